//! Built-in tools: `calculator`, `current_time`, `sleep`. All are idempotent (no external
//! effects), so they never go through the `operations` protocol.

use std::time::Duration;

use chrono::{SecondsFormat, Utc};
use futures_util::future::BoxFuture;
use serde_json::{Value, json};

use super::{Tool, ToolContext, ToolError};

/// Options of the built-in tools and the registry (flattened by the worker's CLI).
#[derive(Debug, Clone, clap::Args)]
pub struct BuiltinToolConfig {
    /// Longest pause the `sleep` tool grants, in seconds; longer requests are capped.
    #[arg(
        long = "tool-max-sleep-seconds",
        env = "TOOL_MAX_SLEEP_SECONDS",
        default_value_t = 30
    )]
    pub max_sleep_seconds: u64,

    /// Tool results longer than this many bytes keep only their head and tail.
    #[arg(long = "tool-max-result-bytes", env = "TOOL_MAX_RESULT_BYTES", default_value_t = 16 * 1024)]
    pub max_result_bytes: usize,
}

impl Default for BuiltinToolConfig {
    fn default() -> Self {
        Self {
            max_sleep_seconds: 30,
            max_result_bytes: 16 * 1024,
        }
    }
}

/// `calculator {"expression": string}`: evaluates arithmetic with `exmex` (`+ - * / ^`,
/// parentheses, `sqrt`, `abs`, `sin`/`cos`/`tan`, `exp`, `ln`/`log10`/`log2`, `floor`/`ceil`/
/// `round`, `min`/`max`, constants `PI`, `E`). Returns the number, integers without `.0`.
/// Errors: unparsable expressions, division by zero and other non-finite results.
#[derive(Debug, Clone, Copy)]
pub struct Calculator;

impl Tool for Calculator {
    fn name(&self) -> &str {
        "calculator"
    }

    fn description(&self) -> &str {
        "Evaluate an arithmetic expression exactly, e.g. \"(2 + 3) * 4 ^ 2 / sqrt(16)\". \
         Supports + - * / ^, parentheses, sqrt, abs, sin, cos, tan, exp, ln, log10, log2, \
         floor, ceil, round, min, max and the constants PI and E."
    }

    fn parameters(&self) -> Value {
        json!({
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "The expression to evaluate."}
            },
            "required": ["expression"],
            "additionalProperties": false
        })
    }

    fn idempotent(&self) -> bool {
        true
    }

    fn call(
        &self,
        args: Value,
        _ctx: ToolContext,
    ) -> BoxFuture<'static, Result<String, ToolError>> {
        let expression = args["expression"]
            .as_str()
            .unwrap_or_default()
            .trim()
            .to_owned();
        Box::pin(async move {
            let value = exmex::eval_str::<f64>(&expression)
                .map_err(|e| ToolError::Failed(format!("cannot evaluate `{expression}`: {e}")))?;
            if !value.is_finite() {
                return Err(ToolError::Failed(format!(
                    "`{expression}` has no finite value (division by zero or outside a function's domain)"
                )));
            }
            Ok(format_number(value))
        })
    }
}

/// `current_time {"timezone"?: string}`: the current time as an RFC 3339 UTC timestamp with
/// second precision (`2026-11-30T12:00:00Z`). Only `UTC` (any case) is supported; any other
/// timezone is an error.
#[derive(Debug, Clone, Copy)]
pub struct CurrentTime;

impl Tool for CurrentTime {
    fn name(&self) -> &str {
        "current_time"
    }

    fn description(&self) -> &str {
        "Get the current date and time as an RFC 3339 timestamp in UTC."
    }

    fn parameters(&self) -> Value {
        json!({
            "type": "object",
            "properties": {
                "timezone": {"type": "string", "description": "Only \"UTC\" is supported (the default)."}
            },
            "additionalProperties": false
        })
    }

    fn idempotent(&self) -> bool {
        true
    }

    fn call(
        &self,
        args: Value,
        _ctx: ToolContext,
    ) -> BoxFuture<'static, Result<String, ToolError>> {
        let timezone = args["timezone"].as_str().map(str::to_owned);
        Box::pin(async move {
            match timezone {
                Some(tz) if !tz.eq_ignore_ascii_case("utc") => Err(ToolError::InvalidArguments(
                    format!("unsupported timezone `{tz}`: only UTC is supported"),
                )),
                _ => Ok(Utc::now().to_rfc3339_opts(SecondsFormat::Secs, true)),
            }
        })
    }
}

/// `sleep {"seconds": number}`: waits, capped at `max_seconds`, and returns
/// `slept N seconds` (noting a cap). Negative durations are an error; cancellation of the
/// context ends it at once with [`ToolError::Cancelled`].
#[derive(Debug, Clone, Copy)]
pub struct Sleep {
    /// Cap on the requested duration, in seconds.
    pub max_seconds: u64,
}

impl Tool for Sleep {
    fn name(&self) -> &str {
        "sleep"
    }

