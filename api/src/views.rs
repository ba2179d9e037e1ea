//! Client-facing JSON views built from rows (SPEC §10, §13).

use agentloop_shared::messages::{self, Message};
use agentloop_shared::runs::Run;
use agentloop_shared::threads::Thread;
use diesel_async::AsyncPgConnection;
use serde_json::{Value, json};

/// Messages from the start of a thread in a window (SPEC §10).
pub const WINDOW_HEAD: i64 = 20;
/// Messages from the end of a thread in a window.
pub const WINDOW_TAIL: i64 = 100;
/// Byte bound of the head part (128 KiB).
pub const WINDOW_HEAD_BYTES: usize = 128 * 1024;
/// Byte bound of the tail part (384 KiB).
pub const WINDOW_TAIL_BYTES: usize = 384 * 1024;

/// Refresh signature: changes whenever the message count/last sequence, the streaming partial
/// (`streaming`, as [`streaming`] returns it) or the run state change, so a client can skip
/// refetching when it is equal (SPEC §10).
pub fn sig(thread: &Thread, run: Option<&Run>, streaming: &Value) -> String {
    let streaming = streaming.get("content").and_then(Value::as_str).map_or(0, str::len)
        + streaming.get("reasoning").and_then(Value::as_str).map_or(0, str::len);
    let run = run.map_or_else(|| "none".to_owned(), |r| format!("{}:{}:{}", r.id.simple(), r.status, r.steps_used));
    format!("{}.{}.{}.{}", thread.message_count, thread.last_sequence, streaming, run)
}

/// A thread's JSON with the fields every view shares.
pub fn thread_json(thread: &Thread) -> Value {
    serde_json::to_value(thread).unwrap_or_default()
}

/// The run JSON or null.
pub fn run_json(run: Option<&Run>) -> Value {
    run.map_or(Value::Null, Run::to_json)
}

/// The streaming partial answer as of the thread row's journal position
/// (`thread.lastEventSequence`), or null: the snapshot the worker stored in
/// `threads.streaming_message` (`{runId, content, reasoning, eventSequence}`) plus the run's
/// `streaming` deltas journaled after it (an index range scan of a few rows; see
/// `agentloop_shared::streaming`). Shape: `{runId, content, reasoning}`.
pub async fn streaming(conn: &mut AsyncPgConnection, thread: &Thread) -> diesel::QueryResult<Value> {
    use agentloop_shared::db::schema::thread_events as e;
    use diesel::prelude::*;
    use diesel_async::RunQueryDsl;
    let Some(snapshot) = &thread.streaming_message else { return Ok(Value::Null) };
    let run_id = snapshot.get("runId").cloned().unwrap_or(Value::Null);
    let since = snapshot.get("eventSequence").and_then(Value::as_i64).unwrap_or(thread.last_event_sequence);
    let mut content = snapshot.get("content").and_then(Value::as_str).unwrap_or_default().to_owned();
    let mut reasoning = snapshot.get("reasoning").and_then(Value::as_str).unwrap_or_default().to_owned();
    let deltas: Vec<Value> = e::table
        .filter(e::thread_id.eq(thread.id))
        .filter(e::kind.eq(agentloop_shared::events::kind::STREAMING))
        .filter(e::sequence.gt(since))
        .filter(e::sequence.le(thread.last_event_sequence))
        .order(e::sequence.asc())
        .limit(10_000)
        .select(e::payload)
        .load(conn)
        .await?;
    for d in deltas.iter().filter(|d| d.get("runId") == Some(&run_id)) {
        let at = |k: &str| d.get(k).and_then(Value::as_u64).map(|v| v as usize);
        if let (Some(offset), Some(delta)) = (at("offset"), d.get("delta").and_then(Value::as_str)) {
            agentloop_shared::streaming::apply_delta(&mut content, offset, delta);
        }
        if let (Some(offset), Some(delta)) = (at("reasoningOffset"), d.get("reasoningDelta").and_then(Value::as_str)) {
            agentloop_shared::streaming::apply_delta(&mut reasoning, offset, delta);
        }
    }
    Ok(json!({"runId": run_id, "content": content, "reasoning": reasoning}))
}

