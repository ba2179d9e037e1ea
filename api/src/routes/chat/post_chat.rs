//! `POST /api/threads/{id}/chat` (SPEC §4, §11, §13; seed 000 "Run lifecycle").

use actix_web::{HttpRequest, HttpResponse, web};
use agentloop_shared::messages::{self, NewMessage, Provenance, role};
use agentloop_shared::receipts::{self, Claim};
use agentloop_shared::runs::{self, NewRun, status};
use agentloop_shared::{threads, tokens};
use diesel_async::AsyncConnection;
use serde::Deserialize;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Largest accepted `maxSteps`.
const MAX_STEPS_LIMIT: i32 = 10_000;

/// Body: `{content, commandId?, multitask?, maxSteps?, model?}`. `content` is a non-empty string
/// or an array of content parts (`{type:"text",text}`, ...). The idempotency key comes from the
/// `Idempotency-Key` header or `commandId` (header wins).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PostChat {
    pub content: Value,
    #[serde(default)]
    pub command_id: Option<String>,
    /// `reject` (409 `run_active` while a run is active; the default), `enqueue` (durable
    /// FIFO: the new run waits as `pending`) or `interrupt` (cancel the active run; the new run
    /// starts when it has ended). Overrides the thread's `metadata.multitask`.
    #[serde(default)]
    pub multitask: Option<String>,
    #[serde(default)]
    pub max_steps: Option<i32>,
    #[serde(default)]
    pub model: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Multitask {
    Reject,
    Enqueue,
    Interrupt,
}

fn parse_multitask(value: &str) -> Result<Multitask, ApiError> {
    match value {
        "reject" => Ok(Multitask::Reject),
        "enqueue" => Ok(Multitask::Enqueue),
        "interrupt" => Ok(Multitask::Interrupt),
        other => Err(ApiError::bad_request(
            "invalid_multitask",
            format!("multitask must be reject, enqueue or interrupt, not '{other}'"),
        )),
    }
}

