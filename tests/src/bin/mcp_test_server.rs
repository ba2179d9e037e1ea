//! `mcp-test-server`: an MCP server (rmcp, server side) for black-box tests of MCP tools, plus an
//! HTTP tool endpoint.
//!
//! ```text
//! mcp-test-server --listen 127.0.0.1:0   # streamable HTTP; prints MCP_TEST_URL=http://127.0.0.1:PORT
//! mcp-test-server --stdio                 # MCP over stdin/stdout (spawned by the worker)
//! mcp-test-server --listen 127.0.0.1:0 --oauth   # + an authorization server; see below
//! ```
//!
//! Tools:
//! - `echo {text}` -> `echo: <text>` (read-only: idempotent for agentloop);
//! - `add {a, b}` -> the sum (read-only);
//! - `ticket {title}` -> `ticket #N created: <title>` (not idempotent: goes through the
//!   operations ledger); every call is recorded with its `_meta.idempotencyKey`;
//! - `slow {ms}` -> `slept <ms> ms` after sleeping `ms` milliseconds (a call that outlives the
//!   client's call timeout; not idempotent);
//! - `reject {reason, result?}` -> a JSON-RPC error answer (`-32602`, the reason as message), or
//!   with `result: true` a tool result with `isError: true`;
//! - `big {bytes}` -> a text result of `bytes` `x` characters (read-only).
//!
//! - `note {text}` -> `note for <user>: <text>` (not idempotent; meant for `--oauth`, where
//!   `<user>` is the signed-in user of the call's bearer token, else `anonymous`).
//!
//! With `--oauth` (and `--listen`) the server is an OAuth-protected MCP resource with its own
//! authorization server (for the sign-in tests, `tests/tests/mcp_signin.rs`), printed on a second
//! line `OAUTH_AS_URL=http://127.0.0.1:PORT2`:
//! - every `tools/call` POST needs `Authorization: Bearer <token>` with a live token issued by
//!   that authorization server; else `401` with `WWW-Authenticate: Bearer error="invalid_token",
//!   resource_metadata="<MCP_TEST_URL>/.well-known/oauth-protected-resource/mcp"` (recorded by
//!   `GET /denied`: `[{tool, idempotencyKey, hadToken}]`); initialize and tools/list stay open;
//! - `GET /.well-known/oauth-protected-resource[/mcp]`: RFC 9728 metadata (`resource` =
//!   `<MCP_TEST_URL>/mcp`, `authorization_servers` = the AS);
//! - the AS: `GET /.well-known/oauth-authorization-server` (RFC 8414, S256 only);
//!   `GET /authorize?response_type=code&client_id=agentloop-test&redirect_uri&code_challenge
//!   &code_challenge_method=S256&state&resource[&user=NAME]` -> `302` to
//!   `redirect_uri?code&state` (the "user" signs in as NAME, default `user`);
//!   `POST /token` (form: authorization_code grant, code used once, PKCE verified, client and
//!   redirect_uri checked) -> `{access_token, token_type: "Bearer", expires_in}`;
//!   `POST /admin/ttl?secs=N` sets the lifetime of tokens issued from then on (default 3600);
//!   `POST /admin/revoke` revokes every token; `GET /admin/tokens`: `[{user, live}]`.
//!
//! HTTP endpoints (with `--listen`): `POST /mcp` (and GET/DELETE: the MCP streamable HTTP
//! transport); `GET /calls`: `[{tool, arguments, idempotencyKey}]` of every `tools/call`
//! received; `POST /http-tool`: an HTTP tool receiver answering `ok: <body>` and recording
//! the `Idempotency-Key` header (listed by `/calls` with `tool: "http-tool"`); any request to
//! `/moved...`: `307 Temporary Redirect` to `/mcp` (same origin).

use std::sync::{Arc, Mutex};

use anyhow::Context;
use clap::Parser;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult, PaginatedRequestParams,
    ServerCapabilities, ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::{MaybeSendFuture, RequestContext, RoleServer, ServiceExt};
