//! `GET /api/webhooks/{id}`.

use actix_web::{HttpResponse, web};
use serde_json::json;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// The webhook (never its secret). 404 for another principal's webhook.
#[utoipa::path(
    get, path = "/api/webhooks/{id}", tag = "webhooks", operation_id = "get_webhook",
    params(("id" = Uuid, Path, description = "Webhook id")),
    responses((status = 200, description = "The webhook", body = crate::views::WebhookView),
              (status = 404, description = "Not the caller's webhook", body = crate::views::ErrorBody))
)]
pub async fn get_webhook(state: web::Data<AppState>, who: Authenticated, path: web::Path<Uuid>) -> Result<HttpResponse, ApiError> {
    let mut conn = state.pool.get().await?;
    let webhook = crate::reads::webhooks(&mut conn, json!({"principalId": who.0.id, "id": path.into_inner()})).await?;
    Ok(HttpResponse::Ok().json(webhook.ok_or(ApiError::NotFound)?))
}
