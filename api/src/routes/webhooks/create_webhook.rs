//! `POST /api/webhooks`.

use actix_web::{HttpResponse, web};
use agentloop_shared::store::Replay;
use agentloop_shared::webhooks::{self, EVENT_TYPES};
use serde::Deserialize;
use serde_json::json;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Longest description, in characters.
const MAX_DESCRIPTION_CHARS: usize = 500;

/// Body: `{url, events, description?}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateWebhook {
    /// `http(s)://...` receiving `POST`s; only public addresses unless the server allows
    /// private targets (`WEBHOOK_ALLOW_PRIVATE_TARGETS`).
    #[schema(max_length = 2048, pattern = "^https?://[A-Za-z0-9]", example = "https://hooks.example.com/agentloop")]
    pub url: String,
    /// Event types (at least one).
    #[schema(value_type = Vec<crate::views::WebhookEvent>, min_items = 1)]
    pub events: Vec<String>,
    #[serde(default)]
    #[schema(max_length = 500)]
    pub description: Option<String>,
}

/// Creates a webhook of the caller -> 201 with the webhook and its signing secret (`secret`,
/// `whsec_...`), shown in this response only. Every transition of one of the caller's runs into
/// a subscribed state is then delivered to `url` (at least once, signed per Standard Webhooks).
#[utoipa::path(
    post, path = "/api/webhooks", tag = "webhooks", operation_id = "create_webhook",
    request_body = CreateWebhook,
    responses((status = 201, description = "The webhook with its secret (shown once)", body = crate::views::WebhookCreated),
              (status = 400, description = "`invalid_webhook_url`, `webhook_target_private`, `invalid_webhook_events`, `invalid_description`", body = crate::views::ErrorBody),
              (status = 429, description = "`too_many_webhooks` (`WEBHOOK_MAX_PER_PRINCIPAL`) or a rate limit", body = crate::views::ErrorBody))
)]
pub async fn create_webhook(state: web::Data<AppState>, who: Authenticated, body: crate::extract::Json<CreateWebhook>) -> Result<HttpResponse, ApiError> {
    let body = body.into_inner();
    let settings = &state.webhooks;
    let url = webhooks::validate_url(&body.url, settings.allow_private).map_err(|r| ApiError::bad_request(r.code, r.message))?;
    let mut events: Vec<&'static str> = Vec::new();
    for event in &body.events {
        let known = EVENT_TYPES.iter().find(|e| **e == event.as_str()).ok_or_else(|| {
            ApiError::bad_request("invalid_webhook_events", format!("events: unknown event type '{event}'; known: {}", EVENT_TYPES.join(", ")))
        })?;
        if !events.contains(known) {
            events.push(*known);
        }
    }
    if events.is_empty() {
        return Err(ApiError::bad_request("invalid_webhook_events", format!("events: at least one of {}", EVENT_TYPES.join(", "))));
    }
    let description = body.description.unwrap_or_default();
    if description.chars().count() > MAX_DESCRIPTION_CHARS {
        return Err(ApiError::bad_request("invalid_description", format!("description: at most {MAX_DESCRIPTION_CHARS} characters")));
    }
    let id = uuid::Uuid::now_v7();
    let secret = webhooks::new_secret();
    let arg = json!({
        "principalId": who.0.id, "id": id, "url": url.as_str(), "events": events, "description": description,
        "secret": webhooks::seal(&secret, settings.key.as_ref(), id), "max": settings.max_per_principal,
    });
    let mut webhook = state.store.call("agentloop_webhook_create", &arg, Replay::Unsafe, None).await?;
    webhook["secret"] = secret.into();
    Ok(HttpResponse::Created().json(webhook))
}
