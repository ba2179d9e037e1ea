//! `GET /api/search?q=&limit=`.

use actix_web::{HttpResponse, web};
use serde_json::json;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Query: `q` (free text, at most 200 characters), `limit` 1..100 per kind (20).
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SearchQuery {
    /// Free text (at most 200 characters).
    pub q: String,
    /// Hits per kind, 1..100 (20).
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<i64>,
}

/// A thread whose title matches.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TitleHit {
    pub id: uuid::Uuid,
    pub title: String,
    #[schema(value_type = String, format = DateTime)]
    pub updated_at: chrono::DateTime<chrono::Utc>,
}

/// A message whose text matches; `snippet` marks matched words with U+0002 … U+0003.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MessageHit {
    pub thread_id: uuid::Uuid,
    pub title: String,
    pub sequence: i64,
    pub role: String,
    pub snippet: String,
    #[schema(value_type = String, format = DateTime)]
    pub created_at: chrono::DateTime<chrono::Utc>,
}

/// Search results, newest first.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct SearchResults {
    #[schema(value_type = Vec<TitleHit>)]
    pub threads: Vec<serde_json::Value>,
    #[schema(value_type = Vec<MessageHit>)]
    pub messages: Vec<serde_json::Value>,
}

/// Searches the caller's threads: titles, and the text of active user and assistant messages
/// through PostgreSQL full-text indexes (`to_tsvector('simple', ...)`: no stemming, any
/// language; every word must match, the last one as a prefix). 200 [`SearchResults`]; 400
/// `invalid_query` (empty or longer than 200 characters).
#[utoipa::path(
    get, path = "/api/search", tag = "threads", operation_id = "search_threads", params(SearchQuery),
    responses((status = 200, description = "Matching titles and messages, newest first", body = SearchResults),
              (status = 400, description = "`invalid_query`", body = crate::views::ErrorBody))
)]
pub async fn search_threads(state: web::Data<AppState>, who: Authenticated, query: web::Query<SearchQuery>) -> Result<HttpResponse, ApiError> {
    if query.q.chars().count() > 200 {
        return Err(ApiError::bad_request("invalid_query", "q is limited to 200 characters"));
    }
    let Some(tsquery) = crate::reads::tsquery(&query.q) else {
        if query.q.trim().is_empty() {
            return Err(ApiError::bad_request("invalid_query", "q must contain a word"));
        }
        return Ok(HttpResponse::Ok().json(json!({"threads": [], "messages": []})));
    };
    let limit = crate::extract::query_range("limit", query.limit, 20, 1..=100)?;
    let _turn = state.limits.heavy_read(who.0.id).await?;
    let mut conn = state.pool.get().await?;
    let found = crate::reads::search(&mut conn, who.0.id, &tsquery, limit).await?;
    Ok(HttpResponse::Ok().json(found))
}
