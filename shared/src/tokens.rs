//! Approximate token counting with a real BPE tokenizer (tiktoken-rs, `o200k_base`).
//!
//! Counts are exact for OpenAI models of that encoding and approximate for every other family
//! (Llama, GLM, Mistral tokenizers differ by roughly ±20%); they are used for budgeting and
//! compaction thresholds, never for billing.

use std::sync::OnceLock;

use tiktoken_rs::CoreBPE;

fn bpe() -> &'static CoreBPE {
    static BPE: OnceLock<CoreBPE> = OnceLock::new();
    BPE.get_or_init(|| tiktoken_rs::o200k_base().expect("o200k_base is embedded in tiktoken-rs"))
}

/// Tokens of `text` (ordinary tokens; special tokens are counted as text).
pub fn estimate_text(text: &str) -> usize {
    if text.is_empty() {
        return 0;
    }
    bpe().encode_ordinary(text).len()
}

/// Approximate tokens of one chat message: its text, tool calls and reasoning, plus 4 tokens of
/// per-message framing (OpenAI's documented chat overhead).
pub fn estimate_message(content: &serde_json::Value, tool_calls: Option<&serde_json::Value>) -> usize {
    let text = crate::messages::content_text(content);
    4 + estimate_text(&text) + tool_calls.map_or(0, |t| estimate_text(&t.to_string()))
}

/// Loads the tokenizer (≈1 s in debug builds) so the first request or slice does not stall an
/// async executor thread. Call once at start-up, off the async threads.
pub async fn warm_up() {
    let _ = tokio::task::spawn_blocking(|| estimate_text("warm up")).await;
}
