//! Runs: one agent run of a thread (SPEC §3-§4).

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::Serialize;
use uuid::Uuid;

use crate::db::schema::{run_steps, runs};
use crate::events;

/// Run statuses (SPEC §4).
pub mod status {
    /// Behind the thread's FIFO head (multitask policy `enqueue`).
    pub const PENDING: &str = "pending";
    pub const QUEUED: &str = "queued";
    pub const RUNNING: &str = "running";
    pub const WAITING_APPROVAL: &str = "waiting_approval";
    pub const BLOCKED: &str = "blocked";
    pub const COMPLETED: &str = "completed";
    pub const FAILED: &str = "failed";
    pub const CANCELLED: &str = "cancelled";
    /// Statuses covered by the one-active-run-per-thread unique index.
    pub const ACTIVE: [&str; 4] = [QUEUED, RUNNING, WAITING_APPROVAL, BLOCKED];
    /// Terminal statuses.
    pub const TERMINAL: [&str; 3] = [COMPLETED, FAILED, CANCELLED];
}

/// Default run budget in slices (SPEC §12).
pub const DEFAULT_MAX_STEPS: i32 = 250;

/// A run row.
#[derive(Debug, Clone, Queryable, QueryableByName, Selectable, Serialize)]
#[diesel(table_name = runs)]
#[serde(rename_all = "camelCase")]
pub struct Run {
    pub id: Uuid,
    #[serde(skip)]
    pub seq: i64,
    pub thread_id: Uuid,
    #[serde(skip)]
    pub principal_id: Uuid,
    pub status: String,
    pub command_id: Option<String>,
    pub model: String,
    pub max_steps: i32,
    pub steps_used: i32,
    pub tool_calls_used: i32,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    pub context_tokens: Option<i32>,
    pub context_limit: Option<i32>,
    pub lease_owner: Option<String>,
    /// Fencing token: incremented by every claim.
    pub lease_epoch: i64,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub attempts: i32,
    pub recoveries: i32,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    pub cancel_requested_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub queued_at: Option<DateTime<Utc>>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub updated_at: DateTime<Utc>,
    /// The user turn of a `pending` run, `{content, tokenEstimate}`, appended to history when
    /// the run is promoted.
    pub input: Option<serde_json::Value>,
    /// `agent` (the tool loop) or `compaction` (manual compaction into this child thread).
    pub kind: String,
    /// For a `compaction` run: the thread being summarised.
    pub source_thread_id: Option<Uuid>,
}

/// Run kinds.
pub mod kind {
    /// The agent tool loop (SPEC §6).
    pub const AGENT: &str = "agent";
    /// Manual compaction into a child thread (SPEC §8).
    pub const COMPACTION: &str = "compaction";
}

impl Run {
    /// Whether the run reached a terminal status.
    pub fn is_terminal(&self) -> bool {
        status::TERMINAL.contains(&self.status.as_str())
    }

    /// The client-facing JSON of the run: its columns plus `error: {code, message}` when failed.
    pub fn to_json(&self) -> serde_json::Value {
        let mut value = serde_json::to_value(self).unwrap_or_default();
        if let (Some(code), Some(obj)) = (&self.error_code, value.as_object_mut()) {
            obj.insert(
                "error".into(),
                serde_json::json!({"code": code, "message": self.error_message.clone().unwrap_or_default()}),
            );
        }
        value
    }
}

/// A step row (one per slice).
#[derive(Debug, Clone, Queryable, Selectable, Serialize)]
#[diesel(table_name = run_steps)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    pub id: i64,
    #[serde(skip)]
    pub run_id: Uuid,
    pub sequence: i32,
    pub idempotency_key: String,
    pub status: String,
    pub attempt: i32,
    pub lease_epoch: i64,
    pub worker_id: String,
    pub model: String,
    pub model_calls: i32,
    pub tool_calls: i32,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    pub context_tokens: Option<i32>,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    pub started_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
}

/// The idempotency key of step `sequence` of `run_id` (SPEC §3).
pub fn step_key(run_id: Uuid, sequence: i32) -> String {
    format!("run:{run_id}:step:{sequence}")
}

