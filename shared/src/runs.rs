//! Runs: one agent run of a thread (SPEC §3-§4).

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::db::schema::{run_steps, runs};

/// Run statuses (SPEC §4).
pub mod status {
    /// Behind the thread's FIFO head (multitask policy `enqueue`).
    pub const PENDING: &str = "pending";
    pub const QUEUED: &str = "queued";
    pub const RUNNING: &str = "running";
    pub const WAITING_APPROVAL: &str = "waiting_approval";
    /// A tool call waits for the user's sign-in at an MCP server ([`crate::mcp_auth`]).
    pub const WAITING_AUTHORIZATION: &str = "waiting_authorization";
    pub const BLOCKED: &str = "blocked";
    pub const COMPLETED: &str = "completed";
    pub const FAILED: &str = "failed";
    pub const CANCELLED: &str = "cancelled";
    /// Statuses covered by the one-active-run-per-thread unique index.
    pub const ACTIVE: [&str; 5] = [QUEUED, RUNNING, WAITING_APPROVAL, WAITING_AUTHORIZATION, BLOCKED];
    /// Terminal statuses.
    pub const TERMINAL: [&str; 3] = [COMPLETED, FAILED, CANCELLED];
}

/// Default run budget in slices (SPEC §12).
pub const DEFAULT_MAX_STEPS: i32 = 250;

/// A run row. Its JSON (camelCase, plus `error: {code, message}` when it has an error) is the
/// one `agentloop_run_json` builds in the database; step results decode back into this type.
#[derive(Debug, Clone, Queryable, QueryableByName, Selectable, Serialize, Deserialize)]
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
    /// Consecutive attempts that ended by a fault (lease expiry, transient hand-back) without
    /// committing progress; a run above the worker's bound fails `abandoned`.
    pub faults: i32,
    /// W3C `traceparent` of the request that created the run (when the api had a trace
    /// context): the remote parent of the worker's slice spans (`crate::telemetry`).
    /// Not in `schema.rs`: a 33rd column needs diesel's `64-column-tables` feature (a much
    /// slower build), so it is selected by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[diesel(
        sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>,
        select_expression = diesel::dsl::sql::<diesel::sql_types::Nullable<diesel::sql_types::Text>>("runs.traceparent"),
        select_expression_type = diesel::expression::SqlLiteral<diesel::sql_types::Nullable<diesel::sql_types::Text>>
    )]
    pub traceparent: Option<String>,
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

/// The run `id` if its thread is owned by `principal` (and is neither deleted nor hidden:
/// [`crate::threads::not_hidden`]).
pub async fn get_owned(conn: &mut AsyncPgConnection, id: Uuid, principal: Uuid) -> QueryResult<Option<Run>> {
    use crate::db::schema::threads;
    runs::table
        .inner_join(threads::table)
        .filter(runs::id.eq(id))
        .filter(threads::owner_id.eq(principal))
        .filter(threads::deleted_at.is_null())
        .filter(crate::threads::not_hidden())
        .select(Run::as_select())
        .first(conn)
        .await
        .optional()
}

/// Loads a run by id.
pub async fn get(conn: &mut AsyncPgConnection, id: Uuid) -> QueryResult<Run> {
    runs::table.find(id).select(Run::as_select()).first(conn).await
}

/// The thread's active run (queued, running, waiting_approval, waiting_authorization or
/// blocked), if any.
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

