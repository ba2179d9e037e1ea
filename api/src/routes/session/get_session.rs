//! `GET /api/session` — who is signed in, and how.

use actix_web::{HttpRequest, HttpResponse, web};

use crate::AppState;
use crate::error::ApiError;
use crate::views::SessionInfo;

/// 200 `{principal: {id, name}, via}` — `via` is `session` (the cookie), `bearer` (an
/// `Authorization` header) or `loopback` (`DEV_LOOPBACK_PRINCIPAL`); 401 `unauthenticated`
/// without credentials (401 `unauthorized` for an invalid key or session).
#[utoipa::path(
    get, path = "/api/session", tag = "session", operation_id = "get_session",
    responses(
        (status = 200, description = "The signed-in principal", body = SessionInfo),
        (status = 401, description = "`unauthenticated` / `unauthorized`", body = crate::views::ErrorBody),
        (status = 429, description = "Too many requests", body = crate::views::ErrorBody),
        (status = 503, description = "Database unavailable", body = crate::views::ErrorBody),
    ),
    security((), ("bearer" = []), ("session" = []))
)]
pub async fn get_session(state: web::Data<AppState>, req: HttpRequest) -> Result<HttpResponse, ApiError> {
    match crate::extract::authenticate(&state, &req).await? {
        Some(who) => Ok(HttpResponse::Ok().json(SessionInfo { principal: who.0.into(), via: who.2.into() })),
        None => Err(ApiError::Unauthenticated { code: "unauthenticated", message: "not signed in".into() }),
    }
}
