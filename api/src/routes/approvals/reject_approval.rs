//! `POST /api/approvals/{id}/reject` `{reason?}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::commands::{self, Decision};
use serde::Deserialize;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Body (optional): `{reason}` (at most 2,000 characters).
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Reject {
    #[serde(default)]
    #[schema(max_length = 2000)]
    pub reason: Option<String>,
}

/// Rejects a pending tool call (compare-and-set): the model reads "Tool call declined by the
/// user." (with the reason). When it was the last undecided call of its batch, the results are
/// appended and the SAME run is requeued. 200 `{approval, run}`; 404; 409 `approval_decided`.
#[utoipa::path(
    post, path = "/api/approvals/{id}/reject", tag = "approvals", operation_id = "reject_approval",
    params(("id" = Uuid, Path, description = "Approval id")),
    request_body(content = Option<Reject>, description = "Optional reason"),
    responses((status = 200, description = "The approval and its run", body = crate::views::Decided),
              (status = 400, description = "`invalid_reason`, `invalid_json`", body = crate::views::ErrorBody),
              (status = 404, description = "Not the caller's approval", body = crate::views::ErrorBody),
              (status = 409, description = "`approval_decided`", body = crate::views::ErrorBody))
)]
pub async fn reject_approval(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<Uuid>,
    body: web::Bytes,
) -> Result<HttpResponse, ApiError> {
    let reason = super::parse_body::<Reject>(&body)?.reason;
    Ok(HttpResponse::Ok().json(reject(&state, who.0.id, path.into_inner(), reason).await?))
}

/// The rejection itself (shared with the MCP tool `reject_tool_call`). Returns `{approval, run}`.
pub async fn reject(state: &AppState, principal: Uuid, approval_id: Uuid, reason: Option<String>) -> Result<serde_json::Value, ApiError> {
    let reason = reason.map(|r| r.trim().to_owned()).filter(|r| !r.is_empty());
    if reason.as_ref().is_some_and(|r| r.chars().count() > 2000) {
        return Err(ApiError::bad_request("invalid_reason", "reason is limited to 2,000 characters"));
    }
    let body = commands::decide(&state.store, principal, approval_id, Decision::Reject { reason }).await?;
    metrics::counter!("agentloop_tool_approvals_decided_total", "decision" => "rejected").increment(1);
    Ok(body)
}
