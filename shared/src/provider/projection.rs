//! Provider projection: the model context turned into the outbound Chat Completions `messages`
//! array for one model (SPEC §9; seed "Provider compatibility", "Representations and
//! invariants" 4).
//!
//! [`project_for`] is pure: it reads a slice of canonical [`ContextMessage`]s and returns a new
//! `Vec<Value>`; every repair happens on the copy, so checkpoint identities and canonical history
//! are never touched. Each output message has the shape
//! `{"role", "content", "tool_calls"?, "tool_call_id"?, "reasoning_content"?}` and nothing else
//! (canonical messages carry no `name`, so none is sent). [`validate`] checks a payload against
//! the invariants the families' providers enforce; every output of [`project_for`] passes it.
//!
//! Steps, in order:
//! 1. **Strip** — only the fields above are copied; the compaction [`SUMMARY_MARKER`] is
//!    removed from all text. Unknown roles are sent as `user`.
//! 2. **Modalities** — a part the model cannot take becomes a text placeholder
//!    (`[image omitted: image/png]`, `[audio omitted: wav]`, `[file omitted: a.pdf]`); a text-only
//!    model (no `image`, `audio` or `file` in `input_modalities`) gets one string per message,
//!    parts joined by `"\n"`. Tool resources (`{"type":"resource","resource":{"uri"}}`, the MCP
//!    embedded-resource shape) are not a Chat Completions part at all and always become
//!    `[resource omitted: <uri>]`.
//! 3. **Tool exchanges** (every family; seed: "assistant tool calls and their contiguous tool
//!    results are an atomic logical group") — see [`project_for`].
//! 4. **GLM** and 5. **Mistral** repairs — see [`project_for`].
//! 6. **Reasoning** — see [`reasoning_field`].
//! 7. **Assistant content** — `null` when the message has tool calls and blank text
//!    (OpenAI's documented shape: content is "required unless tool_calls is specified"),
//!    otherwise a string (assistant parts are flattened as for a text-only model).

use std::collections::{HashMap, HashSet, VecDeque};

use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::catalog::{ModelConfig, ModelFamily};
use crate::context::ContextMessage;
use crate::messages::role::{ASSISTANT, DEVELOPER, SYSTEM, TOOL, USER};

/// Marker that starts the text of a compaction summary message (`system` or `user`). Internal:
/// it never reaches a provider.
pub const SUMMARY_MARKER: &str = "<!--agentloop:summary-->";
/// Neutral user turn appended (or, for GLM, put first) when the history would otherwise end
/// (or start) with an assistant turn.
pub const CONTINUE_TEXT: &str = "Continue.";
/// Content of the synthetic tool result answering a call whose result was never recorded.
pub const NO_RESULT_TEXT: &str = "[no result recorded]";
/// Appended to the text of an assistant answer the user stopped mid-stream.
pub const STOPPED_NOTE: &str = "\n\n[interrupted: the user stopped this answer before it was finished]";
/// Appended to the text of an assistant answer the provider ended early with `reason` (its
/// `finish_reason`: `length` when it reached `max_tokens` or the end of the context).
pub fn cut_note(reason: &str) -> String {
    format!("\n\n[cut off: this answer ended before it was finished (finish_reason: {reason})]")
}
/// Mistral bridge: assistant turn inserted between a tool result and a following user turn.
pub const TOOL_RESULTS_RECEIVED_TEXT: &str = "Tool results received.";

/// A payload that breaks a provider invariant: `index` is the offending message (the payload
/// length for "missing at the end" errors).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("message {index}: {reason}")]
pub struct InvalidPayload {
    pub index: usize,
    pub reason: String,
}

/// Field that carries an assistant message's reasoning back to the provider, if any.
///
/// - `Glm` → `reasoning_content`: Zhipu/Z.ai return thinking as `message.reasoning_content` and
///   document sending it back in history ("preserved thinking", GLM-4.5 and later).
/// - `Llama`, `Other` → `reasoning_content`: the DeepSeek-style field that llama.cpp
///   (`--reasoning-format deepseek`), vLLM reasoning parsers and DeepSeek's API use; servers
///   that do not know it ignore it.
/// - `OpenAi` → none: Chat Completions has no input field for reasoning (it stays server-side)
///   and strict clones reject unknown fields.
/// - `Mistral` → none: mistral-common's `AssistantMessage` has no such field.
pub fn reasoning_field(family: ModelFamily) -> Option<&'static str> {
    match family {
        ModelFamily::Glm | ModelFamily::Llama | ModelFamily::Other => Some("reasoning_content"),
        ModelFamily::OpenAi | ModelFamily::Mistral => None,
    }
}

/// Whether the model takes only text: its `input_modalities` name none of `image`, `audio`,
/// `file`.
pub fn is_text_only(model: &ModelConfig) -> bool {
    let m = Modalities::of(model);
    !(m.image || m.audio || m.file)
}