/// A message's JSON; a message larger than `max_bytes` has its content, reasoning and each tool
/// call's `arguments` cut to `max_bytes` with a marker, and `truncated: true` (before, only the
/// content was cut: a message with 2 MB of tool-call arguments came back whole, marked
/// truncated — acceptance probe).
pub fn message_json(message: &Message, max_bytes: usize) -> Value {
    let mut value = serde_json::to_value(message).unwrap_or_default();
    if message.byte_size as usize > max_bytes {
        value["content"] = json!(cut_text(&message.text(), max_bytes));
        if let Some(reasoning) = message.reasoning.as_deref().filter(|r| r.len() > max_bytes) {
            value["reasoning"] = json!(cut_text(reasoning, max_bytes));
        }
        for call in value.get_mut("toolCalls").and_then(Value::as_array_mut).into_iter().flatten() {
            // Stored as `{id, name, arguments}` or in OpenAI's `{function: {name, arguments}}`.
            let arguments = if call.get("function").is_some() { &mut call["function"]["arguments"] } else { &mut call["arguments"] };
            if let Some(text) = arguments.as_str().filter(|t| t.len() > max_bytes) {
                *arguments = json!(cut_text(text, max_bytes));
            }
        }
        value["truncated"] = json!(true);
    }
    value
}

/// `text`'s first `max_bytes` (on a character boundary) and `\n…[N bytes omitted]`, or `text`
/// itself when it fits.
fn cut_text(text: &str, max_bytes: usize) -> String {
    if text.len() <= max_bytes {
        return text.to_owned();
    }
    let mut cut = max_bytes;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}\n…[{} bytes omitted]", &text[..cut], text.len() - cut)
}

/// Takes messages in order until `budget` bytes are used (at least one, truncated if huge).
fn bounded(messages: impl Iterator<Item = Message>, budget: usize) -> Vec<Value> {
    let mut used = 0usize;
    let mut out = Vec::new();
    for m in messages {
        let size = m.byte_size.max(0) as usize;
        if !out.is_empty() && used + size > budget {
            break;
        }
        used += size.min(budget);
        out.push(message_json(&m, budget));
    }
    out
}

/// The thread window: at most [`WINDOW_HEAD`] messages from the start and [`WINDOW_TAIL`] from
/// the end, byte-bounded, plus `messageWindow` ranges naming what was omitted. Two index range
/// scans whatever the thread's length. A message that starts an alternative of a fork (edit or
/// regenerate) has `branch: {index, count}` (the `‹ 1/2 ›` switcher).
pub async fn window(conn: &mut AsyncPgConnection, thread: &Thread) -> diesel::QueryResult<Value> {
    let (head, tail) = messages::head_and_tail(conn, thread.id, WINDOW_HEAD, WINDOW_TAIL).await?;
    // The tail is what follows the head as SHOWN (cut at its byte budget), not as read: a short
    // thread whose head was cut had its newest messages in neither part, and the page never
    // showed its last answer (acceptance probe K, K-3).
    let head_json = bounded(head.into_iter(), WINDOW_HEAD_BYTES);
    let head_last = head_json.last().and_then(|m| m.get("sequence")).and_then(Value::as_i64);
    let tail: Vec<Message> = tail.into_iter().filter(|m| head_last.is_none_or(|h| m.sequence > h)).collect();
    let mut tail_json = bounded(tail.into_iter().rev(), WINDOW_TAIL_BYTES);
    tail_json.reverse();
    let range = |v: &[Value]| {
        json!({
            "first": v.first().and_then(|m| m.get("sequence")).cloned(),
            "last": v.last().and_then(|m| m.get("sequence")).cloned(),
            "count": v.len(),
        })
    };
    let shown = head_json.len() + tail_json.len();
    let omitted = (thread.message_count as usize).saturating_sub(shown);
    let window = json!({
        "head": range(&head_json),
        "tail": range(&tail_json),
        "omitted": {
            "after": head_json.last().and_then(|m| m.get("sequence")).cloned(),
            "before": tail_json.first().and_then(|m| m.get("sequence")).cloned(),
            "count": omitted,
        },
    });
    let mut messages = head_json;
    messages.extend(tail_json);
    crate::reads::annotate_branches(conn, thread.id, &mut messages).await?;
    Ok(json!({"messages": messages, "messageWindow": window}))
}

