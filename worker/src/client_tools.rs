//! Client-side tools of the OpenAI-compatible endpoint (issue 12, part 1).
//!
//! A `POST /v1/chat/completions` request may carry `tools` (OpenAI function specs). They are
//! stored on the hidden thread (`metadata.clientTools`) and offered to the model next to the
//! server's own tools. The worker never runs them: when the model calls one, the run ends —
//! the assistant message is committed with every call of the turn (client calls marked
//! `clientSide: true`), each call gets a result row so the tool group stays complete, and the
//! run is `completed`; the api returns the client calls as `tool_calls` with
//! `finish_reason: "tool_calls"`, and the caller's next request carries their results (the
//! standard client-side tool loop).
//!
//! Rules:
//! - **Name clash**: a client tool shadows a server tool of the same name for that request
//!   (the caller gets the calls of the tools it declared; an operator adding a server tool
//!   never breaks an existing client integration).
//! - **Mixed turns**: server calls in a turn that also calls a client tool are NOT run (their
//!   result says so): the caller's next request carries only what it saw, so the model would not
//!   see their results, and running them could repeat an effect when it calls them again.

use std::collections::HashSet;

use serde_json::{Value, json};

/// Result row of a client call (what the hidden thread's history says about it).
pub const CLIENT_CALL_RESULT: &str =
    "[returned to the API caller as a client-side tool call; its result comes with the caller's next request]";
/// Result row of a server call in a turn that also called a client tool.
pub const SKIPPED_SERVER_CALL_RESULT: &str = "[not run: this turn also called a client-side tool, so the run ended and returned \
     those calls to the caller; call this tool again if it is still needed]";

/// The client tools of a run (empty for ordinary threads).
#[derive(Debug, Clone, Default)]
pub struct ClientTools {
    specs: Vec<Value>,
    names: HashSet<String>,
}

impl ClientTools {
    /// From the thread metadata's `clientTools` (OpenAI function specs).
    pub fn from_metadata(metadata: &Value) -> Self {
        let specs: Vec<Value> = metadata.get("clientTools").and_then(Value::as_array).cloned().unwrap_or_default();
        let names = specs.iter().filter_map(|s| s.pointer("/function/name").and_then(Value::as_str)).map(str::to_owned).collect();
        Self { specs, names }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }

    /// Whether `name` is a client tool.
    pub fn contains(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    /// The specs offered to the model: the server's, minus those a client tool shadows, then the
    /// client's.
    pub fn merge(&self, server: Vec<Value>) -> Vec<Value> {
        let mut specs: Vec<Value> = server
            .into_iter()
            .filter(|s| !s.pointer("/function/name").and_then(Value::as_str).is_some_and(|n| self.contains(n)))
            .collect();
        specs.extend(self.specs.iter().cloned());
        specs
    }

    /// Marks the client calls of a wire `tool_calls` array (`clientSide: true`).
    pub fn mark(&self, wire: &mut Value) {
        for call in wire.as_array_mut().into_iter().flatten() {
            let client = call.pointer("/function/name").and_then(Value::as_str).is_some_and(|n| self.contains(n));
            if client && let Some(obj) = call.as_object_mut() {
                obj.insert("clientSide".into(), json!(true));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str) -> Value {
        json!({"type": "function", "function": {"name": name, "parameters": {"type": "object"}}})
    }

    #[test]
    fn client_tools_shadow_server_tools_and_are_marked() {
        let client = ClientTools::from_metadata(&json!({"clientTools": [spec("calculator"), spec("lookup")]}));
        let merged = client.merge(vec![spec("calculator"), spec("current_time")]);
        let names: Vec<&str> = merged.iter().map(|s| s["function"]["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["current_time", "calculator", "lookup"]);
        let mut wire = json!([{"id": "a", "function": {"name": "lookup"}}, {"id": "b", "function": {"name": "current_time"}}]);
        client.mark(&mut wire);
        assert_eq!(wire[0]["clientSide"], true);
        assert!(wire[1].get("clientSide").is_none());
        assert!(ClientTools::from_metadata(&json!({})).is_empty());
    }
}