/// Projects the context into the outbound `messages` array for `model` (steps in the module
/// doc). The input is only read.
///
/// Tool exchanges, every family: only well-formed calls (string `id`, `function.name`) are
/// sent; a call id already used earlier in the payload is dropped with the result that follows
/// it; each assistant message with calls is followed immediately by exactly one `tool` message
/// per call, in call order (a result is matched to the nearest preceding call with its id and
/// moved there; a missing one becomes `{"role":"tool","tool_call_id":id,"content":
/// "[no result recorded]"}`); a result matching no preceding call becomes a `user` message
/// `"[tool result for <id>]: <content>"`; an assistant message left without calls keeps its
/// prose, or is dropped if it has none. `developer` is sent as `system` except to `OpenAi`.
///
/// `Glm` (SPEC §9 "strict providers"): all `system`/`developer` text merged (`"\n\n"`) into one
/// leading `system` message; a leading plain assistant folded into it as
/// `"Previous assistant context: <text>"`; adjacent `user` messages, and adjacent assistant
/// messages without calls, merged (`"\n\n"`); a `"Continue."` user turn put before a leading
/// assistant tool call and after a final assistant message.
///
/// `Mistral` (mistral-common `validator.py`, `MistralRequestValidatorV3`/`V5`): system text
/// merged into one leading message (the role order forbids `system` after `assistant`/`tool`);
/// assistant messages with neither text nor calls dropped; call ids mapped to 9 characters
/// `[a-zA-Z0-9]` (ids already of that shape kept, others derived from a SHA-256 of the id, with
/// collisions re-hashed); `{"role":"assistant","content":"Tool results received."}` inserted
/// where a `user` turn would follow a `tool` result; `"Continue."` appended after a final
/// assistant message ("Expected last role User or Tool").
pub fn project_for(model: &ModelConfig, context: &[ContextMessage]) -> Vec<Value> {
    let modalities = Modalities::of(model);
    let messages = context.iter().map(|c| strip(c, modalities)).collect();
    let messages = repair_tool_exchanges(messages);
    let messages = match model.family {
        ModelFamily::Glm => glm(messages),
        ModelFamily::Mistral => mistral(messages),
        _ => messages,
    };
    messages.iter().map(|m| render(m, model.family)).collect()
}

/// Checks the invariants a `family` provider enforces on `messages` (an empty payload passes).
///
/// Every family: only the fields [`project_for`] emits; known roles (`developer` only for
/// `OpenAi`); `user`/`system`/`tool` content a string or an array; assistant content a string,
/// or `null` with tool calls; calls well-formed (`id`, `type:"function"`, `function.name`,
/// string `arguments`) with ids unique in the payload; each call group followed at once by one
/// `tool` message per call in call order, and no other `tool` message.
/// `Glm`: one `system` message, first; then a `user`; no adjacent `user`s nor adjacent
/// assistants without calls; not ending with an assistant.
/// `Mistral`: mistral-common's role order (after `tool` only `assistant`/`tool`; `system` not
/// after `assistant`), call ids `^[a-zA-Z0-9]{9}$`, assistant text or calls, not ending with an
/// assistant, a single message `user` or `system`.
pub fn validate(family: ModelFamily, messages: &[Value]) -> Result<(), InvalidPayload> {
    let fail = |index: usize, reason: String| Err(InvalidPayload { index, reason });
    let reasoning = reasoning_field(family);
    let mut ids = HashSet::new();
    let mut pending: VecDeque<&str> = VecDeque::new();
    for (i, m) in messages.iter().enumerate() {
        let Some(obj) = m.as_object() else {
            return fail(i, "not an object".into());
        };
        if let Some(key) = obj.keys().find(|k| {
            !["role", "content", "tool_calls", "tool_call_id", "name"].contains(&k.as_str())
                && Some(k.as_str()) != reasoning
        }) {
            return fail(i, format!("field {key} is not sent to this family"));
        }
        let role = m["role"].as_str().unwrap_or_default();
        let calls = m.get("tool_calls").filter(|c| !c.is_null());
        if calls.is_some() && role != ASSISTANT {
            return fail(i, format!("tool_calls on a {role} message"));
        }
        if m.get("tool_call_id").is_some() && role != TOOL {
            return fail(i, format!("tool_call_id on a {role} message"));
        }
        if role == TOOL {
            let id = m["tool_call_id"].as_str().unwrap_or_default();
            match pending.pop_front() {
                Some(expected) if expected == id => {}
                Some(expected) => {
                    return fail(i, format!("tool result {id} where {expected} is expected"));
                }
                None => {
                    return fail(
                        i,
                        format!("tool result {id} answers no call of the preceding group"),
                    );
                }
            }
        } else if let Some(expected) = pending.front() {
            return fail(
                i,
                format!("call {expected} unanswered before a {role} message"),
            );
        }
        match role {
            ASSISTANT => {
                let content = &m["content"];
                if !(content.is_string() || (content.is_null() && calls.is_some())) {
                    return fail(
                        i,
                        "assistant content must be a string (null only with tool calls)".into(),
                    );
                }
                if let Some(calls) = calls {
                    let Some(calls) = calls.as_array().filter(|c| !c.is_empty()) else {
                        return fail(i, "tool_calls must be a non-empty array".into());
                    };
                    for call in calls {
                        let id = call["id"].as_str().filter(|s| !s.is_empty());
                        let Some(id) = id else {
                            return fail(i, "tool call without id".into());
                        };
                        if call["type"] != "function"
                            || call["function"]["name"].as_str().is_none_or(str::is_empty)
                            || !call["function"]["arguments"].is_string()
                        {
                            return fail(i, format!("malformed tool call {id}"));
                        }
                        if !ids.insert(id) {
                            return fail(i, format!("duplicate tool call id {id}"));
                        }
                        pending.push_back(id);
                    }
                }
            }
            SYSTEM | USER | TOOL => {}
            DEVELOPER if family == ModelFamily::OpenAi => {}
            other => return fail(i, format!("role {other:?} is not sent to this family")),
        }
        if role != ASSISTANT && !(m["content"].is_string() || m["content"].is_array()) {
            return fail(i, format!("{role} content must be a string or an array"));
        }
    }
    if let Some(expected) = pending.front() {
        return fail(
            messages.len(),
            format!("call {expected} unanswered at the end"),
        );
    }
    let role_of = |i: usize| messages[i]["role"].as_str().unwrap_or_default();
    let plain_assistant =
        |i: usize| role_of(i) == ASSISTANT && messages[i].get("tool_calls").is_none();
    let last = messages.len().wrapping_sub(1);
    match family {
        ModelFamily::Glm => {
            for i in 0..messages.len() {
                if role_of(i) == SYSTEM && i > 0 {
                    return fail(i, "system message after the first position".into());
                }
                let first_turn = i == usize::from(role_of(0) == SYSTEM);
                if first_turn && role_of(i) != USER {
                    return fail(
                        i,
                        "the first non-system message must be a user message".into(),
                    );
                }
                if i > 0
                    && ((role_of(i) == USER && role_of(i - 1) == USER)
                        || (plain_assistant(i) && plain_assistant(i - 1)))
                {
                    return fail(i, format!("adjacent {} messages", role_of(i)));
                }
            }
            if !messages.is_empty() && role_of(last) == ASSISTANT {
                return fail(last, "the payload ends with an assistant message".into());
            }
        }
        ModelFamily::Mistral => {
            for (i, m) in messages.iter().enumerate() {
                let role = role_of(i);
                if i > 0 {
                    let allowed: &[&str] = match role_of(i - 1) {
                        TOOL => &[ASSISTANT, TOOL],
                        ASSISTANT => &[ASSISTANT, USER, TOOL],
                        _ => &[USER, ASSISTANT, SYSTEM],
                    };
                    if !allowed.contains(&role) {
                        return fail(
                            i,
                            format!("unexpected role {role} after {}", role_of(i - 1)),
                        );
                    }
                }
                let ids = m["tool_calls"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|c| &c["id"]);
                for id in ids.chain((role == TOOL).then_some(&m["tool_call_id"])) {
                    if !id.as_str().is_some_and(is_mistral_id) {
                        return fail(
                            i,
                            format!("tool call id {id} is not 9 characters [a-zA-Z0-9]"),
                        );
                    }
                }
                if plain_assistant(i) && m["content"].as_str().is_none_or(|t| t.trim().is_empty()) {
                    return fail(
                        i,
                        "assistant message with neither content nor tool calls".into(),
                    );
                }
            }
            if messages.len() == 1 && ![USER, SYSTEM].contains(&role_of(0)) {
                return fail(0, "a single message must be user or system".into());
            }
            if !messages.is_empty() && role_of(last) == ASSISTANT {
                return fail(last, "the payload ends with an assistant message".into());
            }
        }
        _ => {}
    }
    Ok(())
}

