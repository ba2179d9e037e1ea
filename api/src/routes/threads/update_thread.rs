//! `PATCH /api/threads/{id}`.

use actix_web::{HttpResponse, web};
use serde::Deserialize;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Body: `{title?, model?, metadata?}`; `metadata` replaces the whole object.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UpdateThread {
    #[serde(default)]
    #[schema(max_length = 500)]
    pub title: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    /// Replaces the whole object.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Value>,
}

/// Renames the thread or changes its model or metadata (compaction knobs, multitask policy).
/// 200 with the thread. Errors: 404, 400 `invalid_title` / `unknown_model` / `invalid_metadata`.
#[utoipa::path(
    patch, path = "/api/threads/{id}", tag = "threads", operation_id = "update_thread",
    params(("id" = uuid::Uuid, Path, description = "Thread id")),
    request_body = UpdateThread,
    responses((status = 200, description = "The thread", body = crate::views::ThreadView),
              (status = 400, description = "`invalid_title`, `unknown_model`, `invalid_metadata`", body = crate::views::ErrorBody),
              (status = 404, description = "Not the caller's thread", body = crate::views::ErrorBody))
)]
pub async fn update_thread(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<uuid::Uuid>,
    body: crate::extract::Json<UpdateThread>,
) -> Result<HttpResponse, ApiError> {
    let body = body.into_inner();
    crate::validate::thread_fields(&state.catalog, body.title.as_deref(), body.model.as_deref(), body.metadata.as_ref())?;
    let thread = agentloop_shared::commands::update_thread(&state.store, who.0.id, path.into_inner(), body.title, body.model, body.metadata).await?;
    Ok(HttpResponse::Ok().json(thread))
}