use rmcp::{ErrorData, ServerHandler};
use serde_json::{Map, Value, json};

/// An MCP test server.
#[derive(Debug, Parser)]
#[command(name = "mcp-test-server")]
struct Args {
    /// Serve streamable HTTP on this address (port 0 picks one).
    #[arg(long)]
    listen: Option<String>,
    /// Serve MCP over stdin/stdout.
    #[arg(long)]
    stdio: bool,
    /// Protect tool calls with OAuth and serve an authorization server (see the module docs).
    #[arg(long)]
    oauth: bool,
    /// With `--oauth`: every `initialize` and `tools/call` POST is answered this many ms late
    /// (overlaps concurrent session opens and calls, deterministically).
    #[arg(long, default_value_t = 0)]
    slow_ms: u64,
}

/// The OAuth side of `--oauth`.
#[derive(Default)]
struct OAuth {
    /// `http://127.0.0.1:PORT` of the MCP server.
    mcp_base: String,
    /// `http://127.0.0.1:PORT2` of the authorization server.
    as_base: String,
    /// code -> (code_challenge, redirect_uri, user).
    codes: Mutex<std::collections::HashMap<String, (String, String, String)>>,
    /// token -> (user, expiry).
    tokens: Mutex<std::collections::HashMap<String, (String, std::time::Instant)>>,
    /// Lifetime of new tokens, seconds.
    ttl: Mutex<u64>,
    /// Refused tool calls.
    denied: Mutex<Vec<Value>>,
}

const CLIENT_ID: &str = "agentloop-test";

impl OAuth {
    /// The user of a live bearer token in `headers`.
    fn user(&self, headers: &hyper::HeaderMap) -> Option<String> {
        let token = headers.get("authorization")?.to_str().ok()?.strip_prefix("Bearer ")?;
        let tokens = self.tokens.lock().expect("tokens lock");
        let (user, expiry) = tokens.get(token)?;
        (*expiry > std::time::Instant::now()).then(|| user.clone())
    }
}

/// Every call received: `{tool, arguments, idempotencyKey}`.
type Calls = Arc<Mutex<Vec<Value>>>;

#[derive(Clone)]
struct TestServer {
    calls: Calls,
    oauth: Option<Arc<OAuth>>,
}

