//! Request extractors: the authenticated principal (SPEC §11, CONTRACTS.md "Browser sign-in
//! session", issue 10 points 4 and 7).
//!
//! Credentials, in this order:
//! 1. `Authorization: Bearer <key>` — a present header must hold a live key (never falls back);
//! 2. the `agentloop_session` cookie — a live session of a live key; a request it authenticates
//!    that is not GET/HEAD must carry `X-Requested-With: agentloop` (CSRF guard; a cross-site
//!    form cannot set that header), else 403 `csrf_header_missing`;
//! 3. only with `DEV_LOOPBACK_PRINCIPAL=true`: a request from a loopback peer whose `Host` is a
//!    loopback name (`localhost`, `127.0.0.1`, `[::1]`, any port) acts as `local` — a page of
//!    another site resolving its name to 127.0.0.1 (DNS rebinding) sends its own Host and is
//!    refused, and a browser's request (`Origin` or `Sec-Fetch-Site` present) is held to the
//!    CSRF rule of 2.
//!
//! A source address with too many failed authentications is refused (429) before its
//! credentials are looked at; an authenticated principal then spends one request of its rate
//! budget (429 `rate_limited`). The principal's id goes to the access log.

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;

use actix_web::{FromRequest, HttpMessage, HttpRequest, dev::Payload, web};
use agentloop_shared::auth::{self, Principal};

use crate::AppState;
use crate::error::ApiError;
use crate::limits::Credential;

/// Name of the session cookie.
pub const SESSION_COOKIE: &str = "agentloop_session";
/// The header a cookie-authenticated unsafe request must carry, and its value.
pub const CSRF_HEADER: (&str, &str) = ("X-Requested-With", "agentloop");

/// How a request was authenticated (`GET /api/session`'s `via`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Bearer,
    Session,
    Loopback,
}

impl Via {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Bearer => "bearer",
            Self::Session => "session",
            Self::Loopback => "loopback",
        }
    }
}

/// The caller and how it was authenticated. `.0` is the principal; `.1` the credential (a key
/// or session id; `None` for the loopback principal), which live-update connections register so
/// that a revocation ends them.
#[derive(Debug, Clone)]
pub struct Authenticated(pub Principal, pub Option<Credential>, pub Via);

/// The principal id of a request, for the access log (set by [`Authenticated`]).
#[derive(Debug, Clone, Copy)]
pub struct AccessPrincipal(pub uuid::Uuid);

/// An integer query parameter `name` with its `default` when absent, or 400 `invalid_query`
/// naming it and its `range` when outside it. One rule for every bounded parameter (page sizes,
/// byte budgets): a value outside its range is refused, never silently clamped (acceptance
/// probe: `limit=-1` answered one item where the webhook deliveries refused `limit=0`).
pub fn query_range(name: &str, value: Option<i64>, default: i64, range: std::ops::RangeInclusive<i64>) -> Result<i64, ApiError> {
    match value {
        None => Ok(default),
        Some(v) if range.contains(&v) => Ok(v),
        Some(v) => Err(ApiError::bad_request("invalid_query", format!("{name} must be within {}..={}, not {v}", range.start(), range.end()))),
    }
}

/// The client's address: the TCP peer, or — behind `TRUSTED_PROXY_HOPS` proxies — the address
/// the outermost trusted proxy saw (that many entries from the right of `X-Forwarded-For`).
pub fn client_ip(req: &HttpRequest, trusted_hops: usize) -> Option<IpAddr> {
    let peer = req.peer_addr().map(|a| a.ip());
    if trusted_hops == 0 {
        return peer;
    }
    let forwarded: Vec<&str> = req
        .headers()
        .get_all("X-Forwarded-For")
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    match forwarded.len().checked_sub(trusted_hops) {
        Some(i) => forwarded[i].parse().ok().or(peer),
        None => forwarded.first().and_then(|s| s.parse().ok()).or(peer),
    }
}

