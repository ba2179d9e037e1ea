//! `PATCH /api/threads/{id}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::{events, threads};
use diesel_async::AsyncConnection;
use serde::Deserialize;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;
use crate::views;

/// Body: `{title?, model?, metadata?}`; `metadata` replaces the whole object.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UpdateThread {
    #[serde(default)]
    pub title: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub metadata: Option<serde_json::Value>,
}

/// Renames the thread or changes its model or metadata (compaction knobs, multitask policy).
/// 200 with the thread. Errors: 404, 400 `invalid_title` / `unknown_model` / `invalid_metadata`.
pub async fn update_thread(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<uuid::Uuid>,
    body: web::Json<UpdateThread>,
) -> Result<HttpResponse, ApiError> {
    let body = body.into_inner();
    crate::validate::thread_fields(&state.catalog, body.title.as_deref(), body.model.as_deref(), body.metadata.as_ref())?;
    let (id, owner) = (path.into_inner(), who.0.id);
    let mut conn = state.pool.get().await?;
    let thread = (*conn)
        .transaction(async |conn| -> Result<_, ApiError> {
            threads::lock_owned(conn, id, owner).await?.ok_or(ApiError::NotFound)?;
            let thread = threads::update(conn, id, body.title, body.model, body.metadata).await?;
            events::append(conn, id, events::kind::THREAD, &views::thread_json(&thread)).await?;
            Ok(thread)
        })
        .await?;
    Ok(HttpResponse::Ok().json(views::thread_json(&thread)))
}
