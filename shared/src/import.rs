//! Thread import (issue 12): the documents `POST /api/threads/import` accepts, normalised into
//! canonical messages; the same message rules serve `POST /v1/chat/completions`.
//!
//! Accepted documents ([`parse`]):
//! - **agentloop export** `{"format": "agentloop.thread.v1", "thread": {title, model, metadata,
//!   createdAt}, "messages": [{role, content, toolCalls?, toolCallId?, reasoning?, stopped?,
//!   finishReason?, createdAt}]}` (the shape `GET /api/threads/{id}/export` writes);
//! - **OpenAI** `{"messages": [...], "title"?, "model"?}` or a bare messages array (Chat
//!   Completions messages: `tool_calls`, `tool_call_id`);
//! - **ServiceStack llms.py / AI.Chat** — a thread `{id, title, model, systemPrompt?,
//!   createdAt, messages: [{role, content, timestamp, tool_calls?, tool_call_id?, reasoning?}]}`,
//!   or its export file `{"source": "llmspy", "threads": [thread]}` with exactly one thread.
//!   Timestamps are epoch milliseconds, epoch seconds, RFC 3339 or `YYYY-MM-DD HH:MM:SS` (UTC);
//!   in-flight messages (`streaming: true`) are left out.
//!
//! Message rules ([`messages`], after the projection rules of `provider::projection`): roles are
//! `system|developer|user|assistant|tool`; content is a string, null or an array of parts (objects
//! with a `type`); only assistant messages carry tool calls (`id`, `function.name`, arguments as
//! JSON text — an object is serialised); a call id used twice in one document is refused. A tool
//! result is kept when it answers a call of the assistant message right before its block of
//! results; any other result (no such call, a call further back, a second result for a call, or
//! no `tool_call_id`) is turned into context: a user message `[tool result for <id>]: <text>`,
//! reported in [`Imported::repairs`] (one found inside a block of results is placed right after
//! the block, so the tool group stays contiguous). Everything else malformed is an [`ImportError`] naming the
//! offending field (`param`, e.g. `messages[3].tool_calls[0].id`).

use std::collections::HashSet;

use chrono::{DateTime, NaiveDateTime, TimeZone, Utc};
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::messages::{NewMessage, role};

/// `format` of agentloop's own export document.
pub const AGENTLOOP_FORMAT: &str = "agentloop.thread.v1";
/// Detected format names ([`Imported::format`]).
pub const OPENAI_FORMAT: &str = "openai";
/// ServiceStack llms.py / AI.Chat.
pub const LLMSPY_FORMAT: &str = "llmspy";

/// Longest derived title, in characters.
const DERIVED_TITLE_CHARS: usize = 80;
/// Longest accepted title, in characters (the thread API's bound).
const MAX_TITLE_CHARS: usize = 500;

/// Bounds of one document.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Messages per document.
    pub max_messages: usize,
    /// Stored bytes of one message (content, tool calls and reasoning as JSON text).
    pub max_message_bytes: usize,
}

/// A malformed document: 400 with `param` (the JSON path of the offending value) and a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{param}: {message}")]
pub struct ImportError {
    /// Stable code: `invalid_import`, `unsupported_format`, `too_many_messages`,
    /// `message_too_large`, `duplicate_tool_call_id`, `invalid_title`.
    pub code: &'static str,
    pub param: String,
    pub message: String,
}

fn err(code: &'static str, param: impl Into<String>, message: impl Into<String>) -> ImportError {
    ImportError { code, param: param.into(), message: message.into() }
}

fn invalid(param: impl Into<String>, message: impl Into<String>) -> ImportError {
    err("invalid_import", param, message)
}

/// A change made to keep history valid (reported to the caller).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Repair {
    /// Index of the message in the source document.
    pub index: usize,
    /// `tool_result_to_context` | `dropped_streaming` | `model_dropped` | `metadata_key_dropped`.
    pub action: &'static str,
    pub reason: String,
}