/// Whether the `Host` header names the loopback interface (`localhost`, `*.localhost`,
/// `127.0.0.0/8`, `[::1]`, with any port).
pub fn loopback_host(req: &HttpRequest) -> bool {
    let Some(host) = req.headers().get(actix_web::http::header::HOST).and_then(|h| h.to_str().ok()) else {
        return false;
    };
    let host = host.trim().to_ascii_lowercase();
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or_default().to_owned()
    } else {
        host.rsplit_once(':').filter(|(_, port)| port.chars().all(|c| c.is_ascii_digit())).map_or(host.as_str(), |(h, _)| h).to_owned()
    };
    name == "localhost" || name.ends_with(".localhost") || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The bearer key of a present `Authorization` header (`Some("")` when malformed).
fn bearer(req: &HttpRequest) -> Option<String> {
    req.headers().get(actix_web::http::header::AUTHORIZATION).map(|h| {
        h.to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(|k| k.trim().to_owned())
            .unwrap_or_default()
    })
}

/// The session cookie's token, if the request carries one.
pub fn session_token(req: &HttpRequest) -> Option<String> {
    req.cookie(SESSION_COOKIE).map(|c| c.value().to_owned()).filter(|v| !v.is_empty())
}

/// The answer to a failed authentication from `ip`: 401 `invalid_api_key`, or 429
/// `too_many_failed_auth` once the address has used up its failed-authentication budget
/// (`AUTH_FAILURES_PER_MINUTE`). Only failures are refused: a request whose credential is valid
/// is served whatever its address did, so clients sharing an address — behind a NAT, or every
/// client behind a proxy when `TRUSTED_PROXY_HOPS` is not set — cannot be locked out by a
/// stranger sending bad keys (acceptance probe: 22 bad requests through the bundled HAProxy
/// refused every user's valid key).
pub fn auth_failure(state: &AppState, ip: Option<IpAddr>) -> ApiError {
    if let Some(ip) = ip {
        if let Err(blocked) = state.limits.check_address(ip) {
            return blocked;
        }
        state.limits.record_failure(ip);
    }
    ApiError::Unauthorized
}

/// Resolves the caller of `req` (see the module docs). `None` when the request carries no
/// credential at all and is not a loopback development request.
///
/// Once per request: the edge authenticates a request with a body before weighing it
/// ([`crate::budget`]), and the result is kept in the request's extensions for the route
/// (the per-principal rate limit counts the request once).
pub async fn authenticate(state: &AppState, req: &HttpRequest) -> Result<Option<Authenticated>, ApiError> {
    if let Some(done) = req.extensions().get::<Authenticated>() {
        return Ok(Some(done.clone()));
    }
    let ip = client_ip(req, state.trusted_proxy_hops);
    let failed = |state: &AppState| auth_failure(state, ip);
    let who = if let Some(key) = bearer(req) {
        if key.is_empty() || key.len() > 256 {
            return Err(failed(state));
        }
        let mut conn = state.pool.get().await?;
        let Some(found) = auth::authenticate_key(&mut conn, &key).await? else {
            return Err(failed(state));
        };
        if found.stale {
            // Best effort: a database that refuses writes (read-only after a failover, a full
            // disk) must not turn every authenticated read into an error.
            if let Err(error) = auth::touch_key(&mut conn, found.key_id).await {
                tracing::warn!(%error, "could not record the key's last use; serving the request");
            }
        }
        Authenticated(found.principal, Some(Credential::Key(found.key_id)), Via::Bearer)
    } else if let Some(token) = session_token(req) {
        if token.len() > 256 {
            return Err(failed(state));
        }
        let mut conn = state.pool.get().await?;
        let Some(found) = auth::authenticate_session(&mut conn, &token).await? else {
            return Err(failed(state));
        };
        csrf_guard(req)?;
        Authenticated(found.principal, Some(Credential::Session(found.session_id)), Via::Session)
    } else {
        let peer_loopback = req.peer_addr().is_some_and(|a| a.ip().is_loopback());
        match &state.loopback_principal {
            Some(principal) if peer_loopback && loopback_host(req) => {
                // A page of any site can reach 127.0.0.1 too: a `fetch` with `mode: "no-cors"`
                // needs no preflight, so a body-less POST (cancel, approve) acted as `local`
                // (acceptance probe). A browser's request is held to the cookie rule.
                if from_browser(req) {
                    csrf_guard(req)?;
                }
                Authenticated(principal.clone(), None, Via::Loopback)
            }
            _ => return Ok(None),
        }
    };
    req.extensions_mut().insert(AccessPrincipal(who.0.id));
    state.limits.check_request(who.0.id)?;
    req.extensions_mut().insert(who.clone());
    Ok(Some(who))
}

