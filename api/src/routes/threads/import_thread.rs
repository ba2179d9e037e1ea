//! `POST /api/threads/import` (issue 12, part 3).

use actix_web::{HttpRequest, HttpResponse, web};
use agentloop_shared::import::{self, Limits};
use agentloop_shared::{commands, receipts};
use serde::Serialize;
use serde_json::{Value, json};
use utoipa::ToSchema;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Bounds of an import (from the api's configuration).
#[derive(Debug, Clone, Copy)]
pub struct ImportLimits {
    /// Request body bytes (`IMPORT_MAX_BYTES`).
    pub max_bytes: usize,
    /// Messages per document (`IMPORT_MAX_MESSAGES`).
    pub max_messages: usize,
}

/// Metadata keys an import never takes over: they would change how runs behave
/// (`stateless`: approvals fail closed; `clientTools`: calls end the run).
const RESERVED_METADATA: [&str; 2] = ["stateless", "clientTools"];

/// 201 (200 when replayed) body of an import.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImportResult {
    /// The new thread (as `POST /api/threads` returns it).
    #[schema(value_type = Object)]
    pub thread: Value,
    /// Messages imported.
    pub messages: i64,
    /// `agentloop.thread.v1` | `openai` | `llmspy`.
    pub format: String,
    /// What was changed to keep history valid: `[{index, action, reason}]` (`action`:
    /// `tool_result_to_context`, `dropped_streaming`, `model_dropped`, `metadata_key_dropped`).
    #[schema(value_type = Vec<Object>)]
    pub repairs: Vec<Value>,
    /// Present (true) when an identical request with the same `Idempotency-Key` was answered
    /// before: this is that thread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replayed: Option<bool>,
}

/// Imports one thread from an agentloop export (`agentloop.thread.v1`), an OpenAI messages
/// array (`[...]` or `{"messages": [...], "title"?, "model"?}`) or a ServiceStack llms.py / AI.Chat
/// thread (or its export file with one thread) — see `agentloop_shared::import` for the formats
/// and the message rules — as a new thread of the caller, in ONE transaction
/// (`agentloop_import`): gap-free sequences, strictly increasing timestamp identities from the
/// source's times, the source's `createdAt` kept. `Idempotency-Key`: a retry of the same body
/// returns the same thread (200, `replayed: true`); another body with the key is 409
/// `idempotency_conflict`. A model the server does not configure is dropped (the thread uses
/// the default), reserved metadata keys are dropped; both are listed in `repairs`.
///
/// Errors: 400 `invalid_json`, `invalid_import` / `unsupported_format` / `duplicate_tool_call_id`
/// / `message_too_large` / `too_many_messages` (the message names the JSON path),
/// `invalid_metadata`, `invalid_idempotency_key`; 401; 409; 413 `payload_too_large` (over
/// `IMPORT_MAX_BYTES`).
pub async fn import_thread(
    state: web::Data<AppState>,
    limits: web::Data<ImportLimits>,
    who: Authenticated,
    req: HttpRequest,
    mut payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    use futures_util::StreamExt;
    // Read at most IMPORT_MAX_BYTES: memory is bounded by configuration, not by the client.
    let mut body = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_request("invalid_body", format!("reading the body failed: {e}")))?;
        if body.len() + chunk.len() > limits.max_bytes {
            return Err(ApiError::PayloadTooLarge);
        }
        body.extend_from_slice(&chunk);
    }
    let body = body.freeze();
    let command_id = crate::extract::idempotency_key(&req)?;
    let bounds = Limits { max_messages: limits.max_messages, max_message_bytes: limits.max_bytes };
    // Parsing and token counting are CPU work proportional to the document: off the async threads.
    let parsed = web::block(move || -> Result<(import::Imported, String), ApiError> {
        let doc: Value = serde_json::from_slice(&body).map_err(|e| ApiError::bad_request("invalid_json", format!("invalid JSON: {e}")))?;
        let fingerprint = receipts::fingerprint(&json!({"op": "import", "doc": doc}));
        let imported = import::parse(&doc, &bounds).map_err(|e| {
            let at = if e.param.is_empty() { String::new() } else { format!("{}: ", e.param) };
            ApiError::bad_request(e.code, format!("{at}{}", e.message))
        })?;
        Ok((imported, fingerprint))
    })
    .await
    .map_err(|e| ApiError::Internal(anyhow::anyhow!("import parse task: {e}")))??;
    let (mut imported, fingerprint) = parsed;
    if let Some(model) = imported.model.clone().filter(|m| state.catalog.get(m).is_none()) {
        imported.repairs.push(import::Repair {
            index: 0,
            action: "model_dropped",
            reason: format!("model '{model}' is not configured on this server; the thread uses the default"),
        });
        imported.model = None;
    }
    if let Some(obj) = imported.metadata.as_object_mut() {
        for key in RESERVED_METADATA {
            if obj.remove(key).is_some() {
                imported.repairs.push(import::Repair { index: 0, action: "metadata_key_dropped", reason: format!("metadata.{key} is reserved") });
            }
        }
    }
    crate::validate::metadata(&imported.metadata)?;
    // No message may be larger than a turn the thread's model could take: one that does not fit
    // its context leaves every later turn of the thread failing (acceptance probe: a 15 MiB
    // imported message, refused as a chat turn, made the thread unusable).
    let model = imported.model.as_deref().and_then(|m| state.catalog.get(m)).or_else(|| state.catalog.default_model());
    if let Some(model) = model {
        for (index, m) in imported.messages.iter().enumerate() {
            let what = format!("messages[{index}]");
            crate::validate::message_fits(model, &imported.metadata, m.message.token_estimate, &what, "The thread could not be continued with it.")?;
        }
    }
    let now_ms = chrono::Utc::now().timestamp_millis();
    let messages: Vec<Value> = imported
        .messages
        .iter()
        .zip(imported.timestamps(now_ms))
        .map(|(m, ts)| {
            let mut v = serde_json::to_value(&m.message).unwrap_or_default();
            v["timestamp"] = json!(ts);
            if let Some(at) = m.timestamp_ms.and_then(chrono::DateTime::from_timestamp_millis) {
                v["createdAt"] = json!(at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true));
            }
            v
        })
        .collect();
    let arg = json!({
        "principalId": who.0.id,
        "commandId": command_id,
        "fingerprint": fingerprint,
        "title": imported.title(),
        "model": imported.model,
        "metadata": imported.metadata,
        "createdAt": imported.created_at.map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)),
        "format": imported.format,
        "repairs": imported.repairs,
        "messages": messages,
    });
    let response = commands::import_thread(&state.store, &arg).await?;
    let replayed = response.get("replayed").and_then(Value::as_bool) == Some(true);
    metrics::counter!("agentloop_threads_imported_total", "format" => imported.format).increment(u64::from(!replayed));
    Ok(if replayed { HttpResponse::Ok().json(response) } else { HttpResponse::Created().json(response) })
}
