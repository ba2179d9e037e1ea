//! Compaction (SPEC §8; seed 000 "Context accounting and compaction"): one routine for
//! automatic (threshold) and manual compaction.
//!
//! Rules: keep the leading system/developer instructions and a verbatim recent tail
//! (`compactRecentMessages`, default 12, min 4) and never split a tool group; summarise the
//! middle (earlier summaries included: they are folded, never kept as instructions) in batches
//! of at most `compactChunkTokens` (default 60,000, min 8,000), bounding huge single values
//! head/tail; reduce hierarchically for at most 4 passes until the summary is within
//! `max(2,000, threshold / 4)` tokens; accept only non-empty text that is strictly smaller than
//! what it replaces. Summarisation calls write no history and no usage to the thread.

use futures_util::future::BoxFuture;
use serde_json::Value;

use crate::context::{ContextMessage, is_summary};
use crate::messages::{content_text, role};
use crate::tokens;

/// Default `compactChunkTokens`.
pub const DEFAULT_CHUNK_TOKENS: i64 = 60_000;
/// Minimum `compactChunkTokens`.
pub const MIN_CHUNK_TOKENS: i64 = 8_000;
/// Default `compactRecentMessages`.
pub const DEFAULT_RECENT_MESSAGES: usize = 12;
/// Minimum `compactRecentMessages`.
pub const MIN_RECENT_MESSAGES: usize = 4;
/// Most summarisation passes (the first over the middle, then reductions).
pub const MAX_PASSES: usize = 4;
/// Threshold when the model has no configured context limit (tokens).
pub const FALLBACK_THRESHOLD: i64 = 80_000;
/// Threshold as a share of the model's context limit.
pub const THRESHOLD_RATIO: f64 = 0.8;
/// A single value longer than this (characters) is cut to head + tail when rendered.
pub const MAX_VALUE_CHARS: usize = 8_000;

/// Compaction settings of a thread (from its `metadata` and the model's context limit).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// Context size (tokens) above which automatic compaction runs.
    pub threshold: i64,
    /// Token budget of one summarisation batch.
    pub chunk_tokens: i64,
    /// Messages kept verbatim at the end.
    pub recent_messages: usize,
}

impl Settings {
    /// Reads `metadata.compactThreshold` (a share of the limit when ≤ 1, else tokens),
    /// `compactChunkTokens` and `compactRecentMessages`, clamped to their bounds.
    pub fn from_metadata(metadata: &Value, context_limit: Option<u32>) -> Self {
        let default_threshold = context_limit.map_or(FALLBACK_THRESHOLD, |l| (l as f64 * THRESHOLD_RATIO) as i64);
        let threshold = match metadata.get("compactThreshold").and_then(Value::as_f64) {
            Some(v) if v > 0.0 && v <= 1.0 => context_limit.map_or(FALLBACK_THRESHOLD, |l| (l as f64 * v) as i64),
            Some(v) if v > 1.0 => v as i64,
            _ => default_threshold,
        };
        let chunk_tokens = metadata
            .get("compactChunkTokens")
            .and_then(Value::as_i64)
            .unwrap_or(DEFAULT_CHUNK_TOKENS)
            .max(MIN_CHUNK_TOKENS);
        let recent_messages = metadata
            .get("compactRecentMessages")
            .and_then(Value::as_u64)
            .map_or(DEFAULT_RECENT_MESSAGES, |v| v as usize)
            .max(MIN_RECENT_MESSAGES);
        Self { threshold: threshold.max(1), chunk_tokens, recent_messages }
    }

    /// Token target of the final summary: `max(2000, threshold / 4)`.
    pub fn summary_target(&self) -> i64 {
        (self.threshold / 4).max(2_000)
    }
}

/// The three parts of a context.
#[derive(Debug, Clone, PartialEq)]
pub struct Split {
    /// Leading system/developer instructions (summaries excluded).
    pub instructions: Vec<ContextMessage>,
    /// What gets summarised (earlier summaries included).
    pub middle: Vec<ContextMessage>,
    /// The verbatim recent tail; never starts inside a tool group.
    pub tail: Vec<ContextMessage>,
}

/// Splits `context` into instructions, middle and a tail of about `recent` messages, moving the
/// tail's start back so that an assistant tool call and its results stay together.
pub fn split(context: &[ContextMessage], recent: usize) -> Split {
    let instructions_end = context
        .iter()
        .position(|c| !matches!(c.message.role.as_str(), role::SYSTEM | role::DEVELOPER) || is_summary(&c.message))
        .unwrap_or(context.len());
    let mut tail_start = context.len().saturating_sub(recent).max(instructions_end);
    while tail_start > instructions_end && tail_start < context.len() && context[tail_start].message.role == role::TOOL {
        tail_start -= 1;
    }
    Split {
        instructions: context[..instructions_end].to_vec(),
        middle: context[instructions_end..tail_start].to_vec(),
        tail: context[tail_start..].to_vec(),
    }
}