/// A well-formed tool call, re-serialized as `{id, type:"function", function:{name, arguments}}`.
#[derive(Debug, Clone)]
struct Call {
    id: String,
    name: String,
    arguments: String,
}

/// The working copy of one message.
#[derive(Debug, Clone)]
struct Msg {
    role: &'static str,
    /// A string, an array of parts, or null.
    content: Value,
    /// Well-formed calls (assistant only).
    calls: Vec<Call>,
    /// The source carried a non-empty `tool_calls` value (so a message left without calls was a
    /// tool envelope, dropped when it has no prose).
    had_calls: bool,
    /// Correlation id (tool only).
    call_id: Option<String>,
    /// Non-blank reasoning (assistant only).
    reasoning: Option<String>,
}

impl Msg {
    fn text(role: &'static str, text: impl Into<String>) -> Self {
        Self {
            role,
            content: Value::String(text.into()),
            calls: Vec::new(),
            had_calls: false,
            call_id: None,
            reasoning: None,
        }
    }

    fn is_plain_assistant(&self) -> bool {
        self.role == ASSISTANT && self.calls.is_empty()
    }
}

#[derive(Debug, Clone, Copy)]
struct Modalities {
    image: bool,
    audio: bool,
    file: bool,
}

impl Modalities {
    fn of(model: &ModelConfig) -> Self {
        let has = |m: &str| {
            model
                .input_modalities
                .iter()
                .any(|x| x.eq_ignore_ascii_case(m))
        };
        Self {
            image: has("image"),
            audio: has("audio"),
            file: has("file"),
        }
    }
}

/// Step 1 and 2: the stripped, modality-adjusted copy of one context message.
fn strip(context: &ContextMessage, modalities: Modalities) -> Msg {
    let m = &context.message;
    let role = match m.role.as_str() {
        SYSTEM => SYSTEM,
        DEVELOPER => DEVELOPER,
        ASSISTANT => ASSISTANT,
        TOOL => TOOL,
        _ => USER,
    };
    let content = match &m.content {
        Value::Null => Value::Null,
        Value::String(s) => Value::String(strip_marker(s)),
        Value::Array(parts) => {
            let parts: Vec<Value> = parts.iter().map(|p| convert_part(p, modalities)).collect();
            if modalities.image || modalities.audio || modalities.file {
                Value::Array(parts)
            } else {
                Value::String(parts_text(&parts))
            }
        }
        other => Value::String(strip_marker(&other.to_string())),
    };
    // A stopped answer (the user cancelled it mid-stream) reads as interrupted, so the model
    // does not take it for a finished one (SPEC §4, issue 11).
    // An answer the provider cut (`length`, `content_filter`, ...) says so too, with the reason.
    let content = match content {
        Value::String(s) if m.stopped && role == ASSISTANT => Value::String(format!("{s}{STOPPED_NOTE}")),
        Value::String(s) if role == ASSISTANT && m.finish_reason.is_some() => {
            Value::String(format!("{s}{}", cut_note(m.finish_reason.as_deref().unwrap_or_default())))
        }
        other => other,
    };
    let (calls, had_calls) = match (role, &m.tool_calls) {
        (ASSISTANT, Some(Value::Array(calls))) if !calls.is_empty() => {
            (calls.iter().filter_map(parse_call).collect(), true)
        }
        (ASSISTANT, Some(v)) if !v.is_null() && !v.is_array() => (Vec::new(), true),
        _ => (Vec::new(), false),
    };
    Msg {
        role,
        content,
        calls,
        had_calls,
        call_id: m
            .tool_call_id
            .clone()
            .filter(|id| role == TOOL && !id.is_empty()),
        reasoning: m
            .reasoning
            .as_deref()
            .map(strip_marker)
            .filter(|r| role == ASSISTANT && !r.trim().is_empty()),
    }
}

