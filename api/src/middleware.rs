//! The api's edge: ONE middleware around every route (issue 10 points 5 and 7).
//!
//! In order, for every request:
//! 1. a request id — the client's `X-Request-Id` when it is 1..=64 characters of
//!    `[A-Za-z0-9._-]`, else a new UUID v7 — returned in `x-request-id` and logged;
//! 2. header bounds: more than [`MAX_HEADERS`] headers or [`MAX_HEADER_BYTES`] of them is 431
//!    (the HTTP parser itself answers a bare 431 only beyond 96 headers or 128 KiB);
//! 3. the query string: a NUL character (`%00`) is 400 `invalid_query`;
//! 4. the body of every request that has one (all methods but GET/HEAD/OPTIONS): a non-JSON
//!    `Content-Type` is 415 `unsupported_media_type`; the request is authenticated (a bad
//!    credential, or none, is refused before the body is read; the sign-in, which carries its
//!    key in its body, is held to the small anonymous budget, 16 KiB bodies and 4 in flight per
//!    source address); it waits for its share of the body budget
//!    (`MAX_BODY_BYTES_IN_FLIGHT`, [`crate::budget`]; at most `API_BODY_TIMEOUT_MS`, else 503
//!    `server_busy`; one principal's bodies hold at most half of it), which it holds
//!    until its route has answered; it is read within
//!    `API_BODY_TIMEOUT_MS` (else 408 `body_timeout`) and `API_MAX_BODY_BYTES` (`IMPORT_MAX_BYTES`
//!    for `POST /api/threads/import`; else 413 `payload_too_large`), parsed
//!    (400 `invalid_json`; a number beyond f64, or one it would round, is 400 `invalid_number`), and every NUL in a
//!    string or member name replaced by U+FFFD (PostgreSQL text cannot store NUL; the same rule
//!    as `agentloop_shared::text`) — so every route sees only clean JSON;
//! 5. after the route: every error response without a JSON body (actix's own 404/405/413/...)
//!    becomes the `{"error":{"code","message"}}` envelope with a stable code, keeping its
//!    headers (`Allow`, `Retry-After`, `WWW-Authenticate`);
//! 6. security headers: `Cache-Control: no-store` (unless the route set one), `X-Content-Type-
//!    Options: nosniff`, `Referrer-Policy: no-referrer`, `X-Frame-Options: DENY`, and a CSP —
//!    for HTML pages only the app's own scripts (plus the exact inline scripts of the page, by
//!    SHA-256), its own styles (inline styles allowed: Markdown and code highlighting set them),
//!    images from itself and `data:`/`blob:`, connections to itself, no frames, no plugins; for
//!    everything else `default-src 'none'; frame-ancestors 'none'`;
//! 7. one access-log line (target `agentloop::access`): method, route template, status,
//!    duration_ms (to the response head; a stream's lifetime is not included), principal id,
//!    request id, client address — never bodies, keys or cookies.
//!
//! The route runs inside the `request` span (OpenTelemetry name `METHOD /route/template`, kind
//! server), whose parent is the caller's W3C `traceparent` header when it is valid; runs the
//! request creates store its trace context (`agentloop_shared::telemetry::traceparent`).

use std::time::{Duration, Instant};

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderName, HeaderValue};
use actix_web::http::{Method, StatusCode};
use actix_web::middleware::Next;
use actix_web::{HttpMessage, HttpResponse, web};
use base64::Engine;
use futures_util::StreamExt;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::AppState;
use crate::error::{ApiError, envelope};
use crate::extract::AccessPrincipal;

/// Most request headers accepted (the parser's own hard bound is 96).
pub const MAX_HEADERS: usize = 64;
/// Most bytes of request headers (names and values) accepted.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;

/// The request id of a request (also in the `x-request-id` response header).
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

fn request_id(req: &ServiceRequest) -> String {
    req.headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| (1..=64).contains(&v.len()) && v.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')))
        .map_or_else(|| uuid::Uuid::now_v7().to_string(), str::to_owned)
}

/// Whether a `Content-Type` is JSON (`application/json`, `application/*+json`).
fn is_json(content_type: Option<&HeaderValue>) -> bool {
    let Some(value) = content_type.and_then(|v| v.to_str().ok()) else { return false };
    let essence = value.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    essence == "application/json" || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Whether `value` holds a NUL in any string or member name.
fn has_nul(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(has_nul),
        Value::Object(members) => members.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        _ => false,
    }
}

