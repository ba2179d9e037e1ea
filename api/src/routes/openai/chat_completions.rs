//! `POST /v1/chat/completions` — a stateless OpenAI-compatible call through the same durable
//! tool loop (SPEC §13).
//!
//! The request's messages become the canonical history of a hidden, owner-scoped thread; a run
//! is enqueued exactly like a chat post and executed by a worker (the api never calls a model);
//! the handler waits on the thread's journal for the run to end and answers with a
//! `chat.completion` object. The thread is then soft-deleted. There is no durable checkpoint to
//! resume from on the caller's side, so a run that would need a second slice (the per-slice
//! tool-call limit) fails with `max_iterations` instead (seed 000: "Stateless API calls still
//! receive the original terminal maximum-iterations error"), and a tool that needs approval
//! fails closed.

use std::time::Duration;

use actix_web::{HttpResponse, web};
use agentloop_shared::messages::{self, NewMessage, Provenance, role};
use agentloop_shared::runs::{self, NewRun, status};
use agentloop_shared::threads::{self, NewThread};
use agentloop_shared::tokens;
use diesel_async::AsyncConnection;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Longest wait for the run, in seconds.
const MAX_WAIT: Duration = Duration::from_secs(600);

/// The subset of the OpenAI request that matters here; other fields are accepted and ignored.
#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: Option<String>,
    pub messages: Vec<Value>,
    #[serde(default)]
    pub stream: bool,
}

/// Runs the conversation in `messages` to its final answer. 200 `chat.completion`; errors in
/// the OpenAI-compatible envelope of this API: 400 `invalid_messages` / `unknown_model` /
/// `stream_unsupported`, 502 `run_failed` (with the run's error code in the message), 504
/// `timeout`.
pub async fn chat_completions(
    state: web::Data<AppState>,
    who: Authenticated,
    body: web::Json<ChatCompletionRequest>,
) -> Result<HttpResponse, ApiError> {
    let body = body.into_inner();
    if body.stream {
        return Err(ApiError::bad_request("stream_unsupported", "stream: true is not supported here; use the thread API's SSE"));
    }
    let history = to_history(&body.messages)?;
    let model = match body.model.as_deref() {
        Some(m) if state.catalog.get(m).is_some() => m.to_owned(),
        Some(m) => return Err(ApiError::bad_request("unknown_model", format!("model '{m}' is not configured"))),
        None => state
            .catalog
            .default_model()
            .map(|m| m.id.clone())
            .ok_or_else(|| ApiError::bad_request("no_model", "no model is configured on this server"))?,
    };
    let principal = who.0.id;
    let mut conn = state.pool.get().await?;
    let (thread, run) = (*conn)
        .transaction(async |conn| -> Result<_, ApiError> {
            let thread = threads::create(
                conn,
                principal,
                NewThread { title: "stateless".into(), model: Some(model.clone()), metadata: json!({"stateless": true}) },
            )
            .await?;
            let identities = vec![None; history.len()];
            messages::append(conn, thread.id, Provenance::default(), &history, &identities).await?;
            let run = runs::insert(
                conn,
                NewRun {
                    thread_id: thread.id,
                    principal_id: principal,
                    model: model.clone(),
                    max_steps: 1,
                    command_id: None,
                    status: status::QUEUED,
                    input: None,
                    kind: runs::kind::AGENT,
                    source_thread_id: None,
                },
            )
            .await?;
            Ok((thread, run))
        })
        .await?;
    drop(conn);
    let mut wake = state.hub.subscribe(thread.id);
    let deadline = tokio::time::Instant::now() + MAX_WAIT;
    let finished = loop {
        wake.borrow_and_update();
        let mut conn = state.pool.get().await?;
        let mut current = runs::get(&mut conn, run.id).await?;
        if matches!(current.status.as_str(), status::BLOCKED | status::WAITING_APPROVAL) {
            // Nobody can resolve it for a stateless caller: end the run, keep its error.
            let error = (current.error_code.clone(), current.error_message.clone());
            current = (*conn).transaction(async |conn| runs::request_cancel(conn, run.id).await).await?;
            (current.error_code, current.error_message) = error;
            current.error_code.get_or_insert_with(|| "operation_uncertain".into());
        }
        if current.is_terminal() {
            break current;
        }
        drop(conn);
        tokio::select! {
            _ = wake.changed() => {}
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            _ = tokio::time::sleep_until(deadline) => {
                let mut conn = state.pool.get().await?;
                (*conn).transaction(async |conn| runs::request_cancel(conn, run.id).await).await?;
                return Err(ApiError::Unavailable { code: "timeout", message: "the run did not finish in time".into() });
            }
        }
    };
    let mut conn = state.pool.get().await?;
    let answer = messages::active_after(&mut conn, thread.id, 0).await?.into_iter().rev().find(|m| m.role == role::ASSISTANT);
    (*conn).transaction(async |conn| threads::soft_delete(conn, thread.id).await).await?;
    if finished.status != status::COMPLETED {
        let code = match finished.error_code.as_deref() {
            Some("budget_exhausted") => "max_iterations",
            Some(other) => other,
            None => finished.status.as_str(),
        };
        return Err(ApiError::RunFailed {
            code: code.to_owned(),
            message: finished.error_message.clone().unwrap_or_else(|| format!("the run ended {}", finished.status)),
        });
    }
    let content = answer.map(|m| m.text()).unwrap_or_default();
    Ok(HttpResponse::Ok().json(json!({
        "id": format!("chatcmpl-{}", run.id.simple()),
        "object": "chat.completion",
        "created": finished.created_at.timestamp(),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": finished.prompt_tokens,
            "completion_tokens": finished.completion_tokens,
            "total_tokens": finished.prompt_tokens + finished.completion_tokens,
        },
    })))
}

/// Validates and converts OpenAI messages into canonical rows.
fn to_history(messages: &[Value]) -> Result<Vec<NewMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_request("invalid_messages", "messages must not be empty"));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let r = m.get("role").and_then(Value::as_str).unwrap_or_default();
            if ![role::SYSTEM, role::DEVELOPER, role::USER, role::ASSISTANT, role::TOOL].contains(&r) {
                return Err(ApiError::bad_request("invalid_messages", format!("messages[{i}].role is not a chat role")));
            }
            let content = m.get("content").cloned().unwrap_or(Value::Null);
            let tool_calls = m.get("tool_calls").cloned().filter(|c| c.is_array());
            let text = messages::content_text(&content);
            Ok(NewMessage {
                role: r.to_owned(),
                token_estimate: tokens::estimate_message(&content, tool_calls.as_ref()) as i32,
                content: if content.is_null() { Value::String(text) } else { content },
                tool_calls,
                tool_call_id: m.get("tool_call_id").and_then(Value::as_str).map(str::to_owned),
                reasoning: None,
            })
        })
        .collect()
}