fn schema(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

fn tools() -> Vec<Tool> {
    let read_only = ToolAnnotations::new().read_only(true);
    vec![
        Tool::new(
            "echo",
            "Echo the text back.",
            schema(json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})),
        )
        .with_annotations(read_only.clone()),
        Tool::new(
            "add",
            "Add two numbers.",
            schema(json!({"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]})),
        )
        .with_annotations(read_only),
        Tool::new(
            "ticket",
            "Create a ticket (an external effect).",
            schema(json!({"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]})),
        ),
        Tool::new(
            "slow",
            "Sleep, then answer (an external effect that takes a while).",
            schema(json!({"type": "object", "properties": {"ms": {"type": "integer"}}, "required": ["ms"]})),
        ),
        Tool::new(
            "reject",
            "Answer with a JSON-RPC error.",
            schema(json!({"type": "object", "properties": {"reason": {"type": "string"}, "result": {"type": "boolean"}}})),
        ),
        Tool::new(
            "big",
            "Answer with `bytes` characters.",
            schema(json!({"type": "object", "properties": {"bytes": {"type": "integer"}}, "required": ["bytes"]})),
        )
        .with_annotations(ToolAnnotations::new().read_only(true)),
        Tool::new(
            "note",
            "Save a note for the signed-in user (an external effect).",
            schema(json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})),
        ),
    ]
}

impl ServerHandler for TestServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ListToolsResult, ErrorData>> + MaybeSendFuture + '_ {
        std::future::ready(Ok(ListToolsResult::with_all_items(tools())))
    }

    fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<CallToolResponse, ErrorData>> + MaybeSendFuture + '_ {
        let key = request
            .meta
            .as_ref()
            .and_then(|m| m.0.0.get("idempotencyKey").cloned())
            .or_else(|| context.meta.0.0.get("idempotencyKey").cloned())
            .unwrap_or(Value::Null);
        let args = Value::Object(request.arguments.clone().unwrap_or_default());
        let user = match (&self.oauth, context.extensions.get::<hyper::http::request::Parts>()) {
            (Some(oauth), Some(parts)) => oauth.user(&parts.headers),
            _ => None,
        };
        let count = {
            let mut calls = self.calls.lock().expect("calls lock");
            calls.push(json!({"tool": request.name, "arguments": args, "idempotencyKey": key, "user": user}));
            calls.iter().filter(|c| c["tool"] == "ticket").count()
        };
        let text = |t: String| Ok(CallToolResponse::Complete(CallToolResult::success(vec![ContentBlock::text(t)])));
        let name = request.name.to_string();
        async move {
            match name.as_str() {
                "echo" => text(format!("echo: {}", args["text"].as_str().unwrap_or_default())),
                "add" => text(format!("{}", args["a"].as_f64().unwrap_or(0.0) + args["b"].as_f64().unwrap_or(0.0))),
                "ticket" => text(format!("ticket #{count} created: {}", args["title"].as_str().unwrap_or_default())),
                "slow" => {
                    let ms = args["ms"].as_u64().unwrap_or(0);
                    tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                    text(format!("slept {ms} ms"))
                }
                "reject" if args["result"] == true => Ok(CallToolResponse::Complete(CallToolResult::error(vec![ContentBlock::text(format!(
                    "refused: {}",
                    args["reason"].as_str().unwrap_or_default()
                ))]))),
                "reject" => Err(ErrorData::invalid_params(format!("rejected: {}", args["reason"].as_str().unwrap_or_default()), None)),
                "big" => text("x".repeat(args["bytes"].as_u64().unwrap_or(0) as usize)),
                "note" => text(format!("note for {}: {}", user.as_deref().unwrap_or("anonymous"), args["text"].as_str().unwrap_or_default())),
                other => Ok(CallToolResponse::Complete(CallToolResult::error(vec![ContentBlock::text(format!("no tool {other}"))]))),
            }
        }
    }
}

fn body(text: String) -> BoxBody<Bytes, std::convert::Infallible> {
    Full::new(Bytes::from(text)).boxed()
}

fn json_response(status: u16, value: &Value) -> Response<BoxBody<Bytes, std::convert::Infallible>> {
    Response::builder().status(status).header("content-type", "application/json").body(body(value.to_string())).expect("response")
}

/// Query or form pairs of `text` (`a=1&b=2`).
fn pairs(text: &str) -> std::collections::HashMap<String, String> {
    reqwest::Url::parse(&format!("http://pairs.invalid/?{text}"))
        .map(|u| u.query_pairs().map(|(k, v)| (k.into_owned(), v.into_owned())).collect())
        .unwrap_or_default()
}

fn random_token(prefix: &str) -> String {
    format!("{prefix}{:032x}", rand::random::<u128>())
}

