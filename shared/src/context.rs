//! The model context of a slice and its provider projection (SPEC §6 step 2, §9).
//!
//! The worker holds the context as [`ContextMessage`]s: canonical rows (with their timestamp
//! identity) plus the messages the slice produced. What goes to a provider is always a fresh
//! copy made by [`crate::provider::projection::project_for`], stripped of every UI field (sequence, timestamp, provenance, usage,
//! token estimate), so provider-specific cleanup can never touch checkpoint identities.

use serde_json::Value;

use crate::messages::{Message, NewMessage, role};
use crate::scheduler::step::{LoadedContext, SnapshotRef};

/// One message of the working context. `identity` is the canonical timestamp identity once the
/// message is persisted (`None` until its checkpoint commits).
#[derive(Debug, Clone, PartialEq)]
pub struct ContextMessage {
    pub identity: Option<i64>,
    pub message: NewMessage,
}

impl From<&Message> for ContextMessage {
    fn from(m: &Message) -> Self {
        Self {
            identity: Some(m.timestamp_ms),
            message: NewMessage {
                role: m.role.clone(),
                content: m.content.clone(),
                tool_calls: m.tool_calls.clone(),
                tool_call_id: m.tool_call_id.clone(),
                reasoning: m.reasoning.clone(),
                token_estimate: m.token_estimate,
                stopped: m.stopped,
                finish_reason: m.finish_reason.clone(),
            },
        }
    }
}

/// Builds the summary message of a snapshot: a `system` message whose text starts with the
/// internal [`SUMMARY_MARKER`](crate::provider::projection::SUMMARY_MARKER) (stripped from every
/// provider payload), so a later compaction folds it instead of keeping it as an instruction.
/// `tokens` is the summary's estimate (the same the database counts for the context).
pub fn summary_message(summary: &str, tokens: i32) -> ContextMessage {
    let text = format!("{}\nSummary of the earlier conversation:\n{summary}", crate::provider::projection::SUMMARY_MARKER);
    let mut message = NewMessage::text(role::SYSTEM, text);
    message.token_estimate = tokens.max(1);
    ContextMessage { identity: None, message }
}

/// Whether a context message is a compaction summary (carries the internal marker).
pub fn is_summary(message: &NewMessage) -> bool {
    message.role == role::SYSTEM
        && crate::messages::content_text(&message.content).starts_with(crate::provider::projection::SUMMARY_MARKER)
}

/// The working context of a loaded thread context (SPEC §6 step 2): with a live snapshot, the
/// instructions before its coverage, its summary, then the rows after it; without one, every
/// active row. Returns the snapshot used.
pub fn from_loaded(loaded: &LoadedContext) -> (Vec<ContextMessage>, Option<SnapshotRef>) {
    let mut context: Vec<ContextMessage> = loaded.instructions.iter().map(ContextMessage::from).collect();
    if let Some(snapshot) = &loaded.snapshot {
        context.push(summary_message(&snapshot.summary, snapshot.token_estimate));
    }
    context.extend(loaded.messages.iter().map(ContextMessage::from));
    (context, loaded.snapshot.clone())
}

/// Reads thread `thread_id`'s context and metadata (`agentloop_read_context`).
pub async fn read(store: &crate::store::Store, thread_id: uuid::Uuid) -> Result<(LoadedContext, Value), crate::store::StoreError> {
    let value = store
        .call("agentloop_read_context", &serde_json::json!({"threadId": thread_id}), crate::store::Replay::Safe, None)
        .await?;
    let metadata = value.get("metadata").cloned().unwrap_or(Value::Null);
    let loaded = serde_json::from_value(value)
        .map_err(|e| crate::store::StoreError::Deterministic { sqlstate: "XX000".into(), message: e.to_string() })?;
    Ok((loaded, metadata))
}

/// Approximate tokens of the context's messages (the sum of their estimates, at least 1 each).
pub fn messages_tokens(context: &[ContextMessage]) -> i64 {
    context.iter().map(|c| i64::from(c.message.token_estimate.max(1))).sum()
}

/// Approximate tokens of tool schemas (tokenized: compute once per set of tools, not per call).
pub fn schema_tokens(tools: &[Value]) -> i64 {
    tools.iter().map(|t| crate::tokens::estimate_text(&t.to_string()) as i64).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn projection_strips_ui_fields_and_keeps_tool_correlation() {
        let mut call = NewMessage::text(role::ASSISTANT, "");
        call.tool_calls = Some(json!([{"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]));
        let mut result = NewMessage::text(role::TOOL, "4");
        result.tool_call_id = Some("c1".into());
        let context = vec![
            ContextMessage { identity: Some(10), message: NewMessage::text(role::USER, "2+2?") },
            ContextMessage { identity: Some(11), message: call },
            ContextMessage { identity: None, message: result },
        ];
        let model = crate::provider::catalog::ModelCatalog::from_env_vars("http://127.0.0.1:1/v1", None, "m", None)
            .unwrap()
            .models
            .remove(0);
        let projected = crate::provider::projection::project_for(&model, &context);
        assert_eq!(projected[0], json!({"role": "user", "content": "2+2?"}));
        assert_eq!(projected[1]["content"], Value::Null);
        assert_eq!(projected[1]["tool_calls"][0]["id"], "c1");
        assert_eq!(projected[2], json!({"role": "tool", "content": "4", "tool_call_id": "c1"}));
        for p in &projected {
            for key in ["timestamp", "sequence", "identity", "tokenEstimate", "runId"] {
                assert!(p.get(key).is_none(), "{key} leaked into the payload");
            }
        }
    }
}
