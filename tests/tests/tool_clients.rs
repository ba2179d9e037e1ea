//! Outbound tool clients against hostile servers (issue 9 point 4, issue 10 point 3): HTTP tools
//! and the MCP streamable-HTTP client must follow no redirect by default (and never to another
//! origin), bound what they read, cut stalled and slow-drip answers, and report every call whose
//! request may have reached the receiver without a known outcome as UNCERTAIN, never as failed.
//!
//! The hostile servers are real TCP listeners in the test (raw HTTP/1.1 by hand, so they can
//! misbehave); the MCP server is the real `mcp-test-server` (rmcp). No database: these tests
//! drive `agentloop_shared::tools::ToolRegistry` directly. Every name starts with `tools_`.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentloop_shared::tools::{ToolContext, ToolOutcome, ToolRegistry, ToolsConfig, UNCERTAIN_PREFIX};
use agentloop_tests::{Proc, Sig, bin_dir, free_port};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The credential configured on the tools: it must never reach another host.
const SECRET: &str = "sk-test-credential-42";
const KEY: &str = "run:r:call:c1";

/// What a hostile server does after reading a request.
#[derive(Clone)]
enum Answer {
    /// Write these bytes, then close.
    Raw(String),
    /// Never answer (keep the connection open).
    Silent,
    /// `200` with a chunked body of `x` bytes, as fast as the client reads, up to this many bytes.
    Huge(u64),
    /// `200` with `Content-Length: 1000000`, then one byte every 100 ms.
    Drip,
    /// `200` with `Content-Length: 1000` and 10 bytes, then nothing (connection kept open).
    StallAfterHeaders,
    /// `200` with `Content-Length: 1000` and 10 bytes, then a TCP reset.
    ResetMidBody,
    /// `200` `text/event-stream` that never ends: a small valid JSON-RPC notification every
    /// 10 ms (no event is ever over a cap, and the answer never comes).
    EndlessSse,
}

/// A hostile HTTP/1.1 server on 127.0.0.1.
struct Hostile {
    addr: SocketAddr,
    /// Every request received: head and body as text.
    seen: Arc<Mutex<Vec<String>>>,
    /// Connections accepted.
    accepted: Arc<AtomicUsize>,
    /// Body bytes the server managed to write.
    written: Arc<AtomicU64>,
    /// Set when a connection's handler has ended.
    finished: Arc<AtomicBool>,
}

impl Hostile {
    async fn start(answer: impl Fn(&str) -> Answer + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let answer = Arc::new(answer);
        let server = Self {
            addr,
            seen: Arc::default(),
            accepted: Arc::default(),
            written: Arc::default(),
            finished: Arc::default(),
        };
        let (seen, accepted, written, finished) =
            (server.seen.clone(), server.accepted.clone(), server.written.clone(), server.finished.clone());
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                accepted.fetch_add(1, Ordering::SeqCst);
                let (answer, seen, written, finished) = (answer.clone(), seen.clone(), written.clone(), finished.clone());
                tokio::spawn(async move {
                    serve(stream, answer.as_ref(), &seen, &written).await;
                    finished.store(true, Ordering::SeqCst);
                });
            }
        });
        server
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }

    async fn wait_finished(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.finished.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "the hostile server's connection never ended");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Reads one request (head and `Content-Length` body); `None` if the peer went away.
