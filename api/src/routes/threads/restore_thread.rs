//! `POST /api/threads/{id}/restore`.

use std::time::Duration;

use actix_web::{HttpResponse, web};
use agentloop_shared::commands;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// How long after a delete it can be undone.
pub const UNDO_WINDOW: Duration = Duration::from_secs(600);

/// Undoes `DELETE /api/threads/{id}` within [`UNDO_WINDOW`] (10 minutes): the thread and its
/// history are back; the runs the delete cancelled stay cancelled. A thread with an `uncertain`
/// operation (a call in flight when it was deleted) can be restored at any time, so the
/// operation can be resolved (migration 000032). 200 with the thread; 404 when it is not the
/// caller's deleted thread or the window has passed.
#[utoipa::path(
    post, path = "/api/threads/{id}/restore", tag = "threads", operation_id = "restore_thread",
    params(("id" = Uuid, Path, description = "Thread id")),
    responses((status = 200, description = "The restored thread", body = crate::views::ThreadView),
              (status = 404, description = "Not the caller's deleted thread, or the undo window has passed", body = crate::views::ErrorBody))
)]
pub async fn restore_thread(state: web::Data<AppState>, who: Authenticated, path: web::Path<Uuid>) -> Result<HttpResponse, ApiError> {
    let thread = commands::restore_thread(&state.store, who.0.id, path.into_inner(), UNDO_WINDOW).await?;
    Ok(HttpResponse::Ok().json(thread))
}
