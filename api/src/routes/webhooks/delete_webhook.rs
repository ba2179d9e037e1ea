//! `DELETE /api/webhooks/{id}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::store::Replay;
use serde_json::json;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Deletes the webhook and its deliveries (pending ones are not sent; an attempt in flight
/// may still arrive). 204; 404 for another principal's webhook.
#[utoipa::path(
    delete, path = "/api/webhooks/{id}", tag = "webhooks", operation_id = "delete_webhook",
    params(("id" = Uuid, Path, description = "Webhook id")),
    responses((status = 204, description = "Deleted"),
              (status = 404, description = "Not the caller's webhook", body = crate::views::ErrorBody))
)]
pub async fn delete_webhook(state: web::Data<AppState>, who: Authenticated, path: web::Path<Uuid>) -> Result<HttpResponse, ApiError> {
    let arg = json!({"principalId": who.0.id, "id": path.into_inner()});
    state.store.call("agentloop_webhook_delete", &arg, Replay::Unsafe, None).await?;
    Ok(HttpResponse::NoContent().finish())
}
