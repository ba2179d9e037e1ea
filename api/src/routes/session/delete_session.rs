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
    // A cookie request that is not GET/HEAD carries the CSRF header, sign-out included: a
    // cross-site form must not sign a user out (the rule of every other cookie request).
    let (name, value) = crate::extract::CSRF_HEADER;
    let marked = req.headers().get(name).and_then(|v| v.to_str().ok()).is_some_and(|v| v.eq_ignore_ascii_case(value));
    if crate::extract::session_token(&req).is_some() && !marked {
        return Err(ApiError::Forbidden {
            code: "csrf_header_missing",
            message: format!("a request authenticated by the session cookie must carry {name}: {value}"),
        });
    }
    if let Some(token) = crate::extract::session_token(&req).filter(|t| t.len() <= 256) {
        let mut conn = state.pool.get().await?;
        auth::delete_session(&mut conn, &token).await?;
    }
    Ok(HttpResponse::NoContent().insert_header(("Set-Cookie", super::cookie(&req, "", Some(0)))).finish())
}
