//! Tool approvals (SPEC §3 `tool_approvals`, §4 `running -> waiting_approval -> queued`, §6
//! step 5; seed 000: "Interactive tool approval changes the run to waiting_approval. Continuing
//! an approved batch requeues that same run instead of inventing a new user message.").
//!
//! Protocol:
//! - The worker records one row per `ask` call of an assistant message (the batch) with the
//!   proposed arguments, the tool's schema and a deadline, in the fenced transaction that parks
//!   the run in `waiting_approval` and releases its lease ([`insert_batch`]). The batch's other
//!   calls have already run.
//! - Every decision ([`decide`], the expiry sweep [`expire_due`], [`cancel_pending`]) first locks
//!   the run row, then changes an approval only `WHERE status = 'pending'` (compare-and-set): two
//!   clients approving at once get one success and one `AlreadyDecided`.
//! - The decision that leaves no pending call in the batch ends the wait ([`finish_batch`]): the
//!   results of declined calls ("declined by the user") are appended and the SAME run goes back
//!   to `queued` with `pg_notify('agentloop_runs', 'queued:<id>')`, all in that transaction. The
//!   approved calls run at the start of the run's next slice (the worker answers the unanswered
//!   calls of the run's last tool-call message before calling the model).

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Nullable};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::db::schema::{runs, threads, tool_approvals};
use crate::messages::{self, NewMessage, Provenance, role};
use crate::runs::{Run, status as run_status};
use crate::events;

/// Approval statuses.
pub mod status {
    pub const PENDING: &str = "pending";
    pub const APPROVED: &str = "approved";
    pub const REJECTED: &str = "rejected";
    /// Not decided before its deadline: rejected automatically with reason `expired`.
    pub const EXPIRED: &str = "expired";
    /// The run was cancelled (or its thread deleted) while the call was pending.
    pub const CANCELLED: &str = "cancelled";
}

/// Journal event kind of an approval change; payload = the approval.
pub const EVENT_KIND: &str = "approval";

/// Default decision deadline (SPEC: 24 h).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// An approval row.
#[derive(Debug, Clone, Queryable, Selectable, Serialize)]
#[diesel(table_name = tool_approvals)]
#[serde(rename_all = "camelCase")]
pub struct Approval {
    pub id: Uuid,
    pub run_id: Uuid,
    pub thread_id: Uuid,
    pub message_sequence: i64,
    pub tool_call_id: String,
    pub tool_name: String,
    /// The model's proposed arguments.
    pub arguments: Value,
    /// The tool's JSON schema (edited arguments are validated against it).
    pub parameters: Value,
    pub status: String,
    /// What the tool runs with once approved (the proposal or the user's edit).
    pub approved_arguments: Option<Value>,
    /// The user changed the arguments before approving.
    pub arguments_edited: bool,
    pub reason: Option<String>,
    #[serde(skip)]
    pub decided_by: Option<Uuid>,
    pub deadline_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub decided_at: Option<DateTime<Utc>>,
}

/// A call that needs approval.
#[derive(Debug, Clone)]
pub struct NewApproval {
    pub tool_call_id: String,
    pub tool_name: String,
    /// Validated argument object.
    pub arguments: Value,
    /// The tool's JSON schema.
    pub parameters: Value,
}

/// Text of the result a declined call gets (what the model reads).
pub fn declined_result(reason: Option<&str>) -> String {
    match reason.map(str::trim).filter(|r| !r.is_empty()) {
        Some(reason) => format!("Tool call declined by the user. Reason: {reason}"),
        None => "Tool call declined by the user.".to_owned(),
    }
}