// ------------------------------------------------------------------------------------------
// Schemas of the OpenAPI document (issue 10 point 6): the exact shapes the routes send. Most
// bodies are built by the step functions (`agentloop_*_json` in
// `migrations/…000005_durable_core`) or by `serde_json::json!` here; these types describe them
// and the contract tests (schemathesis, `tests/tests/contract.rs`) check every response
// against them.
// ------------------------------------------------------------------------------------------

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

/// The error envelope of every 4xx/5xx answer (component `Error`).
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Error)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// An error: a stable snake_case `code` and a human `message`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    #[schema(example = "not_found")]
    pub code: String,
    pub message: String,
}

/// `{"status": "ok"}` / `{"status": "ready"}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct HealthStatus {
    #[schema(example = "ok")]
    pub status: String,
}

/// A principal (caller).
#[derive(Debug, Serialize, ToSchema)]
pub struct PrincipalView {
    pub id: Uuid,
    pub name: String,
}

impl From<agentloop_shared::auth::Principal> for PrincipalView {
    fn from(p: agentloop_shared::auth::Principal) -> Self {
        Self { id: p.id, name: p.name }
    }
}

/// `POST /api/session` body.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SignIn {
    /// An API key (`al_...`).
    #[schema(max_length = 256)]
    pub key: String,
}

/// `POST /api/session` answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct SessionCreated {
    pub principal: PrincipalView,
}

/// How a request was authenticated.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ViaName {
    Session,
    Bearer,
    Loopback,
}

impl From<crate::extract::Via> for ViaName {
    fn from(via: crate::extract::Via) -> Self {
        match via {
            crate::extract::Via::Session => Self::Session,
            crate::extract::Via::Bearer => Self::Bearer,
            crate::extract::Via::Loopback => Self::Loopback,
        }
    }
}

/// `GET /api/session` answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct SessionInfo {
    pub principal: PrincipalView,
    pub via: ViaName,
}

/// A thread (`agentloop_thread_json`).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ThreadView {
    pub id: Uuid,
    pub title: String,
    pub model: Option<String>,
    /// Any JSON object (known keys: `multitask`, `compactThreshold`, `compactChunkTokens`,
    /// `compactRecentMessages`).
    #[schema(value_type = Object)]
    pub metadata: serde_json::Value,
    pub parent_thread_id: Option<Uuid>,
    pub message_count: i32,
    pub last_sequence: i64,
    pub last_event_sequence: i64,
    pub context_tokens: Option<i32>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// Run statuses (SPEC §4).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Pending,
    Queued,
    Running,
    WaitingApproval,
    /// A tool call waits for the user's sign-in at an MCP server (`authorization.url`).
    WaitingAuthorization,
    Blocked,
    Completed,
    Failed,
    Cancelled,
}

/// Run kinds.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunKind {
    Agent,
    Compaction,
}

/// A run (`agentloop_run_json`; `error` only when it has an error code).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunView {
    pub id: Uuid,
    pub thread_id: Uuid,
    pub status: RunStatus,
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
    /// Fencing token.
    pub lease_epoch: i64,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub attempts: i32,
    pub recoveries: i32,
    pub faults: i32,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    pub cancel_requested_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub queued_at: Option<DateTime<Utc>>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub updated_at: DateTime<Utc>,
    /// A pending run's user turn `{content, tokenEstimate, ...}`, else null.
    #[schema(value_type = Option<Object>)]
    pub input: Option<serde_json::Value>,
    pub kind: RunKind,
    pub source_thread_id: Option<Uuid>,
    #[schema(required = false)]
    pub error: Option<ErrorDetail>,
    /// W3C trace context of the request that created the run (present only when the api
    /// exports traces or the request carried a `traceparent` header).
    #[schema(required = false)]
    pub traceparent: Option<String>,
}

