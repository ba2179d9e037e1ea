//! `GET /api/threads/{id}/messages?before=&after=&take=&maxBytes=` — pages the middle of a thread
//! (SPEC §10, §13).

use std::collections::HashSet;

use actix_web::{HttpResponse, web};
use agentloop_shared::messages::{self, MessageMeta};
use agentloop_shared::threads;
use diesel_async::AsyncPgConnection;
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;
use crate::views;

/// Default and bounds of `take`.
pub const TAKE_DEFAULT: i64 = 100;
pub const TAKE_MAX: i64 = 200;
/// Default and bounds of `maxBytes`.
pub const MAX_BYTES_DEFAULT: i64 = 512 * 1024;
pub const MAX_BYTES_MIN: i64 = 64 * 1024;
pub const MAX_BYTES_MAX: i64 = 2 * 1024 * 1024;
/// A message added only to keep a tool group whole is cut to at least this many bytes even
/// when the page's byte budget is spent (so widening cannot blow the response up).
const WIDEN_FLOOR_BYTES: usize = 8 * 1024;
/// Rows read per step while looking for the edge of a tool group.
const WIDEN_BATCH: i64 = 64;

/// Query: `before` / `after` (exclusive sequence bounds, each optional), `take` 1..200 (100),
/// `maxBytes` 64 KiB..2 MiB (512 KiB). Out-of-range values are 400 `invalid_query`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
pub struct PageQuery {
    /// Exclusive upper sequence bound.
    pub before: Option<i64>,
    /// Exclusive lower sequence bound.
    pub after: Option<i64>,
    /// Messages per page, 1..=200 (outside: 400 `invalid_query`).
    #[param(minimum = 1, maximum = 200)]
    pub take: Option<i64>,
    /// Byte budget of the page, 65536..=2097152 (outside: 400 `invalid_query`).
    #[param(minimum = 65536, maximum = 2097152)]
    pub max_bytes: Option<i64>,
}

