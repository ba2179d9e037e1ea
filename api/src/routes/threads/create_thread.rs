//! `POST /api/threads`.

use actix_web::{HttpResponse, web};
use serde::Deserialize;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Body: `{title?, model?, metadata?}`. `model` must be configured; `metadata` an object.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateThread {
    #[serde(default)]
    #[schema(max_length = 500)]
    pub title: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Value>,
}

/// Creates a thread owned by the caller -> 201 with the thread. Without a title its metadata
/// gets `autoTitle: true` (unless given): the first answer then titles it.
#[utoipa::path(
    post, path = "/api/threads", tag = "threads", operation_id = "create_thread",
    request_body = CreateThread,
    responses((status = 201, description = "The thread", body = crate::views::ThreadView),
              (status = 400, description = "`invalid_title`, `unknown_model`, `invalid_metadata`", body = crate::views::ErrorBody),
              (status = 429, description = "`too_many_threads` or a rate limit", body = crate::views::ErrorBody))
)]
pub async fn create_thread(
    state: web::Data<AppState>,
    who: Authenticated,
    body: crate::extract::Json<CreateThread>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Created().json(create(&state, who.0.id, body.into_inner()).await?))
}

/// Creation itself (shared with the MCP tool `create_thread`). Returns the thread.
pub async fn create(state: &AppState, principal: uuid::Uuid, body: CreateThread) -> Result<serde_json::Value, ApiError> {
    let mut metadata = body.metadata.unwrap_or_else(|| serde_json::json!({}));
    // An untitled thread is titled automatically after its first answer (worker/src/title.rs);
    // the marker lets the worker know without a query (cleared when the title is written).
    if body.title.as_deref().is_none_or(|t| t.trim().is_empty())
        && let Some(obj) = metadata.as_object_mut()
    {
        obj.entry("autoTitle").or_insert(serde_json::Value::Bool(true));
    }
    crate::validate::thread_fields(&state.catalog, body.title.as_deref(), body.model.as_deref(), Some(&metadata))?;
    Ok(agentloop_shared::commands::create_thread(&state.store, principal, body.title.unwrap_or_default(), body.model, metadata).await?)
}
