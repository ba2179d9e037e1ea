//! The OpenAI-compatible surface (`/v1/*`, issue 12 part 1): `POST /v1/chat/completions`
//! (non-streaming and `stream: true`, client-side tools), `GET /v1/models`,
//! `GET /v1/models/{id}`. Errors on `/v1/*` use OpenAI's shape
//! `{"error":{"message","type","param","code"}}` ([`V1Error`], and [`openai_errors`] for the
//! errors of extractors and shared code), so the official SDKs raise their usual exceptions
//! (`BadRequestError` 400, `AuthenticationError` 401, `NotFoundError` 404, ...).

pub mod chat_completions;
pub mod hidden;
pub mod list_models;
pub mod stream;

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::middleware::Next;
use actix_web::{HttpResponse, ResponseError};
use serde_json::{Value, json};

use crate::error::ApiError;

/// OpenAI's error `type` for an HTTP status.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    }
}

/// The message of a run that ended with a call of unknown outcome (`operation_uncertain`): its
/// own, and where the call is kept — agentloop_openai_release keeps such a thread instead of
/// deleting it (migration 000029).
pub fn uncertain_message(message: &str, thread_id: uuid::Uuid, run_id: uuid::Uuid) -> String {
    format!(
        "{}. The call's outcome is unknown: it is kept for you to resolve in thread {thread_id} \
         (GET /api/runs/{run_id}/operations); this request must not be sent again blindly.",
        message.trim_end().trim_end_matches('.')
    )
}

/// An error of a `/v1` route in OpenAI's shape, with the JSON path of the offending request
/// field in `param` when there is one.
#[derive(Debug)]
pub struct V1Error {
    pub status: StatusCode,
    pub code: String,
    pub message: String,
    pub param: Option<String>,
}

impl V1Error {
    /// A 400 with `code`, `param` and `message`.
    pub fn bad_request(code: &str, param: impl Into<String>, message: impl Into<String>) -> Self {
        let param = param.into();
        Self { status: StatusCode::BAD_REQUEST, code: code.to_owned(), message: message.into(), param: (!param.is_empty()).then_some(param) }
    }

    /// The response body.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": error_type(self.status), "param": self.param, "code": self.code}})
    }
}

impl std::fmt::Display for V1Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<ApiError> for V1Error {
    fn from(e: ApiError) -> Self {
        let response = e.error_response();
        let status = response.status();
        let code = match &e {
            ApiError::Unauthorized => "invalid_api_key".to_owned(),
            other => other.code().to_owned(),
        };
        let message = if status.is_server_error() && matches!(e, ApiError::Internal(_)) { "internal error".to_owned() } else { e.to_string() };
        Self { status, code, message, param: None }
    }
}

impl From<agentloop_shared::store::StoreError> for V1Error {
    fn from(e: agentloop_shared::store::StoreError) -> Self {
        ApiError::from(e).into()
    }
}

/// A row not found on `/v1/*` is the request's own hidden run or message: it is gone only when
/// the workers' sweep deleted the hidden thread because this api stopped renewing the request's
/// lease (`OPENAI_REQUEST_LEASE_MS`; a stalled or overloaded process) — 504 `request_expired`,
/// the caller sends the request again.
impl From<diesel::result::Error> for V1Error {
    fn from(e: diesel::result::Error) -> Self {
        if matches!(e, diesel::result::Error::NotFound) {
            return Self {
                status: StatusCode::GATEWAY_TIMEOUT,
                code: "request_expired".into(),
                message: "this request's lease expired while the server was unresponsive and its run was cleaned up; send it again".into(),
                param: None,
            };
        }
        ApiError::from(e).into()
    }
}

impl From<diesel_async::pooled_connection::deadpool::PoolError> for V1Error {
    fn from(e: diesel_async::pooled_connection::deadpool::PoolError) -> Self {
        ApiError::from(e).into()
    }
}

impl ResponseError for V1Error {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status);
        if self.status == StatusCode::UNAUTHORIZED {
            response.insert_header(("WWW-Authenticate", "Bearer"));
        }
        response.json(self.body())
    }
}

/// App-wide middleware, outermost (acts on `/v1/*` paths only): rewrites the API's own error envelope
/// `{"error":{"code","message"}}` (from extractors — 401, invalid JSON, payload size — and the
/// edge's refusals, the fallback 404) into OpenAI's `{"error":{"message","type","param","code"}}`; bodies already in
/// that shape pass unchanged.
pub async fn openai_errors(req: ServiceRequest, next: Next<impl MessageBody + 'static>) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    if !req.path().starts_with("/v1/") {
        return Ok(next.call(req).await?.map_into_boxed_body());
    }
    let res = next.call(req).await?;
    let status = res.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return Ok(res.map_into_boxed_body());
    }
    let (req, res) = res.into_parts();
    let (head, body) = res.into_parts();
    let bytes = actix_web::body::to_bytes_limited(body, 64 * 1024).await.ok().and_then(Result::ok).unwrap_or_default();
    let mut value: Value = serde_json::from_slice(&bytes).unwrap_or_else(|_| json!({"error": {"message": String::from_utf8_lossy(&bytes)}}));
    if let Some(error) = value.get_mut("error").and_then(Value::as_object_mut) {
        error.entry("type").or_insert_with(|| json!(error_type(status)));
        error.entry("param").or_insert(Value::Null);
        if status == StatusCode::UNAUTHORIZED {
            error.insert("code".into(), json!("invalid_api_key"));
        }
        error.entry("code").or_insert(Value::Null);
        error.entry("message").or_insert_with(|| json!(status.canonical_reason().unwrap_or("error")));
    }
    let mut response = HttpResponse::build(status);
    for (name, value) in head.headers().iter().filter(|(n, _)| *n != actix_web::http::header::CONTENT_LENGTH) {
        response.append_header((name.clone(), value.clone()));
    }
    let response = response.content_type("application/json").body(value.to_string());
    Ok(ServiceResponse::new(req, response))
}
