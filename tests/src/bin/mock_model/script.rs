//! Deciding what to answer: reads one chat-completions request and produces a [`Reply`].
//!
//! Everything is derived from the request's own messages (plus the in-memory failure counters),
//! so the answer is deterministic under concurrency and when a crashed client retries:
//!
//! - the *user text* is the text of the last `user` message (a string, or the `text` parts of
//!   an array of parts joined with no separator); `after` is every message that follows it;
//! - with a `MOCK:` directive in the user text, the step index is the number of `assistant`
//!   messages in `after` (see [`Step`]), except that a step with `retryIfResultContains` is
//!   played again (like a model retrying a failed tool call) when one of its results contains
//!   that text, at most [`MAX_STEP_RETRIES`] times in a row;
//! - without one, a tiny calculator agent answers (see [`default_reply`]).

use std::collections::HashMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

/// Marker that starts a directive inside the user text; everything after its first occurrence
/// is a JSON object `{"steps": [Step, ...]}` (trailing text after the object is ignored).
const DIRECTIVE_MARKER: &str = "MOCK:";

/// Text answered once a directive has run out of steps.
const FINAL_TEXT: &str = "done";

/// Name of the tool the default agent knows how to call.
const CALCULATOR: &str = "calculator";

/// What the mock answers to one request, before it is put on the wire.
#[derive(Debug, Default)]
pub struct Reply {
    /// Sleep before the response headers are sent.
    pub delay: Duration,
    /// Sleep between two streamed chunks (SSE `data:` lines).
    pub chunk_delay: Duration,
    /// When set, answer with this HTTP error instead of a completion.
    pub failure: Option<Failure>,
    /// Sent as `reasoning_content` before the content; empty = none.
    pub reasoning: String,
    /// Assistant content; empty = none (`content: null` when there are tool calls).
    pub text: String,
    /// Tool calls of the assistant message, in order (several = parallel calls).
    pub tool_calls: Vec<ToolCall>,
    /// Deliberate wire damage.
    pub malformed: Option<Malformed>,
    /// Token counts overriding the computed ones.
    pub usage: UsageOverride,
    /// `finish_reason` of the last chunk instead of `stop` / `tool_calls` (e.g. `length`).
    pub finish_reason: Option<String>,
}

/// An HTTP error answer: `status` with an OpenAI-style error body.
#[derive(Debug, Clone, Copy)]
pub struct Failure {
    /// HTTP status code, e.g. 429 or 503.
    pub status: u16,
    /// Value of the `Retry-After` header, in seconds.
    pub retry_after_secs: Option<u64>,
}

/// One tool call of the assistant message.
#[derive(Debug, Clone)]
pub struct ToolCall {
    /// `tool_calls[].id`.
    pub id: String,
    /// `tool_calls[].function.name`.
    pub name: String,
    /// `tool_calls[].function.arguments`: the exact text sent (may be invalid JSON on purpose).
    pub arguments: String,
}

/// Deliberate damage to the response body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Malformed {
    /// One `data: {not json` line in the middle of the stream, which then continues normally.
    Chunk,
    /// The stream stops after half the content, without `finish_reason` or `[DONE]`, and the
    /// connection is dropped.
    Truncate,
}

/// Token counts that replace the computed `usage` (each one independently).
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UsageOverride {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u64>,
}

/// A request the mock cannot script: answered with HTTP 400 and this message.
#[derive(Debug)]
pub struct BadRequest(pub String);

/// The body of a `MOCK:` directive.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Directive {
    #[serde(default)]
    steps: Vec<Step>,
    /// Counting mode (survives compaction, which may summarise the steps away): while the last
    /// tool result of the request is an integer `n < until` (0 when there is none), call
    /// `calculator` with `n+1` and say `text`; then answer `finished at <n>`.
    #[serde(rename = "loop")]
    count_loop: Option<CountLoop>,
}

/// See [`Directive::count_loop`].
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CountLoop {
    until: i64,
    #[serde(default)]
    text: String,
}

