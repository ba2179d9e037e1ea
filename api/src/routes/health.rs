//! Liveness and readiness probes.

use actix_web::{HttpResponse, web};
use diesel_async::RunQueryDsl;
use serde_json::json;

use crate::AppState;
use crate::error::ApiError;

/// `GET /healthz`: the process serves HTTP (no dependency checks).
pub async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "ok"}))
}

/// `GET /metrics`: Prometheus text format (see `agentloop_shared::telemetry::metrics`).
pub async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().content_type("text/plain; version=0.0.4").body(state.metrics.render())
}

/// `GET /readyz`: PostgreSQL answers a query (503 `database_unavailable` otherwise).
pub async fn readyz(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let mut conn = state.pool.get().await?;
    diesel::sql_query("SELECT 1").execute(&mut conn).await.map_err(|e| ApiError::Unavailable {
        code: "database_unavailable",
        message: format!("database unavailable: {e}"),
    })?;
    Ok(HttpResponse::Ok().json(json!({"status": "ready"})))
}
