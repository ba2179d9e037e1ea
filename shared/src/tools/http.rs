//! HTTP tools from the tools file (`httpTools`): `POST <url>` with the validated argument
//! object as JSON and the call's stable key as `Idempotency-Key` (SPEC §7), so a receiver that
//! honours the header deduplicates a call that is retried after an explicit `retry` resolve.
//! Not idempotent unless configured: their calls go through the operations ledger.

use std::time::Duration;

use futures_util::future::BoxFuture;
use serde_json::{Value, json};

use super::config::HttpToolConfig;
use super::{Tool, ToolContext, ToolError};

/// One configured HTTP tool.
#[derive(Debug, Clone)]
pub struct HttpTool {
    config: HttpToolConfig,
    client: reqwest::Client,
}

impl HttpTool {
    /// A tool for `config`, sharing `client`.
    pub fn new(config: HttpToolConfig, client: reqwest::Client) -> Self {
        Self { config, client }
    }
}

impl Tool for HttpTool {
    fn name(&self) -> &str {
        &self.config.name
    }

    fn description(&self) -> &str {
        &self.config.description
    }

    fn parameters(&self) -> Value {
        self.config.parameters.clone().unwrap_or_else(|| json!({"type": "object", "properties": {}}))
    }

    fn idempotent(&self) -> bool {
        false
    }

    /// `Ok(body)` for a 2xx answer; `Failed("HTTP <status>: <body>")` otherwise, or the
    /// transport error.
    fn call(&self, args: Value, ctx: ToolContext) -> BoxFuture<'static, Result<String, ToolError>> {
        let mut request = self
            .client
            .post(&self.config.url)
            .timeout(Duration::from_millis(self.config.timeout_ms.unwrap_or(60_000)))
            .header("Idempotency-Key", &ctx.idempotency_key)
            .json(&args);
        for (name, value) in &self.config.headers {
            request = request.header(name, value);
        }
        let name = self.config.name.clone();
        Box::pin(async move {
            let response = request.send().await.map_err(|e| ToolError::Failed(format!("{name}: request failed: {e}")))?;
            let status = response.status();
            let body = response.text().await.map_err(|e| ToolError::Failed(format!("{name}: reading the answer: {e}")))?;
            if status.is_success() { Ok(body) } else { Err(ToolError::Failed(format!("HTTP {}: {body}", status.as_u16()))) }
        })
    }
}