/// Removes the summary marker: a leading one together with the whitespace after it, then any
/// other occurrence.
fn strip_marker(text: &str) -> String {
    let mut out = match text.trim_start().strip_prefix(SUMMARY_MARKER) {
        Some(rest) => rest.trim_start().to_owned(),
        None => text.to_owned(),
    };
    while out.contains(SUMMARY_MARKER) {
        out = out.replace(SUMMARY_MARKER, "");
    }
    out
}

fn text_part(text: &str) -> Value {
    json!({"type": "text", "text": strip_marker(text)})
}

/// One content part for a model with `modalities`: text parts are rebuilt, accepted media kept,
/// anything else replaced by a placeholder text part.
fn convert_part(part: &Value, modalities: Modalities) -> Value {
    let kind = part["type"].as_str().unwrap_or_default();
    let keep = match kind {
        "text" => return text_part(part["text"].as_str().unwrap_or_default()),
        "image_url" => modalities.image,
        "input_audio" => modalities.audio,
        "file" => modalities.file,
        _ if part.is_string() => return text_part(part.as_str().unwrap_or_default()),
        _ => false,
    };
    if keep {
        part.clone()
    } else {
        text_part(&placeholder(part))
    }
}

/// `[image omitted: image/png]`, `[audio omitted: wav]`, `[file omitted: a.pdf]`,
/// `[resource omitted: file:///x]`, `[<type> omitted]`.
fn placeholder(part: &Value) -> String {
    let short = |s: &str| s.chars().take(200).collect::<String>();
    let (what, detail) = match part["type"].as_str().unwrap_or_default() {
        "image_url" => {
            let url = part["image_url"]["url"]
                .as_str()
                .or(part["image_url"].as_str())
                .unwrap_or_default();
            let detail = match url.strip_prefix("data:") {
                Some(data) => data.split([';', ',']).next().unwrap_or_default().to_owned(),
                None => short(url),
            };
            ("image", detail)
        }
        "input_audio" => (
            "audio",
            short(part["input_audio"]["format"].as_str().unwrap_or_default()),
        ),
        "file" => {
            let file = &part["file"];
            (
                "file",
                short(
                    file["filename"]
                        .as_str()
                        .or(file["file_id"].as_str())
                        .unwrap_or_default(),
                ),
            )
        }
        "resource" => (
            "resource",
            short(part["resource"]["uri"].as_str().unwrap_or_default()),
        ),
        "" => ("attachment", String::new()),
        other => (other, String::new()),
    };
    if detail.is_empty() {
        format!("[{what} omitted]")
    } else {
        format!("[{what} omitted: {detail}]")
    }
}

/// Text of already-converted parts, joined by `"\n"`; a non-text part reads as its placeholder.
fn parts_text(parts: &[Value]) -> String {
    let text = |p: &Value| match p["type"].as_str() {
        Some("text") => p["text"].as_str().unwrap_or_default().to_owned(),
        _ => placeholder(p),
    };
    parts.iter().map(text).collect::<Vec<_>>().join("\n")
}

/// Content as one string (null reads as empty).
fn text_of(content: &Value) -> String {
    match content {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts_text(parts),
        other => other.to_string(),
    }
}

fn is_blank(content: &Value) -> bool {
    text_of(content).trim().is_empty()
}

fn parse_call(call: &Value) -> Option<Call> {
    let id = call["id"].as_str().filter(|s| !s.is_empty())?;
    let function = &call["function"];
    let name = function["name"].as_str().filter(|s| !s.is_empty())?;
    let arguments = match &function["arguments"] {
        Value::String(s) => s.clone(),
        Value::Null => "{}".to_owned(),
        other => other.to_string(),
    };
    Some(Call {
        id: id.to_owned(),
        name: name.to_owned(),
        arguments,
    })
}

/// Step 3 (module doc, [`project_for`]).
fn repair_tool_exchanges(mut messages: Vec<Msg>) -> Vec<Msg> {
    enum Fate {
        Keep,
        Answer,
        Orphan,
        Drop,
    }
    // Id -> whether its nearest call so far is the kept (first) one.
    let mut nearest: HashMap<String, bool> = HashMap::new();
    let mut answered = HashSet::new();
    let mut fates = Vec::with_capacity(messages.len());
    for m in &mut messages {
        let fate = match m.role {
            ASSISTANT => {
                m.calls.retain(|c| {
                    let first = !nearest.contains_key(&c.id);
                    nearest.insert(c.id.clone(), first);
                    first
                });
                Fate::Keep
            }
            TOOL => match m.call_id.as_ref().map(|id| (id, nearest.get(id))) {
                Some((id, Some(&true))) if answered.insert(id.clone()) => Fate::Answer,
                Some((_, Some(_))) => Fate::Drop,
                _ => Fate::Orphan,
            },
            _ => Fate::Keep,
        };
        fates.push(fate);
    }
    let mut results = HashMap::new();
    let mut rest = Vec::with_capacity(messages.len());
    for (m, fate) in messages.into_iter().zip(fates) {
        match fate {
            Fate::Keep => rest.push(m),
            Fate::Answer => {
                results.insert(m.call_id.clone().unwrap_or_default(), m);
            }
            Fate::Orphan => rest.push(orphan_to_user(m)),
            Fate::Drop => {}
        }
    }
    let mut out = Vec::with_capacity(rest.len());
    for m in rest {
        if m.role != ASSISTANT || m.calls.is_empty() {
            if !(m.role == ASSISTANT && m.had_calls && is_blank(&m.content)) {
                out.push(m);
            }
            continue;
        }
        let ids: Vec<String> = m.calls.iter().map(|c| c.id.clone()).collect();
        out.push(m);
        for id in ids {
            out.push(results.remove(&id).unwrap_or_else(|| Msg {
                call_id: Some(id),
                ..Msg::text(TOOL, NO_RESULT_TEXT)
            }));
        }
    }
    out
}

