//! `POST /api/runs/{id}/operations/{key}/resolve` `{outcome, result?, reason?, runUpdatedAt?}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::commands::{self, Outcome};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Body: `outcome` = `completed` (the effect happened; `result` becomes the call's result),
/// `failed` (it did not; optional `reason`) or `retry` (safe to run again under the same key);
/// `runUpdatedAt` (optional): the `updatedAt` of the run as the caller saw it — the resolve is
/// refused if the run changed since.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Resolve {
    /// `completed`, `failed` or `retry`.
    #[schema(pattern = "^(completed|failed|retry)$")]
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
#[utoipa::path(
    post, path = "/api/runs/{id}/operations/{key}/resolve", tag = "operations", operation_id = "resolve_operation",
    params(("id" = Uuid, Path, description = "Run id"), ("key" = String, Path, description = "Operation key `run:{runId}:call:{toolCallId}`")),
    request_body = Resolve,
    responses((status = 200, description = "The operation and the run", body = crate::views::Resolved),
              (status = 400, description = "`invalid_outcome`", body = crate::views::ErrorBody),
              (status = 404, description = "No such run or operation", body = crate::views::ErrorBody),
              (status = 409, description = "`stale_resolve`", body = crate::views::ErrorBody))
)]
pub async fn resolve_operation(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<(Uuid, String)>,
    body: crate::extract::Json<Resolve>,
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
    let label = body.outcome.clone();
    let response = commands::resolve(&state.store, who.0.id, run_id, &key, outcome, body.run_updated_at).await?;
    metrics::counter!("agentloop_operations_resolved_total", "outcome" => label).increment(1);
    Ok(HttpResponse::Ok().json(response))
}