/// Cuts `text` to at most `max` characters: head + an omission marker + tail.
pub fn bound(text: &str, max: usize) -> String {
    let count = text.chars().count();
    if count <= max {
        return text.to_owned();
    }
    let half = max / 2;
    let head: String = text.chars().take(half).collect();
    let tail: String = text.chars().skip(count - half).collect();
    format!("{head}\n…[{} characters omitted]…\n{tail}", count - 2 * half)
}

/// Renders messages as a plain transcript for the summariser (huge values bounded).
pub fn render(messages: &[ContextMessage]) -> String {
    let mut out = String::new();
    for c in messages {
        let m = &c.message;
        let text = bound(&content_text(&m.content), MAX_VALUE_CHARS);
        let label = if is_summary(m) {
            let body = text.trim_start_matches(crate::provider::projection::SUMMARY_MARKER).trim();
            out.push_str(&format!("[EARLIER SUMMARY]\n{body}\n\n"));
            continue;
        } else {
            m.role.to_uppercase()
        };
        if !text.trim().is_empty() {
            let tag = m.tool_call_id.as_deref().map_or(String::new(), |id| format!(" ({id})"));
            out.push_str(&format!("[{label}{tag}]\n{text}\n\n"));
        }
        for call in m.tool_calls.iter().flat_map(|c| c.as_array().into_iter().flatten()) {
            let name = call["function"]["name"].as_str().unwrap_or("?");
            let args = bound(call["function"]["arguments"].as_str().unwrap_or(""), MAX_VALUE_CHARS);
            let id = call["id"].as_str().unwrap_or("");
            out.push_str(&format!("[ASSISTANT CALLED {name} ({id})]\n{args}\n\n"));
        }
    }
    out
}

/// Groups messages into batches of at most `chunk_tokens`, never splitting an assistant tool
/// call from its results (a single group larger than the budget is a batch of its own).
pub fn batches(messages: &[ContextMessage], chunk_tokens: i64) -> Vec<Vec<ContextMessage>> {
    let mut groups: Vec<Vec<ContextMessage>> = Vec::new();
    for c in messages {
        let joins_group = c.message.role == role::TOOL && groups.last().is_some_and(|g| {
            g.first().is_some_and(|f| f.message.role == role::ASSISTANT && f.message.tool_calls.is_some())
        });
        if joins_group {
            groups.last_mut().expect("group").push(c.clone());
        } else {
            groups.push(vec![c.clone()]);
        }
    }
    let mut out: Vec<Vec<ContextMessage>> = Vec::new();
    let mut used = 0i64;
    for g in groups {
        let size: i64 = g.iter().map(|c| i64::from(c.message.token_estimate.max(1))).sum();
        if out.is_empty() || used + size > chunk_tokens {
            out.push(Vec::new());
            used = 0;
        }
        used += size;
        out.last_mut().expect("batch").extend(g);
    }
    out
}

/// Errors of compaction (stable codes for the run error).
#[derive(Debug, Clone, thiserror::Error)]
pub enum CompactionError {
    /// Nothing between the instructions and the recent tail.
    #[error("nothing to compact: the context is only instructions and the recent tail")]
    NothingToCompact,
    /// The summariser returned no text (or tool calls).
    #[error("the summariser returned no text")]
    EmptySummary,
    /// The summary was not smaller than what it replaces.
    #[error("the summary ({summary} tokens) is not smaller than the {input} tokens it replaces")]
    NotSmaller { summary: i64, input: i64 },
    /// The summarisation call failed.
    #[error("summarisation failed: {0}")]
    Model(String),
    /// The summariser was told to stop (a shutdown, a cancellation) before any part was
    /// summarised; with parts done, [`compact`] returns them as a partial compaction instead.
    #[error("compaction stopped before any part was summarised")]
    Stopped,
}

impl CompactionError {
    /// Stable error code.
    pub fn code(&self) -> &'static str {
        match self {
            Self::NothingToCompact => "compaction_nothing_to_compact",
            Self::EmptySummary | Self::NotSmaller { .. } => "compaction_failed",
            Self::Model(_) => "compaction_model_error",
            Self::Stopped => "compaction_stopped",
        }
    }
}

