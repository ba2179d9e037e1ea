//! The chaos harness: a mixed workload against real processes while faults are injected at
//! random, then invariants checked and printed as counts (`chaos` binary, `tests/chaos.rs`).
//!
//! It is black-box: it talks to the product through the HTTP API, reads the database directly
//! at the end, sends real signals, and sits a TCP proxy between every process and PostgreSQL.
//! Nothing here depends on how the write path is implemented; the audit triggers only read
//! the runs row a writer touches (see [`audit`]).
//!
//! Phases: start ([`stack`]) → workload ([`workload`]) with faults ([`faults`]) until the turn
//! budget (or the duration) is used up → faults stop, everything is healed (SIGCONT, proxy
//! thawed, workers replaced) → settle: the clients drive their last runs to the end (bounded)
//! → SSE followers catch up (bounded) → checks ([`check`], [`audit`]) → report ([`report`]).
//! A run is reproducible from its seed as far as the decisions go (scripts, choices, fault
//! kinds and pauses); timing is not.

pub mod audit;
pub mod check;
pub mod faults;
pub mod http;
pub mod pglog;
pub mod proxy;
pub mod receiver;
pub mod report;
pub mod stack;
pub mod tally;
pub mod workload;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Result;
use tokio_util::sync::CancellationToken;

use self::faults::{Fault, FaultPlan, Progress};
use self::receiver::Delays;
use self::report::{Report, info};
use self::stack::{ChaosStack, StackConfig};
use self::tally::Tally;
use self::workload::{Workload, WorkloadConfig};

/// Settings of one chaos run.
#[derive(Debug, Clone)]
pub struct Config {
    pub seed: u64,
    /// Turns to post.
    pub runs: usize,
    /// Stop posting after this long.
    pub duration: Option<Duration>,
    pub workers: usize,
    pub apis: usize,
    pub clients: usize,
    pub faults: BTreeSet<Fault>,
    pub fault_interval_ms: u64,
    pub restarts: usize,
    /// Keep the cluster and database after the run.
    pub keep: bool,
    pub log_dir: PathBuf,
    /// Bound of the settle phase (clients finishing their runs).
    pub settle: Duration,
    pub sse_fraction: f64,
    /// Print progress lines while running.
    pub verbose: bool,
}

impl Config {
    /// Defaults of the soak (`--runs 2000`).
    pub fn soak(seed: u64) -> Self {
        Self {
            seed,
            runs: 2000,
            duration: None,
            workers: 3,
            apis: 1,
            clients: 12,
            faults: Fault::ALL.into_iter().collect(),
            fault_interval_ms: 1500,
            restarts: 2,
            keep: false,
            log_dir: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../test-output/chaos"),
            settle: Duration::from_secs(180),
            sse_fraction: 0.3,
            verbose: true,
        }
    }
}

/// The outcome of a run.
pub struct Outcome {
    pub report: Report,
    /// How to reach the kept database (`--keep`).
    pub kept: Option<String>,
}

impl Outcome {
    pub fn violations(&self) -> usize {
        self.report.violated().len()
    }
}

