//! `bench-reads`: read-path benchmark of issue 5 (SPEC §10).
//!
//! ```text
//! cargo run --release -p agentloop-tests --bin bench-reads -- [--reads 300] [--clients 10000]
//! ```
//!
//! It builds the api/worker binaries of its own profile first (`cargo build`), creates its own
//! database from `TEST_DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`),
//! starts one api process (plus the mock model; no worker), seeds a `--small` (100) and a
//! `--large` (100,000) message thread with SQL, and prints:
//!
//! 1. thread window `GET /api/threads/{id}`: median and p95 of `--reads` sequential reads on
//!    each thread, and the large/small ratio;
//! 2. paging `GET /api/threads/{id}/messages?before=&take=100` (random positions on the large
//!    thread): the same;
//! 3. `EXPLAIN (ANALYZE, FORMAT JSON)` of the window and paging statements (as the server
//!    issues them), with custom and generic plans, listing the plan node types and whether any
//!    node is not an index scan;
//! 4. one api process with `--clients` concurrent SSE clients on loopback: its RSS before and
//!    after they connect, and the delay until every client received one new event (p50, p99,
//!    max, measured from the `POST /chat` that produced it).
//!
//! The client side needs one file descriptor per SSE client: the soft `RLIMIT_NOFILE` is raised
//! to the hard limit at start-up (the api inherits it); with a lower hard limit run
//! `ulimit -n 20000` first (as root) or pass a smaller `--clients`. Everything it starts is
//! stopped and its database dropped at the end. Logs: `test-output/bench_reads/`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use agentloop_tests::{Stack, StackOptions, bin_dir, script};
use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use uuid::Uuid;

/// Read-path benchmark: window and paging cost vs thread length, query plans, SSE fan-out.
#[derive(Debug, Clone, Parser)]
#[command(name = "bench-reads")]
struct Args {
    /// Sequential reads per measurement.
    #[arg(long, default_value_t = 300)]
    reads: usize,
    /// Messages of the small thread.
    #[arg(long, default_value_t = 100)]
    small: i64,
    /// Messages of the large thread.
    #[arg(long, default_value_t = 100_000)]
    large: i64,
    /// Concurrent SSE clients (0 skips the fan-out measurement).
    #[arg(long, default_value_t = 10_000)]
    clients: usize,
    /// Connections being opened at once while the SSE clients connect.
    #[arg(long, default_value_t = 200)]
    connect_concurrency: usize,
    /// Skip building the api/worker binaries (they must then be up to date).
    #[arg(long)]
    no_build: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !args.no_build {
        build_binaries()?;
    }
    let nofile = raise_nofile();
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run(args, nofile))
}

/// Builds `agentloop-api`, `agentloop-worker` and `mock-model` with this binary's profile, so
/// the benchmark never measures stale binaries.
fn build_binaries() -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let release = bin_dir().ends_with("release");
    let mut cmd = std::process::Command::new(cargo);
    cmd.args(["build", "--bin", "agentloop-api", "--bin", "agentloop-worker", "--bin", "mock-model"]);
    if release {
        cmd.arg("--release");
    }
    eprintln!("bench-reads: building the binaries ({})", if release { "release" } else { "debug" });
    let status = cmd.current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).status().context("running cargo build")?;
    ensure!(status.success(), "cargo build failed");
    Ok(())
}

/// Raises the soft open-files limit to the hard one; returns the soft limit in force.
fn raise_nofile() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() { hard } else { soft }
        }
        Ok((soft, _)) => soft,
        Err(_) => 1024,
    }
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64) * q).ceil() as usize;
    sorted[i.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

/// Median and p95 of `n` sequential GETs of `path_for(i)`.
async fn time_reads(http: &reqwest::Client, base: &str, key: &str, n: usize, path_for: impl Fn(usize) -> String) -> Result<(Duration, Duration)> {
    for i in 0..n.min(30) {
        http.get(format!("{base}{}", path_for(i))).bearer_auth(key).send().await?.bytes().await?; // warm-up
    }
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let t0 = Instant::now();
        let resp = http.get(format!("{base}{}", path_for(i))).bearer_auth(key).send().await?;
        ensure!(resp.status().is_success(), "GET {} -> {}", path_for(i), resp.status());
        resp.bytes().await?;
        samples.push(t0.elapsed());
    }
    samples.sort();
    Ok((percentile(&samples, 0.5), percentile(&samples, 0.95)))
}

