//! The operations ledger: external effects of non-idempotent tool calls (SPEC §7; seed 002
//! "External operations and uncertainty").
//!
//! A call's row is keyed by the worker's stable caller-supplied key
//! `run:{run_id}:call:{tool_call_id}` ([`key`]; the tool-call id is the one agentloop assigned
//! when it checkpointed the assistant message, unique per run), never by attempt, and moves
//! `dispatched` (committed immediately before the call leaves the process) -> `completed` |
//! `failed` (committed with the call's result message) | `uncertain` (the request may have left
//! without a known outcome: a timeout, a reset, a 5xx after sending, a transport error, or an
//! attempt that ended — crash, cancellation, shutdown, lease loss — between dispatch and
//! outcome). An uncertain row blocks the run; nothing retries it automatically. An explicit
//! resolve (`agentloop_resolve`) marks it `completed` (optionally with a result), `failed`, or
//! back to `prepared` (safe to `retry` under the same key), conditioned on the run still being
//! blocked, and the run continues. At most [`MAX_PER_RUN`] rows are kept per run. Idempotent
//! tools skip all of this and are simply retried. All writes are step functions
//! (`migrations/2026-12-01-000005_durable_core`); this module holds the row type and reads.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::db::schema::operations;
use crate::messages::{NewMessage, role};

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
#[derive(Debug, Clone, Queryable, Selectable, Serialize, Deserialize)]
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

