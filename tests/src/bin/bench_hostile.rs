//! `bench-hostile`: memory of the api and the worker under hostile clients and tools (issue 10
//! point 1). Prints RSS at start, peak and after the clients (or tools) are gone, with the
//! targets: api peak ≤ 150 MiB and back within 20% of its start; the same for the worker. Then
//! four concurrent exports of threads of 12 MB each: the api's peak grows by ≤ 64 MiB.
//!
//! ```text
//! cargo build --release --workspace
//! cargo run --release -p agentloop-tests --bin bench-hostile -- [--patches 300] [--clients 400] [--threads 300]
//! ```
//!
//! api phase (one api, no worker, generous rate limits so nothing is refused before memory is
//! tested): `--threads` threads across 8 principals; `--clients` SSE clients on 4 watched threads
//! (a quarter of them never read their stream) plus 50 long-polls; then `--patches` PATCHes of a
//! 1 MiB `metadata` on the watched threads and as many on unwatched ones, 8 at a time, and 50
//! chats with 1 MiB content. Every client then disconnects; RSS is read after the hub's idle
//! sweep.
//!
//! worker phase: one worker whose tools file offers a hostile HTTP receiver — a 256 MiB answer,
//! an endless chunked stream, a slow drip (slowloris) — and two MCP servers: the test server's
//! `big` tool (a 64 MiB answer) and a raw endpoint that answers `tools/call` with an endless SSE
//! stream. The mock model calls each tool several times.
//!
//! Needs `TEST_DATABASE_URL` (a superuser); logs in `test-output/bench_hostile*`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use agentloop_tests::{Client, Stack, StackOptions, script};
use anyhow::{Context, Result};
use clap::Parser;
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Debug, Parser)]
#[command(name = "bench-hostile")]
struct Args {
    /// 1 MiB PATCHes on watched threads (and as many on unwatched ones).
    #[arg(long, default_value_t = 300)]
    patches: usize,
    /// SSE clients.
    #[arg(long, default_value_t = 400)]
    clients: usize,
    /// Threads created.
    #[arg(long, default_value_t = 300)]
    threads: usize,
    /// Tool calls per hostile tool in the worker phase.
    #[arg(long, default_value_t = 4)]
    calls: usize,
    /// Only this phase: api | worker.
    #[arg(long)]
    only: Option<String>,
}

fn rss_mib(pid: i32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib: u64 = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()).and_then(|v| v.parse().ok()).unwrap_or(0);
    kib as f64 / 1024.0
}

/// Samples the RSS of `pid` every 50 ms until stopped; returns the peak.
struct Sampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
}

