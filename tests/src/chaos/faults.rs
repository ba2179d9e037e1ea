//! Fault injection at random intervals. Classes (each can be switched off with `--faults`):
//!
//! - `kill`: SIGKILL of a random worker, replaced by a new process (new identity) 0-1 s later;
//! - `stop`: SIGSTOP of a random worker, SIGCONT after 0.3-2 s or, half of the time, after more
//!   than the lease (so its runs are recovered by others while it sleeps);
//! - `terminate`: `pg_terminate_backend` of 1-3 random backends of the workers and the api
//!   (pool connections, and a third of the time a `LISTEN` connection), found in
//!   `pg_stat_activity` by `application_name`;
//! - `locks`: a chaos session takes `FOR UPDATE` row locks on a running run's row and its
//!   thread's row, in either order, holding each 100-500 ms, so the product's transactions meet
//!   lock waits and (with `deadlock_timeout` = 100 ms) deadlocks whatever their lock order;
//! - `freeze`: the proxy stops forwarding (sockets stay open) on one connection for 1-6 s or on
//!   all connections for 0.5-4 s;
//! - `cut`: the proxy closes 1-3 random connections, or all of them;
//! - `restart`: PostgreSQL restarts (fast shutdown), `restarts` times, spread over the run.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use nix::sys::signal::Signal;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use tokio_util::sync::CancellationToken;

use super::stack::ChaosStack;
use super::tally::Tally;

/// A fault class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    Kill,
    Stop,
    Terminate,
    Locks,
    Freeze,
    Cut,
    Restart,
}

impl Fault {
    pub const ALL: [Fault; 7] = [Fault::Kill, Fault::Stop, Fault::Terminate, Fault::Locks, Fault::Freeze, Fault::Cut, Fault::Restart];

    pub fn name(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::Stop => "stop",
            Fault::Terminate => "terminate",
            Fault::Locks => "locks",
            Fault::Freeze => "freeze",
            Fault::Cut => "cut",
            Fault::Restart => "restart",
        }
    }

    /// Parses `all`, `none`, or a comma list of names, each optionally prefixed with `-`
    /// (removed from what precedes it), e.g. `all,-restart` or `kill,stop`.
    pub fn parse_set(spec: &str) -> Result<BTreeSet<Fault>> {
        let mut set = BTreeSet::new();
        for (i, part) in spec.split(',').map(str::trim).filter(|p| !p.is_empty()).enumerate() {
            let (remove, name) = match part.strip_prefix('-') {
                Some(n) => (true, n),
                None => (false, part),
            };
            if remove && i == 0 {
                set.extend(Fault::ALL);
            }
            let items: Vec<Fault> = match name {
                "all" => Fault::ALL.to_vec(),
                "none" => Vec::new(),
                other => match Fault::ALL.iter().find(|f| f.name() == other) {
                    Some(f) => vec![*f],
                    None => bail!("unknown fault class '{other}' (known: all, none, {})", Fault::ALL.map(Fault::name).join(", ")),
                },
            };
            for f in items {
                if remove {
                    set.remove(&f);
                } else {
                    set.insert(f);
                }
            }
        }
        Ok(set)
    }
}

/// What to inject and how often.
#[derive(Debug, Clone)]
pub struct FaultPlan {
    pub enabled: BTreeSet<Fault>,
    /// Mean pause between two faults, ms.
    pub mean_interval_ms: u64,
    /// PostgreSQL restarts over the run (when `restart` is enabled).
    pub restarts: usize,
}

/// How far the workload is, for spreading the restarts: `max(accepted / target, elapsed /
/// duration)`.
pub struct Progress {
    pub accepted: Arc<AtomicUsize>,
    pub target: usize,
    pub started: Instant,
    pub duration: Option<Duration>,
}

impl Progress {
    fn fraction(&self) -> f64 {
        let by_runs = self.accepted.load(Ordering::Relaxed) as f64 / self.target.max(1) as f64;
        let by_time = self.duration.map_or(0.0, |d| self.started.elapsed().as_secs_f64() / d.as_secs_f64().max(0.001));
        by_runs.max(by_time)
    }
}