/// Produces summaries. `transcript` is rendered text; `target_tokens` the size to aim for.
pub trait Summarizer: Send + Sync {
    /// One summary; [`CompactionError::Stopped`] when the call was dropped by a stop.
    fn summarize(&self, transcript: String, target_tokens: i64) -> BoxFuture<'_, Result<String, CompactionError>>;

    /// Whether to start no further summarisation call (a shutdown, a cancellation): the parts
    /// already summarised are kept as a partial compaction (see [`compact`]).
    fn stopped(&self) -> bool {
        false
    }
}

/// Progress of a compaction: batch `part` of `of` in pass `pass`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub pass: usize,
    pub part: usize,
    pub of: usize,
}

/// A finished compaction.
#[derive(Debug, Clone)]
pub struct Compacted {
    pub instructions: Vec<ContextMessage>,
    /// The new summary (without marker).
    pub summary: String,
    /// Tokens of `summary`.
    pub summary_tokens: i64,
    /// Identities of the canonical rows the summary covers (excluding folded summaries).
    pub covered: Vec<i64>,
    /// Whether an earlier summary was folded in.
    pub folded_summary: bool,
    pub tail: Vec<ContextMessage>,
    /// Summarisation passes made (1..=4) and calls made.
    pub passes: usize,
    pub calls: usize,
    /// Tokens of the middle that was replaced.
    pub input_tokens: i64,
}

/// Compacts `context` with `settings`, calling `progress` before each summarisation call.
///
/// Paid summaries are never thrown away by a stop ([`Summarizer::stopped`] before a call, or a
/// call that ends [`CompactionError::Stopped`]): with `k >= 1` parts of the first pass
/// summarised, the result is a partial compaction covering those parts only — their summaries
/// joined, the rest of the middle kept verbatim ahead of the tail (a later compaction folds it
/// in); in a reduction pass, the previous pass's summaries are kept. Without any part done:
/// `Err(Stopped)`. Acceptance (verification of probe E): a SIGTERM during a 7-part compaction
/// started new summary calls after it and threw away the 4 already paid for.
pub async fn compact(
    context: &[ContextMessage],
    settings: &Settings,
    summarizer: &dyn Summarizer,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<Compacted, CompactionError> {
    let Split { instructions, middle, tail } = split(context, settings.recent_messages);
    if middle.is_empty() {
        return Err(CompactionError::NothingToCompact);
    }
    let target = settings.summary_target();
    let mut calls = 0;
    let parts = batches(&middle, settings.chunk_tokens);
    let mut summaries = Vec::with_capacity(parts.len());
    for (i, part) in parts.iter().enumerate() {
        if summarizer.stopped() {
            break;
        }
        progress(Progress { pass: 1, part: i + 1, of: parts.len() });
        let per_part = (target / parts.len() as i64).max(500);
        match summarizer.summarize(render(part), per_part).await {
            Ok(text) => summaries.push(checked(text)?),
            Err(CompactionError::Stopped) => break,
            Err(e) => return Err(e),
        }
        calls += 1;
    }
    if summaries.is_empty() {
        return Err(CompactionError::Stopped);
    }
    // The parts summarised (all of them unless stopped) and what stays verbatim.
    let done: Vec<ContextMessage> = parts[..summaries.len()].iter().flatten().cloned().collect();
    let mut tail = tail;
    if summaries.len() < parts.len() {
        let rest: Vec<ContextMessage> = parts[summaries.len()..].iter().flatten().cloned().collect();
        tail.splice(0..0, rest);
    }
    let input_tokens: i64 = done.iter().map(|c| i64::from(c.message.token_estimate.max(1))).sum();
    let mut summary = summaries.join("\n\n");
    let mut passes = 1;
    'reduce: while summaries.len() == parts.len() && tokens::estimate_text(&summary) as i64 > target && passes < MAX_PASSES {
        // Reduce: batch the partial summaries by the chunk budget and summarise each batch.
        let mut groups: Vec<String> = Vec::new();
        let mut used = 0i64;
        for s in &summaries {
            let size = tokens::estimate_text(s) as i64;
            if groups.is_empty() || used + size > settings.chunk_tokens {
                groups.push(String::new());
                used = 0;
            }
            used += size;
            let g = groups.last_mut().expect("group");
            g.push_str(s);
            g.push_str("\n\n");
        }
        let n = groups.len();
        let mut next = Vec::with_capacity(n);
        for (i, g) in groups.into_iter().enumerate() {
            if summarizer.stopped() {
                break 'reduce;
            }
            progress(Progress { pass: passes + 1, part: i + 1, of: n });
            match summarizer.summarize(format!("[EARLIER SUMMARY]\n{g}"), (target / n as i64).max(500)).await {
                Ok(text) => next.push(checked(text)?),
                Err(CompactionError::Stopped) => break 'reduce,
                Err(e) => return Err(e),
            }
            calls += 1;
        }
        passes += 1;
        summaries = next;
        summary = summaries.join("\n\n");
    }
    let summary_tokens = tokens::estimate_text(&summary) as i64;
    if summary_tokens >= input_tokens {
        return Err(CompactionError::NotSmaller { summary: summary_tokens, input: input_tokens });
    }
    Ok(Compacted {
        covered: done.iter().filter(|c| !is_summary(&c.message)).filter_map(|c| c.identity).collect(),
        folded_summary: done.iter().any(|c| is_summary(&c.message)),
        instructions,
        summary,
        summary_tokens,
        tail,
        passes,
        calls,
        input_tokens,
    })
}

