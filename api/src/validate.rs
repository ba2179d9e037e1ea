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
/// `compactChunkTokens` and `compactRecentMessages` (positive integers), `maxTokens` (a positive
/// integer: the `max_tokens` of every model call), `temperature` (0..=2). Error: 400
/// `invalid_metadata`.
pub fn metadata(metadata: &Value) -> Result<(), ApiError> {
    let bad = |why: &str| Err(ApiError::bad_request("invalid_metadata", why.to_owned()));
    let Some(obj) = metadata.as_object() else { return bad("metadata must be a JSON object") };
    // Set by the server on the hidden threads of `/v1/chat/completions` (`stateless`: approvals
    // fail closed; `clientTools`: their calls end the run); a client may not set them.
    for key in ["stateless", "clientTools"] {
        if obj.contains_key(key) {
            return bad(&format!("metadata.{key} is reserved for the server"));
        }
    }
    if let Some(v) = obj.get("multitask")
        && !matches!(v.as_str(), Some("reject" | "enqueue" | "interrupt"))
    {
        return bad("metadata.multitask must be reject, enqueue or interrupt");
    }
    if let Some(v) = obj.get("compactThreshold")
        && v.as_f64().is_none_or(|t| t <= 0.0)
    {
        return bad("metadata.compactThreshold must be a positive number");
    }
    if let Some(v) = obj.get("maxTokens")
        && !v.is_null()
        && v.as_u64().is_none_or(|n| n == 0 || n > 1_000_000)
    {
        return bad("metadata.maxTokens must be a positive integer (tokens)");
    }
    if let Some(v) = obj.get("temperature")
        && !v.is_null()
        && v.as_f64().is_none_or(|t| !(0.0..=agentloop_shared::generation::TEMPERATURE_MAX).contains(&t))
    {
        return bad("metadata.temperature must be a number from 0 to 2");
    }
    for key in ["compactChunkTokens", "compactRecentMessages"] {
        if let Some(v) = obj.get(key)
            && v.as_u64().is_none_or(|n| n == 0)
        {
            return bad(&format!("metadata.{key} must be a positive integer"));
        }
    }
    Ok(())
}

/// A user turn must fit the model that will answer it (issue 11 "Input limits up front"): the
/// requested model, else the thread's, else the default; its limit is
/// `agentloop_shared::generation::max_input_tokens` under the thread's metadata. Checked before
/// anything is stored. Error: 413 `turn_too_large` naming both sizes. A thread whose model is not
/// configured is left to the step function (409 `model_not_configured`).
pub async fn turn_fits(
    state: &crate::AppState,
    principal: uuid::Uuid,
    thread_id: uuid::Uuid,
    requested: Option<&str>,
    turn: &agentloop_shared::commands::Turn,
) -> Result<(), ApiError> {
    let mut conn = state.pool.get().await?;
    let Some(thread) = agentloop_shared::threads::get_owned(&mut conn, thread_id, principal).await? else {
        return Err(ApiError::NotFound);
    };
    drop(conn);
    let model = match requested.or(thread.model.as_deref()) {
        Some(id) => state.catalog.get(id),
        None => state.catalog.default_model(),
    };
    let Some(model) = model else { return Ok(()) };
    message_fits(model, &thread.metadata, turn.token_estimate, "this message", "Shorten it or split it into several messages.")
}

/// One message of `tokens` fits a turn of `model` under a thread's `metadata`
/// (`agentloop_shared::generation::max_input_tokens`), the limit for user turns and imported
/// messages alike. Error: 413 `turn_too_large`, naming `what` and both sizes, then `hint`.
pub fn message_fits(
    model: &agentloop_shared::provider::catalog::ModelConfig,
    metadata: &serde_json::Value,
    tokens: i32,
    what: &str,
    hint: &str,
) -> Result<(), ApiError> {
    let limit = agentloop_shared::generation::max_input_tokens(model, metadata);
    if tokens.max(0) as u32 <= limit {
        return Ok(());
    }
    Err(ApiError::Refused {
        status: actix_web::http::StatusCode::PAYLOAD_TOO_LARGE,
        code: "turn_too_large".into(),
        message: format!(
            "{what} is about {tokens} tokens; model {} accepts at most {limit} tokens in one turn (its context must also hold the answer and the conversation). {hint}",
            model.id
        ),
    })
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