/// Persists the user turn and enqueues a run in ONE transaction (message, run, journal events,
/// `pg_notify`), then answers 202 `{run, message}` at once. For a `pending` run (behind the
/// thread's active run) `message` is null and the turn is kept as `run.input` until the run is
/// promoted, so the transcript stays in conversation order.
///
/// Errors: 404 (not the caller's thread), 400 (`invalid_content`, `invalid_multitask`,
/// `invalid_max_steps`, `unknown_model`, `no_model`), 409 `run_active` (policy `reject`),
/// 409 `approval_required` (the active run waits for a tool approval), 409
/// `idempotency_conflict` (key reused with a different body).
pub async fn post_chat(
    state: web::Data<AppState>,
    who: Authenticated,
    req: HttpRequest,
    path: web::Path<Uuid>,
    body: web::Json<PostChat>,
) -> Result<HttpResponse, ApiError> {
    let thread_id = path.into_inner();
    let body = body.into_inner();
    crate::validate::content(&body.content)?;
    let requested_policy = body.multitask.as_deref().map(parse_multitask).transpose()?;
    let max_steps = body.max_steps.unwrap_or(runs::DEFAULT_MAX_STEPS);
    if !(1..=MAX_STEPS_LIMIT).contains(&max_steps) {
        return Err(ApiError::bad_request("invalid_max_steps", format!("maxSteps must be within 1..={MAX_STEPS_LIMIT}")));
    }
    crate::validate::model(&state.catalog, body.model.as_deref())?;
    let header_key = req.headers().get("Idempotency-Key").and_then(|v| v.to_str().ok()).map(str::to_owned);
    if let (Some(header), Some(body_id)) = (&header_key, &body.command_id) {
        if header != body_id {
            return Err(ApiError::bad_request(
                "idempotency_key_mismatch",
                "the Idempotency-Key header and commandId differ; send one, or the same value in both",
            ));
        }
    }
    let command_id = header_key.or(body.command_id.clone()).filter(|k| !k.is_empty());
    if command_id.as_ref().is_some_and(|k| k.len() > 200) {
        return Err(ApiError::bad_request("invalid_idempotency_key", "idempotency keys are limited to 200 characters"));
    }
    let fingerprint = receipts::fingerprint(&json!({
        "op": "chat", "thread": thread_id, "content": body.content, "multitask": body.multitask,
        "maxSteps": body.max_steps, "model": body.model,
    }));
    let principal = who.0.id;
    let default_model = state.catalog.default_model().map(|m| m.id.clone());

    let mut conn = state.pool.get().await?;
    let response = (*conn)
        .transaction(async |conn| -> Result<Value, ApiError> {
            if let Some(key) = &command_id {
                match receipts::claim(conn, principal, key, &fingerprint).await? {
                    Claim::New => {}
                    Claim::Replay(response) => return Ok(response),
                    Claim::Conflict => {
                        return Err(ApiError::conflict(
                            "idempotency_conflict",
                            "this idempotency key was already used with a different request",
                        ));
                    }
                }
            }
            runs::lock_active(conn, thread_id).await?; // lock order: active run, thread, pending runs
            let thread = threads::lock_owned(conn, thread_id, principal).await?.ok_or(ApiError::NotFound)?;
            let policy = match requested_policy {
                Some(p) => p,
                None => match thread.metadata.get("multitask").and_then(Value::as_str) {
                    Some(value) => parse_multitask(value).unwrap_or(Multitask::Reject),
                    None => Multitask::Reject,
                },
            };
            let model = body
                .model
                .clone()
                .or_else(|| thread.model.clone())
                .or(default_model.clone())
                .ok_or_else(|| ApiError::bad_request("no_model", "no model is configured on this server"))?;
            let mut active = runs::active_for_thread(conn, thread.id).await?;
            if let (Some(run), Multitask::Interrupt) = (&active, policy) {
                runs::request_cancel(conn, run.id).await?;
                active = runs::active_for_thread(conn, thread.id).await?;
            }
            let run_status = match active {
                None => status::QUEUED,
                Some(active) if active.status == status::WAITING_APPROVAL => {
                    return Err(ApiError::conflict(
                        "approval_required",
                        format!("run {} is waiting for a tool approval; approve or reject it first", active.id),
                    ));
                }
                Some(active) if policy == Multitask::Reject => {
                    return Err(ApiError::conflict(
                        "run_active",
                        format!("run {} is still {}; wait, cancel it, or send with multitask=enqueue", active.id, active.status),
                    ));
                }
                Some(_) => status::PENDING,
            };
            let text = messages::content_text(&body.content);
            let token_estimate = (4 + tokens::estimate_text(&text)) as i32;
            // A queued run's turn enters history now; a pending run's turn waits on the run row
            // and enters history when the run is promoted (after the runs ahead of it).
            let (message, input) = if run_status == status::QUEUED {
                let message = NewMessage {
                    role: role::USER.into(),
                    content: body.content.clone(),
                    tool_calls: None,
                    tool_call_id: None,
                    reasoning: None,
                    token_estimate,
                };
                let mut appended = messages::append(conn, thread.id, Provenance::default(), &[message], &[None]).await?;
                let (_, message) =
                    appended.pop().ok_or_else(|| ApiError::Internal(anyhow::anyhow!("user message not appended")))?;
                (serde_json::to_value(message).unwrap_or_default(), None)
            } else {
                (Value::Null, Some(json!({"content": body.content, "tokenEstimate": token_estimate})))
            };
            let run = runs::insert(
                conn,
                NewRun {
                    thread_id: thread.id,
                    principal_id: principal,
                    model,
                    max_steps,
                    command_id: command_id.clone(),
                    status: run_status,
                    input,
                    kind: runs::kind::AGENT,
                    source_thread_id: None,
                },
            )
            .await?;
            let response = json!({"run": run.to_json(), "message": message});
            if let Some(key) = &command_id {
                receipts::store_response(conn, principal, key, Some(thread.id), Some(run.id), &response).await?;
            }
            Ok(response)
        })
        .await?;
    let status = response["run"]["status"].as_str().unwrap_or("unknown").to_owned();
    metrics::counter!("agentloop_runs_enqueued_total", "status" => status).increment(1);
    Ok(HttpResponse::Accepted().json(response))
}
