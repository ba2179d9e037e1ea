//! Canonical, append-oriented message history (SPEC §3, seed 000 "Representations and
//! invariants").
//!
//! Rows are never updated except `active`. Each row has a gap-free per-thread `sequence` (the
//! stable cursor) and a per-thread monotonic `timestamp_ms` identity
//! (`max(now_ms, last + 1)`), both allocated under the thread row lock by [`append`].

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::Serialize;
use uuid::Uuid;

use crate::db::schema::{messages, threads};
use crate::events;

/// Message roles of the OpenAI Chat Completions model.
pub mod role {
    pub const SYSTEM: &str = "system";
    pub const DEVELOPER: &str = "developer";
    pub const USER: &str = "user";
    pub const ASSISTANT: &str = "assistant";
    pub const TOOL: &str = "tool";
}

/// One canonical message row.
#[derive(Debug, Clone, Queryable, Selectable, Serialize, PartialEq)]
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

/// A message to append. `identity` is the timestamp identity it already received in an
/// earlier successful [`append`] (a re-delivery), or `None` for a new message.
#[derive(Debug, Clone, PartialEq)]
pub struct NewMessage {
    pub role: String,
    pub content: serde_json::Value,
    pub tool_calls: Option<serde_json::Value>,
    pub tool_call_id: Option<String>,
    pub reasoning: Option<String>,
    pub token_estimate: i32,
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
        }
    }
}

/// Provenance stamped on appended rows.
#[derive(Debug, Clone, Copy, Default)]
pub struct Provenance {
    pub run_id: Option<Uuid>,
    pub step_id: Option<i64>,
}

#[derive(Insertable)]
#[diesel(table_name = messages)]
struct MessageRow<'a> {
    thread_id: Uuid,
    sequence: i64,
    timestamp_ms: i64,
    role: &'a str,
    content: &'a serde_json::Value,
    tool_calls: Option<&'a serde_json::Value>,
    tool_call_id: Option<&'a str>,
    reasoning: Option<&'a str>,
    run_id: Option<Uuid>,
    step_id: Option<i64>,
    token_estimate: i32,
    byte_size: i32,
}

