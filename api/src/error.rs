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
    #[error("a valid API key is required (Authorization: Bearer <key>, or the session cookie)")]
    Unauthorized,
    /// 401 with a stable code: `unauthenticated` (no credentials), `invalid_api_key`,
    /// `credentials_revoked` (a live-update connection whose key or session ended).
    #[error("{message}")]
    Unauthenticated { code: &'static str, message: String },
    /// 403 with a stable code (`csrf_header_missing`, `host_not_allowed`).
    #[error("{message}")]
    Forbidden { code: &'static str, message: String },
    /// 429 with a stable code and `Retry-After` (seconds): a rate or a per-principal limit.
    #[error("{message}")]
    TooManyRequests { code: &'static str, message: String, retry_after_s: u64 },
    /// Any other client error with its status and stable code (405, 408, 415, 431, ...).
    #[error("{message}")]
    Status { status: StatusCode, code: &'static str, message: String },
    /// 404 `not_found`; also another principal's resource (SPEC §11).
    #[error("not found")]
    NotFound,
    /// 409 with a stable code: `run_active`, `approval_required`, `idempotency_conflict`, ...
    #[error("{message}")]
    Conflict { code: &'static str, message: String },
    /// 413 `payload_too_large`.
    #[error("request body too large")]
    PayloadTooLarge,
    /// 503 with a stable code (`sse_unavailable`, `database_unavailable`, `statement_timeout`,
    /// `server_busy`).
    #[error("{message}")]
    Unavailable { code: &'static str, message: String },
    /// A refusal of a step function (`AL<status>`), with its status and stable code.
    #[error("{message}")]
    Refused { status: StatusCode, code: String, message: String },
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

    /// The stable error code.
    pub fn code(&self) -> &str {
        match self {
            Self::RunFailed { code, .. } | Self::Refused { code, .. } => code,
            Self::BadRequest { code, .. } | Self::Conflict { code, .. } | Self::Unavailable { code, .. } => code,
            Self::Unauthenticated { code, .. } | Self::Forbidden { code, .. } | Self::TooManyRequests { code, .. } => code,
            Self::Status { code, .. } => code,
            Self::Unauthorized => "unauthorized",
            Self::NotFound => "not_found",
            Self::PayloadTooLarge => "payload_too_large",
            Self::Internal(_) => "internal",
        }
    }
}

impl ApiError {
    /// 503 `database_unavailable` with a generic message; the cause (a SQLSTATE and the
    /// server's text, e.g. `25006: cannot execute INSERT in a read-only transaction`) is logged
    /// here, once, never returned (5xx bodies are generic).
    ///
    /// A statement PostgreSQL stopped at the api's `statement_timeout` (10 s) is 503
    /// `statement_timeout` instead: the database is fine, this request's work did not fit the
    /// bound, and the same request may well fail again (verifier P, P-9: costly text answered
    /// "unavailable, retry later" to clients and SDKs that then retried forever, and fired the
    /// operator's database alert for one user's content).
    pub(crate) fn database_unavailable(cause: &dyn std::fmt::Display) -> Self {
        let text = cause.to_string();
        if text.contains("statement timeout") {
            tracing::warn!(error = %text, "statement timeout");
            return Self::Unavailable {
                code: "statement_timeout",
                message: "the database stopped this request at its time bound (10 s) and nothing of it was stored; the same request \
                          may fail again: a smaller one (fewer or shorter messages, a narrower search) may not"
                    .into(),
            };
        }
        tracing::warn!(error = %text, "database unavailable");
        Self::Unavailable { code: "database_unavailable", message: "the database is unavailable right now; retry later".into() }
    }
}

impl From<diesel::result::Error> for ApiError {
    /// Reads go through diesel, which hides SQLSTATEs: a lost or terminated connection, a
    /// serialization failure, and the outage classes of `store::fault` that a read's write can
    /// meet — a read-only database (25006: a key's `last_used_at`), a full disk (53100), a
    /// server starting or shutting down (57P03) — are 503 `database_unavailable` (a read is
    /// always safe to retry); anything else a 500.
    fn from(e: diesel::result::Error) -> Self {
        use diesel::result::{DatabaseErrorKind as K, Error as E};
        let transient = match &e {
            E::DatabaseError(K::UnableToSendCommand | K::ClosedConnection | K::SerializationFailure | K::ReadOnlyTransaction, _) => true,
            E::DatabaseError(K::Unknown, info) => {
                let m = info.message();
                m.contains("terminating connection")
                    || m.contains("connection") && m.contains("closed")
                    || m.contains("statement timeout")
                    || m.contains("read-only transaction")
                    || m.contains("No space left on device")
                    || m.contains("the database system is")
            }
            _ => false,
        };
        if transient {
            Self::database_unavailable(&e)
        } else {
            Self::Internal(e.into())
        }
    }
}

impl From<agentloop_shared::store::StoreError> for ApiError {
    /// A step function's refusal keeps its status and code (404 is the plain `not_found`); a
    /// database that stayed unavailable is 503 `database_unavailable`; a replay-unsafe command
    /// whose connection broke mid-commit is 503 `outcome_unknown`; anything else is a 500.
    fn from(e: agentloop_shared::store::StoreError) -> Self {
        use agentloop_shared::store::StoreError as E;
        match e {
            E::Refused { status: 404, .. } => Self::NotFound,
            E::Refused { status, code, message } => Self::Refused {
                status: StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
                code,
                message,
            },
            E::Unavailable(message) | E::Outage(message) => Self::database_unavailable(&message),
            E::OutcomeUnknown(_) => Self::Unavailable {
                code: "outcome_unknown",
                message: "the database connection was lost while the command was being committed: it may or may not have \
                          taken effect; read the thread, or send commands with an Idempotency-Key so a retry is safe"
                    .into(),
            },
            E::Deterministic { .. } => Self::Internal(anyhow::anyhow!(e)),
        }
    }
}

impl From<diesel_async::pooled_connection::deadpool::PoolError> for ApiError {
    fn from(e: diesel_async::pooled_connection::deadpool::PoolError) -> Self {
        Self::database_unavailable(&e)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            Self::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Self::Unauthorized | Self::Unauthenticated { .. } => StatusCode::UNAUTHORIZED,
            Self::Forbidden { .. } => StatusCode::FORBIDDEN,
            Self::TooManyRequests { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::Status { status, .. } => *status,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::Conflict { .. } => StatusCode::CONFLICT,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::RunFailed { .. } => StatusCode::BAD_GATEWAY,
            Self::Refused { status, .. } => *status,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn error_response(&self) -> HttpResponse {
        if let Self::Internal(cause) = self {
            tracing::error!(error = ?cause, "request failed");
        }
        let mut response = HttpResponse::build(self.status_code());
        if matches!(self, Self::Unauthorized | Self::Unauthenticated { .. }) {
            response.insert_header(("WWW-Authenticate", "Bearer"));
        }
        match self {
            Self::TooManyRequests { retry_after_s, .. } => {
                response.insert_header(("Retry-After", retry_after_s.to_string()));
            }
            // A per-principal limit counted in PostgreSQL (AL429): a hint, not a promise.
            Self::Refused { status, code, .. } if *status == StatusCode::TOO_MANY_REQUESTS => {
                crate::limits::count_refusal(match code.as_str() {
                    "too_many_active_runs" => "active_runs",
                    "too_many_queued_turns" => "queued_turns",
                    "too_many_threads" => "threads",
                    _ => "other",
                });
                response.insert_header(("Retry-After", "10"));
            }
            // The body budget was used up (`budget.rs`): it frees as requests finish.
            Self::Unavailable { code: "server_busy", .. } => {
                response.insert_header(("Retry-After", "1"));
            }
            _ => {}
        }
        response.json(envelope(self.code(), &self.to_string()))
    }
}

/// The error envelope `{"error":{"code","message"}}`.
pub fn envelope(code: &str, message: &str) -> serde_json::Value {
    json!({"error": {"code": code, "message": message}})
}

/// Maps actix's JSON extractor errors into the envelope (`invalid_json`, `missing_field`,
/// `payload_too_large`, `unsupported_media_type`).
pub fn json_error(err: actix_web::error::JsonPayloadError, _req: &actix_web::HttpRequest) -> actix_web::Error {
    use actix_web::error::JsonPayloadError as E;
    let api = match &err {
        E::OverflowKnownLength { .. } | E::Overflow { .. } => ApiError::PayloadTooLarge,
        E::ContentType => ApiError::Status {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            code: "unsupported_media_type",
            message: "expected Content-Type: application/json".into(),
        },
        E::Deserialize(e) if e.is_data() => {
            let message = e.to_string();
            let code = if message.starts_with("missing field") { "missing_field" } else { "invalid_field" };
            ApiError::bad_request(code, message)
        }
        other => ApiError::bad_request("invalid_json", other.to_string()),
    };
    api.into()
}

/// Maps query-string extractor errors into the envelope (`invalid_query`). serde's message does
/// not name the parameter ("invalid digit found in string"), so the query string (its first 200
/// characters) is quoted with it.
pub fn query_error(err: actix_web::error::QueryPayloadError, req: &actix_web::HttpRequest) -> actix_web::Error {
    let query: String = req.query_string().chars().take(200).collect();
    ApiError::bad_request("invalid_query", format!("{err} (query string: {query})")).into()
}

/// Maps path extractor errors into the envelope (`invalid_path`, e.g. a malformed UUID).
pub fn path_error(err: actix_web::error::PathError, _req: &actix_web::HttpRequest) -> actix_web::Error {
    let _ = err;
    ApiError::NotFound.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A command PostgreSQL stopped at the statement bound is not "the database is unavailable"
    /// (verifier P, P-9); a lost connection still is.
    #[test]
    fn a_statement_timeout_is_told_apart_from_an_unavailable_database() {
        use agentloop_shared::store::StoreError;
        let timed_out = ApiError::from(StoreError::Unavailable("57014: canceling statement due to statement timeout".into()));
        assert_eq!(timed_out.code(), "statement_timeout");
        let lost = ApiError::from(StoreError::Unavailable("connection closed".into()));
        assert_eq!(lost.code(), "database_unavailable");
    }
}
