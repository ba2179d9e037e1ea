//! The per-thread outgoing journal (`thread_events`, SPEC §10) and the wake-up protocol.
//!
//! Every change a client may observe appends one journal row IN THE SAME TRANSACTION as the
//! change (almost always inside a step function, `agentloop_journal`), and the transaction ends
//! with one `pg_notify` on `agentloop_threads` whose payload lists `<thread_id>:<sequence>` for
//! each thread it touched, comma-separated (ids only; payloads stay below PostgreSQL's 8000-byte
//! limit). Scheduler wake-ups go to `agentloop_runs`: `queued:<run>`, `cancel:<run>`,
//! `approval:<run>`, comma-separated. A notification is a wake-up hint: readers always read the
//! journal itself, so a lost notification delays but never loses an event.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::Serialize;
use uuid::Uuid;

use crate::db::schema::thread_events;

/// NOTIFY channel for thread journal appends; payload `<thread_id>:<sequence>[,...]`.
pub const THREADS_CHANNEL: &str = "agentloop_threads";
/// NOTIFY channel for the scheduler; payload `queued:<run_id>`, `cancel:<run_id>` or
/// `approval:<run_id>`, several comma-separated.
pub const RUNS_CHANNEL: &str = "agentloop_runs";

/// Journal event kinds (the SSE `event:` names).
pub mod kind {
    /// The thread row changed (title, counts, context tokens).
    pub const THREAD: &str = "thread";
    /// The thread was deleted; payload `{threadId}`. Clients should close the view.
    pub const THREAD_DELETED: &str = "thread_deleted";
    /// A canonical message was appended; payload = the message.
    pub const MESSAGE: &str = "message";
    /// Canonical messages were deactivated (branch operations); payload `{sequences}`.
    pub const MESSAGES_DEACTIVATED: &str = "messages_deactivated";
    /// A run changed status or progress; payload = the run.
    pub const RUN: &str = "run";
    /// Streaming progress of the partial answer; payload `{runId, offset, delta}` where `offset`
    /// is the character length of the partial text before `delta`; `offset: 0` restarts it.
    pub const STREAMING: &str = "streaming";
    /// Compaction progress of a run: `{runId, pass, part, of, label}` before each summarisation
    /// call, then `{runId, done: true, passes, calls, inputTokens, summaryTokens,
    /// snapshotVersion}`.
    pub const COMPACTION: &str = "compaction";
}

/// One journal row.
#[derive(Debug, Clone, Queryable, Selectable, Serialize)]
#[diesel(table_name = thread_events)]
#[serde(rename_all = "camelCase")]
pub struct ThreadEvent {
    pub thread_id: Uuid,
    pub sequence: i64,
    pub kind: String,
    pub payload: serde_json::Value,
    pub created_at: DateTime<Utc>,
}

/// Reads at most `limit` events of `thread_id` with `sequence > after`, in order.
pub async fn read_after(
    conn: &mut AsyncPgConnection,
    thread_id: Uuid,
    after: i64,
    limit: i64,
) -> QueryResult<Vec<ThreadEvent>> {
    thread_events::table
        .filter(thread_events::thread_id.eq(thread_id))
        .filter(thread_events::sequence.gt(after))
        .order(thread_events::sequence.asc())
        .limit(limit)
        .select(ThreadEvent::as_select())
        .load(conn)
        .await
}

/// The oldest retained sequence of `thread_id`'s journal (`None` when empty). A reader whose
/// cursor is below `oldest - 1` missed pruned events and must reset.
pub async fn oldest_retained(conn: &mut AsyncPgConnection, thread_id: Uuid) -> QueryResult<Option<i64>> {
    thread_events::table
        .filter(thread_events::thread_id.eq(thread_id))
        .select(diesel::dsl::min(thread_events::sequence))
        .get_result(conn)
        .await
}
