//! `POST /api/runs/{id}/cancel`.

use actix_web::{HttpResponse, web};
use agentloop_shared::commands;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Cancels the run (idempotent): pending/queued/waiting/blocked at once; running via the owning
/// worker, which aborts at its next safe point (a streamed partial answer is kept, marked
/// stopped). Returns the run after the call (200); 404.
#[utoipa::path(
    post, path = "/api/runs/{id}/cancel", tag = "runs", operation_id = "cancel_run",
    params(("id" = Uuid, Path, description = "Run id")),
    responses((status = 200, description = "The run after the call", body = crate::views::RunView),
              (status = 404, description = "Not the caller's run", body = crate::views::ErrorBody))
)]
pub async fn cancel_run(state: web::Data<AppState>, who: Authenticated, path: web::Path<Uuid>) -> Result<HttpResponse, ApiError> {
    let run = commands::cancel_run(&state.store, who.0.id, path.into_inner()).await?;
    Ok(HttpResponse::Ok().json(run))
}