/// One message to import.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportedMessage {
    pub message: NewMessage,
    /// The source's time (ms since the epoch), if it had one.
    pub timestamp_ms: Option<i64>,
}

/// A normalised document.
#[derive(Debug, Clone, PartialEq)]
pub struct Imported {
    /// [`AGENTLOOP_FORMAT`], [`OPENAI_FORMAT`] or [`LLMSPY_FORMAT`].
    pub format: &'static str,
    pub title: Option<String>,
    pub model: Option<String>,
    /// Always an object.
    pub metadata: Value,
    pub created_at: Option<DateTime<Utc>>,
    pub messages: Vec<ImportedMessage>,
    pub repairs: Vec<Repair>,
}

impl Imported {
    /// The title to store: the document's (at most 500 characters, checked by [`parse`]), else
    /// the first user text (80 characters), else `Imported conversation`.
    pub fn title(&self) -> String {
        if let Some(t) = self.title.as_deref().map(str::trim).filter(|t| !t.is_empty()) {
            return t.to_owned();
        }
        self.messages
            .iter()
            .find(|m| m.message.role == role::USER)
            .map(|m| crate::messages::content_text(&m.message.content).split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|t| !t.is_empty())
            .map(|t| t.chars().take(DERIVED_TITLE_CHARS).collect())
            .unwrap_or_else(|| "Imported conversation".to_owned())
    }

    /// Every message's time identity (ms), filled where the source had none: from the nearest
    /// known time before (+1 ms per row), else the first known time after (-1 ms per row), else
    /// counting back from `now_ms`. A time after `now_ms` counts as `now_ms` (a document cannot
    /// date messages in the future: later turns would all be stamped after it). The step
    /// function then makes them strictly increasing.
    pub fn timestamps(&self, now_ms: i64) -> Vec<i64> {
        let n = self.messages.len();
        let known: Vec<Option<i64>> = self.messages.iter().map(|m| m.timestamp_ms.map(|t| t.min(now_ms))).collect();
        let Some(first) = known.iter().position(Option::is_some) else {
            return (0..n).map(|i| now_ms - (n - i) as i64).collect();
        };
        let mut out = Vec::with_capacity(n);
        let anchor = known[first].unwrap_or(now_ms);
        for i in 0..first {
            out.push(anchor - (first - i) as i64);
        }
        let mut last = anchor;
        for k in &known[first..] {
            last = match k {
                Some(t) => *t,
                None => last + 1,
            };
            out.push(last);
        }
        out
    }
}

/// Recognises and normalises a document (see the module docs).
///
/// Errors: [`ImportError`] with the codes listed there, and `invalid_title` for a title over
/// 500 characters (the thread API's bound: refused, never cut).
pub fn parse(doc: &Value, limits: &Limits) -> Result<Imported, ImportError> {
    let mut imported = parse_document(doc, limits)?;
    // A thread cannot have been created in the future either.
    imported.created_at = imported.created_at.map(|t| t.min(chrono::Utc::now()));
    if imported.title.as_deref().is_some_and(|t| t.trim().chars().count() > MAX_TITLE_CHARS) {
        return Err(err("invalid_title", "title", format!("title is limited to {MAX_TITLE_CHARS} characters")));
    }
    Ok(imported)
}