/// Checks a JSON body (see the module docs, step 4); returns the cleaned body when it held NUL.
pub fn check_json_body(bytes: &[u8]) -> Result<Option<Vec<u8>>, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let refusal = |e: serde_json::Error| {
        let message = e.to_string();
        if message.contains("number out of range") {
            ApiError::bad_request("invalid_number", format!("a number is outside the range of a 64-bit float: {message}"))
        } else {
            ApiError::bad_request("invalid_json", format!("invalid request body: {message}"))
        }
    };
    // Syntax and number ranges without building a tree (bodies may be a MiB).
    serde_json::from_slice::<Checked>(bytes).map_err(refusal)?;
    // A number serde_json would round (more digits than i64/u64/f64 hold): a tool's edited
    // arguments, a setting or metadata would be stored as a value the client never sent.
    if let Some(number) = std::str::from_utf8(bytes).ok().and_then(agentloop_shared::text::inexact_number) {
        let shown: String = number.chars().take(80).collect();
        return Err(ApiError::bad_request(
            "invalid_number",
            format!("the number {shown} has more digits than a 64-bit integer or float holds exactly; send it as a string"),
        ));
    }
    // A NUL can only be written `\u0000` in JSON text; only then is the body rebuilt.
    if !bytes.windows(6).any(|w| w[0] == b'\\' && w[1] == b'u' && w[2..].iter().all(|&b| b == b'0')) {
        return Ok(None);
    }
    let value: Value = serde_json::from_slice(bytes).map_err(refusal)?;
    if has_nul(&value) {
        let clean = agentloop_shared::text::clean_json(&value);
        return Ok(Some(serde_json::to_vec(&clean).unwrap_or_default()));
    }
    Ok(None)
}

/// A JSON value walked without being stored: numbers are parsed (so one beyond f64 fails),
/// strings are looked at in place.
struct Checked;

impl<'de> serde::Deserialize<'de> for Checked {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(CheckedVisitor)
    }
}

struct CheckedVisitor;