async fn read_request(stream: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = stream.read(&mut chunk).await.ok().filter(|&n| n > 0)?;
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    while buf.len() < head_end + length {
        let n = stream.read(&mut chunk).await.ok().filter(|&n| n > 0)?;
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(String::from_utf8_lossy(&buf).into_owned())
}

async fn serve(mut stream: TcpStream, answer: &(dyn Fn(&str) -> Answer + Send + Sync), seen: &Mutex<Vec<String>>, written: &AtomicU64) {
    // One request per connection: every answer ends it.
    let Some(request) = read_request(&mut stream).await else { return };
    seen.lock().unwrap().push(request.clone());
    let head = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n";
    match answer(&request) {
        Answer::Raw(text) => {
            let _ = stream.write_all(text.as_bytes()).await;
        }
        Answer::Silent => tokio::time::sleep(Duration::from_secs(60)).await,
        Answer::Huge(limit) => {
            let _ = stream.write_all(format!("{head}Transfer-Encoding: chunked\r\n\r\n").as_bytes()).await;
            let chunk = format!("{:x}\r\n{}\r\n", 64 * 1024, "x".repeat(64 * 1024));
            while written.load(Ordering::SeqCst) < limit {
                if stream.write_all(chunk.as_bytes()).await.is_err() {
                    return;
                }
                written.fetch_add(64 * 1024, Ordering::SeqCst);
            }
            let _ = stream.write_all(b"0\r\n\r\n").await;
        }
        Answer::Drip => {
            let _ = stream.write_all(format!("{head}Content-Length: 1000000\r\n\r\n").as_bytes()).await;
            while stream.write_all(b"x").await.is_ok() {
                written.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Answer::StallAfterHeaders => {
            let _ = stream.write_all(format!("{head}Content-Length: 1000\r\n\r\n0123456789").as_bytes()).await;
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        Answer::EndlessSse => {
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n").await;
            let event = "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\",\"params\":{\"level\":\"info\",\"data\":\"still working\"}}\n\n";
            let framed = format!("{:x}\r\n{event}\r\n", event.len());
            while stream.write_all(framed.as_bytes()).await.is_ok() {
                written.fetch_add(framed.len() as u64, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        Answer::ResetMidBody => {
            let _ = stream.write_all(format!("{head}Content-Length: 1000\r\n\r\n0123456789").as_bytes()).await;
            let _ = stream.flush().await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            // Dropped with SO_LINGER 0: the peer gets a TCP reset.
            stream.set_zero_linger().unwrap();
        }
    }
}

/// A complete HTTP/1.1 answer.
fn answer(status: &str, headers: &[(&str, &str)], body: &str) -> Answer {
    let mut text = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n", body.len());
    for (name, value) in headers {
        text.push_str(&format!("{name}: {value}\r\n"));
    }
    Answer::Raw(format!("{text}\r\n{body}"))
}

/// A registry with the tools file `tools`.
fn registry(tools: Value) -> ToolRegistry {
    let config: ToolsConfig = serde_json::from_value(tools).unwrap();
    config.validate().unwrap();
    let mut registry = ToolRegistry::new(16 * 1024);
    registry.configure(&config);
    registry
}

/// A registry with one HTTP tool `pay` POSTing to `url` with the credential header; `extra` keys
/// are merged into its entry.
fn http_tool(url: &str, extra: Value) -> ToolRegistry {
    let mut tool = json!({"name": "pay", "url": url, "headers": {"X-Api-Key": SECRET, "Authorization": format!("Bearer {SECRET}")}});
    tool.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    registry(json!({"httpTools": [tool]}))
}

async fn pay(registry: &ToolRegistry) -> ToolOutcome {
    registry.execute("pay", r#"{"amount": 5}"#, ToolContext::new(KEY)).await
}

#[track_caller]
fn assert_failed(outcome: &ToolOutcome, contains: &str) {
    assert!(outcome.is_error && !outcome.uncertain, "expected a failed (certain) outcome: {outcome:?}");
    assert!(outcome.content.contains(contains), "`{contains}` in {:?}", outcome.content);
}

#[track_caller]
fn assert_uncertain(outcome: &ToolOutcome, contains: &str) {
    assert!(outcome.is_error && outcome.uncertain, "expected an uncertain outcome: {outcome:?}");
    assert!(outcome.content.starts_with(UNCERTAIN_PREFIX), "the text says the outcome is unknown: {:?}", outcome.content);
    assert!(outcome.content.contains(contains), "`{contains}` in {:?}", outcome.content);
}

#[tokio::test]
async fn tools_http_redirect_to_another_port_is_never_followed() {
    let elsewhere = Hostile::start(|_| answer("200 OK", &[], "stolen")).await;
    let target = elsewhere.url("/collect");
    let location = target.clone();
    let origin = Hostile::start(move |_| answer("307 Temporary Redirect", &[("Location", &location)], "")).await;
    for redirects in [json!({}), json!({"redirects": "none"}), json!({"redirects": "same-origin"})] {
        let outcome = pay(&http_tool(&origin.url("/pay"), redirects.clone())).await;
        assert_failed(&outcome, "HTTP 307");
        assert!(outcome.content.contains(&target), "names the Location ({redirects}): {}", outcome.content);
        assert!(!outcome.content.contains(SECRET), "{}", outcome.content);
    }
    assert_eq!(origin.seen().len(), 3);
    assert!(origin.seen()[0].contains(SECRET) && origin.seen()[0].contains(KEY), "the configured origin gets the call");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(elsewhere.accepted.load(Ordering::SeqCst), 0, "the other port received nothing: {:?}", elsewhere.seen());
}

#[tokio::test]
async fn tools_http_same_origin_redirect_is_followed_only_when_configured() {
    let origin = Hostile::start(|request| {
        let body = request.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
        match request.split_whitespace().nth(1).unwrap_or_default() {
            "/old" => answer("307 Temporary Redirect", &[("Location", "/new")], ""),
            "/found" => answer("302 Found", &[("Location", "/new")], ""),
            _ => answer("200 OK", &[], &format!("new: {body}")),
        }
    })
    .await;
    let outcome = pay(&http_tool(&origin.url("/old"), json!({}))).await;
    assert_failed(&outcome, "HTTP 307 redirect to /new not followed");
    assert_eq!(origin.seen().len(), 1, "not followed by default");

    let outcome = pay(&http_tool(&origin.url("/old"), json!({"redirects": "same-origin"}))).await;
    assert_eq!(outcome, ToolOutcome::ok(r#"new: {"amount":5}"#), "307 keeps the method and body");
    let followed = origin.seen().pop().unwrap();
    assert!(followed.starts_with("POST /new") && followed.contains(SECRET) && followed.contains(KEY), "{followed}");

    let outcome = pay(&http_tool(&origin.url("/found"), json!({"redirects": "same-origin"}))).await;
    assert_failed(&outcome, "HTTP 302");
    assert_eq!(origin.seen().len(), 4, "a 302 (which would turn the POST into a GET) is not followed");
}

#[tokio::test]
async fn tools_http_huge_answer_is_cut_at_the_cap_while_streaming() {
    const OFFERED: u64 = 128 * 1024 * 1024;
    let server = Hostile::start(|_| Answer::Huge(OFFERED)).await;
    let started = Instant::now();
    let outcome = pay(&http_tool(&server.url("/"), json!({"maxResponseBytes": 65536, "timeoutMs": 30000}))).await;
    assert!(!outcome.is_error, "{:?}", &outcome.content[..200.min(outcome.content.len())]);
    assert!(outcome.content.ends_with("…[answer cut at 65536 bytes: the receiver sent more]"), "{}", &outcome.content[outcome.content.len() - 100..]);
    assert!(outcome.content.len() <= 16 * 1024, "the registry bound still applies");
    server.wait_finished().await;
    let written = server.written.load(Ordering::SeqCst);
    // What the server could write is the cap plus the kernel's socket buffers (a few MiB on
    // loopback), not the whole answer.
    assert!(written < 16 * 1024 * 1024, "the client stopped reading near the cap: the server wrote {written} bytes");
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
}

#[tokio::test]
async fn tools_http_server_that_never_answers_is_uncertain_after_the_read_timeout() {
    let server = Hostile::start(|_| Answer::Silent).await;
    let started = Instant::now();
    let outcome = pay(&http_tool(&server.url("/"), json!({"readTimeoutMs": 300, "timeoutMs": 10000}))).await;
    assert_uncertain(&outcome, "timed out");
    assert!(started.elapsed() < Duration::from_secs(5), "cut by the read timeout: {:?}", started.elapsed());
    assert_eq!(server.seen().len(), 1, "the request did reach the receiver");
}

#[tokio::test]
async fn tools_http_stall_after_the_headers_is_cut_by_the_read_timeout() {
    let server = Hostile::start(|_| Answer::StallAfterHeaders).await;
    let started = Instant::now();
    let outcome = pay(&http_tool(&server.url("/"), json!({"readTimeoutMs": 300, "timeoutMs": 10000}))).await;
    assert_uncertain(&outcome, "reading the answer");
    assert!(started.elapsed() < Duration::from_secs(5), "cut by the read timeout: {:?}", started.elapsed());
}

#[tokio::test]
async fn tools_http_slow_drip_answer_is_cut_by_the_total_timeout() {
    let server = Hostile::start(|_| Answer::Drip).await;
    let started = Instant::now();
    // One byte every 100 ms never trips the 1 s read timeout; the total timeout cuts it.
    let outcome = pay(&http_tool(&server.url("/"), json!({"readTimeoutMs": 1000, "timeoutMs": 1500}))).await;
    assert_uncertain(&outcome, "reading the answer");
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(1400) && elapsed < Duration::from_secs(5), "{elapsed:?}");
    server.wait_finished().await;
}

#[tokio::test]
async fn tools_http_reset_mid_answer_is_uncertain() {
    let server = Hostile::start(|_| Answer::ResetMidBody).await;
    let outcome = pay(&http_tool(&server.url("/"), json!({}))).await;
    assert_uncertain(&outcome, "pay");
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn tools_http_status_classes() {
    let server = Hostile::start(|request| match request.split_whitespace().nth(1).unwrap_or_default() {
        "/ok" => answer("200 OK", &[], "paid"),
        "/bad" => answer("400 Bad Request", &[], "amount too large"),
        "/conflict" => answer("409 Conflict", &[], "duplicate"),
        "/boom" => answer("500 Internal Server Error", &[], "ledger down"),
        "/unavailable" => answer("503 Service Unavailable", &[], ""),
        "/see-other" => answer("303 See Other", &[("Location", "/receipt/1")], ""),
        _ => answer("404 Not Found", &[], ""),
    })
    .await;
    let call = |path: &str| {
        let registry = http_tool(&server.url(path), json!({}));
        async move { pay(&registry).await }
    };
    assert_eq!(call("/ok").await, ToolOutcome::ok("paid"));
    assert_failed(&call("/bad").await, "HTTP 400: amount too large");
    assert_failed(&call("/conflict").await, "HTTP 409: duplicate");
    assert_uncertain(&call("/boom").await, "HTTP 500: ledger down");
    assert_uncertain(&call("/unavailable").await, "HTTP 503");
    // 303 "see other" answers a POST that was processed: its outcome is not a refusal.
    assert_uncertain(&call("/see-other").await, "HTTP 303 redirect to /receipt/1");
}

#[tokio::test]
async fn tools_http_refused_port_is_failed() {
    let port = free_port();
    let outcome = pay(&http_tool(&format!("http://127.0.0.1:{port}/pay"), json!({}))).await;
    assert_failed(&outcome, "pay: ");
    assert!(outcome.content.to_lowercase().contains("connect"), "{}", outcome.content);
    assert!(!outcome.content.contains(SECRET));
    assert!(!outcome.content.contains(&format!(":{port}/pay")), "the configured URL (maybe with a secret query) is not echoed: {}", outcome.content);
}

#[tokio::test]
async fn tools_http_connect_timeout_is_failed_not_uncertain() {
    // A listener whose accept queue is full and never drained: the kernel drops further SYNs,
    // so a new connection hangs in the connect phase.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(1).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut fillers = Vec::new();
    for _ in 0..8 {
        match tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => fillers.push(stream),
            _ => break,
        }
    }
    let started = Instant::now();
    let outcome = pay(&http_tool(&format!("http://{addr}/pay"), json!({"connectTimeoutMs": 300, "readTimeoutMs": 5000}))).await;
    assert_failed(&outcome, "pay: ");
    assert!(started.elapsed() < Duration::from_secs(4), "{:?}", started.elapsed());
    drop(listener);
}

/// The test MCP server over streamable HTTP, killed on drop.
struct McpServer {
    url: String,
    proc: Proc,
}

fn start_mcp_server() -> McpServer {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(bin_dir().join("mcp-test-server"))
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let url = line.trim().strip_prefix("MCP_TEST_URL=").unwrap().to_owned();
    McpServer { url, proc: Proc { name: "mcp-test-server".into(), child } }
}

/// A registry with the MCP server `web` at `url` (`extra` merged into its entry), connected.
async fn mcp_registry(url: &str, extra: Value) -> (ToolRegistry, Vec<(String, String)>) {
    let mut server = json!({"name": "web", "transport": "http", "url": url, "headers": {"X-Api-Key": SECRET}});
    server.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let registry = registry(json!({"mcpServers": [server]}));
    let errors = registry.connect_mcp().await;
    (registry, errors)
}

async fn calls_seen(mcp: &McpServer) -> Vec<Value> {
    reqwest::get(format!("{}/calls", mcp.url)).await.unwrap().json().await.unwrap()
}

#[tokio::test]
async fn tools_mcp_call_past_the_call_timeout_is_uncertain_and_server_errors_are_failed() {
    let mcp = start_mcp_server();
    let (registry, errors) = mcp_registry(&format!("{}/mcp", mcp.url), json!({"callTimeoutMs": 500})).await;
    assert!(errors.is_empty(), "{errors:?}");
    let started = Instant::now();
    let outcome = registry.execute("web__slow", r#"{"ms": 5000}"#, ToolContext::new(KEY)).await;
    assert_uncertain(&outcome, "did not answer within 500 ms");
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    let seen = calls_seen(&mcp).await;
    assert!(seen.iter().any(|c| c["tool"] == "slow" && c["idempotencyKey"] == KEY), "the server did receive it: {seen:?}");

    let outcome = registry.execute("web__reject", r#"{"reason": "nope"}"#, ToolContext::new(KEY)).await;
    assert_failed(&outcome, "rejected: nope");
    let outcome = registry.execute("web__reject", r#"{"reason": "no funds", "result": true}"#, ToolContext::new(KEY)).await;
    assert_eq!(outcome, ToolOutcome::error("refused: no funds"), "an isError result is the server's own failure");
    // The connection still works after both.
    assert_eq!(registry.execute("web__echo", r#"{"text": "hi"}"#, ToolContext::new(KEY)).await, ToolOutcome::ok("echo: hi"));
}

#[tokio::test]
async fn tools_mcp_server_dying_mid_call_is_uncertain_and_a_dead_server_is_failed() {
    let mut mcp = start_mcp_server();
    let (registry, errors) = mcp_registry(&format!("{}/mcp", mcp.url), json!({"callTimeoutMs": 20000})).await;
    assert!(errors.is_empty(), "{errors:?}");
    let call = registry.execute("web__slow", r#"{"ms": 10000}"#, ToolContext::new(KEY));
    let kill = async {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !calls_seen(&mcp).await.iter().any(|c| c["tool"] == "slow") {
            assert!(Instant::now() < deadline, "the call never reached the server");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        mcp.proc.signal(Sig::SIGKILL);
        mcp.proc.wait_exit(Duration::from_secs(5));
    };
    let started = Instant::now();
    let (outcome, ()) = tokio::join!(call, kill);
    assert_uncertain(&outcome, "MCP server `web` closed the call's answer stream");
    assert!(started.elapsed() < Duration::from_secs(10), "noticed before the call timeout: {:?}", started.elapsed());
    // Now nothing listens: the next call cannot be sent at all.
    let outcome = registry.execute("web__ticket", r#"{"title": "T"}"#, ToolContext::new(KEY)).await;
    assert_failed(&outcome, "MCP server `web`");
}

#[tokio::test]
async fn tools_mcp_same_origin_redirect_is_followed_only_when_configured() {
    let mcp = start_mcp_server();
    let moved = format!("{}/moved", mcp.url);
    let (registry, errors) = mcp_registry(&moved, json!({"connectTimeoutMs": 3000})).await;
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].1.contains("307") && errors[0].1.contains("/mcp"), "names the redirect: {errors:?}");
    assert!(registry.specs().is_empty());

    let (registry, errors) = mcp_registry(&moved, json!({"redirects": "same-origin"})).await;
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(registry.execute("web__echo", r#"{"text": "hi"}"#, ToolContext::new(KEY)).await, ToolOutcome::ok("echo: hi"));
}

#[tokio::test]
async fn tools_mcp_redirect_to_another_port_is_never_followed() {
    let elsewhere = Hostile::start(|_| answer("200 OK", &[("Content-Type", "application/json")], "{}")).await;
    let location = elsewhere.url("/mcp");
    let origin = Hostile::start(move |_| answer("307 Temporary Redirect", &[("Location", &location)], "")).await;
    for redirects in ["none", "same-origin"] {
        let (_, errors) = mcp_registry(&origin.url("/mcp"), json!({"redirects": redirects, "connectTimeoutMs": 3000})).await;
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].1.contains("307"), "{errors:?}");
        assert!(!errors[0].1.contains(SECRET));
    }
    assert!(origin.seen().iter().all(|r| r.contains(SECRET)), "the configured origin gets the credential");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(elsewhere.accepted.load(Ordering::SeqCst), 0, "the other port received nothing: {:?}", elsewhere.seen());
}

#[tokio::test]
async fn tools_mcp_answer_over_the_cap_is_bounded_and_uncertain() {
    let mcp = start_mcp_server();
    let (registry, errors) = mcp_registry(&format!("{}/mcp", mcp.url), json!({"maxResponseBytes": 65536, "callTimeoutMs": 10000})).await;
    assert!(errors.is_empty(), "{errors:?}");
    let outcome = registry.execute("web__big", r#"{"bytes": 1000}"#, ToolContext::new(KEY)).await;
    assert_eq!(outcome, ToolOutcome::ok("x".repeat(1000)), "small answers pass");
    let started = Instant::now();
    let outcome = registry.execute("web__big", r#"{"bytes": 4194304}"#, ToolContext::new(KEY)).await;
    assert!(outcome.is_error && outcome.uncertain, "an answer over the cap is not a result: {:?}", &outcome.content[..200.min(outcome.content.len())]);
    assert!(outcome.content.contains("maxResponseBytes, 65536 bytes"), "{}", outcome.content);
    assert!(outcome.content.len() <= 16 * 1024);
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
}

/// A minimal MCP endpoint over raw HTTP: `initialize` and `tools/list` answer as JSON, other
/// notifications 202, and `tools/call` with `call`.
fn raw_mcp(call: Answer) -> impl Fn(&str) -> Answer + Send + Sync + 'static {
    move |request: &str| {
        let body: Value = serde_json::from_str(request.split("\r\n\r\n").nth(1).unwrap_or_default()).unwrap_or_default();
        let id = body.get("id").cloned().unwrap_or(Value::Null);
        let json_answer = |result: Value| {
            let text = json!({"jsonrpc": "2.0", "id": id, "result": result}).to_string();
            answer("200 OK", &[("Content-Type", "application/json")], &text)
        };
        match body["method"].as_str().unwrap_or_default() {
            "initialize" => json_answer(json!({"protocolVersion": "2025-06-18", "capabilities": {"tools": {}}, "serverInfo": {"name": "hostile", "version": "1"}})),
            "tools/list" => json_answer(json!({"tools": [{"name": "flood", "inputSchema": {"type": "object"}}]})),
            "tools/call" => call.clone(),
            _ => answer("202 Accepted", &[], ""),
        }
    }
}

#[tokio::test]
async fn tools_mcp_endless_answer_stream_is_cut_by_the_call_timeout() {
    let server = Hostile::start(raw_mcp(Answer::EndlessSse)).await;
    let (registry, errors) = mcp_registry(&server.url("/mcp"), json!({"callTimeoutMs": 1500})).await;
    assert!(errors.is_empty(), "{errors:?}");
    let started = Instant::now();
    let outcome = registry.execute("web__flood", "{}", ToolContext::new(KEY)).await;
    assert_uncertain(&outcome, "did not answer within 1500 ms");
    assert!(started.elapsed() < Duration::from_secs(6), "{:?}", started.elapsed());
    assert!(server.seen().iter().any(|r| r.contains("tools/call") && r.contains(KEY)), "the call reached the server");
}

#[tokio::test]
async fn tools_mcp_slow_drip_answer_is_cut_by_the_call_timeout() {
    let server = Hostile::start(raw_mcp(Answer::Drip)).await;
    let (registry, errors) = mcp_registry(&server.url("/mcp"), json!({"callTimeoutMs": 1500, "readTimeoutMs": 1000})).await;
    assert!(errors.is_empty(), "{errors:?}");
    let started = Instant::now();
    let outcome = registry.execute("web__flood", "{}", ToolContext::new(KEY)).await;
    assert!(outcome.is_error && outcome.uncertain, "{outcome:?}");
    assert!(started.elapsed() < Duration::from_secs(6), "{:?}", started.elapsed());
}

#[tokio::test]
async fn tools_http_endless_answer_is_cut_at_the_cap_and_the_connection_dropped() {
    let server = Hostile::start(|_| Answer::Huge(u64::MAX)).await;
    let started = Instant::now();
    let outcome = pay(&http_tool(&server.url("/"), json!({"maxResponseBytes": 65536, "timeoutMs": 30000}))).await;
    assert!(!outcome.is_error, "a 2xx cut at the cap is a result");
    assert!(outcome.content.ends_with("…[answer cut at 65536 bytes: the receiver sent more]"));
    server.wait_finished().await;
    assert!(server.written.load(Ordering::SeqCst) < 16 * 1024 * 1024, "the client hung up near the cap");
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
}

/// Pids of the live (not zombie) processes whose environment holds `marker`.
fn processes_with(marker: &str) -> Vec<i32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else { continue };
        if !environ.split(|&b| b == 0).any(|var| var == marker.as_bytes()) {
            continue;
        }
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let state = stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next());
        if state.is_some_and(|s| s != 'Z' && s != 'X') {
            pids.push(pid);
        }
    }
    pids
}

/// The one live stdio server process carrying `marker`, waiting up to 5 s for it.
async fn the_process(marker: &str) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let pids = processes_with(marker);
        if pids.len() == 1 {
            return pids[0];
        }
        assert!(Instant::now() < deadline, "expected one live server process, found {pids:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_gone(pid: i32, within: Duration, marker: &str) {
    let deadline = Instant::now() + within;
    while processes_with(marker).contains(&pid) {
        assert!(Instant::now() < deadline, "process {pid} still runs");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A stdio MCP server that stops reading (SIGSTOP: every request sent to it goes unanswered)
/// makes its call time out as uncertain, and the connection is discarded: the next call, of
/// another tool, gets a fresh server process and succeeds (the stuck one is shut down). A server
/// process killed between calls is noticed before the next call is sent: that call is never
/// uncertain (here it is sent to a fresh process and succeeds).
#[tokio::test]
async fn tools_mcp_stdio_stuck_or_dead_server_is_replaced_for_the_next_call() {
    use nix::sys::signal::kill;
    use nix::unistd::Pid;
    let marker = format!("AGENTLOOP_TEST_MARK={}", uuid::Uuid::new_v4());
    let (var, value) = marker.split_once('=').unwrap();
    let server = json!({
        "name": "loc", "transport": "stdio", "command": bin_dir().join("mcp-test-server"), "args": ["--stdio"],
        "env": {var: value}, "callTimeoutMs": 1000,
    });
    let _cleanup = KillMarked(marker.clone());
    let registry = registry(json!({"mcpServers": [server]}));
    let errors = registry.connect_mcp().await;
    assert!(errors.is_empty(), "{errors:?}");
    let first = the_process(&marker).await;
    assert_eq!(registry.execute("loc__echo", r#"{"text": "a"}"#, ToolContext::new(KEY)).await, ToolOutcome::ok("echo: a"));

    // The server hangs: the call times out (uncertain: it may have been read).
    kill(Pid::from_raw(first), Sig::SIGSTOP).unwrap();
    let outcome = registry.execute("loc__ticket", r#"{"title": "T"}"#, ToolContext::new(KEY)).await;
    assert_uncertain(&outcome, "did not answer within 1000 ms");
    // The next call (another tool) goes to a fresh process.
    let started = Instant::now();
    let outcome = registry.execute("loc__echo", r#"{"text": "b"}"#, ToolContext::new(KEY)).await;
    assert_eq!(outcome, ToolOutcome::ok("echo: b"), "a stuck server is not reused");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    let second = the_process_other_than(&marker, first).await;
    // (The client shuts the stuck one down gracefully, which takes seconds for a stopped one.)
    let _ = kill(Pid::from_raw(first), Sig::SIGKILL);

    // The server process dies between calls: the next call is not uncertain, and works.
    kill(Pid::from_raw(second), Sig::SIGKILL).unwrap();
    wait_gone(second, Duration::from_secs(5), &marker).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let outcome = registry.execute("loc__ticket", r#"{"title": "U"}"#, ToolContext::new(KEY)).await;
    assert!(!outcome.uncertain, "nothing was sent to the dead process: {outcome:?}");
    assert_eq!(outcome, ToolOutcome::ok("ticket #1 created: U"), "sent to a fresh process");
    assert_eq!(registry.execute("loc__echo", r#"{"text": "c"}"#, ToolContext::new(KEY)).await, ToolOutcome::ok("echo: c"));
    let third = the_process(&marker).await;
    assert!(third != first && third != second);
}

/// Kills (SIGKILL) every process whose environment holds its marker, when dropped.
struct KillMarked(String);

impl Drop for KillMarked {
    fn drop(&mut self) {
        for pid in processes_with(&self.0) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Sig::SIGKILL);
        }
    }
}

/// The one live process carrying `marker` other than `old` (which may still be shutting down).
async fn the_process_other_than(marker: &str, old: i32) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let pids: Vec<i32> = processes_with(marker).into_iter().filter(|&p| p != old).collect();
        if pids.len() == 1 {
            return pids[0];
        }
        assert!(Instant::now() < deadline, "expected one new server process, found {pids:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
