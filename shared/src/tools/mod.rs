//! Tools the model may call: the [`Tool`] trait, the [`ToolRegistry`] that validates
//! arguments, bounds results and knows each tool's approval [`Policy`] and idempotency, the
//! built-in tools (`calculator`, `current_time`, `sleep`), MCP servers ([`mcp`]) and HTTP tools
//! ([`http`]) configured in the operator's tools file ([`config`]).
//!
//! Every failure a model can cause (unknown tool, bad arguments, tool error, cancellation)
//! becomes an error [`ToolOutcome`] the model reads; nothing here panics on model input.
//!
//! A failure is one of two kinds, and callers must keep them apart for tools with external
//! effects: *failed* ([`ToolError::Failed`], [`ToolOutcome::uncertain`] false) means the effect
//! certainly did not happen — the request never left, or the receiver answered and refused —
//! while *uncertain* ([`ToolError::Uncertain`], [`ToolOutcome::uncertain`] true) means the
//! request may have reached the receiver and had its effect, but no usable answer came back
//! (timeout, reset, truncated answer, HTTP 5xx, ...). An uncertain call must not be reported as
//! failed nor retried under a new key: the ledger records it `uncertain` and a human decides.
//! Each client classifies in one place: [`http::classify_send_error`] and the response rules of
//! [`http::HttpTool`], [`mcp::classify_call_error`].

pub mod builtin;
pub mod config;
pub mod http;
pub mod mcp;

use std::collections::HashMap;
use std::{fmt, sync::Arc};

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;

use crate::text::inexact_number;

pub use builtin::{BuiltinToolConfig, Calculator, CurrentTime, Sleep};
pub use config::{Policy, ToolsConfig};

/// Room reserved for the `\n…[N bytes omitted]…\n` marker of a cut result, in bytes.
const OMISSION_MARKER_BYTES: usize = 48;

/// A callable tool.
pub trait Tool: Send + Sync {
    /// Name the model calls it by (`^[a-zA-Z0-9_-]{1,64}$` per OpenAI's function naming).
    fn name(&self) -> &str;
    /// One-paragraph description shown to the model.
    fn description(&self) -> &str;
    /// JSON Schema of the argument object; the registry enforces its `required` list and the
    /// `type` of each of its `properties` before calling.
    fn parameters(&self) -> Value;
    /// True if calling twice with the same arguments is harmless: such tools skip the
    /// `operations` protocol and are simply retried after a crash (SPEC §7).
    fn idempotent(&self) -> bool;
    /// Runs the tool on a validated argument object. The future must not borrow `self`;
    /// long-running tools should also watch `ctx.cancel` (the registry stops waiting anyway).
    fn call(&self, args: Value, ctx: ToolContext) -> BoxFuture<'static, Result<String, ToolError>>;
}

/// Per-call context handed to a tool.
#[derive(Debug, Clone)]
pub struct ToolContext {
    /// Stable key of this call, e.g. `run:{run_id}:step:{sequence}:call:{tool_call_id}`;
    /// tools with external effects pass it on so a repeated call is deduplicated.
    pub idempotency_key: String,
    /// Cancelled when the slice is cancelled or abandoned.
    pub cancel: CancellationToken,
    /// Who the call is made for, and their token for the tool's MCP server, when that server
    /// uses OAuth (`auth: oauth`); `None` for every other tool.
    pub credential: Option<mcp::McpCredential>,
}

impl ToolContext {
    /// A context for a call keyed `idempotency_key`, with a fresh (uncancelled) token.
    pub fn new(idempotency_key: impl Into<String>) -> Self {
        Self { idempotency_key: idempotency_key.into(), cancel: CancellationToken::new(), credential: None }
    }
}

/// A tool failure; its `Display` text is what the model reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    /// Arguments the schema allowed but the tool cannot use.
    #[error("invalid arguments: {0}")]
    InvalidArguments(String),
    /// The call certainly had no effect: it never left the process, or the receiver answered
    /// and refused (or reported the failure itself).
    #[error("{0}")]
    Failed(String),
    /// The request may have reached the receiver and had its effect, but its outcome is unknown
    /// (timeout, connection reset or closed while sending or reading, truncated answer, HTTP
    /// 5xx, ...). The text says what happened; `Display` prefixes it with
    /// [`UNCERTAIN_PREFIX`].
    #[error("outcome unknown (the call may have taken effect): {0}")]
    Uncertain(String),
    /// The call was cancelled through [`ToolContext::cancel`].
    #[error("cancelled")]
    Cancelled,
    /// The tool's MCP server refused the call for want of the user's authorization (HTTP 401,
    /// or 403 `insufficient_scope`): the call certainly had no effect; the caller may park the
    /// run for a sign-in ([`crate::mcp_auth`]) and retry it under the same key.
    #[error("MCP server `{}` requires the user's authorization (sign-in)", .0.server)]
    AuthorizationRequired(mcp::AuthChallenge),
}

/// How the content of an uncertain outcome starts.
pub const UNCERTAIN_PREFIX: &str = "outcome unknown (the call may have taken effect): ";

