//! Canonical, append-oriented message history (SPEC §3, seed 000 "Representations and
//! invariants").
//!
//! Rows are never updated except `active`. Each row has a gap-free per-thread `sequence` (the
//! stable cursor) and a per-thread monotonic `timestamp_ms` identity
//! (`max(now_ms, last + 1)`), both allocated under the thread row lock by the step functions'
//! `agentloop_append` (`migrations/2026-12-01-000005_durable_core`). This module holds the row
//! types and the reads.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::db::schema::messages;

/// Message roles of the OpenAI Chat Completions model.
pub mod role {
    pub const SYSTEM: &str = "system";
    pub const DEVELOPER: &str = "developer";
    pub const USER: &str = "user";
    pub const ASSISTANT: &str = "assistant";
    pub const TOOL: &str = "tool";
}

/// One canonical message row. Its JSON is the one `agentloop_message_json` builds in the
/// database (step results decode back into this type).
#[derive(Debug, Clone, Queryable, Selectable, Serialize, Deserialize, PartialEq)]
#[diesel(table_name = messages)]
#[serde(rename_all = "camelCase")]
pub struct Message {
    #[serde(skip)]
    pub id: i64,
    #[serde(skip)]
    pub thread_id: Uuid,
    pub sequence: i64,
    /// Monotonic identity, ms since the Unix epoch.
    #[serde(rename = "timestamp")]
    pub timestamp_ms: i64,
    pub role: String,
    /// A JSON string, or an array of content parts (`{type:"text",text}`, ...).
    pub content: serde_json::Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    pub run_id: Option<Uuid>,
    pub step_id: Option<i64>,
    pub token_estimate: i32,
    #[serde(skip)]
    pub byte_size: i32,
    pub active: bool,
    pub created_at: DateTime<Utc>,
    /// Committed from the partial answer of a cancelled stream (SPEC §4).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stopped: bool,
    /// The provider's `finish_reason` when it was not a finished answer or tool calls
    /// (`length`, `content_filter`, ...): the answer was cut. `None` = it ended normally.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<String>,
}

impl Message {
    /// The content as plain text (text parts joined by newlines).
    pub fn text(&self) -> String {
        content_text(&self.content)
    }
}

/// Plain text of a content value: a string, or the `text` of its text parts joined by newlines.
pub fn content_text(content: &serde_json::Value) -> String {
    match content {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(|t| t.as_str()))
            .collect::<Vec<_>>()
            .join("\n"),
        serde_json::Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// A message to append (serialised as the step functions expect:
/// `{role, content, toolCalls?, toolCallId?, reasoning?, tokenEstimate, byteSize, stopped?,
/// finishReason?}`).
#[derive(Debug, Clone, PartialEq)]
pub struct NewMessage {
    pub role: String,
    pub content: serde_json::Value,
    pub tool_calls: Option<serde_json::Value>,
    pub tool_call_id: Option<String>,
    pub reasoning: Option<String>,
    pub token_estimate: i32,
    /// The partial answer of a cancelled stream (SPEC §4).
    pub stopped: bool,
    /// See [`Message::finish_reason`].
    pub finish_reason: Option<String>,
}

impl NewMessage {
    /// Stored size in bytes (content, tool calls and reasoning as JSON text): what paging and
    /// windows bound by.
    pub fn byte_size(&self) -> usize {
        self.content.to_string().len()
            + self.tool_calls.as_ref().map_or(0, |t| t.to_string().len())
            + self.reasoning.as_ref().map_or(0, String::len)
    }
}

impl Serialize for NewMessage {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("role", &self.role)?;
        map.serialize_entry("content", &self.content)?;
        if let Some(calls) = &self.tool_calls {
            map.serialize_entry("toolCalls", calls)?;
        }
        if let Some(id) = &self.tool_call_id {
            map.serialize_entry("toolCallId", id)?;
        }
        if let Some(reasoning) = &self.reasoning {
            map.serialize_entry("reasoning", reasoning)?;
        }
        map.serialize_entry("tokenEstimate", &self.token_estimate)?;
        map.serialize_entry("byteSize", &self.byte_size())?;
        if self.stopped {
            map.serialize_entry("stopped", &true)?;
        }
        if let Some(reason) = &self.finish_reason {
            map.serialize_entry("finishReason", reason)?;
        }
        map.end()
    }
}

impl NewMessage {
    /// A plain text message of `role`.
    pub fn text(role: &str, text: impl Into<String>) -> Self {
        let text = text.into();
        let token_estimate = crate::tokens::estimate_text(&text) as i32;
        Self {
            role: role.to_owned(),
            content: serde_json::Value::String(text),
            tool_calls: None,
            tool_call_id: None,
            reasoning: None,
            token_estimate,
            stopped: false,
            finish_reason: None,
        }
    }
}

