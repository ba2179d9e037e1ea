//! MCP servers as tool sources, through the official Rust SDK `rmcp` (client side): streamable
//! HTTP and stdio (child process) transports.
//!
//! Each configured server is one [`McpServer`]: it connects lazily (at worker start-up and again
//! after a failure, at most every [`RECONNECT_BACKOFF`]), lists its tools and offers them to the
//! model as `<server>__<tool>` with their JSON schemas. A call passes the run's stable operation
//! key as the request's `_meta.idempotencyKey` (SPEC §7). A server that is down never fails a run:
//! the call becomes an error result the model reads (`MCP server `x` is unavailable: ...`).
//!
//! **A connection is never reused after it may be stuck or is known dead.** A call that times
//! out, or ends in a transport error, discards its connection (a stdio server's process is shut
//! down — stdin closed, then SIGTERM, then killed — once no call uses it any more), and the next
//! call opens a fresh one (a new process, a new HTTP session) at once, without the backoff. A
//! connection found dead before a call is sent (the stdio process exited, the transport closed)
//! is replaced before sending; if that fails the call is a failed tool error the model reads,
//! never uncertain (nothing was sent).
//!
//! The `http` transport uses its own reqwest client: the server's connect and read timeouts, no
//! redirects unless `"redirects": "same-origin"`, and rmcp's response limits set to
//! `maxResponseBytes` (a JSON answer or SSE event over it is rejected while it streams in; rmcp
//! cannot truncate one). Sessions are not silently re-initialized after an expiry: the call
//! fails and the next one reconnects.
//!
//! **Servers with `auth: oauth`** (MCP's OAuth authorization; docs/architecture.md §15) act for
//! the run's user, so nothing of one user's connection may serve another: the shared connection
//! is used only to list the tools (anonymously, at start-up), and every call goes through a
//! session of its (principal, server) pair, opened with that principal's bearer token
//! ([`McpCredential`], resolved by the caller from `mcp_tokens`) and replaced when the token
//! changes. At most [`MAX_PRINCIPAL_SESSIONS`] such sessions are kept per server (the least
//! recently used is closed). A 401 (or a 403 `insufficient_scope`) answer to the session's
//! initialization or to the call is [`ToolError::AuthorizationRequired`] with the server's
//! `WWW-Authenticate` challenge: the call certainly had no effect, the session is dropped, and
//! the worker parks the run for a sign-in ([`crate::mcp_auth`]).
//!
//! Outcomes of a call ([`classify_call_error`]): a JSON-RPC error answer or an `isError` result
//! is failed (the server answered), as is a failure to connect before the request was sent (and,
//! for stdio, a failure to write the request to the server's stdin); a call timeout, a transport
//! error or a connection closed after the request was sent is uncertain.

use std::collections::HashMap;
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use rmcp::model::{CallToolRequestParams, CallToolResult, ContentBlock, MetaObject, RequestMetaObject};
use rmcp::service::{ClientInitializeError, RoleClient, RunningService, ServiceError, ServiceExt};
use rmcp::transport::common::client_side_sse::ExponentialBackoff;
use rmcp::transport::streamable_http_client::StreamableHttpError;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use uuid::Uuid;

use super::config::{DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_MCP_CALL_TIMEOUT_MS, DEFAULT_MCP_CONNECT_TIMEOUT_MS, McpServerConfig, McpTransport};
use super::http::{OnRefusedRedirect, classify_send_error, describe, outbound_client, redirect_policy};
use super::{Tool, ToolContext, ToolError};

/// Minimum pause between two connection attempts to a server that failed.
pub const RECONNECT_BACKOFF: Duration = Duration::from_secs(5);

/// How often a broken SSE answer stream of the `http` transport is resumed before the call's
/// outcome is given up as unknown.
pub const SSE_RESUME_ATTEMPTS: usize = 3;

/// `_meta` key carrying the operation key of a call.
pub const IDEMPOTENCY_META_KEY: &str = "idempotencyKey";