    fn description(&self) -> &str {
        "Wait for a number of seconds before continuing."
    }

    fn parameters(&self) -> Value {
        json!({
            "type": "object",
            "properties": {
                "seconds": {
                    "type": "number",
                    "description": format!("Seconds to wait (at most {}).", self.max_seconds)
                }
            },
            "required": ["seconds"],
            "additionalProperties": false
        })
    }

    fn idempotent(&self) -> bool {
        true
    }

    fn call(&self, args: Value, ctx: ToolContext) -> BoxFuture<'static, Result<String, ToolError>> {
        let requested = args["seconds"].as_f64().unwrap_or_default();
        let max_seconds = self.max_seconds;
        Box::pin(async move {
            if requested < 0.0 {
                return Err(ToolError::InvalidArguments(
                    "seconds must not be negative".into(),
                ));
            }
            let seconds = requested.min(max_seconds as f64);
            tokio::select! {
                () = ctx.cancel.cancelled() => return Err(ToolError::Cancelled),
                () = tokio::time::sleep(Duration::from_secs_f64(seconds)) => {}
            }
            Ok(if seconds < requested {
                format!(
                    "slept {max_seconds} seconds (capped: {} requested)",
                    format_number(requested)
                )
            } else {
                format!("slept {} seconds", format_number(seconds))
            })
        })
    }
}

/// Formats a finite number rounded to 15 significant digits: integers below 1e15 without a
/// fraction (`4`, not `4.0`), very large or small magnitudes in exponent form (`1e20`).
fn format_number(value: f64) -> String {
    let value: f64 = format!("{value:.14e}").parse().unwrap_or(value);
    let magnitude = value.abs();
    if value.fract() == 0.0 && magnitude < 1e15 {
        format!("{}", value as i64)
    } else if !(1e-6..1e15).contains(&magnitude) {
        format!("{value:e}")
    } else {
        format!("{value}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_util::sync::CancellationToken;

    fn ctx() -> ToolContext {
        ToolContext {
            credential: None,
            idempotency_key: "k".into(),
            cancel: CancellationToken::new(),
        }
    }

    async fn calc(expression: &str) -> Result<String, ToolError> {
        Calculator
            .call(json!({ "expression": expression }), ctx())
            .await
    }

    #[tokio::test]
    async fn calculator_evaluates() {
        for (expression, expected) in [
            ("2 + 3 * 4", "14"),
            ("(2 + 3) * 4", "20"),
            ("2 ^ 10", "1024"),
            ("7 / 2", "3.5"),
            ("-8 + 3", "-5"),
            ("sqrt(16) + abs(-2)", "6"),
            ("0.1 + 0.2", "0.3"),
            ("10 ^ 20", "1e20"),
            ("round(PI * 100) / 100", "3.14"),
        ] {
            assert_eq!(calc(expression).await.unwrap(), expected, "{expression}");
        }
    }

    #[tokio::test]
    async fn calculator_errors() {
        for expression in ["1 / 0", "0 / 0", "sqrt(-1)", "2 +", "x + 1", ""] {
            assert!(
                matches!(calc(expression).await, Err(ToolError::Failed(_))),
                "{expression}"
            );
        }
    }

    #[tokio::test]
    async fn current_time_is_utc_rfc3339() {
        for args in [
            json!({}),
            json!({"timezone": "UTC"}),
            json!({"timezone": "utc"}),
        ] {
            let text = CurrentTime.call(args, ctx()).await.unwrap();
            let parsed = chrono::DateTime::parse_from_rfc3339(&text).unwrap();
            assert!(text.ends_with('Z'));
            assert!(
                (Utc::now() - parsed.with_timezone(&Utc))
                    .num_seconds()
                    .abs()
                    < 5
            );
        }
        let err = CurrentTime
            .call(json!({"timezone": "Europe/Paris"}), ctx())
            .await;
        assert!(matches!(err, Err(ToolError::InvalidArguments(_))));
    }

    #[tokio::test]
    async fn sleep_caps_and_cancels() {
        let sleep = Sleep { max_seconds: 0 };
        assert_eq!(
            sleep.call(json!({"seconds": 0}), ctx()).await.unwrap(),
            "slept 0 seconds"
        );
        assert_eq!(
            sleep.call(json!({"seconds": 2.5}), ctx()).await.unwrap(),
            "slept 0 seconds (capped: 2.5 requested)"
        );
        assert!(matches!(
            sleep.call(json!({"seconds": -1}), ctx()).await,
            Err(ToolError::InvalidArguments(_))
        ));
        let short = Sleep { max_seconds: 30 };
        assert_eq!(
            short.call(json!({"seconds": 0.01}), ctx()).await.unwrap(),
            "slept 0.01 seconds"
        );
        let ctx = ctx();
        ctx.cancel.cancel();
        assert_eq!(
            short.call(json!({"seconds": 30}), ctx).await,
            Err(ToolError::Cancelled)
        );
    }
}
