//! `mcp-test-server`: an MCP server (rmcp, server side) for black-box tests of MCP tools, plus an
//! HTTP tool endpoint.
//!
//! ```text
//! mcp-test-server --listen 127.0.0.1:0   # streamable HTTP; prints MCP_TEST_URL=http://127.0.0.1:PORT
//! mcp-test-server --stdio                 # MCP over stdin/stdout (spawned by the worker)
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
}

/// Every call received: `{tool, arguments, idempotencyKey}`.
type Calls = Arc<Mutex<Vec<Value>>>;

#[derive(Clone)]
struct TestServer {
    calls: Calls,
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
        let count = {
            let mut calls = self.calls.lock().expect("calls lock");
            calls.push(json!({"tool": request.name, "arguments": args, "idempotencyKey": key}));
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
                other => Ok(CallToolResponse::Complete(CallToolResult::error(vec![ContentBlock::text(format!("no tool {other}"))]))),
            }
        }
    }
}

fn body(text: String) -> BoxBody<Bytes, std::convert::Infallible> {
    Full::new(Bytes::from(text)).boxed()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let calls: Calls = Arc::default();
    if args.stdio {
        let server = TestServer { calls }.serve(rmcp::transport::stdio()).await.context("serving stdio")?;
        server.waiting().await.context("stdio server")?;
        return Ok(());
    }
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
    };
    let listen = args.listen.unwrap_or_else(|| "127.0.0.1:0".into());
    let listener = tokio::net::TcpListener::bind(&listen).await.with_context(|| format!("binding {listen}"))?;
    let factory_calls = calls.clone();
    let mcp: Arc<StreamableHttpService<TestServer, LocalSessionManager>> = Arc::new(StreamableHttpService::new(
        move || Ok(TestServer { calls: factory_calls.clone() }),
        Default::default(),
        StreamableHttpServerConfig::default(),
    ));
    println!("MCP_TEST_URL=http://{}", listener.local_addr()?);
    use std::io::Write;
    std::io::stdout().flush()?;
    loop {
        let (stream, _) = listener.accept().await?;
        let (mcp, calls) = (mcp.clone(), calls.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let (mcp, calls) = (mcp.clone(), calls.clone());
                async move {
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