type Client = RunningService<RoleClient, ()>;

/// Most (principal, server) sessions kept open per `auth: oauth` server.
pub const MAX_PRINCIPAL_SESSIONS: usize = 256;

/// Who a call of an `auth: oauth` server's tool is made for, and their access token.
#[derive(Clone)]
pub struct McpCredential {
    /// The run's principal: the session used is this principal's own.
    pub principal: Uuid,
    /// The principal's access token for this server; `None` when they have none (the call goes
    /// without, and the server's 401 starts a sign-in).
    pub token: Option<String>,
}

impl std::fmt::Debug for McpCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpCredential").field("principal", &self.principal).field("token", &self.token.as_ref().map(|_| "..")).finish()
    }
}

/// An MCP server's refusal for want of authorization.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuthChallenge {
    /// The configured server name.
    pub server: String,
    /// The answer's `WWW-Authenticate` header (`Bearer resource_metadata="...", scope="..."`),
    /// if it had one.
    pub www_authenticate: Option<String>,
    /// The refused request carried a token: the server revoked it or it expired there.
    pub had_token: bool,
}

/// A (principal, server) session of an `auth: oauth` server. Shared: every call holds its own
/// reference while it runs, so a session replaced or dropped from the map (a concurrent call
/// opened another, a call failed) is closed only when its last call has finished — never under
/// another call in flight (which would then end "answer stream closed", an unknown outcome).
struct Session {
    client: Arc<Client>,
    /// SHA-256 of the token the session was opened with.
    fingerprint: Option<String>,
    used: Instant,
}

/// Why a connection could not be opened.
enum OpenError {
    /// HTTP 401 (or 403 insufficient_scope), with the `WWW-Authenticate` header if any.
    Auth(Option<String>),
    Other(String),
}

/// SHA-256 (hex) of a token (compared, stored and logged instead of the token).
pub fn fingerprint(token: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(token.as_bytes()))
}

/// Connection state of a server.
#[derive(Default)]
struct State {
    /// Shared as [`Session::client`] is, for the same reason.
    client: Option<Arc<Client>>,
    last_error: Option<String>,
    last_attempt: Option<Instant>,
}

/// One configured MCP server and the tools it offers.
pub struct McpServer {
    config: McpServerConfig,
    state: tokio::sync::Mutex<State>,
    /// Per-principal sessions (`auth: oauth` servers only).
    sessions: tokio::sync::Mutex<HashMap<Uuid, Session>>,
    tools: RwLock<Vec<Arc<McpTool>>>,
    this: Weak<McpServer>,
}

impl std::fmt::Debug for McpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpServer").field("name", &self.config.name).finish()
    }
}

impl McpServer {
    /// A server handle for `config` (not connected yet; see [`McpServer::connect`]).
    pub fn new(config: McpServerConfig) -> Arc<Self> {
        Arc::new_cyclic(|this| Self {
            config,
            state: tokio::sync::Mutex::default(),
            sessions: tokio::sync::Mutex::default(),
            tools: RwLock::default(),
            this: this.clone(),
        })
    }

    /// The configured name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The OAuth settings of an `auth: oauth` server.
    pub fn oauth(&self) -> Option<&super::config::McpAuthConfig> {
        self.config.auth.as_ref()
    }

    /// The configured endpoint of the `http` transport (the OAuth protected resource).
    pub fn url(&self) -> Option<&str> {
        self.config.url.as_deref()
    }

    /// The default policy of this server's tools, if configured.
    pub fn policy(&self) -> Option<super::config::Policy> {
        self.config.policy
    }

    /// Whether `tool_name` is in this server's namespace (`<name>__...`).
    pub fn owns(&self, tool_name: &str) -> bool {
        tool_name.strip_prefix(self.config.name.as_str()).is_some_and(|rest| rest.starts_with("__"))
    }

    /// The tools listed at the last successful connection.
    pub fn tools(&self) -> Vec<Arc<McpTool>> {
        self.tools.read().expect("mcp tools lock").clone()
    }

