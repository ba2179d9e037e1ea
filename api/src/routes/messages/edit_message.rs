//! `POST /api/threads/{id}/messages/{sequence}/edit`.

use actix_web::{HttpResponse, web};
use agentloop_shared::messages::{self, NewMessage, Provenance, role};
use agentloop_shared::{branches, threads, tokens};
use diesel_async::AsyncConnection;
use serde::Deserialize;
use serde_json::{Value, json};
use uuid::Uuid;

use super::{RunOptions, enqueue, ensure_idle};
use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Body: `{content, maxSteps?, model?}`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EditMessage {
    pub content: Value,
    #[serde(default)]
    pub max_steps: Option<i32>,
    #[serde(default)]
    pub model: Option<String>,
}

/// Replaces the user message at `sequence` with new content: it and every active row after it
/// become inactive (never deleted), the new user message is appended with a higher sequence,
/// snapshots covering the old branch stop applying, and a run is enqueued like a chat post.
/// 202 `{run, message, deactivated}`. Errors: 404, 400 `not_a_user_message` /
/// `invalid_content`, 409 `run_active` / `approval_required`.
pub async fn edit_message(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<(Uuid, i64)>,
    body: web::Json<EditMessage>,
) -> Result<HttpResponse, ApiError> {
    let (thread_id, sequence) = path.into_inner();
    let body = body.into_inner();
    crate::validate::content(&body.content)?;
    let text = messages::content_text(&body.content);
    let options = RunOptions { max_steps: body.max_steps, model: body.model };
    let principal = who.0.id;
    let mut conn = state.pool.get().await?;
    let response = (*conn)
        .transaction(async |conn| -> Result<Value, ApiError> {
            let thread = threads::lock_owned(conn, thread_id, principal).await?.ok_or(ApiError::NotFound)?;
            ensure_idle(conn, thread.id).await?;
            let target = branches::active_at(conn, thread.id, sequence).await?.ok_or(ApiError::NotFound)?;
            if target.role != role::USER {
                return Err(ApiError::bad_request("not_a_user_message", "only user messages can be edited"));
            }
            let old = branches::active_from(conn, thread.id, sequence).await?;
            let deactivated = branches::deactivate(conn, thread.id, &old).await?;
            let message = NewMessage {
                role: role::USER.into(),
                content: body.content.clone(),
                tool_calls: None,
                tool_call_id: None,
                reasoning: None,
                token_estimate: (4 + tokens::estimate_text(&text)) as i32,
            };
            let (_, message) = messages::append(conn, thread.id, Provenance::default(), &[message], &[None])
                .await?
                .pop()
                .ok_or_else(|| ApiError::Internal(anyhow::anyhow!("message not appended")))?;
            let run = enqueue(conn, &state, &thread, principal, &options).await?;
            Ok(json!({"run": run.to_json(), "message": message, "deactivated": deactivated}))
        })
        .await?;
    Ok(HttpResponse::Accepted().json(response))
}
