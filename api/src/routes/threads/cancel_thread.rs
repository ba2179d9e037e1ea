//! `POST /api/threads/{id}/cancel`.

use actix_web::{HttpResponse, web};
use agentloop_shared::runs::{self, status};
use agentloop_shared::threads;
use diesel::prelude::*;
use diesel_async::{AsyncConnection, RunQueryDsl};
use serde_json::json;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Cancels the thread's active run and every pending run behind it (idempotent). Returns
/// `{runs: [...]}` as they are after the call.
pub async fn cancel_thread(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<Uuid>,
) -> Result<HttpResponse, ApiError> {
    use agentloop_shared::db::schema::runs as r;
    let mut conn = state.pool.get().await?;
    let (thread_id, owner) = (path.into_inner(), who.0.id);
    let cancelled = (*conn)
        .transaction(async |conn| {
            runs::lock_active(conn, thread_id).await?; // lock order: active run, thread, pending runs
            let Some(thread) = threads::lock_owned(conn, thread_id, owner).await? else {
                return Ok(None);
            };
            // Pending first, so cancelling the active run promotes nothing.
            let ids: Vec<(Uuid, String)> = r::table
                .filter(r::thread_id.eq(thread.id))
                .filter(r::status.eq_any([status::PENDING, status::QUEUED, status::RUNNING, status::WAITING_APPROVAL, status::BLOCKED]))
                .order((r::status.eq(status::PENDING).desc(), r::seq.desc()))
                .select((r::id, r::status))
                .load(conn)
                .await?;
            let mut out = Vec::with_capacity(ids.len());
            for (id, _) in ids {
                out.push(runs::request_cancel(conn, id).await?.to_json());
            }
            Ok::<_, diesel::result::Error>(Some(out))
        })
        .await?
        .ok_or(ApiError::NotFound)?;
    Ok(HttpResponse::Ok().json(json!({"runs": cancelled})))
}
