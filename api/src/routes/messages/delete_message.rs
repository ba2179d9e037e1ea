//! `DELETE /api/threads/{id}/messages/{sequence}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::commands;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Deactivates the message at `sequence` with its whole tool group (an assistant tool call and
/// its results go together; rows are never deleted). 200 `{deactivated}`. Errors: 404, 409
/// `run_active` / `approval_required`.
#[utoipa::path(
    delete, path = "/api/threads/{id}/messages/{sequence}", tag = "messages", operation_id = "delete_message",
    params(("id" = Uuid, Path, description = "Thread id"), ("sequence" = i64, Path, description = "Sequence of the message")),
    responses((status = 200, description = "The deactivated sequences", body = crate::views::Deactivated),
              (status = 404, description = "No such thread or message", body = crate::views::ErrorBody),
              (status = 409, description = "`run_active`, `approval_required`", body = crate::views::ErrorBody))
)]
pub async fn delete_message(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<(Uuid, i64)>,
) -> Result<HttpResponse, ApiError> {
    let (thread_id, sequence) = path.into_inner();
    let body = commands::delete_message(&state.store, who.0.id, thread_id, sequence).await?;
    Ok(HttpResponse::Ok().json(body))
}
