//! `POST /api/threads/{id}/compact`.

use actix_web::{HttpResponse, web};
use agentloop_shared::commands;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Manual compaction (SPEC §8): creates a child thread (`parentThreadId` = this thread) and a
/// `compaction` run on it, in one transaction; a worker summarises this thread's context and
/// writes the child's history — instructions + summary + verbatim recent tail — then completes
/// the run. This thread is left untouched. 201 `{thread, run}`. Errors: 404, 400 `no_model`,
/// 409 `model_not_configured`.
#[utoipa::path(
    post, path = "/api/threads/{id}/compact", tag = "threads", operation_id = "compact_thread",
    params(("id" = Uuid, Path, description = "Thread id")),
    responses((status = 201, description = "The child thread and its compaction run", body = crate::views::Compacted),
              (status = 400, description = "`no_model`", body = crate::views::ErrorBody),
              (status = 404, description = "Not the caller's thread", body = crate::views::ErrorBody),
              (status = 409, description = "`model_not_configured`, `run_active`", body = crate::views::ErrorBody),
              (status = 429, description = "`too_many_threads`, `too_many_active_runs` or a rate limit", body = crate::views::ErrorBody))
)]
pub async fn compact_thread(state: web::Data<AppState>, who: Authenticated, path: web::Path<Uuid>) -> Result<HttpResponse, ApiError> {
    let body = commands::compact(&state.store, who.0.id, path.into_inner(), state.model_choice(None)).await?;
    Ok(HttpResponse::Created().json(body))
}
