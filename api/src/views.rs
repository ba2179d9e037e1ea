//! Client-facing JSON views built from rows (SPEC §10, §13).

use agentloop_shared::messages::{self, Message};
use agentloop_shared::runs::Run;
use agentloop_shared::threads::Thread;
use diesel_async::AsyncPgConnection;
use serde_json::{Value, json};

/// Messages from the start of a thread in a window (SPEC §10).
pub const WINDOW_HEAD: i64 = 20;
/// Messages from the end of a thread in a window.
pub const WINDOW_TAIL: i64 = 100;
/// Byte bound of the head part (128 KiB).
pub const WINDOW_HEAD_BYTES: usize = 128 * 1024;
/// Byte bound of the tail part (384 KiB).
pub const WINDOW_TAIL_BYTES: usize = 384 * 1024;

/// Refresh signature: changes whenever the message count/last sequence, the streaming state or
/// the run state change, so a client can skip refetching when it is equal (SPEC §10).
pub fn sig(thread: &Thread, run: Option<&Run>) -> String {
    let streaming = thread
        .streaming_message
        .as_ref()
        .and_then(|s| s.get("content"))
        .and_then(Value::as_str)
        .map_or(0, str::len);
    let run = run.map_or_else(|| "none".to_owned(), |r| format!("{}:{}:{}", r.id.simple(), r.status, r.steps_used));
    format!("{}.{}.{}.{}", thread.message_count, thread.last_sequence, streaming, run)
}

/// A thread's JSON with the fields every view shares.
pub fn thread_json(thread: &Thread) -> Value {
    serde_json::to_value(thread).unwrap_or_default()
}

/// The run JSON or null.
pub fn run_json(run: Option<&Run>) -> Value {
    run.map_or(Value::Null, Run::to_json)
}

/// The streaming partial message, or null.
pub fn streaming_json(thread: &Thread) -> Value {
    thread.streaming_message.clone().unwrap_or(Value::Null)
}

/// A message's JSON; content longer than `max_bytes` is cut with a marker and `truncated: true`.
pub fn message_json(message: &Message, max_bytes: usize) -> Value {
    let mut value = serde_json::to_value(message).unwrap_or_default();
    if message.byte_size as usize > max_bytes {
        let text = message.text();
        let mut cut = max_bytes.min(text.len());
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        value["content"] = json!(format!("{}\n…[{} bytes omitted]", &text[..cut], text.len() - cut));
        value["truncated"] = json!(true);
    }
    value
}

/// Takes messages in order until `budget` bytes are used (at least one, truncated if huge).
fn bounded(messages: impl Iterator<Item = Message>, budget: usize) -> Vec<Value> {
    let mut used = 0usize;
    let mut out = Vec::new();
    for m in messages {
        let size = m.byte_size.max(0) as usize;
        if !out.is_empty() && used + size > budget {
            break;
        }
        used += size.min(budget);
        out.push(message_json(&m, budget));
    }
    out
}

/// The thread window: at most [`WINDOW_HEAD`] messages from the start and [`WINDOW_TAIL`] from
/// the end, byte-bounded, plus `messageWindow` ranges naming what was omitted. Two index range
/// scans whatever the thread's length.
pub async fn window(conn: &mut AsyncPgConnection, thread: &Thread) -> diesel::QueryResult<Value> {
    let (head, tail) = messages::head_and_tail(conn, thread.id, WINDOW_HEAD, WINDOW_TAIL).await?;
    let head_last = head.last().map(|m| m.sequence);
    let tail: Vec<Message> = tail.into_iter().filter(|m| head_last.is_none_or(|h| m.sequence > h)).collect();
    let head_json = bounded(head.into_iter(), WINDOW_HEAD_BYTES);
    let mut tail_json = bounded(tail.into_iter().rev(), WINDOW_TAIL_BYTES);
    tail_json.reverse();
    let range = |v: &[Value]| {
        json!({
            "first": v.first().and_then(|m| m.get("sequence")).cloned(),
            "last": v.last().and_then(|m| m.get("sequence")).cloned(),
            "count": v.len(),
        })
    };
    let shown = head_json.len() + tail_json.len();
    let omitted = (thread.message_count as usize).saturating_sub(shown);
    let window = json!({
        "head": range(&head_json),
        "tail": range(&tail_json),
        "omitted": {
            "after": head_json.last().and_then(|m| m.get("sequence")).cloned(),
            "before": tail_json.first().and_then(|m| m.get("sequence")).cloned(),
            "count": omitted,
        },
    });
    let mut messages = head_json;
    messages.extend(tail_json);
    Ok(json!({"messages": messages, "messageWindow": window}))
}