/// A step (one slice) of a run.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct StepView {
    pub id: i64,
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

/// What blocks a `blocked` run: its uncertain operations.
#[derive(Debug, Serialize, ToSchema)]
pub struct Blocker {
    pub code: String,
    pub message: Option<String>,
    pub operations: Vec<OperationView>,
}

/// `GET /api/runs/{id}`: the run, its steps, and what it waits for.
#[derive(Debug, Serialize, ToSchema)]
pub struct RunDetail {
    #[serde(flatten)]
    pub run: RunView,
    pub steps: Vec<StepView>,
    #[schema(required = false)]
    pub blocker: Option<Blocker>,
    #[schema(required = false)]
    pub approvals: Option<Vec<ApprovalView>>,
    /// The pending MCP sign-in of a `waiting_authorization` run.
    #[schema(required = false)]
    pub authorization: Option<AuthorizationView>,
    /// Every MCP sign-in the run asked for, oldest first (absent when none).
    #[schema(required = false)]
    pub authorizations: Option<Vec<AuthorizationView>>,
}

/// 200 of `GET /api/oauth/callback`: the completed sign-in and the requeued run.
#[derive(Debug, Serialize, ToSchema)]
pub struct SignedIn {
    pub authorization: AuthorizationView,
    pub run: RunView,
}

/// MCP sign-in statuses: `pending` (the link can be used), `exchanging` (the callback is
/// redeeming the code), `completed` (token stored), `claimed` (the run's retry used it),
/// `failed`, `cancelled` (the run ended first).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AuthorizationStatus {
    Pending,
    Exchanging,
    Completed,
    Claimed,
    Failed,
    Cancelled,
}

/// An MCP sign-in a run asked for (`agentloop_authorization_json`; journal event
/// `authorization`).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AuthorizationView {
    pub id: Uuid,
    pub run_id: Uuid,
    pub thread_id: Uuid,
    /// The MCP server's configured name.
    pub server: String,
    pub tool_call_id: String,
    pub status: AuthorizationStatus,
    /// The sign-in URL (the authorization server's authorize endpoint), while `pending` and
    /// not expired.
    pub url: Option<String>,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub completed_at: Option<DateTime<Utc>>,
    pub claimed_at: Option<DateTime<Utc>>,
}

/// Message roles.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

/// A canonical message (`agentloop_message_json`). Optional members are absent when empty;
/// `truncated: true` when `content` was cut to the view's byte bound (page it to read it whole).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MessageView {
    pub sequence: i64,
    /// Monotonic identity, ms since the Unix epoch.
    pub timestamp: i64,
    pub role: Role,
    /// A string, or an array of content parts.
    #[schema(value_type = StoredContent)]
    pub content: serde_json::Value,
    #[schema(required = false, value_type = Vec<Object>)]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    #[schema(required = false)]
    pub tool_call_id: Option<String>,
    #[schema(required = false)]
    pub reasoning: Option<String>,
    pub run_id: Option<Uuid>,
    pub step_id: Option<i64>,
    pub token_estimate: i32,
    pub active: bool,
    pub created_at: DateTime<Utc>,
    #[schema(required = false)]
    pub stopped: Option<bool>,
    /// The provider ended this answer early: its `finish_reason` when not a finished answer or
    /// tool calls (`length` — it reached `max_tokens` or the end of the context —,
    /// `content_filter`, ...). Absent when the answer ended normally.
    #[schema(required = false)]
    pub finish_reason: Option<String>,
    #[schema(required = false)]
    pub truncated: Option<bool>,
}

/// A range of the window: first and last sequence shown, and how many.
#[derive(Debug, Serialize, ToSchema)]
pub struct WindowRange {
    pub first: Option<i64>,
    pub last: Option<i64>,
    pub count: i64,
}

/// The messages a window leaves out (between `after` and `before`).
#[derive(Debug, Serialize, ToSchema)]
pub struct WindowGap {
    pub after: Option<i64>,
    pub before: Option<i64>,
    pub count: i64,
}

