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
//!      "headers": {"Authorization": "Bearer ..."}, "policy": "ask",
//!      "connectTimeoutMs": 10000, "readTimeoutMs": 300000, "callTimeoutMs": 300000,
//!      "maxResponseBytes": 1048576, "redirects": "none"},
//!     {"name": "files", "transport": "stdio", "command": "mcp-files", "args": ["--root", "/srv"],
//!      "env": {"RUST_LOG": "warn"}}
//!   ],
//!   "httpTools": [
//!     {"name": "notify", "description": "Send a notification.", "url": "https://hooks.example/notify",
//!      "headers": {"X-Api-Key": "..."},
//!      "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
//!      "connectTimeoutMs": 10000, "readTimeoutMs": 30000, "timeoutMs": 60000,
//!      "maxResponseBytes": 1048576, "redirects": "none"}
//!   ]
//! }
//! ```
//!
//! Every key is optional. A tool's policy is, in order: its entry in `tools`, its MCP server's
//! `policy`, `defaultPolicy`, else `auto`. `idempotent` overrides what the tool declares (built-in
//! tools: idempotent; MCP tools: their `readOnlyHint`/`idempotentHint` annotations, else not;
//! HTTP tools: not, unless configured). MCP tools are named `<server>__<tool>`.
//!
//! Outbound HTTP (HTTP tools and the MCP `http` transport) is safe by default:
//! - **Redirects** are not followed (`"redirects": "none"`, the default): a 3xx answer is a
//!   failed call naming the status and `Location`. `"redirects": "same-origin"` follows
//!   307/308 redirects to the same scheme, host and port (at most 10 hops); a redirect to another
//!   origin, and a 301/302/303 (which would turn the POST into a GET), are never followed, so the
//!   configured `headers` (credentials) and the `Idempotency-Key` never reach another host.
//! - **Timeouts**, in milliseconds: `connectTimeoutMs` (TCP + TLS connect), `readTimeoutMs`
//!   (longest wait for the answer's headers and between two reads of its body; it also cuts a
//!   server sending one byte at a time only if it pauses longer than that) and the total per call
//!   (`timeoutMs` of an HTTP tool, `callTimeoutMs` of an MCP server; cuts slow-drip answers).
//! - **Size**: `maxResponseBytes` bounds the bytes read of one answer while it streams in.
//!   An HTTP tool's longer answer is cut there (the result ends with a marker); an MCP
//!   message over the limit is rejected by the client (rmcp), making the call's outcome
//!   unknown. Results are cut again to the registry's 16 KiB for the model.
//!
//! Outcomes: a call whose request certainly never left (connection refused, DNS or TLS
//! failure, connect timeout, invalid configuration) or that the receiver refused (HTTP 3xx other
//! than 303, 4xx; an MCP JSON-RPC error or an `isError` result) is *failed*; a call that may
//! have reached the receiver without a usable answer (timeout after connecting, reset or
//! closed connection while sending or reading, a truncated body, HTTP 303 or 5xx, an MCP
//! answer over `maxResponseBytes`) is *uncertain* ([`super::ToolError::Uncertain`]).

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

