//! `POST /api/threads/{id}/messages/{sequence}/edit`.

use actix_web::{HttpResponse, web};
use agentloop_shared::commands;
use serde::Deserialize;
use serde_json::Value;
use uuid::Uuid;

use super::RunOptions;
use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Body: `{content, maxSteps?, model?, repeatEffects?}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EditMessage {
    #[schema(value_type = crate::views::ContentSchema)]
    pub content: Value,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 10000)]
    pub max_steps: Option<i32>,
    #[serde(default)]
    pub model: Option<String>,
    /// See [`RunOptions::repeat_effects`].
    #[serde(default)]
    pub repeat_effects: Option<bool>,
}

/// Replaces the user message at `sequence` with new content: it and every active row after it
/// become inactive (never deleted), the new user message is appended with a higher sequence,
/// snapshots covering the old branch stop applying, and a run is enqueued like a chat post.
/// 202 `{run, message, deactivated}`. Errors: 404, 400 `not_a_user_message` /
/// `invalid_content` / `invalid_max_steps` / `unknown_model`, 409 `run_active` /
/// `approval_required` / `model_not_configured` / `effects_in_branch` (the replaced messages hold
/// tool calls that took effect or may have; `repeatEffects: true` goes ahead).
#[utoipa::path(
    post, path = "/api/threads/{id}/messages/{sequence}/edit", tag = "messages", operation_id = "edit_message",
    params(("id" = Uuid, Path, description = "Thread id"), ("sequence" = i64, Path, description = "Sequence of the user message")),
    request_body = EditMessage,
    responses((status = 202, description = "The run, the new user message and what was deactivated", body = crate::views::RunAccepted),
              (status = 400, description = "`not_a_user_message`, `invalid_content`, `invalid_max_steps`, `unknown_model`", body = crate::views::ErrorBody),
              (status = 404, description = "No such thread or message", body = crate::views::ErrorBody),
              (status = 409, description = "`run_active`, `approval_required`, `model_not_configured`, `effects_in_branch`", body = crate::views::ErrorBody),
              (status = 429, description = "`too_many_active_runs` or a rate limit", body = crate::views::ErrorBody))
)]
pub async fn edit_message(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<(Uuid, i64)>,
    body: crate::extract::Json<EditMessage>,
) -> Result<HttpResponse, ApiError> {
    let (thread_id, sequence) = path.into_inner();
    let body = body.into_inner();
    crate::validate::content(&body.content)?;
    let options = RunOptions { max_steps: body.max_steps, model: body.model.clone(), repeat_effects: body.repeat_effects }.validated(&state)?;
    let turn = crate::turn(&body.content);
    crate::validate::turn_fits(&state, who.0.id, thread_id, body.model.as_deref(), &turn).await?;
    let response = commands::edit(&state.store, who.0.id, thread_id, sequence, turn, options).await?;
    Ok(HttpResponse::Accepted().json(response))
}
