//! The per-thread outgoing journal (`thread_events`, SPEC §10) and the wake-up protocol.
//!
//! Every change a client may observe appends one journal row IN THE SAME TRANSACTION as the
//! change, and `pg_notify`s `agentloop_threads` with `<thread_id>:<sequence>` (ids only, ~50
//! bytes, far below PostgreSQL's 8000-byte payload limit). The notification is a wake-up hint:
//! readers always read the journal itself, so a lost notification delays but never loses an
//! event.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Jsonb, Text, Uuid as SqlUuid};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::Serialize;
use uuid::Uuid;

use crate::db::schema::thread_events;

/// NOTIFY channel for thread journal appends; payload `<thread_id>:<sequence>`.
pub const THREADS_CHANNEL: &str = "agentloop_threads";
/// NOTIFY channel for the scheduler; payload `queued:<run_id>` or `cancel:<run_id>`.
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

#[derive(QueryableByName)]
struct Appended {
    #[diesel(sql_type = BigInt)]
    sequence: i64,
}

/// Appends an event to `thread_id`'s journal with the next gap-free sequence and notifies
/// [`THREADS_CHANNEL`] (delivered on commit). Call inside the transaction of the change.
/// Returns the event's sequence. Locks the thread row until the transaction ends.
pub async fn append(
    conn: &mut AsyncPgConnection,
    thread_id: Uuid,
    kind: &str,
    payload: &serde_json::Value,
) -> QueryResult<i64> {
    let row: Appended = diesel::sql_query(
        "WITH t AS (
             UPDATE threads SET last_event_sequence = last_event_sequence + 1
             WHERE id = $1 RETURNING last_event_sequence
         ), ins AS (
             INSERT INTO thread_events (thread_id, sequence, kind, payload)
             SELECT $1, t.last_event_sequence, $2, $3 FROM t
             RETURNING sequence
         )
         SELECT ins.sequence, pg_notify($4, $1::text || ':' || ins.sequence::text) IS NULL AS n FROM ins",
    )
    .bind::<SqlUuid, _>(thread_id)
    .bind::<Text, _>(kind)
    .bind::<Jsonb, _>(crate::text::clean_json(payload).as_ref())
    .bind::<Text, _>(THREADS_CHANNEL)
    .get_result(conn)
    .await?;
    Ok(row.sequence)
}

/// Notifies the scheduler channel (delivered on commit). `what` is `queued` or `cancel`.
pub async fn notify_runs(conn: &mut AsyncPgConnection, what: &str, run_id: Uuid) -> QueryResult<()> {
    diesel::sql_query("SELECT pg_notify($1, $2)")
        .bind::<Text, _>(RUNS_CHANNEL)
        .bind::<Text, _>(format!("{what}:{run_id}"))
        .execute(conn)
        .await?;
    Ok(())
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

/// Deletes journal rows of `thread_id` older than its newest `keep` events. Returns rows deleted.
pub async fn prune_thread(conn: &mut AsyncPgConnection, thread_id: Uuid, keep: i64) -> QueryResult<usize> {
    diesel::sql_query(
        "DELETE FROM thread_events WHERE thread_id = $1
         AND sequence <= (SELECT last_event_sequence FROM threads WHERE id = $1) - $2",
    )
    .bind::<SqlUuid, _>(thread_id)
    .bind::<BigInt, _>(keep)
    .execute(conn)
    .await
}

/// Prunes every thread's journal to its newest `keep` events (SPEC §10: "old rows are pruned, and
/// a resume below the retained range gets a `reset`"). Returns rows deleted.
pub async fn prune_all(conn: &mut AsyncPgConnection, keep: i64) -> QueryResult<usize> {
    diesel::sql_query(
        "DELETE FROM thread_events e USING threads t
         WHERE e.thread_id = t.id AND e.sequence <= t.last_event_sequence - $1",
    )
    .bind::<BigInt, _>(keep)
    .execute(conn)
    .await
}