/// Result of [`ToolRegistry::execute`], becoming the `role: "tool"` message content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolOutcome {
    /// Result text or error message, at most the registry's `max_result_bytes` bytes (when
    /// that is at least 48).
    pub content: String,
    /// True if `content` describes a failure (failed or uncertain).
    pub is_error: bool,
    /// True if the call may have had its effect although it produced no usable answer
    /// ([`ToolError::Uncertain`], or a cancellation after the tool started); implies `is_error`.
    /// For a non-idempotent tool the operation must be recorded `uncertain`, not `failed`.
    #[serde(default)]
    pub uncertain: bool,
    /// Set when the call failed for want of the user's authorization
    /// ([`ToolError::AuthorizationRequired`]); implies `is_error`, never `uncertain`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authorization: Option<mcp::AuthChallenge>,
}

impl ToolOutcome {
    /// A successful outcome with `content`.
    pub fn ok(content: impl Into<String>) -> Self {
        Self { content: content.into(), is_error: false, uncertain: false, authorization: None }
    }

    /// A failed outcome with `message` (the call certainly had no effect).
    pub fn error(message: impl Into<String>) -> Self {
        Self { content: message.into(), is_error: true, uncertain: false, authorization: None }
    }

    /// An uncertain outcome with `message` (see [`ToolOutcome::uncertain`]).
    pub fn uncertain(message: impl Into<String>) -> Self {
        Self { content: message.into(), is_error: true, uncertain: true, authorization: None }
    }
}

/// The tools offered to models, in registration order.
#[derive(Clone)]
pub struct ToolRegistry {
    tools: Vec<Arc<dyn Tool>>,
    max_result_bytes: usize,
    settings: HashMap<String, config::ToolSettings>,
    /// HTTP tools of the tools file that replaced a registered tool of the same name.
    shadowed: Vec<String>,
    default_policy: Policy,
    mcp: Vec<Arc<mcp::McpServer>>,
    /// What the other live workers of the fleet configure ([`ToolRegistry::set_fleet`]).
    fleet: Arc<std::sync::RwLock<Vec<FleetPolicy>>>,
}

/// One worker's approval and idempotency configuration, as it publishes it to the fleet
/// (`worker_tool_policies`, migration 000039): `{defaultPolicy, tools: {name: {policy?,
/// idempotent?}}, servers: {mcpServer: policy}}`.
///
/// A call's policy is decided by the worker that runs it, and every worker must run with the
/// same `TOOLS_FILE`; when they do not (a rolling change of the file, a mistake), each worker
/// applies the *strictest* policy of the live workers for every tool, and treats a tool as not
/// idempotent when any of them says so (acceptance probe E: a worker with a laxer file ran a
/// payment without the approval the others asked for). So a policy made stricter takes effect as
/// soon as one worker runs with it, and one made laxer when the last worker with the old file
/// has gone.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FleetPolicy {
    #[serde(default)]
    pub default_policy: Policy,
    #[serde(default)]
    pub tools: HashMap<String, FleetTool>,
    /// MCP servers' default policies (`<server>__<tool>` names).
    #[serde(default)]
    pub servers: HashMap<String, Policy>,
}

/// A tool's entry in a [`FleetPolicy`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FleetTool {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<Policy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotent: Option<bool>,
}

impl FleetPolicy {
    /// A policy another (newer) worker published that this one cannot read: every tool it
    /// names, and its default, ask.
    pub fn unreadable(published: &Value) -> Self {
        let names = published.get("tools").and_then(Value::as_object).map(|t| t.keys().cloned().collect::<Vec<_>>()).unwrap_or_default();
        Self {
            default_policy: Policy::Ask,
            tools: names.into_iter().map(|n| (n, FleetTool { policy: Some(Policy::Ask), idempotent: Some(false) })).collect(),
            servers: HashMap::new(),
        }
    }

    /// The policy of `name` in this configuration (the order of [`ToolRegistry::policy`]).
    pub fn policy(&self, name: &str) -> Policy {
        if let Some(policy) = self.tools.get(name).and_then(|t| t.policy) {
            return policy;
        }
        self.servers
            .iter()
            .find(|(server, _)| name.strip_prefix(server.as_str()).is_some_and(|rest| rest.starts_with("__")))
            .map_or(self.default_policy, |(_, policy)| *policy)
    }
}

impl fmt::Debug for ToolRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolRegistry")
            .field(
                "tools",
                &self.tools.iter().map(|t| t.name()).collect::<Vec<_>>(),
            )
            .field("max_result_bytes", &self.max_result_bytes)
            .field("mcp", &self.mcp)
            .finish()
    }
}

impl ToolRegistry {
    /// An empty registry cutting results longer than `max_result_bytes` bytes.
    pub fn new(max_result_bytes: usize) -> Self {
        Self {
            tools: Vec::new(),
            max_result_bytes,
            settings: HashMap::new(),
            shadowed: Vec::new(),
            default_policy: Policy::Auto,
            mcp: Vec::new(),
            fleet: Arc::default(),
        }
    }

