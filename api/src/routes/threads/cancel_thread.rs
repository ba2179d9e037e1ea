//! `POST /api/threads/{id}/cancel`.

use actix_web::{HttpResponse, web};
use agentloop_shared::commands;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Cancels the thread's active run and every pending run behind it (idempotent). Returns
/// `{runs: [...]}` as they are after the call; 404.
#[utoipa::path(
    post, path = "/api/threads/{id}/cancel", tag = "threads", operation_id = "cancel_thread",
    params(("id" = Uuid, Path, description = "Thread id")),
    responses((status = 200, description = "The thread's runs after the call", body = crate::views::CancelledRuns),
              (status = 404, description = "Not the caller's thread", body = crate::views::ErrorBody))
)]
pub async fn cancel_thread(state: web::Data<AppState>, who: Authenticated, path: web::Path<Uuid>) -> Result<HttpResponse, ApiError> {
    let body = commands::cancel_thread(&state.store, who.0.id, path.into_inner()).await?;
    Ok(HttpResponse::Ok().json(body))
}