/// Seeds `n` messages into `thread` with SQL: alternating user/assistant text, and every 50
/// messages an assistant tool call followed by its result. Counters kept consistent.
async fn seed(db: &tokio_postgres::Client, thread: Uuid, n: i64) -> Result<()> {
    db.execute(
        "INSERT INTO messages (thread_id, sequence, timestamp_ms, role, content, tool_calls, tool_call_id, byte_size)
         SELECT $1, s, 1700000000000 + s, role, content, tc, tcid, octet_length(content::text) + coalesce(octet_length(tc::text), 0)
         FROM (SELECT s,
                      CASE WHEN s % 50 = 24 THEN 'assistant' WHEN s % 50 = 25 THEN 'tool' WHEN s % 2 = 1 THEN 'user' ELSE 'assistant' END AS role,
                      CASE WHEN s % 50 = 24 THEN 'null'::jsonb WHEN s % 50 = 25 THEN to_jsonb('42'::text)
                           ELSE to_jsonb('Message ' || s || ': ' || repeat('lorem ipsum dolor sit amet ', (1 + s % 13)::int)) END AS content,
                      CASE WHEN s % 50 = 24 THEN jsonb_build_array(jsonb_build_object('id', 'call-' || s, 'type', 'function',
                           'function', jsonb_build_object('name', 'calculator', 'arguments', '{\"expression\":\"6*7\"}'))) END AS tc,
                      CASE WHEN s % 50 = 25 THEN 'call-' || (s - 1) END AS tcid
               FROM generate_series(1, $2::bigint) s) x",
        &[&thread, &n],
    )
    .await?;
    db.execute(
        "UPDATE threads SET last_sequence = $2::bigint, message_count = $2::bigint::int,
                last_timestamp_ms = 1700000000000 + $2::bigint WHERE id = $1",
        &[&thread, &n],
    )
    .await?;
    Ok(())
}

/// Node types of a JSON plan, depth-first, e.g. `Limit > Index Scan Backward (messages_active_by_sequence)`.
fn plan_nodes(plan: &Value, out: &mut Vec<String>) {
    let kind = plan["Node Type"].as_str().unwrap_or("?");
    let backward = if plan["Scan Direction"] == "Backward" { " Backward" } else { "" };
    let index = plan["Index Name"].as_str().map(|i| format!(" ({i})")).unwrap_or_default();
    out.push(format!("{kind}{backward}{index}"));
    for child in plan["Plans"].as_array().into_iter().flatten() {
        plan_nodes(child, out);
    }
}

/// Scans that are not index scans of any kind.
fn non_index_scans(nodes: &[String]) -> Vec<&String> {
    nodes.iter().filter(|n| n.contains("Scan") && !n.starts_with("Index Scan") && !n.starts_with("Index Only Scan")).collect()
}