fn parse_document(doc: &Value, limits: &Limits) -> Result<Imported, ImportError> {
    match doc {
        Value::Array(items) => from_openai(None, items, limits),
        Value::Object(obj) => {
            match obj.get("format") {
                Some(Value::String(f)) if f == AGENTLOOP_FORMAT => return from_agentloop(obj, limits),
                Some(Value::String(f)) if f == OPENAI_FORMAT => return openai_object(obj, limits),
                Some(Value::String(f)) if f == LLMSPY_FORMAT => return from_llmspy_doc(obj, limits),
                Some(Value::String(f)) => {
                    return Err(err(
                        "unsupported_format",
                        "format",
                        format!("format '{f}' is not supported (agentloop.thread.v1, openai or llmspy)"),
                    ));
                }
                Some(_) => return Err(invalid("format", "format must be a string")),
                None => {}
            }
            if obj.contains_key("threads") || obj.get("source").and_then(Value::as_str) == Some("llmspy") {
                return from_llmspy_doc(obj, limits);
            }
            let Some(Value::Array(items)) = obj.get("messages") else {
                return Err(invalid(
                    "messages",
                    "expected an agentloop export (format agentloop.thread.v1), an OpenAI messages array or {messages}, \
                     or a ServiceStack llms.py thread",
                ));
            };
            let llmspy = ["createdAt", "systemPrompt", "id", "updatedAt"].iter().any(|k| obj.contains_key(*k))
                || items.iter().any(|m| m.get("timestamp").is_some());
            if llmspy { from_llmspy_thread(obj, "", limits) } else { openai_object(obj, limits) }
        }
        _ => Err(invalid("", "the document must be a JSON object or an array of messages")),
    }
}

fn openai_object(obj: &Map<String, Value>, limits: &Limits) -> Result<Imported, ImportError> {
    let Some(Value::Array(items)) = obj.get("messages") else {
        return Err(invalid("messages", "messages must be an array"));
    };
    let mut imported = from_openai(Some(obj), items, limits)?;
    imported.created_at = match obj.get("createdAt") {
        Some(v) => Some(time_of(v).ok_or_else(|| invalid("createdAt", "not a timestamp"))?.1),
        None => None,
    };
    Ok(imported)
}

fn string_field(obj: Option<&Map<String, Value>>, key: &str, param: &str) -> Result<Option<String>, ImportError> {
    match obj.and_then(|o| o.get(key)) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(invalid(param, format!("{key} must be a string"))),
    }
}

fn metadata_field(obj: Option<&Map<String, Value>>, param: &str) -> Result<Value, ImportError> {
    match obj.and_then(|o| o.get("metadata")) {
        None | Some(Value::Null) => Ok(json!({})),
        Some(v @ Value::Object(_)) => Ok(v.clone()),
        Some(_) => Err(invalid(param, "metadata must be an object")),
    }
}

fn from_openai(obj: Option<&Map<String, Value>>, items: &[Value], limits: &Limits) -> Result<Imported, ImportError> {
    let (messages, repairs) = messages(items, "messages", limits)?;
    Ok(Imported {
        format: OPENAI_FORMAT,
        title: string_field(obj, "title", "title")?,
        model: string_field(obj, "model", "model")?,
        metadata: metadata_field(obj, "metadata")?,
        created_at: None,
        messages,
        repairs,
    })
}

fn from_agentloop(obj: &Map<String, Value>, limits: &Limits) -> Result<Imported, ImportError> {
    let thread = match obj.get("thread") {
        Some(Value::Object(t)) => Some(t),
        None | Some(Value::Null) => None,
        Some(_) => return Err(invalid("thread", "thread must be an object")),
    };
    let Some(Value::Array(items)) = obj.get("messages") else {
        return Err(invalid("messages", "messages must be an array"));
    };
    // An export of an empty thread has no messages, and must round-trip all the same.
    let (messages, repairs) = if items.is_empty() { (Vec::new(), Vec::new()) } else { messages(items, "messages", limits)? };
    let created_at = match thread.and_then(|t| t.get("createdAt")) {
        None | Some(Value::Null) => None,
        Some(v) => Some(time_of(v).ok_or_else(|| invalid("thread.createdAt", "not a timestamp"))?.1),
    };
    Ok(Imported {
        format: AGENTLOOP_FORMAT,
        title: string_field(thread, "title", "thread.title")?,
        model: string_field(thread, "model", "thread.model")?,
        metadata: metadata_field(thread, "thread.metadata")?,
        created_at,
        messages,
        repairs,
    })
}

