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
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// `pending` (undecided only) or `all` (default).
    #[serde(default)]
    #[param(value_type = Option<String>, pattern = "^(pending|all)$")]
    pub status: Option<String>,
    #[serde(default)]
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<i64>,
}

/// `{approvals: [...]}`, newest first: `id`, `runId`, `toolCallId`, `toolName`, `arguments`
/// (the model's proposal), `parameters` (the tool's JSON schema), `status`
/// (`pending|approved|rejected|expired|cancelled`), `approvedArguments`, `argumentsEdited`,
/// `reason`, `deadlineAt`, `createdAt`, `decidedAt`. 404 for another principal's thread.
#[utoipa::path(
    get, path = "/api/threads/{id}/approvals", tag = "approvals", operation_id = "list_approvals",
    params(("id" = Uuid, Path, description = "Thread id"), ListQuery),
    responses((status = 200, description = "The thread's approvals, newest first", body = crate::views::ApprovalList),
              (status = 400, description = "`invalid_query`", body = crate::views::ErrorBody),
              (status = 404, description = "Not the caller's thread", body = crate::views::ErrorBody))
)]
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
