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

/// Texts longer than this are counted in pieces of at most this many bytes.
///
/// BPE merges one regex piece (a run of letters, say) at a time, in memory and time that grow
/// faster than the piece: a 1 MB turn of one "word" took 2–3 s on an api thread and tens of MiB
/// while it ran (bench-hostile). Pieces cut before a whitespace where one is near, else at a
/// character boundary, keep both bounded; a cut through a word adds at most a token or two per
/// piece (an overcount of well under 0.1%), which budgeting tolerates.
pub const PIECE_BYTES: usize = 16 * 1024;

/// Tokens of `text` (ordinary tokens; special tokens are counted as text).
pub fn estimate_text(text: &str) -> usize {
    let mut total = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let mut end = rest.len();
        if end > PIECE_BYTES {
            end = PIECE_BYTES;
            while !rest.is_char_boundary(end) {
                end -= 1;
            }
            // Before the last whitespace of the piece's second half, if it has one (the
            // whitespace then leads the next piece's first word, as the tokenizer would see it).
            if let Some(space) = rest[..end].rfind(char::is_whitespace).filter(|&i| i >= end / 2) {
                end = space;
            }
        }
        total += bpe().encode_ordinary(&rest[..end]).len();
        rest = &rest[end..];
    }
    total
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_texts_are_counted_in_pieces_within_a_tenth_of_a_percent() {
        let short = "Hello, world! Ünïcödé and code: fn main() {}";
        assert_eq!(estimate_text(short), bpe().encode_ordinary(short).len());
        assert_eq!(estimate_text(""), 0);
        let prose = "The quick brown fox jumps over the lazy dog; ünïcödé — 数字 42.\n".repeat(3_000);
        assert!(prose.len() > 10 * PIECE_BYTES);
        let (pieces, whole) = (estimate_text(&prose), bpe().encode_ordinary(&prose).len());
        assert!(pieces.abs_diff(whole) <= whole / 1000, "pieces {pieces}, whole {whole}");
        // One 1 MB "word" (multi-byte characters, no whitespace): bounded pieces, still counted.
        let word = "é".repeat(500_000);
        let n = estimate_text(&word);
        assert!(n > 1_000 && n < word.len(), "{n}");
    }
}