/// `"[tool result for <id>]: <content>"` as a user message (arrays get a leading text part).
fn orphan_to_user(m: Msg) -> Msg {
    let label = match &m.call_id {
        Some(id) => format!("[tool result for {id}]:"),
        None => "[tool result]:".to_owned(),
    };
    let content = match m.content {
        Value::Array(mut parts) => {
            parts.insert(0, text_part(&label));
            Value::Array(parts)
        }
        other => Value::String(format!("{label} {}", text_of(&other))),
    };
    Msg {
        content,
        ..Msg::text(USER, "")
    }
}

/// Splits off `system`/`developer` messages; returns their non-blank texts and the rest.
fn hoist_system(messages: Vec<Msg>) -> (Vec<String>, Vec<Msg>) {
    let (system, rest): (Vec<Msg>, Vec<Msg>) = messages
        .into_iter()
        .partition(|m| m.role == SYSTEM || m.role == DEVELOPER);
    let texts = system
        .iter()
        .map(|m| text_of(&m.content))
        .filter(|t| !t.trim().is_empty())
        .collect();
    (texts, rest)
}

fn with_system(system: Vec<String>, mut rest: Vec<Msg>) -> Vec<Msg> {
    if !system.is_empty() {
        rest.insert(0, Msg::text(SYSTEM, system.join("\n\n")));
    }
    rest
}

/// Joins two contents with `"\n\n"` (parts are concatenated when either is an array).
fn join_content(a: Value, b: Value) -> Value {
    let as_parts = |v: Value| match v {
        Value::Array(parts) => parts,
        other if is_blank(&other) => Vec::new(),
        other => vec![text_part(&text_of(&other))],
    };
    if a.is_array() || b.is_array() {
        let mut parts = as_parts(a);
        parts.extend(as_parts(b));
        return Value::Array(parts);
    }
    let texts: Vec<String> = [a, b]
        .iter()
        .map(text_of)
        .filter(|t| !t.is_empty())
        .collect();
    Value::String(texts.join("\n\n"))
}

/// Step 4 (GLM).
fn glm(messages: Vec<Msg>) -> Vec<Msg> {
    let (mut system, rest) = hoist_system(messages);
    let mut merged: Vec<Msg> = Vec::with_capacity(rest.len());
    for m in rest {
        if let Some(prev) = merged.last_mut()
            && ((prev.role == USER && m.role == USER)
                || (prev.is_plain_assistant() && m.is_plain_assistant()))
        {
            prev.content = join_content(std::mem::take(&mut prev.content), m.content);
            prev.reasoning = match (prev.reasoning.take(), m.reasoning) {
                (Some(a), Some(b)) => Some(format!("{a}\n\n{b}")),
                (a, b) => a.or(b),
            };
            continue;
        }
        merged.push(m);
    }
    while merged.first().is_some_and(Msg::is_plain_assistant) {
        let text = text_of(&merged.remove(0).content);
        if !text.trim().is_empty() {
            system.push(format!("Previous assistant context: {text}"));
        }
    }
    if merged.first().is_some_and(|m| m.role != USER) {
        merged.insert(0, Msg::text(USER, CONTINUE_TEXT));
    }
    if merged.last().is_some_and(|m| m.role == ASSISTANT) {
        merged.push(Msg::text(USER, CONTINUE_TEXT));
    }
    with_system(system, merged)
}

