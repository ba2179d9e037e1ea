//! `GET /api/models`.

use actix_web::{HttpResponse, web};
use serde_json::json;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Configured models with their context limits and capabilities; the first is the default.
/// Never exposes base URLs' credentials or API keys.
pub async fn list_models(state: web::Data<AppState>, _who: Authenticated) -> Result<HttpResponse, ApiError> {
    let default = state.catalog.default_model().map(|m| m.id.clone());
    let models: Vec<_> = state
        .catalog
        .models
        .iter()
        .map(|m| {
            json!({
                "id": m.id,
                "contextTokens": m.context_tokens,
                "inputModalities": m.input_modalities,
                "supportsTools": m.supports_tools,
                "family": m.family,
                "default": Some(&m.id) == default.as_ref(),
            })
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({"models": models})))
}
