//! `GET /api/runs/{id}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::runs;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// The run (with `error: {code, message}` when failed or blocked) and its `steps` in order.
/// A `blocked` run also has `blocker: {code: "operation_uncertain", message, operations}` (its
/// uncertain operations); a `waiting_approval` run has `approvals` (its pending approvals); a
/// run that asked for an MCP sign-in has `authorizations` (all of them, oldest first: `{id,
/// server, toolCallId, status, url (while pending), ...}`), and a `waiting_authorization` run
/// `authorization` (the pending one, with its sign-in `url`).
/// For the run inspector and honest liveness (issue 11) it also has `liveness` (`{state: ok |
/// unclaimed | lease_stale | lease_expired, sinceMs?, expiresInMs?, serverTime}`, computed with
/// the database clock), `toolCalls` (the last 300 calls with timings, result preview, ledger and
/// approval status), `toolCallsTotal` and `compactions` (snapshots it wrote); see
/// `agentloop_run_inspect`.
#[utoipa::path(
    get, path = "/api/runs/{id}", tag = "runs", operation_id = "get_run",
    params(("id" = Uuid, Path, description = "Run id")),
    responses((status = 200, description = "The run with its steps (and its blocker or pending approvals)", body = crate::views::RunDetail),
              (status = 404, description = "Not the caller's run", body = crate::views::ErrorBody))
)]
pub async fn get_run(state: web::Data<AppState>, who: Authenticated, path: web::Path<Uuid>) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(view(&state, who.0.id, path.into_inner()).await?))
}

/// The run view of [`get_run`] for `principal` (shared with the MCP tool `get_run`); 404.
pub async fn view(state: &AppState, principal: Uuid, run_id: Uuid) -> Result<serde_json::Value, ApiError> {
    let mut conn = state.pool.get().await?;
    let run = runs::get_owned(&mut conn, run_id, principal).await?.ok_or(ApiError::NotFound)?;
    let steps = runs::steps(&mut conn, run.id).await?;
    let mut body = run.to_json();
    body["steps"] = serde_json::to_value(steps).unwrap_or_default();
    let l = state.liveness;
    let inspect = crate::reads::run_inspect(&mut conn, run.id, l.lease_ms, l.renew_ms, l.unclaimed_ms).await?;
    if let (Some(obj), Some(extra)) = (body.as_object_mut(), inspect.as_object()) {
        obj.extend(extra.clone());
    }
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
    let authorizations = agentloop_shared::mcp_auth::for_run(&mut conn, run.id).await?;
    if !authorizations.is_empty() {
        if run.status == runs::status::WAITING_AUTHORIZATION
            && let Some(pending) = authorizations.iter().rev().find(|a| a["status"] == "pending")
        {
            body["authorization"] = pending.clone();
        }
        body["authorizations"] = serde_json::Value::Array(authorizations);
    }
    Ok(body)
}
