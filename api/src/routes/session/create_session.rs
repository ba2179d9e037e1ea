//! `POST /api/session` `{key}` — sign in with an API key.

use actix_web::{HttpRequest, HttpResponse, web};
use agentloop_shared::auth;

use crate::AppState;
use crate::error::ApiError;
use crate::views::{SessionCreated, SignIn};

/// Creates a server-side session bound to the key (only its token's SHA-256 is stored) and sets
/// the `agentloop_session` cookie. 200 `{principal: {id, name}}`; 401 `invalid_api_key` for an
/// unknown, revoked or expired key (counted against the address's failed-authentication budget:
/// 429 `too_many_failed_auth` beyond it). The session ends when the key is revoked or expires,
/// at `SESSION_TTL_MS`, or at sign-out.
#[utoipa::path(
    post, path = "/api/session", tag = "session", operation_id = "create_session",
    request_body = SignIn,
    responses(
        (status = 200, description = "Signed in; the session cookie is set", body = SessionCreated,
         headers(("Set-Cookie" = String, description = "agentloop_session=<token>; HttpOnly; SameSite=Strict; Path=/"))),
        (status = 400, description = "Invalid body", body = crate::views::ErrorBody),
        (status = 401, description = "`invalid_api_key`", body = crate::views::ErrorBody),
        (status = 413, description = "Body too large", body = crate::views::ErrorBody),
        (status = 415, description = "Not JSON", body = crate::views::ErrorBody),
        (status = 429, description = "Too many failed authentications or requests", body = crate::views::ErrorBody),
        (status = 503, description = "Database unavailable", body = crate::views::ErrorBody),
    )
)]
pub async fn create_session(state: web::Data<AppState>, req: HttpRequest, body: crate::extract::Json<SignIn>) -> Result<HttpResponse, ApiError> {
    let ip = crate::extract::client_ip(&req, state.trusted_proxy_hops);
    let key = body.into_inner().key;
    // 401, or 429 once the address used up its budget: only failures are refused
    // (`extract::auth_failure`).
    let invalid = || match crate::extract::auth_failure(&state, ip) {
        ApiError::Unauthorized => ApiError::Unauthenticated { code: "invalid_api_key", message: "the API key is unknown, revoked or expired".into() },
        refused => refused,
    };
    if key.trim().is_empty() || key.len() > 256 {
        return Err(invalid());
    }
    let mut conn = state.pool.get().await?;
    let Some(found) = auth::authenticate_key(&mut conn, key.trim()).await? else {
        return Err(invalid());
    };
    state.limits.check_request(found.principal.id)?;
    if found.stale {
        auth::touch_key(&mut conn, found.key_id).await?;
    }
    let token = auth::create_session(&mut conn, found.key_id, state.session_ttl).await?;
    use actix_web::HttpMessage as _;
    req.extensions_mut().insert(crate::extract::AccessPrincipal(found.principal.id));
    Ok(HttpResponse::Ok()
        .insert_header(("Set-Cookie", super::cookie(&req, &token, None)))
        .json(SessionCreated { principal: found.principal.into() }))
}