    /// Applies the tools file: per-tool policies and idempotency overrides, the default policy,
    /// its HTTP tools, and its MCP servers (not connected yet: see [`ToolRegistry::connect_mcp`]).
    pub fn configure(&mut self, config: &ToolsConfig) {
        self.settings = config.tools.clone();
        self.default_policy = config.default_policy.unwrap_or_default();
        for tool in &config.http_tools {
            if self.tools.iter().any(|t| t.name().eq_ignore_ascii_case(&tool.name)) {
                self.shadowed.push(tool.name.clone());
            }
            self.register(Arc::new(http::HttpTool::new(tool.clone())));
        }
        self.mcp = config.mcp_servers.iter().cloned().map(mcp::McpServer::new).collect();
    }

    /// Connects every MCP server once (concurrently; a server that is down is logged and
    /// retried when one of its tools is called). Returns `(server, error)` for the failures.
    pub async fn connect_mcp(&self) -> Vec<(String, String)> {
        let attempts = self.mcp.iter().map(|server| async move { (server.name().to_owned(), server.connect(true).await) });
        futures_util::future::join_all(attempts)
            .await
            .into_iter()
            .filter_map(|(name, result)| result.err().map(|e| (name, e)))
            .collect()
    }

    /// The approval policy of `name`: the tools file's entry, else its MCP server's default,
    /// else the file's `defaultPolicy`, else `auto`.
    ///
    /// The strictest of this worker's and the other live workers' ([`FleetPolicy`]).
    pub fn policy(&self, name: &str) -> Policy {
        let own = self.own_policy(name);
        self.fleet.read().expect("fleet lock").iter().map(|other| other.policy(name)).fold(own, Policy::max)
    }

    fn own_policy(&self, name: &str) -> Policy {
        if let Some(policy) = self.settings.get(name).and_then(|s| s.policy) {
            return policy;
        }
        self.mcp.iter().find(|s| s.owns(name)).and_then(|s| s.policy()).unwrap_or(self.default_policy)
    }

    /// This worker's configuration as it publishes it to the fleet.
    pub fn published(&self) -> FleetPolicy {
        FleetPolicy {
            default_policy: self.default_policy,
            tools: self
                .settings
                .iter()
                .map(|(name, s)| (name.clone(), FleetTool { policy: s.policy, idempotent: s.idempotent }))
                .collect(),
            servers: self.mcp.iter().filter_map(|s| s.policy().map(|p| (s.name().to_owned(), p))).collect(),
        }
    }

    /// Replaces what the other live workers configure (see [`FleetPolicy`]).
    pub fn set_fleet(&self, others: Vec<FleetPolicy>) {
        *self.fleet.write().expect("fleet lock") = others;
    }

    /// The MCP server owning `name` when that server authenticates its calls with OAuth
    /// (`auth: oauth`): the caller must put the run's principal and token in
    /// [`ToolContext::credential`].
    pub fn oauth_server(&self, name: &str) -> Option<Arc<mcp::McpServer>> {
        self.mcp.iter().find(|s| s.owns(name) && s.oauth().is_some()).cloned()
    }

    /// Whether calls of `name` skip the operations ledger: the tools file's `idempotent`, else
    /// what the tool declares. Unknown tools count as idempotent (nothing runs).
    ///
    /// Not idempotent when another live worker's file says so ([`FleetPolicy`]).
    pub fn is_idempotent(&self, name: &str) -> bool {
        let fleet = self.fleet.read().expect("fleet lock");
        if fleet.iter().any(|other| other.tools.get(name).and_then(|t| t.idempotent) == Some(false)) {
            return false;
        }
        drop(fleet);
        if let Some(flag) = self.settings.get(name).and_then(|s| s.idempotent) {
            return flag;
        }
        self.get(name).is_none_or(|t| t.idempotent())
    }

    /// A registry with the built-in tools `calculator`, `current_time` and `sleep`.
    pub fn builtin(config: &BuiltinToolConfig) -> Self {
        let mut registry = Self::new(config.max_result_bytes);
        registry.register(Arc::new(Calculator));
        registry.register(Arc::new(CurrentTime));
        registry.register(Arc::new(Sleep {
            max_seconds: config.max_sleep_seconds,
        }));
        registry
    }

    /// Adds a tool, replacing any tool of the same name in place.
    pub fn register(&mut self, tool: Arc<dyn Tool>) {
        match self.tools.iter_mut().find(|t| t.name() == tool.name()) {
            Some(slot) => *slot = tool,
            None => self.tools.push(tool),
        }
    }

