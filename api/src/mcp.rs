//! The northbound MCP server (issue 12, part 4): agentloop as MCP tools for Claude Desktop,
//! Cursor or another agent, over streamable HTTP at `/mcp` (official Rust SDK `rmcp`, server
//! side; [`serve`] adapts actix-web to rmcp's `StreamableHttpService`).
//!
//! **Identity.** Every HTTP request to `/mcp` is authenticated like the rest of the API — a
//! bearer API key (or, only with `DEV_LOOPBACK_PRINCIPAL` and a loopback peer AND `Host`, the
//! `local` principal) — before rmcp sees it; the principal rides in the request's extensions and
//! every tool call and resource read acts as THAT request's principal. There is no fixed actor
//! and no session-bound identity: a client that changes its key changes who it is on the next
//! call, and another principal's ids are `not_found`, exactly as on `/api`. The server runs
//! stateless (no MCP session is kept in this process), so any api process can serve any request.
//!
//! **One command path.** Tools call the same functions as the HTTP routes
//! (`routes::chat::post_chat::submit`, `routes::runs::get_run::view`, ...), which call
//! `agentloop_shared::commands` — the step functions; nothing here writes on its own.
//!
//! Tools: `list_threads`, `create_thread`, `send_message` (durable, idempotent by `commandId`;
//! returns the run), `get_run`, `wait_run` (bounded wait; returns the final answer),
//! `approve_tool_call`, `reject_tool_call`, `cancel_run`. A tool's failure is a result with
//! `isError: true` and `structuredContent: {"error": {"code", "message"}}` (codes as on `/api`:
//! `not_found`, `run_active`, `idempotency_conflict`, `invalid_arguments`, ...). Resources: each
//! thread's window (`agentloop://threads/{threadId}`, JSON as `GET /api/threads/{id}`), the
//! caller's 50 most recent threads listed.

use std::sync::Arc;
use std::time::Duration;

use actix_web::{HttpRequest, HttpResponse, web};
use agentloop_shared::auth::Principal;
use agentloop_shared::messages::Message;
use agentloop_shared::runs::{self, status};
use diesel::prelude::*;
use diesel_async::RunQueryDsl;
use futures_util::StreamExt;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, Implementation, ListResourceTemplatesResult, ListResourcesResult,
    ListToolsResult, PaginatedRequestParams, ReadResourceRequestParams, ReadResourceResponse, ReadResourceResult, Resource,
    ResourceContents, ResourceTemplate, ServerCapabilities, ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::{MaybeSendFuture, RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, ServerHandler};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;

/// Default and longest `wait_run` wait, in ms.
const WAIT_DEFAULT_MS: u64 = 30_000;
const WAIT_MAX_MS: u64 = 120_000;
/// URI prefix of thread resources.
const THREAD_URI: &str = "agentloop://threads/";

/// The caller of one `/mcp` HTTP request (put in the request's extensions by [`serve`]).
#[derive(Debug, Clone)]
pub struct McpCaller(pub Principal);

/// The MCP service (one per api process; cheap to share).
pub type McpService = StreamableHttpService<AgentloopMcp, NeverSessionManager>;

/// Builds the service over `state`. `max_body` bounds a request body.
pub fn service(state: web::Data<AppState>, max_body: usize) -> Arc<McpService> {
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true)
        .with_sse_keep_alive(Some(Duration::from_secs(10)))
        // Every request carries a verified key (or is a loopback request with a loopback Host,
        // checked in `serve`), so the DNS-rebinding Host check adds nothing and would refuse
        // every deployment behind a real host name.
        .disable_allowed_hosts()
        .with_max_request_body_bytes(max_body);
    Arc::new(StreamableHttpService::new(move || Ok(AgentloopMcp { state: state.clone() }), Arc::new(NeverSessionManager::default()), config))
}

