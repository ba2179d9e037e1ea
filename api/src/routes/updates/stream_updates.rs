//! `GET /api/threads/{id}/updates/stream` — SSE.

use std::time::Duration;

use actix_web::{HttpRequest, Responder, web};
use actix_web_lab::sse;
use agentloop_shared::{runs, threads};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;
use uuid::Uuid;

use super::{Batch, resume_cursor};
use crate::error::ApiError;
use crate::extract::Authenticated;
use crate::{AppState, Transport, views};

/// Query: `afterSequence` (journal sequence to resume after; `Last-Event-ID` wins).
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
pub struct StreamQuery {
    /// Journal sequence to resume after (omit: the present).
    pub after_sequence: Option<i64>,
}

/// SSE of the thread's journal. First `connected` (`{threadId, sequence, transport}`), then a
/// `thread` snapshot (`{thread, run, streamingMessage, sig}`, carrying the current partial text
/// for a client joining mid-answer), then every journal event with `id:` = its sequence and
/// `event:` = its kind, `heartbeat` every `SSE_HEARTBEAT_MS`, and `reset` (`{sequence}`) when the
/// resume position was pruned. Without a resume position the stream starts at the present.
/// Closing the connection never cancels anything. 503 `sse_unavailable` when the transport is
/// configured `long-poll`.
///
/// Each stream counts against `LIVE_MAX_PER_PRINCIPAL` / `LIVE_MAX_CONNECTIONS` (429
/// `too_many_live_connections`); when its key is revoked or expires, or its session ends, it gets
/// a final `error` event (`{"error":{"code":"credentials_revoked",...}}`) and closes within
/// `REVOCATION_CHECK_MS` plus a query; after `SSE_MAX_STREAM_MS` (if set) it closes and the
/// client resumes with `Last-Event-ID`. Events larger than `LIVE_EVENT_MAX_BYTES` arrive slimmed
/// (see `hub::slim`).
#[utoipa::path(
    get, path = "/api/threads/{id}/updates/stream", tag = "updates", operation_id = "stream_updates",
    params(("id" = Uuid, Path, description = "Thread id"), StreamQuery,
           ("Last-Event-ID" = Option<String>, Header, description = "Resume after this journal sequence (wins over afterSequence)")),
    responses((status = 200, description = "Server-sent events: `connected`, `thread`, journal events (`id:` = sequence), `heartbeat`, `reset`, and a final `error` when the credentials are revoked", content_type = "text/event-stream", body = crate::views::SseEvent),
              (status = 400, description = "`invalid_last_event_id`", body = crate::views::ErrorBody),
              (status = 404, description = "Not the caller's thread", body = crate::views::ErrorBody),
              (status = 429, description = "`too_many_live_connections` or a rate limit", body = crate::views::ErrorBody),
              (status = 503, description = "`sse_unavailable` (EVENTS_TRANSPORT=long-poll) or `database_unavailable`", body = crate::views::ErrorBody))
)]
pub async fn stream_updates(
    state: web::Data<AppState>,
    who: Authenticated,
    req: HttpRequest,
    path: web::Path<Uuid>,
    query: web::Query<StreamQuery>,
) -> Result<impl Responder, ApiError> {
    if state.transport == Transport::LongPoll {
        return Err(ApiError::Unavailable {
            code: "sse_unavailable",
            message: "SSE is disabled on this server (EVENTS_TRANSPORT=long-poll); use GET /api/threads/{id}/updates".into(),
        });
    }
    let requested = resume_cursor(&req, query.after_sequence)?;
    let guard = state.limits.open_live(who.0.id, who.1)?;
    let mut conn = state.pool.get().await?;
    let thread = threads::get_owned(&mut conn, path.into_inner(), who.0.id).await?.ok_or(ApiError::NotFound)?;
    let run = runs::latest_for_thread(&mut conn, thread.id).await?;
    let streaming = views::streaming(&mut conn, &thread).await?;
    drop(conn);
    let wake = state.hub.subscribe(thread.id);
    let cursor = requested.unwrap_or(thread.last_event_sequence);
    // Small: every queued event is at most LIVE_EVENT_MAX_BYTES, and a slow reader only
    // holds this many.
    let (tx, rx) = mpsc::channel::<sse::Event>(16);
    let connected = json!({"threadId": thread.id, "sequence": cursor, "transport": state.transport.as_str()});
    let mut thread_view = views::thread_json(&thread);
    crate::hub::slim(&mut thread_view, state.hub.event_bound());
    let snapshot = json!({
        "thread": thread_view,
        "run": views::run_json(run.as_ref()),
        "sig": views::sig(&thread, run.as_ref(), &streaming),
        "streamingMessage": streaming,
    });
    let _ = tx.try_send(data("connected", &connected, None));
    let _ = tx.try_send(data("thread", &snapshot, None));
    let peer = crate::connection::PeerSocket::of(&req);
    tokio::spawn(pump(state.clone(), thread.id, cursor, wake, tx, guard, peer));
    Ok(sse::Sse::from_infallible_receiver(rx)
        .with_retry_duration(Duration::from_secs(2))
        .customize()
        .insert_header(("Cache-Control", "no-cache, no-transform"))
        .insert_header(("X-Accel-Buffering", "no")))
}