/// One scripted assistant turn. All fields are optional; unknown fields are rejected so that
/// a typo in a test shows up as a 400 instead of a silently ignored instruction.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Step {
    /// Assistant content; `{{tool_result}}` and `{{tool_results}}` are substituted.
    text: Option<String>,
    /// Sends `text` this many times over, joined by nothing, with `{{n}}` in it replaced by the
    /// repetition's number from 0 (a huge answer, of distinct words if wanted, without a huge
    /// script in the user's message); about [`MAX_REPEAT_BYTES`] at most.
    repeat: Option<usize>,
    /// Text before and after the repeated `text` (with `repeat` only).
    prefix: Option<String>,
    suffix: Option<String>,
    /// Tool calls of this turn, in order.
    #[serde(default)]
    tool_calls: Vec<ToolCallSpec>,
    /// Reasoning text sent as `reasoning_content` before the content.
    reasoning: Option<String>,
    /// Sleep before the response headers, in ms.
    #[serde(default)]
    delay_ms: u64,
    /// Sleep between chunks, in ms.
    #[serde(default)]
    chunk_delay_ms: u64,
    /// Answer with this HTTP status and an OpenAI-style error body.
    status: Option<u16>,
    /// Only the first `failTimes` requests reaching this (user text, step) fail (`status`) or
    /// are damaged (`malformed`); absent = all.
    fail_times: Option<u64>,
    /// `Retry-After` header of the error answer, in seconds.
    retry_after: Option<u64>,
    /// Deliberate wire damage.
    malformed: Option<Malformed>,
    /// Token counts overriding the computed usage.
    usage: Option<UsageOverride>,
    /// `finish_reason` to end with instead of `stop` / `tool_calls` (e.g. `length`).
    finish_reason: Option<String>,
    /// When a result of this step's tool calls contains this text, the next request plays this
    /// step again (its calls get fresh ids unless `id` is given), like a model retrying a failed
    /// call; at most [`MAX_STEP_RETRIES`] times in a row.
    retry_if_result_contains: Option<String>,
}

/// Largest answer `repeat` builds, in bytes.
pub const MAX_REPEAT_BYTES: usize = 64 << 20;

/// Replays of one `retryIfResultContains` step before the script moves on regardless.
pub const MAX_STEP_RETRIES: usize = 2;

/// A scripted tool call: `arguments` is any JSON value (sent as its JSON text) and
/// `argumentsRaw` is the exact text to send; with neither the arguments are `{}`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ToolCallSpec {
    name: String,
    arguments: Option<Value>,
    arguments_raw: Option<String>,
    id: Option<String>,
    /// Adds `"pad": "xxx…"` of this many bytes to the `arguments` object (a model that writes a
    /// huge call, without a huge script in the user's message).
    pad_bytes: Option<usize>,
}

/// How many requests already failed per (user text, step index), keyed by a hash of the pair.
#[derive(Debug, Default)]
pub struct FailureCounts(Mutex<HashMap<u64, u64>>);

impl FailureCounts {
    /// Records one more request reaching `(user_text, step)` and tells whether it must fail:
    /// true for the first `fail_times` requests, always true when `fail_times` is `None`.
    fn should_fail(&self, user_text: &str, step: usize, fail_times: Option<u64>) -> bool {
        let Some(limit) = fail_times else {
            return true;
        };
        let mut hasher = DefaultHasher::new();
        (user_text, step).hash(&mut hasher);
        let mut counts = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let failed = counts.entry(hasher.finish()).or_insert(0);
        if *failed < limit {
            *failed += 1;
            true
        } else {
            false
        }
    }
}

/// The parts of a request the script looks at.
struct Conversation<'a> {
    /// Text of the last `user` message ("" when there is none).
    user_text: String,
    /// Messages after the last `user` message (all messages when there is none).
    after: &'a [Value],
    /// Every message of the request.
    messages: &'a [Value],
}

impl<'a> Conversation<'a> {
    fn new(messages: &'a [Value]) -> Self {
        let last_user = messages.iter().rposition(|m| role(m) == "user");
        match last_user {
            Some(i) => Self {
                user_text: content_text(&messages[i]),
                after: &messages[i + 1..],
                messages,
            },
            None => Self {
                user_text: String::new(),
                after: messages,
                messages,
            },
        }
    }