fn is_mistral_id(id: &str) -> bool {
    id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// Step 5 (Mistral).
fn mistral(messages: Vec<Msg>) -> Vec<Msg> {
    let (system, mut rest) = hoist_system(messages);
    rest.retain(|m| !(m.is_plain_assistant() && is_blank(&m.content)));
    // Ids: keep those already valid, derive the others, never reusing one in the payload.
    let all: Vec<String> = rest
        .iter()
        .flat_map(|m| m.calls.iter().map(|c| c.id.clone()))
        .collect();
    let mut used: HashSet<String> = all.iter().filter(|id| is_mistral_id(id)).cloned().collect();
    let mut map = HashMap::new();
    for id in all.into_iter().filter(|id| !is_mistral_id(id)) {
        let mapped = (0u32..)
            .map(|salt| {
                const ALPHABET: &[u8] =
                    b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
                let digest = Sha256::digest(format!("{id}\u{0}{salt}").as_bytes());
                digest[..9]
                    .iter()
                    .map(|b| char::from(ALPHABET[usize::from(*b) % 62]))
                    .collect::<String>()
            })
            .find(|candidate| used.insert(candidate.clone()))
            .unwrap_or_default();
        map.insert(id, mapped);
    }
    let remap = |id: &mut String| {
        if let Some(mapped) = map.get(id) {
            id.clone_from(mapped);
        }
    };
    let mut out: Vec<Msg> = Vec::with_capacity(rest.len() + 1);
    for mut m in rest {
        m.calls.iter_mut().for_each(|c| remap(&mut c.id));
        if let Some(id) = m.call_id.as_mut() {
            remap(id);
        }
        if out.last().is_some_and(|p| p.role == TOOL) && m.role != TOOL && m.role != ASSISTANT {
            out.push(Msg::text(ASSISTANT, TOOL_RESULTS_RECEIVED_TEXT));
        }
        out.push(m);
    }
    if out.last().is_some_and(|m| m.role == ASSISTANT) {
        out.push(Msg::text(USER, CONTINUE_TEXT));
    }
    with_system(system, out)
}

/// Steps 6 and 7: the outbound JSON of one message.
fn render(m: &Msg, family: ModelFamily) -> Value {
    let mut out = Map::new();
    let role = if m.role == DEVELOPER && family != ModelFamily::OpenAi {
        SYSTEM
    } else {
        m.role
    };
    out.insert("role".into(), json!(role));
    if m.role == ASSISTANT {
        let text = text_of(&m.content);
        let content = if !m.calls.is_empty() && text.trim().is_empty() {
            Value::Null
        } else {
            Value::String(text)
        };
        out.insert("content".into(), content);
        if !m.calls.is_empty() {
            let calls = m.calls.iter().map(|c| {
                json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
            });
            out.insert("tool_calls".into(), Value::Array(calls.collect()));
        }
        if let (Some(field), Some(reasoning)) = (reasoning_field(family), &m.reasoning) {
            out.insert(field.into(), json!(reasoning));
        }
    } else {
        let content = if m.content.is_null() {
            json!("")
        } else {
            m.content.clone()
        };
        out.insert("content".into(), content);
        if let Some(id) = &m.call_id {
            out.insert("tool_call_id".into(), json!(id));
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::NewMessage;
    use proptest::prelude::*;

    const FAMILIES: [ModelFamily; 5] = [
        ModelFamily::OpenAi,
        ModelFamily::Glm,
        ModelFamily::Mistral,
        ModelFamily::Llama,
        ModelFamily::Other,
    ];

    fn model(family: ModelFamily, modalities: &[&str]) -> ModelConfig {
        ModelConfig {
            id: "m".into(),
            base_url: "http://127.0.0.1:9/v1".into(),
            api_key_env: None,
            api_key: None,
            upstream_name: "m".into(),
            context_tokens: None,
            input_modalities: modalities.iter().map(|m| (*m).to_owned()).collect(),
            supports_tools: true,
            family,
        }
    }

    fn msg(role: &str, content: Value) -> ContextMessage {
        ContextMessage {
            identity: Some(1),
            message: NewMessage {
                role: role.into(),
                content,
                tool_calls: None,
                tool_call_id: None,
                reasoning: None,
                token_estimate: 3,
                stopped: false,
                finish_reason: None,
            },
        }
    }
    fn text(role: &str, t: &str) -> ContextMessage {
        msg(role, json!(t))
    }
    fn call(content: &str, ids: &[&str]) -> ContextMessage {
        let calls: Vec<Value> = ids
            .iter()
            .map(|id| json!({"id": id, "type": "function", "function": {"name": "calc", "arguments": "{}"}}))
            .collect();
        let mut m = text(ASSISTANT, content);
        m.message.tool_calls = Some(Value::Array(calls));
        m
    }
    fn result(id: &str, t: &str) -> ContextMessage {
        let mut m = text(TOOL, t);
        m.message.tool_call_id = Some(id.into());
        m
    }

    /// The payload read back as context (what a second projection would see).
    fn back(payload: &[Value]) -> Vec<ContextMessage> {
        payload
            .iter()
            .map(|v| ContextMessage {
                identity: None,
                message: NewMessage {
                    role: v["role"].as_str().unwrap().into(),
                    content: v["content"].clone(),
                    tool_calls: v.get("tool_calls").cloned(),
                    tool_call_id: v["tool_call_id"].as_str().map(Into::into),
                    reasoning: v["reasoning_content"].as_str().map(Into::into),
                    token_estimate: 0,
                    stopped: false,
                    finish_reason: None,
                },
            })
            .collect()
    }

    fn project(family: ModelFamily, context: &[ContextMessage]) -> Vec<Value> {
        let out = project_for(&model(family, &["text"]), context);
        validate(family, &out).unwrap_or_else(|e| panic!("{family:?}: {e}\n{out:#?}"));
        out
    }

    fn roles(payload: &[Value]) -> Vec<&str> {
        payload
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect()
    }

    #[test]
    fn strips_ui_fields_and_the_summary_marker() {
        let mut assistant = text(ASSISTANT, "hi");
        assistant.message.reasoning = Some("thought".into());
        let context = [
            text(
                SYSTEM,
                &format!("{SUMMARY_MARKER}\nEarlier: the user asked for X."),
            ),
            msg(
                USER,
                json!([{"type": "text", "text": format!("{SUMMARY_MARKER} summary"), "cache_control": {}}]),
            ),
            assistant,
        ];
        for family in FAMILIES {
            let out = project(family, &context);
            assert!(
                !serde_json::to_string(&out)
                    .unwrap()
                    .contains(SUMMARY_MARKER)
            );
            let reasoning = out.iter().find_map(|m| m.get("reasoning_content"));
            assert_eq!(
                reasoning.is_some(),
                reasoning_field(family).is_some(),
                "{family:?}"
            );
        }
        let out = project(ModelFamily::OpenAi, &context);
        assert_eq!(
            out[0],
            json!({"role": "system", "content": "Earlier: the user asked for X."})
        );
        assert_eq!(out[1], json!({"role": "user", "content": "summary"}));
        assert_eq!(out[2], json!({"role": "assistant", "content": "hi"}));
    }

    #[test]
    fn text_only_models_get_strings_and_placeholders() {
        let parts = json!([
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            {"type": "file", "file": {"filename": "a.pdf", "file_data": "AAAA"}},
        ]);
        let mut tool = msg(
            TOOL,
            json!([{"type": "resource", "resource": {"uri": "file:///r.txt", "mimeType": "text/plain"}}]),
        );
        tool.message.tool_call_id = Some("c1".into());
        let context = [msg(USER, parts.clone()), call("", &["c1"]), tool];
        let out = project_for(&model(ModelFamily::Other, &["text"]), &context);
        assert_eq!(
            out[0]["content"],
            "look\n[image omitted: image/png]\n[audio omitted: wav]\n[file omitted: a.pdf]"
        );
        assert_eq!(out[2]["content"], "[resource omitted: file:///r.txt]");
        // An image model keeps the image, replaces what it cannot take, and never gets resources.
        let out = project_for(&model(ModelFamily::Other, &["text", "image"]), &context);
        assert_eq!(out[0]["content"][1], parts[1]);
        assert_eq!(
            out[0]["content"][2],
            json!({"type": "text", "text": "[audio omitted: wav]"})
        );
        assert_eq!(
            out[2]["content"],
            json!([{"type": "text", "text": "[resource omitted: file:///r.txt]"}])
        );
    }

    #[test]
    fn every_family_repairs_tool_exchanges() {
        let context = [
            text(USER, "go"),
            result("zz", "stray"),   // orphan
            call("", &["c1", "c2"]), // c2 never answered
            text(USER, "meanwhile"),
            result("c1", "one"),    // separated from its call
            call("again", &["c1"]), // duplicate id
            result("c1", "dup"),    // its duplicate result
        ];
        for family in FAMILIES {
            let out = project(family, &context);
            let flat = serde_json::to_string(&out).unwrap();
            assert!(flat.contains("[tool result for zz]: stray"), "{family:?}");
            assert!(!flat.contains("dup"), "{family:?}");
            let call_at = out
                .iter()
                .position(|m| m.get("tool_calls").is_some())
                .unwrap();
            assert_eq!(out[call_at]["content"], Value::Null);
            assert_eq!(out[call_at + 1]["content"], "one");
            assert_eq!(out[call_at + 2]["content"], NO_RESULT_TEXT);
        }
        let out = project(ModelFamily::OpenAi, &context);
        assert_eq!(
            roles(&out),
            [
                "user",
                "user",
                "assistant",
                "tool",
                "tool",
                "user",
                "assistant"
            ]
        );
        assert_eq!(out[6], json!({"role": "assistant", "content": "again"}));
    }

    #[test]
    fn invalid_envelopes_keep_their_prose_or_vanish() {
        let mut no_name = text(ASSISTANT, "let me check");
        no_name.message.tool_calls =
            Some(json!([{"id": "c1", "type": "function", "function": {"arguments": "{}"}}]));
        let mut no_id = text(ASSISTANT, "");
        no_id.message.tool_calls =
            Some(json!([{"type": "function", "function": {"name": "calc"}}]));
        let context = [
            text(USER, "q"),
            no_name,
            result("c1", "r"),
            no_id,
            text(USER, "well?"),
        ];
        let out = project(ModelFamily::Glm, &context);
        assert_eq!(
            out,
            [
                json!({"role": "user", "content": "q"}),
                json!({"role": "assistant", "content": "let me check"}),
                json!({"role": "user", "content": "[tool result for c1]: r\n\nwell?"}),
            ]
        );
    }

    #[test]
    fn glm_system_first_merged_and_leading_assistant_folded() {
        let context = [
            text(ASSISTANT, "I was saying"),
            text(SYSTEM, "Be brief."),
            text(USER, "a"),
            text(DEVELOPER, "Use tools."),
            text(USER, "b"),
            text(ASSISTANT, "c"),
            text(ASSISTANT, "d"),
        ];
        let out = project(ModelFamily::Glm, &context);
        assert_eq!(
            out,
            [
                json!({"role": "system", "content": "Be brief.\n\nUse tools.\n\nPrevious assistant context: I was saying"}),
                json!({"role": "user", "content": "a\n\nb"}),
                json!({"role": "assistant", "content": "c\n\nd"}),
                json!({"role": "user", "content": CONTINUE_TEXT}),
            ]
        );
        // Other families keep the order and roles (developer becomes system outside OpenAI).
        assert_eq!(project(ModelFamily::Llama, &context).len(), context.len());
        assert_eq!(project(ModelFamily::Llama, &context)[3]["role"], "system");
        assert_eq!(
            project(ModelFamily::OpenAi, &context)[3]["role"],
            "developer"
        );
    }

    #[test]
    fn glm_leading_tool_call_gets_a_user_turn() {
        let out = project(ModelFamily::Glm, &[call("", &["c1"]), result("c1", "4")]);
        assert_eq!(roles(&out), ["user", "assistant", "tool"]);
        assert_eq!(out[0]["content"], CONTINUE_TEXT);
        assert!(
            validate(
                ModelFamily::Glm,
                &project_for(&model(ModelFamily::Other, &[]), &[call("", &["c1"])])
            )
            .is_err()
        );
    }

    #[test]
    fn mistral_ids_bridge_and_last_turn() {
        let context = [
            text(USER, "q"),
            call("", &["call_0123456789abcdef", "abcDEF123"]),
            result("abcDEF123", "kept id"),
            result("call_0123456789abcdef", "mapped id"),
            text(USER, "thanks"),
            text(ASSISTANT, ""),
            text(ASSISTANT, "done"),
        ];
        let out = project(ModelFamily::Mistral, &context);
        assert_eq!(
            roles(&out),
            [
                "user",
                "assistant",
                "tool",
                "tool",
                "assistant",
                "user",
                "assistant",
                "user"
            ]
        );
        let mapped = out[1]["tool_calls"][0]["id"].as_str().unwrap();
        assert!(is_mistral_id(mapped) && mapped != "abcDEF123");
        assert_eq!(out[1]["tool_calls"][1]["id"], "abcDEF123");
        assert_eq!(
            (out[2]["tool_call_id"].as_str(), &out[2]["content"]),
            (Some(mapped), &json!("mapped id"))
        );
        assert_eq!(out[3]["tool_call_id"], "abcDEF123");
        assert_eq!(out[4]["content"], TOOL_RESULTS_RECEIVED_TEXT);
        assert_eq!(out[7]["content"], CONTINUE_TEXT);
        // Deterministic across calls; the input is untouched.
        assert_eq!(project(ModelFamily::Mistral, &context), out);
        assert_eq!(
            context[1].message.tool_calls.as_ref().unwrap()[0]["id"],
            "call_0123456789abcdef"
        );
    }

    #[test]
    fn validate_rejects_what_providers_reject() {
        let call = json!({"role": "assistant", "content": null,
            "tool_calls": [{"id": "abcDEF123", "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
        let tool = json!({"role": "tool", "tool_call_id": "abcDEF123", "content": "x"});
        let user = json!({"role": "user", "content": "u"});
        let cases: [(ModelFamily, Vec<Value>); 7] = [
            (ModelFamily::OpenAi, vec![user.clone(), call.clone()]),
            (ModelFamily::OpenAi, vec![user.clone(), tool.clone()]),
            (
                ModelFamily::OpenAi,
                vec![json!({"role": "user", "content": "u", "timestamp": 1})],
            ),
            (
                ModelFamily::OpenAi,
                vec![call.clone(), tool.clone(), call.clone(), tool.clone()],
            ),
            (
                ModelFamily::Glm,
                vec![user.clone(), json!({"role": "system", "content": "s"})],
            ),
            (ModelFamily::Glm, vec![user.clone(), user.clone()]),
            (
                ModelFamily::Mistral,
                vec![user.clone(), call.clone(), tool.clone(), user.clone()],
            ),
        ];
        for (family, payload) in cases {
            assert!(
                validate(family, &payload).is_err(),
                "{family:?} accepted {payload:?}"
            );
        }
        assert!(validate(ModelFamily::Mistral, &[user, call, tool]).is_ok());
    }

    fn arb_text() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(String::new()),
            "[a-z ]{1,8}",
            "[a-z]{1,6}".prop_map(|t| format!("{SUMMARY_MARKER}\n{t}")),
        ]
    }

    fn arb_content() -> impl Strategy<Value = Value> {
        let part = prop_oneof![
            arb_text().prop_map(|t| json!({"type": "text", "text": t})),
            Just(json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})),
            Just(
                json!({"type": "image_url", "image_url": {"url": "https://example.test/cat.jpg"}})
            ),
            Just(json!({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "mp3"}})),
            Just(json!({"type": "file", "file": {"filename": "a.pdf", "file_data": "AAAA"}})),
            Just(
                json!({"type": "resource", "resource": {"uri": "file:///r", "mimeType": "text/plain"}})
            ),
        ];
        prop_oneof![
            4 => arb_text().prop_map(Value::String),
            2 => prop::collection::vec(part, 0..4).prop_map(Value::Array),
            1 => Just(Value::Null),
        ]
    }

    fn arb_id() -> impl Strategy<Value = String> {
        prop::sample::select(vec!["c1", "c2", "c3", "call_9f8e7d", "abcDEF123", ""])
            .prop_map(String::from)
    }

    fn arb_call() -> impl Strategy<Value = Value> {
        (arb_id(), prop::option::weighted(0.9, "[a-z_]{1,6}"), any::<bool>()).prop_map(|(id, name, object_args)| {
            let mut function = json!({"arguments": if object_args { json!({"x": 1}) } else { json!("{\"x\":1}") }});
            if let Some(name) = name {
                function["name"] = json!(name);
            }
            let mut call = json!({"type": "function", "function": function, "index": 0});
            if !id.is_empty() {
                call["id"] = json!(id);
            }
            call
        })
    }

    fn arb_message() -> impl Strategy<Value = ContextMessage> {
        let roles = prop::sample::select(vec![
            SYSTEM, DEVELOPER, USER, USER, ASSISTANT, ASSISTANT, TOOL, TOOL, "function",
        ]);
        (
            roles,
            arb_content(),
            prop::option::of(prop::collection::vec(arb_call(), 0..3)),
            prop::option::of(arb_id()),
            prop::option::of("[a-z ]{0,6}"),
            prop::option::of(any::<i64>()),
        )
            .prop_map(|(role, content, calls, call_id, reasoning, identity)| {
                ContextMessage {
                    identity,
                    message: NewMessage {
                        role: role.into(),
                        content,
                        tool_calls: calls.map(Value::Array),
                        tool_call_id: call_id,
                        reasoning,
                        token_estimate: 7,
                        stopped: false,
                        finish_reason: None,
                    },
                }
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        #[test]
        fn projections_are_pure_valid_idempotent_and_marker_free(
            context in prop::collection::vec(arb_message(), 0..14),
        ) {
            let before = context.clone();
            for family in FAMILIES {
                for modalities in [&["text"][..], &["text", "image", "audio", "file"][..]] {
                    let model = model(family, modalities);
                    let out = project_for(&model, &context);
                    prop_assert_eq!(&context, &before);
                    if let Err(e) = validate(family, &out) {
                        return Err(TestCaseError::fail(format!("{family:?} {modalities:?}: {e}\n{out:#?}")));
                    }
                    prop_assert_eq!(&project_for(&model, &back(&out)), &out, "{:?} {:?}", family, modalities);
                    prop_assert!(!serde_json::to_string(&out).unwrap().contains(SUMMARY_MARKER));
                    if is_text_only(&model) {
                        prop_assert!(out.iter().all(|m| m["content"].is_string() || m["content"].is_null()));
                    }
                }
            }
        }
    }
}