    /// The tool called `name` (`<server>__<tool>`), if listed.
    pub fn find(&self, name: &str) -> Option<Arc<McpTool>> {
        self.tools.read().expect("mcp tools lock").iter().find(|t| t.name == name).cloned()
    }

    /// Connects (unless connected) and refreshes the tool list. A connection whose transport
    /// has closed (a stdio server's process exited) is replaced. With `force` a server whose
    /// last connection attempt failed is retried at once, else at most every
    /// [`RECONNECT_BACKOFF`] (a connection discarded after a call is replaced at once). Errors
    /// are the reason the server is unavailable.
    pub async fn connect(&self, force: bool) -> Result<(), String> {
        self.connected(force).await.map(drop)
    }

    /// [`McpServer::connect`], returning the live connection.
    async fn connected(&self, force: bool) -> Result<Arc<Client>, String> {
        let mut state = self.state.lock().await;
        if let Some(client) = &state.client {
            if alive(client) {
                return Ok(client.clone());
            }
            tracing::warn!(mcp.server = %self.config.name, "MCP server connection closed; reconnecting");
            state.client = None;
        }
        if !force && state.last_error.is_some() && state.last_attempt.is_some_and(|t| t.elapsed() < RECONNECT_BACKOFF) {
            return Err(state.last_error.clone().unwrap_or_else(|| "not connected".into()));
        }
        state.last_attempt = Some(Instant::now());
        let timeout = self.connect_timeout();
        let result = match tokio::time::timeout(timeout, self.open()).await {
            Ok(Ok((client, tools))) => {
                *self.tools.write().expect("mcp tools lock") = tools;
                let client = Arc::new(client);
                state.client = Some(client.clone());
                state.last_error = None;
                tracing::info!(mcp.server = %self.config.name, tools = self.tools().len(), "MCP server connected");
                Ok(client)
            }
            Ok(Err(error)) => Err(error),
            Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
        };
        if let Err(error) = &result {
            tracing::warn!(mcp.server = %self.config.name, %error, "MCP server unavailable");
            state.client = None;
            state.last_error = Some(error.clone());
        }
        result
    }

    /// Opens a connection (with `bearer` as the `Authorization: Bearer` token, `http` only).
    async fn open_client(&self, bearer: Option<&str>) -> Result<Client, OpenError> {
        let client: Client = match self.config.transport {
            McpTransport::Http => {
                use rmcp::transport::StreamableHttpClientTransport;
                use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
                let url = self.config.url.clone().unwrap_or_default();
                let mut headers = HashMap::new();
                for (name, value) in &self.config.headers {
                    let name = reqwest::header::HeaderName::from_bytes(name.as_bytes()).map_err(|e| OpenError::Other(format!("header {name}: {e}")))?;
                    let value = reqwest::header::HeaderValue::from_str(value).map_err(|e| OpenError::Other(format!("header {name}: {e}")))?;
                    headers.insert(name, value);
                }
                let call_timeout = self.call_timeout();
                let read_timeout = self.config.read_timeout_ms.map_or(call_timeout, Duration::from_millis);
                let policy = redirect_policy(self.config.redirects, OnRefusedRedirect::Error);
                // No idle pooling, like rmcp's default client (avoids delayed-ACK stalls on reuse).
                let client = outbound_client(self.connect_timeout(), read_timeout, None, policy)
                    .pool_max_idle_per_host(0)
                    .build()
                    .map_err(|e| OpenError::Other(format!("cannot build the HTTP client: {}", describe(&e))))?;
                let cap = self.config.max_response_bytes.unwrap_or(DEFAULT_MAX_RESPONSE_BYTES);
                let mut config = StreamableHttpClientTransportConfig::with_uri(url)
                    .custom_headers(headers)
                    .max_json_response_size(cap)
                    .max_sse_event_size(cap)
                    .reinit_on_expired_session(false);
                if let Some(token) = bearer {
                    config = config.auth_header(token);
                }
                // A broken event stream is resumed a few times (0.25 + 0.5 + 1 s), not forever:
                // a call whose answer stream died ends as uncertain instead of waiting for the
                // call timeout.
                let mut retry = ExponentialBackoff::default();
                retry.max_times = Some(SSE_RESUME_ATTEMPTS);
                retry.base_duration = Duration::from_millis(250);
                retry.max_delay = Some(Duration::from_secs(2));
                config.retry_config = Arc::new(retry);
                let transport = StreamableHttpClientTransport::with_client(client, config);
                match ().serve(transport).await {
                    Ok(client) => client,
                    Err(e) => {
                        if let ClientInitializeError::TransportError { error, .. } = &e
                            && let Some(header) = auth_challenge(error.error.as_ref())
                        {
                            return Err(OpenError::Auth(header));
                        }
                        return Err(OpenError::Other(format!("cannot connect: {}", init_text(&e))));
                    }
                }
            }
            McpTransport::Stdio => {
                let mut command = tokio::process::Command::new(self.config.command.clone().unwrap_or_default());
                command.args(&self.config.args).envs(&self.config.env).kill_on_drop(true);
                // The server's stderr goes to the worker's log stream.
                let (transport, _) = rmcp::transport::TokioChildProcess::builder(command)
                    .stderr(std::process::Stdio::inherit())
                    .spawn()
                    .map_err(|e| OpenError::Other(format!("cannot start: {e}")))?;
                ().serve(transport).await.map_err(|e| OpenError::Other(format!("cannot connect: {}", init_text(&e))))?
            }
        };
        Ok(client)
    }

