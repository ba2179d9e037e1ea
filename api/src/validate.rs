//! Validation of client-supplied values shared by several routes (400s with stable codes).

use serde_json::Value;

use crate::error::ApiError;

/// Content part types accepted in message content (OpenAI Chat Completions' user content parts).
const PART_TYPES: [&str; 4] = ["text", "image_url", "input_audio", "file"];

/// Message content: a non-empty string, or a non-empty array of well-formed parts —
/// `{type:"text", text: string}`, `{type:"image_url", image_url:{url: http(s)/data URL}}`,
/// `{type:"input_audio", input_audio:{data, format}}`, `{type:"file", file:{...}}`.
/// Error: 400 `invalid_content` naming the offending part.
pub fn content(content: &Value) -> Result<(), ApiError> {
    let bad = |why: String| Err(ApiError::bad_request("invalid_content", why));
    match content {
        Value::String(s) if !s.trim().is_empty() => Ok(()),
        Value::Array(parts) if !parts.is_empty() => {
            for (i, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
                if !PART_TYPES.contains(&kind) {
                    return bad(format!("content[{i}].type must be one of {}", PART_TYPES.join(", ")));
                }
                let ok = match kind {
                    "text" => part.get("text").and_then(Value::as_str).is_some(),
                    "image_url" => part
                        .pointer("/image_url/url")
                        .and_then(Value::as_str)
                        .is_some_and(|u| u.starts_with("https://") || u.starts_with("http://") || u.starts_with("data:")),
                    "input_audio" => part.pointer("/input_audio/data").and_then(Value::as_str).is_some(),
                    _ => part.get("file").is_some_and(Value::is_object),
                };
                if !ok {
                    return bad(format!("content[{i}] is not a well-formed {kind} part"));
                }
            }
            Ok(())
        }
        _ => bad("content must be a non-empty string or a non-empty array of content parts".into()),
    }
}

/// Thread metadata: an object whose known keys have valid values — `multitask` (reject |
/// enqueue | interrupt), `compactThreshold` (> 0: a share of the limit when ≤ 1, else tokens),
/// `compactChunkTokens` and `compactRecentMessages` (positive integers). Error: 400
/// `invalid_metadata`.
pub fn metadata(metadata: &Value) -> Result<(), ApiError> {
    let bad = |why: &str| Err(ApiError::bad_request("invalid_metadata", why.to_owned()));
    let Some(obj) = metadata.as_object() else { return bad("metadata must be a JSON object") };
    if let Some(v) = obj.get("multitask") {
        if !matches!(v.as_str(), Some("reject" | "enqueue" | "interrupt")) {
            return bad("metadata.multitask must be reject, enqueue or interrupt");
        }
    }
    if let Some(v) = obj.get("compactThreshold") {
        if !v.as_f64().is_some_and(|t| t > 0.0) {
            return bad("metadata.compactThreshold must be a positive number");
        }
    }
    for key in ["compactChunkTokens", "compactRecentMessages"] {
        if let Some(v) = obj.get(key) {
            if !v.as_u64().is_some_and(|n| n > 0) {
                return bad(&format!("metadata.{key} must be a positive integer"));
            }
        }
    }
    Ok(())
}

/// Longest thread title, in characters.
const MAX_TITLE_CHARS: usize = 500;

/// A requested model id must be in the catalog. Error: 400 `unknown_model`.
pub fn model(catalog: &agentloop_shared::provider::catalog::ModelCatalog, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if catalog.get(m).is_none() => {
            Err(ApiError::bad_request("unknown_model", format!("model '{m}' is not configured")))
        }
        _ => Ok(()),
    }
}

/// The optional fields of a thread create/update: `title` at most 500 characters, a configured
/// `model`, valid `metadata`. Errors: 400 `invalid_title`, `unknown_model`, `invalid_metadata`.
pub fn thread_fields(
    catalog: &agentloop_shared::provider::catalog::ModelCatalog,
    title: Option<&str>,
    model_id: Option<&str>,
    metadata_value: Option<&Value>,
) -> Result<(), ApiError> {
    if title.is_some_and(|t| t.chars().count() > MAX_TITLE_CHARS) {
        return Err(ApiError::bad_request("invalid_title", format!("title is limited to {MAX_TITLE_CHARS} characters")));
    }
    model(catalog, model_id)?;
    metadata_value.map_or(Ok(()), metadata)
}