/// `GET|POST|DELETE /mcp`: authenticates, then hands the request to rmcp. 401 (with
/// `WWW-Authenticate: Bearer`) without a valid key.
///
/// A call that waits (`wait_run`, up to 120 s) ends when its key is revoked or expires, as a
/// live-update stream does (acceptance probe H: `wait_run` answered 17 s after the revocation):
/// 401 `credentials_revoked`.
pub async fn serve(
    mcp: web::Data<Arc<McpService>>,
    state: web::Data<crate::AppState>,
    who: crate::extract::Authenticated,
    req: HttpRequest,
    body: web::Bytes,
) -> Result<HttpResponse, ApiError> {
    // The keyless development principal only for a loopback Host too: a browser page of another
    // site that resolves its name to 127.0.0.1 (DNS rebinding) must not act as `local`.
    if req.headers().get(actix_web::http::header::AUTHORIZATION).is_none() {
        let host = req.connection_info().host().to_owned();
        let name = host.rsplit_once(':').map_or(host.as_str(), |(h, p)| if p.bytes().all(|b| b.is_ascii_digit()) { h } else { host.as_str() });
        if !matches!(name, "localhost" | "127.0.0.1" | "[::1]") {
            return Err(ApiError::Unauthorized);
        }
    }
    if let Some(refusal) = refuse_message(&body) {
        return refusal;
    }
    let mut builder = http::Request::builder().method(req.method().as_str()).uri(req.uri().to_string());
    for (name, value) in req.headers() {
        builder = builder.header(name.as_str(), value.as_bytes());
    }
    let mut request = builder
        .body(http_body_util::Full::new(body))
        .map_err(|e| ApiError::bad_request("invalid_request", format!("unreadable MCP request: {e}")))?;
    let watch = state.limits.watch(who.0.id, who.1);
    let revoked = watch.revoked();
    request.extensions_mut().insert(McpCaller(who.0));
    let response = tokio::select! {
        response = mcp.handle(request) => response,
        () = revoked.cancelled() => {
            return Err(ApiError::Unauthenticated {
                code: "credentials_revoked",
                message: "the API key of this request was revoked or expired while it waited".into(),
            });
        }
    };
    drop(watch);
    let (parts, body) = response.into_parts();
    if parts.status.is_client_error() || parts.status.is_server_error() {
        // rmcp answers transport errors (406, 415, a malformed JSON-RPC body, ...) in its own
        // words; the API's clients get them in the one error envelope, with rmcp's text.
        let status = actix_web::http::StatusCode::from_u16(parts.status.as_u16()).unwrap_or(actix_web::http::StatusCode::BAD_REQUEST);
        let bytes = http_body_util::BodyExt::collect(body).await.map(|c| c.to_bytes()).unwrap_or_default();
        let text = String::from_utf8_lossy(&bytes[..bytes.len().min(2048)]).trim().to_owned();
        return Err(ApiError::Status { status, code: "mcp_transport_error", message: if text.is_empty() { status.to_string() } else { text } });
    }
    let mut out = HttpResponse::build(actix_web::http::StatusCode::from_u16(parts.status.as_u16()).unwrap_or_default());
    for (name, value) in &parts.headers {
        out.append_header((name.as_str(), value.as_bytes()));
    }
    let stream = http_body_util::BodyExt::into_data_stream(body).map(|chunk| chunk.map_err(|never| match never {}));
    Ok(out.streaming(stream))
}

/// JSON-RPC "Invalid params" (JSON-RPC 2.0 §5.1).
const INVALID_PARAMS: i64 = -32602;