/// Inserts the batch's approval rows (deadline `now() + timeout`, database clock) and journals
/// one `approval` event per row. Call in the worker's fenced transaction that parks the run.
/// A row that already exists for `(run, tool_call_id)` is kept.
pub async fn insert_batch(
    conn: &mut AsyncPgConnection,
    run_id: Uuid,
    thread_id: Uuid,
    message_sequence: i64,
    calls: &[NewApproval],
    timeout: Duration,
) -> QueryResult<Vec<Approval>> {
    let deadline = diesel::dsl::sql::<diesel::sql_types::Timestamptz>(&format!(
        "now() + make_interval(secs => {}::bigint / 1000.0)",
        timeout.as_millis().min(i64::MAX as u128) as i64
    ));
    let mut inserted = Vec::with_capacity(calls.len());
    for call in calls {
        let row: Option<Approval> = diesel::insert_into(tool_approvals::table)
            .values((
                tool_approvals::id.eq(Uuid::new_v4()),
                tool_approvals::run_id.eq(run_id),
                tool_approvals::thread_id.eq(thread_id),
                tool_approvals::message_sequence.eq(message_sequence),
                tool_approvals::tool_call_id.eq(&call.tool_call_id),
                tool_approvals::tool_name.eq(&call.tool_name),
                tool_approvals::arguments.eq(&call.arguments),
                tool_approvals::parameters.eq(&call.parameters),
                tool_approvals::deadline_at.eq(deadline.clone()),
            ))
            .on_conflict((tool_approvals::run_id, tool_approvals::tool_call_id))
            .do_nothing()
            .returning(Approval::as_returning())
            .get_result(conn)
            .await
            .optional()?;
        if let Some(row) = row {
            journal(conn, &row).await?;
            inserted.push(row);
        }
    }
    Ok(inserted)
}

async fn journal(conn: &mut AsyncPgConnection, approval: &Approval) -> QueryResult<i64> {
    events::append(conn, approval.thread_id, EVENT_KIND, &serde_json::to_value(approval).unwrap_or_default()).await
}

/// Approvals of `run_id`, oldest first.
pub async fn for_run(conn: &mut AsyncPgConnection, run_id: Uuid) -> QueryResult<Vec<Approval>> {
    tool_approvals::table
        .filter(tool_approvals::run_id.eq(run_id))
        .order(tool_approvals::created_at.asc())
        .select(Approval::as_select())
        .load(conn)
        .await
}

/// At most `limit` approvals of `thread_id`, newest first (only pending ones with
/// `only_pending`). The caller checks the thread's owner.
pub async fn for_thread(conn: &mut AsyncPgConnection, thread_id: Uuid, only_pending: bool, limit: i64) -> QueryResult<Vec<Approval>> {
    let mut query = tool_approvals::table
        .filter(tool_approvals::thread_id.eq(thread_id))
        .order((tool_approvals::created_at.desc(), tool_approvals::tool_call_id.asc()))
        .limit(limit)
        .select(Approval::as_select())
        .into_boxed();
    if only_pending {
        query = query.filter(tool_approvals::status.eq(status::PENDING));
    }
    query.load(conn).await
}

/// The approval `id` if its thread belongs to `principal` (and is not deleted).
pub async fn get_owned(conn: &mut AsyncPgConnection, id: Uuid, principal: Uuid) -> QueryResult<Option<Approval>> {
    tool_approvals::table
        .inner_join(threads::table.on(threads::id.eq(tool_approvals::thread_id)))
        .filter(tool_approvals::id.eq(id))
        .filter(threads::owner_id.eq(principal))
        .filter(threads::deleted_at.is_null())
        .select(Approval::as_select())
        .first(conn)
        .await
        .optional()
}

/// A human decision.
#[derive(Debug, Clone)]
pub enum Decision {
    /// Run the call; `arguments` (already validated against the approval's schema) replace the
    /// proposal when given.
    Approve { arguments: Option<Value> },
    /// Do not run it; the model reads [`declined_result`] with `reason`.
    Reject { reason: Option<String> },
}

/// Why a decision was refused.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    #[error("approval not found")]
    NotFound,
    /// Someone (or the deadline, or a cancellation) decided first.
    #[error("the approval is already {}", .0.status)]
    AlreadyDecided(Box<Approval>),
    #[error(transparent)]
    Query(#[from] diesel::result::Error),
}