/// Appends `new` to `thread_id`'s active history, in order, allocating gap-free sequences and
/// monotonic timestamp identities under the thread row lock, and journals one `message` event
/// per row. Must run inside the caller's transaction (with the run's fence, for a worker).
///
/// `known_identities[i]`, when `Some`, is the identity message `i` received in an earlier
/// committed append: if a row with that identity exists, message `i` is skipped (re-delivery
/// appends nothing). Returns `(index into new, row)` for each row inserted.
pub async fn append(
    conn: &mut AsyncPgConnection,
    thread_id: Uuid,
    provenance: Provenance,
    new: &[NewMessage],
    known_identities: &[Option<i64>],
) -> QueryResult<Vec<(usize, Message)>> {
    let claimed: Vec<i64> = known_identities.iter().flatten().copied().collect();
    let existing: Vec<i64> = if claimed.is_empty() {
        Vec::new()
    } else {
        messages::table
            .filter(messages::thread_id.eq(thread_id))
            .filter(messages::timestamp_ms.eq_any(&claimed))
            .select(messages::timestamp_ms)
            .load(conn)
            .await?
    };
    let fresh: Vec<usize> = (0..new.len())
        .filter(|&i| !matches!(known_identities.get(i), Some(Some(ts)) if existing.contains(ts)))
        .collect();
    if fresh.is_empty() {
        return Ok(Vec::new());
    }
    let k = fresh.len() as i64;
    // One statement allocates k sequences and k timestamps: max(now_ms, last + 1) onwards.
    let (last_sequence, last_ts): (i64, i64) = diesel::update(threads::table.find(thread_id))
        .set((
            threads::last_sequence.eq(threads::last_sequence + k),
            threads::message_count.eq(threads::message_count + k as i32),
            threads::last_timestamp_ms.eq(diesel::dsl::sql::<diesel::sql_types::BigInt>(&format!(
                "GREATEST(last_timestamp_ms + {k}, (extract(epoch from clock_timestamp()) * 1000)::bigint + {})",
                k - 1
            ))),
            threads::updated_at.eq(diesel::dsl::now),
        ))
        .returning((threads::last_sequence, threads::last_timestamp_ms))
        .get_result(conn)
        .await?;
    let first_sequence = last_sequence - k + 1;
    let first_ts = last_ts - k + 1;
    // NUL-free copies (PostgreSQL text/jsonb cannot store U+0000), see `crate::text`.
    let cleaned: Vec<NewMessage> = new
        .iter()
        .map(|m| NewMessage {
            role: m.role.clone(),
            content: crate::text::clean_json(&m.content).into_owned(),
            tool_calls: m.tool_calls.as_ref().map(|t| crate::text::clean_json(t).into_owned()),
            tool_call_id: m.tool_call_id.as_deref().map(|t| crate::text::clean(t).into_owned()),
            reasoning: m.reasoning.as_deref().map(|r| crate::text::clean(r).into_owned()),
            token_estimate: m.token_estimate,
        })
        .collect();
    let new = &cleaned[..];
    let rows: Vec<MessageRow> = fresh
        .iter()
        .enumerate()
        .map(|(j, &i)| {
            let m = &new[i];
            let byte_size = m.content.to_string().len()
                + m.tool_calls.as_ref().map_or(0, |t| t.to_string().len())
                + m.reasoning.as_ref().map_or(0, |r| r.len());
            MessageRow {
                thread_id,
                sequence: first_sequence + j as i64,
                timestamp_ms: first_ts + j as i64,
                role: &m.role,
                content: &m.content,
                tool_calls: m.tool_calls.as_ref(),
                tool_call_id: m.tool_call_id.as_deref(),
                reasoning: m.reasoning.as_deref(),
                run_id: provenance.run_id,
                step_id: provenance.step_id,
                token_estimate: m.token_estimate,
                byte_size: byte_size as i32,
            }
        })
        .collect();
    let inserted: Vec<Message> = diesel::insert_into(messages::table)
        .values(&rows)
        .returning(Message::as_returning())
        .get_results(conn)
        .await?;
    for message in &inserted {
        events::append(conn, thread_id, events::kind::MESSAGE, &serde_json::to_value(message).unwrap_or_default())
            .await?;
    }
    Ok(fresh.into_iter().zip(inserted).collect())
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

/// Content of the synthetic result given to a tool call that never got one (SPEC §4
/// "interrupt", seed 000 "Provider compatibility": every tool call must be answered).
pub const CANCELLED_TOOL_RESULT: &str = "[cancelled: the run ended before this tool call produced a result]";

/// Appends a synthetic cancelled result for every tool call of `run_id`'s last assistant
/// tool-call message that has no result yet, so the history stays valid for every provider.
/// Call in the transaction that ends the run. Returns how many results were appended.
pub async fn close_dangling_tool_calls(conn: &mut AsyncPgConnection, thread_id: Uuid, run_id: Uuid) -> QueryResult<usize> {
    let last_call: Option<Message> = messages::table
        .filter(messages::run_id.eq(run_id))
        .filter(messages::active)
        .filter(messages::role.eq(role::ASSISTANT))
        .filter(messages::tool_calls.is_not_null())
        .order(messages::sequence.desc())
        .select(Message::as_select())
        .first(conn)
        .await
        .optional()?;
    let Some(call) = last_call else { return Ok(0) };
    let answered: Vec<Option<String>> = messages::table
        .filter(messages::thread_id.eq(thread_id))
        .filter(messages::active)
        .filter(messages::sequence.gt(call.sequence))
        .filter(messages::role.eq(role::TOOL))
        .select(messages::tool_call_id)
        .load(conn)
        .await?;
    let missing: Vec<NewMessage> = call
        .tool_calls
        .as_ref()
        .and_then(|c| c.as_array())
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("id").and_then(|id| id.as_str()))
        .filter(|id| !answered.iter().flatten().any(|a| a == id))
        .map(|id| {
            let mut m = NewMessage::text(role::TOOL, CANCELLED_TOOL_RESULT);
            m.tool_call_id = Some(id.to_owned());
            m
        })
        .collect();
    if missing.is_empty() {
        return Ok(0);
    }
    let identities = vec![None; missing.len()];
    let provenance = Provenance { run_id: Some(run_id), step_id: call.step_id };
    Ok(append(conn, thread_id, provenance, &missing, &identities).await?.len())
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

/// The last active assistant tool-call message of `run_id` and the ids of its calls that
/// already have a result (active `tool` rows after it), or `None` when the run made no call.
/// A slice starts by answering the rest (approved calls, calls interrupted by a crash), SPEC §6.
pub async fn last_tool_call_group(
    conn: &mut AsyncPgConnection,
    thread_id: Uuid,
    run_id: Uuid,
) -> QueryResult<Option<(Message, Vec<String>)>> {
    let last_call: Option<Message> = messages::table
        .filter(messages::run_id.eq(run_id))
        .filter(messages::active)
        .filter(messages::role.eq(role::ASSISTANT))
        .filter(messages::tool_calls.is_not_null())
        .order(messages::sequence.desc())
        .select(Message::as_select())
        .first(conn)
        .await
        .optional()?;
    let Some(call) = last_call else { return Ok(None) };
    let answered: Vec<Option<String>> = messages::table
        .filter(messages::thread_id.eq(thread_id))
        .filter(messages::active)
        .filter(messages::sequence.gt(call.sequence))
        .filter(messages::role.eq(role::TOOL))
        .select(messages::tool_call_id)
        .load(conn)
        .await?;
    Ok(Some((call, answered.into_iter().flatten().collect())))
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
