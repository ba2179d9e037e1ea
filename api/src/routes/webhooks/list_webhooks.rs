//! `GET /api/webhooks`.

use actix_web::{HttpResponse, web};
use serde_json::json;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// `{webhooks: [...]}`: the caller's webhooks, oldest first (never their secrets).
#[utoipa::path(
    get, path = "/api/webhooks", tag = "webhooks", operation_id = "list_webhooks",
    responses((status = 200, description = "The caller's webhooks", body = crate::views::WebhookList))
)]
pub async fn list_webhooks(state: web::Data<AppState>, who: Authenticated) -> Result<HttpResponse, ApiError> {
    let mut conn = state.pool.get().await?;
    let list = crate::reads::webhooks(&mut conn, json!({"principalId": who.0.id})).await?;
    Ok(HttpResponse::Ok().json(list.unwrap_or_else(|| json!({"webhooks": []}))))
}