async fn explain(db: &tokio_postgres::Client, thread: Uuid, middle: i64) -> Result<bool> {
    let cols = "id, thread_id, sequence, timestamp_ms, role, content, tool_calls, tool_call_id, reasoning, run_id, step_id, token_estimate, byte_size, active, created_at";
    // The statements as the server sends them ($n are binds). diesel binds `active = true`
    // (window) as a parameter; the paging statements use the literal predicate.
    let statements: Vec<(&str, String, Vec<String>)> = vec![
        ("window head", format!("SELECT {cols} FROM messages WHERE thread_id = $1 AND active = $2 ORDER BY sequence ASC LIMIT $3"), vec![format!("'{thread}'"), "true".into(), "20".into()]),
        ("window tail", format!("SELECT {cols} FROM messages WHERE thread_id = $1 AND active = $2 ORDER BY sequence DESC LIMIT $3"), vec![format!("'{thread}'"), "true".into(), "100".into()]),
        ("paging metadata", "SELECT sequence, role, byte_size, tool_calls IS NOT NULL FROM messages WHERE thread_id = $1 AND active AND sequence < $2 ORDER BY sequence DESC LIMIT $3".into(), vec![format!("'{thread}'"), middle.to_string(), "100".into()]),
        ("paging bodies", format!("SELECT {cols} FROM messages WHERE thread_id = $1 AND active AND sequence BETWEEN $2 AND $3 ORDER BY sequence ASC"), vec![format!("'{thread}'"), (middle - 100).to_string(), (middle - 1).to_string()]),
        ("paging hasMore probes", "SELECT (SELECT sequence FROM messages WHERE thread_id = $1 AND active AND sequence < $2 ORDER BY sequence DESC LIMIT 1) AS prev, (SELECT sequence FROM messages WHERE thread_id = $1 AND active AND sequence > $3 ORDER BY sequence ASC LIMIT 1) AS next".into(), vec![format!("'{thread}'"), (middle - 100).to_string(), (middle - 1).to_string()]),
    ];
    let types = ["window head", "window tail"];
    let mut all_index = true;
    for (mode, setting) in [("custom plan", "force_custom_plan"), ("generic plan", "force_generic_plan")] {
        db.batch_execute(&format!("SET plan_cache_mode = {setting}")).await?;
        for (i, (name, sql, binds)) in statements.iter().enumerate() {
            let param_types = if types.contains(name) { "uuid, boolean, bigint" } else { "uuid, bigint, bigint" };
            db.batch_execute(&format!("DEALLOCATE ALL; PREPARE q{i} ({param_types}) AS {sql}")).await?;
            let text = db
                .simple_query(&format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE q{i} ({})", binds.join(", ")))
                .await?
                .into_iter()
                .find_map(|m| match m {
                    tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
                    _ => None,
                })
                .context("EXPLAIN returned no row")?;
            let plan: Value = serde_json::from_str(&text)?;
            let root = &plan[0]["Plan"];
            let mut nodes = Vec::new();
            plan_nodes(root, &mut nodes);
            let bad = non_index_scans(&nodes);
            all_index &= bad.is_empty();
            let buffers = root["Shared Hit Blocks"].as_i64().unwrap_or(0) + root["Shared Read Blocks"].as_i64().unwrap_or(0);
            println!(
                "  {mode:<12} {name:<22} {:>7.3} ms  {:>4} buffers  {}{}",
                plan[0]["Execution Time"].as_f64().unwrap_or(0.0),
                buffers,
                nodes.join(" > "),
                if bad.is_empty() { String::new() } else { format!("   <-- NOT AN INDEX SCAN: {bad:?}") }
            );
        }
    }
    db.batch_execute("DEALLOCATE ALL; RESET plan_cache_mode").await?;
    Ok(all_index)
}

fn rss_kib(pid: i32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn contains(haystack: &[u8], from: usize, needle: &[u8]) -> bool {
    haystack[from.saturating_sub(needle.len())..].windows(needle.len()).any(|w| w == needle)
}

/// One SSE client over a raw socket: connects, waits for the `thread` snapshot (sent right after
/// `connected`), reports itself ready, then returns the instant it saw an `event: message`.
async fn sse_client(addr: SocketAddr, request: Arc<Vec<u8>>, gate: Arc<Semaphore>, ready: Arc<AtomicUsize>) -> Result<Instant> {
    let permit = gate.acquire_owned().await?;
    let mut stream = TcpStream::connect(addr).await?;
    stream.write_all(&request).await?;
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            bail!("connection closed");
        }
        let from = buf.len();
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() >= 12 && !buf.starts_with(b"HTTP/1.1 200") {
            bail!("unexpected response: {}", String::from_utf8_lossy(&buf[..buf.len().min(200)]));
        }
        if contains(&buf, from, b"event: thread") {
            break;
        }
    }
    ready.fetch_add(1, Ordering::SeqCst);
    drop(permit);
    buf.clear();
    wait_message(stream, buf, chunk).await
}