/// Injects faults until `stop` fires.
pub async fn run(stack: Arc<ChaosStack>, plan: FaultPlan, seed: u64, tally: Tally, progress: Progress, stop: CancellationToken) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xfa17_fa17);
    let classes: Vec<Fault> = plan.enabled.iter().copied().filter(|f| *f != Fault::Restart).collect();
    let mut restarts_done = 0usize;
    loop {
        let pause = (plan.mean_interval_ms as f64 * rng.random_range(0.3..1.7)) as u64;
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(pause)) => {}
        }
        if plan.enabled.contains(&Fault::Restart)
            && restarts_done < plan.restarts
            && progress.fraction() >= (restarts_done + 1) as f64 / (plan.restarts + 1) as f64
        {
            restarts_done += 1;
            tally.note("restart PostgreSQL");
            let s = stack.clone();
            let t0 = Instant::now();
            match tokio::task::spawn_blocking(move || s.restart_postgres()).await {
                Ok(Ok(())) => {
                    tally.add("fault.restart", 1);
                    tally.note(format!("PostgreSQL restarted in {:.1}s", t0.elapsed().as_secs_f64()));
                }
                other => {
                    tally.add("fault.restart_failed", 1);
                    tally.note(format!("PostgreSQL restart failed: {other:?}"));
                }
            }
            continue;
        }
        let Some(&class) = classes.choose(&mut rng) else { continue };
        let result = match class {
            Fault::Kill => kill(&stack, &mut rng, &tally, &stop).await,
            Fault::Stop => sigstop(&stack, &mut rng, &tally, &stop),
            Fault::Terminate => terminate(&stack, &mut rng, &tally).await,
            Fault::Locks => locks(&stack, &mut rng, &tally, &stop).await,
            Fault::Freeze => freeze(&stack, &mut rng, &tally, &stop),
            Fault::Cut => cut(&stack, &mut rng, &tally),
            Fault::Restart => Ok(()),
        };
        if let Err(e) = result {
            tally.add(&format!("fault.{}_skipped", class.name()), 1);
            tally.note(format!("{} skipped: {e:#}", class.name()));
        }
    }
}

/// Ends every fault in progress: thaws the proxy, continues stopped workers and replaces
/// missing ones. Returns how many workers were continued.
pub fn heal(stack: &ChaosStack) -> usize {
    stack.proxy.thaw_everything();
    let mut continued = 0;
    let missing = {
        let mut workers = stack.workers.lock().expect("workers lock");
        for w in workers.iter_mut().filter(|w| w.stopped) {
            w.proc.signal(Signal::SIGCONT);
            w.stopped = false;
            continued += 1;
        }
        stack.config.workers.saturating_sub(workers.len())
    };
    for _ in 0..missing {
        let _ = stack.add_worker();
    }
    continued
}

async fn kill(stack: &Arc<ChaosStack>, rng: &mut StdRng, tally: &Tally, stop: &CancellationToken) -> Result<()> {
    let victim = {
        let mut workers = stack.workers.lock().expect("workers lock");
        if workers.is_empty() {
            bail!("no worker");
        }
        let i = rng.random_range(0..workers.len());
        workers.swap_remove(i)
    };
    let (n, pid) = (victim.n, victim.proc.pid());
    victim.proc.signal(Signal::SIGKILL);
    tally.add("fault.kill", 1);
    tally.note(format!("SIGKILL worker w{n} (pid {pid})"));
    let delay = Duration::from_millis(rng.random_range(0..1000));
    let (stack, tally, stop) = (stack.clone(), tally.clone(), stop.clone());
    tokio::spawn(async move {
        let mut victim = victim;
        let _ = tokio::task::spawn_blocking(move || {
            if victim.proc.wait_exit(Duration::from_secs(5)) {
                super::stack::forget_pid(pid);
            }
        })
        .await;
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(delay) => {}
        }
        match stack.add_worker() {
            Ok(m) => tally.note(format!("started worker w{m} to replace w{n}")),
            Err(e) => tally.note(format!("could not replace w{n}: {e:#}")),
        }
    });
    Ok(())
}