impl Sampler {
    fn start(pid: i32) -> Self {
        let (stop, peak) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let (s, p) = (stop.clone(), peak.clone());
        tokio::spawn(async move {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max((rss_mib(pid) * 1024.0) as u64, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        Self { stop, peak }
    }

    fn peak(&self) -> f64 {
        self.peak.load(Ordering::Relaxed) as f64 / 1024.0
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn verdict(name: &str, start: f64, peak: f64, after: f64) -> bool {
    let peak_ok = peak <= 150.0;
    let back_ok = after <= start * 1.2;
    println!("  {name} RSS: start {start:.1} MiB, peak {peak:.1} MiB, after {after:.1} MiB ({:+.0}% of start)", (after / start - 1.0) * 100.0);
    println!("    peak ≤ 150 MiB: {}   back within 20% of start: {}", if peak_ok { "PASS" } else { "FAIL" }, if back_ok { "PASS" } else { "FAIL" });
    peak_ok && back_ok
}

/// The api's allocator gauges and open live connections, from its /metrics, on one line.
async fn allocator_line(api_url: &str) -> String {
    let text = match reqwest::get(format!("{api_url}/metrics")).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    };
    let mib = |name: &str| text.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse::<f64>().ok()).map_or("?".to_owned(), |b| format!("{:.1} MiB", b / 1048576.0));
    let live: Vec<&str> = text.lines().filter(|l| l.starts_with("agentloop_live_clients")).collect();
    format!("allocator: allocated {}, resident {}; {}", mib("agentloop_allocator_allocated_bytes "), mib("agentloop_allocator_resident_bytes "), live.join(", "))
}

async fn api_phase(args: &Args) -> Result<bool> {
    let stack = Stack::start("bench_hostile_api", StackOptions { workers: 0, ..Default::default() }).await?;
    let pid = stack.api.pid();
    let http = reqwest::Client::builder().pool_max_idle_per_host(64).build()?;
    // Warm up (tokenizer, pools), then measure the start.
    for _ in 0..20 {
        stack.client().get("/api/threads").await?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let start = rss_mib(pid);
    let sampler = Sampler::start(pid);
    println!("api phase · api pid {pid} · start RSS {start:.1} MiB; {}", allocator_line(&stack.api_url).await);

    let mut principals: Vec<Client> = vec![stack.client()];
    for i in 1..8 {
        principals.push(stack.client_for(&format!("p{i}"))?);
    }
    let mut threads: Vec<(usize, String)> = Vec::new();
    let t = Instant::now();
    let creates = futures_util::stream::iter((0..args.threads).map(|i| {
        let c = principals[i % principals.len()].clone();
        async move { (i % 8, c.create_thread().await) }
    }))
    .buffer_unordered(16)
    .collect::<Vec<_>>()
    .await;
    for (p, id) in creates {
        threads.push((p, id?));
    }
    println!("  {} threads in {:.1} s", threads.len(), t.elapsed().as_secs_f64());
    let watched: Vec<(usize, String)> = threads.iter().filter(|(p, _)| *p == 0).take(4).cloned().collect();

    // SSE clients: three quarters read, a quarter never reads (back-pressure).
    let mut streams = Vec::new();
    let opened = futures_util::stream::iter((0..args.clients).map(|i| {
        let (_, thread) = watched[i % watched.len()].clone();
        let (http, url, key) = (http.clone(), stack.api_url.clone(), stack.key.clone());
        async move { http.get(format!("{url}/api/threads/{thread}/updates/stream")).bearer_auth(key).send().await }
    }))
    .buffer_unordered(32)
    .collect::<Vec<_>>()
    .await;
    let mut readers = Vec::new();
    for (i, response) in opened.into_iter().enumerate() {
        let response = response?;
        anyhow::ensure!(response.status() == 200, "SSE: {}", response.status());
        if i % 4 == 3 {
            streams.push(response); // never read
        } else {
            readers.push(tokio::spawn(async move {
                let mut body = response.bytes_stream();
                let mut n = 0u64;
                while let Some(Ok(chunk)) = body.next().await {
                    n += chunk.len() as u64;
                }
                n
            }));
        }
    }
    let polls: Vec<_> = (0..50)
        .map(|i| {
            let (_, thread) = watched[i % watched.len()].clone();
            let c = principals[0].clone();
            tokio::spawn(async move {
                loop {
                    if c.get(&format!("/api/threads/{thread}/updates?timeoutMs=5000")).await.is_err() {
                        return;
                    }
                }
            })
        })
        .collect();
    println!("  {} SSE clients ({} never reading) and 50 long-polls on {} watched threads; RSS {:.1} MiB", args.clients, streams.len(), watched.len(), rss_mib(pid));

    let megabyte = "m".repeat(1024 * 1024 - 64);
    let t = Instant::now();
    let unwatched: Vec<(usize, String)> = threads.iter().filter(|(p, _)| *p != 0).cloned().collect();
    let jobs = (0..args.patches * 2).map(|i| {
        let (p, thread) = if i % 2 == 0 { watched[i / 2 % watched.len()].clone() } else { unwatched[i / 2 % unwatched.len()].clone() };
        let c = principals[p].clone();
        let body = json!({"metadata": {"blob": megabyte, "n": i}});
        async move { c.send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), Some(body), &[]).await.map(|r| r.status) }
    });
    let results = futures_util::stream::iter(jobs).buffer_unordered(8).collect::<Vec<_>>().await;
    let ok = results.iter().filter(|r| matches!(r, Ok(200))).count();
    println!("  {} PATCHes of 1 MiB metadata ({ok} answered 200) in {:.1} s; RSS {:.1} MiB, peak so far {:.1} MiB", results.len(), t.elapsed().as_secs_f64(), rss_mib(pid), sampler.peak());
    println!("  after the PATCHes: {}", allocator_line(&stack.api_url).await);
    let chats = (0..50).map(|i| {
        let (p, thread) = unwatched[i % unwatched.len()].clone();
        let c = principals[p].clone();
        let content = format!("{i} {}", &megabyte[..1000 * 1000]);
        async move { c.post(&format!("/api/threads/{thread}/chat"), json!({"content": content, "multitask": "enqueue"})).await.map(|r| r.status) }
    });
    let chats = futures_util::stream::iter(chats).buffer_unordered(8).collect::<Vec<_>>().await;
    // Refused with 413 when the turn is larger than the model's context can hold (issue 11:
    // input limits up front); read, counted and refused all the same.
    println!(
        "  50 chats of 1 MB ({} accepted, {} refused 413); RSS {:.1} MiB",
        chats.iter().filter(|r| matches!(r, Ok(202))).count(),
        chats.iter().filter(|r| matches!(r, Ok(413))).count(),
        rss_mib(pid)
    );

    let peak = sampler.peak();

    drop(streams);
    for r in &readers {
        r.abort();
    }
    for p in &polls {
        p.abort();
    }
    drop(http);
    // The hub frees idle feeds every 5 s; the pools close connections idle for
    // DB_POOL_IDLE_TIMEOUT_MS (30 s by default; their buffers grew with the 1 MiB rows).
    tokio::time::sleep(Duration::from_secs(12)).await;
    println!("  RSS 12 s after the clients left (information only): {:.1} MiB; {}", rss_mib(pid), allocator_line(&stack.api_url).await);
    tokio::time::sleep(Duration::from_secs(28)).await;
    let after = rss_mib(pid);
    println!("  RSS 40 s after the clients left: {after:.1} MiB");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../test-output/bench_hostile_api");
    let _ = std::fs::write(dir.join("api-smaps-after.txt"), std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default());
    let metrics = reqwest::get(format!("{}/metrics", stack.api_url)).await?.text().await?;
    let cached = metrics.lines().find(|l| l.starts_with("agentloop_hub_cached_bytes")).unwrap_or("agentloop_hub_cached_bytes ?");
    println!("  clients gone: {cached}; {}", allocator_line(&stack.api_url).await);
    let steady = verdict("api", start, peak, after);

    // Exports of threads of large messages (acceptance probe N, N-11: an export read up to 200
    // messages per page whatever their size, so a thread of large messages was one page in the
    // api's memory, several times over). Four principals import a thread of 48 messages of 243 KB
    // of prose (a message must fit the mock model's context), then export it at once, reading at ~4 MB/s.
    let mut big = Vec::new();
    let prose = "lorem ipsum dolor sit amet ".repeat(9000);
    for p in 1..5 {
        let c = principals[p].clone();
        let messages: Vec<Value> = (0..48)
            .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("{i} {prose}")}))
            .collect();
        let r = c.post("/api/threads/import", json!({"format": "agentloop.thread.v1", "thread": {"title": "big"}, "messages": messages})).await?;
        anyhow::ensure!(r.status == 201, "import: {} {}", r.status, r.body.to_string().chars().take(300).collect::<String>());
        big.push((c, r.body["thread"]["id"].as_str().context("imported thread id")?.to_owned()));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before_exports = rss_mib(pid);
    let export_sampler = Sampler::start(pid);
    let exports = big.into_iter().map(|(c, thread)| async move {
        let response = c.http.get(format!("{}/api/threads/{thread}/export", c.base)).bearer_auth(c.key.clone().unwrap_or_default()).send().await?;
        anyhow::ensure!(response.status() == 200, "export: {}", response.status());
        let mut body = response.bytes_stream();
        let (mut n, mut paced) = (0usize, 0usize);
        while let Some(chunk) = body.next().await {
            n += chunk?.len();
            if n - paced >= 256 * 1024 {
                paced = n;
                tokio::time::sleep(Duration::from_millis(60)).await; // ~4 MB/s
            }
        }
        Ok::<_, anyhow::Error>(n)
    });
    let sizes = futures_util::future::join_all(exports).await.into_iter().collect::<Result<Vec<_>>>()?;
    let export_peak = export_sampler.peak();
    drop(export_sampler);
    let growth = export_peak - before_exports;
    println!(
        "  4 exports of threads of 48 x 243 KB ({:.1} MB each, read at ~4 MB/s): RSS before {before_exports:.1} MiB, peak {export_peak:.1} MiB (+{growth:.1})",
        sizes.iter().sum::<usize>() as f64 / 4e6,
    );
    // Each export holds about one page (at most 4 MiB of stored text) and its encoding.
    let exports_ok = growth <= 64.0;
    println!("    export peak growth ≤ 64 MiB: {}", if exports_ok { "PASS" } else { "FAIL" });
    Ok(steady && exports_ok)
}

