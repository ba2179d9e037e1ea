//! `GET /api/threads/{id}/updates` — long-poll fallback with the SSE cursor.

use std::time::Duration;

use actix_web::{HttpRequest, HttpResponse, web};
use agentloop_shared::threads;
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use super::{Batch, resume_cursor};
use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Longest accepted `timeoutMs`.
const MAX_TIMEOUT: Duration = Duration::from_secs(60);

/// Query: `afterSequence` (omit to start at the present), `timeoutMs` (0..60000; default
/// `LONG_POLL_TIMEOUT_MS`).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PollQuery {
    pub after_sequence: Option<i64>,
    pub timeout_ms: Option<u64>,
}

/// Returns at once when events newer than the cursor exist, else waits up to the timeout for
/// one. Body: `{events: [{sequence, kind, payload, createdAt}], nextSequence, reset}`; with
/// `reset: true` the client refetches the window and resumes from `nextSequence`.
pub async fn poll_updates(
    state: web::Data<AppState>,
    who: Authenticated,
    req: HttpRequest,
    path: web::Path<Uuid>,
    query: web::Query<PollQuery>,
) -> Result<HttpResponse, ApiError> {
    let requested = resume_cursor(&req, query.after_sequence)?;
    let timeout = query.timeout_ms.map_or(state.long_poll_timeout, Duration::from_millis).min(MAX_TIMEOUT);
    let thread_id = path.into_inner();
    let mut conn = state.pool.get().await?;
    let thread = threads::get_owned(&mut conn, thread_id, who.0.id).await?.ok_or(ApiError::NotFound)?;
    drop(conn);
    let mut wake = state.hub.subscribe(thread_id);
    let cursor = requested.unwrap_or(thread.last_event_sequence);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        wake.borrow_and_update();
        let batch = state.hub.next_batch(&state.pool, thread_id, cursor).await.map_err(|e| ApiError::Unavailable {
            code: "database_unavailable",
            message: format!("database unavailable: {e}"),
        })?;
        match batch {
            Batch::Reset { sequence } => {
                return Ok(HttpResponse::Ok().json(json!({"events": [], "nextSequence": sequence, "reset": true})));
            }
            Batch::Events(events) if !events.is_empty() => {
                let next = events.last().map_or(cursor, |e| e.sequence);
                return Ok(HttpResponse::Ok().json(json!({"events": events, "nextSequence": next, "reset": false})));
            }
            Batch::Events(_) => {}
        }
        tokio::select! {
            changed = wake.changed() => if changed.is_err() { break },
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    Ok(HttpResponse::Ok().json(json!({"events": [], "nextSequence": cursor, "reset": false})))
}