/// Active messages of `thread_id` with `sequence > after`, in sequence order (context building).
pub async fn active_after(conn: &mut AsyncPgConnection, thread_id: Uuid, after: i64) -> QueryResult<Vec<Message>> {
    messages::table
        .filter(messages::thread_id.eq(thread_id))
        .filter(messages::active)
        .filter(messages::sequence.gt(after))
        .order(messages::sequence.asc())
        .select(Message::as_select())
        .load(conn)
        .await
}

/// The first `head` and last `tail` active messages (each in sequence order, possibly
/// overlapping when the thread is short). Two index range scans: cost independent of length.
pub async fn head_and_tail(
    conn: &mut AsyncPgConnection,
    thread_id: Uuid,
    head: i64,
    tail: i64,
) -> QueryResult<(Vec<Message>, Vec<Message>)> {
    let first = messages::table
        .filter(messages::thread_id.eq(thread_id))
        .filter(messages::active)
        .order(messages::sequence.asc())
        .limit(head)
        .select(Message::as_select())
        .load(conn)
        .await?;
    let mut last: Vec<Message> = messages::table
        .filter(messages::thread_id.eq(thread_id))
        .filter(messages::active)
        .order(messages::sequence.desc())
        .limit(tail)
        .select(Message::as_select())
        .load(conn)
        .await?;
    last.reverse();
    Ok((first, last))
}

/// Preview of a thread for lists: `{role, text, sequence}` of its last active message, text cut
/// to `max_chars` characters; `None` for an empty thread. One index probe; the body is cut in
/// the database so large messages are never transferred.
pub async fn preview(conn: &mut AsyncPgConnection, thread_id: Uuid, max_chars: i32) -> QueryResult<Option<serde_json::Value>> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Text)]
        role: String,
        #[diesel(sql_type = diesel::sql_types::Text)]
        text: String,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        sequence: i64,
    }
    let row: Option<Row> = diesel::sql_query(
        "SELECT role, sequence,
                left(CASE jsonb_typeof(content) WHEN 'string' THEN content #>> '{}'
                     ELSE coalesce((SELECT string_agg(p ->> 'text', ' ') FROM jsonb_array_elements(
                          CASE jsonb_typeof(content) WHEN 'array' THEN content ELSE '[]'::jsonb END) p), '') END, $2) AS text
         FROM messages WHERE thread_id = $1 AND active ORDER BY sequence DESC LIMIT 1",
    )
    .bind::<diesel::sql_types::Uuid, _>(thread_id)
    .bind::<diesel::sql_types::Integer, _>(max_chars)
    .get_result(conn)
    .await
    .optional()?;
    Ok(row.map(|r| serde_json::json!({"role": r.role, "text": r.text, "sequence": r.sequence})))
}

/// What paging needs to know about an active message without reading its body: the cursor,
/// the role, the stored byte size and whether it carries tool calls (SPEC §10).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageMeta {
    pub sequence: i64,
    pub role: String,
    pub byte_size: i32,
    pub has_tool_calls: bool,
}

impl MessageMeta {
    /// A tool result (belongs to the assistant tool-call message before it).
    pub fn is_tool_result(&self) -> bool {
        self.role == role::TOOL
    }

    /// An assistant message that starts a tool group.
    pub fn starts_tool_group(&self) -> bool {
        self.role == role::ASSISTANT && self.has_tool_calls
    }
}

/// Metadata of at most `limit` active messages of `thread_id` strictly between `after` and
/// `before` (each optional), nearest to `before` first when `newest_first`, else nearest to
/// `after` first. One range scan on `messages_active_by_sequence (thread_id, sequence) WHERE
/// active` (the `active` predicate is a literal so even a generic plan matches the partial
/// index); bodies are never read (`tool_calls IS NOT NULL` does not detoast).
pub async fn active_meta_between(
    conn: &mut AsyncPgConnection,
    thread_id: Uuid,
    after: Option<i64>,
    before: Option<i64>,
    newest_first: bool,
    limit: i64,
) -> QueryResult<Vec<MessageMeta>> {
    let mut query = messages::table
        .filter(messages::thread_id.eq(thread_id))
        .filter(messages::active)
        .select((messages::sequence, messages::role, messages::byte_size, messages::tool_calls.is_not_null()))
        .into_boxed();
    if let Some(after) = after {
        query = query.filter(messages::sequence.gt(after));
    }
    if let Some(before) = before {
        query = query.filter(messages::sequence.lt(before));
    }
    query = if newest_first { query.order(messages::sequence.desc()) } else { query.order(messages::sequence.asc()) };
    let rows: Vec<(i64, String, i32, bool)> = query.limit(limit).load(conn).await?;
    Ok(rows
        .into_iter()
        .map(|(sequence, role, byte_size, has_tool_calls)| MessageMeta { sequence, role, byte_size, has_tool_calls })
        .collect())
}

