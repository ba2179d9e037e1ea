//! `GET /api/runs/{id}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::runs;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// The run (with `error: {code, message}` when failed or blocked) and its `steps` in order.
/// A `blocked` run also has `blocker: {code: "operation_uncertain", message, operations}` (its
/// uncertain operations); a `waiting_approval` run has `approvals` (its pending approvals).
pub async fn get_run(state: web::Data<AppState>, who: Authenticated, path: web::Path<Uuid>) -> Result<HttpResponse, ApiError> {
    let mut conn = state.pool.get().await?;
    let run = runs::get_owned(&mut conn, path.into_inner(), who.0.id).await?.ok_or(ApiError::NotFound)?;
    let steps = runs::steps(&mut conn, run.id).await?;
    let mut body = run.to_json();
    body["steps"] = serde_json::to_value(steps).unwrap_or_default();
    if run.status == runs::status::BLOCKED {
        use agentloop_shared::operations;
        let uncertain: Vec<_> =
            operations::for_run(&mut conn, run.id).await?.into_iter().filter(|o| o.status == operations::status::UNCERTAIN).collect();
        body["blocker"] = serde_json::json!({
            "code": run.error_code.as_deref().unwrap_or(operations::BLOCKED_CODE),
            "message": run.error_message,
            "operations": uncertain,
        });
    } else if run.status == runs::status::WAITING_APPROVAL {
        use agentloop_shared::approvals;
        let pending: Vec<_> =
            approvals::for_run(&mut conn, run.id).await?.into_iter().filter(|a| a.status == approvals::status::PENDING).collect();
        body["approvals"] = serde_json::to_value(pending).unwrap_or_default();
    }
    Ok(HttpResponse::Ok().json(body))
}