/// Where the window's head and tail are.
#[derive(Debug, Serialize, ToSchema)]
pub struct MessageWindow {
    pub head: WindowRange,
    pub tail: WindowRange,
    pub omitted: WindowGap,
}

/// The streaming partial answer of a running run.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct StreamingView {
    pub run_id: Option<Uuid>,
    pub content: String,
    pub reasoning: String,
}

/// `GET /api/threads/{id}`: the thread window.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ThreadWindow {
    pub thread: ThreadView,
    pub messages: Vec<MessageView>,
    pub message_count: i32,
    pub message_window: MessageWindow,
    pub run: Option<RunView>,
    pub streaming_message: Option<StreamingView>,
    /// Refresh signature: equal means nothing to refetch.
    pub sig: String,
}

/// A thread's latest message, shortened.
#[derive(Debug, Serialize, ToSchema)]
pub struct Preview {
    pub role: Role,
    pub text: String,
    pub sequence: i64,
}

/// One item of `GET /api/threads`.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ThreadSummary {
    pub id: Uuid,
    pub title: String,
    pub model: Option<String>,
    pub message_count: i32,
    pub preview: Option<Preview>,
    pub run: Option<RunView>,
    pub updated_at: DateTime<Utc>,
    pub sig: String,
}

/// `GET /api/threads`.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ThreadList {
    pub threads: Vec<ThreadSummary>,
    pub next_cursor: Option<String>,
}

/// `GET /api/threads/{id}/messages`.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MessagePage {
    pub messages: Vec<MessageView>,
    pub first_sequence: Option<i64>,
    pub last_sequence: Option<i64>,
    pub has_more_before: bool,
    pub has_more_after: bool,
}

/// 202 of chat and edit: the run and the user message (null for a `pending` run, whose turn is
/// `run.input`); `deactivated` (edit only) lists the sequences the new branch replaced.
#[derive(Debug, Serialize, ToSchema)]
pub struct RunAccepted {
    pub run: RunView,
    pub message: Option<MessageView>,
    #[schema(required = false)]
    pub deactivated: Option<Vec<i64>>,
}

/// 202 of regenerate.
#[derive(Debug, Serialize, ToSchema)]
pub struct Regenerated {
    pub run: RunView,
    pub deactivated: Vec<i64>,
}

/// `DELETE /api/threads/{id}/messages/{sequence}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Deactivated {
    pub deactivated: Vec<i64>,
}

/// `POST /api/threads/{id}/cancel`.
#[derive(Debug, Serialize, ToSchema)]
pub struct CancelledRuns {
    pub runs: Vec<RunView>,
}

/// `POST /api/threads/{id}/compact`: the child thread and its compaction run.
#[derive(Debug, Serialize, ToSchema)]
pub struct Compacted {
    pub thread: ThreadView,
    pub run: RunView,
}

/// The latest snapshot in a context.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContextSnapshot {
    pub version: i32,
    pub from_sequence: i64,
    pub to_sequence: i64,
    pub tokens: i32,
}

/// A count of messages and their tokens.
#[derive(Debug, Serialize, ToSchema)]
pub struct ContextPart {
    pub messages: i64,
    pub tokens: i64,
}

/// The tail of a context.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContextTail {
    pub messages: i64,
    pub tokens: i64,
    pub from_sequence: i64,
}

/// `GET /api/threads/{id}/context` (tokens).
#[derive(Debug, Serialize, ToSchema)]
pub struct ContextView {
    pub snapshot: Option<ContextSnapshot>,
    pub instructions: ContextPart,
    pub tail: ContextTail,
    pub tools: Option<i64>,
    pub total: i64,
    pub measured: Option<i32>,
    pub limit: Option<i32>,
    pub threshold: i64,
}

/// A journal event (`id:` of SSE = `sequence`, `event:` = `kind`).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct EventView {
    pub thread_id: Uuid,
    pub sequence: i64,
    /// `thread`, `thread_deleted`, `message`, `messages_deactivated`, `run`, `streaming`,
    /// `compaction`, `approval`, `authorization`, ...
    pub kind: String,
    /// The event's payload; members over the live-event bound are left out and listed in
    /// `omitted` (`truncated: true`): re-read the thread or message.
    #[schema(value_type = Object)]
    pub payload: serde_json::Value,
    pub created_at: DateTime<Utc>,
}

