//! `stream: true` of `POST /v1/chat/completions`: the hidden thread's journal turned into
//! `chat.completion.chunk` server-sent events (issue 12, part 1).
//!
//! The pump follows the thread's journal through the process's hub (the same reads as the
//! thread SSE route): `streaming` deltas of the run's partial answer become `delta.content`
//! chunks as the worker flushes them (every `WORKER_STREAM_THROTTLE_MS`); each committed
//! assistant message is authoritative for its model call, so whatever of its text was not
//! streamed yet is sent then; the text of successive model calls (before and after a server-side
//! tool call) is separated by a blank line, exactly as the non-streaming `content`. Server-side
//! tool calls are never sent. At the run's end: client-side calls as one `delta.tool_calls`
//! chunk, the final chunk with `finish_reason` (`stop` | `tool_calls`, or the provider's own
//! when it cut the last answer: `length`, `content_filter`), the `usage` chunk when
//! `stream_options.include_usage` (`choices: []`), then `data: [DONE]`. A run that fails sends
//! one `data: {"error": {...}}` event (the SDKs raise it) and the stream ends.
//!
//! A partial answer that restarts with different text (a worker died mid-stream and the
//! recovered attempt's model answered differently) cannot be taken back: the stream ends with
//! an error `stream_restarted` and the run is cancelled. When the client disconnects, the pump
//! sees its channel closed and drops the request: the run is cancelled and the hidden thread
//! deleted ([`super::hidden`]).

use std::time::Duration;

use actix_web::web;
use actix_web_lab::sse;
use agentloop_shared::events::kind;
use agentloop_shared::messages::{content_text, role};
use agentloop_shared::runs::status;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::hidden::HiddenRequest;
use crate::AppState;
use crate::routes::updates::Batch;

/// Assistant message `sequence` of the hidden thread as the journal would carry it whole.
async fn whole_message(pool: &agentloop_shared::db::PgPool, thread_id: uuid::Uuid, sequence: Option<i64>) -> anyhow::Result<Value> {
    let sequence = sequence.ok_or_else(|| anyhow::anyhow!("the slimmed message has no sequence"))?;
    let mut conn = pool.get().await?;
    let message = agentloop_shared::messages::active_in_range(&mut conn, thread_id, sequence, sequence)
        .await?
        .pop()
        .ok_or_else(|| anyhow::anyhow!("message {sequence} is not there"))?;
    Ok(serde_json::to_value(&message)?)
}

/// Builds the chunks of one completion.
pub struct Chunker {
    /// `chatcmpl-<run id>`.
    pub id: String,
    /// Unix seconds.
    pub created: i64,
    pub model: String,
    pub include_usage: bool,
}

impl Chunker {
    /// The chunker of `run_id`'s completion, created now.
    pub fn new(run_id: uuid::Uuid, model: &str, include_usage: bool) -> Self {
        Self { id: format!("chatcmpl-{}", run_id.simple()), created: chrono::Utc::now().timestamp(), model: model.to_owned(), include_usage }
    }

    fn event(value: &Value) -> sse::Event {
        sse::Event::Data(sse::Data::new(value.to_string()))
    }

    /// A `chat.completion.chunk` with one choice.
    pub fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> sse::Event {
        let mut chunk = json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "system_fingerprint": null,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
        });
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        Self::event(&chunk)
    }

    /// The chunk of a completion's client-side `calls` (`{id, type, function}`), each with its
    /// `index`.
    pub fn tool_calls(&self, calls: &[Value]) -> sse::Event {
        let calls: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(i, c)| json!({"index": i, "id": c["id"], "type": "function", "function": c["function"]}))
            .collect();
        self.chunk(json!({"tool_calls": calls}), None)
    }

    /// The usage chunk (`choices: []`).
    pub fn usage(&self, prompt: i64, completion: i64) -> sse::Event {
        Self::event(&json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "system_fingerprint": null, "choices": [], "usage": super::chat_completions::usage(prompt, completion),
        }))
    }

    /// An error event in OpenAI's shape.
    pub fn error(code: &str, message: &str) -> sse::Event {
        Self::event(&json!({"error": {"message": message, "type": "server_error", "param": null, "code": code}}))
    }
}

/// The text of the current model call as sent so far, and whether anything was sent before it.
#[derive(Default)]
struct Text {
    /// The partial answer of the current model call, as the journal has it.
    partial: String,
    /// What was sent of the current model call.
    sent: String,
    /// Some text of an earlier model call was sent (the next call's text starts with a blank line).
    any: bool,
    /// A streaming event of the current model call came slimmed (its delta cut to the live
    /// event bound): `partial` is not the journal's any more, so the call's later deltas are
    /// left for its committed message.
    stale: bool,
}

enum Progress {
    /// Text to send (possibly empty).
    Send(String),
    /// The answer restarted with other text.
    Diverged,
}

