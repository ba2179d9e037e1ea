//! Automatic thread titles (issue 11 "Threads"): after the first answer of an untitled thread
//! (the api marks a thread created without a title `metadata.autoTitle`, so the worker knows
//! without a query; runs of other threads cost nothing extra),
//! one cheap model call proposes a short title; when the model is slow ([`MODEL_TIMEOUT`]),
//! fails, answers nothing usable, or too many titles are being made at once
//! ([`MAX_CONCURRENT`]), the first words of the user's first message are used instead.
//!
//! It runs in a task of its own AFTER the run's final commit, so it never delays or fails the
//! run. It is idempotent and bounded: `agentloop_auto_title` sets a title only while the thread
//! is untitled (a rename always wins), at most [`MAX_CONCURRENT`] model calls run per worker, and
//! each is cut at [`MODEL_TIMEOUT`]. A worker that dies before the title is written leaves the
//! thread untitled; its next first-turn answer (after an edit) tries again, and the UI shows the
//! first words meanwhile.

use std::sync::Arc;
use std::time::Duration;

use agentloop_shared::provider::catalog::ModelConfig;
use agentloop_shared::provider::client::{ChatRequest, ProviderClient};
use agentloop_shared::store::Store;
use serde_json::json;
use tokio::sync::Semaphore;
use tracing::Instrument;
use uuid::Uuid;

/// Model calls for titles one worker makes at once; beyond it the first words are used.
pub const MAX_CONCURRENT: usize = 2;
/// Longest wait for the title model call.
pub const MODEL_TIMEOUT: Duration = Duration::from_secs(10);
/// Words of the fallback title.
const FALLBACK_WORDS: usize = 6;
/// Longest title kept, in characters.
const MAX_CHARS: usize = 80;
/// Characters of the first message and of the answer the model reads.
const EXCERPT_CHARS: usize = 1_500;

/// Start of the system prompt of a title request (the test mock model recognises it).
pub const TITLE_PROMPT: &str = "You write conversation titles. Reply with a short title (at most 6 words) for the conversation below: \
no quotes, no punctuation at the end, nothing else.";

/// The title makers of one worker process.
pub struct Titles {
    permits: Arc<Semaphore>,
}

impl Default for Titles {
    fn default() -> Self {
        Self { permits: Arc::new(Semaphore::new(MAX_CONCURRENT)) }
    }
}

impl Titles {
    /// Titles thread `thread_id` in the background if it is still untitled: `question` is the
    /// user's first message, `answer` the first answer.
    pub fn spawn(&self, store: Store, provider: ProviderClient, model: ModelConfig, thread_id: Uuid, question: String, answer: String) {
        let permits = self.permits.clone();
        // A child of the slice span: the title's model call joins the run's trace.
        let span = tracing::info_span!("title", thread.id = %thread_id);
        tokio::spawn(async move {
            match agentloop_shared::commands::needs_title(&store, thread_id).await {
                Ok(true) => {}
                Ok(false) => return,
                Err(error) => {
                    tracing::debug!(%error, thread.id = %thread_id, "title check failed; skipped");
                    return;
                }
            }
            let proposed = match permits.try_acquire() {
                Ok(_permit) => match tokio::time::timeout(MODEL_TIMEOUT, propose(&provider, &model, &question, &answer)).await {
                    Ok(Some(title)) => Some(title),
                    Ok(None) => None,
                    Err(_) => {
                        tracing::info!(thread.id = %thread_id, "title model call timed out; using the first words");
                        None
                    }
                },
                Err(_) => None,
            };
            let title = proposed.unwrap_or_else(|| first_words(&question));
            if title.is_empty() {
                return;
            }
            if let Err(error) = agentloop_shared::commands::auto_title(&store, thread_id, &title).await {
                tracing::warn!(%error, thread.id = %thread_id, "could not store the automatic title");
            }
        }.instrument(span));
    }
}

/// Asks the model for a title; `None` when it fails or answers nothing usable.
async fn propose(provider: &ProviderClient, model: &ModelConfig, question: &str, answer: &str) -> Option<String> {
    let request = ChatRequest {
        messages: vec![
            json!({"role": "system", "content": TITLE_PROMPT}),
            json!({"role": "user", "content": format!("User: {}\n\nAssistant: {}", excerpt(question), excerpt(answer))}),
        ],
        tools: Vec::new(),
        tool_choice: None,
        max_tokens: Some(24),
        temperature: Some(0.2),
    };
    match provider.stream_chat(model, &request, &mut |_| {}).await {
        Ok(turn) => Some(clean(&turn.content)).filter(|t| !t.is_empty()),
        Err(error) => {
            tracing::info!(%error, "title model call failed; using the first words");
            None
        }
    }
}

fn excerpt(text: &str) -> String {
    text.chars().take(EXCERPT_CHARS).collect()
}

/// The first line of a model's answer without quotes, a `Title:` label or trailing punctuation,
/// at most [`MAX_CHARS`] characters.
pub fn clean(raw: &str) -> String {
    let line = raw.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or_default();
    let line = line.strip_prefix("Title:").or_else(|| line.strip_prefix("title:")).unwrap_or(line).trim();
    let line = line.trim_matches(|c: char| matches!(c, '"' | '\'' | '*' | '#' | '`' | '“' | '”')).trim();
    let line = line.trim_end_matches(['.', '!', ':', ';', ',']).trim();
    cut(line)
}

/// The first [`FALLBACK_WORDS`] words of the user's message, at most [`MAX_CHARS`] characters.
pub fn first_words(text: &str) -> String {
    let words: Vec<&str> = text.split_whitespace().take(FALLBACK_WORDS).collect();
    let mut title = cut(&words.join(" "));
    if text.split_whitespace().count() > FALLBACK_WORDS {
        title.push('…');
    }
    title
}

fn cut(s: &str) -> String {
    if s.chars().count() <= MAX_CHARS {
        return s.to_owned();
    }
    let mut out: String = s.chars().take(MAX_CHARS - 1).collect();
    out.push('…');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cleaning_and_fallback() {
        assert_eq!(clean("  \n\"Paris trip planning.\"\nmore"), "Paris trip planning");
        assert_eq!(clean("Title: **Rust lifetimes**"), "Rust lifetimes");
        assert_eq!(first_words("What is 12*7? Use the calculator please now"), "What is 12*7? Use the calculator…");
        assert_eq!(first_words("short one"), "short one");
        assert_eq!(first_words(&"x".repeat(200)).chars().count(), MAX_CHARS);
    }
}