/// Fields of a new run.
#[derive(Debug, Clone)]
pub struct NewRun {
    pub thread_id: Uuid,
    pub principal_id: Uuid,
    pub model: String,
    pub max_steps: i32,
    pub command_id: Option<String>,
    /// `queued` (claimable now) or `pending` (behind the thread's FIFO head).
    pub status: &'static str,
    /// For a `pending` run: its user turn, appended when it is promoted.
    pub input: Option<serde_json::Value>,
    /// [`kind::AGENT`] or [`kind::COMPACTION`].
    pub kind: &'static str,
    /// For a compaction run: the thread it summarises.
    pub source_thread_id: Option<Uuid>,
}

/// Inserts a run, journals a `run` event and, when it is `queued`, notifies the scheduler (on
/// commit). A second active run of the thread violates `runs_one_active_per_thread`.
pub async fn insert(conn: &mut AsyncPgConnection, new: NewRun) -> QueryResult<Run> {
    let queued = new.status == status::QUEUED;
    let run: Run = diesel::insert_into(runs::table)
        .values((
            runs::id.eq(Uuid::new_v4()),
            runs::thread_id.eq(new.thread_id),
            runs::principal_id.eq(new.principal_id),
            runs::status.eq(new.status),
            runs::model.eq(new.model),
            runs::max_steps.eq(new.max_steps),
            runs::command_id.eq(new.command_id),
            runs::queued_at.eq(queued.then(Utc::now)),
            runs::input.eq(new.input),
            runs::kind.eq(new.kind),
            runs::source_thread_id.eq(new.source_thread_id),
        ))
        .returning(Run::as_returning())
        .get_result(conn)
        .await?;
    journal(conn, &run).await?;
    if queued {
        events::notify_runs(conn, "queued", run.id).await?;
    }
    Ok(run)
}

/// Journals the run's current state as a `run` event of its thread.
pub async fn journal(conn: &mut AsyncPgConnection, run: &Run) -> QueryResult<i64> {
    events::append(conn, run.thread_id, events::kind::RUN, &run.to_json()).await
}

/// The run `id` if its thread is owned by `principal`.
pub async fn get_owned(conn: &mut AsyncPgConnection, id: Uuid, principal: Uuid) -> QueryResult<Option<Run>> {
    use crate::db::schema::threads;
    runs::table
        .inner_join(threads::table)
        .filter(runs::id.eq(id))
        .filter(threads::owner_id.eq(principal))
        .filter(threads::deleted_at.is_null())
        .select(Run::as_select())
        .first(conn)
        .await
        .optional()
}

/// Loads a run by id.
pub async fn get(conn: &mut AsyncPgConnection, id: Uuid) -> QueryResult<Run> {
    runs::table.find(id).select(Run::as_select()).first(conn).await
}

/// The thread's active run (queued, running, waiting_approval or blocked), if any.
pub async fn active_for_thread(conn: &mut AsyncPgConnection, thread_id: Uuid) -> QueryResult<Option<Run>> {
    runs::table
        .filter(runs::thread_id.eq(thread_id))
        .filter(runs::status.eq_any(status::ACTIVE))
        .select(Run::as_select())
        .first(conn)
        .await
        .optional()
}

/// The thread's most recent run of any status.
pub async fn latest_for_thread(conn: &mut AsyncPgConnection, thread_id: Uuid) -> QueryResult<Option<Run>> {
    runs::table
        .filter(runs::thread_id.eq(thread_id))
        .order(runs::seq.desc())
        .select(Run::as_select())
        .first(conn)
        .await
        .optional()
}

/// Steps of a run in order.
pub async fn steps(conn: &mut AsyncPgConnection, run_id: Uuid) -> QueryResult<Vec<Step>> {
    run_steps::table
        .filter(run_steps::run_id.eq(run_id))
        .order(run_steps::sequence.asc())
        .select(Step::as_select())
        .load(conn)
        .await
}