async fn wait_message(mut stream: TcpStream, mut buf: Vec<u8>, mut chunk: [u8; 4096]) -> Result<Instant> {
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            bail!("connection closed before the event");
        }
        let from = buf.len();
        buf.extend_from_slice(&chunk[..n]);
        if contains(&buf, from, b"event: message") {
            return Ok(Instant::now());
        }
        if buf.len() > 64 * 1024 {
            buf.drain(..buf.len() - 64);
        }
    }
}

async fn fan_out(stack: &Stack, args: &Args, nofile: u64) -> Result<()> {
    let mut clients = args.clients;
    if (nofile as usize) < clients + 200 {
        let fit = (nofile as usize).saturating_sub(200);
        println!("  open-files limit {nofile} < {} clients + 200: measuring {fit} clients (run `ulimit -n 20000` first for all)", args.clients);
        clients = fit;
    }
    let c = stack.client();
    let thread = c.create_thread().await?;
    let addr: SocketAddr = stack.api_url.trim_start_matches("http://").parse()?;
    let request = Arc::new(
        format!(
            "GET /api/threads/{thread}/updates/stream HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\nAccept: text/event-stream\r\n\r\n",
            stack.key
        )
        .into_bytes(),
    );
    let pid = stack.api.pid();
    let (rss0, _) = rss_kib(pid);
    let gate = Arc::new(Semaphore::new(args.connect_concurrency));
    let ready = Arc::new(AtomicUsize::new(0));
    let t_connect = Instant::now();
    let handles: Vec<_> = (0..clients)
        .map(|_| tokio::spawn(sse_client(addr, request.clone(), gate.clone(), ready.clone())))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(300);
    while ready.load(Ordering::SeqCst) < clients {
        if Instant::now() > deadline || handles.iter().filter(|h| h.is_finished()).count() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let connected = ready.load(Ordering::SeqCst);
    let connect_time = t_connect.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss1, _) = rss_kib(pid);
    println!("  {connected} of {clients} SSE clients connected in {:.1} s (connected + thread snapshot received)", connect_time.as_secs_f64());
    ensure!(connected == clients, "not every SSE client connected");
    println!("  api RSS: {:.1} MiB idle -> {:.1} MiB with {clients} SSE clients ({:.1} KiB per client)",
        rss0 as f64 / 1024.0, rss1 as f64 / 1024.0, (rss1.saturating_sub(rss0)) as f64 / clients as f64);

    let t0 = Instant::now();
    c.chat(&thread, &script(json!([{"text": "fan-out probe"}]))).await?;
    let posted = t0.elapsed();
    let mut delays = Vec::with_capacity(clients);
    let mut failed = 0;
    for h in handles {
        match tokio::time::timeout(Duration::from_secs(120), h).await {
            Ok(Ok(Ok(at))) => delays.push(at.saturating_duration_since(t0)),
            _ => failed += 1,
        }
    }
    let (rss2, hwm) = rss_kib(pid);
    delays.sort();
    println!("  one event (POST /chat -> `message` on every stream; the POST itself took {}):", ms(posted));
    println!(
        "    received by {} of {clients}: p50 {}, p99 {}, max {}",
        delays.len(),
        ms(percentile(&delays, 0.5)),
        ms(percentile(&delays, 0.99)),
        ms(delays.last().copied().unwrap_or_default())
    );
    println!("  api RSS after the event: {:.1} MiB (peak {:.1} MiB)", rss2 as f64 / 1024.0, hwm as f64 / 1024.0);
    ensure!(failed == 0, "{failed} clients did not receive the event");
    Ok(())
}

