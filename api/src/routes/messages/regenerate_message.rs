//! `POST /api/threads/{id}/messages/{sequence}/regenerate`.

use actix_web::{HttpResponse, web};
use agentloop_shared::messages::role;
use agentloop_shared::{branches, threads};
use diesel_async::AsyncConnection;
use serde_json::{Value, json};
use uuid::Uuid;

use super::{RunOptions, enqueue, ensure_idle};
use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// A new answer from `sequence`: for a user message, everything after it is deactivated; for an
/// assistant or tool message, its whole tool group and everything after it. A run is enqueued
/// (no user message is invented). Body (optional): `{maxSteps?, model?}`. 202
/// `{run, deactivated}`. Errors: 404, 409 `run_active` / `approval_required`.
pub async fn regenerate_message(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<(Uuid, i64)>,
    body: Option<web::Json<RunOptions>>,
) -> Result<HttpResponse, ApiError> {
    let (thread_id, sequence) = path.into_inner();
    let options = body.map(web::Json::into_inner).unwrap_or_default();
    let principal = who.0.id;
    let mut conn = state.pool.get().await?;
    let response = (*conn)
        .transaction(async |conn| -> Result<Value, ApiError> {
            let thread = threads::lock_owned(conn, thread_id, principal).await?.ok_or(ApiError::NotFound)?;
            ensure_idle(conn, thread.id).await?;
            let target = branches::active_at(conn, thread.id, sequence).await?.ok_or(ApiError::NotFound)?;
            let from = if target.role == role::USER {
                sequence + 1
            } else {
                *branches::tool_group(conn, &target).await?.first().unwrap_or(&sequence)
            };
            let old = branches::active_from(conn, thread.id, from).await?;
            let deactivated = branches::deactivate(conn, thread.id, &old).await?;
            let run = enqueue(conn, &state, &thread, principal, &options).await?;
            Ok(json!({"run": run.to_json(), "deactivated": deactivated}))
        })
        .await?;
    Ok(HttpResponse::Accepted().json(response))
}