    async fn open(&self) -> Result<(Client, Vec<Arc<McpTool>>), String> {
        let client = self.open_client(None).await.map_err(|e| match e {
            OpenError::Auth(_) => "requires authorization even to list its tools (only servers that list them anonymously are supported with auth: oauth)".to_owned(),
            OpenError::Other(text) => text,
        })?;
        let listed = client.list_all_tools().await.map_err(|e| format!("cannot list tools: {}", service_text(&e)))?;
        let tools = listed
            .into_iter()
            .map(|tool| {
                let hints = tool.annotations.as_ref();
                let declared_idempotent =
                    hints.is_some_and(|a| a.read_only_hint == Some(true) || a.idempotent_hint == Some(true));
                Arc::new(McpTool {
                    server: self.this.clone(),
                    name: format!("{}__{}", self.config.name, tool.name),
                    remote: tool.name.to_string(),
                    description: tool.description.as_deref().unwrap_or_default().to_owned(),
                    schema: Value::Object((*tool.input_schema).clone()),
                    declared_idempotent,
                })
            })
            .collect();
        Ok((client, tools))
    }

    fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.config.connect_timeout_ms.unwrap_or(DEFAULT_MCP_CONNECT_TIMEOUT_MS))
    }

    fn call_timeout(&self) -> Duration {
        Duration::from_millis(self.config.call_timeout_ms.unwrap_or(DEFAULT_MCP_CALL_TIMEOUT_MS))
    }

    /// Discards `client` (the connection a call used, if it is still the current one): the next
    /// call opens a fresh one. The connection itself closes when no call holds it any more (a
    /// stdio server's process is then shut down).
    async fn discard(&self, client: &Arc<Client>, credential: Option<&McpCredential>) {
        match credential.filter(|_| self.config.auth.is_some()) {
            Some(credential) => {
                let mut sessions = self.sessions.lock().await;
                if sessions.get(&credential.principal).is_some_and(|s| Arc::ptr_eq(&s.client, client)) {
                    sessions.remove(&credential.principal);
                }
            }
            None => {
                let mut state = self.state.lock().await;
                if state.client.as_ref().is_some_and(|c| Arc::ptr_eq(c, client)) {
                    state.client = None;
                }
            }
        }
    }

    /// The peer of `credential`'s own session, opened (with their token) unless one with the
    /// same token is open.
    async fn principal_peer(&self, credential: &McpCredential) -> Result<Arc<Client>, ToolError> {
        let name = &self.config.name;
        let print = credential.token.as_deref().map(fingerprint);
        {
            let mut sessions = self.sessions.lock().await;
            if let Some(session) = sessions.get_mut(&credential.principal) {
                if session.fingerprint == print && alive(&session.client) {
                    session.used = Instant::now();
                    return Ok(session.client.clone());
                }
                sessions.remove(&credential.principal);
            }
        }
        let timeout = self.connect_timeout();
        let client = match tokio::time::timeout(timeout, self.open_client(credential.token.as_deref())).await {
            Ok(Ok(client)) => client,
            Ok(Err(OpenError::Auth(header))) => {
                return Err(ToolError::AuthorizationRequired(AuthChallenge {
                    server: name.clone(),
                    www_authenticate: header,
                    had_token: credential.token.is_some(),
                }));
            }
            Ok(Err(OpenError::Other(error))) => return Err(ToolError::Failed(format!("MCP server `{name}` is unavailable: {error}"))),
            Err(_) => return Err(ToolError::Failed(format!("MCP server `{name}` is unavailable: no answer within {} ms", timeout.as_millis()))),
        };
        let client = Arc::new(client);
        let mut sessions = self.sessions.lock().await;
        if let Some(session) = sessions.get_mut(&credential.principal)
            && session.fingerprint == print
            && alive(&session.client)
        {
            // A concurrent call opened one meanwhile: share it (ours closes when dropped here).
            session.used = Instant::now();
            return Ok(session.client.clone());
        }
        if sessions.len() >= MAX_PRINCIPAL_SESSIONS
            && let Some(oldest) = sessions.iter().min_by_key(|(_, s)| s.used).map(|(id, _)| *id)
        {
            sessions.remove(&oldest);
        }
        sessions.insert(credential.principal, Session { client: client.clone(), fingerprint: print, used: Instant::now() });
        Ok(client)
    }

    /// Calls `remote` with `args`; the result text, or a tool error the model can read
    /// (classified by [`classify_call_error`]; a server that cannot be reached before the call
    /// is sent is failed). An `auth: oauth` server is called through `credential`'s session
    /// (see the module docs).
    async fn call(&self, remote: &str, args: Value, key: &str, credential: Option<&McpCredential>) -> Result<String, ToolError> {
        let name = &self.config.name;
        let oauth = self.config.auth.is_some();
        // The session is held (not just its peer) until the call ends: see [`Session`].
        let client = match (oauth, credential) {
            (true, Some(credential)) => self.principal_peer(credential).await?,
            (true, None) => return Err(ToolError::Failed(format!("MCP server `{name}` acts for a signed-in user, and this call has none"))),
            (false, _) => self.connected(false).await.map_err(|e| ToolError::Failed(format!("MCP server `{name}` is unavailable: {e}")))?,
        };
        let arguments = match args {
            Value::Object(map) => map,
            _ => Map::new(),
        };
        let mut meta = Map::new();
        meta.insert(IDEMPOTENCY_META_KEY.into(), Value::String(key.to_owned()));
        let mut params = CallToolRequestParams::new(remote.to_owned()).with_arguments(arguments);
        params.meta = Some(RequestMetaObject(MetaObject(meta)));
        let timeout = self.call_timeout();
        match tokio::time::timeout(timeout, client.peer().call_tool(params)).await {
            Ok(Ok(result)) => result_text(result),
            Ok(Err(error)) => {
                if !matches!(error, ServiceError::McpError(_)) {
                    // The connection may be broken or out of step: the next call opens another.
                    self.discard(&client, credential).await;
                }
                if oauth
                    && let ServiceError::TransportSend(transport) = &error
                    && let Some(header) = auth_challenge(transport.error.as_ref())
                {
                    return Err(ToolError::AuthorizationRequired(AuthChallenge {
                        server: name.clone(),
                        www_authenticate: header,
                        had_token: credential.is_some_and(|c| c.token.is_some()),
                    }));
                }
                if matches!(error, ServiceError::TransportClosed) && self.config.transport == McpTransport::Http {
                    // rmcp drops an SSE event over the cap and then reports the stream closed.
                    let cap = self.config.max_response_bytes.unwrap_or(DEFAULT_MAX_RESPONSE_BYTES);
                    return Err(ToolError::Uncertain(format!(
                        "MCP server `{name}` closed the call's answer stream before answering (so does an answer over maxResponseBytes, {cap} bytes)"
                    )));
                }
                if let ServiceError::TransportSend(transport) = &error
                    && self.config.transport == McpTransport::Stdio
                {
                    // Writing the request to the server's stdin failed (its process is gone or
                    // closed its input): no complete request line reached it.
                    return Err(ToolError::Failed(format!(
                        "MCP server `{name}` is unavailable: the call could not be sent: {}",
                        transport_text(transport.error.as_ref())
                    )));
                }
                Err(classify_call_error(name, &error))
            }
            Err(_) => {
                // The server may be stuck (a stdio server that stopped reading its input would
                // never read another request): never reuse this connection.
                self.discard(&client, credential).await;
                Err(ToolError::Uncertain(format!("MCP server `{name}` did not answer within {} ms", timeout.as_millis())))
            }
        }
    }
}

