//! `POST /api/runs/{id}/cancel`.

use actix_web::{HttpResponse, web};
use agentloop_shared::runs;
use diesel_async::AsyncConnection;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Cancels the run (idempotent): queued/pending at once; running via the owning worker, which
/// aborts at its next safe point. Returns the run after the call (200).
pub async fn cancel_run(state: web::Data<AppState>, who: Authenticated, path: web::Path<Uuid>) -> Result<HttpResponse, ApiError> {
    let mut conn = state.pool.get().await?;
    let run = runs::get_owned(&mut conn, path.into_inner(), who.0.id).await?.ok_or(ApiError::NotFound)?;
    let run = (*conn).transaction(async |conn| runs::request_cancel(conn, run.id).await).await?;
    Ok(HttpResponse::Ok().json(run.to_json()))
}