    /// What is wrong with the tools file against the tools this worker has (call once every
    /// tool is registered and [`ToolRegistry::connect_mcp`] has run; the worker refuses to start
    /// on any): an entry of `tools` that names no tool — neither a registered one, nor one an
    /// MCP server listed, nor one in the namespace of a server that was down — so its policy
    /// would apply to nothing (acceptance probe J, F7 and verification probe L, L-4: a misspelt
    /// `deny` protected nothing); an HTTP tool with the name of a built-in one, which it
    /// silently replaced.
    pub fn config_problems(&self) -> Vec<String> {
        let mut problems: Vec<String> =
            self.shadowed.iter().map(|n| format!("the HTTP tool `{n}` has the name of a built-in tool; rename it")).collect();
        let known = |name: &str| {
            self.tools.iter().any(|t| t.name() == name)
                || self.mcp.iter().any(|m| m.owns(name) && {
                    let listed = m.tools();
                    listed.is_empty() || listed.iter().any(|t| t.name() == name)
                })
        };
        let mut unknown: Vec<&String> = self.settings.keys().filter(|name| !known(name)).collect();
        unknown.sort();
        if !unknown.is_empty() {
            let mut names: Vec<String> = self.all().iter().map(|t| t.name().to_owned()).collect();
            names.extend(self.mcp.iter().filter(|m| m.tools().is_empty()).map(|m| format!("{}__* (not connected)", m.name())));
            names.sort_unstable();
            problems.push(format!(
                "`tools` names tools that do not exist: {} (tools: {})",
                unknown.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", "),
                names.join(", ")
            ));
        }
        problems
    }

    /// Every tool currently offered: registered ones, then each connected MCP server's.
    fn all(&self) -> Vec<Arc<dyn Tool>> {
        let mut all = self.tools.clone();
        for server in &self.mcp {
            all.extend(server.tools().into_iter().map(|t| t as Arc<dyn Tool>));
        }
        all
    }

    /// OpenAI tool specs of the tools offered to a model call (all but `deny` ones):
    /// `[{"type":"function","function":{"name","description","parameters"}}]`.
    pub fn specs(&self) -> Vec<Value> {
        self.all()
            .iter()
            .filter(|tool| self.policy(tool.name()) != Policy::Deny)
            .map(|tool| {
                serde_json::json!({
                    "type": "function",
                    "function": {
                        "name": tool.name(),
                        "description": tool.description(),
                        "parameters": tool.parameters(),
                    }
                })
            })
            .collect()
    }

    /// The tool with this name.
    pub fn get(&self, name: &str) -> Option<Arc<dyn Tool>> {
        if let Some(tool) = self.tools.iter().find(|t| t.name() == name) {
            return Some(tool.clone());
        }
        self.mcp.iter().find(|s| s.owns(name)).and_then(|s| s.find(name)).map(|t| t as Arc<dyn Tool>)
    }

    /// Resolves `name` and validates `raw_arguments` against its schema, without running it.
    /// An MCP tool whose server is down (or not listed yet) triggers one reconnection attempt.
    /// Errors are the outcome the model reads (see [`ToolRegistry::execute`]).
    pub async fn prepare(&self, name: &str, raw_arguments: &str) -> Result<(Arc<dyn Tool>, Value), ToolOutcome> {
        let mut tool = self.get(name);
        if tool.is_none()
            && let Some(server) = self.mcp.iter().find(|s| s.owns(name))
        {
            if let Err(error) = server.connect(false).await {
                return Err(ToolOutcome::error(truncate_middle(
                    format!("MCP server `{}` is unavailable: {error}", server.name()),
                    self.max_result_bytes,
                )));
            }
            tool = server.find(name).map(|t| t as Arc<dyn Tool>);
        }
        let Some(tool) = tool else {
            return Err(ToolOutcome::error(format!("unknown tool: {name}")));
        };
        let schema = tool.parameters();
        match parse_arguments(raw_arguments).and_then(|args| conform(&schema, args)) {
            Ok(args) => Ok((tool, args)),
            Err(problem) => {
                Err(ToolOutcome::error(truncate_middle(format!("invalid arguments for {name}: {problem}"), self.max_result_bytes)))
            }
        }
    }

    /// Runs a tool on arguments [`ToolRegistry::prepare`] validated; bounds the result.
    ///
    /// The outcome keeps the tool's classification: `Ok` is a success,
    /// [`ToolError::Uncertain`] an uncertain outcome (`is_error` and `uncertain`), any other
    /// error a failed one. A cancellation of `ctx.cancel` before the tool started is failed
    /// (`cancelled`: nothing ran); one while the tool was running is uncertain (its request may
    /// already have left).
    pub async fn invoke(&self, tool: &dyn Tool, arguments: Value, ctx: ToolContext) -> ToolOutcome {
        let cancel = ctx.cancel.clone();
        if cancel.is_cancelled() {
            return ToolOutcome::error(ToolError::Cancelled.to_string());
        }
        let result = tokio::select! {
            biased;
            () = cancel.cancelled() => Err(ToolError::Uncertain("cancelled while the call was running".into())),
            result = tool.call(arguments, ctx) => result,
        };
        let outcome = match result {
            Ok(text) => ToolOutcome::ok(text),
            Err(error @ ToolError::Uncertain(_)) => ToolOutcome::uncertain(error.to_string()),
            Err(ToolError::AuthorizationRequired(challenge)) => ToolOutcome {
                authorization: Some(challenge.clone()),
                ..ToolOutcome::error(ToolError::AuthorizationRequired(challenge).to_string())
            },
            Err(error) => ToolOutcome::error(error.to_string()),
        };
        ToolOutcome { content: truncate_middle(outcome.content, self.max_result_bytes), ..outcome }
    }

    /// Bounds `text` like a tool result (head and tail around an omission marker).
    pub fn bound(&self, text: String) -> String {
        truncate_middle(text, self.max_result_bytes)
    }

    /// Validates `raw_arguments` (the model's text; empty means `{}`) against the tool's
    /// schema and runs it. Never fails: an unknown tool (`unknown tool: x`), arguments that are
    /// not a JSON object, a missing required field, a wrong JSON type, a tool error or
    /// cancellation of `ctx.cancel` (returned promptly) give an error outcome, uncertain as
    /// [`ToolRegistry::invoke`] says.
    /// Content longer than `max_result_bytes` keeps its head and tail around
    /// `\n…[N bytes omitted]…\n`, cut on character boundaries.
    pub async fn execute(&self, name: &str, raw_arguments: &str, ctx: ToolContext) -> ToolOutcome {
        match self.prepare(name, raw_arguments).await {
            Ok((tool, arguments)) => self.invoke(tool.as_ref(), arguments, ctx).await,
            Err(outcome) => outcome,
        }
    }
}