fn from_llmspy_doc(obj: &Map<String, Value>, limits: &Limits) -> Result<Imported, ImportError> {
    match obj.get("threads") {
        Some(Value::Array(threads)) if threads.len() == 1 => match &threads[0] {
            Value::Object(t) => from_llmspy_thread(t, "threads[0].", limits),
            _ => Err(invalid("threads[0]", "a thread must be an object")),
        },
        Some(Value::Array(threads)) => Err(invalid(
            "threads",
            format!("the export holds {} threads; import them one at a time (one thread per request)", threads.len()),
        )),
        Some(_) => Err(invalid("threads", "threads must be an array")),
        None => from_llmspy_thread(obj, "", limits),
    }
}

fn from_llmspy_thread(obj: &Map<String, Value>, prefix: &str, limits: &Limits) -> Result<Imported, ImportError> {
    let Some(Value::Array(items)) = obj.get("messages") else {
        return Err(invalid(format!("{prefix}messages"), "messages must be an array"));
    };
    let mut kept = Vec::with_capacity(items.len());
    let mut dropped = Vec::new();
    for (i, m) in items.iter().enumerate() {
        if m.get("streaming").and_then(Value::as_bool) == Some(true) {
            dropped.push(Repair { index: i, action: "dropped_streaming", reason: "an in-flight (streaming) message".into() });
        } else {
            kept.push(m.clone());
        }
    }
    let system_prompt = string_field(Some(obj), "systemPrompt", &format!("{prefix}systemPrompt"))?.filter(|s| !s.trim().is_empty());
    if let Some(prompt) = system_prompt {
        let first_is_it = kept.first().is_some_and(|m| {
            m.get("role").and_then(Value::as_str) == Some(role::SYSTEM) && m.get("content").and_then(Value::as_str) == Some(prompt.as_str())
        });
        if !first_is_it {
            kept.insert(0, json!({"role": role::SYSTEM, "content": prompt}));
        }
    }
    let (messages, mut repairs) = messages(&kept, &format!("{prefix}messages"), limits)?;
    repairs.extend(dropped);
    let created_at = match obj.get("createdAt") {
        None | Some(Value::Null) => None,
        Some(v) => Some(time_of(v).ok_or_else(|| invalid(format!("{prefix}createdAt"), "not a timestamp"))?.1),
    };
    Ok(Imported {
        format: LLMSPY_FORMAT,
        title: string_field(Some(obj), "title", &format!("{prefix}title"))?,
        model: string_field(Some(obj), "model", &format!("{prefix}model"))?,
        metadata: metadata_field(Some(obj), &format!("{prefix}metadata"))?,
        created_at,
        messages,
        repairs,
    })
}

/// A time value: epoch ms (≥ 10^11), epoch seconds (integer or float), RFC 3339, or
/// `YYYY-MM-DD HH:MM:SS[.fff]` / `YYYY-MM-DDTHH:MM:SS[.fff]` without a zone (UTC), in years
/// 1..=9999 (what PostgreSQL's `timestamptz` holds: a time outside it was a 500 from the
/// database instead of a 400). Returns (ms, time).
pub fn time_of(value: &Value) -> Option<(i64, DateTime<Utc>)> {
    parse_time(value).filter(|(_, at)| crate::text::storable_time(at))
}

fn parse_time(value: &Value) -> Option<(i64, DateTime<Utc>)> {
    let at = match value {
        Value::Number(n) => {
            let f = n.as_f64()?;
            let ms = if f.abs() >= 1e11 { f } else { f * 1000.0 };
            Utc.timestamp_millis_opt(ms.round() as i64).single()?
        }
        Value::String(s) => {
            let s = s.trim();
            if let Ok(t) = DateTime::parse_from_rfc3339(s) {
                t.with_timezone(&Utc)
            } else if let Ok(n) = s.parse::<f64>() {
                return parse_time(&json!(n));
            } else {
                let naive = NaiveDateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.f")
                    .or_else(|_| NaiveDateTime::parse_from_str(s, "%Y-%m-%dT%H:%M:%S%.f"))
                    .ok()?;
                Utc.from_utc_datetime(&naive)
            }
        }
        _ => return None,
    };
    Some((at.timestamp_millis(), at))
}

