//! The operator's tool configuration: the JSON file named by `TOOLS_FILE` (worker).
//!
//! ```json
//! {
//!   "defaultPolicy": "auto",
//!   "tools": {
//!     "calculator": {"policy": "auto"},
//!     "sleep": {"policy": "ask"},
//!     "files__delete": {"policy": "deny"},
//!     "tickets__create": {"policy": "ask", "idempotent": false}
//!   },
//!   "mcpServers": [
//!     {"name": "tickets", "transport": "http", "url": "http://127.0.0.1:9000/mcp",
//!      "headers": {"Authorization": "Bearer ..."}, "policy": "ask"},
//!     {"name": "files", "transport": "stdio", "command": "mcp-files", "args": ["--root", "/srv"],
//!      "env": {"RUST_LOG": "warn"}}
//!   ],
//!   "httpTools": [
//!     {"name": "notify", "description": "Send a notification.", "url": "https://hooks.example/notify",
//!      "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}
//!   ]
//! }
//! ```
//!
//! Every key is optional. A tool's policy is, in order: its entry in `tools`, its MCP server's
//! `policy`, `defaultPolicy`, else `auto`. `idempotent` overrides what the tool declares (built-in
//! tools: idempotent; MCP tools: their `readOnlyHint`/`idempotentHint` annotations, else not;
//! HTTP tools: not, unless configured). MCP tools are named `<server>__<tool>`.

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

/// Approval policy of a tool (SPEC §6 step 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Runs without asking.
    #[default]
    Auto,
    /// Needs a human approval first: the run parks in `waiting_approval`.
    Ask,
    /// Never runs; the model gets an error result.
    Deny,
}

/// Per-tool settings.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ToolSettings {
    #[serde(default)]
    pub policy: Option<Policy>,
    /// Overrides whether the tool is idempotent (skips the operations ledger).
    #[serde(default)]
    pub idempotent: Option<bool>,
}

/// MCP transports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum McpTransport {
    /// Streamable HTTP (`url`).
    Http,
    /// A child process speaking MCP on stdin/stdout (`command`, `args`, `env`).
    Stdio,
}

/// One MCP server.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct McpServerConfig {
    /// Short name (`^[a-zA-Z0-9_-]+$`); its tools are offered as `<name>__<tool>`.
    pub name: String,
    pub transport: McpTransport,
    /// Endpoint of the `http` transport.
    #[serde(default)]
    pub url: Option<String>,
    /// Extra HTTP headers of the `http` transport (e.g. `Authorization`).
    #[serde(default)]
    pub headers: HashMap<String, String>,
    /// Program of the `stdio` transport.
    #[serde(default)]
    pub command: Option<String>,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: HashMap<String, String>,
    /// Default policy of this server's tools.
    #[serde(default)]
    pub policy: Option<Policy>,
    /// Connect/list timeout in ms (default 10,000).
    #[serde(default)]
    pub connect_timeout_ms: Option<u64>,
    /// Per-call timeout in ms (default 300,000).
    #[serde(default)]
    pub call_timeout_ms: Option<u64>,
}

/// A tool that POSTs its JSON arguments to a URL with an `Idempotency-Key` header.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpToolConfig {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub url: String,
    /// JSON Schema of the arguments (default: any object).
    #[serde(default)]
    pub parameters: Option<Value>,
    #[serde(default)]
    pub headers: HashMap<String, String>,
    /// Request timeout in ms (default 60,000).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

/// The whole `TOOLS_FILE`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ToolsConfig {
    #[serde(default)]
    pub default_policy: Option<Policy>,
    #[serde(default)]
    pub tools: HashMap<String, ToolSettings>,
    #[serde(default)]
    pub mcp_servers: Vec<McpServerConfig>,
    #[serde(default)]
    pub http_tools: Vec<HttpToolConfig>,
}

/// Errors loading the tools file.
#[derive(Debug, thiserror::Error)]
pub enum ToolsConfigError {
    #[error("cannot read {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("invalid tools file {path}: {source}")]
    Parse { path: String, source: serde_json::Error },
    #[error("invalid tools file: {0}")]
    Invalid(String),
}

impl ToolsConfig {
    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Self, ToolsConfigError> {
        let display = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ToolsConfigError::Read { path: display.clone(), source })?;
        let config: Self = serde_json::from_str(&text).map_err(|source| ToolsConfigError::Parse { path: display, source })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks names and transport fields.
    pub fn validate(&self) -> Result<(), ToolsConfigError> {
        let valid = |s: &str| !s.is_empty() && s.len() <= 64 && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        let mut names = std::collections::HashSet::new();
        for server in &self.mcp_servers {
            if !valid(&server.name) || server.name.contains("__") {
                return Err(ToolsConfigError::Invalid(format!("MCP server name `{}` must match ^[a-zA-Z0-9_-]+$ without `__`", server.name)));
            }
            if !names.insert(server.name.clone()) {
                return Err(ToolsConfigError::Invalid(format!("MCP server `{}` is configured twice", server.name)));
            }
            match server.transport {
                McpTransport::Http if server.url.is_none() => {
                    return Err(ToolsConfigError::Invalid(format!("MCP server `{}`: the http transport needs `url`", server.name)));
                }
                McpTransport::Stdio if server.command.is_none() => {
                    return Err(ToolsConfigError::Invalid(format!("MCP server `{}`: the stdio transport needs `command`", server.name)));
                }
                _ => {}
            }
        }
        for tool in &self.http_tools {
            if !valid(&tool.name) {
                return Err(ToolsConfigError::Invalid(format!("HTTP tool name `{}` must match ^[a-zA-Z0-9_-]{{1,64}}$", tool.name)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_shape() {
        let config: ToolsConfig = serde_json::from_value(serde_json::json!({
            "tools": {"calculator": {"policy": "auto"}, "sleep": {"policy": "ask", "idempotent": false}},
            "mcpServers": [
                {"name": "x", "transport": "http", "url": "http://127.0.0.1:1/mcp"},
                {"name": "y", "transport": "stdio", "command": "srv", "args": ["a"]}
            ]
        }))
        .unwrap();
        config.validate().unwrap();
        assert_eq!(config.tools["sleep"].policy, Some(Policy::Ask));
        assert_eq!(config.mcp_servers[1].transport, McpTransport::Stdio);
        let bad: ToolsConfig =
            serde_json::from_value(serde_json::json!({"mcpServers": [{"name": "a__b", "transport": "http", "url": "u"}]})).unwrap();
        assert!(bad.validate().is_err());
        assert!(serde_json::from_value::<ToolsConfig>(serde_json::json!({"tool": {}})).is_err());
    }
}
