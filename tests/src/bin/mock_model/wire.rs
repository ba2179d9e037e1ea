//! Putting a [`Reply`] on the wire in OpenAI's Chat Completions format: one `chat.completion`
//! object, or the frames of a server-sent-event stream of `chat.completion.chunk` objects.
//!
//! Source for the shapes: OpenAI API reference, "Chat Completions" (the chat completion object,
//! the chat completion chunk object, and streaming of tool calls).

use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::web::Bytes;
use serde_json::{Value, json};

use crate::script::{Malformed, Reply, ToolCall, content_text};

/// Words per streamed content (and reasoning) chunk.
const WORDS_PER_CHUNK: usize = 3;

/// The line sent by `malformed: "chunk"`.
const MALFORMED_LINE: &str = "data: {not json\n\n";

/// Fields shared by every object of one response.
pub struct Envelope {
    /// `chatcmpl-<32 hex digits>`.
    id: String,
    /// Unix time, in seconds.
    created: u64,
    /// The request's `model`, or `"mock"`.
    model: String,
}

impl Envelope {
    /// A fresh envelope for an answer to `request`.
    pub fn for_request(request: &Value) -> Self {
        Self {
            id: format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |elapsed| elapsed.as_secs()),
            model: request
                .get("model")
                .and_then(Value::as_str)
                .unwrap_or("mock")
                .to_owned(),
        }
    }

    /// A `chat.completion.chunk` with one choice carrying `delta` and `finish_reason`.
    fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> Value {
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish_reason }],
        })
    }
}

/// Token counts of one answer.
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
}

impl Usage {
    /// Prompt tokens = characters of the request messages' text content / 4; completion tokens
    /// = characters of content + reasoning + tool-call arguments / 4; each at least 1, and each
    /// replaced by the step's `usage` override when given.
    pub fn compute(request: &Value, reply: &Reply) -> Self {
        let prompt_chars: usize = request
            .get("messages")
            .and_then(Value::as_array)
            .map(|messages| {
                messages
                    .iter()
                    .map(|m| content_text(m).chars().count())
                    .sum()
            })
            .unwrap_or(0);
        let completion_chars = reply.text.chars().count()
            + reply.reasoning.chars().count()
            + reply
                .tool_calls
                .iter()
                .map(|call| call.arguments.chars().count())
                .sum::<usize>();
        let estimate = |chars: usize| u64::try_from(chars / 4).unwrap_or(u64::MAX).max(1);
        Self {
            prompt_tokens: reply
                .usage
                .prompt_tokens
                .unwrap_or_else(|| estimate(prompt_chars)),
            completion_tokens: reply
                .usage
                .completion_tokens
                .unwrap_or_else(|| estimate(completion_chars)),
        }
    }

    fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }
}

/// The reply's scripted `finish_reason`, else `"tool_calls"` when it calls tools, else
/// `"stop"`.
fn finish_reason(reply: &Reply) -> &str {
    if let Some(reason) = &reply.finish_reason {
        reason
    } else if reply.tool_calls.is_empty() {
        "stop"
    } else {
        "tool_calls"
    }
}

/// The non-streaming `chat.completion` object.
pub fn completion(envelope: &Envelope, reply: &Reply, usage: Usage) -> Value {
    let content = if reply.text.is_empty() && !reply.tool_calls.is_empty() {
        Value::Null
    } else {
        Value::String(reply.text.clone())
    };
    let mut message = json!({ "role": "assistant", "content": content });
    if !reply.tool_calls.is_empty() {
        let calls: Vec<Value> = reply
            .tool_calls
            .iter()
            .map(|call| {
                json!({
                    "id": call.id,
                    "type": "function",
                    "function": { "name": call.name, "arguments": call.arguments },
                })
            })
            .collect();
        message["tool_calls"] = Value::Array(calls);
    }
    if !reply.reasoning.is_empty() {
        message["reasoning_content"] = Value::String(reply.reasoning.clone());
    }
    json!({
        "id": envelope.id,
        "object": "chat.completion",
        "created": envelope.created,
        "model": envelope.model,
        "choices": [{ "index": 0, "message": message, "finish_reason": finish_reason(reply) }],
        "usage": usage.to_json(),
    })
}

/// One step of a response body.
pub enum Frame {
    /// Bytes to send (one SSE event, or a piece of a JSON body).
    Data(Bytes),
    /// Drop the connection without ending the body properly.
    Abort,
}

/// SSE frame `data: <json>\n\n`.
fn event(value: &Value) -> Frame {
    Frame::Data(Bytes::from(format!("data: {value}\n\n")))
}

