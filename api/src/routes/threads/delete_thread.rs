//! `DELETE /api/threads/{id}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::commands;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Deletes the thread for its owner (soft: it disappears from every read and 404s from then on;
/// rows are kept for audit) and cancels its runs — and with them pending approvals — in the
/// same transaction; open live clients get `thread_deleted`. A running run is aborted by its
/// worker. 204; 404; 409 `operations_uncertain` while a tool call of the thread may or may not
/// have taken effect (resolve it first: its record must not go with the thread; migration
/// 000032). A call still in flight does not refuse the delete: its run is cancelled, its
/// operation becomes `uncertain`, and the thread can then be restored at any time
/// (`POST /api/threads/{id}/restore`) to resolve it; the purge keeps it.
#[utoipa::path(
    delete, path = "/api/threads/{id}", tag = "threads", operation_id = "delete_thread",
    params(("id" = Uuid, Path, description = "Thread id")),
    responses((status = 204, description = "Deleted"),
              (status = 404, description = "Not the caller's thread", body = crate::views::ErrorBody),
              (status = 409, description = "`operations_uncertain`: resolve the thread's uncertain tool calls first", body = crate::views::ErrorBody))
)]
pub async fn delete_thread(state: web::Data<AppState>, who: Authenticated, path: web::Path<Uuid>) -> Result<HttpResponse, ApiError> {
    commands::delete_thread(&state.store, who.0.id, path.into_inner()).await?;
    Ok(HttpResponse::NoContent().finish())
}
