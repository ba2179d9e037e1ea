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
        (status = 403, description = "`csrf_header_missing`: a session cookie without `X-Requested-With: agentloop`", body = crate::views::ErrorBody),
        (status = 503, description = "Database unavailable", body = crate::views::ErrorBody),
    ),
    security(())
)]
pub async fn delete_session(state: web::Data<AppState>, req: HttpRequest) -> Result<HttpResponse, ApiError> {
    // Sign-out by cookie follows the CSRF rule of every cookie request (a cross-site form must
    // not end a session).
    if crate::extract::session_token(&req).is_some() {
        crate::extract::csrf_guard(&req)?;
    }
    if let Some(token) = crate::extract::session_token(&req).filter(|t| t.len() <= 256) {
        let mut conn = state.pool.get().await?;
        auth::delete_session(&mut conn, &token).await?;
    }
    Ok(HttpResponse::NoContent().insert_header(("Set-Cookie", super::cookie(&req, "", Some(0)))).finish())
}
