//! `POST /api/threads`.

use actix_web::{HttpResponse, web};
use agentloop_shared::threads::{self, NewThread};
use diesel_async::AsyncConnection;
use serde::Deserialize;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Body: `{title?, model?, metadata?}`. `model` must be configured; `metadata` an object.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateThread {
    #[serde(default)]
    pub title: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub metadata: Option<serde_json::Value>,
}

/// Creates a thread owned by the caller -> 201 with the thread.
pub async fn create_thread(
    state: web::Data<AppState>,
    who: Authenticated,
    body: web::Json<CreateThread>,
) -> Result<HttpResponse, ApiError> {
    let body = body.into_inner();
    let metadata = body.metadata.unwrap_or_else(|| serde_json::json!({}));
    crate::validate::thread_fields(&state.catalog, body.title.as_deref(), body.model.as_deref(), Some(&metadata))?;
    let title = body.title.unwrap_or_default();
    let mut conn = state.pool.get().await?;
    let owner = who.0.id;
    let thread = (*conn)
        .transaction(async |conn| {
            threads::create(conn, owner, NewThread { title, model: body.model, metadata }).await
        })
        .await?;
    Ok(HttpResponse::Created().json(crate::views::thread_json(&thread)))
}
