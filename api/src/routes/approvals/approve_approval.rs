//! `POST /api/approvals/{id}/approve` `{arguments?}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::approvals::{self, Decision};
use agentloop_shared::tools;
use diesel_async::AsyncConnection;
use serde::Deserialize;
use serde_json::Value;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Body (optional): `{arguments}` — the arguments to run the tool with instead of the model's
/// proposal: a JSON object, or a string holding one.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Approve {
    #[serde(default)]
    pub arguments: Option<Value>,
}

/// Approves a pending tool call (compare-and-set). Edited `arguments` are validated against the
/// tool's JSON schema stored on the approval (400 `invalid_arguments`); the approval then records
/// `argumentsEdited: true` and the tool's result says the user changed them. When it was the
/// last undecided call of its batch, the SAME run is requeued and the tool runs at the start of
/// its next slice. 200 `{approval, run}`; 404; 409 `approval_decided` when it was already decided
/// (a second click, another browser, the deadline or a cancellation came first).
pub async fn approve_approval(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<Uuid>,
    body: web::Bytes,
) -> Result<HttpResponse, ApiError> {
    let body: Approve = super::parse_body(&body)?;
    let mut conn = state.pool.get().await?;
    let approval =
        approvals::get_owned(&mut conn, path.into_inner(), who.0.id).await?.ok_or(ApiError::NotFound)?;
    let arguments = match body.arguments {
        None | Some(Value::Null) => None,
        Some(raw) => {
            let value = match raw {
                Value::String(text) => serde_json::from_str::<Value>(&text)
                    .map_err(|e| ApiError::bad_request("invalid_arguments", format!("arguments are not valid JSON: {e}")))?,
                other => other,
            };
            let valid = tools::validate_arguments(&approval.parameters, &value).map_err(|problem| {
                ApiError::bad_request("invalid_arguments", format!("invalid arguments for {}: {problem}", approval.tool_name))
            })?;
            Some(valid)
        }
    };
    let (principal, id) = (who.0.id, approval.id);
    let (approval, run) = (*conn)
        .transaction(async |conn| approvals::decide(conn, id, principal, Decision::Approve { arguments }).await)
        .await
        .map_err(super::decide_error)?;
    metrics::counter!("agentloop_tool_approvals_decided_total", "decision" => "approved").increment(1);
    Ok(HttpResponse::Ok().json(super::decision_json(&approval, &run)))
}
