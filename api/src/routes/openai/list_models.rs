//! `GET /v1/models` and `GET /v1/models/{id}` in OpenAI's shape.

use actix_web::{HttpResponse, web};
use agentloop_shared::provider::catalog::ModelConfig;
use serde::Serialize;
use utoipa::ToSchema;

use super::V1Error;
use crate::AppState;
use crate::extract::Authenticated;

/// One model (`object: "model"`). `created` is when this api process started (the catalog has
/// no creation time); `owned_by` is `agentloop`.
#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiModel {
    pub id: String,
    /// Always `model`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: i64,
    pub owned_by: &'static str,
}

/// `{"object":"list","data":[model...]}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiModelList {
    /// Always `list`.
    pub object: &'static str,
    pub data: Vec<OpenAiModel>,
}

fn started() -> i64 {
    static STARTED: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *STARTED.get_or_init(|| chrono::Utc::now().timestamp())
}

fn model(m: &ModelConfig) -> OpenAiModel {
    OpenAiModel { id: m.id.clone(), object: "model", created: started(), owned_by: "agentloop" }
}

/// The configured models (the default first), in OpenAI's list shape.
pub async fn list_models(state: web::Data<AppState>, _who: Authenticated) -> Result<HttpResponse, V1Error> {
    let data = state.catalog.models.iter().map(model).collect();
    Ok(HttpResponse::Ok().json(OpenAiModelList { object: "list", data }))
}

/// One configured model; 404 `model_not_found` otherwise.
pub async fn get_model(state: web::Data<AppState>, _who: Authenticated, path: web::Path<String>) -> Result<HttpResponse, V1Error> {
    let id = path.into_inner();
    match state.catalog.get(&id) {
        Some(m) => Ok(HttpResponse::Ok().json(model(m))),
        None => Err(V1Error {
            status: actix_web::http::StatusCode::NOT_FOUND,
            code: "model_not_found".into(),
            message: format!("The model '{id}' does not exist on this server"),
            param: Some("model".into()),
        }),
    }
}