/// A hostile HTTP receiver for HTTP tools and a raw MCP endpoint: `/huge` 256 MiB, `/endless`
/// an endless chunked stream, `/drip` one byte every 200 ms, `/mcp` an MCP endpoint whose
/// `tools/call` answer is an endless SSE stream.
async fn hostile_server() -> Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let mut request = Vec::new();
                loop {
                    let Ok(n) = stream.read(&mut buf).await else { return };
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buf[..n]);
                    if let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&request[..end]).to_ascii_lowercase();
                        let length: usize = head.lines().find_map(|l| l.strip_prefix("content-length:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
                        if request.len() >= end + 4 + length {
                            break;
                        }
                    }
                }
                let text = String::from_utf8_lossy(&request).into_owned();
                let path = text.split_whitespace().nth(1).unwrap_or("/").to_owned();
                let chunk = format!("{:x}\r\n{}\r\n", 64 * 1024, "x".repeat(64 * 1024));
                match path.as_str() {
                    "/huge" | "/endless" => {
                        let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n").await;
                        let limit = if path == "/huge" { 4096 } else { u64::MAX }; // 4096 x 64 KiB = 256 MiB
                        let mut sent = 0u64;
                        while sent < limit && stream.write_all(chunk.as_bytes()).await.is_ok() {
                            sent += 1;
                        }
                        let _ = stream.write_all(b"0\r\n\r\n").await;
                    }
                    "/drip" => {
                        let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n").await;
                        while stream.write_all(b"x").await.is_ok() {
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                    _ => {
                        // A minimal MCP endpoint: initialize and tools/list answer as JSON,
                        // tools/call with an endless SSE stream.
                        let body = text.split("\r\n\r\n").nth(1).unwrap_or_default();
                        let request: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
                        let id = request.get("id").cloned().unwrap_or(serde_json::Value::Null);
                        let method = request["method"].as_str().unwrap_or_default();
                        let answer = match method {
                            "initialize" => json!({"jsonrpc": "2.0", "id": id, "result": {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}}, "serverInfo": {"name": "hostile", "version": "1"}}}),
                            "tools/list" => json!({"jsonrpc": "2.0", "id": id, "result": {"tools": [{"name": "flood", "inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": true}}]}}),
                            "tools/call" => {
                                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n").await;
                                let event = format!("data: {}\n\n", "y".repeat(32 * 1024));
                                let framed = format!("{:x}\r\n{event}\r\n", event.len());
                                while stream.write_all(framed.as_bytes()).await.is_ok() {}
                                return;
                            }
                            _ => {
                                let _ = stream.write_all(b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n").await;
                                return;
                            }
                        };
                        let body = answer.to_string();
                        let _ = stream
                            .write_all(format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).as_bytes())
                            .await;
                    }
                }
            });
        }
    });
    Ok(addr)
}

