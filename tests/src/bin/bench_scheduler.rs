//! `bench-scheduler`: the scheduler benchmark of issue 3, from ONE run on ONE PostgreSQL.
//!
//! ```text
//! cargo build --release --workspace
//! cargo run --release -p agentloop-tests --bin bench-scheduler -- [--runs 20000] [--latency-runs 1000]
//! target/release/bench-scheduler --only concurrency --streams 1000 --watchers 50
//! ```
//!
//! It spawns the release binaries next to itself (`target/release/agentloop-api`,
//! `agentloop-worker`, `mock-model`), creates its own database from `TEST_DATABASE_URL`
//! (default `postgres://postgres@127.0.0.1:5432/postgres`, a superuser), migrates it with
//! `agentloop-worker migrate`, and prints:
//!
//! 1. claim + complete throughput: `--runs` runs (threads, user messages and `queued` runs
//!    inserted directly with SQL in big batches) answered by the zero-latency mock model
//!    (`You said: ...`, one slice, no tool call) by `--workers` worker processes of
//!    `--concurrency` slots each, timed from spawning the workers until a 200 ms poll finds no
//!    run left that is not terminal;
//! 2. `pgbench -N` TPS at the same client count (workers x concurrency) on the same server, run
//!    just before and just after (1), and the ratio of (1) to it; then the step protocol alone:
//!    the SQL the workers send for such a run (claim, slice start, commit and their
//!    notification flushes), driven by `pgbench -f` at the same client count on a database of
//!    its own filled like (1)'s, with no worker process — the database's own cost of a run, and
//!    how much of it (1) reaches;
//! 3. enqueue-to-slice-start latency over `--latency-runs` single runs posted one at a time
//!    through the HTTP API with idle workers (`runs.started_at - runs.created_at` and the step
//!    row's `started_at`, from the database; plus what a client sees: POST -> 202 and
//!    POST -> the SSE `run` event with status `running`);
//! 4. SQL per run: transactions per run from `pg_stat_database.xact_commit` over phase (1)
//!    (minus the benchmark's own polls), statements and round trips per run counted by a
//!    protocol-level proxy between the workers and PostgreSQL over `--statement-runs` runs
//!    (and by `pg_stat_statements` over phase (1) when the server preloads it);
//! 5. concurrency: `--streams` runs (1,000) streaming at once on ONE worker process
//!    (`WORKER_CONCURRENCY` = streams, `DB_POOL_SIZE` = `--stream-pool`, 16), each answered by
//!    the mock in `--stream-chunks` (50) chunks of 3 words every `--stream-seconds` /
//!    `--stream-chunks` (100 ms), the words naming their chunk (`c0007.0 c0007.1 c0007.2`).
//!    The runs are inserted with SQL, `--watchers` (50) SSE clients connect to as many of their
//!    threads (spread over the claim order) before the worker starts. Reported against the
//!    issue's targets: statuses (0 failed), first claim -> last finish (<= stream-seconds + 3 s),
//!    the worker's peak RSS (VmRSS every 100 ms, and VmHWM; <= 200 MiB), its connections in
//!    `pg_stat_activity` (<= DB_POOL_SIZE + 4), the SSE clients' offset gaps (0) and chunk delay
//!    (p99 <= 500 ms; chunk i's delay = receive time - (t0 + i x interval), t0 = the minimum over
//!    the stream's chunks of receive time - i x interval: lag relative to the stream's own
//!    best-delivered chunk), the committed answers; plus PostgreSQL transactions/s and WAL
//!    bytes/s over the phase, the server-side flush times, the worker's own metrics and the CPU
//!    split. Per-chunk data: `test-output/bench-scheduler/concurrency-chunks.csv`.
//!
//! `--only throughput,latency,statements,concurrency` runs some phases only (pgbench goes with
//! throughput). The soft open-files limit is raised to the hard limit at start-up (the worker
//! and the mock need a socket per stream and inherit it). Targets are printed with PASS/FAIL
//! next to the figures; the benchmark exits 0 whatever they are, non-zero only when a phase
//! could not be measured.
//!
//! Every process it starts and both databases it creates are removed at the end, on error, and
//! on SIGINT/SIGTERM. Process logs go to `test-output/bench-scheduler/`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentloop_tests::{ENQUEUE_SQL, Proc, Sig, admin_url, bin_dir, free_port, install_crypto};
use anyhow::{Context, Result, anyhow, bail, ensure};
use clap::Parser;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_postgres::NoTls;
use uuid::Uuid;

/// Scheduler benchmark: claim+complete throughput vs pgbench, enqueue-to-start latency, SQL per run,
/// concurrent streaming runs on one worker.
#[derive(Debug, Clone, Parser)]
#[command(name = "bench-scheduler")]
struct Args {
    /// Runs of the throughput phase.
    #[arg(long, default_value_t = 20_000)]
    runs: u32,
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    workers: u32,
    /// Slots per worker process (WORKER_CONCURRENCY); pgbench uses workers x concurrency clients.
    #[arg(long, default_value_t = 4)]
    concurrency: u32,
    /// Single runs of the latency phase (posted one at a time through the API).
    #[arg(long, default_value_t = 1_000)]
    latency_runs: u32,
    /// Runs of the statement-count phase (through the counting proxy); 0 skips it.
    #[arg(long, default_value_t = 1_000)]
    statement_runs: u32,
    /// Duration of each pgbench run, seconds; 0 skips pgbench.
    #[arg(long, default_value_t = 20)]
    pgbench_seconds: u32,
    /// pgbench scale factor.
    #[arg(long, default_value_t = 10)]
    pgbench_scale: u32,
    /// Runs inserted per SQL statement when enqueueing.
    #[arg(long, default_value_t = 2_000)]
    batch: u32,
    /// Concurrent streaming runs of the concurrency phase, all on ONE worker
    /// (WORKER_CONCURRENCY = this); 0 skips the phase.
    #[arg(long, default_value_t = 1_000)]
    streams: u32,
    /// Length of each streamed answer of the concurrency phase, seconds (the mock sleeps
    /// stream-seconds / stream-chunks between two chunks).
    #[arg(long, default_value_t = 5.0)]
    stream_seconds: f64,
    /// Content chunks of each streamed answer.
    #[arg(long, default_value_t = 50)]
    stream_chunks: u32,
    /// SSE clients of the concurrency phase, each watching one of the streaming threads.
    #[arg(long, default_value_t = 50)]
    watchers: u32,
    /// DB_POOL_SIZE of the concurrency phase's worker.
    #[arg(long, default_value_t = 16)]
    stream_pool: u32,
    /// Run only these phases (comma-separated); default: all. `throughput` includes pgbench.
    #[arg(long, value_delimiter = ',', value_enum)]
    only: Vec<Phase>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Phase {
    Throughput,
    Latency,
    Statements,
    Concurrency,
}

impl Args {
    fn runs_phase(&self, phase: Phase) -> bool {
        self.only.is_empty() || self.only.contains(&phase)
    }
}

/// Targets of the issues, printed next to the figures (a benchmark reports; it does not assert).
/// Issue 3: transactions and round trips per run (one slice, final answer, no tool call).
const TARGET_XACTS_PER_RUN: f64 = 4.0;
const TARGET_ROUND_TRIPS_PER_RUN: f64 = 10.0;
/// Issue 3: claim+complete runs/s over pgbench -N TPS at the same client count.
const TARGET_PGBENCH_RATIO: f64 = 0.7;
/// Concurrency phase: every run ends within this long after the first claim (for 5 s answers:
/// the answer's length + this slack = 8 s).
const TARGET_STREAM_SLACK_SECS: f64 = 3.0;
/// Concurrency phase: peak RSS of the one worker.
const TARGET_WORKER_RSS_MIB: f64 = 200.0;
/// Concurrency phase: p99 delay of a chunk to an SSE client (relative to the stream's best chunk).
const TARGET_CHUNK_P99_MS: f64 = 500.0;
/// Concurrency phase: worker connections beyond DB_POOL_SIZE (1 lease keeper, 1 listener,
/// 2 maintenance).
const WORKER_EXTRA_CONNECTIONS: i64 = 4;
/// Words per streamed content chunk of the mock model (`WORDS_PER_CHUNK` in mock_model/wire.rs).
const MOCK_WORDS_PER_CHUNK: usize = 3;

fn mark(pass: bool) -> &'static str {
    if pass { "PASS" } else { "FAIL" }
}

const USER_TEXT: &str = "hello from the scheduler benchmark";
const TERMINAL_SQL: &str = "SELECT count(*) FROM runs WHERE status NOT IN ('completed','failed','cancelled')";

fn main() -> ExitCode {
    let args = Args::parse();
    // Before any thread exists: the worker, api and mock inherit the raised limit (the
    // concurrency phase needs a socket per stream in the worker and in the mock).
    let nofile = raise_nofile();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut int), Ok(mut term)) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) else {
            eprintln!("error: cannot install signal handlers");
            return ExitCode::FAILURE;
        };
        // The bench runs in its own task: on a signal it is aborted, which drops (kills) every
        // child process and drops (DROP DATABASE ... WITH (FORCE)) every database it created.
        let mut task = tokio::spawn(bench(args, nofile));
        let interrupted = tokio::select! {
            result = &mut task => {
                return match result {
                    Ok(Ok(())) => ExitCode::SUCCESS,
                    Ok(Err(e)) => {
                        eprintln!("error: {e:#}");
                        ExitCode::FAILURE
                    }
                    Err(e) => {
                        eprintln!("error: the benchmark task failed: {e}");
                        ExitCode::FAILURE
                    }
                };
            }
            _ = int.recv() => ("SIGINT", 130),
            _ = term.recv() => ("SIGTERM", 143),
        };
        task.abort();
        let _ = task.await;
        eprintln!("{}: stopped every process and dropped the databases", interrupted.0);
        ExitCode::from(interrupted.1)
    })
}

/// Raises the soft open-files limit to the hard limit; returns the soft limit now in force.
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

fn log(msg: impl AsRef<str>) {
    eprintln!("[bench] {}", msg.as_ref());
}

// ---------------------------------------------------------------------------------------------
// Databases, processes, binaries

fn url_for(db: &str) -> String {
    let admin = admin_url();
    let (base, _) = admin.rsplit_once('/').expect("TEST_DATABASE_URL has a database path");
    let query = admin.split_once('?').map(|(_, q)| format!("?{q}")).unwrap_or_default();
    format!("{base}/{db}{query}")
}

async fn connect(url: &str) -> Result<tokio_postgres::Client> {
    let (client, conn) = tokio_postgres::connect(url, NoTls).await.with_context(|| format!("connecting to {url}"))?;
    tokio::spawn(conn);
    Ok(client)
}

/// A database of the benchmark, dropped (`WITH (FORCE)`) when the value is dropped.
struct Database {
    name: String,
    url: String,
}

impl Database {
    async fn create(prefix: &str) -> Result<Self> {
        let name = format!("{prefix}_{}", Uuid::new_v4().simple());
        let admin = connect(&admin_url()).await.context("TEST_DATABASE_URL must be a superuser that may CREATE DATABASE")?;
        // The guard exists before CREATE, so even a half-done creation is cleaned up.
        let db = Self { url: url_for(&name), name };
        admin.batch_execute(&format!("CREATE DATABASE {}", db.name)).await?;
        Ok(db)
    }
}

impl Drop for Database {
    fn drop(&mut self) {
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            rt.block_on(async move {
                if let Ok(admin) = connect(&admin_url()).await {
                    let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
                }
            });
        })
        .join();
    }
}

fn bin(name: &str) -> Result<PathBuf> {
    let path = bin_dir().join(name);
    ensure!(path.exists(), "{} is missing: run `cargo build --release --workspace` first", path.display());
    Ok(path)
}

