//! `GET /api/threads/{id}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::{runs, threads};
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;
use crate::views;

/// The thread window: `thread`, `messages` (head + tail, bounded), `messageCount`,
/// `messageWindow`, the active or latest `run`, `streamingMessage`, `sig`.
#[utoipa::path(
    get, path = "/api/threads/{id}", tag = "threads", operation_id = "get_thread",
    params(("id" = Uuid, Path, description = "Thread id")),
    responses((status = 200, description = "The thread window", body = crate::views::ThreadWindow),
              (status = 404, description = "Not the caller's thread", body = crate::views::ErrorBody))
)]
pub async fn get_thread(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<Uuid>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(view(&state, who.0.id, path.into_inner()).await?))
}

/// The window of [`get_thread`] for `principal` (shared with the MCP thread resources); 404.
pub async fn view(state: &AppState, principal: Uuid, thread_id: Uuid) -> Result<serde_json::Value, ApiError> {
    let mut conn = state.pool.get().await?;
    let thread = threads::get_owned(&mut conn, thread_id, principal).await?.ok_or(ApiError::NotFound)?;
    // The active run if there is one (a pending run behind it is not what runs now), else the latest.
    let run = match runs::active_for_thread(&mut conn, thread.id).await? {
        Some(run) => Some(run),
        None => runs::latest_for_thread(&mut conn, thread.id).await?,
    };
    let mut body = views::window(&mut conn, &thread).await?;
    body["thread"] = views::thread_json(&thread);
    body["messageCount"] = thread.message_count.into();
    body["run"] = views::run_json(run.as_ref());
    let streaming = views::streaming(&mut conn, &thread).await?;
    body["sig"] = views::sig(&thread, run.as_ref(), &streaming).into();
    body["streamingMessage"] = streaming;
    Ok(body)
}