const ROLES: [&str; 5] = [role::SYSTEM, role::DEVELOPER, role::USER, role::ASSISTANT, role::TOOL];

fn field<'a>(m: &'a Map<String, Value>, names: &[&str]) -> Option<(&'a str, &'a Value)> {
    names.iter().find_map(|n| m.get_key_value(*n).filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.as_str(), v)))
}

/// Validates and converts chat messages (see the module docs): OpenAI and llms.py field names
/// (`tool_calls`, `tool_call_id`, `reasoning_content`, `timestamp`) and agentloop's
/// (`toolCalls`, `toolCallId`, `reasoning`, `createdAt`) alike. `param` names the array in
/// errors (`messages`).
pub fn messages(items: &[Value], param: &str, limits: &Limits) -> Result<(Vec<ImportedMessage>, Vec<Repair>), ImportError> {
    if items.is_empty() {
        return Err(invalid(param, "messages must not be empty"));
    }
    if items.len() > limits.max_messages {
        return Err(err("too_many_messages", param, format!("at most {} messages per document", limits.max_messages)));
    }
    let mut out = Vec::with_capacity(items.len());
    let mut repairs = Vec::new();
    let mut call_ids: HashSet<String> = HashSet::new();
    // Calls of the assistant message right before the current block of tool results that have
    // no result yet; cleared by any message that is not a tool result.
    let mut open: Vec<String> = Vec::new();
    // Results turned into context inside a block: placed after the block, so the tool group
    // stays contiguous (its later results still pair with their calls).
    let mut deferred: Vec<ImportedMessage> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("{param}[{i}]");
        let Value::Object(m) = item else { return Err(invalid(at, "a message must be an object")) };
        let r = m.get("role").and_then(Value::as_str).unwrap_or_default();
        if !ROLES.contains(&r) {
            return Err(invalid(format!("{at}.role"), "role must be system, developer, user, assistant or tool"));
        }
        let content = match m.get("content") {
            None | Some(Value::Null) => Value::Null,
            Some(v @ Value::String(_)) => v.clone(),
            Some(Value::Array(parts)) => {
                for (k, p) in parts.iter().enumerate() {
                    if p.get("type").and_then(Value::as_str).is_none() {
                        return Err(invalid(format!("{at}.content[{k}]"), "a content part must be an object with a string type"));
                    }
                }
                Value::Array(parts.clone())
            }
            Some(_) => return Err(invalid(format!("{at}.content"), "content must be a string, an array of parts, or null")),
        };
        let reasoning = match field(m, &["reasoning", "reasoning_content"]) {
            None => None,
            Some((_, Value::String(s))) => Some(s.clone()).filter(|s| !s.is_empty()),
            Some((k, _)) => return Err(invalid(format!("{at}.{k}"), "reasoning must be a string")),
        };
        let stopped = m.get("stopped").and_then(Value::as_bool).unwrap_or(false);
        // An agentloop export's mark of an answer the provider cut (`length`, ...).
        let finish_reason = match field(m, &["finishReason"]) {
            None | Some((_, Value::Null)) => None,
            Some((_, Value::String(s))) if r == role::ASSISTANT && !s.is_empty() && s.len() <= 64 => Some(s.clone()),
            Some((k, _)) => return Err(invalid(format!("{at}.{k}"), "finishReason must be a short string, on an assistant message")),
        };
        let timestamp_ms = match field(m, &["createdAt", "timestamp", "created_at"]) {
            None => None,
            Some((k, v)) => Some(time_of(v).ok_or_else(|| invalid(format!("{at}.{k}"), "not a timestamp"))?.0),
        };
        let calls = match field(m, &["toolCalls", "tool_calls"]) {
            None => None,
            Some((k, Value::Array(calls))) if r == role::ASSISTANT => {
                if calls.is_empty() {
                    None
                } else {
                    let mut wire = Vec::with_capacity(calls.len());
                    for (c, call) in calls.iter().enumerate() {
                        let cp = format!("{at}.{k}[{c}]");
                        let id = call.get("id").and_then(Value::as_str).filter(|s| !s.is_empty());
                        let Some(id) = id else { return Err(invalid(format!("{cp}.id"), "a tool call needs a non-empty string id")) };
                        if !call_ids.insert(id.to_owned()) {
                            return Err(err("duplicate_tool_call_id", format!("{cp}.id"), format!("tool call id '{id}' is used twice")));
                        }
                        let name = call.pointer("/function/name").and_then(Value::as_str).filter(|s| !s.is_empty());
                        let Some(name) = name else {
                            return Err(invalid(format!("{cp}.function.name"), "a tool call needs a function name"));
                        };
                        let arguments = match call.pointer("/function/arguments") {
                            None | Some(Value::Null) => "{}".to_owned(),
                            // Kept as given, even when not JSON: canonical history keeps a model's
                            // own malformed arguments the same way (a tool refuses them when
                            // called; the projection sends them back as text), so an export of
                            // such a thread still round-trips.
                            Some(Value::String(s)) => s.clone(),
                            Some(v @ Value::Object(_)) => v.to_string(),
                            Some(_) => return Err(invalid(format!("{cp}.function.arguments"), "arguments must be JSON text or an object")),
                        };
                        wire.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}));
                    }
                    Some(Value::Array(wire))
                }
            }
            Some((k, Value::Array(_))) => return Err(invalid(format!("{at}.{k}"), "only assistant messages carry tool calls")),
            Some((k, _)) => return Err(invalid(format!("{at}.{k}"), "tool calls must be an array")),
        };
        let mut message = NewMessage {
            role: r.to_owned(),
            content: content.clone(),
            tool_calls: calls.clone(),
            tool_call_id: None,
            reasoning,
            token_estimate: 0,
            stopped,
            finish_reason,
        };
        if r == role::TOOL {
            let id = match field(m, &["toolCallId", "tool_call_id"]) {
                None => None,
                Some((_, Value::String(s))) if !s.is_empty() => Some(s.clone()),
                Some((k, _)) => return Err(invalid(format!("{at}.{k}"), "tool_call_id must be a non-empty string")),
            };
            match id {
                Some(id) if open.contains(&id) => {
                    open.retain(|o| *o != id);
                    message.tool_call_id = Some(id);
                }
                other => {
                    let label = match &other {
                        Some(id) => format!("[tool result for {id}]:"),
                        None => "[tool result]:".to_owned(),
                    };
                    message.role = role::USER.to_owned();
                    message.content = match content {
                        Value::Array(mut parts) => {
                            parts.insert(0, json!({"type": "text", "text": label}));
                            Value::Array(parts)
                        }
                        other_content => Value::String(format!("{label} {}", crate::messages::content_text(&other_content))),
                    };
                    let reason = match other {
                        Some(id) => format!("tool result for '{id}' does not follow a call with that id"),
                        None => "tool result without a tool_call_id".to_owned(),
                    };
                    repairs.push(Repair { index: i, action: "tool_result_to_context", reason });
                }
            }
        } else {
            out.append(&mut deferred);
            open = crate::messages::tool_calls_of(calls.as_ref()).into_iter().map(|c| c.id).collect();
        }
        if message.content.is_null() && message.tool_calls.is_none() {
            message.content = Value::String(String::new());
        }
        message.token_estimate = crate::tokens::estimate_message(&message.content, message.tool_calls.as_ref()) as i32
            + message.reasoning.as_deref().map_or(0, crate::tokens::estimate_text) as i32;
        if message.byte_size() > limits.max_message_bytes {
            return Err(err("message_too_large", at, format!("a message is limited to {} bytes", limits.max_message_bytes)));
        }
        let imported = ImportedMessage { message, timestamp_ms };
        if r == role::TOOL && imported.message.role != role::TOOL && !open.is_empty() {
            deferred.push(imported);
        } else {
            out.push(imported);
        }
    }
    out.append(&mut deferred);
    Ok((out, repairs))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits { max_messages: 100, max_message_bytes: 10_000 };

    fn call(id: &str) -> Value {
        json!({"id": id, "type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+1"}}})
    }

    #[test]
    fn times_from_the_future_count_as_now() {
        let doc = json!({"format": "agentloop.thread.v1", "thread": {"createdAt": "9999-12-31T23:59:59Z"},
                         "messages": [{"role": "user", "content": "hi", "createdAt": "9999-12-31T23:59:59Z"},
                                      {"role": "assistant", "content": "yo"}]});
        let imported = parse(&doc, &LIMITS).unwrap();
        assert!(imported.created_at.unwrap() <= chrono::Utc::now());
        assert_eq!(imported.timestamps(1_000), vec![1_000, 1_001]);
    }

    #[test]
    fn a_title_over_the_bound_is_refused_not_cut() {
        let long = "t".repeat(MAX_TITLE_CHARS + 1);
        let e = parse(&json!({"title": long, "messages": [{"role": "user", "content": "hi"}]}), &LIMITS).unwrap_err();
        assert_eq!((e.code, e.param.as_str()), ("invalid_title", "title"));
        let fits = "t".repeat(MAX_TITLE_CHARS);
        let ok = parse(&json!({"title": fits.clone(), "messages": [{"role": "user", "content": "hi"}]}), &LIMITS).unwrap();
        assert_eq!(ok.title(), fits);
    }

    #[test]
    fn openai_messages_keep_answered_calls_and_turn_orphans_into_context() {
        let doc = json!({"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "add"},
            {"role": "assistant", "content": null, "tool_calls": [call("a"), call("b")]},
            {"role": "tool", "tool_call_id": "a", "content": "2"},
            {"role": "tool", "tool_call_id": "a", "content": "dup"},
            {"role": "tool", "tool_call_id": "b", "content": "2"},
            {"role": "user", "content": "again"},
            {"role": "tool", "tool_call_id": "b", "content": "late"},
            {"role": "tool", "content": "no id"},
        ]});
        let imported = parse(&doc, &LIMITS).unwrap();
        assert_eq!(imported.format, OPENAI_FORMAT);
        let roles: Vec<&str> = imported.messages.iter().map(|m| m.message.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "tool", "user", "user", "user", "user"]);
        assert_eq!(imported.messages[2].message.tool_calls.as_ref().unwrap()[0]["function"]["arguments"], "{\"expression\":\"1+1\"}");
        assert_eq!(imported.messages[4].message.tool_call_id.as_deref(), Some("b"), "the group stays whole");
        assert_eq!(imported.messages[5].message.content, "[tool result for a]: dup", "moved after the group");
        assert_eq!(imported.messages[7].message.content, "[tool result for b]: late");
        assert_eq!(imported.messages[8].message.content, "[tool result]: no id");
        let repaired: Vec<usize> = imported.repairs.iter().map(|r| r.index).collect();
        assert_eq!(repaired, [4, 7, 8]);
        assert_eq!(imported.title(), "add");
    }

    #[test]
    fn malformed_documents_name_the_offending_field() {
        let cases = [
            (json!({"messages": []}), "messages"),
            (json!({"messages": [{"role": "wizard", "content": "x"}]}), "messages[0].role"),
            (json!({"messages": [{"role": "user", "content": 5}]}), "messages[0].content"),
            (json!({"messages": [{"role": "user", "content": [{"text": "x"}]}]}), "messages[0].content[0]"),
            (json!({"messages": [{"role": "user", "content": "x", "tool_calls": [call("a")]}]}), "messages[0].tool_calls"),
            (json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "", "function": {"name": "f"}}]}]}), "messages[0].tool_calls[0].id"),
            (json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "x", "function": {}}]}]}), "messages[0].tool_calls[0].function.name"),
            (json!({"messages": [{"role": "assistant", "tool_calls": [call("a")]}, {"role": "assistant", "tool_calls": [call("a")]}]}), "messages[1].tool_calls[0].id"),
            (json!({"messages": [{"role": "user", "content": "x", "timestamp": "yesterday"}]}), "messages[0].timestamp"),
            (json!({"format": "agentloop.thread.v1", "thread": {"createdAt": "x"}, "messages": [{"role": "user", "content": "x"}]}), "thread.createdAt"),
            // Outside PostgreSQL's timestamps (years 1..=9999).
            (json!({"messages": [{"role": "user", "content": "x", "timestamp": 253402300800000i64}]}), "messages[0].timestamp"),
            (json!({"messages": [{"role": "user", "content": "x", "timestamp": -62135596800001i64}]}), "messages[0].timestamp"),
            (json!({"format": "agentloop.thread.v1", "thread": {"createdAt": "0000-01-01T00:00:00Z"}, "messages": [{"role": "user", "content": "x"}]}), "thread.createdAt"),
            (json!({"messages": [{"role": "user", "content": "x", "createdAt": "0000-01-01T00:00:00Z"}]}), "messages[0].createdAt"),
            (json!({"format": "nope"}), "format"),
            (json!({"threads": [{"messages": []}, {"messages": []}]}), "threads"),
            (json!("text"), ""),
        ];
        for (doc, param) in cases {
            let e = parse(&doc, &LIMITS).unwrap_err();
            assert_eq!(e.param, param, "{doc}: {e:?}");
        }
        let many = Value::Array(vec![json!({"role": "user", "content": "x"}); 101]);
        assert_eq!(parse(&many, &LIMITS).unwrap_err().code, "too_many_messages");
        let big = json!([{"role": "user", "content": "x".repeat(10_001)}]);
        assert_eq!(parse(&big, &LIMITS).unwrap_err().code, "message_too_large");
    }

    #[test]
    fn llmspy_threads_and_exports_are_recognised() {
        let thread = json!({
            "id": 1765794035123i64, "title": "Capitals", "model": "gpt-4o", "systemPrompt": "You are terse.",
            "createdAt": "2025-12-31T05:41:46.686Z",
            "messages": [
                {"id": 1, "role": "user", "content": "Capital of France?", "timestamp": 1767159706686i64},
                {"id": 2, "role": "assistant", "content": "Paris.", "reasoning": "easy", "timestamp": "2025-12-31 05:41:50"},
                {"id": 3, "role": "assistant", "content": "Par", "streaming": true, "timestamp": 1767159710001i64},
            ]
        });
        let imported = parse(&thread, &LIMITS).unwrap();
        assert_eq!(imported.format, LLMSPY_FORMAT);
        assert_eq!(imported.messages.len(), 3, "system prompt + 2; the streaming one dropped");
        assert_eq!(imported.messages[0].message.role, "system");
        assert_eq!(imported.messages[2].message.reasoning.as_deref(), Some("easy"));
        assert_eq!(imported.messages[1].timestamp_ms, Some(1767159706686));
        assert_eq!(imported.messages[2].timestamp_ms, Some(1767159710000));
        assert_eq!(imported.created_at.unwrap().timestamp_millis(), 1767159706686);
        assert_eq!(imported.repairs[0].action, "dropped_streaming");
        let export = json!({"exportedAt": "2026-01-01T00:00:00Z", "version": "1.0", "source": "llmspy", "threadCount": 1, "threads": [thread]});
        assert_eq!(parse(&export, &LIMITS).unwrap().messages, imported.messages);
    }

    #[test]
    fn missing_times_are_filled_from_their_neighbours() {
        let doc = json!([
            {"role": "user", "content": "a"},
            {"role": "user", "content": "b", "timestamp": 1000000000000i64},
            {"role": "user", "content": "c"},
            {"role": "user", "content": "d", "timestamp": 1000000000000i64},
        ]);
        let imported = parse(&doc, &LIMITS).unwrap();
        assert_eq!(imported.timestamps(2_000_000_000_000), [999999999999, 1000000000000, 1000000000001, 1000000000000]);
        let none = parse(&json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]), &LIMITS).unwrap();
        assert_eq!(none.timestamps(100), [98, 99]);
    }
}