async fn run(args: Args, nofile: u64) -> Result<()> {
    agentloop_tests::install_crypto();
    let options = StackOptions {
        workers: 0,
        api_env: vec![("RUST_LOG".into(), "warn".into())],
        ..Default::default()
    };
    let stack = Stack::start("bench_reads", options).await?;
    let db = stack.db.client().await?;
    let c = stack.client();
    let small = Uuid::parse_str(&c.create_thread().await?)?;
    let large = Uuid::parse_str(&c.create_thread().await?)?;
    let t = Instant::now();
    seed(&db, small, args.small).await?;
    seed(&db, large, args.large).await?;
    db.batch_execute("ANALYZE messages; ANALYZE threads").await?;
    let rows: i64 = db.query_one("SELECT count(*) FROM messages", &[]).await?.get(0);
    println!("bench-reads · api {} (pid {}) · {rows} messages seeded in {:.1} s", stack.api_url, stack.api.pid(), t.elapsed().as_secs_f64());

    let http = reqwest::Client::new();
    let (base, key) = (stack.api_url.as_str(), stack.key.as_str());
    println!("\n1. thread window GET /api/threads/{{id}} ({} sequential reads each)", args.reads);
    let (s50, s95) = time_reads(&http, base, key, args.reads, |_| format!("/api/threads/{small}")).await?;
    let (l50, l95) = time_reads(&http, base, key, args.reads, |_| format!("/api/threads/{large}")).await?;
    println!("  {:>7} messages: median {}, p95 {}", args.small, ms(s50), ms(s95));
    println!("  {:>7} messages: median {}, p95 {}", args.large, ms(l50), ms(l95));
    println!("  ratio large/small: median {:.2}x, p95 {:.2}x", l50.as_secs_f64() / s50.as_secs_f64(), l95.as_secs_f64() / s95.as_secs_f64());

    println!("\n2. paging GET /api/threads/{{id}}/messages?before=&take=100 ({} sequential reads each)", args.reads);
    let small_before = args.small + 1;
    let (s50, s95) = time_reads(&http, base, key, args.reads, |_| format!("/api/threads/{small}/messages?before={small_before}&take=100")).await?;
    let span = (args.large - 200).max(1) as usize;
    let (l50, l95) = time_reads(&http, base, key, args.reads, |i| {
        let before = 150 + (i.wrapping_mul(7919) % span) as i64; // spread over the whole thread
        format!("/api/threads/{large}/messages?before={before}&take=100")
    })
    .await?;
    println!("  {:>7} messages: median {}, p95 {}   (the whole thread: 100 messages)", args.small, ms(s50), ms(s95));
    println!("  {:>7} messages: median {}, p95 {}   (100 messages at positions spread over the thread)", args.large, ms(l50), ms(l95));
    println!("  ratio large/small: median {:.2}x, p95 {:.2}x", l50.as_secs_f64() / s50.as_secs_f64(), l95.as_secs_f64() / s95.as_secs_f64());

    println!("\n3. EXPLAIN (ANALYZE, FORMAT JSON) on the {}-message thread", args.large);
    let mut all_index = true;
    for position in [args.large / 2, 150] {
        println!("  paging position before={position}:");
        all_index &= explain(&db, large, position).await?;
    }
    println!("  {}", if all_index { "OK: every scan is an index scan" } else { "WARNING: a scan is not an index scan (see above)" });

    if args.clients > 0 {
        println!("\n4. SSE fan-out: one api process, {} concurrent SSE clients on loopback (open-files limit {nofile})", args.clients);
        fan_out(&stack, &args, nofile).await?;
    }
    Ok(())
}
