//! `GET /api/threads?limit=&cursor=`.

use actix_web::{HttpResponse, web};
use agentloop_shared::{messages, runs, threads};
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;
use crate::views;

/// Query: `limit` 1..100 (default 50); `cursor` from the previous page's `nextCursor`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Page size, 1..=100 (outside: 400 `invalid_query`).
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<i64>,
    /// `nextCursor` of the previous page.
    #[param(max_length = 200)]
    pub cursor: Option<String>,
}

/// Thread summaries, most recently updated first: id, title, model, authoritative
/// `messageCount`, a one-message `preview` (≤ 200 characters), active `run`, `updatedAt`, `sig`.
#[utoipa::path(
    get, path = "/api/threads", tag = "threads", operation_id = "list_threads",
    params(ListQuery),
    responses((status = 200, description = "Thread summaries, most recently updated first", body = crate::views::ThreadList),
              (status = 400, description = "`invalid_cursor`, `invalid_query`", body = crate::views::ErrorBody))
)]
pub async fn list_threads(
    state: web::Data<AppState>,
    who: Authenticated,
    query: web::Query<ListQuery>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(page(&state, who.0.id, query.limit, query.cursor.as_deref()).await?))
}

/// One page of [`list_threads`] for `principal` (shared with the MCP tool `list_threads`).
pub async fn page(state: &AppState, principal: Uuid, limit: Option<i64>, cursor: Option<&str>) -> Result<serde_json::Value, ApiError> {
    let limit = crate::extract::query_range("limit", limit, 50, 1..=100)?;
    let before = match cursor {
        Some(c) => Some(crate::extract::keyset_cursor(c)?),
        None => None,
    };
    let mut conn = state.pool.get().await?;
    let page = threads::list(&mut conn, principal, limit, before).await?;
    let mut items = Vec::with_capacity(page.len());
    for thread in &page {
        let preview = messages::preview(&mut conn, thread.id, 200).await?;
        let run = runs::active_for_thread(&mut conn, thread.id).await?;
        items.push(json!({
            "id": thread.id,
            "title": thread.title,
            "model": thread.model,
            "messageCount": thread.message_count,
            "preview": preview,
            "run": views::run_json(run.as_ref()),
            "updatedAt": thread.updated_at,
            "sig": views::sig(thread, run.as_ref(), thread.streaming_message.as_ref().unwrap_or(&serde_json::Value::Null)),
        }));
    }
    let next = (page.len() as i64 == limit)
        .then(|| page.last().map(|t| format!("{}_{}", t.updated_at.timestamp_micros(), t.id)))
        .flatten();
    Ok(json!({"threads": items, "nextCursor": next}))
}