    /// Number of `assistant` messages after the last user message = the step index.
    fn step_index(&self) -> usize {
        self.after.iter().filter(|m| role(m) == "assistant").count()
    }

    /// Content of the last `tool` message of the whole request ("" when there is none).
    fn last_tool_result(&self) -> String {
        self.messages
            .iter()
            .rev()
            .find(|m| role(m) == "tool")
            .map(content_text)
            .unwrap_or_default()
    }

    /// Contents of the `tool` messages after the last user message, in order.
    fn tool_results_after(&self) -> Vec<String> {
        self.after
            .iter()
            .filter(|m| role(m) == "tool")
            .map(content_text)
            .collect()
    }
}

/// Decides the reply to `request` (a parsed chat-completions body).
///
/// Errors: `messages` missing or not an array, or a `MOCK:` directive that is not a valid
/// `{"steps": [...]}` object.
pub fn plan(request: &Value, failures: &FailureCounts) -> Result<Reply, BadRequest> {
    let messages = request
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| BadRequest("`messages` must be an array".to_owned()))?;
    if let Some(reply) = summary_reply(messages) {
        return Ok(reply);
    }
    if let Some(reply) = title_reply(messages) {
        return Ok(reply);
    }
    let conversation = Conversation::new(messages);
    // The directive comes from the last user message, or else from a system message (where a
    // compaction summary carries it forward).
    let source = Some(conversation.user_text.clone()).filter(|t| t.contains(DIRECTIVE_MARKER)).or_else(|| {
        messages.iter().filter(|m| role(m) == "system").map(content_text).find(|t| t.contains(DIRECTIVE_MARKER))
    });
    match source {
        Some(text) => {
            let at = text.find(DIRECTIVE_MARKER).unwrap_or(0);
            let directive = parse_directive(&text[at + DIRECTIVE_MARKER.len()..])?;
            if let Some(count_loop) = directive.count_loop {
                return Ok(loop_reply(&conversation, &count_loop));
            }
            Ok(scripted_reply(&conversation, directive, failures))
        }
        None => Ok(default_reply(&conversation, request)),
    }
}

/// Opening words of agentloop's title prompt (`agentloop_worker::title::TITLE_PROMPT`).
const TITLE_PROMPT_START: &str = "You write conversation titles";

/// A title request (first message is agentloop's title prompt) gets `Chat: <first 4 words of the
/// user's first message>` (directives removed) — never a scripted step, so a script's steps and
/// failure counters are untouched. A first message containing `MOCK_TITLE_FAIL` gets an HTTP 500
/// instead (the worker then falls back to the first words).
fn title_reply(messages: &[Value]) -> Option<Reply> {
    let first = messages.first()?;
    if role(first) != "system" || !content_text(first).starts_with(TITLE_PROMPT_START) {
        return None;
    }
    let text = messages.get(1).map(content_text).unwrap_or_default();
    if text.contains("MOCK_TITLE_FAIL") {
        return Some(Reply { failure: Some(Failure { status: 500, retry_after_secs: None }), ..Reply::default() });
    }
    let question = text.strip_prefix("User: ").unwrap_or(&text);
    let question = question.split("\n\nAssistant:").next().unwrap_or_default();
    let question = question.split(DIRECTIVE_MARKER).next().unwrap_or_default();
    let words: Vec<&str> = question.split_whitespace().take(4).collect();
    Some(Reply { text: format!("Chat: {}", words.join(" ")), ..Reply::default() })
}

/// Opening words of agentloop's summarisation system prompt (`compaction::SUMMARY_PROMPT`).
const SUMMARY_PROMPT_START: &str = "You compress the earlier part of a conversation";