/// A page of active messages strictly between `after` and `before`, in ascending order:
/// `before` only → the `take` messages just before it; `after` (with or without `before`) → the
/// `take` just after it; neither → the latest `take`. The page is cut at `maxBytes` (stored
/// `byte_size`; a single larger message is returned truncated with `truncated: true`), then
/// widened to whole tool groups (seed 000, SPEC §6: an assistant message with tool calls and
/// its contiguous tool results are never split) — beyond `take`, the byte budget and, when a
/// bound falls inside a group, that bound too: the page then also holds rows the client asked
/// to exclude (merge by `sequence`). Pages walked with `before = firstSequence` or
/// `after = lastSequence` never overlap, because their edges are group edges.
///
/// Body: `{messages, firstSequence, lastSequence, hasMoreBefore, hasMoreAfter}`; the flags say
/// whether active messages remain between the page and the requested bound on that side (the
/// thread's start/end when the bound is absent). Cost: a handful of index range scans on
/// `messages_active_by_sequence`, independent of the thread's length (plus one scan per 64
/// rows of a group the page widens over).
#[utoipa::path(
    get, path = "/api/threads/{id}/messages", tag = "threads", operation_id = "list_messages",
    params(("id" = Uuid, Path, description = "Thread id"), PageQuery),
    responses((status = 200, description = "A page of active messages", body = crate::views::MessagePage),
              (status = 400, description = "`invalid_query`: `take` or `maxBytes` out of range", body = crate::views::ErrorBody),
              (status = 404, description = "Not the caller's thread", body = crate::views::ErrorBody))
)]
pub async fn list_messages(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<Uuid>,
    query: web::Query<PageQuery>,
) -> Result<HttpResponse, ApiError> {
    let take = crate::extract::query_range("take", query.take, TAKE_DEFAULT, 1..=TAKE_MAX)?;
    let max_bytes = crate::extract::query_range("maxBytes", query.max_bytes, MAX_BYTES_DEFAULT, MAX_BYTES_MIN..=MAX_BYTES_MAX)? as usize;
    let (after, before) = (query.after, query.before);
    let mut conn = state.pool.get().await?;
    let thread = threads::get_owned(&mut conn, path.into_inner(), who.0.id).await?.ok_or(ApiError::NotFound)?;

    let empty = || {
        HttpResponse::Ok().json(json!({
            "messages": [], "firstSequence": null, "lastSequence": null, "hasMoreBefore": false, "hasMoreAfter": false,
        }))
    };
    if matches!((after, before), (Some(a), Some(b)) if b.saturating_sub(a) <= 1) {
        return Ok(empty());
    }

    // 1. Metadata of the candidate rows, nearest to the anchor first, cut at the byte budget.
    let forward = after.is_some();
    let candidates = messages::active_meta_between(&mut conn, thread.id, after, before, !forward, take).await?;
    let mut core: Vec<MessageMeta> = Vec::with_capacity(candidates.len());
    let mut used = 0usize;
    for meta in candidates {
        let size = meta.byte_size.max(0) as usize;
        if !core.is_empty() && used + size > max_bytes {
            break;
        }
        used += size.min(max_bytes);
        core.push(meta);
    }
    if !forward {
        core.reverse();
    }
    let (Some(low), Some(high)) = (core.first().cloned(), core.last().cloned()) else {
        return Ok(empty());
    };

    // 2. Widen both edges to whole tool groups, past the requested bounds if a group crosses one.
    let first = if low.is_tool_result() { widen_down(&mut conn, thread.id, low.sequence).await? } else { low.sequence };
    let last = if high.is_tool_result() || high.starts_tool_group() {
        widen_up(&mut conn, thread.id, high.sequence).await?
    } else {
        high.sequence
    };

    // 3. The bodies of exactly that range, and whether more exists on each side.
    let rows = messages::active_in_range(&mut conn, thread.id, first, last).await?;
    let (more_before, more_after) = messages::active_exists_around(&mut conn, thread.id, first, last, after, before).await?;
    drop(conn);

    let core: HashSet<i64> = core.iter().map(|m| m.sequence).collect();
    let mut out = Vec::with_capacity(rows.len());
    for row in &rows {
        let size = row.byte_size.max(0) as usize;
        if core.contains(&row.sequence) {
            out.push(views::message_json(row, max_bytes));
        } else {
            // Kept only so the tool group is whole: whatever budget is left, at least the floor.
            let limit = max_bytes.saturating_sub(used).max(WIDEN_FLOOR_BYTES);
            used += size.min(limit);
            out.push(views::message_json(row, limit));
        }
    }
    let mut conn = state.pool.get().await?;
    crate::reads::annotate_branches(&mut conn, thread.id, &mut out).await?;
    Ok(HttpResponse::Ok().json(json!({
        "messages": out,
        "firstSequence": rows.first().map(|m| m.sequence),
        "lastSequence": rows.last().map(|m| m.sequence),
        "hasMoreBefore": more_before,
        "hasMoreAfter": more_after,
    })))
}

/// The page starts with a tool result: walk down to the assistant tool-call message that opens
/// its group (tool results in between included; orphan results stop at the first other
/// message). Returns the new first sequence.
async fn widen_down(conn: &mut AsyncPgConnection, thread_id: Uuid, from: i64) -> Result<i64, ApiError> {
    let mut first = from;
    loop {
        let batch = messages::active_meta_between(conn, thread_id, None, Some(first), true, WIDEN_BATCH).await?;
        let full = batch.len() as i64 == WIDEN_BATCH;
        for meta in batch {
            if meta.is_tool_result() {
                first = meta.sequence;
            } else {
                if meta.starts_tool_group() {
                    first = meta.sequence;
                }
                return Ok(first);
            }
        }
        if !full {
            return Ok(first);
        }
    }
}

/// The page ends inside a tool group: walk up over the contiguous tool results that follow.
/// Returns the new last sequence.
async fn widen_up(conn: &mut AsyncPgConnection, thread_id: Uuid, from: i64) -> Result<i64, ApiError> {
    let mut last = from;
    loop {
        let batch = messages::active_meta_between(conn, thread_id, Some(last), None, false, WIDEN_BATCH).await?;
        let full = batch.len() as i64 == WIDEN_BATCH;
        for meta in batch {
            if !meta.is_tool_result() {
                return Ok(last);
            }
            last = meta.sequence;
        }
        if !full {
            return Ok(last);
        }
    }
}
