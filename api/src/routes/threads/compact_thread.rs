//! `POST /api/threads/{id}/compact`.

use actix_web::{HttpResponse, web};
use agentloop_shared::runs::{self, NewRun, status};
use agentloop_shared::threads::{self, NewThread};
use diesel_async::AsyncConnection;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;
use crate::views;

/// Manual compaction (SPEC §8): creates a child thread (`parentThreadId` = this thread) and a
/// `compaction` run on it, in one transaction; a worker summarises this thread's context and
/// writes the child's history — instructions + summary + verbatim recent tail — then completes
/// the run. This thread is left untouched. 201 `{thread, run}`. Errors: 404, 400 `no_model`.
pub async fn compact_thread(state: web::Data<AppState>, who: Authenticated, path: web::Path<Uuid>) -> Result<HttpResponse, ApiError> {
    let (source_id, principal) = (path.into_inner(), who.0.id);
    let default_model = state.catalog.default_model().map(|m| m.id.clone());
    let mut conn = state.pool.get().await?;
    let body = (*conn)
        .transaction(async |conn| -> Result<Value, ApiError> {
            let source = threads::lock_owned(conn, source_id, principal).await?.ok_or(ApiError::NotFound)?;
            let model = source
                .model
                .clone()
                .or(default_model)
                .ok_or_else(|| ApiError::bad_request("no_model", "no model is configured on this server"))?;
            let title = if source.title.is_empty() { "compacted".to_owned() } else { format!("{} (compacted)", source.title) };
            let mut child = threads::create(
                conn,
                principal,
                NewThread { title, model: source.model.clone(), metadata: source.metadata.clone() },
            )
            .await?;
            child.parent_thread_id = Some(source.id);
            threads::set_parent(conn, child.id, source.id).await?;
            let run = runs::insert(
                conn,
                NewRun {
                    thread_id: child.id,
                    principal_id: principal,
                    model,
                    max_steps: 1,
                    command_id: None,
                    status: status::QUEUED,
                    input: None,
                    kind: runs::kind::COMPACTION,
                    source_thread_id: Some(source.id),
                },
            )
            .await?;
            Ok(json!({"thread": views::thread_json(&child), "run": run.to_json()}))
        })
        .await?;
    Ok(HttpResponse::Created().json(body))
}
