//! `DELETE /api/threads/{id}/messages/{sequence}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::commands;
use serde::Deserialize;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Query of the delete: `repeatEffects=true` goes ahead although the group holds tool calls that
/// took effect (or may have).
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct DeleteQuery {
    /// Take a group whose calls took effect out of the conversation anyway.
    #[serde(default)]
    pub repeat_effects: Option<bool>,
}

/// Deactivates the message at `sequence` with its whole tool group (an assistant tool call and
/// its results go together; rows are never deleted). 200 `{deactivated}`. Errors: 404, 409
/// `run_active` / `approval_required` / `effects_in_branch` (the group holds tool calls that
/// took effect or may have: the model would no longer see them and may make them again;
/// `?repeatEffects=true` goes ahead — migration 000037).
#[utoipa::path(
    delete, path = "/api/threads/{id}/messages/{sequence}", tag = "messages", operation_id = "delete_message",
    params(("id" = Uuid, Path, description = "Thread id"), ("sequence" = i64, Path, description = "Sequence of the message"), DeleteQuery),
    responses((status = 200, description = "The deactivated sequences", body = crate::views::Deactivated),
              (status = 404, description = "No such thread or message", body = crate::views::ErrorBody),
              (status = 409, description = "`run_active`, `approval_required`, `effects_in_branch`", body = crate::views::ErrorBody))
)]
pub async fn delete_message(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<(Uuid, i64)>,
    query: web::Query<DeleteQuery>,
) -> Result<HttpResponse, ApiError> {
    let (thread_id, sequence) = path.into_inner();
    let repeat_effects = query.repeat_effects.unwrap_or(false);
    let body = commands::delete_message(&state.store, who.0.id, thread_id, sequence, repeat_effects).await?;
    Ok(HttpResponse::Ok().json(body))
}