/// `GET /api/threads/{id}/updates` (long-poll).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PollAnswer {
    pub events: Vec<EventView>,
    pub next_sequence: i64,
    pub reset: bool,
}

/// Approval statuses.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalStatus {
    Pending,
    Approved,
    Rejected,
    Expired,
    Cancelled,
}

/// A tool approval (`agentloop_approval_json`).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalView {
    pub id: Uuid,
    pub run_id: Uuid,
    pub thread_id: Uuid,
    pub message_sequence: i64,
    pub tool_call_id: String,
    pub tool_name: String,
    #[schema(value_type = Object)]
    pub arguments: serde_json::Value,
    /// The tool's JSON schema.
    #[schema(value_type = Object)]
    pub parameters: serde_json::Value,
    pub status: ApprovalStatus,
    #[schema(value_type = Option<Object>)]
    pub approved_arguments: Option<serde_json::Value>,
    pub arguments_edited: bool,
    pub reason: Option<String>,
    pub deadline_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub decided_at: Option<DateTime<Utc>>,
}

/// `GET /api/threads/{id}/approvals`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ApprovalList {
    pub approvals: Vec<ApprovalView>,
}

/// 200 of approve/reject.
#[derive(Debug, Serialize, ToSchema)]
pub struct Decided {
    pub approval: ApprovalView,
    pub run: RunView,
}

/// Operation statuses.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OperationStatus {
    Prepared,
    Dispatched,
    Completed,
    Failed,
    Uncertain,
}

/// An operation of the external-effects ledger (`agentloop_operation_json`).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct OperationView {
    /// `run:{runId}:call:{toolCallId}`.
    pub key: String,
    pub run_id: Uuid,
    pub thread_id: Uuid,
    pub tool_call_id: String,
    pub tool_name: String,
    #[schema(value_type = Object)]
    pub arguments: serde_json::Value,
    pub status: OperationStatus,
    pub result: Option<String>,
    pub resolution: Option<String>,
    pub dispatches: i32,
    pub lease_epoch: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub dispatched_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub resolved_at: Option<DateTime<Utc>>,
}

/// `GET /api/runs/{id}/operations`.
#[derive(Debug, Serialize, ToSchema)]
pub struct OperationList {
    pub run: RunView,
    pub operations: Vec<OperationView>,
}

/// 200 of resolve.
#[derive(Debug, Serialize, ToSchema)]
pub struct Resolved {
    pub operation: OperationView,
    pub run: RunView,
}

/// The assistant's answer in a completion.
#[derive(Debug, Serialize, ToSchema)]
pub struct CompletionMessage {
    pub role: String,
    pub content: String,
}

/// One choice of a completion.
#[derive(Debug, Serialize, ToSchema)]
pub struct CompletionChoice {
    pub index: i32,
    pub message: CompletionMessage,
    pub finish_reason: String,
}

/// Token usage of a completion.
#[derive(Debug, Serialize, ToSchema)]
pub struct CompletionUsage {
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    pub total_tokens: i64,
}

/// `POST /v1/chat/completions` answer (`chat.completion`).
#[derive(Debug, Serialize, ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    pub object: String,
    pub created: i64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: CompletionUsage,
}

/// Message content: a non-empty string, or a non-empty array of content parts
/// (`{type: "text", text}`, `{type: "image_url", image_url: {url}}`, `{type: "input_audio",
/// input_audio: {data, format}}`, `{type: "file", file: {...}}`).
pub struct ContentSchema;

impl utoipa::PartialSchema for ContentSchema {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Type};
        OneOfBuilder::new()
            .item(ObjectBuilder::new().schema_type(Type::String).min_length(Some(1)).pattern(Some("\\S")))
            .item(ArrayBuilder::new().items(ObjectBuilder::new().schema_type(Type::Object)).min_items(Some(1)))
            .description(Some("A non-empty string, or a non-empty array of content parts"))
            .into()
    }
}