/// Validates an argument object against a tool's JSON `schema` the way the registry does
/// ([`conform`]). Returns the conformed object, or the problem as text. Used by the api for
/// arguments a user edited before approving (with the schema stored on the approval).
pub fn validate_arguments(schema: &Value, arguments: &Value) -> Result<Value, String> {
    let Value::Object(args) = arguments else {
        return Err("expected a JSON object".to_owned());
    };
    conform(schema, args.clone())
}

/// Conforms `args` to a tool's JSON `schema` and validates them against all of it: first the
/// `required` list and `properties.*.type` with plain messages (whole floats in `integer`
/// fields become integers), then the whole schema with the `jsonschema` crate —
/// `additionalProperties`, `enum`, `const`, bounds, lengths, patterns, nested objects and
/// arrays (the draft its `$schema` names; 2020-12 by default). Remote `$ref`s are never fetched
/// (the crate is built without resolvers: schemas come from MCP servers); a schema that does
/// not compile, such as one with a remote `$ref`, is held to the first checks only. Errors: the
/// first problem, as text of at most ~500 bytes.
fn conform(schema: &Value, mut args: Map<String, Value>) -> Result<Value, String> {
    conform_arguments(schema, &mut args)?;
    let args = Value::Object(args);
    if let Ok(validator) = jsonschema::validator_for(schema)
        && let Err(error) = validator.validate(&args)
    {
        let at = error.instance_path().to_string();
        let what = if at.is_empty() { error.to_string() } else { format!("{at}: {error}") };
        return Err(truncate_middle(what, 500));
    }
    Ok(args)
}

/// Parses argument text — the model's, or a user's edit sent as text — into an object (empty
/// or blank text is `{}`); refuses a number the tool would receive rounded
/// ([`crate::text::inexact_number`]).
pub fn parse_arguments(raw: &str) -> Result<Map<String, Value>, String> {
    if raw.trim().is_empty() {
        return Ok(Map::new());
    }
    match serde_json::from_str::<Value>(raw) {
        Ok(Value::Object(args)) => match inexact_number(raw) {
            None => Ok(args),
            Some(number) => Err(format!(
                "the number {} has more digits than a tool's arguments carry exactly (64-bit integers, 64-bit floats); send it as a string",
                truncate_middle(number.to_owned(), 80)
            )),
        },
        Ok(_) => Err("expected a JSON object".to_owned()),
        Err(e) => Err(format!("not valid JSON ({e})")),
    }
}

/// Enforces the schema's `required` list and `properties.*.type` (a name or a list of names);
/// a `null` value counts as absent. Whole floats in `integer` fields become integers (`2.0`
/// -> `2`), so tools can read them with `as_u64`/`as_i64`.
fn conform_arguments(schema: &Value, args: &mut Map<String, Value>) -> Result<(), String> {
    let required = schema["required"].as_array().into_iter().flatten();
    for field in required.filter_map(Value::as_str) {
        if args.get(field).is_none_or(Value::is_null) {
            return Err(format!("missing required field `{field}`"));
        }
    }
    for (key, value) in args.iter_mut().filter(|(_, v)| !v.is_null()) {
        let types: Vec<&str> = match &schema["properties"][key.as_str()]["type"] {
            Value::String(name) => vec![name.as_str()],
            Value::Array(names) => names.iter().filter_map(Value::as_str).collect(),
            _ => continue,
        };
        if !types.is_empty() && !types.iter().any(|t| json_type_matches(t, value)) {
            return Err(format!(
                "field `{key}` must be of type {}",
                types.join(" or ")
            ));
        }
        if types.contains(&"integer") && value.is_f64() && !types.contains(&"number") {
            // A whole float (`2.0`, `1e3`) in an integer field becomes that integer; one beyond
            // what a 64-bit integer holds exactly would reach the tool as a float (`1e+30`).
            match value.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 9_007_199_254_740_992.0) {
                Some(whole) => *value = Value::from(whole as i64),
                None => return Err(format!("field `{key}` must be an integer within 64 bits")),
            }
        }
    }
    Ok(())
}

