//! Live updates (SPEC §10): SSE and long-poll over the same per-thread journal cursor.

pub mod poll_updates;
pub mod stream_updates;

use agentloop_shared::events::{self, ThreadEvent};
use diesel_async::AsyncPgConnection;
use uuid::Uuid;

/// Most events read per journal query.
pub const BATCH: i64 = 500;

/// What a client at `cursor` should receive next.
pub enum Batch {
    /// Events after the cursor (possibly none).
    Events(Vec<ThreadEvent>),
    /// The cursor is below the retained range: the client must refetch the window and resume
    /// from `sequence` (the journal's current end).
    Reset { sequence: i64 },
}

/// Reads the next batch after `cursor` (payloads slimmed to about `event_max` bytes), detecting
/// a pruned position.
pub async fn next_batch(conn: &mut AsyncPgConnection, thread_id: Uuid, cursor: i64, current: i64, event_max: usize) -> diesel::QueryResult<Batch> {
    if cursor > current {
        // A cursor from the future (e.g. another thread's id): treat as a reset to the present.
        return Ok(Batch::Reset { sequence: current });
    }
    let events = crate::hub::read_journal(conn, thread_id, cursor, BATCH, crate::hub::BATCH_BYTES, event_max).await?;
    if let Some(first) = events.first() {
        if first.sequence > cursor + 1 {
            return Ok(Batch::Reset { sequence: current });
        }
    } else if cursor < current {
        // Nothing retained after the cursor although the journal moved on: pruned.
        let oldest = events::oldest_retained(conn, thread_id).await?;
        if oldest.is_none_or(|o| o > cursor + 1) {
            return Ok(Batch::Reset { sequence: current });
        }
    }
    Ok(Batch::Events(events))
}

/// Parses a resume position: the `Last-Event-ID` header wins over `afterSequence`. Errors: 400
/// `invalid_last_event_id` (not an integer ≥ 0), `invalid_query` (a negative `afterSequence`).
pub fn resume_cursor(req: &actix_web::HttpRequest, after_sequence: Option<i64>) -> Result<Option<i64>, crate::error::ApiError> {
    let invalid = || crate::error::ApiError::bad_request("invalid_last_event_id", "Last-Event-ID must be a journal sequence (an integer, 0 or more)");
    // A header that is not even ASCII is refused like any other non-integer, not ignored.
    let header = req.headers().get("Last-Event-ID").map(|v| v.to_str().map_err(|_| invalid())).transpose()?;
    match header {
        Some(raw) if !raw.trim().is_empty() => match raw.trim().parse::<i64>() {
            Ok(cursor) if cursor >= 0 => Ok(Some(cursor)),
            _ => Err(invalid()),
        },
        // A journal sequence is never negative: a corrupted cursor is told, not reset.
        _ if after_sequence.is_some_and(|c| c < 0) => {
            Err(crate::error::ApiError::bad_request("invalid_query", "afterSequence must be a journal sequence (0 or more)"))
        }
        _ => Ok(after_sequence),
    }
}
