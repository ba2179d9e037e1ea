//! Liveness and readiness probes.

use actix_web::{HttpResponse, web};
use diesel_async::RunQueryDsl;
use serde_json::json;

use crate::AppState;
use crate::error::ApiError;

/// `GET /healthz`: the process serves HTTP (no dependency checks).
#[utoipa::path(get, path = "/healthz", tag = "health", operation_id = "healthz", security(()),
    responses((status = 200, description = "Alive", body = crate::views::HealthStatus)))]
pub async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "ok"}))
}

/// `GET /metrics`: Prometheus text format (see `agentloop_shared::telemetry::metrics`).
#[utoipa::path(get, path = "/metrics", tag = "health", operation_id = "metrics", security(()),
    responses((status = 200, description = "Prometheus text exposition", content_type = "text/plain", body = String)))]
pub async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().content_type("text/plain; version=0.0.4").body(state.metrics.render())
}

/// Longest wait of a readiness probe for PostgreSQL: a database that does not answer within it
/// is unavailable (a half-open connection must not hang the probe, nor the web UI's banner).
const READY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// `transaction_read_only` of a pooled session: `on` or `off`.
#[derive(diesel::QueryableByName)]
struct ReadOnly {
    #[diesel(sql_type = diesel::sql_types::Text)]
    read_only: String,
}

/// `GET /readyz`: PostgreSQL answers a query within 2 s, and the command pool has or can open a
/// connection (503 `database_unavailable` otherwise)
/// and accepts writes (503 `database_read_only` from a hot standby or under
/// `default_transaction_read_only`: reads would answer, but no turn could be accepted and no
/// run could move); 503 `draining` from SIGTERM on, while the process still serves, so load
/// balancers stop routing to it before its listener closes.
#[utoipa::path(get, path = "/readyz", tag = "health", operation_id = "readyz", security(()),
    responses((status = 200, description = "Ready", body = crate::views::HealthStatus)))]
pub async fn readyz(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    if std::sync::atomic::AtomicBool::load(&state.draining, std::sync::atomic::Ordering::SeqCst) {
        return Err(ApiError::Unavailable { code: "draining", message: "this process is shutting down".into() });
    }
    let unavailable = |why: String| ApiError::database_unavailable(&why);
    let probe = async {
        // The command connections too (the writes' pool, its own connections): with the
        // server's connections used up by another client, reads answered from an open pooled
        // connection while every write failed `too many clients` (acceptance probe J, F8).
        drop(state.store.conn().await.map_err(|e| unavailable(format!("command connection: {e}")))?);
        let mut conn = state.pool.get().await?;
        diesel::sql_query("SELECT current_setting('transaction_read_only') AS read_only")
            .get_result::<ReadOnly>(&mut conn)
            .await
            .map_err(|e| unavailable(e.to_string()))
    };
    let ReadOnly { read_only } =
        tokio::time::timeout(READY_TIMEOUT, probe).await.map_err(|_| unavailable("no answer within 2 s".into()))??;
    if read_only == "on" {
        tracing::warn!("readiness: PostgreSQL accepts no writes (transaction_read_only = on)");
        return Err(ApiError::Unavailable {
            code: "database_read_only",
            message: "the database accepts no writes right now (a standby, or read-only mode); retry later".into(),
        });
    }
    Ok(HttpResponse::Ok().json(json!({"status": "ready"})))
}