/// The frames of a streamed answer, in order:
///
/// 1. delta `{"role":"assistant","content":""}`;
/// 2. `{"reasoning_content": …}` deltas, then `{"content": …}` deltas of ~3 words each;
/// 3. per tool call, a delta with its `index`, `id`, `type`, `name` and empty `arguments`,
///    followed by 2–3 deltas carrying pieces of the arguments text;
/// 4. an empty delta with `finish_reason` (`"tool_calls"` or `"stop"`);
/// 5. with `usage` (the request asked `stream_options.include_usage`), a chunk with
///    `"choices":[]` and `usage`;
/// 6. `data: [DONE]`.
///
/// `malformed: "chunk"` inserts `data: {not json` half-way through the deltas;
/// `malformed: "truncate"` sends the role and reasoning deltas, the first half of the content
/// (or, without content, the first tool call's header and the first half of its arguments),
/// then [`Frame::Abort`].
pub fn stream(envelope: &Envelope, reply: &Reply, usage: Option<Usage>) -> Vec<Frame> {
    let mut frames = vec![event(
        &envelope.chunk(json!({ "role": "assistant", "content": "" }), None),
    )];
    for piece in split_words(&reply.reasoning) {
        frames.push(event(
            &envelope.chunk(json!({ "reasoning_content": piece }), None),
        ));
    }

    if reply.malformed == Some(Malformed::Truncate) {
        let half_text = first_half(&reply.text);
        for piece in split_words(half_text) {
            frames.push(event(&envelope.chunk(json!({ "content": piece }), None)));
        }
        if half_text.is_empty()
            && let Some(call) = reply.tool_calls.first()
        {
            frames.push(event(&envelope.chunk(tool_call_header(0, call), None)));
            let half_arguments = first_half(&call.arguments);
            frames.push(event(
                &envelope.chunk(tool_call_arguments(0, half_arguments), None),
            ));
        }
        frames.push(Frame::Abort);
        return frames;
    }

    for piece in split_words(&reply.text) {
        frames.push(event(&envelope.chunk(json!({ "content": piece }), None)));
    }
    for (index, call) in reply.tool_calls.iter().enumerate() {
        frames.push(event(&envelope.chunk(tool_call_header(index, call), None)));
        for piece in split_arguments(&call.arguments) {
            frames.push(event(
                &envelope.chunk(tool_call_arguments(index, piece), None),
            ));
        }
    }
    if reply.malformed == Some(Malformed::Chunk) {
        let middle = (frames.len() / 2).max(1);
        frames.insert(
            middle,
            Frame::Data(Bytes::from_static(MALFORMED_LINE.as_bytes())),
        );
    }

    frames.push(event(
        &envelope.chunk(json!({}), Some(finish_reason(reply))),
    ));
    if let Some(usage) = usage {
        frames.push(event(&json!({
            "id": envelope.id,
            "object": "chat.completion.chunk",
            "created": envelope.created,
            "model": envelope.model,
            "choices": [],
            "usage": usage.to_json(),
        })));
    }
    frames.push(Frame::Data(Bytes::from_static(b"data: [DONE]\n\n")));
    frames
}

/// First delta of tool call `index`: everything but the arguments.
fn tool_call_header(index: usize, call: &ToolCall) -> Value {
    json!({ "tool_calls": [{
        "index": index,
        "id": call.id,
        "type": "function",
        "function": { "name": call.name, "arguments": "" },
    }] })
}

/// A later delta of tool call `index`: one piece of its arguments text.
fn tool_call_arguments(index: usize, piece: &str) -> Value {
    json!({ "tool_calls": [{ "index": index, "function": { "arguments": piece } }] })
}

/// Splits `text` into pieces of [`WORDS_PER_CHUNK`] words, each keeping the whitespace that
/// follows it, so the pieces concatenate back to `text`. Empty text gives no pieces.
fn split_words(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let (mut start, mut words, mut in_word) = (0, 0, false);
    for (at, c) in text.char_indices() {
        if c.is_whitespace() {
            if in_word {
                in_word = false;
                words += 1;
            }
        } else if !in_word {
            if words == WORDS_PER_CHUNK {
                pieces.push(&text[start..at]);
                start = at;
                words = 0;
            }
            in_word = true;
        }
    }
    if start < text.len() {
        pieces.push(&text[start..]);
    }
    pieces
}

/// Splits an arguments text into 3 pieces of about equal length (2 when it is shorter than 3
/// characters; pieces may then be empty), on character boundaries.
fn split_arguments(arguments: &str) -> Vec<&str> {
    let boundaries: Vec<usize> = arguments
        .char_indices()
        .map(|(at, _)| at)
        .chain([arguments.len()])
        .collect();
    let chars = boundaries.len() - 1;
    let pieces = if chars >= 3 { 3 } else { 2 };
    (0..pieces)
        .map(|k| {
            let from = boundaries[chars * k / pieces];
            let to = boundaries[chars * (k + 1) / pieces];
            &arguments[from..to]
        })
        .collect()
}

/// The first half of `text`, by characters.
pub fn first_half(text: &str) -> &str {
    let half = text.chars().count() / 2;
    let end = text
        .char_indices()
        .nth(half)
        .map_or(text.len(), |(at, _)| at);
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_pieces_concatenate_back() {
        let text = "  one two three four\nfive  six seven";
        let pieces = split_words(text);
        assert_eq!(pieces, ["  one two three ", "four\nfive  six ", "seven"]);
        assert_eq!(pieces.concat(), text);
        assert!(split_words("").is_empty());
    }

    #[test]
    fn argument_pieces_concatenate_back() {
        for arguments in ["", "{", "{}", "{\"a\":1}", "{\"é\":\"ü\"}"] {
            let pieces = split_arguments(arguments);
            assert!((2..=3).contains(&pieces.len()));
            assert_eq!(pieces.concat(), arguments);
        }
    }
}