/// Records `decision` on approval `id` by `principal` as a compare-and-set, and finishes the
/// batch when it was the last pending call (see [`finish_batch`]). Must run in the caller's
/// transaction. Returns the approval and the run as they are after the call.
pub async fn decide(
    conn: &mut AsyncPgConnection,
    id: Uuid,
    principal: Uuid,
    decision: Decision,
) -> Result<(Approval, Run), DecideError> {
    let current: Approval =
        tool_approvals::table.find(id).select(Approval::as_select()).first(conn).await.optional()?.ok_or(DecideError::NotFound)?;
    // Lock order everywhere: the run row, then its approvals.
    let run: Run = runs::table.find(current.run_id).select(Run::as_select()).for_update().first(conn).await?;
    let target = diesel::update(tool_approvals::table.find(id)).filter(tool_approvals::status.eq(status::PENDING));
    let updated: Option<Approval> = match decision {
        Decision::Approve { arguments } => {
            let edited = arguments.as_ref().is_some_and(|a| *a != current.arguments);
            let run_with = arguments.unwrap_or_else(|| current.arguments.clone());
            target
                .set((
                    tool_approvals::status.eq(status::APPROVED),
                    tool_approvals::approved_arguments.eq(Some(run_with)),
                    tool_approvals::arguments_edited.eq(edited),
                    tool_approvals::decided_by.eq(Some(principal)),
                    tool_approvals::decided_at.eq(diesel::dsl::now),
                ))
                .returning(Approval::as_returning())
                .get_result(conn)
                .await
                .optional()?
        }
        Decision::Reject { reason } => target
            .set((
                tool_approvals::status.eq(status::REJECTED),
                tool_approvals::reason.eq(reason),
                tool_approvals::decided_by.eq(Some(principal)),
                tool_approvals::decided_at.eq(diesel::dsl::now),
            ))
            .returning(Approval::as_returning())
            .get_result(conn)
            .await
            .optional()?,
    };
    let Some(approval) = updated else {
        let now: Approval = tool_approvals::table.find(id).select(Approval::as_select()).first(conn).await?;
        return Err(DecideError::AlreadyDecided(Box::new(now)));
    };
    journal(conn, &approval).await?;
    let run = finish_batch_if_decided(conn, run).await?;
    Ok((approval, run))
}

/// When `run` (locked by the caller) waits for approval and none of its approvals is pending
/// any more, finishes the batch; otherwise returns it unchanged.
async fn finish_batch_if_decided(conn: &mut AsyncPgConnection, run: Run) -> QueryResult<Run> {
    if run.status != run_status::WAITING_APPROVAL {
        return Ok(run);
    }
    let pending: i64 = tool_approvals::table
        .filter(tool_approvals::run_id.eq(run.id))
        .filter(tool_approvals::status.eq(status::PENDING))
        .count()
        .get_result(conn)
        .await?;
    if pending > 0 { Ok(run) } else { finish_batch(conn, &run).await }
}

/// Ends the wait of `run` (locked, `waiting_approval`, every approval decided): appends the
/// declined results of rejected/expired calls that have none yet (in call order, with the
/// assistant message's provenance), puts the SAME run back to `queued`, journals it and
/// notifies the scheduler — all in the caller's transaction.
pub async fn finish_batch(conn: &mut AsyncPgConnection, run: &Run) -> QueryResult<Run> {
    if let Some((call_message, answered)) = messages::last_tool_call_group(conn, run.thread_id, run.id).await? {
        let decided: Vec<Approval> = for_run(conn, run.id).await?;
        let mut results = Vec::new();
        for call in messages::tool_calls_of(call_message.tool_calls.as_ref()) {
            if answered.contains(&call.id) {
                continue;
            }
            let Some(approval) = decided.iter().find(|a| a.tool_call_id == call.id) else { continue };
            if approval.status == status::REJECTED || approval.status == status::EXPIRED {
                let mut result = NewMessage::text(role::TOOL, declined_result(approval.reason.as_deref()));
                result.tool_call_id = Some(call.id.clone());
                results.push(result);
            }
        }
        if !results.is_empty() {
            let provenance = Provenance { run_id: Some(run.id), step_id: call_message.step_id };
            let identities = vec![None; results.len()];
            messages::append(conn, run.thread_id, provenance, &results, &identities).await?;
        }
    }
    let run: Run = diesel::update(runs::table.find(run.id))
        .set((
            runs::status.eq(run_status::QUEUED),
            runs::queued_at.eq(diesel::dsl::now),
            runs::updated_at.eq(diesel::dsl::now),
        ))
        .returning(Run::as_returning())
        .get_result(conn)
        .await?;
    crate::runs::journal(conn, &run).await?;
    events::notify_runs(conn, "queued", run.id).await?;
    Ok(run)
}