fn checked(summary: String) -> Result<String, CompactionError> {
    let trimmed = summary.trim();
    if trimmed.is_empty() { Err(CompactionError::EmptySummary) } else { Ok(trimmed.to_owned()) }
}

/// The system prompt of summarisation calls: what a continuing agent needs.
pub const SUMMARY_PROMPT: &str = "You compress the earlier part of a conversation between a user and an AI agent that uses tools, so that the agent can continue the work without the original messages. Write a dense, factual summary in plain text (no preamble) with these headings:\n\
Goal: what the user ultimately wants, in their terms.\n\
Decisions and constraints: choices made, preferences and rules the user stated.\n\
Work done and evidence: what was done, which tools were called with which key inputs, and the results that matter (numbers, names, paths, ids, URLs, exact error messages).\n\
Identifiers: every id, file name, variable, URL or value the agent may need again, verbatim.\n\
Open issues: questions not yet answered, failures not yet resolved.\n\
Next step: what the agent was about to do.\n\
If the input contains an [EARLIER SUMMARY], merge it into this summary instead of repeating it. Never invent facts. Be as short as the content allows.";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::NewMessage;
    use serde_json::json;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn msg(role: &str, text: &str, id: i64) -> ContextMessage {
        ContextMessage { identity: Some(id), message: NewMessage::text(role, text) }
    }

    fn tool_group(id: i64) -> Vec<ContextMessage> {
        let mut call = NewMessage::text(role::ASSISTANT, "");
        call.tool_calls = Some(json!([{"id": format!("c{id}"), "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]));
        let mut result = NewMessage::text(role::TOOL, "4");
        result.tool_call_id = Some(format!("c{id}"));
        vec![ContextMessage { identity: Some(id), message: call }, ContextMessage { identity: Some(id + 1), message: result }]
    }

    struct Fixed(String, AtomicUsize);
    impl Summarizer for Fixed {
        fn summarize(&self, _t: String, _target: i64) -> BoxFuture<'_, Result<String, CompactionError>> {
            self.1.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move { Ok(self.0.clone()) })
        }
    }

    #[test]
    fn split_keeps_instructions_and_never_starts_the_tail_inside_a_tool_group() {
        let mut ctx = vec![msg(role::SYSTEM, "be nice", 1), msg(role::USER, "a", 2)];
        ctx.extend(tool_group(3));
        ctx.push(msg(role::ASSISTANT, "b", 5));
        let s = split(&ctx, 2); // naive tail would start at the tool result (index 3)
        assert_eq!(s.instructions.len(), 1);
        assert_eq!(s.tail.first().unwrap().message.role, role::ASSISTANT);
        assert!(s.tail.first().unwrap().message.tool_calls.is_some());
        assert_eq!(s.middle.len(), 1);
    }

    #[test]
    fn settings_follow_the_spec_defaults_and_bounds() {
        let s = Settings::from_metadata(&json!({}), Some(10_000));
        assert_eq!((s.threshold, s.chunk_tokens, s.recent_messages), (8_000, 60_000, 12));
        assert_eq!(Settings::from_metadata(&json!({}), None).threshold, 80_000);
        let s = Settings::from_metadata(&json!({"compactChunkTokens": 10, "compactRecentMessages": 1, "compactThreshold": 0.5}), Some(10_000));
        assert_eq!((s.threshold, s.chunk_tokens, s.recent_messages), (5_000, 8_000, 4));
        assert_eq!(s.summary_target(), 2_000);
    }

    #[test]
    fn batches_never_split_a_tool_group() {
        let mut ctx = Vec::new();
        for i in 0..50 {
            ctx.extend(tool_group(i * 2));
        }
        for b in batches(&ctx, 20) {
            assert_eq!(b.first().unwrap().message.role, role::ASSISTANT);
            assert_eq!(b.last().unwrap().message.role, role::TOOL);
        }
    }

    #[tokio::test]
    async fn compaction_folds_earlier_summaries_and_refuses_growth() {
        let mut ctx = vec![msg(role::SYSTEM, "rules", 1), crate::context::summary_message("old summary", 3)];
        for i in 0..30 {
            ctx.push(msg(if i % 2 == 0 { role::USER } else { role::ASSISTANT }, &"word ".repeat(200), 10 + i));
        }
        let settings = Settings::from_metadata(&json!({}), Some(8_000));
        let s = Fixed("short summary".into(), AtomicUsize::new(0));
        let out = compact(&ctx, &settings, &s, &mut |_| {}).await.unwrap();
        assert_eq!(out.instructions.len(), 1);
        assert!(out.folded_summary);
        assert_eq!(out.tail.len(), 12);
        assert_eq!(out.covered.len(), 18);
        let big = Fixed("word ".repeat(100_000), AtomicUsize::new(0));
        let err = compact(&ctx, &settings, &big, &mut |_| {}).await.unwrap_err();
        assert_eq!(err.code(), "compaction_failed");
        assert_eq!(big.1.load(Ordering::SeqCst), 1 + 3, "stops after 4 passes");
        let empty = Fixed("  ".into(), AtomicUsize::new(0));
        assert!(matches!(compact(&ctx, &settings, &empty, &mut |_| {}).await, Err(CompactionError::EmptySummary)));
    }

    /// Summarises until `stop_after` calls were made, then reports a stop: before the next call
    /// (`stopped`), or — with `drop_call` — by ending that call `Stopped`.
    struct Stopping {
        calls: AtomicUsize,
        stop_after: usize,
        drop_call: bool,
    }
    impl Summarizer for Stopping {
        fn summarize(&self, _t: String, _target: i64) -> BoxFuture<'_, Result<String, CompactionError>> {
            let n = self.calls.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move { if self.drop_call && n >= self.stop_after { Err(CompactionError::Stopped) } else { Ok(format!("summary {n}")) } })
        }
        fn stopped(&self) -> bool {
            !self.drop_call && self.calls.load(Ordering::SeqCst) >= self.stop_after
        }
    }

    /// A stop mid-compaction keeps the parts already summarised (they are paid for) as a
    /// partial compaction: the summaries of those parts, their rows covered, the rest of the
    /// middle kept verbatim ahead of the tail; no call is started after the stop. A stop before
    /// any part is `Stopped`.
    #[tokio::test]
    async fn a_stop_keeps_the_parts_already_summarised() {
        let mut ctx = vec![msg(role::SYSTEM, "rules", 1)];
        for i in 0..40 {
            ctx.push(msg(if i % 2 == 0 { role::USER } else { role::ASSISTANT }, &"word ".repeat(2_000), 10 + i));
        }
        let settings = Settings::from_metadata(&json!({"compactChunkTokens": 8000}), Some(200_000));
        let whole = compact(&ctx, &settings, &Fixed("s".into(), AtomicUsize::new(0)), &mut |_| {}).await.unwrap();
        assert!(whole.calls >= 4, "{} parts", whole.calls);
        for drop_call in [false, true] {
            let s = Stopping { calls: AtomicUsize::new(0), stop_after: 2, drop_call };
            let out = compact(&ctx, &settings, &s, &mut |_| {}).await.unwrap();
            let started = s.calls.load(Ordering::SeqCst);
            assert_eq!(started, if drop_call { 3 } else { 2 }, "no call after the stop");
            assert_eq!((out.calls, out.summary.as_str()), (2, "summary 0\n\nsummary 1"));
            let covered = out.covered.len();
            assert!(covered > 0 && covered < whole.covered.len(), "{covered} of {}", whole.covered.len());
            assert_eq!(out.tail.len(), whole.tail.len() + whole.covered.len() - covered, "the rest of the middle stays verbatim");
            assert_eq!(out.tail.first().unwrap().identity, Some(10 + covered as i64), "in order, right after the covered rows");
        }
        let s = Stopping { calls: AtomicUsize::new(0), stop_after: 0, drop_call: false };
        assert!(matches!(compact(&ctx, &settings, &s, &mut |_| {}).await, Err(CompactionError::Stopped)));
    }
}
