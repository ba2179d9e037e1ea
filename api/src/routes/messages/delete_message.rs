//! `DELETE /api/threads/{id}/messages/{sequence}`.

use actix_web::{HttpResponse, web};
use agentloop_shared::{branches, threads};
use diesel_async::AsyncConnection;
use serde_json::{Value, json};
use uuid::Uuid;

use super::ensure_idle;
use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Deactivates the message at `sequence` with its whole tool group (an assistant tool call and
/// its results go together; rows are never deleted). 200 `{deactivated}`. Errors: 404, 409
/// `run_active` / `approval_required`.
pub async fn delete_message(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<(Uuid, i64)>,
) -> Result<HttpResponse, ApiError> {
    let (thread_id, sequence) = path.into_inner();
    let principal = who.0.id;
    let mut conn = state.pool.get().await?;
    let response = (*conn)
        .transaction(async |conn| -> Result<Value, ApiError> {
            let thread = threads::lock_owned(conn, thread_id, principal).await?.ok_or(ApiError::NotFound)?;
            ensure_idle(conn, thread.id).await?;
            let target = branches::active_at(conn, thread.id, sequence).await?.ok_or(ApiError::NotFound)?;
            let group = branches::tool_group(conn, &target).await?;
            let deactivated = branches::deactivate(conn, thread.id, &group).await?;
            Ok(json!({"deactivated": deactivated}))
        })
        .await?;
    Ok(HttpResponse::Ok().json(response))
}