fn sigstop(stack: &Arc<ChaosStack>, rng: &mut StdRng, tally: &Tally, stop: &CancellationToken) -> Result<()> {
    let lease = stack.config.lease_ms;
    let past_lease = rng.random_bool(0.5);
    let ms = if past_lease { rng.random_range(lease + 500..=lease + 3000) } else { rng.random_range(300..=2000) };
    let n = {
        let mut workers = stack.workers.lock().expect("workers lock");
        let candidates: Vec<usize> = (0..workers.len()).filter(|&i| !workers[i].stopped).collect();
        let Some(&i) = candidates.choose(rng) else { bail!("every worker is stopped") };
        let w = &mut workers[i];
        w.proc.signal(Signal::SIGSTOP);
        w.stopped = true;
        tally.note(format!("SIGSTOP worker w{} (pid {}) for {ms} ms", w.n, w.proc.pid()));
        w.n
    };
    tally.add("fault.stop", 1);
    if past_lease {
        tally.add("fault.stop_past_lease", 1);
    }
    let (stack, tally, stop) = (stack.clone(), tally.clone(), stop.clone());
    tokio::spawn(async move {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
        }
        let mut workers = stack.workers.lock().expect("workers lock");
        if let Some(w) = workers.iter_mut().find(|w| w.n == n && w.stopped) {
            w.proc.signal(Signal::SIGCONT);
            w.stopped = false;
            tally.note(format!("SIGCONT worker w{n}"));
        }
    });
    Ok(())
}

async fn admin(stack: &ChaosStack) -> Result<tokio_postgres::Client> {
    let url = stack.cluster.as_ref().map(|c| c.admin_url()).unwrap_or_default();
    let (client, conn) = tokio::time::timeout(Duration::from_secs(3), tokio_postgres::connect(&url, tokio_postgres::NoTls)).await??;
    tokio::spawn(conn);
    Ok(client)
}

