//! The API's one error type and envelope: `{"error":{"code":"snake_case","message":"..."}}`
//! (SPEC §13). 5xx bodies are generic; their cause goes to the log once, here.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde_json::json;

/// Every error a handler returns.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 400 with a stable code, e.g. `invalid_json`, `missing_field`, `invalid_content`.
    #[error("{message}")]
    BadRequest { code: &'static str, message: String },
    /// 401 `unauthorized`: no or an invalid bearer key.
    #[error("a valid API key is required (Authorization: Bearer <key>)")]
    Unauthorized,
    /// 404 `not_found`; also another principal's resource (SPEC §11).
    #[error("not found")]
    NotFound,
    /// 409 with a stable code: `run_active`, `approval_required`, `idempotency_conflict`, ...
    #[error("{message}")]
    Conflict { code: &'static str, message: String },
    /// 413 `payload_too_large`.
    #[error("request body too large")]
    PayloadTooLarge,
    /// 503 with a stable code (`sse_unavailable`, `database_unavailable`).
    #[error("{message}")]
    Unavailable { code: &'static str, message: String },
    /// 502 with the failed run's error code (the stateless endpoint).
    #[error("{message}")]
    RunFailed { code: String, message: String },
    /// 500 `internal`; the cause is logged, never returned.
    #[error("internal error")]
    Internal(#[from] anyhow::Error),
}

impl ApiError {
    /// A 400 with `code` and `message`.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::BadRequest { code, message: message.into() }
    }

    /// A 409 with `code` and `message`.
    pub fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        Self::Conflict { code, message: message.into() }
    }

    fn code(&self) -> &str {
        match self {
            Self::RunFailed { code, .. } => code,
            Self::BadRequest { code, .. } | Self::Conflict { code, .. } | Self::Unavailable { code, .. } => code,
            Self::Unauthorized => "unauthorized",
            Self::NotFound => "not_found",
            Self::PayloadTooLarge => "payload_too_large",
            Self::Internal(_) => "internal",
        }
    }
}

impl From<diesel::result::Error> for ApiError {
    fn from(e: diesel::result::Error) -> Self {
        Self::Internal(e.into())
    }
}

impl From<diesel_async::pooled_connection::deadpool::PoolError> for ApiError {
    fn from(e: diesel_async::pooled_connection::deadpool::PoolError) -> Self {
        Self::Unavailable { code: "database_unavailable", message: format!("database unavailable: {e}") }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            Self::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::Conflict { .. } => StatusCode::CONFLICT,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::RunFailed { .. } => StatusCode::BAD_GATEWAY,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn error_response(&self) -> HttpResponse {
        if let Self::Internal(cause) = self {
            tracing::error!(error = ?cause, "request failed");
        }
        let mut response = HttpResponse::build(self.status_code());
        if matches!(self, Self::Unauthorized) {
            response.insert_header(("WWW-Authenticate", "Bearer"));
        }
        response.json(json!({"error": {"code": self.code(), "message": self.to_string()}}))
    }
}

/// Maps actix's JSON extractor errors into the envelope (`invalid_json`, `missing_field`,
/// `payload_too_large`, `unsupported_media_type`).
pub fn json_error(err: actix_web::error::JsonPayloadError, _req: &actix_web::HttpRequest) -> actix_web::Error {
    use actix_web::error::JsonPayloadError as E;
    let api = match &err {
        E::OverflowKnownLength { .. } | E::Overflow { .. } => ApiError::PayloadTooLarge,
        E::ContentType => ApiError::bad_request("unsupported_media_type", "expected Content-Type: application/json"),
        E::Deserialize(e) if e.is_data() => {
            let message = e.to_string();
            let code = if message.starts_with("missing field") { "missing_field" } else { "invalid_field" };
            ApiError::bad_request(code, message)
        }
        other => ApiError::bad_request("invalid_json", other.to_string()),
    };
    api.into()
}

/// Maps query-string extractor errors into the envelope (`invalid_query`).
pub fn query_error(err: actix_web::error::QueryPayloadError, _req: &actix_web::HttpRequest) -> actix_web::Error {
    ApiError::bad_request("invalid_query", err.to_string()).into()
}

/// Maps path extractor errors into the envelope (`invalid_path`, e.g. a malformed UUID).
pub fn path_error(err: actix_web::error::PathError, _req: &actix_web::HttpRequest) -> actix_web::Error {
    let _ = err;
    ApiError::NotFound.into()
}
