//! The operations ledger: external effects of non-idempotent tool calls (SPEC §7; seed 002
//! "External operations and uncertainty").
//!
//! A call's row is keyed by the worker's stable caller-supplied key
//! `run:{run_id}:call:{tool_call_id}` ([`key`]), never by attempt, and moves
//! `prepared` (before) -> `dispatched` (committed immediately before the call leaves the process)
//! -> `completed` | `failed` (committed with the call's result message, in one fenced
//! transaction). If recovery, cancellation, shutdown or lease loss leaves a row `dispatched`
//! with no outcome, nobody can know whether the effect happened: the row becomes `uncertain`
//! and the run `blocked` ([`mark_uncertain`]); nothing retries it automatically. An explicit
//! [`resolve`] marks it `completed` (optionally with a result), `failed`, or safe to `retry`,
//! conditioned on the run still being blocked, and the run continues. At most [`MAX_PER_RUN`]
//! rows are kept per run. Idempotent tools skip all of this and are simply retried.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::db::schema::{operations, runs};
use crate::messages::{self, NewMessage, Provenance, role};
use crate::runs::{Run, status as run_status};
use crate::events;

/// Operation statuses.
pub mod status {
    pub const PREPARED: &str = "prepared";
    pub const DISPATCHED: &str = "dispatched";
    pub const COMPLETED: &str = "completed";
    pub const FAILED: &str = "failed";
    pub const UNCERTAIN: &str = "uncertain";
}

/// Rows kept per run (SPEC §12); the oldest finished rows go first.
pub const MAX_PER_RUN: i64 = 64;

/// Error code on a run blocked by uncertain operations (`run.error.code`).
pub const BLOCKED_CODE: &str = "operation_uncertain";

/// The stable key of a call: `run:{run_id}:call:{tool_call_id}` (also the tool's idempotency key).
pub fn key(run_id: Uuid, tool_call_id: &str) -> String {
    format!("run:{run_id}:call:{tool_call_id}")
}

/// An operation row.
#[derive(Debug, Clone, Queryable, Selectable, Serialize)]
#[diesel(table_name = operations)]
#[serde(rename_all = "camelCase")]
pub struct Operation {
    pub key: String,
    pub run_id: Uuid,
    pub thread_id: Uuid,
    pub tool_call_id: String,
    pub tool_name: String,
    pub arguments: Value,
    pub status: String,
    pub result: Option<String>,
    pub resolution: Option<String>,
    #[serde(skip)]
    pub resolved_by: Option<Uuid>,
    pub dispatches: i32,
    pub lease_epoch: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub dispatched_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub resolved_at: Option<DateTime<Utc>>,
}

/// The row of `key`.
pub async fn get(conn: &mut AsyncPgConnection, key: &str) -> QueryResult<Option<Operation>> {
    operations::table.find(key).select(Operation::as_select()).first(conn).await.optional()
}

/// Rows of `run_id`, oldest first.
pub async fn for_run(conn: &mut AsyncPgConnection, run_id: Uuid) -> QueryResult<Vec<Operation>> {
    operations::table
        .filter(operations::run_id.eq(run_id))
        .order((operations::created_at.asc(), operations::key.asc()))
        .select(Operation::as_select())
        .load(conn)
        .await
}

/// Records `prepared` for a call about to run (a row still `prepared` — never dispatched, or
/// released by a `retry` resolve — is taken over by this attempt) and trims the run's ledger
/// to [`MAX_PER_RUN`] rows. Fenced by the caller (the run row is locked, so the read-then-write
/// is race-free). Returns the row; `None` when the key exists in
/// another state (the caller must not dispatch).
#[allow(clippy::too_many_arguments)]
pub async fn prepare(
    conn: &mut AsyncPgConnection,
    run_id: Uuid,
    thread_id: Uuid,
    lease_epoch: i64,
    tool_call_id: &str,
    tool_name: &str,
    arguments: &Value,
) -> QueryResult<Option<Operation>> {
    let key = key(run_id, tool_call_id);
    let row: Option<Operation> = match get(conn, &key).await? {
        None => Some(
            diesel::insert_into(operations::table)
                .values((
                    operations::key.eq(&key),
                    operations::run_id.eq(run_id),
                    operations::thread_id.eq(thread_id),
                    operations::tool_call_id.eq(tool_call_id),
                    operations::tool_name.eq(tool_name),
                    operations::arguments.eq(arguments),
                    operations::status.eq(status::PREPARED),
                    operations::lease_epoch.eq(lease_epoch),
                ))
                .returning(Operation::as_returning())
                .get_result(conn)
                .await?,
        ),
        Some(existing) if existing.status == status::PREPARED => Some(
            diesel::update(operations::table.find(&key))
                .set((
                    operations::lease_epoch.eq(lease_epoch),
                    operations::arguments.eq(arguments),
                    operations::updated_at.eq(diesel::dsl::now),
                ))
                .returning(Operation::as_returning())
                .get_result(conn)
                .await?,
        ),
        Some(_) => None,
    };
    diesel::sql_query(
        "DELETE FROM operations WHERE key IN (
             SELECT key FROM operations WHERE run_id = $1 AND status IN ('completed', 'failed')
             ORDER BY created_at ASC
             LIMIT GREATEST((SELECT count(*) FROM operations WHERE run_id = $1) - $2, 0))",
    )
    .bind::<diesel::sql_types::Uuid, _>(run_id)
    .bind::<diesel::sql_types::BigInt, _>(MAX_PER_RUN)
    .execute(conn)
    .await?;
    Ok(row)
}