impl Text {
    /// What to send given the current call's text `full`.
    fn advance(&mut self, full: &str) -> Progress {
        if let Some(rest) = full.strip_prefix(self.sent.as_str()) {
            if rest.is_empty() {
                return Progress::Send(String::new());
            }
            let out = if self.sent.is_empty() && self.any { format!("\n\n{rest}") } else { rest.to_owned() };
            self.sent = full.to_owned();
            self.any = true;
            Progress::Send(out)
        } else if self.sent.starts_with(full) {
            Progress::Send(String::new()) // a restarted stream catching up with what was sent
        } else {
            Progress::Diverged
        }
    }

    /// The current model call ended (its message was committed).
    fn end_call(&mut self) {
        self.partial.clear();
        self.sent.clear();
        self.stale = false;
    }
}

/// How the run ended, as the journal's `run` event says.
enum End {
    Completed { prompt: i64, completion: i64 },
    Failed { code: String, message: String },
}

/// Feeds one streaming client until the run ends or the client goes away (see the module docs).
pub async fn pump(state: web::Data<AppState>, request: HiddenRequest, chunker: Chunker, tx: mpsc::Sender<sse::Event>) {
    let run_id = request.run_id.to_string();
    let thread_id = request.thread_id;
    if tx.send(chunker.chunk(json!({"role": "assistant", "content": ""}), None)).await.is_err() {
        return;
    }
    let mut wake = state.hub.subscribe(thread_id);
    let deadline = tokio::time::Instant::now() + super::chat_completions::MAX_WAIT;
    let mut cursor = 0i64;
    let mut text = Text::default();
    let mut client_calls: Vec<Value> = Vec::new();
    // The provider's `finish_reason` when it cut the last answer (`length`, ...).
    let mut cut: Option<String> = None;
    let mut end: Option<End> = None;
    'outer: loop {
        wake.borrow_and_update();
        let events = match state.hub.next_batch(&state.pool, thread_id, cursor).await {
            Ok(Batch::Events(events)) => events,
            Ok(Batch::Reset { sequence }) => {
                cursor = sequence;
                Vec::new()
            }
            Err(error) => {
                tracing::warn!(%error, "journal read for an OpenAI stream failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => continue,
                    _ = tx.closed() => return,
                }
            }
        };
        let full_batch = events.len() as i64 == crate::routes::updates::BATCH;
        for event in events {
            let mut whole = None;
            let mut p = &event.payload;
            let mine = p.get("runId").and_then(Value::as_str) == Some(run_id.as_str());
            // A live event larger than LIVE_EVENT_MAX_BYTES comes slimmed (`truncated`): an
            // assistant message is read again whole; its text was taken for a restarted answer
            // and every answer over 64 KiB ended `stream_restarted` (acceptance probe N, N-10).
            if mine && event.kind == kind::MESSAGE && p.get("truncated") == Some(&Value::Bool(true)) {
                match whole_message(&state.pool, thread_id, p.get("sequence").and_then(Value::as_i64)).await {
                    Ok(message) => whole = Some(message),
                    Err(error) => {
                        tracing::warn!(%error, "reading a slimmed message for an OpenAI stream failed; retrying");
                        tokio::select! {
                            _ = tokio::time::sleep(Duration::from_millis(500)) => continue 'outer,
                            _ = tx.closed() => return,
                        }
                    }
                }
            }
            if let Some(message) = &whole {
                p = message;
            }
            cursor = event.sequence;
            let progress = match event.kind.as_str() {
                kind::STREAMING if mine => {
                    if p.get("truncated") == Some(&Value::Bool(true)) {
                        text.stale = true;
                    }
                    if text.stale {
                        None
                    } else {
                        if let (Some(offset), Some(delta)) = (p.get("offset").and_then(Value::as_u64), p.get("delta").and_then(Value::as_str)) {
                            agentloop_shared::streaming::apply_delta(&mut text.partial, offset as usize, delta);
                        }
                        let partial = text.partial.clone();
                        Some(text.advance(&partial))
                    }
                }
                kind::MESSAGE if mine && p.get("role").and_then(Value::as_str) == Some(role::ASSISTANT) => {
                    let progress = text.advance(&content_text(&p["content"]));
                    text.end_call();
                    cut = p.get("finishReason").and_then(Value::as_str).map(str::to_owned);
                    let calls = super::chat_completions::client_calls(p.get("toolCalls"));
                    if !calls.is_empty() {
                        client_calls = calls;
                    }
                    Some(progress)
                }
                kind::RUN if p.get("id").and_then(Value::as_str) == Some(run_id.as_str()) => {
                    match p.get("status").and_then(Value::as_str).unwrap_or_default() {
                        status::COMPLETED => {
                            end = Some(End::Completed {
                                prompt: p["promptTokens"].as_i64().unwrap_or(0),
                                completion: p["completionTokens"].as_i64().unwrap_or(0),
                            });
                        }
                        s @ (status::FAILED | status::CANCELLED) => {
                            let code = match p.pointer("/error/code").and_then(Value::as_str) {
                                Some("budget_exhausted") => "max_iterations".to_owned(),
                                Some(c) => c.to_owned(),
                                None => s.to_owned(),
                            };
                            let message = p.pointer("/error/message").and_then(Value::as_str).unwrap_or("the run did not complete").to_owned();
                            end = Some(End::Failed { code, message });
                        }
                        s @ (status::WAITING_APPROVAL | status::BLOCKED) => {
                            // Nobody can resolve it for a stateless caller.
                            let _ = agentloop_shared::commands::openai_cancel(&state.store, request.principal, request.thread_id).await;
                            let code = p.pointer("/error/code").and_then(Value::as_str).unwrap_or(s).to_owned();
                            let message = p
                                .pointer("/error/message")
                                .and_then(Value::as_str)
                                .unwrap_or("the run needs a human decision, which a stateless request cannot give")
                                .to_owned();
                            let message = if code == "operation_uncertain" {
                                super::uncertain_message(&message, request.thread_id, request.run_id)
                            } else {
                                message
                            };
                            end = Some(End::Failed { code, message });
                        }
                        _ => {}
                    }
                    None
                }
                _ => None,
            };
            let delta = match progress {
                Some(Progress::Send(delta)) if !delta.is_empty() => Some(delta),
                Some(Progress::Diverged) => {
                    let _ = tx
                        .send(Chunker::error(
                            "stream_restarted",
                            "the answer was restarted after a worker failure and differs from what was already streamed",
                        ))
                        .await;
                    return; // dropping the request cancels the run and deletes the thread
                }
                _ => None,
            };
            if let Some(delta) = delta
                && tx.send(chunker.chunk(json!({"content": delta}), None)).await.is_err()
            {
                return;
            }
            if end.is_some() {
                break 'outer;
            }
        }
        if full_batch {
            continue;
        }
        tokio::select! {
            changed = wake.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            _ = tx.closed() => return,
            _ = tokio::time::sleep_until(deadline) => {
                let _ = tx.send(Chunker::error("timeout", "the run did not finish in time")).await;
                return;
            }
        }
    }
    let answered = matches!(end, Some(End::Completed { .. }));
    // A keyed request's outcome, for resends of its key: what a non-streaming request would
    // have answered, read the same way (`ended`).
    let response = match &end {
        Some(ended) if request.keyed() => {
            let result = match ended {
                End::Completed { .. } => match super::chat_completions::run_of(&state.pool, request.run_id).await {
                    Ok(run) => super::chat_completions::ended(&state.pool, &state.store, &chunker, request.thread_id, request.run_id, &run).await,
                    Err(e) => Err(e),
                },
                End::Failed { code, message } => Err(super::V1Error {
                    status: actix_web::http::StatusCode::BAD_GATEWAY,
                    code: code.clone(),
                    message: message.clone(),
                    param: None,
                }),
            };
            Some(super::chat_completions::recorded(&result))
        }
        _ => None,
    };
    match end {
        Some(End::Completed { prompt, completion }) => {
            let mut events = Vec::new();
            if !client_calls.is_empty() {
                // Noted before they are returned (migration 000038), unless a keyed request's
                // `ended` above did it already.
                if response.is_none()
                    && let Err(error) = agentloop_shared::commands::openai_note_client_calls(&state.store, request.thread_id).await
                {
                    tracing::warn!(thread_id = %request.thread_id, %error, "could not note the client calls; the next request will not see this run's server calls");
                }
                events.push(chunker.tool_calls(&client_calls));
            }
            let finish = if client_calls.is_empty() { cut.as_deref().unwrap_or("stop") } else { "tool_calls" };
            events.push(chunker.chunk(json!({}), Some(finish)));
            if chunker.include_usage {
                events.push(chunker.usage(prompt, completion));
            }
            events.push(sse::Event::Data(sse::Data::new("[DONE]")));
            for event in events {
                if tx.send(event).await.is_err() {
                    break;
                }
            }
        }
        Some(End::Failed { code, message }) => {
            let _ = tx.send(Chunker::error(&code, &message)).await;
        }
        None => {}
    }
    request.finish(answered, response).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(p: Progress) -> String {
        match p {
            Progress::Send(s) => s,
            Progress::Diverged => "<diverged>".into(),
        }
    }

    #[test]
    fn text_of_successive_model_calls_is_sent_once_with_a_separator() {
        let mut t = Text::default();
        assert_eq!(sent(t.advance("Let me")), "Let me");
        assert_eq!(sent(t.advance("Let me check.")), " check.");
        assert_eq!(sent(t.advance("Let me check.")), "");
        t.end_call();
        assert_eq!(sent(t.advance("")), "", "a call with no text sends nothing");
        t.end_call();
        assert_eq!(sent(t.advance("It is")), "\n\nIt is");
        assert_eq!(sent(t.advance("It")), "", "a restart catching up");
        assert_eq!(sent(t.advance("It is 42.")), " 42.");
        assert_eq!(sent(t.advance("No, wait")), "<diverged>");
    }
}
