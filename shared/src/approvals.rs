//! Tool approvals (SPEC §3 `tool_approvals`, §4 `running -> waiting_approval -> queued`, §6
//! step 5; seed 000: "Interactive tool approval changes the run to waiting_approval. Continuing
//! an approved batch requeues that same run instead of inventing a new user message.").
//!
//! Protocol (written by the step functions of `migrations/2026-12-01-000005_durable_core`):
//! - The worker's checkpoint that parks the run in `waiting_approval` (lease released) also
//!   creates one row per `ask` call of the assistant message (the batch) with the proposed
//!   arguments, the tool's schema and a deadline; the batch's other calls have already run.
//! - Every decision (`agentloop_decide`, the expiry sweep `agentloop_expire_approvals`, a
//!   cancellation) locks the thread, then the run, then changes an approval only
//!   `WHERE status = 'pending'` (compare-and-set): two clients approving at once get one success
//!   and one `approval_decided`.
//! - The decision that leaves no pending call in the batch ends the wait: the results of
//!   declined calls ("declined by the user") are appended and the SAME run goes back to
//!   `queued` with a `queued:<id>` wake-up, all in that transaction. The approved calls run at
//!   the start of the run's next slice.
//!
//! This module holds the row type and the reads.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::db::schema::{threads, tool_approvals};

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
#[derive(Debug, Clone, Queryable, Selectable, Serialize, Deserialize)]
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

/// A call that needs approval (created by the checkpoint that parks the run).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NewApproval {
    /// Sequence of the assistant message carrying the call (the batch).
    pub message_sequence: i64,
    pub tool_call_id: String,
    pub tool_name: String,
    /// Validated argument object.
    pub arguments: Value,
    /// The tool's JSON schema.
    pub parameters: Value,
}

/// Text of the result a call gets whose approval expired (the same `agentloop_finish_batch`
/// writes): not a decline by the user.
pub const EXPIRED_RESULT: &str = "Tool call not run: nobody approved it before its approval expired.";

/// Text of the result a declined call gets (what the model reads).
pub fn declined_result(reason: Option<&str>) -> String {
    match reason.map(str::trim).filter(|r| !r.is_empty()) {
        Some(reason) => format!("Tool call declined by the user. Reason: {reason}"),
        None => "Tool call declined by the user.".to_owned(),
    }
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

/// The approval `id` if its thread belongs to `principal` (and is neither deleted nor hidden:
/// [`crate::threads::not_hidden`]).
pub async fn get_owned(conn: &mut AsyncPgConnection, id: Uuid, principal: Uuid) -> QueryResult<Option<Approval>> {
    tool_approvals::table
        .inner_join(threads::table.on(threads::id.eq(tool_approvals::thread_id)))
        .filter(tool_approvals::id.eq(id))
        .filter(threads::owner_id.eq(principal))
        .filter(threads::deleted_at.is_null())
        .filter(crate::threads::not_hidden())
        .select(Approval::as_select())
        .first(conn)
        .await
        .optional()
}