/// Whether a connection can still carry a request: not closed, and its service loop still
/// running (it ends when the transport closes, e.g. a stdio server's process exited; rmcp's
/// `is_closed` alone does not notice that).
fn alive(client: &Client) -> bool {
    !client.is_closed() && !client.peer().is_transport_closed()
}

/// `Some(WWW-Authenticate header if any)` when a transport error is the server's refusal for
/// want of authorization: HTTP 401, or 403 with an `insufficient_scope` challenge.
fn auth_challenge(error: &(dyn std::error::Error + Send + Sync + 'static)) -> Option<Option<String>> {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = current {
        if let Some(http) = e.downcast_ref::<StreamableHttpError<reqwest::Error>>() {
            return match http {
                StreamableHttpError::AuthRequired(auth) => Some(Some(auth.www_authenticate_header.clone())),
                StreamableHttpError::InsufficientScope(scope) => Some(Some(scope.www_authenticate_header.clone())),
                StreamableHttpError::HttpStatus(status) if status.status == 401 => Some(None),
                StreamableHttpError::UnexpectedServerResponse(text) if text.starts_with("HTTP 401") => Some(None),
                _ => None,
            };
        }
        current = e.source();
    }
    None
}

/// Classifies the error of an MCP `tools/call` sent to `server` (the call timeout itself is
/// uncertain too; it is applied around the call):
///
/// - [`ToolError::Failed`]: the server answered with a JSON-RPC error; or the `http` transport
///   certainly did not deliver the request — it could not connect (see
///   [`super::http::classify_send_error`]), had an invalid header, or the server answered the
///   POST with a refusal (HTTP 3xx not followed other than 303, 401/403, 404 session expired,
///   other 4xx, 429).
/// - [`ToolError::Uncertain`]: anything after the request may have been sent — a transport
///   error while sending or reading (timeout, reset, truncated or oversized answer, HTTP 5xx,
///   an unparseable answer), a connection closed before the answer, a cancelled request.
pub fn classify_call_error(server: &str, error: &ServiceError) -> ToolError {
    let text = format!("MCP server `{server}` failed the call: {}", service_text(error));
    let failed = match error {
        ServiceError::McpError(_) => true,
        ServiceError::TransportSend(transport) => {
            let mut current: Option<&(dyn std::error::Error + 'static)> = Some(transport.error.as_ref());
            let mut found = None;
            while let Some(e) = current {
                if let Some(http) = e.downcast_ref::<StreamableHttpError<reqwest::Error>>() {
                    found = Some(http);
                    break;
                }
                current = e.source();
            }
            found.is_some_and(|http| http_error_is_refusal(server, http))
        }
        _ => false,
    };
    if failed { ToolError::Failed(text) } else { ToolError::Uncertain(text) }
}

/// Text of a transport error: reqwest's error chain when there is one (rmcp does not chain its
/// client errors as sources), without URLs.
fn transport_text(error: &(dyn std::error::Error + 'static)) -> String {
    match error.downcast_ref::<StreamableHttpError<reqwest::Error>>() {
        Some(StreamableHttpError::Client(e)) => describe(e),
        _ => describe(error),
    }
}

/// Text of a request's error, without rmcp's transport type names.
fn service_text(error: &ServiceError) -> String {
    match error {
        ServiceError::TransportSend(transport) => transport_text(transport.error.as_ref()),
        other => describe(other),
    }
}

/// Text of a failed initialization.
fn init_text(error: &ClientInitializeError) -> String {
    match error {
        ClientInitializeError::TransportError { error, context } => format!("{} (when {context})", transport_text(error.error.as_ref())),
        other => describe(other),
    }
}

/// Whether a streamable-HTTP transport error means the POST certainly had no effect.
fn http_error_is_refusal(server: &str, error: &StreamableHttpError<reqwest::Error>) -> bool {
    match error {
        StreamableHttpError::Client(e) => matches!(classify_send_error(e, server), ToolError::Failed(_)),
        StreamableHttpError::HttpStatus(status) => (400..500).contains(&status.status),
        StreamableHttpError::AuthRequired(_)
        | StreamableHttpError::InsufficientScope(_)
        | StreamableHttpError::SessionExpired
        | StreamableHttpError::ReservedHeaderConflict(_) => true,
        // rmcp reports other non-success answers as `HTTP <status>: <body>`.
        StreamableHttpError::UnexpectedServerResponse(text) => {
            text.strip_prefix("HTTP 4").is_some_and(|rest| rest.as_bytes().first().is_some_and(u8::is_ascii_digit))
        }
        _ => false,
    }
}

/// Text of a tool result: its text blocks joined by newlines (other blocks as placeholders),
/// else its structured content; `isError` makes it a tool error.
fn result_text(result: CallToolResult) -> Result<String, ToolError> {
    let mut parts = Vec::new();
    for block in &result.content {
        match block {
            ContentBlock::Text(text) => parts.push(text.text.clone()),
            ContentBlock::Image(image) => parts.push(format!("[image {}]", image.mime_type)),
            ContentBlock::Audio(audio) => parts.push(format!("[audio {}]", audio.mime_type)),
            _ => parts.push("[resource]".to_owned()),
        }
    }
    let mut text = parts.join("\n");
    if text.is_empty()
        && let Some(structured) = &result.structured_content
    {
        text = structured.to_string();
    }
    if result.is_error == Some(true) { Err(ToolError::Failed(text)) } else { Ok(text) }
}

/// A tool listed by an MCP server.
#[derive(Debug)]
pub struct McpTool {
    server: Weak<McpServer>,
    /// `<server>__<tool>`.
    name: String,
    /// The tool's own name on its server.
    remote: String,
    description: String,
    schema: Value,
    declared_idempotent: bool,
}

impl Tool for McpTool {
    fn name(&self) -> &str {
        &self.name
    }

    fn description(&self) -> &str {
        &self.description
    }

    fn parameters(&self) -> Value {
        self.schema.clone()
    }

    /// From the server's `readOnlyHint`/`idempotentHint` annotations (the tools file may
    /// override it).
    fn idempotent(&self) -> bool {
        self.declared_idempotent
    }

    fn call(&self, args: Value, ctx: ToolContext) -> BoxFuture<'static, Result<String, ToolError>> {
        let server = self.server.upgrade();
        let remote = self.remote.clone();
        Box::pin(async move {
            let server = server.ok_or_else(|| ToolError::Failed("MCP server is gone".into()))?;
            server.call(&remote, args, &ctx.idempotency_key, ctx.credential.as_ref()).await
        })
    }
}
