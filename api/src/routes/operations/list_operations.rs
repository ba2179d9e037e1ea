//! `GET /api/runs/{id}/operations`.

use actix_web::{HttpResponse, web};
use agentloop_shared::{operations, runs};
use serde_json::json;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// `{run, operations: [...]}` (at most 64, oldest first): `key`
/// (`run:{runId}:call:{toolCallId}`), `toolCallId`, `toolName`, `arguments`, `status`
/// (`prepared|dispatched|completed|failed|uncertain`), `result`, `resolution`, `dispatches`,
/// timestamps. 404 for another principal's run.
#[utoipa::path(
    get, path = "/api/runs/{id}/operations", tag = "operations", operation_id = "list_operations",
    params(("id" = Uuid, Path, description = "Run id")),
    responses((status = 200, description = "The run and its operations", body = crate::views::OperationList),
              (status = 404, description = "Not the caller's run", body = crate::views::ErrorBody))
)]
pub async fn list_operations(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<Uuid>,
) -> Result<HttpResponse, ApiError> {
    let mut conn = state.pool.get().await?;
    let run = runs::get_owned(&mut conn, path.into_inner(), who.0.id).await?.ok_or(ApiError::NotFound)?;
    let rows = operations::for_run(&mut conn, run.id).await?;
    Ok(HttpResponse::Ok().json(json!({"run": run.to_json(), "operations": rows})))
}
