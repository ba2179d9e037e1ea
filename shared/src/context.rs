//! The model context of a slice and its provider projection (SPEC §6 step 2, §9).
//!
//! The worker holds the context as [`ContextMessage`]s: canonical rows (with their timestamp
//! identity) plus the messages the slice produced. What goes to a provider is always a fresh
//! copy made by [`crate::provider::projection::project_for`], stripped of every UI field (sequence, timestamp, provenance, usage,
//! token estimate), so provider-specific cleanup can never touch checkpoint identities.

use serde_json::Value;

use crate::messages::{Message, NewMessage, role};

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
            },
        }
    }
}

/// Builds the summary message of a snapshot: a `system` message whose text starts with the
/// internal [`SUMMARY_MARKER`](crate::provider::projection::SUMMARY_MARKER) (stripped from every
/// provider payload), so a later compaction folds it instead of keeping it as an instruction.
pub fn summary_message(summary: &str) -> ContextMessage {
    let text = format!("{}\nSummary of the earlier conversation:\n{summary}", crate::provider::projection::SUMMARY_MARKER);
    ContextMessage { identity: None, message: NewMessage::text(role::SYSTEM, text) }
}

/// Whether a context message is a compaction summary (carries the internal marker).
pub fn is_summary(message: &NewMessage) -> bool {
    message.role == role::SYSTEM
        && crate::messages::content_text(&message.content).starts_with(crate::provider::projection::SUMMARY_MARKER)
}

/// The model context of a thread (SPEC §6 step 2): with a live snapshot, the system/developer
/// rows before its coverage, its summary, then the active rows after `to_sequence`; without one,
/// every active row. Returns the snapshot used.
pub async fn load(
    conn: &mut diesel_async::AsyncPgConnection,
    thread_id: uuid::Uuid,
) -> diesel::QueryResult<(Vec<ContextMessage>, Option<crate::snapshots::Snapshot>)> {
    let snapshot = crate::snapshots::latest_live(conn, thread_id).await?;
    let Some(snap) = snapshot else {
        let rows = crate::messages::active_after(conn, thread_id, 0).await?;
        return Ok((rows.iter().map(ContextMessage::from).collect(), None));
    };
    let instructions = crate::messages::instructions_before(conn, thread_id, snap.from_sequence).await?;
    let tail = crate::messages::active_after(conn, thread_id, snap.to_sequence).await?;
    let mut context: Vec<ContextMessage> = instructions.iter().map(ContextMessage::from).collect();
    context.push(summary_message(&snap.summary));
    context.extend(tail.iter().map(ContextMessage::from));
    Ok((context, Some(snap)))
}

/// Approximate tokens of the context (the sum of per-message estimates, SPEC §6 step 2) plus the
/// tool schemas sent with it.
pub fn estimate_tokens(context: &[ContextMessage], tools: &[Value]) -> i64 {
    let messages: i64 = context.iter().map(|c| i64::from(c.message.token_estimate.max(1))).sum();
    let schemas: i64 = tools.iter().map(|t| crate::tokens::estimate_text(&t.to_string()) as i64).sum();
    messages + schemas
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