/// Answers, before rmcp sees it, a body that rmcp would misreport:
///
/// - a JSON-RPC batch (an array): MCP 2025-06-18 removed batching, so HTTP 400
///   `jsonrpc_batch_unsupported` in the API's error envelope, like every other transport-level
///   refusal of `/mcp` (rmcp would answer 415, as if the media type were wrong);
/// - `tools/call` whose `params` lack a string `name` or carry non-object `arguments`: HTTP 200
///   with JSON-RPC error `-32602` Invalid params for that request id (rmcp cannot parse such a
///   request into a known method and would answer `-32601` Method not found);
/// - anything else that is JSON but not a JSON-RPC 2.0 message (a scalar, no `"jsonrpc":
///   "2.0"`, an `id` of another type): HTTP 400 `invalid_jsonrpc` (rmcp would answer 415).
///
/// `None` for a well-formed message, and for bodies that are not JSON (answered in the envelope
/// as rmcp's transport errors are).
fn refuse_message(body: &[u8]) -> Option<Result<HttpResponse, ApiError>> {
    let message: Value = serde_json::from_slice(body).ok()?;
    match &message {
        Value::Array(_) => Some(Err(ApiError::bad_request(
            "jsonrpc_batch_unsupported",
            "JSON-RPC batches are not supported (MCP 2025-06-18): send one message per request",
        ))),
        Value::Object(m) if m.get("method").and_then(Value::as_str) == Some("tools/call") && m.contains_key("id") => {
            let params = m.get("params");
            let name_ok = params.and_then(|p| p.get("name")).is_some_and(Value::is_string);
            let args_ok = params.and_then(|p| p.get("arguments")).is_none_or(|a| a.is_object() || a.is_null());
            let text = match (params.is_some_and(Value::is_object), name_ok, args_ok) {
                (false, _, _) => "tools/call needs params {name, arguments?}",
                (true, false, _) => "tools/call params need a string name",
                (true, true, false) => "tools/call arguments must be an object",
                (true, true, true) => return None,
            };
            Some(Ok(HttpResponse::Ok()
                .json(json!({"jsonrpc": "2.0", "id": m["id"].clone(), "error": {"code": INVALID_PARAMS, "message": text}}))))
        }
        // Not a JSON-RPC 2.0 message rmcp can read (a scalar, no `"jsonrpc": "2.0"`, an `id`
        // that is not a string or an integer): rmcp would call it an unsupported media type.
        Value::Object(m)
            if m.get("jsonrpc").and_then(Value::as_str) == Some("2.0")
                && m.get("id").is_none_or(|id| id.is_string() || id.is_i64() || id.is_u64()) =>
        {
            None
        }
        _ => Some(Err(ApiError::bad_request(
            "invalid_jsonrpc",
            "not a JSON-RPC 2.0 message: an object with \"jsonrpc\": \"2.0\", a method or a result, and a string or integer id",
        ))),
    }
}

/// The MCP server handler (one per request; holds the shared state).
#[derive(Clone)]
pub struct AgentloopMcp {
    state: web::Data<AppState>,
}

