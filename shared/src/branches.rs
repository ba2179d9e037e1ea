//! Branch operations (SPEC §3; seed 000 "Explicit edit/redo/delete operations deactivate the
//! prior branch and create a new active branch"): rows are never deleted or rewritten; the
//! affected active rows become inactive, snapshots that covered them stop applying, and new
//! active rows are appended with higher sequences.

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use uuid::Uuid;

use crate::db::schema::{messages, threads};
use crate::messages::{Message, role};
use crate::{events, snapshots};

/// Deactivates the active rows with `sequence` in `sequences` (and nothing else), keeps the
/// thread's `message_count` authoritative, supersedes snapshots covering them, and journals
/// `messages_deactivated {sequences}`. Returns the sequences deactivated, ascending.
pub async fn deactivate(conn: &mut AsyncPgConnection, thread_id: Uuid, sequences: &[i64]) -> QueryResult<Vec<i64>> {
    let mut done: Vec<i64> = diesel::update(messages::table)
        .filter(messages::thread_id.eq(thread_id))
        .filter(messages::active)
        .filter(messages::sequence.eq_any(sequences))
        .set(messages::active.eq(false))
        .returning(messages::sequence)
        .get_results(conn)
        .await?;
    done.sort_unstable();
    if let Some(first) = <[i64]>::first(&done) {
        diesel::update(threads::table.find(thread_id))
            .set((
                threads::message_count.eq(threads::message_count - done.len() as i32),
                threads::updated_at.eq(diesel::dsl::now),
            ))
            .execute(conn)
            .await?;
        snapshots::supersede_from(conn, thread_id, *first).await?;
        events::append(conn, thread_id, events::kind::MESSAGES_DEACTIVATED, &serde_json::json!({"sequences": done}))
            .await?;
    }
    Ok(done)
}

/// Active rows of the thread with `sequence >= from` (what an edit or regenerate replaces).
pub async fn active_from(conn: &mut AsyncPgConnection, thread_id: Uuid, from: i64) -> QueryResult<Vec<i64>> {
    messages::table
        .filter(messages::thread_id.eq(thread_id))
        .filter(messages::active)
        .filter(messages::sequence.ge(from))
        .select(messages::sequence)
        .load(conn)
        .await
}

/// The active message at `sequence`, if any.
pub async fn active_at(conn: &mut AsyncPgConnection, thread_id: Uuid, sequence: i64) -> QueryResult<Option<Message>> {
    messages::table
        .filter(messages::thread_id.eq(thread_id))
        .filter(messages::active)
        .filter(messages::sequence.eq(sequence))
        .select(Message::as_select())
        .first(conn)
        .await
        .optional()
}

/// The sequences of the whole tool group containing `message`: an assistant tool call and its
/// contiguous results; a plain message is its own group.
pub async fn tool_group(conn: &mut AsyncPgConnection, message: &Message) -> QueryResult<Vec<i64>> {
    let call = if message.role == role::TOOL {
        // The nearest active assistant tool-call message before the result.
        messages::table
            .filter(messages::thread_id.eq(message.thread_id))
            .filter(messages::active)
            .filter(messages::sequence.lt(message.sequence))
            .filter(messages::role.ne(role::TOOL))
            .order(messages::sequence.desc())
            .select(Message::as_select())
            .first(conn)
            .await
            .optional()?
            .filter(|m| m.role == role::ASSISTANT && m.tool_calls.is_some())
    } else if message.role == role::ASSISTANT && message.tool_calls.is_some() {
        Some(message.clone())
    } else {
        None
    };
    let Some(call) = call else { return Ok(vec![message.sequence]) };
    // The call plus the contiguous tool results after it.
    let after: Vec<(i64, String)> = messages::table
        .filter(messages::thread_id.eq(call.thread_id))
        .filter(messages::active)
        .filter(messages::sequence.gt(call.sequence))
        .order(messages::sequence.asc())
        .limit(256)
        .select((messages::sequence, messages::role))
        .load(conn)
        .await?;
    let mut group = vec![call.sequence];
    group.extend(after.into_iter().take_while(|(_, r)| r == role::TOOL).map(|(s, _)| s));
    Ok(group)
}
