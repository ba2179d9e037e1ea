//! Request extractors: the authenticated principal (SPEC §11).

use std::future::Future;
use std::pin::Pin;

use actix_web::{FromRequest, HttpRequest, dev::Payload, web};
use agentloop_shared::auth::{self, Principal};

use crate::AppState;
use crate::error::ApiError;

/// The caller, resolved from `Authorization: Bearer <key>`, or — only when the development flag
/// `DEV_LOOPBACK_PRINCIPAL` is on and the peer address is loopback — the `local` principal.
/// Client-supplied actor fields are never consulted.
pub struct Authenticated(pub Principal);

impl FromRequest for Authenticated {
    type Error = ApiError;
    type Future = Pin<Box<dyn Future<Output = Result<Self, ApiError>>>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let state = req.app_data::<web::Data<AppState>>().cloned();
        // A present Authorization header must be a well-formed bearer key: only its absence
        // may fall back to the loopback principal.
        let header = req.headers().get(actix_web::http::header::AUTHORIZATION);
        let bearer = header.map(|h| {
            h.to_str()
                .ok()
                .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
                .map(|k| k.trim().to_owned())
                .unwrap_or_default()
        });
        let loopback = req.peer_addr().is_some_and(|a| a.ip().is_loopback());
        Box::pin(async move {
            let state = state.ok_or_else(|| ApiError::Internal(anyhow::anyhow!("missing app state")))?;
            match bearer {
                Some(key) if key.is_empty() => Err(ApiError::Unauthorized),
                Some(key) => {
                    let mut conn = state.pool.get().await?;
                    auth::principal_for_key(&mut conn, &key).await?.map(Authenticated).ok_or(ApiError::Unauthorized)
                }
                None => match (&state.loopback_principal, loopback) {
                    (Some(principal), true) => Ok(Authenticated(principal.clone())),
                    _ => Err(ApiError::Unauthorized),
                },
            }
        })
    }
}