impl FromRequest for Authenticated {
    type Error = ApiError;
    type Future = Pin<Box<dyn Future<Output = Result<Self, ApiError>>>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let req = req.clone();
        Box::pin(async move {
            let state = req.app_data::<web::Data<AppState>>().cloned().ok_or_else(|| ApiError::Internal(anyhow::anyhow!("missing app state")))?;
            authenticate(&state, &req).await?.ok_or(ApiError::Unauthorized)
        })
    }
}

/// A JSON object request body as `T` — [`web::Json`] (its `JsonConfig`: size limit,
/// content type, error envelope), but only an object: serde builds a struct from a JSON array
/// too (positional fields), which no client means, so an array, string, number or null body is
/// 400 `invalid_json`. Field errors as [`crate::error::json_error`] maps them (`missing_field`,
/// `invalid_field`).
pub struct Json<T>(pub T);

impl<T> Json<T> {
    /// The body.
    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<T> std::ops::Deref for Json<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: serde::de::DeserializeOwned + 'static> FromRequest for Json<T> {
    type Error = actix_web::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self, actix_web::Error>>>>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let body = web::Json::<serde_json::Value>::from_request(req, payload);
        let req = req.clone();
        Box::pin(async move {
            let value = body.await?.into_inner();
            if !value.is_object() {
                return Err(ApiError::bad_request("invalid_json", "the request body must be a JSON object").into());
            }
            serde_json::from_value(value)
                .map(Json)
                .map_err(|e| crate::error::json_error(actix_web::error::JsonPayloadError::Deserialize(e), &req))
        })
    }
}

/// An optional JSON object body: `None` when the request has no body (no `Content-Length`,
/// or 0, and no `Transfer-Encoding`); otherwise exactly [`Json`] — a malformed body is a 400,
/// never silently read as absent (actix's `Option<Json<T>>` turns every error into `None`).
pub struct OptionalJson<T>(pub Option<T>);

impl<T: serde::de::DeserializeOwned + 'static> FromRequest for OptionalJson<T> {
    type Error = actix_web::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self, actix_web::Error>>>>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        use actix_web::http::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
        let headers = req.headers();
        let length = headers.get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).map(str::trim);
        if matches!(length, None | Some("0")) && !headers.contains_key(TRANSFER_ENCODING) {
            return Box::pin(async { Ok(OptionalJson(None)) });
        }
        let body = Json::<T>::from_request(req, payload);
        Box::pin(async move { Ok(OptionalJson(Some(body.await?.into_inner()))) })
    }
}

/// The `Idempotency-Key` header: `None` when absent. A key that is present but unusable —
/// not UTF-8, empty or only whitespace, over 200 characters — is refused with 400
/// `invalid_idempotency_key`, never silently dropped: a client that believes it sent a key
/// would otherwise post its turn twice on a retry.
pub fn idempotency_key(req: &HttpRequest) -> Result<Option<String>, ApiError> {
    let Some(value) = req.headers().get("Idempotency-Key") else { return Ok(None) };
    let key = String::from_utf8(value.as_bytes().to_vec())
        .map_err(|_| ApiError::bad_request("invalid_idempotency_key", "the Idempotency-Key header is not valid UTF-8"))?;
    check_idempotency_key(&key)?;
    Ok(Some(key))
}

