//! `GET /api/models`.

use actix_web::{HttpResponse, web};
use serde_json::json;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// One configured model.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelInfo {
    pub id: String,
    /// Context window in tokens, when configured.
    pub context_tokens: Option<u32>,
    pub input_modalities: Vec<String>,
    /// Whether tools are offered to it (from the models file, or probed from a local server).
    pub supports_tools: bool,
    /// `openai`, `glm`, `mistral`, `llama` or `other`.
    pub family: String,
    pub default: bool,
    /// The largest user turn it accepts, in tokens (for a thread without `maxTokens`): what the
    /// context holds next to the answer and a compacted history (`agentloop_shared::generation`).
    /// A larger turn is refused with 413 `turn_too_large` before anything is stored.
    pub max_input_tokens: u32,
    /// `max_tokens` sent when the thread sets none (a quarter of the context, 256..8,192; none
    /// without a configured context).
    pub default_max_tokens: Option<u32>,
}

/// `{models}`.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ModelList {
    pub models: Vec<ModelInfo>,
}

/// Configured models with their context limits, input limits and capabilities; the first is
/// the default. Never exposes base URLs' credentials or API keys.
#[utoipa::path(
    get, path = "/api/models", tag = "models", operation_id = "list_models",
    responses((status = 200, description = "Configured models; the first is the default", body = ModelList))
)]
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
                "maxInputTokens": agentloop_shared::generation::max_input_tokens(m, &json!({})),
                "defaultMaxTokens": agentloop_shared::generation::default_max_tokens(m),
            })
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({"models": models})))
}
