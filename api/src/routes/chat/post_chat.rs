//! `POST /api/threads/{id}/chat` (SPEC §4, §11, §13; seed 000 "Run lifecycle").

use actix_web::{HttpRequest, HttpResponse, web};
use agentloop_shared::{commands, receipts, runs};
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
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PostChat {
    #[schema(value_type = crate::views::ContentSchema)]
    pub content: Value,
    #[serde(default)]
    #[schema(max_length = 200)]
    pub command_id: Option<String>,
    /// `reject` (409 `run_active` while a run is active; the default), `enqueue` (durable
    /// FIFO: the new run waits as `pending`) or `interrupt` (cancel the active run; the new run
    /// starts when it has ended). Overrides the thread's `metadata.multitask`.
    #[serde(default)]
    #[schema(pattern = "^(reject|enqueue|interrupt)$")]
    pub multitask: Option<String>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 10000)]
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

/// Persists the user turn and enqueues a run in ONE transaction (`agentloop_chat`: receipt,
/// message, run, journal events, `pg_notify`), then answers 202 `{run, message}` at once. For a `pending` run (behind the
/// thread's active run) `message` is null and the turn is kept as `run.input` until the run is
/// promoted, so the transcript stays in conversation order.
///
/// Errors: 404 (not the caller's thread), 400 (`invalid_content`, `invalid_multitask`,
/// `invalid_max_steps`, `unknown_model`, `no_model`), 409 `run_active` (policy `reject`),
/// 409 `approval_required` (the active run waits for a tool approval), 409
/// `idempotency_conflict` (key reused with a different body), 409 `model_not_configured` (the
/// thread's model is not configured on this server; the message names the configured ones),
/// 413 `turn_too_large` (more tokens than the model accepts in one turn: `GET /api/models`
/// `maxInputTokens`; nothing is stored), 503 `database_unavailable` /
/// `outcome_unknown`.
#[utoipa::path(
    post, path = "/api/threads/{id}/chat", tag = "chat", operation_id = "post_chat",
    params(("id" = Uuid, Path, description = "Thread id"),
           ("Idempotency-Key" = Option<String>, Header, description = "Idempotency key (at most 200 characters); an identical retry replays the first answer")),
    request_body = PostChat,
    responses((status = 202, description = "The run (and the user message unless the run is pending)", body = crate::views::RunAccepted),
              (status = 400, description = "`invalid_content`, `invalid_multitask`, `invalid_max_steps`, `unknown_model`, `no_model`, `invalid_idempotency_key`", body = crate::views::ErrorBody),
              (status = 404, description = "Not the caller's thread", body = crate::views::ErrorBody),
              (status = 409, description = "`run_active`, `approval_required`, `idempotency_conflict`, `model_not_configured`", body = crate::views::ErrorBody),
              (status = 429, description = "`too_many_active_runs`, `too_many_queued_turns` or a rate limit", body = crate::views::ErrorBody))
)]
pub async fn post_chat(
    state: web::Data<AppState>,
    who: Authenticated,
    req: HttpRequest,
    path: web::Path<Uuid>,
    body: crate::extract::Json<PostChat>,
) -> Result<HttpResponse, ApiError> {
    let header_key = crate::extract::idempotency_key(&req)?;
    let response = submit(&state, who.0.id, path.into_inner(), body.into_inner(), header_key).await?;
    Ok(HttpResponse::Accepted().json(response))
}

/// The chat command itself (validation, idempotency key, one `agentloop_chat` call), shared by
/// the HTTP route and the MCP tool `send_message`. `header_key` is the `Idempotency-Key` header
/// (it must equal `commandId` when both are given). Returns `{run, message}`.
pub async fn submit(state: &AppState, principal: Uuid, thread_id: Uuid, body: PostChat, header_key: Option<String>) -> Result<serde_json::Value, ApiError> {
    crate::validate::content(&body.content)?;
    let requested_policy = body.multitask.as_deref().map(parse_multitask).transpose()?;
    let max_steps = body.max_steps.unwrap_or(runs::DEFAULT_MAX_STEPS);
    if !(1..=MAX_STEPS_LIMIT).contains(&max_steps) {
        return Err(ApiError::bad_request("invalid_max_steps", format!("maxSteps must be within 1..={MAX_STEPS_LIMIT}")));
    }
    crate::validate::model(&state.catalog, body.model.as_deref())?;
    if let (Some(header), Some(body_id)) = (&header_key, &body.command_id)
        && header != body_id
    {
        return Err(ApiError::bad_request(
            "idempotency_key_mismatch",
            "the Idempotency-Key header and commandId differ; send one, or the same value in both",
        ));
    }
    let command_id = header_key.or(body.command_id.clone());
    if let Some(key) = &command_id {
        crate::extract::check_idempotency_key(key)?;
    }
    let fingerprint = receipts::fingerprint(&json!({
        "op": "chat", "thread": thread_id, "content": body.content, "multitask": body.multitask,
        "maxSteps": body.max_steps, "model": body.model,
    }));
    let multitask = requested_policy.map(|p| match p {
        Multitask::Reject => "reject",
        Multitask::Enqueue => "enqueue",
        Multitask::Interrupt => "interrupt",
    });
    let turn = crate::turn(&body.content);
    crate::validate::turn_fits(state, principal, thread_id, body.model.as_deref(), &turn).await?;
    let command = commands::Chat {
        principal_id: principal,
        thread_id,
        command_id,
        fingerprint,
        turn,
        multitask,
        max_steps,
        model: state.model_choice(body.model.clone()),
    };
    let response = commands::chat(&state.store, &command).await?;
    let status = response["run"]["status"].as_str().unwrap_or("unknown").to_owned();
    metrics::counter!("agentloop_runs_enqueued_total", "status" => status).increment(1);
    Ok(response)
}