fn log_dir() -> Result<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../test-output/bench-scheduler");
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn spawn_logged(name: &str, mut cmd: Command) -> Result<Proc> {
    let log = std::fs::File::create(log_dir()?.join(format!("{name}.log")))?;
    cmd.stdout(Stdio::from(log.try_clone()?)).stderr(Stdio::from(log)).stdin(Stdio::null());
    let child = cmd.spawn().with_context(|| format!("spawning {name}"))?;
    Ok(Proc { name: name.to_owned(), child })
}

/// Starts the mock model; returns its URL and process.
fn start_mock() -> Result<(String, Proc)> {
    let log = std::fs::File::create(log_dir()?.join("mock-model.log"))?;
    let mut child = Command::new(bin("mock-model")?)
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .stdin(Stdio::null())
        .spawn()
        .context("spawning mock-model")?;
    let stdout = child.stdout.take().context("mock stdout")?;
    let proc = Proc { name: "mock-model".into(), child };
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let url = line.trim().strip_prefix("MOCK_MODEL_URL=").context("mock-model did not print its URL")?.to_owned();
    Ok((url, proc))
}

struct Env {
    db: Database,
    mock_url: String,
    mock: Proc,
    key: String,
    principal: Uuid,
    args: Args,
    next_worker: usize,
}

impl Env {
    fn spawn_workers(&mut self, database_url: &str) -> Result<Vec<Proc>> {
        (0..self.args.workers)
            .map(|_| {
                let n = self.next_worker;
                self.next_worker += 1;
                let mut cmd = Command::new(bin("agentloop-worker")?);
                cmd.arg("run")
                    .env("DATABASE_URL", database_url)
                    .env("MODEL_BASE_URL", format!("{}/v1", self.mock_url))
                    .env("MODEL_NAME", "mock")
                    .env("WORKER_ID", format!("bench-w{n}"))
                    .env("WORKER_CONCURRENCY", self.args.concurrency.to_string())
                    .env("RUST_LOG", "warn");
                spawn_logged(&format!("worker-{n}"), cmd)
            })
            .collect()
    }

    fn spawn_api(&self, port: u16) -> Result<Proc> {
        let mut cmd = Command::new(bin("agentloop-api")?);
        cmd.arg("run")
            .env("DATABASE_URL", &self.db.url)
            .env("API_LISTEN", format!("127.0.0.1:{port}"))
            .env("MODEL_BASE_URL", format!("{}/v1", self.mock_url))
            .env("MODEL_NAME", "mock")
            .envs(agentloop_tests::GENEROUS_LIMITS.iter().copied())
            .env("API_WORKERS", "2")
            .env("RUST_LOG", "warn");
        spawn_logged("api", cmd)
    }
}

