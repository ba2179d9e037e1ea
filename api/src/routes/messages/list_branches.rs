//! `GET /api/threads/{id}/messages/{sequence}/branches`.

use actix_web::{HttpResponse, web};
use agentloop_shared::threads;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// One alternative continuation after a fork (an edit or a regenerate made it).
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Branch {
    /// Sequence of its first message (what `activate` takes).
    pub first_sequence: i64,
    /// Whether it is the one the thread shows now.
    pub active: bool,
    /// Messages in it.
    pub messages: i64,
    /// The first 120 characters of its first message.
    pub preview: Option<String>,
    #[schema(value_type = Option<String>, format = DateTime)]
    pub created_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// The alternatives of the fork at a message: `index` (1-based) of the shown one among `count`.
#[derive(Debug, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BranchList {
    /// The message after which the alternatives differ (0: the start of the thread).
    pub parent_sequence: i64,
    pub index: i64,
    pub count: i64,
    #[schema(value_type = Vec<Branch>)]
    pub branches: Vec<serde_json::Value>,
}

/// The alternatives (branches) of the fork whose shown alternative starts at active message
/// `sequence` — made by editing or regenerating, in the order they were made. 200
/// [`BranchList`]; 404 when the message is not active or starts no alternative.
#[utoipa::path(
    get, path = "/api/threads/{id}/messages/{sequence}/branches", tag = "messages", operation_id = "list_branches",
    params(("id" = Uuid, Path, description = "Thread id"), ("sequence" = i64, Path, description = "Message sequence")),
    responses((status = 200, description = "The alternatives (branches) of the fork whose shown alternative starts at this message", body = BranchList),
              (status = 404, description = "No such thread or message", body = crate::views::ErrorBody))
)]
pub async fn list_branches(state: web::Data<AppState>, who: Authenticated, path: web::Path<(Uuid, i64)>) -> Result<HttpResponse, ApiError> {
    let (thread_id, sequence) = path.into_inner();
    let mut conn = state.pool.get().await?;
    let thread = threads::get_owned(&mut conn, thread_id, who.0.id).await?.ok_or(ApiError::NotFound)?;
    let list = crate::reads::branches_of(&mut conn, thread.id, sequence).await?.ok_or(ApiError::NotFound)?;
    Ok(HttpResponse::Ok().json(list))
}
