//! `GET /api/runs/{id}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::runs;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// The run (with `error: {code, message}` when failed) and its `steps` in order.
pub async fn get_run(state: web::Data<AppState>, who: Authenticated, path: web::Path<Uuid>) -> Result<HttpResponse, ApiError> {
    let mut conn = state.pool.get().await?;
    let run = runs::get_owned(&mut conn, path.into_inner(), who.0.id).await?.ok_or(ApiError::NotFound)?;
    let steps = runs::steps(&mut conn, run.id).await?;
    let mut body = run.to_json();
    body["steps"] = serde_json::to_value(steps).unwrap_or_default();
    Ok(HttpResponse::Ok().json(body))
}