/// SIGTERM, then waits (up to 20 s) for every process to exit; they are SIGKILLed on drop
/// otherwise.
async fn stop(procs: &mut [Proc]) {
    for p in procs.iter() {
        p.signal(Sig::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    for p in procs.iter_mut() {
        while Instant::now() < deadline && !matches!(p.child.try_wait(), Ok(Some(_))) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn admin_verb(args: &[&str], database_url: &str) -> Result<String> {
    let out = tokio::process::Command::new(bin("agentloop-worker")?)
        .args(args)
        .env("DATABASE_URL", database_url)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .output()
        .await?;
    ensure!(out.status.success(), "agentloop-worker {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

// ---------------------------------------------------------------------------------------------
// Machine conditions

/// (busy, total) jiffies of all CPUs from /proc/stat.
fn machine_jiffies() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<u64> =
        stat.lines().next().unwrap_or_default().split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    let total: u64 = fields.iter().take(8).sum();
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (total.saturating_sub(idle), total)
}

/// CPU seconds (user + system) used so far by process `pid` (USER_HZ = 100).
fn process_cpu_secs(pid: i32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    (ticks(11) + ticks(12)) as f64 / 100.0
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn cpus() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// Server processes (backends) connected to database `db`.
async fn backend_pids(admin: &tokio_postgres::Client, db: &str) -> Result<Vec<i32>> {
    let rows = admin.query("SELECT pid FROM pg_stat_activity WHERE datname = $1", &[&db]).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// CPU use during a phase: the machine's busy cores, cores used by the listed processes, and by
/// the PostgreSQL backends of the benchmark database (a backend born during the phase counts
/// from zero; one that exited before the end is missed).
struct CpuWindow {
    start: Instant,
    machine: (u64, u64),
    procs: Vec<(String, i32, f64)>,
    backends: HashMap<i32, f64>,
}

impl CpuWindow {
    fn begin(procs: &[(&str, i32)], backends: &[i32]) -> Self {
        Self {
            start: Instant::now(),
            machine: machine_jiffies(),
            procs: procs.iter().map(|(n, pid)| ((*n).to_owned(), *pid, process_cpu_secs(*pid))).collect(),
            backends: backends.iter().map(|pid| (*pid, process_cpu_secs(*pid))).collect(),
        }
    }

    /// "machine 1.95 of 2 cores busy; cores used by workers 0.62, mock-model 0.11, PostgreSQL
    /// backends 0.9". `backends`: the backends of the benchmark database now.
    fn end(&self, backends: &[i32]) -> String {
        self.end_use(backends).text
    }

    /// [`Self::end`] with the cores the PostgreSQL backends used (CPU seconds / wall seconds).
    fn end_use(&self, backends: &[i32]) -> CpuUse {
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        let (busy, total) = machine_jiffies();
        let frac = (busy - self.machine.0) as f64 / ((total - self.machine.1) as f64).max(1.0);
        let mut by_name: Vec<(String, f64)> = Vec::new();
        for (name, pid, before) in &self.procs {
            let used = process_cpu_secs(*pid) - before;
            match by_name.iter_mut().find(|(n, _)| n == name) {
                Some((_, v)) => *v += used,
                None => by_name.push((name.clone(), used)),
            }
        }
        let server: f64 = backends.iter().map(|pid| process_cpu_secs(*pid) - self.backends.get(pid).copied().unwrap_or(0.0)).sum();
        by_name.push((format!("{} PostgreSQL backends", backends.len()), server));
        let parts: Vec<String> = by_name.iter().map(|(n, v)| format!("{n} {:.2}", v / secs)).collect();
        CpuUse {
            text: format!("machine {:.2} of {} cores busy; cores used by {}", frac * cpus() as f64, cpus(), parts.join(", ")),
            server_cores: server / secs,
        }
    }
}

/// What [`CpuWindow::end_use`] measured.
struct CpuUse {
    /// The line printed as "CPU: ...".
    text: String,
    /// Cores used by the benchmark database's PostgreSQL backends over the window.
    server_cores: f64,
}

impl CpuUse {
    /// PostgreSQL CPU per unit of work in ms: backend cores / units per second.
    fn server_ms_per(&self, per_second: f64) -> f64 {
        self.server_cores * 1000.0 / per_second
    }
}

// ---------------------------------------------------------------------------------------------
// Enqueue, polls, statistics

async fn enqueue(db_url: &str, principal: Uuid, runs: u32, batch: u32, notify: bool) -> Result<Duration> {
    let client = connect(db_url).await?;
    let started = Instant::now();
    let stmt = client.prepare(ENQUEUE_SQL).await?;
    let mut left = runs;
    while left > 0 {
        let k = left.min(batch.max(1));
        client.execute(&stmt, &[&principal, &(k as i32), &USER_TEXT]).await?;
        left -= k;
    }
    if notify {
        // Idle workers sleep on LISTEN: any `agentloop_runs` payload but `cancel:` triggers a claim pass.
        client.batch_execute("SELECT pg_notify('agentloop_runs', 'queued:bulk')").await?;
    }
    Ok(started.elapsed())
}

/// Polls every 200 ms until no run is left that is not terminal; fails if a worker exits or
/// nothing progresses for 120 s. Returns the number of polls issued.
async fn wait_all_terminal(poller: &tokio_postgres::Client, workers: &mut [Proc], total: u32) -> Result<u64> {
    let poll = poller.prepare(TERMINAL_SQL).await?;
    let mut polls = 1u64; // the preparation is a transaction of its own too
    let mut last = (i64::MAX, Instant::now());
    let mut reported = Instant::now();
    loop {
        let left: i64 = poller.query_one(&poll, &[]).await?.get(0);
        polls += 1;
        if left == 0 {
            return Ok(polls);
        }
        if left < last.0 {
            last = (left, Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(120) {
            bail!("{left} runs made no progress for 120 s");
        }
        for w in workers.iter_mut() {
            if let Ok(Some(status)) = w.child.try_wait() {
                bail!("{} exited ({status}); see test-output/bench-scheduler/{}.log", w.name, w.name);
            }
        }
        if reported.elapsed() > Duration::from_secs(5) {
            log(format!("  {} of {total} runs done", i64::from(total) - left));
            reported = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `(xact_commit, xact_rollback)` of database `db`, read by the admin connection (another
/// database, so the read itself is not counted).
async fn xacts(admin: &tokio_postgres::Client, db: &str) -> Result<(i64, i64)> {
    admin.batch_execute("SELECT pg_stat_clear_snapshot()").await?;
    let row = admin.query_one("SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = $1", &[&db]).await?;
    Ok((row.get(0), row.get(1)))
}

/// Whether `pg_stat_statements` works in `db` (it needs `shared_preload_libraries`).
async fn pg_stat_statements_available(client: &tokio_postgres::Client) -> bool {
    client.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").await.is_ok()
        && client.query_one("SELECT count(*) FROM pg_stat_statements", &[]).await.is_ok()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// "p50 1.23 ms, p99 4.56 ms, max 7.89 ms (n=1000)".
fn dist(mut values: Vec<f64>) -> String {
    values.sort_by(|a, b| a.total_cmp(b));
    if values.is_empty() {
        return "no samples".into();
    }
    format!(
        "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms (n={})",
        percentile(&values, 50.0),
        percentile(&values, 99.0),
        values[values.len() - 1],
        values.len()
    )
}

// ---------------------------------------------------------------------------------------------
// pgbench

fn pgbench_path() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("PGBENCH") {
        return Ok(PathBuf::from(p));
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let version = e.file_name().to_string_lossy().parse::<u32>().ok()?;
                    let path = e.path().join("bin/pgbench");
                    path.exists().then_some((version, path))
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    match found.pop() {
        Some((_, p)) => Ok(p),
        None => Ok(PathBuf::from("pgbench")),
    }
}

async fn pgbench_init(pgbench: &Path, url: &str, scale: u32) -> Result<()> {
    let out = tokio::process::Command::new(pgbench)
        .args(["-i", "-q", "-s", &scale.to_string(), url])
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("running {}", pgbench.display()))?;
    ensure!(out.status.success(), "pgbench -i failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

/// `pgbench -N` on `db` for `seconds`: (TPS, PostgreSQL CPU ms per transaction).
async fn pgbench_tps(pgbench: &Path, db: &Database, clients: u32, seconds: u32) -> Result<(f64, f64)> {
    let (tps, cpu) = run_pgbench(pgbench, db, &["-N".into()], clients, seconds).await?;
    Ok((tps, cpu.server_ms_per(tps)))
}

/// Runs pgbench with `args` (workload options) on `db` at `clients` clients for `seconds`:
/// its TPS and the CPU split (pgbench and the database's backends) over the middle of the run,
/// from 0.5 s after the start to 1.5 s before the end, while pgbench and its backends are alive.
async fn run_pgbench(pgbench: &Path, db: &Database, args: &[std::ffi::OsString], clients: u32, seconds: u32) -> Result<(f64, CpuUse)> {
    let threads = (cpus() as u32).clamp(1, clients.max(1));
    let admin = connect(&admin_url()).await?;
    let child = tokio::process::Command::new(pgbench)
        .args(args)
        .args(["-c", &clients.to_string(), "-j", &threads.to_string(), "-T", &seconds.to_string(), &db.url])
        .kill_on_drop(true)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {}", pgbench.display()))?;
    let window = Duration::from_secs(u64::from(seconds)).saturating_sub(Duration::from_millis(1500)).max(Duration::from_millis(500));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let backends = backend_pids(&admin, &db.name).await?;
    let cpu = CpuWindow::begin(&[("pgbench", child.id().map_or(0, |p| p as i32))], &backends);
    tokio::time::sleep(window).await;
    let cpu = cpu.end_use(&backends);
    let out = child.wait_with_output().await?;
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(out.status.success(), "pgbench {args:?} failed: {text}{}", String::from_utf8_lossy(&out.stderr));
    let tps: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("tps = ").and_then(|r| r.split_whitespace().next()).and_then(|v| v.parse().ok()))
        .ok_or_else(|| anyhow!("no `tps = ` line in pgbench output: {text}"))?;
    Ok((tps, cpu))
}

// ---------------------------------------------------------------------------------------------
// Statement counting proxy

/// Statements seen by the proxy (frontend messages only; the backend stream is copied as is).
#[derive(Debug, Clone, Default)]
struct Wire {
    /// Executed statements by normalized text (Execute of a portal, or each `;`-separated part
    /// of a simple Query).
    statements: HashMap<String, u64>,
    /// Parse messages (statement preparations).
    parses: u64,
    /// Sync + simple Query messages: one client-server round trip each.
    round_trips: u64,
    /// Logical transactions: `BEGIN` blocks, plus each statement executed outside one.
    transactions: u64,
}

impl Wire {
    fn executed(&self) -> u64 {
        self.statements.values().sum()
    }

    fn minus(&self, before: &Wire) -> Wire {
        let statements = self
            .statements
            .iter()
            .map(|(k, v)| (k.clone(), v - before.statements.get(k).copied().unwrap_or(0)))
            .filter(|(_, v)| *v > 0)
            .collect();
        Wire {
            statements,
            parses: self.parses - before.parses,
            round_trips: self.round_trips - before.round_trips,
            transactions: self.transactions - before.transactions,
        }
    }
}

/// Incremental parser of one connection's frontend messages.
#[derive(Default)]
struct FrontendParser {
    buf: Vec<u8>,
    started: bool,
    broken: bool,
    in_block: bool,
    prepared: HashMap<String, String>,
    portals: HashMap<String, String>,
}

fn cstr(body: &[u8], at: &mut usize) -> String {
    let rest = body.get(*at..).unwrap_or_default();
    let end = rest.iter().position(|b| *b == 0).unwrap_or(rest.len());
    *at += end + 1;
    String::from_utf8_lossy(&rest[..end]).into_owned()
}

fn normalize(sql: &str) -> String {
    sql.split_whitespace().collect::<Vec<_>>().join(" ")
}

impl FrontendParser {
    fn feed(&mut self, bytes: &[u8], wire: &Mutex<Wire>) {
        if self.broken {
            return;
        }
        self.buf.extend_from_slice(bytes);
        let mut pos = 0;
        loop {
            let rest = &self.buf[pos..];
            if !self.started {
                // Startup phase: untyped messages (SSLRequest/GSSENCRequest, then StartupMessage).
                if rest.len() < 8 {
                    break;
                }
                let len = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
                if len < 8 {
                    self.broken = true;
                    break;
                }
                if rest.len() < len {
                    break;
                }
                let code = u32::from_be_bytes([rest[4], rest[5], rest[6], rest[7]]);
                if code != 80_877_103 && code != 80_877_104 {
                    self.started = true;
                }
                pos += len;
            } else {
                if rest.len() < 5 {
                    break;
                }
                let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
                if len < 4 {
                    self.broken = true;
                    break;
                }
                if rest.len() < 1 + len {
                    break;
                }
                let kind = rest[0];
                let body = rest[5..1 + len].to_vec();
                pos += 1 + len;
                self.message(kind, &body, wire);
            }
        }
        self.buf.drain(..pos);
    }

    fn message(&mut self, kind: u8, body: &[u8], wire: &Mutex<Wire>) {
        let mut at = 0;
        let mut wire = wire.lock().expect("wire lock");
        match kind {
            b'Q' => {
                wire.round_trips += 1;
                for part in cstr(body, &mut at).split(';').map(str::trim).filter(|p| !p.is_empty()) {
                    let query = normalize(part);
                    self.count(&mut wire, query);
                }
            }
            b'P' => {
                let name = cstr(body, &mut at);
                let query = cstr(body, &mut at);
                self.prepared.insert(name, normalize(&query));
                wire.parses += 1;
            }
            b'B' => {
                let portal = cstr(body, &mut at);
                let statement = cstr(body, &mut at);
                let query = self.prepared.get(&statement).cloned().unwrap_or_else(|| "<unknown statement>".into());
                self.portals.insert(portal, query);
            }
            b'E' => {
                let portal = cstr(body, &mut at);
                let query = self.portals.get(&portal).cloned().unwrap_or_else(|| "<unknown portal>".into());
                self.count(&mut wire, query);
            }
            b'S' => wire.round_trips += 1,
            _ => {}
        }
    }

    /// Counts one executed statement and tracks transaction blocks.
    fn count(&mut self, wire: &mut Wire, query: String) {
        let upper = query.to_ascii_uppercase();
        let word = upper.split_whitespace().next().unwrap_or_default();
        match word {
            "BEGIN" | "START" => {
                self.in_block = true;
                wire.transactions += 1;
            }
            "COMMIT" | "END" | "ABORT" => self.in_block = false,
            "ROLLBACK" if !upper.starts_with("ROLLBACK TO") => self.in_block = false,
            _ if !self.in_block => wire.transactions += 1,
            _ => {}
        }
        *wire.statements.entry(query).or_default() += 1;
    }
}

async fn relay(client: tokio::net::TcpStream, upstream: String, wire: Arc<Mutex<Wire>>) -> std::io::Result<()> {
    let server = tokio::net::TcpStream::connect(&upstream).await?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let down = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
        let _ = client_write.shutdown().await;
    });
    let mut parser = FrontendParser::default();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = client_read.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        server_write.write_all(&buf[..n]).await?;
        parser.feed(&buf[..n], &wire);
    }
    let _ = server_write.shutdown().await;
    let _ = down.await;
    Ok(())
}

/// Starts the counting proxy in front of the admin URL's server; returns a libpq key/value
/// connection string for database `db` through it (TLS off, so the stream stays readable).
async fn start_proxy(db: &str, wire: Arc<Mutex<Wire>>) -> Result<Option<(String, tokio::task::JoinHandle<()>)>> {
    let config: tokio_postgres::Config = admin_url().parse()?;
    let Some(tokio_postgres::config::Host::Tcp(host)) = config.get_hosts().first().cloned() else {
        return Ok(None);
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let upstream = format!("{host}:{port}");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else { continue };
            tokio::spawn(relay(client, upstream.clone(), wire.clone()));
        }
    });
    let quote = |v: &str| format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'"));
    let mut conninfo = format!("host=127.0.0.1 port={} dbname={} sslmode=disable", local.port(), quote(db));
    if let Some(user) = config.get_user() {
        conninfo.push_str(&format!(" user={}", quote(user)));
    }
    if let Some(password) = config.get_password() {
        conninfo.push_str(&format!(" password={}", quote(&String::from_utf8_lossy(password))));
    }
    Ok(Some((conninfo, task)))
}

// ---------------------------------------------------------------------------------------------
// Phases

struct Throughput {
    runs: u32,
    wall: Duration,
    db_secs: f64,
    outcome: String,
    failures: Vec<String>,
    assistant_messages: i64,
    xact_commit: i64,
    xact_rollback: i64,
    polls: u64,
    pgss: Option<(i64, Vec<(String, i64)>)>,
    /// Plannings and planning time (ms) over phase 1, nested statements included, when
    /// `pg_stat_statements.track_planning` is on.
    planning: Option<(i64, f64)>,
    cpu: CpuUse,
    enqueue: Duration,
}

async fn throughput_phase(env: &mut Env) -> Result<Throughput> {
    let runs = env.args.runs;
    log(format!("enqueueing {runs} runs with SQL (batches of {})", env.args.batch));
    let enqueue_took = enqueue(&env.db.url, env.principal, runs, env.args.batch, false).await?;
    {
        let c = connect(&env.db.url).await?;
        c.batch_execute("ANALYZE").await?;
    }
    let admin = connect(&admin_url()).await?;
    let pgss = {
        let c = connect(&env.db.url).await?;
        let available = pg_stat_statements_available(&c).await;
        if available {
            c.batch_execute("SELECT pg_stat_statements_reset()").await?;
        }
        available
    };
    tokio::time::sleep(Duration::from_millis(500)).await; // backends above exit and flush their stats
    let before = xacts(&admin, &env.db.name).await?;

    log(format!(
        "throughput: starting {} workers x {} slots at once; polling every 200 ms",
        env.args.workers, env.args.concurrency
    ));
    let started = Instant::now();
    let mut workers = env.spawn_workers(&env.db.url.clone())?;
    let mut watched: Vec<(&str, i32)> = workers.iter().map(|w| ("workers", w.pid())).collect();
    watched.push(("mock-model", env.mock.pid()));
    let cpu = CpuWindow::begin(&watched, &[]);
    let poller = connect(&env.db.url).await?;
    let polls = wait_all_terminal(&poller, &mut workers, runs).await?;
    let wall = started.elapsed();
    let cpu = cpu.end_use(&backend_pids(&admin, &env.db.name).await?);
    drop(poller);
    stop(&mut workers).await;
    drop(workers);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = xacts(&admin, &env.db.name).await?;

    let c = connect(&env.db.url).await?;
    let row = c
        .query_one(
            "SELECT (extract(epoch from max(finished_at) - min(started_at)))::float8,
                    count(*) FILTER (WHERE status = 'completed'),
                    count(*) FILTER (WHERE status = 'failed'),
                    count(*) FILTER (WHERE status = 'cancelled')
             FROM runs",
            &[],
        )
        .await?;
    let db_secs: f64 = row.get::<_, Option<f64>>(0).unwrap_or(f64::NAN);
    let (completed, failed, cancelled): (i64, i64, i64) = (row.get(1), row.get(2), row.get(3));
    let failures = c
        .query(
            "SELECT coalesce(error_code, '?'), left(coalesce(min(error_message), ''), 160), count(*) FROM runs
             WHERE status <> 'completed' GROUP BY 1 ORDER BY 3 DESC LIMIT 10",
            &[],
        )
        .await?
        .iter()
        .map(|r| format!("{} x {}: {}", r.get::<_, i64>(2), r.get::<_, String>(0), r.get::<_, String>(1)))
        .collect();
    let assistant_messages: i64 = c.query_one("SELECT count(*) FROM messages WHERE role = 'assistant'", &[]).await?.get(0);
    let pgss = if pgss {
        let rows = c
            .query(
                "SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 110), calls FROM pg_stat_statements
                 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                   AND query NOT LIKE '%pg_stat_statements%' AND query NOT LIKE 'SELECT count(*) FROM runs WHERE status NOT IN%'
                 ORDER BY calls DESC",
                &[],
            )
            .await?;
        let list: Vec<(String, i64)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        Some((list.iter().map(|(_, c)| c).sum(), list))
    } else {
        None
    };
    let planning = if pgss.is_some() && c.query_one("SHOW pg_stat_statements.track_planning", &[]).await?.get::<_, String>(0) == "on" {
        let row = c
            .query_one(
                "SELECT coalesce(sum(plans), 0)::int8, coalesce(sum(total_plan_time), 0)::float8 FROM pg_stat_statements
                 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
                &[],
            )
            .await?;
        Some((row.get(0), row.get(1)))
    } else {
        None
    };
    Ok(Throughput {
        runs,
        wall,
        db_secs,
        outcome: format!("{completed} completed, {failed} failed, {cancelled} cancelled"),
        failures,
        assistant_messages,
        xact_commit: after.0 - before.0,
        xact_rollback: after.1 - before.1,
        polls,
        pgss,
        planning,
        cpu,
        enqueue: enqueue_took,
    })
}

/// The SQL of one run as the workers send it for a one-slice run with a final answer (claim
/// without slice starts, no flush behind it; slice start and commit, each followed by the
/// notification flush), as a pgbench script: one pgbench transaction = one run.
const STEP_PROTOCOL_SCRIPT: &str = r#"SELECT r ->> 'id' AS run, r ->> 'threadId' AS thread, r ->> 'leaseEpoch' AS epoch, (r ->> 'stepsUsed')::int + 1 AS stepseq FROM (SELECT agentloop_claim(jsonb_build_object('owner', 'floor-' || :client_id, 'leaseMs', 15000, 'limit', 1, 'inflight', '[]'::jsonb, 'adopt', false, 'start', NULL)) -> 'runs' -> 0 AS r OFFSET 0) s \gset
SELECT (s -> 'step' ->> 'id') AS stepid FROM (SELECT agentloop_slice_start(agentloop_defer(jsonb_build_object('runId', ':run', 'threadId', ':thread', 'owner', 'floor-' || :client_id, 'epoch', :epoch, 'leaseMs', 15000, 'stepSequence', :stepseq, 'model', 'mock', 'toolTokens', 0, 'contextLimit', 32768))) AS s OFFSET 0) x \gset
SELECT agentloop_flush_notify();
SELECT agentloop_commit(agentloop_defer(jsonb_build_object('runId', ':run', 'threadId', ':thread', 'owner', 'floor-' || :client_id, 'epoch', :epoch, 'leaseMs', 15000, 'commitId', gen_random_uuid(), 'stepId', :stepid, 'messages', jsonb_build_array(jsonb_build_object('role', 'assistant', 'content', 'You said: hello from the scheduler benchmark', 'tokenEstimate', 12, 'byteSize', 46)), 'usage', jsonb_build_object('modelCalls', 1, 'promptTokens', 12, 'completionTokens', 12), 'end', jsonb_build_object('status', 'completed'))));
SELECT agentloop_flush_notify();
"#;

/// Phase 2b: the step protocol alone.
struct Floor {
    /// Runs completed per second by pgbench driving [`STEP_PROTOCOL_SCRIPT`].
    rps: f64,
    completed: i64,
    seconds: u32,
    cpu: CpuUse,
}

/// Runs [`STEP_PROTOCOL_SCRIPT`] with pgbench (`clients` clients, `seconds` s) on a database of
/// its own, migrated and filled like phase 1's (enough queued runs for `expected_rps` x 3):
/// the database's cost of a run with no worker process, no mock model and no Rust code.
async fn floor_phase(env: &Env, pgbench: &Path, clients: u32, seconds: u32, expected_rps: f64) -> Result<Floor> {
    let db = Database::create("bench_floor").await?;
    admin_verb(&["migrate"], &db.url).await?;
    admin_verb(&["create-key", "--principal", "bench"], &db.url).await?;
    let principal: Uuid = connect(&db.url).await?.query_one("SELECT id FROM principals WHERE name = 'bench'", &[]).await?.get(0);
    let runs = ((expected_rps.max(500.0) * 3.0 * f64::from(seconds)) as u32).clamp(5_000, 500_000);
    log(format!("step protocol alone: {runs} queued runs, pgbench -f (same SQL as the workers) -c {clients} -T {seconds}"));
    enqueue(&db.url, principal, runs, env.args.batch, false).await?;
    connect(&db.url).await?.batch_execute("VACUUM ANALYZE").await?;
    let script = log_dir()?.join("step-protocol.pgbench");
    std::fs::write(&script, STEP_PROTOCOL_SCRIPT)?;
    let (rps, cpu) = run_pgbench(pgbench, &db, &["-n".into(), "-f".into(), script.into_os_string()], clients, seconds).await?;
    // Every script run must have completed a run with its answer: the figure counts real runs.
    let c = connect(&db.url).await?;
    let row = c
        .query_one(
            "SELECT count(*) FILTER (WHERE status = 'completed'),
                    (SELECT count(*) FROM messages WHERE role = 'assistant')
             FROM runs",
            &[],
        )
        .await?;
    let (completed, answers): (i64, i64) = (row.get(0), row.get(1));
    ensure!(completed > 0 && completed == answers, "step protocol: {completed} runs completed, {answers} answers");
    Ok(Floor { rps, completed, seconds, cpu })
}

struct Latency {
    runs: usize,
    claim_ms: Vec<f64>,
    step_ms: Vec<f64>,
    post_ms: Vec<f64>,
    seen_running_ms: Vec<f64>,
    not_completed: usize,
    cpu: String,
}

async fn wait_api(http: &reqwest::Client, url: &str, api: &mut Proc) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = http.get(format!("{url}/readyz")).send().await
            && r.status().is_success()
        {
            return Ok(());
        }
        if let Ok(Some(status)) = api.child.try_wait() {
            bail!("the api exited ({status}); see test-output/bench-scheduler/api.log");
        }
        ensure!(Instant::now() < deadline, "the api was not ready within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn latency_phase(env: &mut Env) -> Result<Latency> {
    let n = env.args.latency_runs as usize;
    let port = free_port();
    let mut api = env.spawn_api(port)?;
    let api_url = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    wait_api(&http, &api_url, &mut api).await?;
    let mut workers = env.spawn_workers(&env.db.url.clone())?;
    tokio::time::sleep(Duration::from_secs(2)).await; // workers start, claim nothing, block on LISTEN
    log(format!("latency: {n} single runs through the API, one at a time, idle workers"));
    let mut watched: Vec<(&str, i32)> = workers.iter().map(|w| ("workers", w.pid())).collect();
    watched.push(("api", api.pid()));
    watched.push(("mock-model", env.mock.pid()));
    let admin = connect(&admin_url()).await?;
    let cpu = CpuWindow::begin(&watched, &backend_pids(&admin, &env.db.name).await?);
    let key = env.key.clone();
    let mut post_ms = Vec::with_capacity(n);
    let mut seen_running_ms = Vec::with_capacity(n);
    let mut run_ids = Vec::with_capacity(n);
    let mut not_completed = 0;
    for i in 0..n {
        for w in workers.iter_mut().chain(std::iter::once(&mut api)) {
            if let Ok(Some(status)) = w.child.try_wait() {
                bail!("{} exited ({status}); see test-output/bench-scheduler/{}.log", w.name, w.name);
            }
        }
        let r = http.post(format!("{api_url}/api/threads")).bearer_auth(&key).json(&json!({"title": "bench"})).send().await?;
        ensure!(r.status().as_u16() == 201, "create thread: {}", r.status());
        let thread: Value = r.json().await?;
        let thread = thread["id"].as_str().context("thread id")?.to_owned();
        let stream = http
            .get(format!("{api_url}/api/threads/{thread}/updates/stream?afterSequence=0"))
            .bearer_auth(&key)
            .send()
            .await?;
        ensure!(stream.status().is_success(), "SSE: {}", stream.status());
        let mut events = stream.bytes_stream().eventsource();
        tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(ev) = events.next().await {
                if ev.map_err(|e| anyhow!("SSE: {e}"))?.event == "connected" {
                    return Ok(());
                }
            }
            bail!("SSE stream ended before `connected`")
        })
        .await
        .context("no SSE `connected` within 10 s")??;

        let t0 = Instant::now();
        let r = http
            .post(format!("{api_url}/api/threads/{thread}/chat"))
            .bearer_auth(&key)
            .json(&json!({"content": USER_TEXT}))
            .send()
            .await?;
        let status = r.status();
        let body: Value = r.json().await?;
        post_ms.push(t0.elapsed().as_secs_f64() * 1000.0);
        ensure!(status.as_u16() == 202, "chat: {status} {body}");
        let run_id = body["run"]["id"].as_str().context("run id")?.to_owned();
        let mut running_at: Option<Duration> = None;
        let end = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(ev) = events.next().await {
                let ev = ev.map_err(|e| anyhow!("SSE: {e}"))?;
                if ev.event != "run" {
                    continue;
                }
                let run: Value = serde_json::from_str(&ev.data)?;
                if run["id"].as_str() != Some(run_id.as_str()) {
                    continue;
                }
                let status = run["status"].as_str().unwrap_or_default().to_owned();
                if status != "queued" && running_at.is_none() {
                    running_at = Some(t0.elapsed());
                }
                if matches!(status.as_str(), "completed" | "failed" | "cancelled") {
                    return Ok(status);
                }
            }
            bail!("SSE stream ended before the run ended")
        })
        .await
        .with_context(|| format!("run {run_id} did not end within 30 s"))??;
        if end != "completed" {
            not_completed += 1;
        }
        if let Some(t) = running_at {
            seen_running_ms.push(t.as_secs_f64() * 1000.0);
        }
        run_ids.push(Uuid::parse_str(&run_id)?);
        drop(events);
        // Let the worker finish its post-slice claim pass: the next run meets idle workers.
        tokio::time::sleep(Duration::from_millis(20)).await;
        if (i + 1) % 200 == 0 {
            log(format!("  {} of {n} single runs done", i + 1));
        }
    }
    let cpu = cpu.end(&backend_pids(&admin, &env.db.name).await?);
    stop(&mut workers).await;
    stop(std::slice::from_mut(&mut api)).await;

    let c = connect(&env.db.url).await?;
    let rows = c
        .query(
            "SELECT (extract(epoch from r.started_at - r.created_at) * 1000)::float8,
                    (extract(epoch from s.started_at - r.created_at) * 1000)::float8
             FROM runs r JOIN run_steps s ON s.run_id = r.id AND s.sequence = 1
             WHERE r.id = ANY($1)",
            &[&run_ids],
        )
        .await?;
    Ok(Latency {
        runs: n,
        claim_ms: rows.iter().map(|r| r.get(0)).collect(),
        step_ms: rows.iter().map(|r| r.get(1)).collect(),
        post_ms,
        seen_running_ms,
        not_completed,
        cpu,
    })
}

struct Statements {
    runs: u32,
    secs: f64,
    wire: Wire,
    outcome: String,
}

async fn statement_phase(env: &mut Env) -> Result<Option<Statements>> {
    let runs = env.args.statement_runs;
    let wire = Arc::new(Mutex::new(Wire::default()));
    let Some((proxied_url, proxy)) = start_proxy(&env.db.name, wire.clone()).await? else {
        log("statement count skipped: TEST_DATABASE_URL is not a TCP address");
        return Ok(None);
    };
    log(format!("statements: {runs} runs through the counting proxy"));
    let mut workers = env.spawn_workers(&proxied_url)?;
    tokio::time::sleep(Duration::from_secs(2)).await; // start-up statements happen before the baseline
    for w in workers.iter_mut() {
        if let Ok(Some(status)) = w.child.try_wait() {
            bail!("{} exited through the proxy ({status}); see test-output/bench-scheduler/{}.log", w.name, w.name);
        }
    }
    let before = wire.lock().expect("wire lock").clone();
    let started = Instant::now();
    let poller = connect(&env.db.url).await?;
    let _ = enqueue(&env.db.url, env.principal, runs, env.args.batch, true).await?;
    wait_all_terminal(&poller, &mut workers, runs).await?;
    let secs = started.elapsed().as_secs_f64();
    let delta = wire.lock().expect("wire lock").minus(&before);
    stop(&mut workers).await;
    proxy.abort();
    let row = poller
        .query_one(
            "SELECT count(*) FILTER (WHERE status = 'completed'), count(*) FILTER (WHERE status <> 'completed') FROM runs
             WHERE id IN (SELECT id FROM runs ORDER BY seq DESC LIMIT $1)",
            &[&i64::from(runs)],
        )
        .await?;
    Ok(Some(Statements {
        runs,
        secs,
        wire: delta,
        outcome: format!("{} completed, {} not completed", row.get::<_, i64>(0), row.get::<_, i64>(1)),
    }))
}

// ---------------------------------------------------------------------------------------------
// Concurrency phase: many concurrent streaming runs on ONE worker

/// The answer of every streaming run: `stream_chunks` chunks of [`MOCK_WORDS_PER_CHUNK`] words,
/// each word naming its chunk (`c0007.0 c0007.1 c0007.2 c0008.0 ...`), so the last word of any
/// partial tells which chunk it reaches.
fn stream_text(chunks: u32) -> String {
    (0..chunks)
        .flat_map(|c| (0..MOCK_WORDS_PER_CHUNK).map(move |j| format!("c{c:04}.{j}")))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The highest chunk whose words are all in `partial` (`None`: not even chunk 0).
fn chunk_reached(partial: &str) -> Option<u32> {
    let last = partial.split_whitespace().last()?;
    let (c, j) = last.strip_prefix('c')?.split_once('.')?;
    let (c, j): (u32, usize) = (c.parse().ok()?, j.parse().ok()?);
    if j + 1 == MOCK_WORDS_PER_CHUNK { Some(c) } else { c.checked_sub(1) }
}

/// Truncates `s` to its first `units` UTF-16 code units.
fn truncate_utf16(s: &mut String, units: usize) {
    let mut seen = 0;
    for (at, c) in s.char_indices() {
        if seen >= units {
            s.truncate(at);
            return;
        }
        seen += c.len_utf16();
    }
}

/// What one SSE client of a streaming thread saw.
#[derive(Default)]
struct Watch {
    /// Receive time (ms since the phase's base instant) at which each chunk was first complete.
    chunk_at: Vec<Option<f64>>,
    /// Per `streaming` event: receive time and the newest chunk the partial then reached.
    newest: Vec<(f64, u32)>,
    /// Chunks first seen in the final `message` event (never streamed to this client).
    via_message: u64,
    deltas: u64,
    /// `offset` > length of the partial: text missed.
    gaps: u64,
    /// 0 < `offset` < length of the partial: text sent twice.
    overlaps: u64,
    /// `offset` 0 on a non-empty partial (a new model call of the run).
    restarts: u64,
    resets: u64,
    /// The partial when the run ended.
    partial: String,
    /// Content of the assistant message event.
    message: Option<String>,
    status: Option<String>,
    error: Option<String>,
}

/// One SSE client of `thread`: signals `ready` after `connected`, then applies events until the
/// run ended and its message arrived, or `stop`.
async fn watch_thread(
    http: reqwest::Client,
    url: String,
    key: String,
    chunks: u32,
    base: Instant,
    ready: tokio::sync::oneshot::Sender<Result<()>>,
    stop: tokio_util::sync::CancellationToken,
) -> Watch {
    let mut w = Watch { chunk_at: vec![None; chunks as usize], ..Watch::default() };
    let opened = async {
        let r = http.get(&url).bearer_auth(&key).send().await?;
        ensure!(r.status().is_success(), "SSE: {}", r.status());
        let mut events = r.bytes_stream().eventsource();
        while let Some(ev) = events.next().await {
            if ev.map_err(|e| anyhow!("SSE: {e}"))?.event == "connected" {
                return Ok(events);
            }
        }
        bail!("SSE stream ended before `connected`")
    };
    let mut events = match tokio::time::timeout(Duration::from_secs(30), opened).await {
        Ok(Ok(events)) => {
            let _ = ready.send(Ok(()));
            events
        }
        Ok(Err(e)) => {
            let _ = ready.send(Err(anyhow!("{e:#}")));
            return w;
        }
        Err(_) => {
            let _ = ready.send(Err(anyhow!("no SSE `connected` within 30 s")));
            return w;
        }
    };
    let ms = |at: Instant| at.duration_since(base).as_secs_f64() * 1000.0;
    let mut units = 0usize;
    let mut reached: Option<u32> = None;
    loop {
        let ev = tokio::select! {
            ev = events.next() => ev,
            _ = stop.cancelled() => break,
        };
        let now = Instant::now();
        let ev = match ev {
            Some(Ok(ev)) => ev,
            Some(Err(e)) => {
                w.error = Some(format!("SSE: {e}"));
                break;
            }
            None => {
                w.error = Some("SSE stream ended".into());
                break;
            }
        };
        let data: Value = serde_json::from_str(&ev.data).unwrap_or(Value::Null);
        match ev.event.as_str() {
            "streaming" => {
                let (Some(offset), Some(delta)) = (data["offset"].as_u64(), data["delta"].as_str()) else { continue };
                let offset = offset as usize;
                w.deltas += 1;
                if offset == 0 {
                    if units > 0 {
                        w.restarts += 1;
                    }
                    w.partial.clear();
                    units = 0;
                } else if offset > units {
                    w.gaps += 1;
                } else if offset < units {
                    w.overlaps += 1;
                    truncate_utf16(&mut w.partial, offset);
                    units = offset;
                }
                w.partial.push_str(delta);
                units += delta.encode_utf16().count();
                if let Some(r) = chunk_reached(&w.partial) {
                    let from = reached.map_or(0, |p| p + 1);
                    for i in from..=r.min(chunks.saturating_sub(1)) {
                        w.chunk_at[i as usize].get_or_insert(ms(now));
                    }
                    reached = Some(reached.map_or(r, |p| p.max(r)));
                    w.newest.push((ms(now), r));
                }
            }
            "message" if data["role"].as_str() == Some("assistant") => {
                let content = data["content"].as_str().map(str::to_owned).unwrap_or_else(|| data["content"].to_string());
                // The committed answer delivers whatever the flusher had not streamed yet.
                if let Some(r) = chunk_reached(&content) {
                    for at in w.chunk_at.iter_mut().take(r as usize + 1).filter(|at| at.is_none()) {
                        *at = Some(ms(now));
                        w.via_message += 1;
                    }
                }
                w.message = Some(content);
            }
            "run" => {
                if let Some(s) = data["status"].as_str() {
                    w.status = Some(s.to_owned());
                }
            }
            "reset" => w.resets += 1,
            _ => {}
        }
        if w.message.is_some() && matches!(w.status.as_deref(), Some("completed" | "failed" | "cancelled")) {
            break;
        }
    }
    w
}

/// `VmRSS` and `VmHWM` of `pid`, in KiB.
fn rss_kib(pid: i32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// What the 100 ms sampler saw during the phase.
#[derive(Default, Clone)]
struct Samples {
    samples: u64,
    peak_rss_kib: u64,
    max_worker_connections: i64,
    max_api_connections: i64,
    /// Most worker connections by state at the sample with the most worker connections.
    busiest: String,
}

/// Samples the worker's RSS and the connections of the benchmark database every 100 ms (on the
/// admin connection, another database, so the samples are not counted as its transactions).
async fn sample(admin: tokio_postgres::Client, db: String, worker_pid: i32, stop: tokio_util::sync::CancellationToken) -> Samples {
    let mut s = Samples::default();
    let Ok(stmt) = admin
        .prepare(
            "SELECT count(*) FILTER (WHERE application_name LIKE 'agentloop-worker%'),
                    count(*) FILTER (WHERE application_name LIKE 'agentloop-api%'),
                    coalesce(string_agg(DISTINCT state, ',') FILTER (WHERE application_name LIKE 'agentloop-worker%'), '')
             FROM pg_stat_activity WHERE datname = $1",
        )
        .await
    else {
        return s;
    };
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return s,
        }
        s.samples += 1;
        s.peak_rss_kib = s.peak_rss_kib.max(rss_kib(worker_pid).0);
        if let Ok(row) = admin.query_one(&stmt, &[&db]).await {
            let (worker, api): (i64, i64) = (row.get(0), row.get(1));
            if worker > s.max_worker_connections {
                s.max_worker_connections = worker;
                s.busiest = row.get(2);
            }
            s.max_api_connections = s.max_api_connections.max(api);
        }
    }
}

struct Concurrency {
    streams: u32,
    chunks: u32,
    interval_ms: u64,
    pool: u32,
    nofile: u64,
    enqueue: Duration,
    /// Worker spawn -> every run terminal (or the deadline).
    wall: Duration,
    worker_exit: Option<String>,
    not_terminal: i64,
    completed: i64,
    failed: i64,
    cancelled: i64,
    failures: Vec<String>,
    reclaimed: i64,
    /// First claim -> last finish, and first claim -> last claim (database clock).
    window_secs: f64,
    claim_spread_secs: f64,
    /// Per run: finished_at - started_at, ms.
    run_ms: Vec<f64>,
    messages_ok: i64,
    messages_total: i64,
    samples: Samples,
    hwm_kib: u64,
    rss_end_kib: u64,
    xacts: (i64, i64),
    polls: u64,
    wal_bytes: f64,
    cpu: String,
    watchers: Vec<Watch>,
    watcher_errors: Vec<String>,
    text: String,
    warn_lines: Vec<String>,
    warn_count: usize,
    /// Selected lines of the worker's Prometheus endpoint, read when the last run ended.
    metrics: Vec<String>,
    /// Start of each flush transaction (distinct created_at of the phase's streaming journal
    /// rows), ms after the first claim.
    flush_ms: Vec<f64>,
    /// Per run: its first streaming journal row's created_at - run_steps.started_at, ms.
    first_flush_ms: Vec<f64>,
    /// Per run: run_steps.started_at - runs.started_at (claim -> slice started), ms.
    step_ms: Vec<f64>,
    /// Per run: runs.finished_at - run_steps.started_at, ms.
    finish_ms: Vec<f64>,
}

/// The worker's own counters and summaries that explain a slow phase (flush rate and size,
/// commit and model-call durations, faults, lost leases).
async fn scrape_worker_metrics(http: &reqwest::Client, port: u16) -> Vec<String> {
    let Ok(r) = http.get(format!("http://127.0.0.1:{port}/metrics")).timeout(Duration::from_secs(5)).send().await else {
        return vec!["(worker metrics endpoint did not answer)".into()];
    };
    let text = r.text().await.unwrap_or_default();
    let wanted = [
        "agentloop_stream_flushes_total",
        "agentloop_stream_flush_items",
        "agentloop_commit_duration_seconds",
        "agentloop_model_call_duration_seconds",
        "agentloop_claim_duration_seconds",
        "agentloop_slice_duration_seconds",
        "agentloop_store_faults_total",
        "agentloop_lease_lost_total",
        "agentloop_lease_renew_failures_total",
        "agentloop_slices_total",
        "agentloop_model_calls_total",
    ];
    let mut lines: Vec<String> = Vec::new();
    for name in wanted {
        let mut parts = Vec::new();
        for l in text.lines().filter(|l| !l.starts_with('#') && l.starts_with(name)) {
            let (series, value) = l.rsplit_once(' ').unwrap_or((l, ""));
            let label = series.strip_prefix(name).unwrap_or(series);
            // Keep the summary's count/sum and the 0.5/0.99/1 quantiles only.
            if label.contains("quantile") && !["\"0.5\"", "\"0.99\"", "\"1\""].iter().any(|q| label.contains(q)) {
                continue;
            }
            let value: f64 = value.parse().unwrap_or(f64::NAN);
            let label = label.replace("quantile=", "q").replace('"', "");
            parts.push(format!("{}={}", if label.is_empty() { "total" } else { label.as_str() }, format_sig(value)));
        }
        if !parts.is_empty() {
            lines.push(format!("{}: {}", name.trim_start_matches("agentloop_"), parts.join(" ")));
        }
    }
    lines
}

fn format_sig(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e12 { format!("{v:.0}") } else if v.abs() >= 100.0 { format!("{v:.1}") } else { format!("{v:.4}") }
}

const STREAM_TERMINAL_SQL: &str =
    "SELECT count(*) FROM runs WHERE id = ANY($1) AND status NOT IN ('completed','failed','cancelled')";

async fn concurrency_phase(env: &mut Env, nofile: u64) -> Result<Concurrency> {
    let a = env.args.clone();
    let n = a.streams;
    let chunks = a.stream_chunks.max(1);
    let interval_ms = ((a.stream_seconds * 1000.0) / f64::from(chunks)).round().max(0.0) as u64;
    if (nofile as usize) < n as usize + a.watchers as usize + 200 {
        log(format!(
            "WARNING: open-files limit {nofile} < streams + watchers + 200: the worker or the mock may run out of sockets (ulimit -n)"
        ));
    }
    let text = stream_text(chunks);
    let user_text = format!("MOCK:{}", json!({"steps": [{"text": text, "chunkDelayMs": interval_ms}]}));

    // Runs first (queued, no NOTIFY: the worker claims them at start-up), then the api and the
    // SSE clients, then the one worker.
    log(format!("concurrency: enqueueing {n} streaming runs ({chunks} chunks every {interval_ms} ms) with SQL"));
    let c = connect(&env.db.url).await?;
    let enqueue_started = Instant::now();
    let stmt = c.prepare(&format!("{ENQUEUE_SQL} RETURNING id, thread_id")).await?;
    let mut runs: Vec<(Uuid, Uuid)> = Vec::with_capacity(n as usize);
    let mut left = n;
    while left > 0 {
        let k = left.min(a.batch.max(1));
        for row in c.query(&stmt, &[&env.principal, &(k as i32), &user_text]).await? {
            runs.push((row.get(0), row.get(1)));
        }
        left -= k;
    }
    let enqueue = enqueue_started.elapsed();
    c.batch_execute("ANALYZE runs, threads, messages").await?;
    drop(c);
    let run_ids: Vec<Uuid> = runs.iter().map(|(r, _)| *r).collect();

    let port = free_port();
    let mut api = env.spawn_api(port)?;
    let api_url = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    wait_api(&http, &api_url, &mut api).await?;

    let watchers = (a.watchers.min(n)) as usize;
    log(format!("concurrency: opening {watchers} SSE clients"));
    let base = Instant::now();
    let stop_watch = tokio_util::sync::CancellationToken::new();
    let mut watch_tasks = Vec::with_capacity(watchers);
    let mut readies = Vec::with_capacity(watchers);
    for k in 0..watchers {
        // Spread over the enqueue order (= claim order).
        let (_, thread) = runs[k * n as usize / watchers];
        let (tx, rx) = tokio::sync::oneshot::channel();
        readies.push(rx);
        watch_tasks.push(tokio::spawn(watch_thread(
            http.clone(),
            format!("{api_url}/api/threads/{thread}/updates/stream?afterSequence=0"),
            env.key.clone(),
            chunks,
            base,
            tx,
            stop_watch.clone(),
        )));
    }
    let mut watcher_errors = Vec::new();
    for rx in readies {
        match rx.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => watcher_errors.push(format!("{e:#}")),
            Err(_) => watcher_errors.push("watcher task ended before `connected`".into()),
        }
    }
    ensure!(watcher_errors.len() < watchers.max(1), "no SSE client could connect: {}", watcher_errors.join("; "));

    let admin = connect(&admin_url()).await?;
    tokio::time::sleep(Duration::from_millis(500)).await; // backends above flush their stats
    let before = xacts(&admin, &env.db.name).await?;
    let lsn_before: String = admin.query_one("SELECT pg_current_wal_lsn()::text", &[]).await?.get(0);

    log(format!(
        "concurrency: starting ONE worker, WORKER_CONCURRENCY={n}, DB_POOL_SIZE={}; polling every 200 ms",
        a.stream_pool
    ));
    let metrics_port = free_port();
    let started = Instant::now();
    let mut cmd = Command::new(bin("agentloop-worker")?);
    cmd.arg("run")
        .env("DATABASE_URL", &env.db.url)
        .env("MODEL_BASE_URL", format!("{}/v1", env.mock_url))
        .env("MODEL_NAME", "mock")
        .env("WORKER_ID", "bench-streams")
        .env("WORKER_CONCURRENCY", n.to_string())
        .env("DB_POOL_SIZE", a.stream_pool.to_string())
        .env("WORKER_METRICS_LISTEN", format!("127.0.0.1:{metrics_port}"))
        .env("RUST_LOG", "warn");
    let mut worker = spawn_logged("worker-streams", cmd)?;
    let worker_pid = worker.pid();
    let watched = [
        ("worker", worker_pid),
        ("api", api.pid()),
        ("mock-model", env.mock.pid()),
        ("bench (SSE clients)", std::process::id() as i32),
    ];
    let cpu = CpuWindow::begin(&watched, &backend_pids(&admin, &env.db.name).await?);
    let stop_sampler = tokio_util::sync::CancellationToken::new();
    let sampler = tokio::spawn(sample(connect(&admin_url()).await?, env.db.name.clone(), worker_pid, stop_sampler.clone()));

    // Until every run is terminal, the worker exits, or the deadline.
    let poller = connect(&env.db.url).await?;
    let poll = poller.prepare(STREAM_TERMINAL_SQL).await?;
    let mut polls = 1u64;
    let deadline = Duration::from_secs_f64((a.stream_seconds * 10.0).max(60.0));
    let mut worker_exit = None;
    let mut reported = Instant::now();
    let not_terminal = loop {
        let left: i64 = poller.query_one(&poll, &[&run_ids]).await?.get(0);
        polls += 1;
        if left == 0 {
            break 0;
        }
        if let Ok(Some(status)) = worker.child.try_wait() {
            worker_exit = Some(format!("the worker exited ({status}); see test-output/bench-scheduler/worker-streams.log"));
            break left;
        }
        if started.elapsed() > deadline {
            log(format!("concurrency: {left} runs still not terminal after {} s; giving up", deadline.as_secs()));
            break left;
        }
        if reported.elapsed() > Duration::from_secs(2) {
            log(format!("  {} of {n} streaming runs done", i64::from(n) - left));
            reported = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let wall = started.elapsed();
    let wal_bytes: f64 = admin
        .query_one("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::float8", &[&lsn_before])
        .await?
        .get(0);
    let cpu = cpu.end(&backend_pids(&admin, &env.db.name).await?);
    stop_sampler.cancel();
    let samples = sampler.await.unwrap_or_default();
    let (rss_end_kib, hwm_kib) = rss_kib(worker_pid);
    let metrics = scrape_worker_metrics(&http, metrics_port).await;

    // The watchers end by themselves once their run's message and end arrived.
    let canceller = {
        let stop_watch = stop_watch.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            stop_watch.cancel();
        })
    };
    let mut watches = Vec::with_capacity(watchers);
    for task in watch_tasks {
        match task.await {
            Ok(w) => watches.push(w),
            Err(e) => watcher_errors.push(format!("watcher task: {e}")),
        }
    }
    canceller.abort();
    stop_watch.cancel();
    drop(poller);
    stop(std::slice::from_mut(&mut worker)).await;
    stop(std::slice::from_mut(&mut api)).await;
    tokio::time::sleep(Duration::from_millis(500)).await; // exited backends flush their stats
    let after = xacts(&admin, &env.db.name).await?;

    let c = connect(&env.db.url).await?;
    let row = c
        .query_one(
            "SELECT (extract(epoch from max(finished_at) - min(started_at)))::float8,
                    (extract(epoch from max(started_at) - min(started_at)))::float8,
                    count(*) FILTER (WHERE status = 'completed'),
                    count(*) FILTER (WHERE status = 'failed'),
                    count(*) FILTER (WHERE status = 'cancelled'),
                    count(*) FILTER (WHERE attempts > 1)
             FROM runs WHERE id = ANY($1)",
            &[&run_ids],
        )
        .await?;
    let failures = c
        .query(
            "SELECT status || ' ' || coalesce(error_code, '-'), left(coalesce(min(error_message), ''), 200), count(*) FROM runs
             WHERE id = ANY($1) AND status <> 'completed' GROUP BY 1 ORDER BY 3 DESC LIMIT 10",
            &[&run_ids],
        )
        .await?
        .iter()
        .map(|r| format!("{} x {}: {}", r.get::<_, i64>(2), r.get::<_, String>(0), r.get::<_, String>(1)))
        .collect();
    let run_ms: Vec<f64> = c
        .query(
            "SELECT (extract(epoch from finished_at - started_at) * 1000)::float8 FROM runs
             WHERE id = ANY($1) AND finished_at IS NOT NULL AND started_at IS NOT NULL",
            &[&run_ids],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let steps = c
        .query(
            "SELECT (extract(epoch from s.started_at - r.started_at) * 1000)::float8,
                    (extract(epoch from r.finished_at - s.started_at) * 1000)::float8
             FROM runs r JOIN run_steps s ON s.run_id = r.id AND s.sequence = 1
             WHERE r.id = ANY($1) AND r.finished_at IS NOT NULL",
            &[&run_ids],
        )
        .await?;
    let step_ms: Vec<f64> = steps.iter().map(|r| r.get(0)).collect();
    // Server side of the stream flusher: each flush is one transaction, so its journal rows
    // share one created_at (= now(), the transaction's start).
    let flush_ms: Vec<f64> = c
        .query(
            "SELECT DISTINCT (extract(epoch from e.created_at - (SELECT min(started_at) FROM runs WHERE id = ANY($1))) * 1000)::float8 AS t
             FROM thread_events e JOIN runs r ON r.thread_id = e.thread_id
             WHERE r.id = ANY($1) AND e.kind = 'streaming' ORDER BY t",
            &[&run_ids],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let first_flush_ms: Vec<f64> = c
        .query(
            "SELECT (extract(epoch from min(e.created_at) - s.started_at) * 1000)::float8
             FROM runs r JOIN run_steps s ON s.run_id = r.id AND s.sequence = 1
                         JOIN thread_events e ON e.thread_id = r.thread_id AND e.kind = 'streaming'
             WHERE r.id = ANY($1) GROUP BY r.id, s.started_at",
            &[&run_ids],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let finish_ms: Vec<f64> = steps.iter().map(|r| r.get(1)).collect();
    let m = c
        .query_one(
            "SELECT count(*) FILTER (WHERE content = to_jsonb($2::text)), count(*) FROM messages
             WHERE role = 'assistant' AND run_id = ANY($1)",
            &[&run_ids, &text],
        )
        .await?;

    let log_text = std::fs::read_to_string(log_dir()?.join("worker-streams.log")).unwrap_or_default();
    let warn: Vec<&str> = log_text.lines().filter(|l| l.contains("WARN") || l.contains("ERROR") || l.contains("panicked")).collect();
    Ok(Concurrency {
        streams: n,
        chunks,
        interval_ms,
        pool: a.stream_pool,
        nofile,
        enqueue,
        wall,
        worker_exit,
        not_terminal,
        completed: row.get(2),
        failed: row.get(3),
        cancelled: row.get(4),
        failures,
        reclaimed: row.get(5),
        window_secs: row.get::<_, Option<f64>>(0).unwrap_or(f64::NAN),
        claim_spread_secs: row.get::<_, Option<f64>>(1).unwrap_or(f64::NAN),
        run_ms,
        messages_ok: m.get(0),
        messages_total: m.get(1),
        samples,
        hwm_kib,
        rss_end_kib,
        xacts: (after.0 - before.0, after.1 - before.1),
        polls,
        wal_bytes,
        cpu,
        watchers: watches,
        watcher_errors,
        text,
        warn_count: warn.len(),
        metrics,
        flush_ms,
        first_flush_ms,
        step_ms,
        finish_ms,
        warn_lines: warn.iter().take(8).map(|l| l.chars().take(300).collect()).collect(),
    })
}

/// Per watcher: t0 = min over its chunks of (receive time - i x interval); chunk i's delay =
/// receive time - (t0 + i x interval). Returns (every chunk's delay, the delay of the newest
/// chunk of each `streaming` event, chunks never received).
fn chunk_delays(watches: &[Watch], interval_ms: u64) -> (Vec<f64>, Vec<f64>, usize) {
    let d = interval_ms as f64;
    let (mut all, mut newest, mut missing) = (Vec::new(), Vec::new(), 0);
    for w in watches {
        let t0 = w
            .chunk_at
            .iter()
            .enumerate()
            .filter_map(|(i, at)| at.map(|at| at - i as f64 * d))
            .fold(f64::INFINITY, f64::min);
        missing += w.chunk_at.iter().filter(|at| at.is_none()).count();
        if !t0.is_finite() {
            continue;
        }
        all.extend(w.chunk_at.iter().enumerate().filter_map(|(i, at)| at.map(|at| at - t0 - i as f64 * d)));
        newest.extend(w.newest.iter().map(|(at, i)| at - t0 - f64::from(*i) * d));
    }
    (all, newest, missing)
}

/// Writes every watcher's chunk receive times to `test-output/bench-scheduler/concurrency-chunks.csv`
/// (`watcher,chunk,received_ms,delay_ms`; received_ms since the SSE clients were opened).
fn write_chunk_csv(watches: &[Watch], interval_ms: u64) -> Result<PathBuf> {
    use std::fmt::Write as _;
    let d = interval_ms as f64;
    let mut out = String::from("watcher,chunk,received_ms,delay_ms\n");
    for (k, w) in watches.iter().enumerate() {
        let t0 = w
            .chunk_at
            .iter()
            .enumerate()
            .filter_map(|(i, at)| at.map(|at| at - i as f64 * d))
            .fold(f64::INFINITY, f64::min);
        for (i, at) in w.chunk_at.iter().enumerate() {
            if let Some(at) = at {
                let _ = writeln!(out, "{k},{i},{at:.1},{:.1}", at - t0 - i as f64 * d);
            }
        }
    }
    let path = log_dir()?.join("concurrency-chunks.csv");
    std::fs::write(&path, out)?;
    Ok(path.canonicalize().unwrap_or(path))
}

fn print_concurrency(c: &Concurrency, stream_seconds: f64) {
    let target_window = stream_seconds + TARGET_STREAM_SLACK_SECS;
    println!(
        "5. concurrency: {} streaming runs on ONE worker (WORKER_CONCURRENCY={}, DB_POOL_SIZE={}), answers of {} chunks x {} words every {} ms (~{:.1} s; the mock also waits one interval before each of its 3 closing frames), {} SSE clients",
        c.streams,
        c.streams,
        c.pool,
        c.chunks,
        MOCK_WORDS_PER_CHUNK,
        c.interval_ms,
        c.chunks as f64 * c.interval_ms as f64 / 1000.0,
        c.watchers.len()
    );
    println!(
        "   enqueued with SQL in {:.2} s before the worker started; open-files limit {} (the worker and the mock inherit it)",
        c.enqueue.as_secs_f64(),
        c.nofile
    );
    if let Some(e) = &c.worker_exit {
        println!("   FAIL: {e}");
    }
    let ok = c.failed == 0 && c.cancelled == 0 && c.not_terminal == 0 && c.completed == i64::from(c.streams);
    println!(
        "   outcome: {} completed, {} failed, {} cancelled, {} not terminal after {:.1} s [target 0 failed, all completed: {}]",
        c.completed,
        c.failed,
        c.cancelled,
        c.not_terminal,
        c.wall.as_secs_f64(),
        mark(ok)
    );
    for f in &c.failures {
        println!("   not completed: {f}");
    }
    if c.reclaimed > 0 {
        println!("   runs claimed more than once (handed back or recovered): {}", c.reclaimed);
    }
    println!(
        "   first claim -> last finish (database clock): {:.2} s [target <= {target_window:.1} s: {}]; first -> last claim {:.2} s; per run started_at -> finished_at: {}",
        c.window_secs,
        mark(c.window_secs <= target_window && c.not_terminal == 0),
        c.claim_spread_secs,
        dist(c.run_ms.clone())
    );
    println!("   per run claim -> slice started (run_steps.started_at): {}", dist(c.step_ms.clone()));
    println!("   per run slice started -> finished: {}", dist(c.finish_ms.clone()));
    let flush_gaps: Vec<f64> = c.flush_ms.windows(2).map(|p| p[1] - p[0]).collect();
    println!(
        "   stream flushes (server side: distinct created_at of the streaming journal rows = one flush transaction each): {}, first at +{:.0} ms and last at +{:.0} ms after the first claim; interval between flushes {}",
        c.flush_ms.len(),
        c.flush_ms.first().copied().unwrap_or(f64::NAN),
        c.flush_ms.last().copied().unwrap_or(f64::NAN),
        dist(flush_gaps)
    );
    println!("   per run slice started -> its first streaming event committed: {}", dist(c.first_flush_ms.clone()));
    println!(
        "   answers: {} of {} runs' assistant messages equal the full text ({} assistant messages) [{}]",
        c.messages_ok,
        c.streams,
        c.messages_total,
        mark(c.messages_ok == i64::from(c.streams) && c.messages_total == i64::from(c.streams))
    );
    let mib = |kib: u64| kib as f64 / 1024.0;
    println!(
        "   worker RSS: peak {:.1} MiB over {} samples every 100 ms, VmHWM {:.1} MiB, {:.1} MiB at the end [target <= {TARGET_WORKER_RSS_MIB:.0} MiB: {}]",
        mib(c.samples.peak_rss_kib),
        c.samples.samples,
        mib(c.hwm_kib),
        mib(c.rss_end_kib),
        mark(mib(c.samples.peak_rss_kib.max(c.hwm_kib)) <= TARGET_WORKER_RSS_MIB)
    );
    let bound = i64::from(c.pool) + WORKER_EXTRA_CONNECTIONS;
    println!(
        "   worker connections (pg_stat_activity, application_name agentloop-worker*): max {} (states then: {}) [target <= DB_POOL_SIZE + {WORKER_EXTRA_CONNECTIONS} = {bound}: {}]; api: max {}",
        c.samples.max_worker_connections,
        if c.samples.busiest.is_empty() { "-" } else { &c.samples.busiest },
        mark(c.samples.max_worker_connections <= bound),
        c.samples.max_api_connections
    );
    let secs = c.wall.as_secs_f64().max(1e-9);
    let xacts = c.xacts.0 + c.xacts.1 - c.polls as i64;
    println!(
        "   PostgreSQL: {:.0} transactions/s ({} commits + {} rollbacks of the benchmark database minus the benchmark's {} polls, over {:.2} s from worker spawn to the last run terminal = {:.1} per run; includes the api's journal reads for the SSE clients and the worker's start-up and shutdown)",
        xacts as f64 / secs,
        c.xacts.0,
        c.xacts.1,
        c.polls,
        secs,
        xacts as f64 / f64::from(c.streams.max(1))
    );
    println!(
        "   WAL: {:.0} bytes/s = {:.2} MiB/s ({:.1} MiB, {:.1} KiB per run; pg_current_wal_lsn() delta, server-wide, over the same {:.2} s)",
        c.wal_bytes / secs,
        c.wal_bytes / secs / 1_048_576.0,
        c.wal_bytes / 1_048_576.0,
        c.wal_bytes / 1024.0 / f64::from(c.streams.max(1)),
        secs
    );
    let (all, newest, missing) = chunk_delays(&c.watchers, c.interval_ms);
    let p99 = {
        let mut v = all.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        percentile(&v, 99.0)
    };
    let sum = |f: fn(&Watch) -> u64| c.watchers.iter().map(f).sum::<u64>();
    let gaps = sum(|w| w.gaps);
    println!(
        "   SSE clients: {} connected, {} streaming events applied; offset gaps {}, overlaps {}, restarts {}, resets {} [target 0 gaps: {}]",
        c.watchers.len(),
        sum(|w| w.deltas),
        gaps,
        sum(|w| w.overlaps),
        sum(|w| w.restarts),
        sum(|w| w.resets),
        mark(gaps == 0 && !c.watchers.is_empty())
    );
    println!(
        "   chunks: {} of {} reached the clients as streaming deltas, {} only with the final `message` event (not flushed before the slice unregistered its stream), {} never [{}]",
        c.watchers.len() * c.chunks as usize - missing - sum(|w| w.via_message) as usize,
        c.watchers.len() * c.chunks as usize,
        sum(|w| w.via_message),
        missing,
        mark(missing == 0)
    );
    let mut between: Vec<f64> = Vec::new();
    for w in &c.watchers {
        between.extend(w.newest.windows(2).map(|p| p[1].0 - p[0].0));
    }
    println!("   time between two streaming events to one client (flush period as seen by SSE): {}", dist(between));
    println!(
        "   chunk delay, every chunk: {} [target p99 <= {TARGET_CHUNK_P99_MS:.0} ms: {}]",
        dist(all),
        mark(p99 <= TARGET_CHUNK_P99_MS)
    );
    let newest_p99 = {
        let mut v = newest.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        percentile(&v, 99.0)
    };
    println!(
        "   chunk delay, newest chunk of each streaming event: {} [target p99 <= {TARGET_CHUNK_P99_MS:.0} ms: {}]",
        dist(newest),
        mark(newest_p99 <= TARGET_CHUNK_P99_MS)
    );
    match write_chunk_csv(&c.watchers, c.interval_ms) {
        Ok(path) => println!("   per-chunk receive times and delays: {}", path.display()),
        Err(e) => println!("   per-chunk receive times not written: {e:#}"),
    }
    println!(
        "   (delay of chunk i = receive time - (t0 + i x {} ms), t0 = min over the stream's chunks of (receive time - i x {} ms): lag relative to the stream's own best-delivered chunk, so it includes the flusher's throttle, the journal read and SSE, but not the wait for the first claim or the first flush)",
        c.interval_ms, c.interval_ms
    );
    let partial_ok = c.watchers.iter().filter(|w| w.partial == c.text).count();
    let message_ok = c.watchers.iter().filter(|w| w.message.as_deref() == Some(c.text.as_str())).count();
    println!(
        "   SSE clients: the rebuilt partial equals the full text for {partial_ok} of {}; the `message` event does for {message_ok}; run ended `completed` for {} [{}]",
        c.watchers.len(),
        c.watchers.iter().filter(|w| w.status.as_deref() == Some("completed")).count(),
        mark(message_ok == c.watchers.len())
    );
    for w in c.watchers.iter().filter(|w| w.error.is_some()).take(5) {
        println!("   SSE client error: {}", w.error.as_deref().unwrap_or_default());
    }
    for e in c.watcher_errors.iter().take(5) {
        println!("   SSE client error: {e}");
    }
    println!("   CPU: {}", c.cpu);
    for l in &c.metrics {
        println!("   worker metric {l}");
    }
    if c.warn_count > 0 {
        println!("   worker log: {} WARN/ERROR lines (test-output/bench-scheduler/worker-streams.log), first:", c.warn_count);
        for l in &c.warn_lines {
            println!("     {l}");
        }
    }
}

// ---------------------------------------------------------------------------------------------

async fn bench(args: Args, nofile: u64) -> Result<()> {
    install_crypto();
    if cfg!(debug_assertions) {
        log("WARNING: a debug build; run with `cargo run --release` for meaningful figures");
    }
    for name in ["agentloop-worker", "agentloop-api", "mock-model"] {
        bin(name)?;
    }
    let clients = args.workers * args.concurrency;
    let load_start = loadavg();
    let admin = connect(&admin_url()).await?;
    let version: String = admin.query_one("SHOW server_version", &[]).await?.get(0);
    let mut settings = Vec::new();
    for s in ["synchronous_commit", "fsync", "shared_buffers", "max_connections"] {
        let v: String = admin.query_one(&format!("SHOW {s}"), &[]).await?.get(0);
        settings.push(format!("{s}={v}"));
    }
    drop(admin);

    let db = Database::create("bench_sched").await?;
    log(format!("database {} (migrating)", db.name));
    admin_verb(&["migrate"], &db.url).await?;
    let key = admin_verb(&["create-key", "--principal", "bench"], &db.url).await?;
    let principal: Uuid = connect(&db.url)
        .await?
        .query_one("SELECT id FROM principals WHERE name = 'bench'", &[])
        .await?
        .get(0);
    let (mock_url, mock) = start_mock()?;
    let mut env = Env { db, mock_url, mock, key, principal, args: args.clone(), next_worker: 0 };

    // pgbench's scratch database, initialised up front; runs just before and after phase 1.
    let pgbench = pgbench_path()?;
    let run_throughput = args.runs_phase(Phase::Throughput) && args.runs > 0;
    let pgdb = if run_throughput && args.pgbench_seconds > 0 {
        let pgdb = Database::create("bench_pgbench").await?;
        log(format!("pgbench -i -s {} ({})", args.pgbench_scale, pgbench.display()));
        pgbench_init(&pgbench, &pgdb.url, args.pgbench_scale).await?;
        Some(pgdb)
    } else {
        None
    };
    let mut tps = Vec::new();
    if let Some(pgdb) = &pgdb {
        log(format!("pgbench -N -c {clients} -T {} (before)", args.pgbench_seconds));
        tps.push(pgbench_tps(&pgbench, pgdb, clients, args.pgbench_seconds).await?);
    }
    let throughput = if run_throughput { Some(throughput_phase(&mut env).await?) } else { None };
    if let Some(pgdb) = &pgdb {
        log(format!("pgbench -N -c {clients} -T {} (after)", args.pgbench_seconds));
        tps.push(pgbench_tps(&pgbench, pgdb, clients, args.pgbench_seconds).await?);
    }
    drop(pgdb);
    let floor = match &throughput {
        Some(t) if args.pgbench_seconds > 0 => {
            let expected = f64::from(t.runs) / t.wall.as_secs_f64();
            Some(floor_phase(&env, &pgbench, clients, args.pgbench_seconds, expected).await?)
        }
        _ => None,
    };
    let latency =
        if args.runs_phase(Phase::Latency) && args.latency_runs > 0 { Some(latency_phase(&mut env).await?) } else { None };
    let statements = if args.runs_phase(Phase::Statements) && args.statement_runs > 0 {
        statement_phase(&mut env).await?
    } else {
        None
    };
    let concurrency = if args.runs_phase(Phase::Concurrency) && args.streams > 0 {
        Some(concurrency_phase(&mut env, nofile).await?)
    } else {
        None
    };
    let load_end = loadavg();

    // ------------------------------------------------------------------ report
    println!();
    println!("agentloop scheduler benchmark (one run, one PostgreSQL)");
    println!("  server: PostgreSQL {version}; {}", settings.join(", "));
    println!(
        "  machine: {} CPUs; load average {load_start} at start, {load_end} at end (shared with other processes)",
        cpus()
    );
    println!("  binaries: {}", bin_dir().display());
    println!();
    let (mut rps, mut worker_xacts_per_sec) = (f64::NAN, f64::NAN);
    match &throughput {
        None => println!("1. claim + complete: skipped"),
        Some(t) => {
            rps = f64::from(t.runs) / t.wall.as_secs_f64();
            worker_xacts_per_sec = (t.xact_commit - t.polls as i64) as f64 / t.wall.as_secs_f64();
            println!(
                "1. claim + complete: {} runs, zero-latency mock model, {} worker processes x {} slots = {clients} slots",
                t.runs, env.args.workers, env.args.concurrency
            );
            println!("   enqueued with SQL in {:.1} s before the workers started", t.enqueue.as_secs_f64());
            println!(
                "   worker spawn -> all runs terminal (200 ms polls): {:.2} s = {rps:.0} runs/s",
                t.wall.as_secs_f64()
            );
            println!(
                "   first claim -> last finish (database clock): {:.2} s = {:.0} runs/s",
                t.db_secs,
                f64::from(t.runs) / t.db_secs
            );
            println!("   outcome: {}; assistant messages: {}", t.outcome, t.assistant_messages);
            for f in &t.failures {
                println!("   not completed: {f}");
            }
            println!("   CPU: {}", t.cpu.text);
        }
    }
    println!();
    if tps.is_empty() {
        println!("2. pgbench: skipped (--pgbench-seconds 0, or no throughput phase)");
    } else {
        let mean = tps.iter().map(|t| t.0).sum::<f64>() / tps.len() as f64;
        let pgbench_cpu_ms = tps.iter().map(|t| t.1).sum::<f64>() / tps.len() as f64;
        let ratio = rps / mean;
        println!(
            "2. pgbench -N -c {clients} -j {} -T {} (scale {}), same server: {} TPS (before / after phase 1), mean {mean:.0}",
            (cpus() as u32).clamp(1, clients.max(1)),
            env.args.pgbench_seconds,
            env.args.pgbench_scale,
            tps.iter().map(|v| format!("{:.0}", v.0)).collect::<Vec<_>>().join(" / ")
        );
        println!(
            "   runs/s vs pgbench: claim+complete runs/s / pgbench TPS = {rps:.0} / {mean:.0} = {ratio:.3} [target >= {TARGET_PGBENCH_RATIO}: {}]",
            mark(ratio >= TARGET_PGBENCH_RATIO)
        );
        println!(
            "   (the workers committed {worker_xacts_per_sec:.0} transactions/s during phase 1 = {:.2} x pgbench TPS)",
            worker_xacts_per_sec / mean
        );
        if let Some(f) = &floor {
            println!(
                "   the step protocol alone (the workers' SQL for a one-slice run, driven by pgbench -f with {clients} clients, no worker process; script: test-output/bench-scheduler/step-protocol.pgbench): {:.0} runs/s over {} s ({} runs completed) = {:.3} x pgbench TPS",
                f.rps,
                f.seconds,
                f.completed,
                f.rps / mean
            );
            println!(
                "   claim+complete runs/s / step protocol alone = {rps:.0} / {:.0} = {:.2} (what the workers, the mock model and the network cost on top of the database's own work per run)",
                f.rps,
                rps / f.rps
            );
            println!("   CPU (step protocol alone): {}", f.cpu.text);
        }
        // CPU per unit of work is steadier than rates on a shared machine: it says how much more
        // database work a run is than a pgbench transaction, whatever else ran meanwhile.
        let mut per = vec![format!("pgbench -N transaction {pgbench_cpu_ms:.3} ms")];
        if let Some(f) = &floor {
            let ms = f.cpu.server_ms_per(f.rps);
            per.push(format!("run, step protocol alone {ms:.2} ms ({:.1} x)", ms / pgbench_cpu_ms));
        }
        if let Some(t) = &throughput {
            let ms = t.cpu.server_ms_per(f64::from(t.runs) / t.wall.as_secs_f64());
            per.push(format!("run, phase 1 {ms:.2} ms ({:.1} x)", ms / pgbench_cpu_ms));
        }
        println!("   PostgreSQL CPU per unit of work (backend cores / rate): {}", per.join("; "));
    }
    println!();
    match &latency {
        None => println!("3. latency: skipped"),
        Some(l) => {
            println!("3. enqueue -> slice start, {} single runs posted one at a time via HTTP, idle workers", l.runs);
            println!("   runs.started_at - runs.created_at (claimed):         {}", dist(l.claim_ms.clone()));
            println!("   run_steps.started_at - runs.created_at (step begun): {}", dist(l.step_ms.clone()));
            println!("   client: POST /chat -> 202:                            {}", dist(l.post_ms.clone()));
            println!("   client: POST /chat -> SSE `run` event `running`:      {}", dist(l.seen_running_ms.clone()));
            if l.not_completed > 0 {
                println!("   runs not completed: {}", l.not_completed);
            }
            println!("   CPU: {}", l.cpu);
        }
    }
    println!();
    println!(
        "4. SQL per run (one slice, final answer, no tool call) [target <= {TARGET_XACTS_PER_RUN} transactions / <= {TARGET_ROUND_TRIPS_PER_RUN} round trips per run]"
    );
    match &throughput {
        None => println!("   server-counted commits: not measured (no throughput phase)"),
        Some(t) => {
            let xacts_per_run = (t.xact_commit - t.polls as i64) as f64 / f64::from(t.runs);
            println!(
                "   server-counted commits: {xacts_per_run:.2} per run [target <= {TARGET_XACTS_PER_RUN}: {}] = pg_stat_database.xact_commit delta of the benchmark database over phase 1 ({}) minus the benchmark's {} polls, / {} runs (rollbacks: {}); PostgreSQL also counts each statement preparation (Parse..Sync) outside a transaction block as a commit; includes worker start-up and autovacuum",
                mark(xacts_per_run <= TARGET_XACTS_PER_RUN),
                t.xact_commit,
                t.polls,
                t.runs,
                t.xact_rollback
            );
            match &t.pgss {
                Some((calls, list)) => {
                    println!(
                        "   statements (pg_stat_statements, phase 1): {:.2} per run ({calls} calls)",
                        *calls as f64 / f64::from(t.runs)
                    );
                    for (q, c) in list.iter().take(25) {
                        println!("     {:>7.3}  {q}", *c as f64 / f64::from(t.runs));
                    }
                    match t.planning {
                        // Migration 000021: statements re-planned on every execution were ~2 ms
                        // of planning per run.
                        Some((plans, ms)) => println!(
                            "   planning (pg_stat_statements.track_planning, nested statements included): {:.2} plannings, {:.3} ms per run",
                            plans as f64 / f64::from(t.runs),
                            ms / f64::from(t.runs)
                        ),
                        None => println!("   planning: not measured (pg_stat_statements.track_planning = off)"),
                    }
                }
                None => println!(
                    "   pg_stat_statements: not available (needs shared_preload_libraries); counted on the wire instead"
                ),
            }
        }
    }
    match &statements {
        None => println!("   statements: not counted"),
        Some(s) => {
            let per = |v: u64| v as f64 / f64::from(s.runs);
            // `SELECT agentloop_flush_notify()` (migration 000018) is pipelined behind each step
            // with its own Sync: a transaction that only sends the step's deferred notifications
            // (no xid, no WAL, synchronous_commit off). Shown apart from the step transactions.
            let flushes: u64 = s.wire.statements.iter().filter(|(q, _)| q.starts_with("SELECT agentloop_flush_notify()")).map(|(_, c)| *c).sum();
            let steps = s.wire.transactions.saturating_sub(flushes);
            println!(
                "   transactions: {:.2} per run on the wire (BEGIN..COMMIT blocks + statements outside them) = {:.2} step transactions + {:.2} notification flushes (pg_notify only: no xid, no WAL) [target <= {TARGET_XACTS_PER_RUN} step transactions: {}]",
                per(s.wire.transactions),
                per(steps),
                per(flushes),
                mark(per(steps) <= TARGET_XACTS_PER_RUN)
            );
            println!(
                "   statements: {:.2} per run (incl. BEGIN/COMMIT); round trips {:.2} per run [target <= {TARGET_ROUND_TRIPS_PER_RUN}: {}]; statement preparations (Parse) {:.2} per run",
                per(s.wire.executed()),
                per(s.wire.round_trips),
                mark(per(s.wire.round_trips) <= TARGET_ROUND_TRIPS_PER_RUN),
                per(s.wire.parses)
            );
            println!(
                "   method: a protocol proxy between the 2 workers and PostgreSQL counted Execute messages (and each statement of a simple Query) over {} more runs ({}; {:.1} s incl. enqueue, {:.0} runs/s through the proxy), after the workers' start-up; round trips = Sync + simple Query messages",
                s.runs,
                s.outcome,
                s.secs,
                f64::from(s.runs) / s.secs
            );
            let mut list: Vec<(&String, &u64)> = s.wire.statements.iter().collect();
            list.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
            println!("   per run  statement");
            for (q, c) in list {
                let q: String = if q.chars().count() > 120 { q.chars().take(117).collect::<String>() + "..." } else { q.clone() };
                println!("   {:>7.3}  {q}", per(*c));
            }
        }
    }
    println!();
    match &concurrency {
        None => println!("5. concurrency: skipped"),
        Some(c) => print_concurrency(c, env.args.stream_seconds),
    }
    Ok(())
}