/// A summarisation request (first message is agentloop's summary prompt) gets a short summary:
/// `Summary of <N> characters: <first 80 characters of the transcript>` — always far smaller
/// than its input, deterministic, and free of `MOCK:` directives. A transcript containing
/// `MOCK_SUMMARY_GROWS` gets back twice its own text instead (to test refusal of a summary that
/// does not shrink); one containing `MOCK_SUMMARY_SLOW` is answered after 2 s (a summary call
/// long enough for a fault to start during it).
fn summary_reply(messages: &[Value]) -> Option<Reply> {
    let first = messages.first()?;
    if role(first) != "system" || !content_text(first).starts_with(SUMMARY_PROMPT_START) {
        return None;
    }
    let transcript = messages.get(1).map(content_text).unwrap_or_default();
    let text = if transcript.contains("MOCK_SUMMARY_GROWS") {
        transcript.repeat(2)
    } else {
        // Carry a directive forward verbatim so scripted runs keep their script after compaction.
        let directive = transcript.find(DIRECTIVE_MARKER).and_then(|at| {
            let rest = &transcript[at + DIRECTIVE_MARKER.len()..];
            serde_json::Deserializer::from_str(rest).into_iter::<Value>().next()?.ok()
        });
        let head: String = transcript.replace(DIRECTIVE_MARKER, "").chars().take(80).collect();
        let mut text = format!("Summary of {} characters: {}", transcript.chars().count(), head.replace('\n', " "));
        if let Some(d) = directive {
            text.push_str(&format!(" {DIRECTIVE_MARKER} {d}"));
        }
        text
    };
    let delay = if transcript.contains("MOCK_SUMMARY_SLOW") { Duration::from_secs(2) } else { Duration::ZERO };
    Some(Reply { text, delay, ..Reply::default() })
}

/// The counting loop of [`CountLoop`].
fn loop_reply(conversation: &Conversation<'_>, count_loop: &CountLoop) -> Reply {
    let n: i64 = conversation.last_tool_result().trim().parse().unwrap_or(0);
    if n >= count_loop.until {
        return Reply { text: format!("finished at {n}"), ..Reply::default() };
    }
    Reply {
        text: count_loop.text.clone(),
        tool_calls: vec![ToolCall {
            id: default_call_id(n as usize, 0),
            name: CALCULATOR.to_owned(),
            arguments: serde_json::json!({ "expression": format!("{n}+1") }).to_string(),
        }],
        ..Reply::default()
    }
}

/// Parses the first JSON value after the marker, ignoring whatever text follows it.
fn parse_directive(script: &str) -> Result<Directive, BadRequest> {
    let mut values = serde_json::Deserializer::from_str(script).into_iter::<Directive>();
    match values.next() {
        Some(Ok(directive)) => Ok(directive),
        Some(Err(err)) => Err(BadRequest(format!("invalid MOCK directive: {err}"))),
        None => Err(BadRequest(
            "invalid MOCK directive: expected {\"steps\":[...]}".to_owned(),
        )),
    }
}

/// Plays step `step_index` of a directive (or the final `"done"` once steps run out).
fn scripted_reply(
    conversation: &Conversation<'_>,
    directive: Directive,
    failures: &FailureCounts,
) -> Reply {
    let index = scripted_index(conversation, &directive.steps);
    let step = directive
        .steps
        .into_iter()
        .nth(index)
        .unwrap_or_else(|| Step {
            text: Some(FINAL_TEXT.to_owned()),
            ..Step::default()
        });

    // `failTimes` counts the requests that get the step's error status or wire damage.
    let failing = (step.status.is_some() || step.malformed.is_some())
        && failures.should_fail(&conversation.user_text, index, step.fail_times);
    let failure = step
        .status
        .filter(|_| failing)
        .map(|status| Failure {
            status,
            retry_after_secs: step.retry_after,
        });
    let text = step
        .text
        .map(|text| {
            text.replace(
                "{{tool_results}}",
                &conversation.tool_results_after().join(", "),
            )
            .replace("{{tool_result}}", &conversation.last_tool_result())
        })
        .map(|text| match step.repeat {
            None => text,
            Some(n) => {
                let body = repeat_text(&text, n);
                format!("{}{body}{}", step.prefix.as_deref().unwrap_or(""), step.suffix.as_deref().unwrap_or(""))
            }
        })
        .unwrap_or_default();
    let tool_calls = step
        .tool_calls
        .into_iter()
        .enumerate()
        .map(|(i, spec)| ToolCall {
            id: spec.id.unwrap_or_else(|| default_call_id(index, i)),
            name: spec.name,
            arguments: match (spec.arguments_raw, spec.arguments, spec.pad_bytes) {
                (Some(raw), _, _) => raw,
                (None, value, Some(pad)) => {
                    let mut value = value.unwrap_or_else(|| serde_json::json!({}));
                    value["pad"] = Value::String("x".repeat(pad));
                    value.to_string()
                }
                (None, Some(value), None) => value.to_string(),
                (None, None, None) => "{}".to_owned(),
            },
        })
        .collect();

    Reply {
        delay: Duration::from_millis(step.delay_ms),
        chunk_delay: Duration::from_millis(step.chunk_delay_ms),
        failure,
        reasoning: step.reasoning.unwrap_or_default(),
        text,
        tool_calls,
        malformed: step.malformed.filter(|_| failing),
        usage: step.usage.unwrap_or_default(),
        finish_reason: step.finish_reason,
    }
}