/// Approval policy of a tool (SPEC §6 step 5). Ordered from the laxest to the strictest
/// (`Auto < Ask < Deny`): a fleet applies the strictest of its live workers'
/// ([`super::FleetPolicy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Deserialize, serde::Serialize)]
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
    /// Timeout of connecting and listing the tools, in ms (default
    /// [`DEFAULT_MCP_CONNECT_TIMEOUT_MS`]); for the `http` transport also the TCP + TLS connect
    /// timeout of every request.
    #[serde(default)]
    pub connect_timeout_ms: Option<u64>,
    /// Total timeout of one tool call, in ms (default [`DEFAULT_MCP_CALL_TIMEOUT_MS`]); a call
    /// still unanswered then is uncertain.
    #[serde(default)]
    pub call_timeout_ms: Option<u64>,
    /// `http` transport: longest wait for an answer's headers and between two reads of its body,
    /// in ms (default: the call timeout). Keep it above the server's SSE keep-alive interval
    /// (15 s for rmcp servers): the client's standing event stream is idle otherwise.
    #[serde(default)]
    pub read_timeout_ms: Option<u64>,
    /// `http` transport: largest JSON answer or SSE event read, in bytes (default
    /// [`DEFAULT_MAX_RESPONSE_BYTES`]); a larger one is rejected while it streams in. The `stdio`
    /// transport keeps rmcp's own limit (16 MiB per line).
    #[serde(default)]
    pub max_response_bytes: Option<usize>,
    /// `http` transport: which redirects are followed (default `none`).
    #[serde(default)]
    pub redirects: Redirects,
    /// `http` transport: how calls authenticate as the run's user. Absent: every call goes
    /// through one shared connection with the configured `headers`. `{"type": "oauth", ...}`:
    /// MCP's OAuth authorization (docs/architecture.md §15) — calls carry the run's principal's
    /// token over a connection of that principal, and a server answering 401 parks the run in
    /// `waiting_authorization` with a sign-in URL.
    #[serde(default)]
    pub auth: Option<McpAuthConfig>,
}

/// How an MCP server's calls authenticate.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct McpAuthConfig {
    /// `oauth` (the only kind).
    #[serde(rename = "type")]
    pub kind: McpAuthKind,
    /// The client id registered with the server's authorization server (static registration).
    pub client_id: String,
    /// Scopes requested (space-joined), unless the server's 401 names them; default: the
    /// protected resource metadata's `scopes_supported`, else none.
    #[serde(default)]
    pub scopes: Vec<String>,
}

/// Kinds of MCP authentication.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum McpAuthKind {
    /// OAuth 2.1 authorization code with PKCE (S256), per the MCP authorization specification.
    Oauth,
}

/// Which HTTP redirects an outbound client follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Redirects {
    /// None: a 3xx answer is the call's (failed) outcome.
    #[default]
    None,
    /// 307 and 308 redirects to the same scheme, host and port, at most
    /// [`MAX_REDIRECT_HOPS`] of them. Never another origin, never 301/302/303.
    SameOrigin,
}

/// Most redirects followed for one request under [`Redirects::SameOrigin`].
pub const MAX_REDIRECT_HOPS: usize = 10;
/// Default answer size limit of HTTP tools and MCP `http` servers: 1 MiB, in bytes.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1024 * 1024;
/// Default TCP + TLS connect timeout of an HTTP tool, in ms.
pub const DEFAULT_HTTP_CONNECT_TIMEOUT_MS: u64 = 10_000;
/// Default read (idle) timeout of an HTTP tool, in ms.
pub const DEFAULT_HTTP_READ_TIMEOUT_MS: u64 = 30_000;
/// Default total timeout of an HTTP tool call, in ms.
pub const DEFAULT_HTTP_TIMEOUT_MS: u64 = 60_000;
/// Default connect-and-list timeout of an MCP server, in ms.
pub const DEFAULT_MCP_CONNECT_TIMEOUT_MS: u64 = 10_000;
/// Default total timeout of an MCP tool call, in ms.
pub const DEFAULT_MCP_CALL_TIMEOUT_MS: u64 = 300_000;

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
    /// Extra request headers (e.g. `X-Api-Key`, `Authorization`). Sent to `url`'s origin only;
    /// never logged.
    #[serde(default)]
    pub headers: HashMap<String, String>,
    /// Total timeout of one call, from connecting until the last byte of the answer, in ms
    /// (default [`DEFAULT_HTTP_TIMEOUT_MS`]).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// TCP + TLS connect timeout, in ms (default [`DEFAULT_HTTP_CONNECT_TIMEOUT_MS`]). A call
    /// that times out connecting never sent anything: it fails.
    #[serde(default)]
    pub connect_timeout_ms: Option<u64>,
    /// Longest wait for the answer's headers and between two reads of its body, in ms (default
    /// [`DEFAULT_HTTP_READ_TIMEOUT_MS`]).
    #[serde(default)]
    pub read_timeout_ms: Option<u64>,
    /// Largest answer body read, in bytes (default [`DEFAULT_MAX_RESPONSE_BYTES`]); the read
    /// stops there and the result ends with `…[answer cut at N bytes]`.
    #[serde(default)]
    pub max_response_bytes: Option<usize>,
    /// Which redirects are followed (default `none`).
    #[serde(default)]
    pub redirects: Redirects,
}