fn schema(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

fn uuid_prop(description: &str) -> Value {
    json!({"type": "string", "format": "uuid", "description": description})
}

/// The tools (names, descriptions, JSON schemas).
fn tools() -> Vec<Tool> {
    let read = ToolAnnotations::new().read_only(true);
    vec![
        Tool::new(
            "list_threads",
            "List your threads, most recently updated first: id, title, model, messageCount, a one-message preview and the active run.",
            schema(json!({"type": "object", "properties": {
                "limit": {"type": "integer", "minimum": 1, "maximum": 100, "description": "page size (default 50)"},
                "cursor": {"type": "string", "description": "nextCursor of the previous page"}}})),
        )
        .with_annotations(read.clone()),
        Tool::new(
            "create_thread",
            "Create a thread (a durable conversation). Returns it; use its id with send_message.",
            schema(json!({"type": "object", "properties": {
                "title": {"type": "string", "maxLength": 500},
                "model": {"type": "string", "description": "a configured model id (default: the server's)"},
                "metadata": {"type": "object", "description": "e.g. {\"multitask\": \"enqueue\"}"}}})),
        ),
        Tool::new(
            "send_message",
            "Post a user message to a thread and start the agent run that answers it. Durable: the turn is committed before this returns. \
             Idempotent by commandId: retrying with the same commandId and content returns the same run instead of posting twice. \
             Returns {run, message}; follow the run with wait_run or get_run.",
            schema(json!({"type": "object", "properties": {
                "threadId": uuid_prop("the thread"),
                "content": {"description": "the message: text, or an array of content parts", "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
                "commandId": {"type": "string", "minLength": 1, "maxLength": 200, "description": "your unique id of this command (e.g. a UUID)"},
                "multitask": {"type": "string", "enum": ["reject", "enqueue", "interrupt"], "description": "while another run is active (default reject)"},
                "maxSteps": {"type": "integer", "minimum": 1, "maximum": 10000},
                "model": {"type": "string"}},
                "required": ["threadId", "content", "commandId"]})),
        ),
        Tool::new(
            "get_run",
            "A run: status (queued, running, waiting_approval, waiting_authorization, blocked, completed, failed, cancelled), usage, error, its steps, and \
             its pending approvals (waiting_approval) or uncertain operations (blocked).",
            schema(json!({"type": "object", "properties": {"runId": uuid_prop("the run")}, "required": ["runId"]})),
        )
        .with_annotations(read.clone()),
        Tool::new(
            "wait_run",
            "Wait (at most timeoutMs, default 30000, up to 120000) until the run ends or needs a human decision. Returns {done, status, \
             answer (the final assistant text when completed), run}. Call it again while done is false and the run is still going.",
            schema(json!({"type": "object", "properties": {
                "runId": uuid_prop("the run"),
                "timeoutMs": {"type": "integer", "minimum": 0, "maximum": WAIT_MAX_MS}},
                "required": ["runId"]})),
        )
        .with_annotations(read),
        Tool::new(
            "approve_tool_call",
            "Approve a pending tool call of a run in waiting_approval (ids in get_run's approvals), optionally with edited arguments \
             (validated against the tool's schema). When it was the last undecided call, the same run continues.",
            schema(json!({"type": "object", "properties": {
                "approvalId": uuid_prop("the approval"),
                "arguments": {"type": "object", "description": "arguments to run the tool with instead of the proposal"}},
                "required": ["approvalId"]})),
        ),
        Tool::new(
            "reject_tool_call",
            "Reject a pending tool call; the model reads \"Tool call declined by the user. Reason: ...\".",
            schema(json!({"type": "object", "properties": {
                "approvalId": uuid_prop("the approval"),
                "reason": {"type": "string", "maxLength": 2000}},
                "required": ["approvalId"]})),
        ),
        Tool::new(
            "cancel_run",
            "Cancel a run (idempotent). A running run stops at its next safe point; what it streamed is kept, marked stopped.",
            schema(json!({"type": "object", "properties": {"runId": uuid_prop("the run")}, "required": ["runId"]})),
        )
        .with_annotations(ToolAnnotations::new().idempotent(true)),
    ]
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListArgs {
    limit: Option<i64>,
    cursor: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RunArgs {
    run_id: Uuid,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WaitArgs {
    run_id: Uuid,
    timeout_ms: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SendArgs {
    thread_id: Uuid,
    content: Value,
    command_id: String,
    multitask: Option<String>,
    max_steps: Option<i32>,
    model: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ApproveArgs {
    approval_id: Uuid,
    arguments: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RejectArgs {
    approval_id: Uuid,
    reason: Option<String>,
}

fn args<T: serde::de::DeserializeOwned>(arguments: Option<Map<String, Value>>) -> Result<T, ApiError> {
    serde_json::from_value(Value::Object(arguments.unwrap_or_default()))
        .map_err(|e| ApiError::bad_request("invalid_arguments", format!("invalid arguments: {e}")))
}

/// The tool-result form of an API error.
fn tool_error(e: &ApiError) -> CallToolResult {
    use actix_web::ResponseError;
    let response = e.error_response();
    let code = e.code().to_owned();
    let message = if response.status().is_server_error() && matches!(e, ApiError::Internal(_)) { "internal error".to_owned() } else { e.to_string() };
    CallToolResult::structured_error(json!({"error": {"code": code, "message": message}}))
}

/// The caller of the HTTP request this MCP request came in.
fn caller(context: &RequestContext<RoleServer>) -> Result<Principal, ErrorData> {
    context
        .extensions
        .get::<http::request::Parts>()
        .and_then(|parts| parts.extensions.get::<McpCaller>())
        .map(|c| c.0.clone())
        .ok_or_else(|| ErrorData::internal_error("unauthenticated MCP request", None))
}

impl AgentloopMcp {
    async fn call(&self, principal: Uuid, name: &str, arguments: Option<Map<String, Value>>) -> Result<Value, ApiError> {
        let state = &self.state;
        match name {
            "list_threads" => {
                let a: ListArgs = args(arguments)?;
                crate::routes::threads::list_threads::page(state, principal, a.limit, a.cursor.as_deref()).await
            }
            "create_thread" => {
                let body: crate::routes::threads::create_thread::CreateThread = args(arguments)?;
                crate::routes::threads::create_thread::create(state, principal, body).await
            }
            "send_message" => {
                let a: SendArgs = args(arguments)?;
                if a.command_id.trim().is_empty() {
                    return Err(ApiError::bad_request("invalid_arguments", "commandId must not be empty"));
                }
                let body = crate::routes::chat::post_chat::PostChat {
                    content: a.content,
                    command_id: Some(a.command_id),
                    multitask: a.multitask,
                    max_steps: a.max_steps,
                    model: a.model,
                };
                crate::routes::chat::post_chat::submit(state, principal, a.thread_id, body, None).await
            }
            "get_run" => {
                let a: RunArgs = args(arguments)?;
                crate::routes::runs::get_run::view(state, principal, a.run_id).await
            }
            "wait_run" => {
                let a: WaitArgs = args(arguments)?;
                self.wait_run(principal, a.run_id, Duration::from_millis(a.timeout_ms.unwrap_or(WAIT_DEFAULT_MS).min(WAIT_MAX_MS))).await
            }
            "approve_tool_call" => {
                let a: ApproveArgs = args(arguments)?;
                crate::routes::approvals::approve_approval::approve(state, principal, a.approval_id, a.arguments).await
            }
            "reject_tool_call" => {
                let a: RejectArgs = args(arguments)?;
                crate::routes::approvals::reject_approval::reject(state, principal, a.approval_id, a.reason).await
            }
            "cancel_run" => {
                let a: RunArgs = args(arguments)?;
                Ok(agentloop_shared::commands::cancel_run(&state.store, principal, a.run_id).await?)
            }
            other => Err(ApiError::bad_request("unknown_tool", format!("no tool named {other}"))),
        }
    }

    /// Waits until the run is terminal or needs a human (waiting_approval, waiting_authorization, blocked), at most
    /// `timeout`. `{done, status, answer, run}`; 404 for another principal's run.
    async fn wait_run(&self, principal: Uuid, run_id: Uuid, timeout: Duration) -> Result<Value, ApiError> {
        let state = &self.state;
        let mut conn = state.pool.get().await?;
        let run = runs::get_owned(&mut conn, run_id, principal).await?.ok_or(ApiError::NotFound)?;
        drop(conn);
        let mut wake = state.hub.subscribe(run.thread_id);
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            wake.borrow_and_update();
            let mut conn = state.pool.get().await?;
            let run = runs::get_owned(&mut conn, run_id, principal).await?.ok_or(ApiError::NotFound)?;
            let settled = run.is_terminal() || matches!(run.status.as_str(), status::WAITING_APPROVAL | status::WAITING_AUTHORIZATION | status::BLOCKED);
            if settled || tokio::time::Instant::now() >= deadline {
                let answer = if run.status == status::COMPLETED { final_answer(&mut conn, run_id).await? } else { None };
                drop(conn);
                let view = crate::routes::runs::get_run::view(state, principal, run_id).await?;
                return Ok(json!({"done": run.is_terminal(), "status": run.status, "answer": answer, "run": view}));
            }
            drop(conn);
            tokio::select! {
                _ = wake.changed() => {}
                _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                _ = tokio::time::sleep_until(deadline) => {}
            }
        }
    }
}

/// The text of the run's last active assistant message (its final answer).
async fn final_answer(conn: &mut diesel_async::AsyncPgConnection, run_id: Uuid) -> Result<Option<String>, ApiError> {
    use agentloop_shared::db::schema::messages as m;
    let last: Option<Message> = m::table
        .filter(m::run_id.eq(run_id))
        .filter(m::active)
        .filter(m::role.eq(agentloop_shared::messages::role::ASSISTANT))
        .order(m::sequence.desc())
        .select(Message::as_select())
        .first(conn)
        .await
        .optional()?;
    Ok(last.map(|m| m.text()))
}

fn thread_uri(id: &str) -> String {
    format!("{THREAD_URI}{id}")
}

impl ServerHandler for AgentloopMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().enable_resources().build())
            .with_server_info(Implementation::new("agentloop", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "agentloop runs durable, tool-using agent conversations. create_thread, then send_message (with a unique commandId) \
                 and wait_run for the answer; approve_tool_call / reject_tool_call when a run waits for approval.",
            )
    }

    fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ListToolsResult, ErrorData>> + MaybeSendFuture + '_ {
        std::future::ready(Ok(ListToolsResult::with_all_items(tools())))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        {
            let principal = caller(&context)?;
            if !tools().iter().any(|t| t.name == request.name) {
                return Err(ErrorData::invalid_params(format!("no tool named {}", request.name), None));
            }
            let result = match self.call(principal.id, &request.name, request.arguments).await {
                Ok(value) => CallToolResult::structured(value),
                Err(e) => tool_error(&e),
            };
            Ok(CallToolResponse::Complete(result))
        }
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        {
            let principal = caller(&context)?;
            let page = crate::routes::threads::list_threads::page(&self.state, principal.id, Some(50), None)
                .await
                .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
            let resources = page["threads"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| {
                    let id = t["id"].as_str()?;
                    let title = t["title"].as_str().filter(|s| !s.is_empty()).unwrap_or("untitled");
                    Some(
                        Resource::new(thread_uri(id), title.to_owned())
                            .with_description(format!("thread window ({} messages)", t["messageCount"]))
                            .with_mime_type("application/json"),
                    )
                })
                .collect();
            Ok(ListResourcesResult::with_all_items(resources))
        }
    }

    fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ListResourceTemplatesResult, ErrorData>> + MaybeSendFuture + '_ {
        std::future::ready(Ok(ListResourceTemplatesResult::with_all_items(vec![
            ResourceTemplate::new(format!("{THREAD_URI}{{threadId}}"), "thread")
                .with_description("A thread's window: the first 20 and last 100 messages (bounded), the active run, the streaming partial")
                .with_mime_type("application/json"),
        ])))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        {
            let principal = caller(&context)?;
            let not_found = || ErrorData::resource_not_found(format!("no resource {}", request.uri), None);
            let id = request.uri.strip_prefix(THREAD_URI).and_then(|id| Uuid::parse_str(id).ok()).ok_or_else(not_found)?;
            let view = match crate::routes::threads::get_thread::view(&self.state, principal.id, id).await {
                Ok(view) => view,
                Err(ApiError::NotFound) => return Err(not_found()),
                Err(e) => return Err(ErrorData::internal_error(e.to_string(), None)),
            };
            let contents = match ResourceContents::text(view.to_string(), request.uri.clone()) {
                ResourceContents::TextResourceContents { uri, text, meta, .. } => {
                    ResourceContents::TextResourceContents { uri, mime_type: Some("application/json".into()), text, meta }
                }
                other => other,
            };
            Ok(ReadResourceResponse::Complete(ReadResourceResult::new(vec![contents])))
        }
    }
}