/// `text` `n` times over, joined by nothing, `{{n}}` replaced by the repetition's number from 0;
/// about [`MAX_REPEAT_BYTES`] at most.
fn repeat_text(text: &str, n: usize) -> String {
    if text.is_empty() {
        return String::new();
    }
    if !text.contains("{{n}}") {
        return text.repeat(n.min(MAX_REPEAT_BYTES / text.len()));
    }
    let mut all = String::new();
    for i in 0..n {
        all.push_str(&text.replace("{{n}}", &i.to_string()));
        if all.len() > MAX_REPEAT_BYTES {
            break;
        }
    }
    all
}

/// The step to play: one per `assistant` message after the user message, except that a step
/// with `retryIfResultContains` whose results (the `tool` messages after its assistant message)
/// contain that text is played again, at most [`MAX_STEP_RETRIES`] times in a row. Without such
/// steps this is [`Conversation::step_index`].
fn scripted_index(conversation: &Conversation<'_>, steps: &[Step]) -> usize {
    let after = conversation.after;
    let (mut index, mut repeats, mut i) = (0usize, 0usize, 0usize);
    while i < after.len() {
        if role(&after[i]) != "assistant" {
            i += 1;
            continue;
        }
        let mut j = i + 1;
        let mut results = Vec::new();
        while j < after.len() && role(&after[j]) != "assistant" {
            if role(&after[j]) == "tool" {
                results.push(content_text(&after[j]));
            }
            j += 1;
        }
        let retry = steps
            .get(index)
            .and_then(|s| s.retry_if_result_contains.as_deref())
            .is_some_and(|pattern| repeats < MAX_STEP_RETRIES && results.iter().any(|r| r.contains(pattern)));
        if retry {
            repeats += 1;
        } else {
            index += 1;
            repeats = 0;
        }
        i = j;
    }
    index
}

/// The default "agent", for requests without a directive:
///
/// 1. no `tool` message after the user message, a `calculator` tool offered, and an arithmetic
///    expression in the user text: one `calculator` call with `{"expression": "<expr>"}`;
/// 2. a `tool` message after the user message: `The result is <last tool content>.`;
/// 3. otherwise: `You said: <user text>`.
fn default_reply(conversation: &Conversation<'_>, request: &Value) -> Reply {
    let has_tool_result = conversation.after.iter().any(|m| role(m) == "tool");
    if !has_tool_result
        && offers_tool(request, CALCULATOR)
        && let Some(expression) = find_expression(&conversation.user_text)
    {
        let arguments = serde_json::json!({ "expression": expression }).to_string();
        return Reply {
            tool_calls: vec![ToolCall {
                id: default_call_id(conversation.step_index(), 0),
                name: CALCULATOR.to_owned(),
                arguments,
            }],
            ..Reply::default()
        };
    }
    let text = if has_tool_result {
        format!("The result is {}.", conversation.last_tool_result())
    } else {
        format!("You said: {}", conversation.user_text)
    };
    Reply {
        text,
        ..Reply::default()
    }
}

