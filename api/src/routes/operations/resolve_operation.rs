//! `POST /api/runs/{id}/operations/{key}/resolve` `{outcome, result?, reason?, runUpdatedAt?}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::operations::{self, Outcome, ResolveError};
use agentloop_shared::runs;
use chrono::{DateTime, Utc};
use diesel_async::AsyncConnection;
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Body: `outcome` = `completed` (the effect happened; `result` becomes the call's result),
/// `failed` (it did not; optional `reason`) or `retry` (safe to run again under the same key);
/// `runUpdatedAt` (optional): the `updatedAt` of the run as the caller saw it — the resolve is
/// refused if the run changed since.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Resolve {
    pub outcome: String,
    #[serde(default)]
    pub result: Option<String>,
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub run_updated_at: Option<DateTime<Utc>>,
}

/// Resolves an `uncertain` operation of a `blocked` run, conditioned on that state (a stale
/// resolve is 409 `stale_resolve`). `completed`/`failed` append the call's result; `retry`
/// dispatches the call again in the run's next slice. When no uncertain operation remains the
/// SAME run is requeued. 200 `{operation, run}`; 400 `invalid_outcome`; 404.
pub async fn resolve_operation(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<(Uuid, String)>,
    body: web::Json<Resolve>,
) -> Result<HttpResponse, ApiError> {
    let (run_id, key) = path.into_inner();
    let body = body.into_inner();
    let bound = |text: Option<String>| text.map(|t| t.chars().take(16 * 1024).collect::<String>());
    let outcome = match body.outcome.as_str() {
        "completed" => Outcome::Completed { result: bound(body.result) },
        "failed" => Outcome::Failed { reason: bound(body.reason) },
        "retry" => Outcome::Retry,
        other => {
            return Err(ApiError::bad_request(
                "invalid_outcome",
                format!("outcome must be completed, failed or retry, not '{other}'"),
            ));
        }
    };
    let mut conn = state.pool.get().await?;
    let run = runs::get_owned(&mut conn, run_id, who.0.id).await?.ok_or(ApiError::NotFound)?;
    let principal = who.0.id;
    let label = body.outcome.clone();
    let (operation, run) = (*conn)
        .transaction(async |conn| operations::resolve(conn, run.id, &key, principal, outcome, body.run_updated_at).await)
        .await
        .map_err(|e| match e {
            ResolveError::NotFound => ApiError::NotFound,
            ResolveError::Stale(message) => ApiError::conflict("stale_resolve", message),
            ResolveError::Query(q) => q.into(),
        })?;
    metrics::counter!("agentloop_operations_resolved_total", "outcome" => label).increment(1);
    Ok(HttpResponse::Ok().json(json!({"operation": operation, "run": run.to_json()})))
}
