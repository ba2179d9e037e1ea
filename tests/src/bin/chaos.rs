//! `chaos`: the chaos harness (see `agentloop_tests::chaos`).
//!
//! ```text
//! cargo run --release -p agentloop-tests --bin chaos -- --runs 2000 --seed 42
//!     [--duration 10m] [--workers 3] [--apis 1] [--clients 12]
//!     [--faults all | none | kill,stop,terminate,locks,freeze,cut,restart | all,-restart]
//!     [--fault-interval-ms 1500] [--restarts 2] [--keep] [--no-build]
//! ```
//!
//! It starts a private PostgreSQL cluster, a TCP proxy in front of it, the mock model, an
//! effects receiver, the api and the workers (logs in `test-output/chaos/`), runs a mixed
//! workload while injecting faults, lets everything settle, checks the invariants and prints
//! them as a table. Exit status: 0 when every invariant holds, 1 when one is violated, 2 when
//! the harness itself failed. Run through cargo, it first builds the api/worker/mock binaries
//! of its own profile (skip with `--no-build`).

use std::time::Duration;

use agentloop_tests::bin_dir;
use agentloop_tests::chaos::{self, Config, faults::Fault};
use anyhow::{Context, Result, ensure};
use clap::Parser;

/// Chaos harness: mixed workload + random faults, then invariants as counts.
#[derive(Debug, Parser)]
#[command(name = "chaos")]
struct Args {
    /// Turns to post.
    #[arg(long, default_value_t = 2000)]
    runs: usize,
    /// Seed of every random choice (default: from the clock; printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Stop posting after this long (e.g. 600, 600s, 10m), even if `--runs` is not reached.
    #[arg(long, value_parser = parse_duration)]
    duration: Option<Duration>,
    /// Worker processes.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Api processes (1 or 2).
    #[arg(long, default_value_t = 1)]
    apis: usize,
    /// Concurrent scripted clients.
    #[arg(long, default_value_t = 12)]
    clients: usize,
    /// Fault classes: all, none, or a comma list (kill, stop, terminate, locks, freeze, cut,
    /// restart), each optionally prefixed with `-` to remove it (e.g. `all,-restart`).
    #[arg(long, default_value = "all")]
    faults: String,
    /// Mean pause between two faults, ms.
    #[arg(long, default_value_t = 1500)]
    fault_interval_ms: u64,
    /// PostgreSQL restarts over the run (with the `restart` class).
    #[arg(long, default_value_t = 2)]
    restarts: usize,
    /// Keep the cluster and the database running afterwards (prints how to connect).
    #[arg(long)]
    keep: bool,
    /// Do not build the binaries first.
    #[arg(long)]
    no_build: bool,
    /// Evidence lines printed per violated invariant.
    #[arg(long, default_value_t = 5)]
    examples: usize,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = s.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num.trim().parse().map_err(|e| format!("invalid duration '{s}': {e}"))?;
    Ok(Duration::from_secs_f64(v * mult))
}

fn main() {
    let args = Args::parse();
    let code = match real_main(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("chaos: harness error: {e:#}");
            2
        }
    };
    std::process::exit(code);
}

fn real_main(args: Args) -> Result<i32> {
    if std::env::var_os("CARGO").is_some() && !args.no_build {
        build_binaries()?;
    }
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64 % 1_000_000).unwrap_or(1)
    });
    let mut config = Config::soak(seed);
    config.runs = args.runs;
    config.duration = args.duration;
    config.workers = args.workers.max(1);
    config.apis = args.apis.clamp(1, 2);
    config.clients = args.clients.max(1);
    config.faults = Fault::parse_set(&args.faults)?;
    config.fault_interval_ms = args.fault_interval_ms.max(50);
    config.restarts = args.restarts;
    config.keep = args.keep;
    eprintln!("chaos: seed {seed} (rerun with --seed {seed})");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    // Interrupted: no destructor runs, so kill what was started and remove the cluster.
    runtime.spawn(async {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else { return };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        eprintln!("chaos: interrupted; stopping everything it started");
        chaos::stack::emergency_cleanup();
        std::process::exit(130);
    });
    let outcome = runtime.block_on(chaos::run(config))?;
    println!("{}", outcome.report.table(args.examples));
    if let Some(kept) = &outcome.kept {
        println!("{kept}");
    }
    runtime.shutdown_timeout(Duration::from_secs(5));
    Ok(if outcome.violations() > 0 { 1 } else { 0 })
}

/// Builds `agentloop-api`, `agentloop-worker` and `mock-model` with this binary's profile, so
/// the harness never runs stale binaries.
fn build_binaries() -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let release = bin_dir().ends_with("release");
    let mut cmd = std::process::Command::new(cargo);
    cmd.args(["build", "--bin", "agentloop-api", "--bin", "agentloop-worker", "--bin", "mock-model"]);
    if release {
        cmd.arg("--release");
    }
    eprintln!("chaos: building the binaries ({})", if release { "release" } else { "debug" });
    let status = cmd.current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).status().context("running cargo build")?;
    ensure!(status.success(), "cargo build failed");
    Ok(())
}