impl<'de> serde::de::Visitor<'de> for CheckedVisitor {
    type Value = Checked;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Checked, E> {
        Ok(Checked)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Checked, E> {
        Ok(Checked)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Checked, E> {
        Ok(Checked)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Checked, E> {
        Ok(Checked)
    }
    fn visit_str<E>(self, _: &str) -> Result<Checked, E> {
        Ok(Checked)
    }
    fn visit_unit<E>(self) -> Result<Checked, E> {
        Ok(Checked)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Checked, A::Error> {
        while seq.next_element::<Checked>()?.is_some() {}
        Ok(Checked)
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Checked, A::Error> {
        while map.next_key::<serde::de::IgnoredAny>()?.is_some() {
            map.next_value::<Checked>()?;
        }
        Ok(Checked)
    }
}

fn status_error(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::Status { status, code, message: message.into() }
}

/// Reads the whole body (`declared` bytes when the client said so) within `timeout` and `limit`
/// bytes.
async fn read_body(req: &mut ServiceRequest, declared: Option<usize>, limit: usize, timeout: Duration) -> Result<web::Bytes, ApiError> {
    let mut payload = req.take_payload();
    let read = async {
        // One allocation of the declared size (not a doubling series of them).
        let mut body = web::BytesMut::with_capacity(declared.unwrap_or(0).min(limit));
        while let Some(chunk) = payload.next().await {
            let chunk = chunk.map_err(|e| ApiError::bad_request("invalid_body", format!("the request body could not be read: {e}")))?;
            if body.len() + chunk.len() > limit {
                return Err(ApiError::PayloadTooLarge);
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body.freeze())
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(result) => result,
        Err(_) => Err(status_error(
            StatusCode::REQUEST_TIMEOUT,
            "body_timeout",
            format!("the request body did not arrive within {} ms", timeout.as_millis()),
        )),
    }
}

/// The body bounds of the edge (from `AppState`).
struct BodyBounds<'a> {
    /// `API_MAX_BODY_BYTES`.
    max_body: usize,
    /// `IMPORT_MAX_BYTES` (`POST /api/threads/import`).
    import_max: usize,
    timeout: Duration,
    budget: Option<&'a crate::budget::BodyBudget>,
    /// Authenticates the request before its body is weighed ([`crate::budget`]).
    state: Option<&'a AppState>,
}

/// Checks the request before routing; returns the error to answer with, if any, else the share
/// of the body budget the request holds until its route has answered.
async fn admit(req: &mut ServiceRequest, bounds: &BodyBounds<'_>) -> Result<Option<crate::budget::BodyPermit>, ApiError> {
    let header_bytes: usize = req.headers().iter().map(|(k, v)| k.as_str().len() + v.len()).sum();
    if req.headers().len() > MAX_HEADERS || header_bytes > MAX_HEADER_BYTES {
        return Err(status_error(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "header_fields_too_large",
            format!("at most {MAX_HEADERS} request headers and {MAX_HEADER_BYTES} bytes of them"),
        ));
    }
    let query = req.query_string();
    if query.contains('\0') || query.to_ascii_lowercase().contains("%00") {
        return Err(ApiError::bad_request("invalid_query", "the query string may not contain NUL (%00)"));
    }
    // The query extractor decodes invalid UTF-8 lossily (U+FFFD): `search?q=%FF%FE` searched for
    // replacement characters and answered 200 (acceptance probe).
    if percent_encoding::percent_decode_str(query).decode_utf8().is_err() {
        return Err(ApiError::bad_request("invalid_query", "the query string is not UTF-8 once percent-decoded"));
    }
    if matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return Ok(None);
    }
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    let chunked = req.headers().contains_key(header::TRANSFER_ENCODING);
    if declared.unwrap_or(0) == 0 && !chunked {
        return Ok(None);
    }
    if !is_json(req.headers().get(header::CONTENT_TYPE)) {
        return Err(status_error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "request bodies must be JSON (Content-Type: application/json)",
        ));
    }
    let limit = if req.method() == Method::POST && req.path() == "/api/threads/import" { bounds.import_max } else { bounds.max_body };
    let declared = match declared {
        Some(length) if length > limit as u64 => return Err(ApiError::PayloadTooLarge),
        // A chunked body (no length) is weighed at its limit: it may grow that large.
        other => other.map(|length| length as usize),
    };
    // Who sends it, before anything of it is weighed or read, so nobody without a key can hold
    // the budget the tenants' writes need (acceptance probe H; verification probe I). Every route
    // with a body but the sign-in needs a principal: a bad credential, or none, is refused now
    // (the route's extractor reuses this authentication, `extract::authenticate`). The sign-in
    // carries its key in its body and must work with a stale session cookie: it is anonymous,
    // whatever it carries, and held to the small anonymous budget (`budget::Owner::Anonymous`).
    let sign_in = req.method() == Method::POST && req.path() == "/api/session";
    let address = bounds.state.and_then(|s| crate::extract::client_ip(req.request(), s.trusted_proxy_hops));
    let owner = match bounds.state {
        Some(state) if !sign_in => match crate::extract::authenticate(state, req.request()).await? {
            Some(who) => crate::budget::Owner::Principal(who.0.id),
            None => return Err(ApiError::Unauthorized),
        },
        _ => crate::budget::Owner::Anonymous(address),
    };
    let (declared, limit) = if matches!(owner, crate::budget::Owner::Anonymous(_)) && bounds.state.is_some() {
        if declared.is_some_and(|d| d > crate::budget::ANONYMOUS_MAX_BODY) {
            return Err(ApiError::PayloadTooLarge);
        }
        (declared, limit.min(crate::budget::ANONYMOUS_MAX_BODY))
    } else {
        (declared, limit)
    };
    let permit = match bounds.budget {
        Some(budget) => Some(budget.acquire(declared.unwrap_or(limit), bounds.timeout, owner).await?),
        None => None,
    };
    let body = read_body(req, declared, limit, bounds.timeout).await?;
    let body = match check_json_body(&body)? {
        Some(cleaned) => {
            // The Content-Length the route may read must match the cleaned body.
            if let Ok(length) = HeaderValue::from_str(&cleaned.len().to_string()) {
                req.headers_mut().insert(header::CONTENT_LENGTH, length);
            }
            web::Bytes::from(cleaned)
        }
        None => body,
    };
    req.set_payload(actix_web::dev::Payload::from(body));
    Ok(permit)
}

/// The stable code of a status without an error of ours.
fn code_for(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "bad_request",
        401 => "unauthorized",
        403 => "forbidden",
        404 => "not_found",
        405 => "method_not_allowed",
        406 => "not_acceptable",
        408 => "request_timeout",
        411 => "length_required",
        413 => "payload_too_large",
        414 => "uri_too_long",
        415 => "unsupported_media_type",
        429 => "rate_limited",
        431 => "header_fields_too_large",
        503 => "unavailable",
        _ if status.is_server_error() => "internal",
        _ => "http_error",
    }
}

/// The Content-Security-Policy of an HTML page: its inline scripts allowed by their SHA-256.
pub fn page_csp(html: &[u8]) -> String {
    let text = String::from_utf8_lossy(html);
    let lower = text.to_ascii_lowercase();
    let mut hashes = String::new();
    let mut at = 0;
    while let Some(open) = lower[at..].find("<script") {
        let open = at + open;
        let Some(head_end) = lower[open..].find('>').map(|i| open + i + 1) else { break };
        let Some(close) = lower[head_end..].find("</script").map(|i| head_end + i) else { break };
        if !lower[open..head_end].contains(" src") {
            let digest = Sha256::digest(text[head_end..close].as_bytes());
            hashes.push_str(&format!(" 'sha256-{}'", base64::engine::general_purpose::STANDARD.encode(digest)));
        }
        at = close;
    }
    format!(
        "default-src 'self'; script-src 'self'{hashes}; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; \
         font-src 'self' data:; connect-src 'self'; media-src 'self' data: blob:; object-src 'none'; base-uri 'none'; \
         form-action 'self'; frame-ancestors 'none'"
    )
}

/// Non-page responses may load nothing and be framed by nobody.
const API_CSP: &str = "default-src 'none'; frame-ancestors 'none'";

fn set_default(headers: &mut header::HeaderMap, name: HeaderName, value: &str) {
    if !headers.contains_key(&name)
        && let Ok(value) = HeaderValue::from_str(value)
    {
        headers.insert(name, value);
    }
}

/// The edge middleware (see the module docs). Register with `actix_web::middleware::from_fn`.
pub async fn edge(mut req: ServiceRequest, next: Next<BoxBody>) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    let started = Instant::now();
    let id = request_id(&req);
    req.extensions_mut().insert(RequestId(id.clone()));
    let state = req.app_data::<web::Data<AppState>>().cloned();
    let bounds = state.as_ref().map_or(
        BodyBounds { max_body: 1024 * 1024, import_max: 1024 * 1024, timeout: Duration::from_secs(10), budget: None, state: None },
        |s| BodyBounds {
            max_body: s.max_body_bytes,
            import_max: s.import_max_bytes,
            timeout: s.body_timeout,
            budget: Some(&s.body_budget),
            state: Some(s.get_ref()),
        },
    );
    let hops = state.as_ref().map_or(0, |s| s.trusted_proxy_hops);
    let method = req.method().clone();
    let client = crate::extract::client_ip(req.request(), hops).map_or_else(|| "-".to_owned(), |ip| ip.to_string());
    // Trace context (README "Traces"): the caller's W3C `traceparent` is the request span's
    // parent; runs created by the request store the span's context for the worker.
    let incoming = req
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(agentloop_shared::telemetry::valid_traceparent)
        .map(str::to_owned);
    let span = tracing::info_span!(
        "request",
        request_id = %id,
        otel.name = tracing::field::Empty,
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.route = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    if agentloop_shared::telemetry::exporting() {
        // Named before the span is first entered (the OpenTelemetry span is built then); the
        // resource map resolves the route template before routing.
        let route = req.match_pattern().unwrap_or_else(|| "-".to_owned());
        span.record("otel.name", format!("{method} {route}"));
        span.record("http.route", route.as_str());
    }
    agentloop_shared::telemetry::set_remote_parent(&span, incoming.as_deref());
    let mut res = match admit(&mut req, &bounds).await {
        Err(error) => req.error_response(error),
        Ok(permit) => {
            use tracing::Instrument;
            let handled = next.call(req).instrument(span.clone());
            let res = match agentloop_shared::telemetry::with_incoming(incoming, handled).await {
                Ok(res) => res,
                // Routes answer errors as responses; an error escaping the service has no request
                // left to answer with, so actix renders it.
                Err(error) => return Err(error),
            };
            // The route has answered: its body, parsed JSON and step-function argument are gone
            // (the answer itself is written out after this; streams are not held).
            drop(permit);
            res
        }
    };
    let status = res.status();
    if status.as_u16() >= 400 && !is_json(res.headers().get(header::CONTENT_TYPE)) {
        let message = status.canonical_reason().unwrap_or("error").to_ascii_lowercase();
        let code = code_for(status);
        let (request, old) = res.into_parts();
        let mut fresh = HttpResponse::build(status).json(envelope(code, &message));
        for (name, value) in old.headers() {
            if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
                fresh.headers_mut().insert(name.clone(), value.clone());
            }
        }
        res = ServiceResponse::new(request, fresh);
    }
    let html = res.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("text/html"));
    let res = if html {
        let (request, response) = res.into_parts();
        let (head, body) = response.into_parts();
        match body.try_into_bytes() {
            Ok(bytes) => {
                let csp = page_csp(&bytes);
                let mut response = head.set_body(BoxBody::new(bytes));
                set_default(response.headers_mut(), header::CONTENT_SECURITY_POLICY, &csp);
                ServiceResponse::new(request, response)
            }
            Err(body) => {
                let mut response = head.set_body(body);
                set_default(response.headers_mut(), header::CONTENT_SECURITY_POLICY, "default-src 'self'; frame-ancestors 'none'");
                ServiceResponse::new(request, response)
            }
        }
    } else {
        let mut res = res;
        set_default(res.headers_mut(), header::CONTENT_SECURITY_POLICY, API_CSP);
        res
    };
    let mut res = res;
    let headers = res.headers_mut();
    set_default(headers, header::CACHE_CONTROL, if html { "no-cache" } else { "no-store" });
    set_default(headers, header::X_CONTENT_TYPE_OPTIONS, "nosniff");
    set_default(headers, header::REFERRER_POLICY, "no-referrer");
    set_default(headers, header::X_FRAME_OPTIONS, "DENY");
    set_default(headers, HeaderName::from_static("cross-origin-opener-policy"), "same-origin");
    if let Ok(value) = HeaderValue::from_str(&id) {
        headers.insert(HeaderName::from_static("x-request-id"), value);
    }
    let route = res.request().match_pattern().unwrap_or_else(|| "-".to_owned());
    if agentloop_shared::telemetry::exporting() {
        span.record("http.response.status_code", i64::from(res.status().as_u16()));
        if res.status().is_server_error() {
            span.record("otel.status_code", "ERROR");
        }
    }
    drop(span);
    let principal = res.request().extensions().get::<AccessPrincipal>().map_or_else(|| "-".to_owned(), |p| p.0.to_string());
    tracing::info!(
        target: "agentloop::access",
        method = %method,
        route = %route,
        status = res.status().as_u16(),
        duration_ms = started.elapsed().as_millis() as u64,
        principal_id = %principal,
        request_id = %id,
        client = %client,
        "access"
    );
    Ok(res.map_into_boxed_body())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_with_nul_are_cleaned_and_huge_numbers_refused() {
        assert_eq!(check_json_body(br#"{"a": "b", "n": 1.7976931348623157e308}"#).unwrap(), None);
        assert_eq!(check_json_body(b"").unwrap(), None);
        let cleaned = |body: &[u8]| serde_json::from_slice::<Value>(&check_json_body(body).unwrap().unwrap()).unwrap();
        assert_eq!(cleaned(br#"{"a": "x\u0000y"}"#), serde_json::json!({"a": "x\u{FFFD}y"}));
        assert_eq!(cleaned(br#"{"k\u0000": [{"deep": ["\u0000"]}]}"#), serde_json::json!({"k\u{FFFD}": [{"deep": ["\u{FFFD}"]}]}));
        let code = |body: &[u8]| check_json_body(body).unwrap_err().code().to_owned();
        assert_eq!(code(br#"{"n": 1e400}"#), "invalid_number");
        assert_eq!(code(br#"{"n": -1.8e308}"#), "invalid_number");
        // Numbers serde_json would round are refused; ones that differ only in spelling pass.
        assert_eq!(code(br#"{"args": {"amount": 12345678901234567.89}}"#), "invalid_number");
        assert_eq!(code(br#"{"n": 123456789012345678901234}"#), "invalid_number");
        assert!(check_json_body(br#"{"n": [1.10, 1E2, -0, 0.1, 18446744073709551615, "12345678901234567.89"]}"#).is_ok());
        assert_eq!(code(br#"{"n": NaN}"#), "invalid_json");
        assert_eq!(code(b"{"), "invalid_json");
    }

    #[test]
    fn the_page_csp_allows_exactly_its_inline_scripts() {
        let csp = page_csp(b"<html><script>alert(1)</script><script src=\"/app.js\"></script><SCRIPT type=module>x()</SCRIPT></html>");
        let hash = |s: &str| base64::engine::general_purpose::STANDARD.encode(Sha256::digest(s.as_bytes()));
        assert!(csp.contains(&format!("'sha256-{}'", hash("alert(1)"))), "{csp}");
        assert!(csp.contains(&format!("'sha256-{}'", hash("x()"))), "{csp}");
        assert_eq!(csp.matches("sha256-").count(), 2, "{csp}");
        assert!(csp.contains("frame-ancestors 'none'") && !csp.contains("unsafe-eval"));
    }

    #[test]
    fn json_content_types() {
        assert!(is_json(Some(&HeaderValue::from_static("application/json; charset=utf-8"))));
        assert!(is_json(Some(&HeaderValue::from_static("application/merge-patch+json"))));
        assert!(!is_json(Some(&HeaderValue::from_static("text/plain"))));
        assert!(!is_json(None));
    }
}