/// A JSON object as a map, refusing a key that appears twice.
fn unique_keys<'de, D, V>(deserializer: D) -> Result<HashMap<String, V>, D::Error>
where
    D: serde::Deserializer<'de>,
    V: Deserialize<'de>,
{
    struct Unique<V>(std::marker::PhantomData<V>);
    impl<'de, V: Deserialize<'de>> serde::de::Visitor<'de> for Unique<V> {
        type Value = HashMap<String, V>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object of tool names")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = HashMap::new();
            while let Some((key, value)) = map.next_entry::<String, V>()? {
                if out.contains_key(&key) {
                    return Err(serde::de::Error::custom(format!("tool `{key}` is configured twice in `tools`")));
                }
                out.insert(key, value);
            }
            Ok(out)
        }
    }
    deserializer.deserialize_map(Unique(std::marker::PhantomData))
}

/// The whole `TOOLS_FILE`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ToolsConfig {
    #[serde(default)]
    pub default_policy: Option<Policy>,
    /// Per-tool settings; a name given twice is an error, not the last one winning (verification
    /// probe L, L-5: a second entry silently replaced a `deny`).
    #[serde(default, deserialize_with = "unique_keys")]
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
        Self::load_with_text(path).map(|(config, _)| config)
    }

    /// Reads and validates `path`; also returns the text it was read from, so what a worker
    /// publishes about its configuration (its fingerprint) is of the very bytes it runs with,
    /// not of a second read of a file that may have changed in between.
    pub fn load_with_text(path: &Path) -> Result<(Self, String), ToolsConfigError> {
        let display = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ToolsConfigError::Read { path: display.clone(), source })?;
        let config: Self = serde_json::from_str(&text).map_err(|source| ToolsConfigError::Parse { path: display, source })?;
        config.validate()?;
        Ok((config, text))
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
                McpTransport::Stdio if server.command.as_deref().is_none_or(|c| c.trim().is_empty()) => {
                    return Err(ToolsConfigError::Invalid(format!("MCP server `{}`: the stdio transport needs `command`", server.name)));
                }
                McpTransport::Stdio if server.auth.is_some() => {
                    return Err(ToolsConfigError::Invalid(format!("MCP server `{}`: `auth` needs the http transport", server.name)));
                }
                _ => {}
            }
            if server.auth.as_ref().is_some_and(|a| a.client_id.trim().is_empty()) {
                return Err(ToolsConfigError::Invalid(format!("MCP server `{}`: `auth.clientId` must not be empty", server.name)));
            }
        }
        for server in &self.mcp_servers {
            let limits = [server.connect_timeout_ms, server.call_timeout_ms, server.read_timeout_ms, server.max_response_bytes.map(|b| b as u64)];
            if limits.contains(&Some(0)) {
                return Err(ToolsConfigError::Invalid(format!("MCP server `{}`: timeouts and maxResponseBytes must be positive", server.name)));
            }
        }
        let web = |url: &str| reqwest::Url::parse(url).is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.has_host());
        for server in &self.mcp_servers {
            if let Some(url) = server.url.as_deref().filter(|u| !web(u)) {
                return Err(ToolsConfigError::Invalid(format!("MCP server `{}`: url `{url}` is not an http(s) URL", server.name)));
            }
        }
        let mut tool_names: std::collections::HashSet<String> = std::collections::HashSet::new();
        for tool in &self.http_tools {
            if !valid(&tool.name) {
                return Err(ToolsConfigError::Invalid(format!("HTTP tool name `{}` must match ^[a-zA-Z0-9_-]{{1,64}}$", tool.name)));
            }
            // Names differing only in case are one name to a reader (and to some models).
            if !tool_names.insert(tool.name.to_ascii_lowercase()) {
                return Err(ToolsConfigError::Invalid(format!("HTTP tool `{}` is configured twice", tool.name)));
            }
            if tool.name.contains("__") {
                return Err(ToolsConfigError::Invalid(format!("HTTP tool name `{}` must not contain `__` (the MCP tools' namespace separator)", tool.name)));
            }
            if !web(&tool.url) {
                return Err(ToolsConfigError::Invalid(format!("HTTP tool `{}`: url `{}` is not an http(s) URL", tool.name, tool.url)));
            }
            let limits = [tool.timeout_ms, tool.connect_timeout_ms, tool.read_timeout_ms, tool.max_response_bytes.map(|b| b as u64)];
            if limits.contains(&Some(0)) {
                return Err(ToolsConfigError::Invalid(format!("HTTP tool `{}`: timeouts and maxResponseBytes must be positive", tool.name)));
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
        let twice = r#"{"tools": {"pay": {"policy": "deny"}, "pay": {"policy": "auto"}}}"#;
        assert!(serde_json::from_str::<ToolsConfig>(twice).unwrap_err().to_string().contains("`pay` is configured twice"));
    }

    #[test]
    fn outbound_settings_parse_and_are_checked() {
        let config: ToolsConfig = serde_json::from_value(serde_json::json!({
            "mcpServers": [{"name": "x", "transport": "http", "url": "http://h/mcp", "readTimeoutMs": 5, "maxResponseBytes": 10, "redirects": "same-origin"}],
            "httpTools": [{"name": "pay", "url": "http://h/pay", "connectTimeoutMs": 1, "readTimeoutMs": 2, "timeoutMs": 3, "maxResponseBytes": 4}]
        }))
        .unwrap();
        config.validate().unwrap();
        assert_eq!(config.mcp_servers[0].redirects, Redirects::SameOrigin);
        assert_eq!(config.http_tools[0].redirects, Redirects::None, "no redirects by default");
        assert_eq!(config.http_tools[0].max_response_bytes, Some(4));
        let always = serde_json::json!({"httpTools": [{"name": "pay", "url": "u", "redirects": "always"}]});
        assert!(serde_json::from_value::<ToolsConfig>(always).is_err(), "there is no follow-anything setting");
        for url in ["ftp://h/pay", "u", "file:///etc/passwd"] {
            let bad: ToolsConfig = serde_json::from_value(serde_json::json!({"httpTools": [{"name": "pay", "url": url}]})).unwrap();
            assert!(bad.validate().unwrap_err().to_string().contains("not an http(s) URL"), "{url}");
        }
        let twice: ToolsConfig =
            serde_json::from_value(serde_json::json!({"httpTools": [{"name": "pay", "url": "http://h/a"}, {"name": "pay", "url": "http://h/b"}]})).unwrap();
        assert!(twice.validate().is_err());
        let zero: ToolsConfig = serde_json::from_value(serde_json::json!({"httpTools": [{"name": "pay", "url": "http://h/pay", "readTimeoutMs": 0}]})).unwrap();
        assert!(zero.validate().is_err());
        let zero: ToolsConfig =
            serde_json::from_value(serde_json::json!({"mcpServers": [{"name": "x", "transport": "http", "url": "http://h/mcp", "maxResponseBytes": 0}]})).unwrap();
        assert!(zero.validate().is_err());
    }
}
