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
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
pub struct PollQuery {
    /// Journal sequence to resume after (omit: the present).
    pub after_sequence: Option<i64>,
    /// Longest wait in ms, 0..=60000 (else 400 `invalid_query`); above the server's
    /// `LONG_POLL_MAX_MS` it is cut to it.
    #[param(minimum = 0, maximum = 60000)]
    pub timeout_ms: Option<i64>,
}

/// Returns at once when events newer than the cursor exist, else waits up to the timeout for
/// one; a wait ends with 401 `credentials_revoked` when the key or session is revoked meanwhile
/// (within `REVOCATION_CHECK_MS`). Counts against the live-connection limits while it waits. Body: `{events: [{sequence, kind, payload, createdAt}], nextSequence, reset}`; with
/// `reset: true` the client refetches the window and resumes from `nextSequence`.
#[utoipa::path(
    get, path = "/api/threads/{id}/updates", tag = "updates", operation_id = "poll_updates",
    params(("id" = Uuid, Path, description = "Thread id"), PollQuery,
           ("Last-Event-ID" = Option<String>, Header, description = "Resume after this journal sequence (wins over afterSequence)")),
    responses((status = 200, description = "Events after the cursor, or none after the timeout", body = crate::views::PollAnswer),
              (status = 400, description = "`invalid_last_event_id`, `invalid_query`", body = crate::views::ErrorBody),
              (status = 401, description = "`unauthorized`, or `credentials_revoked` when the key or session ended while waiting", body = crate::views::ErrorBody),
              (status = 404, description = "Not the caller's thread", body = crate::views::ErrorBody),
              (status = 429, description = "`too_many_live_connections` or a rate limit", body = crate::views::ErrorBody))
)]
pub async fn poll_updates(
    state: web::Data<AppState>,
    who: Authenticated,
    req: HttpRequest,
    path: web::Path<Uuid>,
    query: web::Query<PollQuery>,
) -> Result<HttpResponse, ApiError> {
    let requested = resume_cursor(&req, query.after_sequence)?;
    let timeout = match query.timeout_ms {
        None => state.long_poll_timeout,
        Some(ms) => Duration::from_millis(crate::extract::query_range("timeoutMs", Some(ms), 0, 0..=MAX_TIMEOUT.as_millis() as i64)? as u64),
    }
    .min(state.long_poll_max);
    let guard = state.limits.open_live(who.0.id, who.1)?;
    let revoked = guard.revoked();
    let thread_id = path.into_inner();
    let mut conn = state.pool.get().await?;
    let position = threads::event_position_owned(&mut conn, thread_id, who.0.id).await?.ok_or(ApiError::NotFound)?;
    drop(conn);
    let _client = super::stream_updates::LiveClient::of("long-poll");
    let mut wake = state.hub.subscribe(thread_id);
    let cursor = requested.unwrap_or(position);
    let deadline = tokio::time::Instant::now() + timeout;
    let gone = crate::connection::client_gone(crate::connection::PeerSocket::of(&req));
    tokio::pin!(gone);
    let mut first = true;
    loop {
        wake.borrow_and_update();
        let read = state.hub.next_batch(&state.pool, thread_id, cursor);
        // A read after a wake-up ends at the deadline (the client asked for an answer by then;
        // its cursor is unchanged, so it misses nothing); the first read always completes, so
        // `timeoutMs=0` still looks once.
        let batch = if std::mem::take(&mut first) {
            read.await
        } else {
            match tokio::time::timeout_at(deadline, read).await {
                Ok(batch) => batch,
                Err(_) => break,
            }
        };
        let batch = batch.map_err(|e| ApiError::database_unavailable(&e))?;
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
            // The client left: end now, so its live-connection slot and hub subscription are
            // released at once (the answer goes nowhere).
            () = &mut gone => break,
            _ = revoked.cancelled() => {
                return Err(ApiError::Unauthenticated {
                    code: "credentials_revoked",
                    message: "the API key or session of this request was revoked or expired".into(),
                });
            }
        }
    }
    Ok(HttpResponse::Ok().json(json!({"events": [], "nextSequence": cursor, "reset": false})))
}
