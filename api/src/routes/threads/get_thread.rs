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
pub async fn get_thread(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<Uuid>,
) -> Result<HttpResponse, ApiError> {
    let mut conn = state.pool.get().await?;
    let thread = threads::get_owned(&mut conn, path.into_inner(), who.0.id).await?.ok_or(ApiError::NotFound)?;
    // The active run if there is one (a pending run behind it is not what runs now), else the latest.
    let run = match runs::active_for_thread(&mut conn, thread.id).await? {
        Some(run) => Some(run),
        None => runs::latest_for_thread(&mut conn, thread.id).await?,
    };
    let mut body = views::window(&mut conn, &thread).await?;
    body["thread"] = views::thread_json(&thread);
    body["messageCount"] = thread.message_count.into();
    body["run"] = views::run_json(run.as_ref());
    body["streamingMessage"] = views::streaming_json(&thread);
    body["sig"] = views::sig(&thread, run.as_ref()).into();
    Ok(HttpResponse::Ok().json(body))
}