/// `prepared -> dispatched` (committed just before the call leaves the process). Fenced by the
/// caller. Returns whether the row moved.
pub async fn dispatch(conn: &mut AsyncPgConnection, key: &str, lease_epoch: i64) -> QueryResult<bool> {
    let n = diesel::update(operations::table.find(key))
        .filter(operations::status.eq(status::PREPARED))
        .set((
            operations::status.eq(status::DISPATCHED),
            operations::lease_epoch.eq(lease_epoch),
            operations::dispatches.eq(operations::dispatches + 1),
            operations::dispatched_at.eq(diesel::dsl::now),
            operations::updated_at.eq(diesel::dsl::now),
        ))
        .execute(conn)
        .await?;
    Ok(n == 1)
}

/// `dispatched -> completed | failed` with the (bounded) result text. Fenced by the caller, in
/// the transaction that appends the call's result message.
pub async fn finish(conn: &mut AsyncPgConnection, key: &str, ok: bool, result: &str) -> QueryResult<bool> {
    let n = diesel::update(operations::table.find(key))
        .filter(operations::status.eq(status::DISPATCHED))
        .set((
            operations::status.eq(if ok { status::COMPLETED } else { status::FAILED }),
            operations::result.eq(Some(result)),
            operations::finished_at.eq(diesel::dsl::now),
            operations::updated_at.eq(diesel::dsl::now),
        ))
        .execute(conn)
        .await?;
    Ok(n == 1)
}

/// Turns every `dispatched` row of `run_id` into `uncertain` (an attempt ended, or was found
/// dead, between dispatch and outcome) and returns all uncertain rows of the run (new and old).
/// Call in the transaction that ends/starts the slice.
pub async fn mark_uncertain(conn: &mut AsyncPgConnection, run_id: Uuid) -> QueryResult<Vec<Operation>> {
    diesel::update(operations::table)
        .filter(operations::run_id.eq(run_id))
        .filter(operations::status.eq(status::DISPATCHED))
        .set((operations::status.eq(status::UNCERTAIN), operations::updated_at.eq(diesel::dsl::now)))
        .execute(conn)
        .await?;
    operations::table
        .filter(operations::run_id.eq(run_id))
        .filter(operations::status.eq(status::UNCERTAIN))
        .order(operations::created_at.asc())
        .select(Operation::as_select())
        .load(conn)
        .await
}

/// The `run.error.message` of a run blocked on `uncertain` rows.
pub fn blocker_message(uncertain: &[Operation]) -> String {
    let calls: Vec<String> = uncertain.iter().map(|o| format!("{} ({})", o.tool_name, o.key)).collect();
    format!(
        "the outcome of {} is unknown (the worker stopped after dispatching it); resolve it as completed, failed or retry",
        calls.join(", ")
    )
}

/// The result message a finished operation gives its call.
pub fn result_message(op: &Operation) -> NewMessage {
    let text = match (op.status.as_str(), op.result.as_deref()) {
        (_, Some(text)) => text.to_owned(),
        (status::COMPLETED, None) => "completed".to_owned(),
        _ => "failed".to_owned(),
    };
    let mut message = NewMessage::text(role::TOOL, text);
    message.tool_call_id = Some(op.tool_call_id.clone());
    message
}

/// An explicit resolution of an uncertain operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The effect happened; `result` (or a note) becomes the call's result.
    Completed { result: Option<String> },
    /// It did not happen; the call's result says so.
    Failed { reason: Option<String> },
    /// It is safe to run again: the next slice dispatches it again under the same key.
    Retry,
}

