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

/// Bounds every message of the working context to `max_tokens` (the largest turn the model
/// takes, [`crate::generation::max_input_tokens`]): one message larger than that — a model's
/// own huge tool call, say — can never fit beside the answer, cannot be compacted away while it
/// is recent, and failed every later turn of its thread (`compaction_nothing_to_compact`). Such
/// a message keeps its role, identity and call ids, but its text is cut in the middle
/// ("…[N characters omitted]…"), each call's arguments become `{"omitted_from_context": "<head
/// …[N characters omitted]… tail>"}` (still a JSON object, which strict providers parse), its
/// reasoning is dropped and its estimate recounted. Only the copy sent to the model and
/// summarised is cut; the stored history and what the tools received are untouched. Returns the
/// number of messages cut.
pub fn bound_messages(context: &mut [ContextMessage], max_tokens: u32) -> usize {
    let max_tokens = max_tokens.max(64);
    let mut cut = 0;
    for c in context.iter_mut().filter(|c| c.message.token_estimate.max(0) as u32 > max_tokens) {
        bound_message(&mut c.message, max_tokens);
        cut += 1;
    }
    cut
}

fn bound_message(m: &mut NewMessage, max_tokens: u32) {
    let text = crate::messages::content_text(&m.content);
    let calls = m.tool_calls.clone();
    let count = calls.as_ref().and_then(Value::as_array).map_or(0, Vec::len);
    m.reasoning = None;
    // Start from ~3 characters per token and halve until the estimate fits.
    let mut budget = (max_tokens as usize).saturating_mul(3);
    loop {
        let share = budget / (count + 1);
        m.content = Value::String(crate::compaction::bound(&text, share));
        m.tool_calls = calls.clone().map(|mut calls| {
            for call in calls.as_array_mut().into_iter().flatten() {
                if let Some(arguments) = call.pointer_mut("/function/arguments")
                    && arguments.as_str().is_some_and(|a| a.chars().count() > share)
                {
                    let omitted = crate::compaction::bound(arguments.as_str().unwrap_or_default(), share);
                    *arguments = Value::String(serde_json::json!({ "omitted_from_context": omitted }).to_string());
                }
            }
            calls
        });
        m.token_estimate = crate::tokens::estimate_message(&m.content, m.tool_calls.as_ref()) as i32;
        if m.token_estimate.max(0) as u32 <= max_tokens || budget < 64 {
            return;
        }
        budget /= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A message larger than the model's turn limit is cut to fit; the others are untouched.
    #[test]
    fn a_message_larger_than_a_turn_is_cut_to_fit() {
        let mut call = NewMessage::text(role::ASSISTANT, "writing the file");
        let huge = format!(r#"{{"path":"a.txt","text":"{}"}}"#, "lorem ipsum dolor sit amet ".repeat(20_000));
        call.tool_calls = Some(json!([{"id": "c1", "providerId": "p1", "type": "function", "function": {"name": "write", "arguments": huge}}]));
        call.reasoning = Some("thinking".repeat(10_000));
        call.token_estimate = crate::tokens::estimate_message(&call.content, call.tool_calls.as_ref()) as i32;
        let big_text = NewMessage::text(role::TOOL, "word ".repeat(50_000));
        let small = NewMessage::text(role::USER, "hello");
        let mut context: Vec<ContextMessage> = [small.clone(), call, big_text]
            .into_iter()
            .enumerate()
            .map(|(i, message)| ContextMessage { identity: Some(i as i64), message })
            .collect();
        assert!(context[1].message.token_estimate > 100_000, "{}", context[1].message.token_estimate);
        assert_eq!(bound_messages(&mut context, 3000), 2);
        assert_eq!(context[0].message, small, "a message that fits is untouched");
        for c in &context[1..] {
            assert!((1..=3000).contains(&c.message.token_estimate), "{}", c.message.token_estimate);
            assert_eq!(c.message.token_estimate as usize, crate::tokens::estimate_message(&c.message.content, c.message.tool_calls.as_ref()));
        }
        let cut = &context[1].message;
        assert_eq!((cut.role.as_str(), context[1].identity, cut.reasoning.as_deref()), ("assistant", Some(1), None));
        let calls = cut.tool_calls.as_ref().unwrap();
        assert_eq!((calls[0]["id"].as_str(), calls[0]["providerId"].as_str(), calls[0]["function"]["name"].as_str()), (Some("c1"), Some("p1"), Some("write")));
        let arguments: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).expect("still a JSON object");
        let omitted = arguments["omitted_from_context"].as_str().unwrap();
        assert!(omitted.starts_with(r#"{"path":"a.txt""#) && omitted.contains("characters omitted]"), "{omitted}");
        assert!(crate::messages::content_text(&context[2].message.content).contains("characters omitted]"));
    }

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
