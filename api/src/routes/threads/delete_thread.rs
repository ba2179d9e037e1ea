//! `DELETE /api/threads/{id}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::runs::{self, status};
use agentloop_shared::threads;
use diesel::prelude::*;
use diesel_async::{AsyncConnection, RunQueryDsl};
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Deletes the thread for its owner (soft: it disappears from every read and 404s from then on;
/// rows are kept for audit) and cancels its runs — and with them pending approvals — in the
/// same transaction. A running run is aborted by its worker. 204.
pub async fn delete_thread(state: web::Data<AppState>, who: Authenticated, path: web::Path<Uuid>) -> Result<HttpResponse, ApiError> {
    use agentloop_shared::db::schema::runs as r;
    let (id, owner) = (path.into_inner(), who.0.id);
    let mut conn = state.pool.get().await?;
    (*conn)
        .transaction(async |conn| -> Result<(), ApiError> {
            runs::lock_active(conn, id).await?; // lock order: active run, thread, pending runs
            threads::lock_owned(conn, id, owner).await?.ok_or(ApiError::NotFound)?;
            let open: Vec<Uuid> = r::table
                .filter(r::thread_id.eq(id))
                .filter(r::status.eq_any([status::PENDING, status::QUEUED, status::RUNNING, status::WAITING_APPROVAL, status::BLOCKED]))
                .order((r::status.eq(status::PENDING).desc(), r::seq.desc()))
                .select(r::id)
                .load(conn)
                .await?;
            for run in open {
                runs::request_cancel(conn, run).await?;
            }
            threads::soft_delete(conn, id).await?;
            // Open SSE/long-poll clients learn it from the journal like any other change.
            agentloop_shared::events::append(conn, id, agentloop_shared::events::kind::THREAD_DELETED, &serde_json::json!({"threadId": id}))
                .await?;
            Ok(())
        })
        .await?;
    Ok(HttpResponse::NoContent().finish())
}
