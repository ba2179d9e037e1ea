//! `GET /api/threads/{id}/approvals?status=pending&limit=`.

use actix_web::{HttpResponse, web};
use agentloop_shared::{approvals, threads};
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Query: `status` (`pending` to list only undecided calls; default all) and `limit` (1..=200,
/// default 50).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    #[serde(default)]
    pub status: Option<String>,
    #[serde(default)]
    pub limit: Option<i64>,
}

/// `{approvals: [...]}`, newest first: `id`, `runId`, `toolCallId`, `toolName`, `arguments`
/// (the model's proposal), `parameters` (the tool's JSON schema), `status`
/// (`pending|approved|rejected|expired|cancelled`), `approvedArguments`, `argumentsEdited`,
/// `reason`, `deadlineAt`, `createdAt`, `decidedAt`. 404 for another principal's thread.
pub async fn list_approvals(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<Uuid>,
    query: web::Query<ListQuery>,
) -> Result<HttpResponse, ApiError> {
    let only_pending = match query.status.as_deref() {
        None | Some("all") => false,
        Some("pending") => true,
        Some(other) => {
            return Err(ApiError::bad_request("invalid_query", format!("status must be pending or all, not '{other}'")));
        }
    };
    let limit = query.limit.unwrap_or(50);
    if !(1..=200).contains(&limit) {
        return Err(ApiError::bad_request("invalid_query", "limit must be within 1..=200"));
    }
    let mut conn = state.pool.get().await?;
    let thread = threads::get_owned(&mut conn, path.into_inner(), who.0.id).await?.ok_or(ApiError::NotFound)?;
    let rows = approvals::for_thread(&mut conn, thread.id, only_pending, limit).await?;
    Ok(HttpResponse::Ok().json(json!({"approvals": rows})))
}