/// `call_<step>_<i>_<8 random hex digits>`.
fn default_call_id(step: usize, i: usize) -> String {
    let random = uuid::Uuid::new_v4().simple().to_string();
    format!("call_{step}_{i}_{}", &random[..8])
}

/// Whether `tools` (OpenAI shape `{"type":"function","function":{"name":...}}`, or a bare
/// `{"name":...}`) contains a tool called `name`.
fn offers_tool(request: &Value, name: &str) -> bool {
    request
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|tools| {
            tools.iter().any(|tool| {
                let function = tool.get("function").unwrap_or(tool);
                function.get("name").and_then(Value::as_str) == Some(name)
            })
        })
}

/// The first maximal run of digits, spaces, `.`, `+ - * / ^ ( )` that holds at least one digit
/// and one operator (`+ - * / ^`), trimmed.
fn find_expression(text: &str) -> Option<&str> {
    let is_expression_char = |c: char| c.is_ascii_digit() || " .+-*/^()".contains(c);
    let is_operator = |c: char| "+-*/^".contains(c);
    text.split(|c: char| !is_expression_char(c))
        .map(str::trim)
        .find(|run| run.contains(|c: char| c.is_ascii_digit()) && run.contains(is_operator))
}

/// `role` of a message ("" when absent).
fn role(message: &Value) -> &str {
    message.get("role").and_then(Value::as_str).unwrap_or("")
}

/// Text of a message's `content`: a string as is, an array of parts as its `text` parts joined
/// with no separator, anything else as "".
pub fn content_text(message: &Value) -> String {
    match message.get("content") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn finds_the_first_arithmetic_expression() {
        assert_eq!(find_expression("what is 12*7"), Some("12*7"));
        assert_eq!(find_expression("what is (1 + 2) ^ 3?"), Some("(1 + 2) ^ 3"));
        assert_eq!(find_expression("I have 3 cats and 2 dogs"), None);
        assert_eq!(find_expression("from 3 - 2"), Some("3 - 2"));
        assert_eq!(find_expression("no numbers + here"), None);
    }

    #[test]
    fn step_index_counts_assistant_messages_after_the_last_user_message() {
        let messages = [
            json!({"role": "user", "content": "old"}),
            json!({"role": "assistant", "content": "x"}),
            json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
            json!({"role": "assistant", "content": null}),
            json!({"role": "tool", "content": "84"}),
        ];
        let conversation = Conversation::new(&messages);
        assert_eq!(conversation.user_text, "ab");
        assert_eq!(conversation.step_index(), 1);
        assert_eq!(conversation.last_tool_result(), "84");
    }

    #[test]
    fn a_step_with_retry_if_result_contains_is_replayed_on_a_matching_result() {
        let directive = parse_directive(
            r#"{"steps":[{"toolCalls":[{"name":"x"}],"retryIfResultContains":"failed"},{"text":"end"}]}"#,
        )
        .unwrap();
        let call = json!({"role": "assistant", "content": null});
        let user = json!({"role": "user", "content": "go"});
        let bad = json!({"role": "tool", "content": "x: request failed"});
        let good = json!({"role": "tool", "content": "ok"});
        let index = |messages: &[Value]| scripted_index(&Conversation::new(messages), &directive.steps);
        assert_eq!(index(std::slice::from_ref(&user)), 0);
        assert_eq!(index(&[user.clone(), call.clone(), good.clone()]), 1);
        assert_eq!(index(&[user.clone(), call.clone(), bad.clone()]), 0, "replayed");
        assert_eq!(index(&[user.clone(), call.clone(), bad.clone(), call.clone(), good.clone()]), 1);
        let three = [user, call.clone(), bad.clone(), call.clone(), bad.clone(), call, bad];
        assert_eq!(index(&three), 1, "at most MAX_STEP_RETRIES replays");
    }

    #[test]
    fn fail_times_fails_only_the_first_requests() {
        let failures = FailureCounts::default();
        assert!(failures.should_fail("t", 0, Some(1)));
        assert!(!failures.should_fail("t", 0, Some(1)));
        assert!(failures.should_fail("t", 1, Some(1)));
        assert!(failures.should_fail("t", 0, None));
    }
}