async fn terminate(stack: &ChaosStack, rng: &mut StdRng, tally: &Tally) -> Result<()> {
    let client = admin(stack).await?;
    let rows = client
        .query(
            "SELECT pid, application_name FROM pg_stat_activity WHERE datname = $1
             AND (application_name LIKE 'agentloop-worker%' OR application_name LIKE 'agentloop-api%') ORDER BY pid",
            &[&stack.db_name],
        )
        .await?;
    let backends: Vec<(i32, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let listeners: Vec<&(i32, String)> = backends.iter().filter(|(_, a)| a.ends_with("-listener")).collect();
    let pooled: Vec<&(i32, String)> = backends.iter().filter(|(_, a)| !a.ends_with("-listener")).collect();
    let victims: Vec<&(i32, String)> = if rng.random_bool(0.35) && !listeners.is_empty() {
        vec![*listeners.choose(rng).expect("non-empty")]
    } else {
        let k = rng.random_range(1..=3).min(pooled.len());
        pooled.choose_multiple(rng, k).copied().collect()
    };
    if victims.is_empty() {
        bail!("no backend to terminate");
    }
    for (pid, app) in victims {
        client.execute("SELECT pg_terminate_backend($1)", &[pid]).await?;
        tally.add("fault.terminate", 1);
        if app.ends_with("-listener") {
            tally.add("fault.terminate_listener", 1);
        }
        tally.note(format!("pg_terminate_backend({pid}) '{app}'"));
    }
    Ok(())
}

async fn locks(stack: &ChaosStack, rng: &mut StdRng, tally: &Tally, stop: &CancellationToken) -> Result<()> {
    let (client, conn) =
        tokio::time::timeout(Duration::from_secs(3), tokio_postgres::connect(&format!("{}?application_name=chaos-locker", stack.db_url), tokio_postgres::NoTls))
            .await??;
    tokio::spawn(conn);
    let row = client
        .query_opt(
            "SELECT id, thread_id FROM runs WHERE status IN ('running', 'queued', 'waiting_approval', 'blocked')
             ORDER BY (status = 'running') DESC, random() LIMIT 1",
            &[],
        )
        .await?;
    let Some(row) = row else { bail!("no active run") };
    let (run, thread): (uuid::Uuid, uuid::Uuid) = (row.get(0), row.get(1));
    let run_first = rng.random_bool(0.5);
    let (hold1, hold2) = (rng.random_range(100..=500u64), rng.random_range(100..=500u64));
    tally.add("fault.locks", 1);
    tally.note(format!(
        "locks on run {run} and thread {thread} ({} first, {hold1}+{hold2} ms)",
        if run_first { "run" } else { "thread" }
    ));
    let (tally, stop) = (tally.clone(), stop.clone());
    tokio::spawn(async move {
        let run_sql = "SELECT 1 FROM runs WHERE id = $1 FOR UPDATE";
        let thread_sql = "SELECT 1 FROM threads WHERE id = $1 FOR UPDATE";
        let (first, second) = if run_first { ((run_sql, run), (thread_sql, thread)) } else { ((thread_sql, thread), (run_sql, run)) };
        let work = async {
            client.batch_execute("BEGIN; SET LOCAL lock_timeout = '3s'").await?;
            client.execute(first.0, &[&first.1]).await?;
            tokio::time::sleep(Duration::from_millis(hold1)).await;
            client.execute(second.0, &[&second.1]).await?;
            tokio::time::sleep(Duration::from_millis(hold2)).await;
            client.batch_execute("COMMIT").await?;
            Ok::<_, tokio_postgres::Error>(())
        };
        let outcome = tokio::select! {
            _ = stop.cancelled() => return,
            r = work => r,
        };
        if let Err(e) = outcome {
            match e.code().map(|c| c.code()) {
                Some("40P01") => tally.add("fault.locks_chaos_deadlock_victim", 1),
                Some("55P03") => tally.add("fault.locks_chaos_lock_timeout", 1),
                _ => tally.add("fault.locks_chaos_error", 1),
            }
        }
    });
    Ok(())
}

fn freeze(stack: &Arc<ChaosStack>, rng: &mut StdRng, tally: &Tally, stop: &CancellationToken) -> Result<()> {
    let all = rng.random_bool(0.4);
    let (stack, tally2, stop) = (stack.clone(), tally.clone(), stop.clone());
    if all {
        let ms = rng.random_range(500..=4000u64);
        stack.proxy.freeze_all(true);
        tally.add("fault.freeze_all", 1);
        tally.note(format!("proxy: freeze all connections for {ms} ms"));
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
            }
            stack.proxy.freeze_all(false);
            tally2.note("proxy: thaw all");
        });
    } else {
        let conns = stack.proxy.connections();
        let Some(&(id, port)) = conns.choose(rng) else { bail!("no connection") };
        let ms = rng.random_range(1000..=6000u64);
        stack.proxy.freeze(id, true);
        tally.add("fault.freeze_one", 1);
        tally.note(format!("proxy: freeze connection {id} (backend client_port {port}) for {ms} ms"));
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
            }
            stack.proxy.freeze(id, false);
        });
    }
    Ok(())
}

fn cut(stack: &ChaosStack, rng: &mut StdRng, tally: &Tally) -> Result<()> {
    if rng.random_bool(0.3) {
        let n = stack.proxy.cut_all();
        tally.add("fault.cut_all", 1);
        tally.note(format!("proxy: cut all {n} connections"));
    } else {
        let conns = stack.proxy.connections();
        let k = rng.random_range(1..=3).min(conns.len());
        if k == 0 {
            bail!("no connection");
        }
        for (id, port) in conns.choose_multiple(rng, k) {
            stack.proxy.cut(*id);
            tally.add("fault.cut_one", 1);
            tally.note(format!("proxy: cut connection {id} (backend client_port {port})"));
        }
    }
    Ok(())
}