/// Marks every pending approval of `run_id` `cancelled` (run cancelled or thread deleted).
/// Call in the cancelling transaction (the run row locked). Returns how many changed.
pub async fn cancel_pending(conn: &mut AsyncPgConnection, run_id: Uuid) -> QueryResult<usize> {
    let cancelled: Vec<Approval> = diesel::update(tool_approvals::table)
        .filter(tool_approvals::run_id.eq(run_id))
        .filter(tool_approvals::status.eq(status::PENDING))
        .set((tool_approvals::status.eq(status::CANCELLED), tool_approvals::decided_at.eq(diesel::dsl::now)))
        .returning(Approval::as_returning())
        .get_results(conn)
        .await?;
    for approval in &cancelled {
        journal(conn, approval).await?;
    }
    Ok(cancelled.len())
}

/// The expiry sweep (run by workers in their claim pass): rejects, with reason `expired`, the
/// pending approvals whose deadline passed, for at most `max_runs` runs, one transaction per run
/// (run row locked with `SKIP LOCKED`, so concurrent sweepers and deciders never wait on each
/// other), finishing each batch left without a pending call. Cheap when nothing is due: one
/// probe of the partial index `tool_approvals_pending_deadline`. Returns the approvals expired.
pub async fn expire_due(conn: &mut AsyncPgConnection, max_runs: i64) -> QueryResult<usize> {
    use diesel_async::AsyncConnection;
    let due: Vec<Uuid> = tool_approvals::table
        .filter(tool_approvals::status.eq(status::PENDING))
        .filter(tool_approvals::deadline_at.lt(diesel::dsl::now))
        .select(tool_approvals::run_id)
        .distinct()
        .limit(max_runs)
        .load(conn)
        .await?;
    let mut expired = 0;
    for run_id in due {
        expired += conn
            .transaction(async |conn| {
                let Some(run) = runs::table
                    .find(run_id)
                    .select(Run::as_select())
                    .for_update()
                    .skip_locked()
                    .first::<Run>(conn)
                    .await
                    .optional()?
                else {
                    return Ok::<_, diesel::result::Error>(0);
                };
                let rows: Vec<Approval> = diesel::update(tool_approvals::table)
                    .filter(tool_approvals::run_id.eq(run_id))
                    .filter(tool_approvals::status.eq(status::PENDING))
                    .filter(tool_approvals::deadline_at.lt(diesel::dsl::now))
                    .set((
                        tool_approvals::status.eq(status::EXPIRED),
                        tool_approvals::reason.eq(Some("expired")),
                        tool_approvals::decided_at.eq(diesel::dsl::now),
                    ))
                    .returning(Approval::as_returning())
                    .get_results(conn)
                    .await?;
                for approval in &rows {
                    journal(conn, approval).await?;
                }
                if !rows.is_empty() {
                    finish_batch_if_decided(conn, run).await?;
                }
                Ok(rows.len())
            })
            .await?;
    }
    Ok(expired)
}

/// Milliseconds until the earliest pending deadline (negative when overdue), or `None`: the
/// worker's expiry timer.
pub async fn next_deadline_ms(conn: &mut AsyncPgConnection) -> QueryResult<Option<i64>> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Nullable<BigInt>)]
        ms: Option<i64>,
    }
    let row: Row = diesel::sql_query(
        "SELECT (extract(epoch from (min(deadline_at) - now())) * 1000)::bigint AS ms
         FROM tool_approvals WHERE status = 'pending'",
    )
    .get_result(conn)
    .await?;
    Ok(row.ms)
}
