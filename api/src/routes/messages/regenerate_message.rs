//! `POST /api/threads/{id}/messages/{sequence}/regenerate`.

use actix_web::{HttpResponse, web};
use agentloop_shared::commands;
use uuid::Uuid;

use super::RunOptions;
use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// A new answer from `sequence`: for a user message, everything after it is deactivated; for an
/// assistant or tool message, its whole tool group and everything after it. A run is enqueued
/// (no user message is invented). Body (optional): `{maxSteps?, model?, repeatEffects?}`. 202
/// `{run, deactivated}`. Errors: 404, 400 `invalid_max_steps` / `unknown_model`, 409
/// `run_active` / `approval_required` / `model_not_configured` / `effects_in_branch` (the
/// replaced messages hold tool calls that took effect or may have, and a new answer may call
/// them again; `repeatEffects: true` goes ahead — migration 000037).
#[utoipa::path(
    post, path = "/api/threads/{id}/messages/{sequence}/regenerate", tag = "messages", operation_id = "regenerate_message",
    params(("id" = Uuid, Path, description = "Thread id"), ("sequence" = i64, Path, description = "Sequence to answer again from")),
    request_body(content = Option<RunOptions>, description = "Optional run settings"),
    responses((status = 202, description = "The run and what was deactivated", body = crate::views::Regenerated),
              (status = 400, description = "`invalid_max_steps`, `unknown_model`", body = crate::views::ErrorBody),
              (status = 404, description = "No such thread or message", body = crate::views::ErrorBody),
              (status = 409, description = "`run_active`, `approval_required`, `model_not_configured`, `effects_in_branch`", body = crate::views::ErrorBody),
              (status = 429, description = "`too_many_active_runs` or a rate limit", body = crate::views::ErrorBody))
)]
pub async fn regenerate_message(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<(Uuid, i64)>,
    body: crate::extract::OptionalJson<RunOptions>,
) -> Result<HttpResponse, ApiError> {
    let (thread_id, sequence) = path.into_inner();
    let options = body.0.unwrap_or_default().validated(&state)?;
    let response = commands::regenerate(&state.store, who.0.id, thread_id, sequence, options).await?;
    Ok(HttpResponse::Accepted().json(response))
}
