//! Tool approvals (SPEC §13): list a thread's approvals, approve (optionally with edited
//! arguments) or reject one. Each decision is an atomic compare-and-set
//! (`agentloop_shared::approvals::decide`).

pub mod approve_approval;
pub mod list_approvals;
pub mod reject_approval;

use crate::error::ApiError;

/// Parses an optional JSON body (empty = `T::default()`); invalid JSON or unknown fields are
/// 400 `invalid_json`, never silently ignored.
pub fn parse_body<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request("invalid_json", format!("invalid request body: {e}")))
}