/// Why a resolve was refused.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("operation not found")]
    NotFound,
    /// The run is not `blocked` (any more), or the operation is not `uncertain`, or the caller's
    /// expected run state does not match: the resolve is stale.
    #[error("{0}")]
    Stale(String),
    #[error(transparent)]
    Query(#[from] diesel::result::Error),
}

/// Resolves uncertain operation `key` of `run_id` (must run in the caller's transaction). The run
/// row is locked and must be `blocked` (and, when `expected_updated_at` is given, unchanged
/// since the caller read it); the operation must be `uncertain`. `completed`/`failed` append the
/// call's result (unless it has one); `retry` puts the row back to `prepared`. When no uncertain
/// row remains, the SAME run is requeued (error cleared, journal, `pg_notify`). Returns the
/// operation and the run after the call.
pub async fn resolve(
    conn: &mut AsyncPgConnection,
    run_id: Uuid,
    key: &str,
    principal: Uuid,
    outcome: Outcome,
    expected_updated_at: Option<DateTime<Utc>>,
) -> Result<(Operation, Run), ResolveError> {
    let run: Run = runs::table.find(run_id).select(Run::as_select()).for_update().first(conn).await?;
    let op = get(conn, key).await?.filter(|o| o.run_id == run_id).ok_or(ResolveError::NotFound)?;
    if run.status != run_status::BLOCKED {
        return Err(ResolveError::Stale(format!("the run is {}, not blocked", run.status)));
    }
    if expected_updated_at.is_some_and(|t| (t - run.updated_at).num_milliseconds().abs() > 0) {
        return Err(ResolveError::Stale("the run changed since it was read".into()));
    }
    if op.status != status::UNCERTAIN {
        return Err(ResolveError::Stale(format!("the operation is {}, not uncertain", op.status)));
    }
    let (new_status, result, resolution) = match &outcome {
        Outcome::Completed { result } => (
            status::COMPLETED,
            Some(result.clone().unwrap_or_else(|| "completed (outcome confirmed by the user after an interruption)".into())),
            "completed",
        ),
        Outcome::Failed { reason } => (
            status::FAILED,
            Some(match reason {
                Some(r) => format!("failed: {r}"),
                None => "failed (the user confirmed the call did not take effect after an interruption)".into(),
            }),
            "failed",
        ),
        Outcome::Retry => (status::PREPARED, None, "retry"),
    };
    let op: Operation = diesel::update(operations::table.find(key))
        .set((
            operations::status.eq(new_status),
            operations::result.eq(result),
            operations::resolution.eq(Some(resolution)),
            operations::resolved_by.eq(Some(principal)),
            operations::resolved_at.eq(diesel::dsl::now),
            operations::finished_at.eq(diesel::dsl::now),
            operations::updated_at.eq(diesel::dsl::now),
        ))
        .returning(Operation::as_returning())
        .get_result(conn)
        .await?;
    if outcome != Outcome::Retry
        && let Some((call_message, answered)) = messages::last_tool_call_group(conn, run.thread_id, run.id).await?
        && !answered.contains(&op.tool_call_id)
        && messages::tool_calls_of(call_message.tool_calls.as_ref()).iter().any(|c| c.id == op.tool_call_id)
    {
        let provenance = Provenance { run_id: Some(run.id), step_id: call_message.step_id };
        messages::append(conn, run.thread_id, provenance, &[result_message(&op)], &[None]).await?;
    }
    let still: i64 = operations::table
        .filter(operations::run_id.eq(run_id))
        .filter(operations::status.eq(status::UNCERTAIN))
        .count()
        .get_result(conn)
        .await?;
    let run: Run = if still == 0 {
        let run: Run = diesel::update(runs::table.find(run_id))
            .set((
                runs::status.eq(run_status::QUEUED),
                runs::error_code.eq(None::<String>),
                runs::error_message.eq(None::<String>),
                runs::queued_at.eq(diesel::dsl::now),
                runs::updated_at.eq(diesel::dsl::now),
            ))
            .returning(Run::as_returning())
            .get_result(conn)
            .await?;
        crate::runs::journal(conn, &run).await?;
        events::notify_runs(conn, "queued", run.id).await?;
        run
    } else {
        let remaining = mark_uncertain(conn, run_id).await?;
        let run: Run = diesel::update(runs::table.find(run_id))
            .set((runs::error_message.eq(Some(blocker_message(&remaining))), runs::updated_at.eq(diesel::dsl::now)))
            .returning(Run::as_returning())
            .get_result(conn)
            .await?;
        crate::runs::journal(conn, &run).await?;
        run
    };
    Ok((op, run))
}