async fn worker_phase(args: &Args) -> Result<bool> {
    let addr = hostile_server().await?;
    let mcp = {
        use std::io::BufRead;
        let mut child = std::process::Command::new(agentloop_tests::bin_dir().join("mcp-test-server"))
            .args(["--listen", "127.0.0.1:0"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line)?;
        let url = line.trim().strip_prefix("MCP_TEST_URL=").unwrap_or_default().to_owned();
        (agentloop_tests::Proc { name: "mcp-test-server".into(), child }, url)
    };
    let tools = json!({
        "defaultPolicy": "auto",
        "tools": {"huge": {"idempotent": true}, "endless": {"idempotent": true}, "drip": {"idempotent": true}},
        "httpTools": [
            {"name": "huge", "url": format!("http://{addr}/huge"), "timeoutMs": 20000},
            {"name": "endless", "url": format!("http://{addr}/endless"), "timeoutMs": 5000},
            {"name": "drip", "url": format!("http://{addr}/drip"), "timeoutMs": 3000, "readTimeoutMs": 1000}
        ],
        "mcpServers": [
            {"name": "big", "transport": "http", "url": format!("{}/mcp", mcp.1), "callTimeoutMs": 20000},
            {"name": "hostile", "transport": "http", "url": format!("http://{addr}/mcp"), "callTimeoutMs": 5000}
        ]
    });
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../test-output/bench_hostile_worker");
    std::fs::create_dir_all(&dir)?;
    let tools_file = dir.join("tools.json");
    std::fs::write(&tools_file, tools.to_string())?;
    let options = StackOptions {
        workers: 1,
        worker_env: vec![("TOOLS_FILE".into(), tools_file.display().to_string()), ("WORKER_CONCURRENCY".into(), "4".into())],
        ..Default::default()
    };
    let stack = Stack::start("bench_hostile_worker", options).await?;
    let pid = stack.workers[0].pid();
    let c = stack.client();
    // Warm up: one plain run.
    let thread = c.create_thread().await?;
    let run = c.chat(&thread, "hello").await?;
    c.wait_terminal(run["run"]["id"].as_str().unwrap(), Duration::from_secs(60)).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let start = rss_mib(pid);
    let sampler = Sampler::start(pid);
    println!("worker phase · worker pid {pid} · start RSS {start:.1} MiB");
    let calls = ["huge", "endless", "drip", "big__big", "hostile__flood"];
    let t = Instant::now();
    let mut runs = Vec::new();
    for round in 0..args.calls {
        for tool in calls {
            let thread = c.create_thread().await?;
            let arguments = if tool == "big__big" { json!({"bytes": 64 * 1024 * 1024}) } else { json!({}) };
            let steps = json!([{"toolCalls": [{"name": tool, "arguments": arguments}]}, {"text": format!("{tool} {round} done")}]);
            let posted = c.chat(&thread, &script(steps)).await?;
            runs.push(posted["run"]["id"].as_str().unwrap().to_owned());
        }
    }
    let mut ended = 0;
    for run in &runs {
        let r = c.wait_terminal(run, Duration::from_secs(180)).await?;
        ended += usize::from(r["status"] == "completed");
    }
    println!("  {} runs calling {calls:?} ({ended} completed; each tool answer bounded) in {:.1} s", runs.len(), t.elapsed().as_secs_f64());
    let peak = sampler.peak();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = rss_mib(pid);
    drop(mcp);
    Ok(verdict("worker", start, peak, after))
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    agentloop_tests::install_crypto();
    let mut ok = true;
    if args.only.as_deref().is_none_or(|o| o == "api") {
        ok &= api_phase(&args).await?;
    }
    if args.only.as_deref().is_none_or(|o| o == "worker") {
        ok &= worker_phase(&args).await?;
    }
    println!("{}", if ok { "all targets met" } else { "a target was missed" });
    std::process::exit(if ok { 0 } else { 1 });
}