fn data(kind: &str, payload: &serde_json::Value, id: Option<i64>) -> sse::Event {
    let mut d = sse::Data::new(payload.to_string()).event(kind.to_owned());
    if let Some(id) = id {
        d = d.id(id.to_string());
    }
    sse::Event::Data(d)
}

/// Feeds one SSE client from the journal until it disconnects.
async fn pump(
    state: web::Data<AppState>,
    thread_id: Uuid,
    mut cursor: i64,
    mut wake: tokio::sync::watch::Receiver<u64>,
    tx: mpsc::Sender<sse::Event>,
    guard: crate::limits::LiveGuard,
    peer: Option<crate::connection::PeerSocket>,
) {
    let heartbeat = state.sse_heartbeat;
    let _client = LiveClient::new();
    let revoked = guard.revoked();
    let end = (!state.sse_max_stream.is_zero()).then(|| tokio::time::Instant::now() + state.sse_max_stream);
    let until_end = async move {
        match end {
            Some(end) => tokio::time::sleep_until(end).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(until_end);
    // A departed client ends its pump within a check interval, not two heartbeats later — also
    // while the pump waits for room in a full queue (a client that stopped reading, then left).
    let gone = crate::connection::client_gone(peer);
    tokio::pin!(gone);
    macro_rules! send {
        ($event:expr) => {
            tokio::select! {
                sent = tx.send($event) => sent.is_ok(),
                () = &mut gone => false,
            }
        };
    }
    loop {
        if revoked.is_cancelled() {
            let error = crate::error::envelope("credentials_revoked", "the API key or session of this stream was revoked or expired");
            let _ = send!(data("error", &error, None));
            return;
        }
        wake.borrow_and_update();
        let batch = state.hub.next_batch(&state.pool, thread_id, cursor).await;
        let mut sent_any = false;
        match batch {
            Ok(Batch::Events(events)) => {
                sent_any = events.len() as i64 == super::BATCH;
                for event in events {
                    if !send!(data(&event.kind, &event.payload, Some(event.sequence))) {
                        return;
                    }
                    cursor = event.sequence;
                }
            }
            Ok(Batch::Reset { sequence }) => {
                cursor = sequence;
                if !send!(data("reset", &json!({"sequence": sequence}), Some(sequence))) {
                    return;
                }
            }
            Err(error) => {
                tracing::warn!(%error, "SSE journal read failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        }
        if sent_any {
            continue; // a full batch: more may be waiting
        }
        tokio::select! {
            changed = wake.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(heartbeat) => {
                if !send!(data("heartbeat", &json!({"sequence": cursor}), None)) {
                    return;
                }
            }
            _ = tx.closed() => return,
            () = &mut gone => return,
            _ = revoked.cancelled() => {}
            _ = &mut until_end => return,
        }
    }
}

/// Counts connected live-update clients in the `agentloop_live_clients{transport}` gauge
/// (`sse` streams, `long-poll` requests waiting) while it lives.
pub(crate) struct LiveClient(&'static str);

impl LiveClient {
    pub(crate) fn new() -> Self {
        Self::of("sse")
    }

    pub(crate) fn of(transport: &'static str) -> Self {
        metrics::gauge!("agentloop_live_clients", "transport" => transport).increment(1.0);
        Self(transport)
    }
}

impl Drop for LiveClient {
    fn drop(&mut self) {
        metrics::gauge!("agentloop_live_clients", "transport" => self.0).decrement(1.0);
    }
}