impl ToSchema for ContentSchema {}

/// Stored message content: a string or an array of content parts.
pub struct StoredContent;

impl utoipa::PartialSchema for StoredContent {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Type};
        OneOfBuilder::new()
            .item(ObjectBuilder::new().schema_type(Type::String))
            .item(ArrayBuilder::new().items(ObjectBuilder::new()))
            .description(Some("A string, or an array of content parts"))
            .into()
    }
}

impl ToSchema for StoredContent {}

/// One server-sent event as the stream carries it: `event` (the kind), `data` (JSON text), `id`
/// (the journal sequence, on journal events).
#[derive(Debug, Serialize, ToSchema)]
pub struct SseEvent {
    pub event: String,
    pub data: String,
    #[schema(required = false)]
    pub id: Option<String>,
    #[schema(required = false)]
    pub retry: Option<i64>,
}

/// Event types of webhooks (`run.<status>` for these run states).
#[derive(Debug, Serialize, Deserialize, ToSchema, Clone, Copy, PartialEq, Eq)]
pub enum WebhookEvent {
    #[serde(rename = "run.completed")]
    RunCompleted,
    #[serde(rename = "run.failed")]
    RunFailed,
    #[serde(rename = "run.cancelled")]
    RunCancelled,
    #[serde(rename = "run.waiting_approval")]
    RunWaitingApproval,
    #[serde(rename = "run.waiting_authorization")]
    RunWaitingAuthorization,
    #[serde(rename = "run.blocked")]
    RunBlocked,
}

/// A webhook (never its secret).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WebhookView {
    pub id: Uuid,
    pub url: String,
    pub events: Vec<WebhookEvent>,
    pub description: String,
    pub created_at: DateTime<Utc>,
}

/// 201 of `POST /api/webhooks`: the webhook and its signing secret, shown this once.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WebhookCreated {
    pub id: Uuid,
    pub url: String,
    pub events: Vec<WebhookEvent>,
    pub description: String,
    pub created_at: DateTime<Utc>,
    /// `whsec_<base64 of 32 bytes>`: the HMAC-SHA256 key is the base64-decoded part after
    /// `whsec_` (Standard Webhooks). Shown only in this response.
    #[schema(example = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")]
    pub secret: String,
}

/// `GET /api/webhooks`.
#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookList {
    pub webhooks: Vec<WebhookView>,
}

/// Delivery statuses.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryStatus {
    Pending,
    Delivered,
    Failed,
}

/// One attempt of a delivery.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryAttemptView {
    /// 1, 2, ...
    pub attempt: i32,
    pub started_at: DateTime<Utc>,
    /// Null while it runs.
    pub finished_at: Option<DateTime<Utc>>,
    pub duration_ms: Option<i32>,
    /// The receiver's HTTP status, when it answered.
    pub status_code: Option<i32>,
    /// The start of the receiver's answer (at most 1 KiB).
    pub response_body: Option<String>,
    /// Why it did not deliver (a status, a timeout, a refused target, a worker that stopped).
    pub error: Option<String>,
}

/// A delivery of one event to one webhook.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryView {
    pub id: Uuid,
    pub webhook_id: Uuid,
    /// The `webhook-id` header of every attempt (`msg_` + the id's hex digits).
    pub message_id: String,
    pub event_type: WebhookEvent,
    pub run_id: Uuid,
    pub thread_id: Uuid,
    pub status: DeliveryStatus,
    /// Attempts started.
    pub attempts: i32,
    /// When a pending delivery is due (its next attempt, or the end of the current one's lease).
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// The event as sent: `{type, timestamp, data: {runId, threadId, status, ...}}`.
    #[schema(value_type = Object)]
    pub payload: serde_json::Value,
    pub attempt_log: Vec<DeliveryAttemptView>,
}

/// `GET /api/webhooks/{id}/deliveries`.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryList {
    pub deliveries: Vec<DeliveryView>,
    /// The `cursor` of the next page; null on the last page.
    pub next_cursor: Option<String>,
}