/// Active messages of `thread_id` with `first <= sequence <= last`, in sequence order. One
/// range scan on `messages_active_by_sequence`; the caller bounds the range.
pub async fn active_in_range(conn: &mut AsyncPgConnection, thread_id: Uuid, first: i64, last: i64) -> QueryResult<Vec<Message>> {
    messages::table
        .filter(messages::thread_id.eq(thread_id))
        .filter(messages::active)
        .filter(messages::sequence.between(first, last))
        .order(messages::sequence.asc())
        .select(Message::as_select())
        .load(conn)
        .await
}

/// Whether active messages of `thread_id` exist below `first` (and above `floor`, when given)
/// and above `last` (and below `ceiling`, when given): `(more_before, more_after)`. One
/// statement with two nearest-neighbour probes (`ORDER BY sequence ... LIMIT 1`), each a
/// one-row scan of `messages_active_by_sequence`; written this way rather than as `EXISTS`
/// with open bounds, for which the planner may pick a sequential scan.
pub async fn active_exists_around(
    conn: &mut AsyncPgConnection,
    thread_id: Uuid,
    first: i64,
    last: i64,
    floor: Option<i64>,
    ceiling: Option<i64>,
) -> QueryResult<(bool, bool)> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::BigInt>)]
        prev: Option<i64>,
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::BigInt>)]
        next: Option<i64>,
    }
    let row: Row = diesel::sql_query(
        "SELECT (SELECT sequence FROM messages WHERE thread_id = $1 AND active AND sequence < $2
                 ORDER BY sequence DESC LIMIT 1) AS prev,
                (SELECT sequence FROM messages WHERE thread_id = $1 AND active AND sequence > $3
                 ORDER BY sequence ASC LIMIT 1) AS next",
    )
    .bind::<diesel::sql_types::Uuid, _>(thread_id)
    .bind::<diesel::sql_types::BigInt, _>(first)
    .bind::<diesel::sql_types::BigInt, _>(last)
    .get_result(conn)
    .await?;
    let before = row.prev.is_some_and(|p| floor.is_none_or(|f| p > f));
    let after = row.next.is_some_and(|n| ceiling.is_none_or(|c| n < c));
    Ok((before, after))
}

/// Active `system`/`developer` rows before `sequence` (the instructions kept ahead of a
/// snapshot's coverage), in order.
pub async fn instructions_before(conn: &mut AsyncPgConnection, thread_id: Uuid, sequence: i64) -> QueryResult<Vec<Message>> {
    messages::table
        .filter(messages::thread_id.eq(thread_id))
        .filter(messages::active)
        .filter(messages::sequence.lt(sequence))
        .filter(messages::role.eq_any([role::SYSTEM, role::DEVELOPER]))
        .order(messages::sequence.asc())
        .select(Message::as_select())
        .load(conn)
        .await
}

/// One tool call of an assistant message's `tool_calls` (OpenAI shape).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallRef {
    pub id: String,
    pub name: String,
    /// The model's argument text.
    pub arguments: String,
}

/// The calls of a `tool_calls` value, in order (entries without an id are skipped).
pub fn tool_calls_of(tool_calls: Option<&serde_json::Value>) -> Vec<ToolCallRef> {
    tool_calls
        .and_then(|c| c.as_array())
        .into_iter()
        .flatten()
        .filter_map(|c| {
            let id = c.get("id")?.as_str()?.to_owned();
            let function = c.get("function");
            let name = function.and_then(|f| f.get("name")).and_then(|n| n.as_str()).unwrap_or_default().to_owned();
            let arguments = match function.and_then(|f| f.get("arguments")) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Null) | None => String::new(),
                Some(other) => other.to_string(),
            };
            Some(ToolCallRef { id, name, arguments })
        })
        .collect()
}

/// `(count, sum of token_estimate)` of the active rows after `sequence` (context accounting).
pub async fn active_totals_after(conn: &mut AsyncPgConnection, thread_id: Uuid, sequence: i64) -> QueryResult<(i64, i64)> {
    let (count, tokens): (i64, Option<i64>) = messages::table
        .filter(messages::thread_id.eq(thread_id))
        .filter(messages::active)
        .filter(messages::sequence.gt(sequence))
        .select((diesel::dsl::count_star(), diesel::dsl::sum(messages::token_estimate)))
        .get_result(conn)
        .await?;
    Ok((count, tokens.unwrap_or(0)))
}
