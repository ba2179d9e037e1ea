//! `GET /api/webhooks/{id}/deliveries?status=&limit=&cursor=`.

use actix_web::{HttpResponse, web};
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Query: `status` (`pending|delivered|failed`; default all), `limit` (1..=200, default 50) and
/// `cursor` (the previous page's `nextCursor`).
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DeliveriesQuery {
    /// Only deliveries in this status.
    #[serde(default)]
    #[param(value_type = Option<String>, pattern = "^(pending|delivered|failed)$")]
    pub status: Option<String>,
    #[serde(default)]
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<i64>,
    /// `nextCursor` of the previous page.
    #[serde(default)]
    #[param(max_length = 200)]
    pub cursor: Option<String>,
}

/// `{deliveries: [...], nextCursor}`, newest first (`nextCursor`: null on the last page): `id`, `messageId` (the `webhook-id` header), `eventType`,
/// `runId`, `threadId`, `status` (`pending|delivered|failed`), `attempts`, `nextAttemptAt`,
/// `payload` (the event as sent) and `attemptLog` (each attempt: times, `statusCode`, the start
/// of the answer in `responseBody` (at most 1 KiB), `error`). 404 for another principal's webhook.
#[utoipa::path(
    get, path = "/api/webhooks/{id}/deliveries", tag = "webhooks", operation_id = "list_webhook_deliveries",
    params(("id" = Uuid, Path, description = "Webhook id"), DeliveriesQuery),
    responses((status = 200, description = "The webhook's deliveries, newest first", body = crate::views::DeliveryList),
              (status = 400, description = "`invalid_query`, `invalid_cursor`", body = crate::views::ErrorBody),
              (status = 404, description = "Not the caller's webhook", body = crate::views::ErrorBody))
)]
pub async fn list_deliveries(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<Uuid>,
    query: web::Query<DeliveriesQuery>,
) -> Result<HttpResponse, ApiError> {
    let mut arg = json!({"principalId": who.0.id, "webhookId": path.into_inner()});
    match query.status.as_deref() {
        None => {}
        Some(status @ ("pending" | "delivered" | "failed")) => arg["status"] = status.into(),
        Some(other) => {
            return Err(ApiError::bad_request("invalid_query", format!("status must be pending, delivered or failed, not '{other}'")));
        }
    }
    let limit = crate::extract::query_range("limit", query.limit, 50, 1..=200)?;
    arg["limit"] = limit.into();
    if let Some(cursor) = query.cursor.as_deref() {
        let (at, id) = crate::extract::keyset_cursor(cursor)?;
        arg["before"] = json!({"atMicros": at.timestamp_micros(), "id": id});
    }
    let mut conn = state.pool.get().await?;
    let deliveries = crate::reads::webhook_deliveries(&mut conn, arg).await?;
    Ok(HttpResponse::Ok().json(deliveries.ok_or(ApiError::NotFound)?))
}