/// Runs the whole thing. Errors only for harness failures (could not start, ...); violations
/// are in the report.
pub async fn run(config: Config) -> Result<Outcome> {
    let t0 = Instant::now();
    let tally = Tally::default();
    let say = |s: String| {
        if config.verbose {
            eprintln!("[chaos {:>6.1}s] {s}", t0.elapsed().as_secs_f64());
        }
    };
    let stack_config = StackConfig {
        workers: config.workers,
        apis: config.apis,
        worker_concurrency: 4,
        lease_ms: 3000,
        renew_ms: 1000,
        tool_timeout_ms: 1500,
        receiver_delays: Delays { fast: (0, 300), slow_rate: 0.08, slow: (1700, 2600) },
        seed: config.seed,
        log_dir: config.log_dir.clone(),
    };
    say(format!("starting: PostgreSQL cluster, proxy, mock model, receiver, {} api, {} workers", config.apis, config.workers));
    let stack = Arc::new(ChaosStack::start(stack_config).await?);
    say(format!("started (logs in {}); workload: {} turns, {} clients, seed {}", config.log_dir.display(), config.runs, config.clients, config.seed));

    let workload = Workload::new(
        WorkloadConfig {
            clients: config.clients,
            runs: config.runs,
            duration: config.duration,
            sse_fraction: config.sse_fraction,
            run_patience: Duration::from_secs(150),
            seed: config.seed,
        },
        stack.clone(),
        tally.clone(),
    );
    let stop_faults = CancellationToken::new();
    let plan = FaultPlan { enabled: config.faults.clone(), mean_interval_ms: config.fault_interval_ms, restarts: config.restarts };
    let progress = Progress { accepted: workload.accepted.clone(), target: config.runs, started: Instant::now(), duration: config.duration };
    let fault_task = tokio::spawn(faults::run(stack.clone(), plan, config.seed, tally.clone(), progress, stop_faults.clone()));
    let clients = workload.spawn_clients();

    // Workload phase: until every client stopped posting.
    let mut last_print = Instant::now();
    while workload.posting.load(Ordering::SeqCst) > 0 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if last_print.elapsed() > Duration::from_secs(10) {
            last_print = Instant::now();
            let faults: u64 = Fault::ALL.iter().map(|f| fault_count(&tally, *f)).sum();
            say(format!(
                "{} posted, {} accepted, {} faults so far",
                tally.get("workload.posted"),
                workload.accepted.load(Ordering::SeqCst),
                faults
            ));
        }
    }
    let workload_s = t0.elapsed().as_secs_f64();
    say("posting done: stopping faults and healing".into());
    stop_faults.cancel();
    let _ = fault_task.await;
    tokio::time::sleep(Duration::from_millis(1500)).await; // pending worker replacements land
    let continued = faults::heal(&stack);
    if continued > 0 {
        tally.note(format!("heal: SIGCONT {continued} stopped worker(s)"));
    }
    workload.settled.cancel();

    // Settle: the clients finish driving their runs (bounded).
    let settle_deadline = Instant::now() + config.settle;
    let mut timed_out_clients = 0;
    for c in clients {
        let left = settle_deadline.saturating_duration_since(Instant::now());
        let abort = c.abort_handle();
        if tokio::time::timeout(left, c).await.is_err() {
            abort.abort();
            timed_out_clients += 1;
        }
    }
    if timed_out_clients > 0 {
        tally.note(format!("settle: {timed_out_clients} client(s) still driving runs after {:?}; aborted", config.settle));
    }
    // Then the database must be quiet: no active run (bounded).
    let db = stack.db().await?;
    let quiet_deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let active: i64 = db
            .query_one("SELECT count(*) FROM runs WHERE status IN ('queued', 'running', 'pending')", &[])
            .await?
            .get(0);
        if active == 0 || Instant::now() > quiet_deadline {
            if active > 0 {
                tally.note(format!("settle: {active} run(s) still queued/running/pending after the quiet wait"));
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    say("settled; waiting for the SSE followers to catch up".into());
    // Longer than the api's SSE heartbeat (15 s), after which an idle client re-reads.
    let follow_deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ends = check::Snapshot::journal_ends(&db).await?;
        let behind = workload.followers_behind(&ends);
        if behind == 0 || Instant::now() > follow_deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let sse = workload.finish_followers().await;
    let total_s = t0.elapsed().as_secs_f64();

    // Checks.
    say("checking invariants".into());
    let followed: Vec<String> = sse.iter().map(|l| l.thread.clone()).collect();
    let mut snap = check::Snapshot::load(&db, &followed).await?;
    snap.log_reasons = failure_reasons(&config.log_dir);
    let effects = stack.receiver.effects();
    let names: Vec<&str> = config.faults.iter().map(|f| f.name()).collect();
    let mut report = Report {
        header: format!(
            "chaos: seed {} | {} turns{} | {} clients | {} workers | {} api | faults: {} | {:.0}s workload, {:.0}s total",
            config.seed,
            config.runs,
            config.duration.map(|d| format!(" (or {}s)", d.as_secs())).unwrap_or_default(),
            config.clients,
            config.workers,
            config.apis,
            if names.is_empty() { "none".to_owned() } else { names.join(",") },
            workload_s,
            total_s
        ),
        ..Default::default()
    };
    {
        let s = report.section("faults injected");
        for f in Fault::ALL {
            let detail = tally
                .with_prefix(&format!("fault.{}_", f.name()))
                .iter()
                .map(|(k, v)| format!("{k}: {v}"))
                .collect::<Vec<_>>()
                .join(", ");
            let enabled = config.faults.contains(&f);
            s.push(info(f.name(), fault_count(&tally, f), if enabled { detail } else { "disabled".into() }));
        }
        let (accepted, failed) = stack.proxy.totals();
        s.push(info("proxy connections", accepted, format!("{failed} upstream connects failed")));
    }
    // Every agent-step request the mock received (the checks count steps paid more than once).
    let model_requests: Vec<serde_json::Value> = reqwest::get(format!("{}/_mock/requests", stack.mock.url)).await?.json().await?;
    check::evaluate(&mut report, &workload, &snap, &effects, &sse, &model_requests);
    let findings = audit::check(&db).await?;
    report.section("lease audit").extend(check::audit_lines(&findings));
    {
        let s = report.section("client");
        let http: Vec<String> = tally.with_prefix("http.").iter().map(|(k, v)| format!("{k}: {v}")).collect();
        s.push(info("HTTP retries", tally.get("http.post_retries") + tally.get("http.get_retries"), http.join(", ")));
        let cancels: Vec<String> = tally.with_prefix("workload.cancel.").iter().map(|(k, v)| format!("{k}: {v}")).collect();
        let sent: u64 = tally.with_prefix("workload.cancel.").iter().map(|(_, v)| v).sum();
        s.push(info("cancels sent", sent, cancels.join(", ")));
        let decisions: Vec<String> = tally.with_prefix("workload.decision.").iter().map(|(k, v)| format!("{k}: {v}")).collect();
        s.push(info("approval decisions sent", workload.decisions.lock().expect("decisions").len() as u64, decisions.join(", ")));
        let resolves: Vec<String> = tally.with_prefix("workload.resolve.").iter().map(|(k, v)| format!("{k}: {v}")).collect();
        s.push(info("resolves sent", workload.resolves.lock().expect("resolves").len() as u64, resolves.join(", ")));
        let scen: Vec<String> = tally.with_prefix("workload.scenario.").iter().map(|(k, v)| format!("{k}: {v}")).collect();
        let n: u64 = tally.with_prefix("workload.scenario.").iter().map(|(_, v)| v).sum();
        s.push(info("scenarios", n, scen.join(", ")));
        s.push(info("scenario errors", tally.get("workload.scenario_errors"), "see notes in report.json"));
        if let Some(requests) = mock_requests(&stack.mock.url).await {
            let assistant = snap_assistant_count(&db).await.unwrap_or(0);
            s.push(info(
                "model calls",
                requests,
                format!("{assistant} assistant messages persisted; {} calls produced nothing durable", requests.saturating_sub(assistant)),
            ));
        }
    }
    if let Some(log) = stack.postgres_log()
        && let Ok(text) = std::fs::read_to_string(&log) {
            let pg = pglog::parse(&text);
            let deadlocks: u64 = pg.victims.values().sum();
            let by = pg.victims.iter().map(|(k, v)| format!("{k}: {v}")).collect::<Vec<_>>().join(", ");
            let s = report.section("PostgreSQL log");
            s.push(info("deadlocks detected", deadlocks, format!("victims: {by}")));
            s.push(info("lock waits logged", pg.lock_waits, "waits longer than deadlock_timeout (100 ms)"));
            s.push(report::inv("deadlocks between product sessions", pg.product_deadlocks, "no chaos lock session involved: a lock-order bug"));
            let _ = std::fs::write(config.log_dir.join("postgres.log"), &text);
        }
    if timed_out_clients > 0 {
        report.notes.push(format!("{timed_out_clients} client(s) did not finish within the settle bound"));
    }
    // Evidence file.
    let mut json = report.json();
    json["timeline"] = serde_json::json!(tally.notes().iter().map(|(t, n)| format!("{t:.1}s {n}")).collect::<Vec<_>>());
    json["counters"] = serde_json::json!(tally.all());
    let _ = std::fs::write(config.log_dir.join("report.json"), serde_json::to_vec_pretty(&json)?);
    report.notes.push(format!("evidence and fault timeline: {}", config.log_dir.join("report.json").display()));

    drop(db);
    drop(workload);
    let kept = if config.keep {
        match Arc::try_unwrap(stack) {
            Ok(mut s) => Some(s.keep()),
            Err(_) => Some("could not keep the database (still referenced)".into()),
        }
    } else {
        None
    };
    Ok(Outcome { report, kept })
}

async fn snap_assistant_count(db: &tokio_postgres::Client) -> Result<u64> {
    let n: i64 = db.query_one("SELECT count(*) FROM messages WHERE role = 'assistant'", &[]).await?.get(0);
    Ok(n.max(0) as u64)
}

/// Faults of class `f` injected so far.
fn fault_count(tally: &Tally, f: Fault) -> u64 {
    match f {
        Fault::Freeze => tally.get("fault.freeze_all") + tally.get("fault.freeze_one"),
        Fault::Cut => tally.get("fault.cut_all") + tally.get("fault.cut_one"),
        other => tally.get(&format!("fault.{}", other.name())),
    }
}

/// Chat-completions requests the mock model received.
async fn mock_requests(url: &str) -> Option<u64> {
    let stats: serde_json::Value = reqwest::get(format!("{url}/_mock/stats")).await.ok()?.json().await.ok()?;
    stats["requests"].as_u64()
}

/// `run id -> error` of the worker log lines that fail a run after a database error
/// ("database error in slice; failing the run ... error=<text>"), ANSI colours removed.
fn failure_reasons(log_dir: &std::path::Path) -> std::collections::HashMap<String, String> {
    let mut out = std::collections::HashMap::new();
    let Ok(dir) = std::fs::read_dir(log_dir) else { return out };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("worker-") {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(entry.path()) else { continue };
        for line in text.lines().filter(|l| l.contains("failing the run")) {
            let plain = strip_ansi(line);
            let run = plain.split("run.id=").nth(1).and_then(|r| r.split_whitespace().next()).map(str::to_owned);
            let error = plain.split("error=").nth(1).map(|e| e.trim().to_owned());
            if let (Some(run), Some(error)) = (run, error) {
                out.insert(run, error);
            }
        }
    }
    out
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