/// The authorization server of `--oauth` (see the module docs).
async fn authorization_server(oauth: &OAuth, request: Request<Incoming>) -> Response<BoxBody<Bytes, std::convert::Infallible>> {
    use base64::Engine;
    let path = request.uri().path().to_owned();
    let query = pairs(request.uri().query().unwrap_or_default());
    let error = |status: u16, code: &str| json_response(status, &json!({"error": code}));
    match path.as_str() {
        "/.well-known/oauth-authorization-server" => json_response(
            200,
            &json!({"issuer": oauth.as_base, "authorization_endpoint": format!("{}/authorize", oauth.as_base),
                    "token_endpoint": format!("{}/token", oauth.as_base), "response_types_supported": ["code"],
                    "grant_types_supported": ["authorization_code"], "code_challenge_methods_supported": ["S256"]}),
        ),
        "/authorize" => {
            let get = |k: &str| query.get(k).cloned().unwrap_or_default();
            if get("response_type") != "code" || get("client_id") != CLIENT_ID || get("code_challenge_method") != "S256" {
                return error(400, "invalid_request");
            }
            if get("resource") != format!("{}/mcp", oauth.mcp_base) || get("code_challenge").is_empty() || get("state").is_empty() {
                return error(400, "invalid_request");
            }
            let user = query.get("user").cloned().unwrap_or_else(|| "user".into());
            let code = random_token("code_");
            oauth.codes.lock().expect("codes lock").insert(code.clone(), (get("code_challenge"), get("redirect_uri"), user));
            let mut location = reqwest::Url::parse(&get("redirect_uri")).expect("redirect_uri");
            location.query_pairs_mut().append_pair("code", &code).append_pair("state", &get("state"));
            Response::builder().status(302).header("location", location.to_string()).body(body(String::new())).expect("response")
        }
        "/token" => {
            let bytes = request.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            let form = pairs(&String::from_utf8_lossy(&bytes));
            let get = |k: &str| form.get(k).cloned().unwrap_or_default();
            if get("grant_type") != "authorization_code" || get("client_id") != CLIENT_ID {
                return error(400, "invalid_request");
            }
            let Some((challenge, redirect_uri, user)) = oauth.codes.lock().expect("codes lock").remove(&get("code")) else {
                return error(400, "invalid_grant");
            };
            let computed = base64::engine::general_purpose::URL_SAFE_NO_PAD
                .encode(ring::digest::digest(&ring::digest::SHA256, get("code_verifier").as_bytes()));
            if computed != challenge || redirect_uri != get("redirect_uri") {
                return error(400, "invalid_grant");
            }
            let ttl = *oauth.ttl.lock().expect("ttl lock");
            let token = random_token("tok_");
            let expiry = std::time::Instant::now() + std::time::Duration::from_secs(ttl);
            oauth.tokens.lock().expect("tokens lock").insert(token.clone(), (user, expiry));
            json_response(200, &json!({"access_token": token, "token_type": "Bearer", "expires_in": ttl, "scope": "tools"}))
        }
        "/admin/ttl" => {
            *oauth.ttl.lock().expect("ttl lock") = query.get("secs").and_then(|s| s.parse().ok()).unwrap_or(3600);
            json_response(200, &json!({"ok": true}))
        }
        "/admin/revoke" => {
            oauth.tokens.lock().expect("tokens lock").clear();
            json_response(200, &json!({"ok": true}))
        }
        "/admin/tokens" => {
            let now = std::time::Instant::now();
            let list: Vec<Value> =
                oauth.tokens.lock().expect("tokens lock").values().map(|(user, expiry)| json!({"user": user, "live": *expiry > now})).collect();
            json_response(200, &Value::Array(list))
        }
        _ => error(404, "not_found"),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let calls: Calls = Arc::default();
    if args.stdio {
        let server = TestServer { calls, oauth: None }.serve(rmcp::transport::stdio()).await.context("serving stdio")?;
        server.waiting().await.context("stdio server")?;
        return Ok(());
    }
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
    };
    let listen = args.listen.unwrap_or_else(|| "127.0.0.1:0".into());
    let listener = tokio::net::TcpListener::bind(&listen).await.with_context(|| format!("binding {listen}"))?;
    let oauth = if args.oauth {
        let as_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.context("binding the authorization server")?;
        let oauth = Arc::new(OAuth {
            mcp_base: format!("http://{}", listener.local_addr()?),
            as_base: format!("http://{}", as_listener.local_addr()?),
            ttl: Mutex::new(3600),
            ..OAuth::default()
        });
        let served = oauth.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = as_listener.accept().await else { continue };
                let oauth = served.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                        let oauth = oauth.clone();
                        async move { Ok::<_, std::convert::Infallible>(authorization_server(&oauth, request).await) }
                    });
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
                });
            }
        });
        Some(oauth)
    } else {
        None
    };
    let factory_calls = calls.clone();
    let factory_oauth = oauth.clone();
    let mcp: Arc<StreamableHttpService<TestServer, LocalSessionManager>> = Arc::new(StreamableHttpService::new(
        move || Ok(TestServer { calls: factory_calls.clone(), oauth: factory_oauth.clone() }),
        Default::default(),
        StreamableHttpServerConfig::default(),
    ));
    println!("MCP_TEST_URL=http://{}", listener.local_addr()?);
    if let Some(oauth) = &oauth {
        println!("OAUTH_AS_URL={}", oauth.as_base);
    }
    use std::io::Write;
    std::io::stdout().flush()?;
    loop {
        let (stream, _) = listener.accept().await?;
        let (mcp, calls, oauth) = (mcp.clone(), calls.clone(), oauth.clone());
        let slow_ms = args.slow_ms;
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let (mcp, calls, oauth) = (mcp.clone(), calls.clone(), oauth.clone());
                async move {
                    if let Some(oauth) = &oauth {
                        match request.uri().path() {
                            "/.well-known/oauth-protected-resource" | "/.well-known/oauth-protected-resource/mcp" => {
                                let metadata = json!({"resource": format!("{}/mcp", oauth.mcp_base),
                                                      "authorization_servers": [oauth.as_base], "scopes_supported": ["tools"]});
                                return Ok(json_response(200, &metadata));
                            }
                            "/denied" => return Ok(json_response(200, &Value::Array(oauth.denied.lock().expect("denied lock").clone()))),
                            "/mcp" if request.method() == hyper::Method::POST => {
                                let (parts, incoming) = request.into_parts();
                                let bytes = incoming.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                                let message: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                                if slow_ms > 0 && (message["method"] == "initialize" || message["method"] == "tools/call") {
                                    tokio::time::sleep(std::time::Duration::from_millis(slow_ms)).await;
                                }
                                if message["method"] == "tools/call" && oauth.user(&parts.headers).is_none() {
                                    oauth.denied.lock().expect("denied lock").push(json!({
                                        "tool": message["params"]["name"],
                                        "idempotencyKey": message["params"]["_meta"]["idempotencyKey"],
                                        "hadToken": parts.headers.contains_key("authorization"),
                                    }));
                                    let challenge = format!(
                                        "Bearer error=\"invalid_token\", resource_metadata=\"{}/.well-known/oauth-protected-resource/mcp\"",
                                        oauth.mcp_base
                                    );
                                    let response = Response::builder()
                                        .status(401)
                                        .header("www-authenticate", challenge)
                                        .header("content-type", "application/json")
                                        .body(body(json!({"error": "invalid_token"}).to_string()))
                                        .expect("response");
                                    return Ok(response);
                                }
                                let request = Request::from_parts(parts, Full::new(bytes));
                                return Ok::<_, std::convert::Infallible>(mcp.handle(request).await);
                            }
                            _ => {}
                        }
                    }
                    let response = match request.uri().path() {
                        path if path.starts_with("/moved") => Response::builder()
                            .status(307)
                            .header("location", "/mcp")
                            .body(body(String::new()))
                            .expect("response"),
                        "/calls" => {
                            let list = calls.lock().expect("calls lock").clone();
                            Response::builder()
                                .header("content-type", "application/json")
                                .body(body(Value::Array(list).to_string()))
                                .expect("response")
                        }
                        "/http-tool" => {
                            let key = request.headers().get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned);
                            let bytes = request.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                            let text = String::from_utf8_lossy(&bytes).into_owned();
                            let arguments: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
                            calls.lock().expect("calls lock").push(json!({"tool": "http-tool", "arguments": arguments, "idempotencyKey": key}));
                            Response::builder().body(body(format!("ok: {text}"))).expect("response")
                        }
                        _ => mcp.handle(request).await,
                    };
                    Ok::<_, std::convert::Infallible>(response)
                }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
        });
    }
}
