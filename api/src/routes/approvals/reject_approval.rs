//! `POST /api/approvals/{id}/reject` `{reason?}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::approvals::{self, Decision};
use diesel_async::AsyncConnection;
use serde::Deserialize;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Body (optional): `{reason}` (at most 2,000 characters).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Reject {
    #[serde(default)]
    pub reason: Option<String>,
}

/// Rejects a pending tool call (compare-and-set): the model reads "Tool call declined by the
/// user." (with the reason). When it was the last undecided call of its batch, the results are
/// appended and the SAME run is requeued. 200 `{approval, run}`; 404; 409 `approval_decided`.
pub async fn reject_approval(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<Uuid>,
    body: web::Bytes,
) -> Result<HttpResponse, ApiError> {
    let reason = super::parse_body::<Reject>(&body)?.reason.map(|r| r.trim().to_owned()).filter(|r| !r.is_empty());
    if reason.as_ref().is_some_and(|r| r.chars().count() > 2000) {
        return Err(ApiError::bad_request("invalid_reason", "reason is limited to 2,000 characters"));
    }
    let mut conn = state.pool.get().await?;
    let approval =
        approvals::get_owned(&mut conn, path.into_inner(), who.0.id).await?.ok_or(ApiError::NotFound)?;
    let (principal, id) = (who.0.id, approval.id);
    let (approval, run) = (*conn)
        .transaction(async |conn| approvals::decide(conn, id, principal, Decision::Reject { reason }).await)
        .await
        .map_err(super::decide_error)?;
    metrics::counter!("agentloop_tool_approvals_decided_total", "decision" => "rejected").increment(1);
    Ok(HttpResponse::Ok().json(super::decision_json(&approval, &run)))
}
