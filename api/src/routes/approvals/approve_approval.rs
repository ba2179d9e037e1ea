//! `POST /api/approvals/{id}/approve` `{arguments?}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::commands::{self, Decision};
use agentloop_shared::{approvals, tools};
use serde::Deserialize;
use serde_json::Value;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Body (optional): `{arguments}` — the arguments to run the tool with instead of the model's
/// proposal: a JSON object, or a string holding one.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Approve {
    /// A JSON object, or a string holding one.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub arguments: Option<Value>,
}

/// Approves a pending tool call (compare-and-set). Edited `arguments` are validated against the
/// tool's JSON schema stored on the approval (400 `invalid_arguments`); the approval then records
/// `argumentsEdited: true` and the tool's result says the user changed them. When it was the
/// last undecided call of its batch, the SAME run is requeued and the tool runs at the start of
/// its next slice. 200 `{approval, run}`; 404; 409 `approval_decided` when it was already decided
/// (a second click, another browser, the deadline or a cancellation came first).
#[utoipa::path(
    post, path = "/api/approvals/{id}/approve", tag = "approvals", operation_id = "approve_approval",
    params(("id" = Uuid, Path, description = "Approval id")),
    request_body(content = Option<Approve>, description = "Optional edited arguments"),
    responses((status = 200, description = "The approval and its run", body = crate::views::Decided),
              (status = 400, description = "`invalid_arguments`, `invalid_json`", body = crate::views::ErrorBody),
              (status = 404, description = "Not the caller's approval", body = crate::views::ErrorBody),
              (status = 409, description = "`approval_decided`", body = crate::views::ErrorBody))
)]
pub async fn approve_approval(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<Uuid>,
    body: web::Bytes,
) -> Result<HttpResponse, ApiError> {
    let body: Approve = super::parse_body(&body)?;
    Ok(HttpResponse::Ok().json(approve(&state, who.0.id, path.into_inner(), body.arguments).await?))
}

/// The approval itself (shared with the MCP tool `approve_tool_call`): `arguments` as the route
/// takes them. Returns `{approval, run}`.
pub async fn approve(state: &AppState, principal: Uuid, approval_id: Uuid, arguments: Option<Value>) -> Result<Value, ApiError> {
    let mut conn = state.pool.get().await?;
    let approval = approvals::get_owned(&mut conn, approval_id, principal).await?.ok_or(ApiError::NotFound)?;
    drop(conn);
    let arguments = match arguments {
        None | Some(Value::Null) => None,
        Some(raw) => {
            let value = match raw {
                // Edited arguments sent as text are read as the model's are.
                Value::String(text) => Value::Object(tools::parse_arguments(&text).map_err(|problem| {
                    ApiError::bad_request("invalid_arguments", format!("invalid arguments for {}: {problem}", approval.tool_name))
                })?),
                other => other,
            };
            let valid = tools::validate_arguments(&approval.parameters, &value).map_err(|problem| {
                ApiError::bad_request("invalid_arguments", format!("invalid arguments for {}: {problem}", approval.tool_name))
            })?;
            Some(valid)
        }
    };
    let body = commands::decide(&state.store, principal, approval.id, Decision::Approve { arguments }).await?;
    metrics::counter!("agentloop_tool_approvals_decided_total", "decision" => "approved").increment(1);
    Ok(body)
}
