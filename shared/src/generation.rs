//! Per-thread generation settings and the input limit of a model (issue 11 "Models", "Input
//! limits up front").
//!
//! A thread's `metadata.maxTokens` (an upper bound of generated tokens per model call) and
//! `metadata.temperature` are sent to the provider as `max_tokens` / `temperature`. Without
//! `maxTokens`, a model with a known context limit gets [`default_max_tokens`]; one without a
//! known limit gets none (the provider's own default).
//!
//! The largest user turn a model accepts ([`max_input_tokens`]) is what its context can hold
//! next to the answer and the rest of a compacted context: `context − reserve − context / 8`,
//! where `reserve` is the thread's `maxTokens` (else the default) and the eighth is room for
//! instructions, tool schemas and a compaction summary. A model without a configured limit is
//! measured against [`FALLBACK_CONTEXT_TOKENS`] (the context whose 80% is compaction's
//! 80,000-token fallback threshold), so such a turn never needs a compaction that cannot help.

use serde_json::Value;

use crate::provider::catalog::ModelConfig;

/// Context assumed for a model without a configured limit (tokens): compaction's fallback
/// threshold (80,000) is 80% of it.
pub const FALLBACK_CONTEXT_TOKENS: u32 = 100_000;
/// Bounds of the default `max_tokens` (tokens).
pub const DEFAULT_MAX_TOKENS_MIN: u32 = 256;
pub const DEFAULT_MAX_TOKENS_MAX: u32 = 8_192;
/// Smallest `max_tokens` ever sent (tokens), even when the context is nearly full.
pub const MIN_MAX_TOKENS: u32 = 16;
/// Temperature bounds (OpenAI Chat Completions: 0 to 2).
pub const TEMPERATURE_MAX: f64 = 2.0;

/// The default `max_tokens` of a model: a quarter of its context, within 256..=8,192; `None`
/// when the model's context is not configured.
pub fn default_max_tokens(model: &ModelConfig) -> Option<u32> {
    model.context_tokens.map(|c| (c / 4).clamp(DEFAULT_MAX_TOKENS_MIN, DEFAULT_MAX_TOKENS_MAX))
}

/// The thread's `metadata.maxTokens`, if it is a positive integer.
pub fn metadata_max_tokens(metadata: &Value) -> Option<u32> {
    metadata.get("maxTokens").and_then(Value::as_u64).filter(|&n| n > 0).map(|n| n.min(u32::MAX as u64) as u32)
}

/// The thread's `metadata.temperature`, if it is a number within 0..=2.
pub fn metadata_temperature(metadata: &Value) -> Option<f32> {
    metadata.get("temperature").and_then(Value::as_f64).filter(|t| (0.0..=TEMPERATURE_MAX).contains(t)).map(|t| t as f32)
}

/// The largest user turn (tokens) `model` accepts under a thread whose metadata is `metadata`
/// (see the module docs), at least 1.
pub fn max_input_tokens(model: &ModelConfig, metadata: &Value) -> u32 {
    let context = model.context_tokens.unwrap_or(FALLBACK_CONTEXT_TOKENS);
    let reserve = metadata_max_tokens(metadata)
        .or_else(|| default_max_tokens(model))
        .unwrap_or(DEFAULT_MAX_TOKENS_MAX)
        .min(context / 2);
    context.saturating_sub(reserve).saturating_sub(context / 8).max(1)
}

/// `max_tokens` and `temperature` of one model call: the thread's settings (else the default),
/// and never more than what is left of the context after `context_tokens` (at least
/// [`MIN_MAX_TOKENS`]).
pub fn request_settings(model: &ModelConfig, metadata: &Value, context_tokens: i64) -> (Option<u32>, Option<f32>) {
    let max_tokens = metadata_max_tokens(metadata).or_else(|| default_max_tokens(model)).map(|n| match model.context_tokens {
        Some(limit) => n.min((i64::from(limit) - context_tokens).max(i64::from(MIN_MAX_TOKENS)) as u32),
        None => n,
    });
    (max_tokens, metadata_temperature(metadata))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn model(context: Option<u32>) -> ModelConfig {
        let mut m = crate::provider::catalog::ModelCatalog::from_env_vars("http://x/v1", None, "m", context).unwrap().models.remove(0);
        m.context_tokens = context;
        m
    }

    #[test]
    fn defaults_follow_the_context() {
        assert_eq!(default_max_tokens(&model(Some(4096))), Some(1024));
        assert_eq!(default_max_tokens(&model(Some(128_000))), Some(8192));
        assert_eq!(default_max_tokens(&model(Some(512))), Some(256));
        assert_eq!(default_max_tokens(&model(None)), None);
        assert_eq!(max_input_tokens(&model(Some(4096)), &json!({})), 4096 - 1024 - 512);
        assert_eq!(max_input_tokens(&model(None), &json!({})), 100_000 - 8192 - 12_500);
        assert_eq!(max_input_tokens(&model(Some(4096)), &json!({"maxTokens": 256})), 4096 - 256 - 512);
        // A reserve above half the context counts as half.
        assert_eq!(max_input_tokens(&model(Some(4096)), &json!({"maxTokens": 4000})), 4096 - 2048 - 512);
    }

    #[test]
    fn request_settings_fit_what_is_left() {
        let m = model(Some(4096));
        assert_eq!(request_settings(&m, &json!({}), 100), (Some(1024), None));
        assert_eq!(request_settings(&m, &json!({"temperature": 0.2}), 3500), (Some(596), Some(0.2)));
        assert_eq!(request_settings(&m, &json!({"maxTokens": 50}), 4090).0, Some(MIN_MAX_TOKENS));
        assert_eq!(request_settings(&model(None), &json!({"temperature": 3}), 10), (None, None));
        assert_eq!(request_settings(&model(None), &json!({"maxTokens": 77}), 10).0, Some(77));
    }
}