/// The rule for any idempotency key (header or `commandId`): 1 to 200 characters, not only
/// whitespace; 400 `invalid_idempotency_key` otherwise.
pub fn check_idempotency_key(key: &str) -> Result<(), ApiError> {
    if key.trim().is_empty() {
        return Err(ApiError::bad_request("invalid_idempotency_key", "an idempotency key must not be empty; omit it to send without one"));
    }
    if key.chars().count() > 200 {
        return Err(ApiError::bad_request("invalid_idempotency_key", "idempotency keys are limited to 200 characters"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use actix_web::test::TestRequest;

    use super::*;

    #[test]
    fn only_loopback_host_names_count_as_loopback() {
        for host in ["localhost", "localhost:8080", "127.0.0.1:8080", "127.1.2.3", "[::1]:8080", "[::1]", "app.localhost:3000", "LOCALHOST"] {
            assert!(loopback_host(&TestRequest::default().insert_header(("Host", host)).to_http_request()), "{host}");
        }
        for host in ["evil.example", "evil.example:8080", "127.0.0.1.evil.example", "localhost.evil.example", "10.0.0.1", "[::2]:80", ""] {
            assert!(!loopback_host(&TestRequest::default().insert_header(("Host", host)).to_http_request()), "{host}");
        }
    }

    #[test]
    fn forwarded_addresses_are_taken_from_the_trusted_hops_only() {
        let req = TestRequest::default()
            .peer_addr("10.0.0.2:1234".parse().unwrap())
            .insert_header(("X-Forwarded-For", "6.6.6.6, 1.2.3.4"))
            .to_http_request();
        assert_eq!(client_ip(&req, 0), Some("10.0.0.2".parse().unwrap()), "not trusted: the peer");
        assert_eq!(client_ip(&req, 1), Some("1.2.3.4".parse().unwrap()), "the address our proxy saw, not the spoofable left one");
        assert_eq!(client_ip(&req, 2), Some("6.6.6.6".parse().unwrap()));
    }
}

/// Whether `req` comes from a web page: browsers send `Origin` on every request that is not
/// GET/HEAD (cross-site `no-cors` ones included) and `Sec-Fetch-Site` on every request; curl
/// and SDKs send neither.
fn from_browser(req: &HttpRequest) -> bool {
    req.headers().contains_key("Origin") || req.headers().contains_key("Sec-Fetch-Site")
}

/// The CSRF rule of requests a browser authenticates without a header the page must set (the
/// session cookie; the development loopback principal): one that is not GET/HEAD must carry
/// [`CSRF_HEADER`] (a cross-site page cannot set it without a CORS preflight this server never
/// grants), else 403 `csrf_header_missing`. Applied by [`authenticate`] and by sign-out, which
/// reads the cookie itself.
pub fn csrf_guard(req: &HttpRequest) -> Result<(), ApiError> {
    let safe = matches!(*req.method(), actix_web::http::Method::GET | actix_web::http::Method::HEAD);
    let marked = req.headers().get(CSRF_HEADER.0).and_then(|v| v.to_str().ok()).is_some_and(|v| v.eq_ignore_ascii_case(CSRF_HEADER.1));
    if safe || marked {
        return Ok(());
    }
    Err(ApiError::Forbidden {
        code: "csrf_header_missing",
        message: format!("a browser request authenticated by the session cookie or the loopback principal must carry {}: {}", CSRF_HEADER.0, CSRF_HEADER.1),
    })
}

/// A keyset cursor `<µs since the epoch>_<uuid>`: the position of the last item of a page
/// ordered by a timestamp, then id, as `nextCursor` of the threads list and of a webhook's
/// deliveries gives it. Errors: 400 `invalid_cursor` when malformed, or when its time is outside
/// years 1..=9999 (what PostgreSQL's `timestamptz` holds; beyond it was a 500).
pub(crate) fn keyset_cursor(cursor: &str) -> Result<(chrono::DateTime<chrono::Utc>, uuid::Uuid), ApiError> {
    let parse = || {
        let (at, id) = cursor.split_once('_')?;
        let micros: i64 = at.parse().ok()?;
        let at = chrono::DateTime::from_timestamp_micros(micros).filter(agentloop_shared::text::storable_time)?;
        Some((at, uuid::Uuid::parse_str(id).ok()?))
    };
    parse().ok_or_else(|| ApiError::bad_request("invalid_cursor", "cursor is malformed"))
}