/// Promotes the thread's oldest `pending` run to `queued` (FIFO, SPEC §4), appends its user
/// turn to history and notifies the scheduler. Call in the transaction that ends the thread's
/// active run. Returns the promoted run.
pub async fn promote_next_pending(conn: &mut AsyncPgConnection, thread_id: Uuid) -> QueryResult<Option<Run>> {
    let next: Option<Uuid> = runs::table
        .filter(runs::thread_id.eq(thread_id))
        .filter(runs::status.eq(status::PENDING))
        .order(runs::seq.asc())
        .select(runs::id)
        .for_update()
        .first(conn)
        .await
        .optional()?;
    let Some(id) = next else { return Ok(None) };
    let run: Run = diesel::update(runs::table.find(id))
        .set((
            runs::status.eq(status::QUEUED),
            runs::queued_at.eq(diesel::dsl::now),
            runs::updated_at.eq(diesel::dsl::now),
        ))
        .returning(Run::as_returning())
        .get_result(conn)
        .await?;
    if let Some(input) = &run.input {
        let message = crate::messages::NewMessage {
            role: crate::messages::role::USER.into(),
            content: input.get("content").cloned().unwrap_or_default(),
            tool_calls: None,
            tool_call_id: None,
            reasoning: None,
            token_estimate: input.get("tokenEstimate").and_then(|t| t.as_i64()).unwrap_or(0) as i32,
        };
        let provenance = crate::messages::Provenance { run_id: Some(run.id), step_id: None };
        crate::messages::append(conn, thread_id, provenance, &[message], &[None]).await?;
    }
    journal(conn, &run).await?;
    events::notify_runs(conn, "queued", run.id).await?;
    Ok(Some(run))
}

/// Requests cancellation of run `id` (SPEC §5 "Cancellation"); idempotent. In the caller's
/// transaction it locks the run and:
/// - `pending`/`queued`/`waiting_approval`/`blocked` (no worker holds it): `cancelled` at once,
///   its pending tool approvals `cancelled`, and the thread's next pending run is promoted when
///   this one was active;
/// - `running`: sets `cancel_requested_at` (kept if already set) and notifies
///   `cancel:<id>`, so the owning worker aborts at once and writes `cancelled` itself;
/// - terminal: nothing.
///
/// Returns the run as it is after the call.
pub async fn request_cancel(conn: &mut AsyncPgConnection, id: Uuid) -> QueryResult<Run> {
    let run: Run = runs::table.find(id).select(Run::as_select()).for_update().first(conn).await?;
    match run.status.as_str() {
        status::PENDING | status::QUEUED | status::WAITING_APPROVAL | status::BLOCKED => {
            let was_active = run.status != status::PENDING;
            let run: Run = diesel::update(runs::table.find(id))
                .set((
                    runs::status.eq(status::CANCELLED),
                    runs::cancel_requested_at.eq(diesel::dsl::now),
                    runs::finished_at.eq(diesel::dsl::now),
                    runs::lease_owner.eq(None::<String>),
                    runs::lease_expires_at.eq(None::<DateTime<Utc>>),
                    runs::updated_at.eq(diesel::dsl::now),
                ))
                .returning(Run::as_returning())
                .get_result(conn)
                .await?;
            crate::approvals::cancel_pending(conn, run.id).await?;
            crate::messages::close_dangling_tool_calls(conn, run.thread_id, run.id).await?;
            journal(conn, &run).await?;
            if was_active {
                promote_next_pending(conn, run.thread_id).await?;
            }
            Ok(run)
        }
        status::RUNNING if run.cancel_requested_at.is_none() => {
            let run: Run = diesel::update(runs::table.find(id))
                .set((runs::cancel_requested_at.eq(diesel::dsl::now), runs::updated_at.eq(diesel::dsl::now)))
                .returning(Run::as_returning())
                .get_result(conn)
                .await?;
            journal(conn, &run).await?;
            events::notify_runs(conn, "cancel", run.id).await?;
            Ok(run)
        }
        _ => Ok(run),
    }
}

/// Locks the thread's active run, if any (`FOR UPDATE`). Lock order everywhere is: active run,
/// then thread, then pending runs — the order a worker's slice takes them (fence, history
/// append, FIFO promotion) — so api commands that touch runs never deadlock with a worker.
pub async fn lock_active(conn: &mut AsyncPgConnection, thread_id: Uuid) -> QueryResult<Option<Run>> {
    runs::table
        .filter(runs::thread_id.eq(thread_id))
        .filter(runs::status.eq_any(status::ACTIVE))
        .select(Run::as_select())
        .for_update()
        .first(conn)
        .await
        .optional()
}
