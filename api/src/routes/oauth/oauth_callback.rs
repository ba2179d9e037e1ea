//! `GET /api/oauth/callback`.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, web};
use agentloop_shared::mcp_auth;
use serde::Deserialize;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// The redirect of an authorization server.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct CallbackQuery {
    /// The authorization code.
    pub code: Option<String>,
    /// The `state` of the sign-in URL (single use, bound to the principal and the authorization).
    pub state: Option<String>,
    /// An OAuth error instead of a code (e.g. `access_denied`).
    pub error: Option<String>,
}

/// The OAuth redirect target of MCP sign-ins (the `OAUTH_REDIRECT_URL` the workers put in
/// sign-in URLs). Requires the caller's session cookie or key: the `state` must be a pending
/// sign-in of THIS principal (another principal's state is 404 `not_found`, like any other
/// principal's resource, and stays usable by its owner); a state is used once (409 `authorization_used`) and only before
/// it expires (410 `authorization_expired`). The code is redeemed with the PKCE verifier at the
/// authorization server's token endpoint; the token is stored encrypted for this principal and
/// this MCP server only, the authorization is `completed` and the waiting run requeued — it
/// retries the call with the token. A refused exchange (or an `error` redirect) marks the
/// authorization `failed` (502 `token_exchange_failed`; 400 `authorization_denied`) and requeues
/// the run too: its retry asks for a new sign-in. Without `OAUTH_TOKENS_KEY` no sign-in can be
/// pending, so every state is 404 `not_found` (a client's input never makes a 5xx).
#[utoipa::path(
    get, path = "/api/oauth/callback", tag = "runs", operation_id = "oauth_callback",
    params(CallbackQuery),
    responses((status = 200, description = "Signed in: the completed authorization and the requeued run", body = crate::views::SignedIn),
              (status = 400, description = "`code`/`state` missing, or the user refused", body = crate::views::ErrorBody),
              (status = 404, description = "No pending sign-in of the caller has this state", body = crate::views::ErrorBody),
              (status = 409, description = "The state was used already", body = crate::views::ErrorBody),
              (status = 410, description = "The sign-in link expired", body = crate::views::ErrorBody),
              (status = 502, description = "The token endpoint refused the code", body = crate::views::ErrorBody))
)]
pub async fn oauth_callback(state: web::Data<AppState>, who: Authenticated, query: web::Query<CallbackQuery>) -> Result<HttpResponse, ApiError> {
    let query = query.into_inner();
    let Some(signin_state) = query.state.as_deref().filter(|s| !s.is_empty() && s.len() <= 512) else {
        return Err(ApiError::bad_request("missing_field", "the callback needs `state`"));
    };
    if query.error.is_none() && query.code.as_deref().is_none_or(str::is_empty) {
        return Err(ApiError::bad_request("missing_field", "the callback needs `code` (or `error`)"));
    }
    let Some(key) = state.oauth.key.as_ref() else {
        return Err(ApiError::NotFound);
    };
    let taken = mcp_auth::take_state(&state.store, who.0.id, signin_state).await?;
    let outcome = match (&query.error, &query.code) {
        (Some(error), _) => Err((StatusCode::BAD_REQUEST, "authorization_denied", format!("the authorization server answered `{}`", bounded(error)))),
        (None, Some(code)) => mcp_auth::exchange(&state.oauth.client, &taken, code, key)
            .await
            .map_err(|e| (StatusCode::BAD_GATEWAY, "token_exchange_failed", e)),
        (None, None) => unreachable!("checked above"),
    };
    match outcome {
        Ok(token) => {
            let done = mcp_auth::finish(&state.store, &taken, Ok(&token), key).await?;
            tracing::info!(authorization.id = %taken.id, mcp.server = %taken.server, run.id = %taken.run_id, "MCP sign-in completed");
            Ok(HttpResponse::Ok().json(done))
        }
        Err((status, code, message)) => {
            tracing::warn!(authorization.id = %taken.id, mcp.server = %taken.server, %message, "MCP sign-in failed");
            mcp_auth::finish(&state.store, &taken, Err(&message), key).await?;
            Err(ApiError::Status { status, code, message })
        }
    }
}

fn bounded(text: &str) -> String {
    text.chars().take(100).filter(|c| !c.is_control()).collect()
}
