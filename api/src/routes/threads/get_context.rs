//! `GET /api/threads/{id}/context`.

use actix_web::{HttpResponse, web};
use agentloop_shared::compaction::Settings;
use agentloop_shared::{messages, snapshots, threads};
use serde_json::json;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Context accounting (SPEC §13; issue 4): what the next model call would carry, in tokens
/// (tiktoken `o200k_base`: exact for OpenAI models, approximate for other families).
/// `{snapshot: {version, fromSequence, toSequence, tokens} | null, instructions: {messages,
/// tokens}, tail: {messages, tokens, fromSequence}, tools: tokens | null (tool schemas, from the
/// worker's last measurement), total, measured (the worker's last count), limit, threshold}`.
#[utoipa::path(
    get, path = "/api/threads/{id}/context", tag = "threads", operation_id = "get_context",
    params(("id" = Uuid, Path, description = "Thread id")),
    responses((status = 200, description = "Context accounting in tokens", body = crate::views::ContextView),
              (status = 404, description = "Not the caller's thread", body = crate::views::ErrorBody))
)]
pub async fn get_context(state: web::Data<AppState>, who: Authenticated, path: web::Path<Uuid>) -> Result<HttpResponse, ApiError> {
    let mut conn = state.pool.get().await?;
    let thread = threads::get_owned(&mut conn, path.into_inner(), who.0.id).await?.ok_or(ApiError::NotFound)?;
    let snapshot = snapshots::latest_live(&mut conn, thread.id).await?;
    let (instructions, after) = match &snapshot {
        Some(s) => (messages::instructions_before(&mut conn, thread.id, s.from_sequence).await?, s.to_sequence),
        None => (Vec::new(), 0),
    };
    let instruction_tokens: i64 = instructions.iter().map(|m| i64::from(m.token_estimate)).sum();
    let (tail_count, tail_tokens) = messages::active_totals_after(&mut conn, thread.id, after).await?;
    let snapshot_tokens = snapshot.as_ref().map_or(0, |s| i64::from(s.token_estimate));
    let messages_total = snapshot_tokens + instruction_tokens + tail_tokens;
    let tools = thread.context_tokens.map(|m| (i64::from(m) - messages_total).max(0));
    let model = thread.model.as_deref().and_then(|m| state.catalog.get(m)).or_else(|| state.catalog.default_model());
    let limit = model.and_then(|m| m.context_tokens);
    let threshold = Settings::from_metadata(&thread.metadata, limit).threshold;
    Ok(HttpResponse::Ok().json(json!({
        "snapshot": snapshot.as_ref().map(|s| json!({
            "version": s.version, "fromSequence": s.from_sequence, "toSequence": s.to_sequence, "tokens": s.token_estimate,
        })),
        "instructions": {"messages": instructions.len(), "tokens": instruction_tokens},
        "tail": {"messages": tail_count, "tokens": tail_tokens, "fromSequence": after + 1},
        "tools": tools,
        "total": messages_total + tools.unwrap_or(0),
        "measured": thread.context_tokens,
        "limit": limit,
        "threshold": threshold,
    })))
}