fn json_type_matches(json_type: &str, value: &Value) -> bool {
    match json_type {
        "string" => value.is_string(),
        "number" => value.is_number(),
        "integer" => {
            value.is_i64() || value.is_u64() || value.as_f64().is_some_and(|f| f.fract() == 0.0)
        }
        "boolean" => value.is_boolean(),
        "object" => value.is_object(),
        "array" => value.is_array(),
        "null" => value.is_null(),
        _ => true,
    }
}

/// Cuts `text` to at most `max_bytes` bytes (for `max_bytes` >= 48) by replacing its middle
/// with `\n…[N bytes omitted]…\n`.
fn truncate_middle(text: String, max_bytes: usize) -> String {
    if text.len() <= max_bytes {
        return text;
    }
    let keep = max_bytes.saturating_sub(OMISSION_MARKER_BYTES);
    let head_end = text.floor_char_boundary(keep / 2);
    let tail_start = text.ceil_char_boundary(text.len() - (keep - head_end));
    format!(
        "{}\n…[{} bytes omitted]…\n{}",
        &text[..head_end],
        tail_start - head_end,
        &text[tail_start..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::number_is_exact;

    /// The strictest policy of the live fleet applies, tool by tool, through each level of a
    /// configuration (tool entry, MCP server, default), and "not idempotent" anywhere wins.
    #[test]
    fn a_tools_file_naming_no_tool_or_shadowing_a_builtin_is_a_problem() {
        let config: ToolsConfig = serde_json::from_value(serde_json::json!({
            "tools": {"calculater": {"policy": "deny"}, "calculator": {"policy": "ask"}, "files__rm": {"policy": "deny"}, "other__x": {"policy": "deny"}},
            "httpTools": [{"name": "sleep", "url": "http://h/sleep"}],
            "mcpServers": [{"name": "files", "transport": "stdio", "command": "x"}]
        }))
        .unwrap();
        let mut registry = ToolRegistry::builtin(&BuiltinToolConfig::default());
        registry.configure(&config);
        let problems = registry.config_problems().join("\n");
        assert!(problems.contains("`sleep` has the name of a built-in tool"), "{problems}");
        assert!(problems.contains("`calculater`, `other__x`"), "{problems}");
        assert!(!problems.contains("`calculator`") && !problems.contains("files__rm"), "{problems}");
        let fine: ToolsConfig = serde_json::from_value(serde_json::json!({"tools": {"calculator": {"policy": "ask"}}})).unwrap();
        let mut registry = ToolRegistry::builtin(&BuiltinToolConfig::default());
        registry.configure(&fine);
        assert!(registry.config_problems().is_empty());
    }

    #[test]
    fn the_strictest_policy_of_the_fleet_applies() {
        let config: ToolsConfig = serde_json::from_value(serde_json::json!({
            "defaultPolicy": "auto",
            "tools": {"calculator": {"policy": "auto"}, "pay": {"policy": "ask", "idempotent": false}},
            "mcpServers": [{"name": "files", "transport": "stdio", "command": "x", "policy": "auto"}]
        }))
        .unwrap();
        let mut registry = ToolRegistry::builtin(&BuiltinToolConfig::default());
        registry.configure(&config);
        assert_eq!(registry.policy("calculator"), Policy::Auto);
        assert_eq!(registry.policy("files__delete"), Policy::Auto);
        assert!(registry.is_idempotent("calculator"));
        let other: FleetPolicy = serde_json::from_value(serde_json::json!({
            "defaultPolicy": "ask",
            "tools": {"calculator": {"policy": "deny"}, "pay": {"policy": "auto"}, "current_time": {"idempotent": false}},
            "servers": {"files": "ask"}
        }))
        .unwrap();
        registry.set_fleet(vec![other.clone()]);
        assert_eq!(registry.policy("calculator"), Policy::Deny, "the other's tool entry");
        assert_eq!(registry.policy("pay"), Policy::Ask, "ours, stricter than the other's");
        assert_eq!(registry.policy("files__delete"), Policy::Ask, "the other's MCP server policy");
        assert_eq!(registry.policy("sleep"), Policy::Ask, "the other's default");
        assert!(!registry.is_idempotent("current_time"), "the other says it is not idempotent");
        assert!(registry.specs().iter().all(|s| s["function"]["name"] != "calculator"), "a tool denied anywhere is not offered");
        // What a worker publishes reads back as the same policy.
        assert_eq!(serde_json::from_value::<FleetPolicy>(serde_json::to_value(registry.published()).unwrap()).unwrap(), registry.published());
        assert_eq!(registry.published().policy("pay"), Policy::Ask);
        registry.set_fleet(Vec::new());
        assert_eq!(registry.policy("calculator"), Policy::Auto, "the other has gone");
        // An unreadable policy asks for every tool it names.
        let unreadable = FleetPolicy::unreadable(&serde_json::json!({"tools": {"calculator": {"policy": "sometimes"}}}));
        assert_eq!(unreadable.policy("calculator"), Policy::Ask);
    }

    /// Edited or model-written arguments are held to the whole schema, not only `required` and
    /// `type` (an acceptance test sent an extra field past `additionalProperties: false`).
    #[test]
    fn arguments_are_validated_against_the_whole_schema() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "to": {"type": "string", "pattern": "^[a-z]+@example\\.com$"},
                "amount": {"type": "integer", "minimum": 1, "maximum": 100},
                "currency": {"enum": ["EUR", "USD"]},
                "memo": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 5}}, "additionalProperties": false}
            },
            "required": ["to", "amount"],
            "additionalProperties": false
        });
        let ok = serde_json::json!({"to": "ann@example.com", "amount": 5.0, "currency": "EUR", "memo": {"text": "hi"}});
        assert_eq!(validate_arguments(&schema, &ok).unwrap()["amount"], 5, "whole floats still become integers");
        for (bad, what) in [
            (serde_json::json!({"to": "ann@example.com", "amount": 5, "extra": "x"}), "extra"),
            (serde_json::json!({"to": "ann@example.com", "amount": 500}), "500"),
            (serde_json::json!({"to": "ann@example.com", "amount": 0}), "0"),
            (serde_json::json!({"to": "ann@example.com", "amount": 5, "currency": "GBP"}), "GBP"),
            (serde_json::json!({"to": "mallory@evil.test", "amount": 5}), "mallory"),
            (serde_json::json!({"to": "ann@example.com", "amount": 5, "memo": {"text": "too long"}}), "too long"),
            (serde_json::json!({"to": "ann@example.com", "amount": 5, "memo": {"text": "a", "x": 1}}), "x"),
            (serde_json::json!({"amount": 5}), "to"),
        ] {
            let problem = validate_arguments(&schema, &bad).expect_err(&bad.to_string());
            assert!(problem.contains(what), "{bad}: {problem}");
        }
        // A schema that cannot compile (a remote $ref is never fetched) keeps the plain checks.
        let remote = serde_json::json!({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}, "required": ["a"]});
        assert!(validate_arguments(&remote, &serde_json::json!({"a": 1})).is_ok());
        assert!(validate_arguments(&remote, &serde_json::json!({})).is_err());
    }

    /// A number that `serde_json::Value` would round is refused, never passed on changed;
    /// numbers that only look different (`1.10`, `1E2`, `-0`, 64-bit extremes) pass. 2^64 is
    /// a float exactly, but would be written back as 18446744073709552000.
    #[test]
    fn numbers_a_tool_would_receive_rounded_are_refused() {
        for exact in [
            "0", "-0", "1.10", "1E2", "1e-7", "0.1", "-2.5e+300", "9007199254740993", "-9223372036854775808",
            "18446744073709551615", "123456789012345.6", "5e-324", "1.7976931348623157e308",
        ] {
            assert!(number_is_exact(exact), "{exact} is carried exactly");
            let raw = format!(r#"{{"a": {exact}, "s": "1234567890123456789012345"}}"#);
            assert!(parse_arguments(&raw).is_ok(), "{raw}");
        }
        for rounded in [
            "18446744073709551616", "18446744073709551617", "-9223372036854775809", "0.12345678901234567891", "12345678901234567.89",
            "1.00000000000000001", "1000000000000000000000000000000",
        ] {
            assert!(!number_is_exact(rounded), "{rounded} would be rounded");
            let raw = format!(r#"{{"note": "a \"quoted\" 1.5", "nested": [1, {{"amount": {rounded}}}]}}"#);
            let problem = parse_arguments(&raw).expect_err(&raw);
            assert!(problem.contains(rounded) && problem.contains("string"), "{problem}");
        }
        // A whole float in an integer field becomes the integer, unless no 64-bit integer holds
        // it exactly (`1e30` would reach the tool as `1e+30`: verification probe G).
        let schema = serde_json::json!({"type": "object", "properties": {"amount": {"type": "integer"}}});
        assert_eq!(validate_arguments(&schema, &serde_json::json!({"amount": 2.0})).unwrap(), serde_json::json!({"amount": 2}));
        let problem = validate_arguments(&schema, &serde_json::json!({"amount": 1e30})).unwrap_err();
        assert!(problem.contains("within 64 bits"), "{problem}");
    }

    /// Returns `text` repeated `times` times, or fails with `text` when `fail` is true.
    struct Echo;

    impl Tool for Echo {
        fn name(&self) -> &str {
            "echo"
        }
        fn description(&self) -> &str {
            "Repeats text."
        }
        fn parameters(&self) -> Value {
            serde_json::json!({
                "type": "object",
                "properties": {
                    "text": {"type": "string"},
                    "times": {"type": "integer"},
                    "fail": {"type": ["boolean", "null"]},
                    "uncertain": {"type": "boolean"}
                },
                "required": ["text"]
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
            Box::pin(async move {
                let text = args["text"].as_str().unwrap_or_default().to_owned();
                if args["fail"] == true {
                    return Err(ToolError::Failed(text));
                }
                if args["uncertain"] == true {
                    return Err(ToolError::Uncertain(text.repeat(args["times"].as_u64().unwrap_or(1) as usize)));
                }
                Ok(text.repeat(args["times"].as_u64().unwrap_or(1) as usize))
            })
        }
    }

    fn registry(max_result_bytes: usize) -> ToolRegistry {
        let mut registry = ToolRegistry::builtin(&BuiltinToolConfig {
            max_result_bytes,
            ..BuiltinToolConfig::default()
        });
        registry.register(Arc::new(Echo));
        registry
    }

    fn ctx() -> ToolContext {
        ToolContext {
            idempotency_key: "run:r:step:1:call:c".into(),
            cancel: CancellationToken::new(),
            credential: None,
        }
    }

    async fn run(name: &str, args: &str) -> ToolOutcome {
        registry(16 * 1024).execute(name, args, ctx()).await
    }

    #[test]
    fn specs_are_openai_functions() {
        let specs = registry(100).specs();
        let names: Vec<_> = specs
            .iter()
            .map(|s| s["function"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["calculator", "current_time", "sleep", "echo"]);
        assert!(specs.iter().all(|s| s["type"] == "function" && s["function"]["parameters"]["type"] == "object"));
        assert!(registry(100).get("sleep").unwrap().idempotent());
    }

    #[tokio::test]
    async fn execute_error_paths() {
        let cases = [
            ("nope", "{}", "unknown tool: nope"),
            (
                "echo",
                "{\"text\":",
                "invalid arguments for echo: not valid JSON",
            ),
            (
                "echo",
                "[1]",
                "invalid arguments for echo: expected a JSON object",
            ),
            (
                "echo",
                "",
                "invalid arguments for echo: missing required field `text`",
            ),
            (
                "echo",
                r#"{"text":null}"#,
                "invalid arguments for echo: missing required field `text`",
            ),
            (
                "echo",
                r#"{"text":5}"#,
                "invalid arguments for echo: field `text` must be of type string",
            ),
            (
                "echo",
                r#"{"text":"a","times":1.5}"#,
                "invalid arguments for echo: field `times` must be of type integer",
            ),
            ("echo", r#"{"text":"boom","fail":true}"#, "boom"),
        ];
        for (name, args, expected) in cases {
            let outcome = run(name, args).await;
            assert!(outcome.is_error, "{name} {args}");
            assert!(
                outcome.content.starts_with(expected),
                "{name} {args}: {}",
                outcome.content
            );
        }
        let ok = run("echo", r#"{"text":"hi","times":2.0,"fail":null}"#).await;
        assert_eq!(ok, ToolOutcome::ok("hihi"));
        assert!(!run("echo", r#"{"text":"boom","fail":true}"#).await.uncertain, "failed is not uncertain");
        let empty_is_object = run("current_time", "  ").await;
        assert!(!empty_is_object.is_error, "{}", empty_is_object.content);
    }

    #[tokio::test]
    async fn long_results_keep_head_and_tail() {
        let registry = registry(100);
        let args = serde_json::json!({"text": "é", "times": 200}).to_string();
        let outcome = registry.execute("echo", &args, ctx()).await;
        assert!(!outcome.is_error);
        assert!(outcome.content.len() <= 100, "{}", outcome.content.len());
        let (head, rest) = outcome.content.split_once("\n…[").unwrap();
        let (omitted, tail) = rest.split_once(" bytes omitted]…\n").unwrap();
        assert!(head.chars().all(|c| c == 'é') && tail.chars().all(|c| c == 'é'));
        assert_eq!(
            head.len() + tail.len() + omitted.parse::<usize>().unwrap(),
            400
        );
    }

    #[tokio::test]
    async fn cancellation_returns_promptly() {
        let ctx = ctx();
        let cancel = ctx.cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            cancel.cancel();
        });
        let started = std::time::Instant::now();
        let outcome = registry(1000)
            .execute("sleep", r#"{"seconds": 30}"#, ctx)
            .await;
        assert!(outcome.is_error && outcome.uncertain, "cancelled while running: {outcome:?}");
        assert!(outcome.content.starts_with(UNCERTAIN_PREFIX), "{}", outcome.content);
        assert!(started.elapsed() < std::time::Duration::from_secs(5));

        let ctx = self::ctx();
        ctx.cancel.cancel();
        let outcome = registry(1000).execute("sleep", r#"{"seconds": 30}"#, ctx).await;
        assert_eq!(outcome, ToolOutcome::error("cancelled"), "cancelled before it started: nothing ran");
    }

    #[tokio::test]
    async fn uncertain_errors_pass_through_bounded() {
        let registry = registry(1000);
        let outcome = registry.execute("echo", r#"{"text":"timeout ","times":500,"uncertain":true}"#, ctx()).await;
        assert!(outcome.is_error && outcome.uncertain, "{outcome:?}");
        assert!(outcome.content.starts_with(UNCERTAIN_PREFIX), "the text says the outcome is unknown: {}", outcome.content);
        assert!(outcome.content.len() <= 1000, "still bounded: {}", outcome.content.len());
        let json = serde_json::to_value(&outcome).unwrap();
        assert_eq!(json["uncertain"], true);
        let old: ToolOutcome = serde_json::from_value(serde_json::json!({"content": "x", "is_error": true})).unwrap();
        assert!(!old.uncertain, "outcomes serialized before the field read as certain");
    }
}
