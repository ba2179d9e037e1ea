//! `DELETE /api/session` — sign out.

use actix_web::{HttpRequest, HttpResponse, web};
use agentloop_shared::auth;

use crate::AppState;
use crate::error::ApiError;

/// Deletes the cookie's session (if any; idempotent) and answers 204 with a cookie that expires
/// at once. Open live-update connections of that session end within seconds.
#[utoipa::path(
    delete, path = "/api/session", tag = "session", operation_id = "delete_session",
    responses(
        (status = 204, description = "Signed out; the cookie is expired",
         headers(("Set-Cookie" = String, description = "agentloop_session=; Max-Age=0"))),
        (status = 503, description = "Database unavailable", body = crate::views::ErrorBody),
    ),
    security(())
)]
pub async fn delete_session(state: web::Data<AppState>, req: HttpRequest) -> Result<HttpResponse, ApiError> {
    if let Some(token) = crate::extract::session_token(&req).filter(|t| t.len() <= 256) {
        let mut conn = state.pool.get().await?;
        auth::delete_session(&mut conn, &token).await?;
    }
    Ok(HttpResponse::NoContent().insert_header(("Set-Cookie", super::cookie(&req, "", Some(0)))).finish())
}
