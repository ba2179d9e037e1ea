//! `bench-retention`: tables stay bounded at any age (issue 13).
//!
//! ```text
//! cargo build --release --workspace
//! target/release/bench-retention [--journal-rows 1000000] [--terminal-runs 200000] [--seconds 30] [--rate 20]
//! ```
//!
//! It creates its own database from `TEST_DATABASE_URL` (a superuser URL; default
//! `postgres://postgres@127.0.0.1:5432/postgres`; this machine runs PostgreSQL with autovacuum
//! off and the bench never runs ANALYZE), then:
//!
//! 1. ages it with SQL: `--terminal-runs` runs that ended 40 days ago, one step row each, on
//!    `--terminal-runs / 10` threads whose journals hold `--journal-rows` events in all; 100,000
//!    idempotency receipts two days old; a tenth of those threads soft-deleted 10 days ago;
//! 2. phase A, retention off: the api, 2 workers (`WORKER_CONCURRENCY=4`) and the mock model
//!    serve a steady `--rate` chat posts per second (scripted answers streamed in 3 chunks) for
//!    `--seconds`, while a reader fetches thread windows; it records enqueue -> claim latency
//!    (`runs.started_at - runs.queued_at`, database clock) and window latency (client side);
//! 3. phase B, retention on (pass every second, journal 10 events per thread, steps 720 h,
//!    deleted threads 168 h): the same load until every retention task has finished a pass (at
//!    most 10 minutes), recording the same latencies plus rows deleted per task, pruning rate,
//!    batch durations (from the worker's histogram), and the journal rows the load added;
//! 4. prints both phases, the ratios of claim p99 and window p99 (target: within 20%), and
//!    whether pruning kept up (its deletion rate against the load's insertion rate).
//!
//! Logs: `test-output/bench_retention/`. Everything it starts is stopped and its database
//! dropped at the end.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use agentloop_tests::cluster::sum_metric;
use agentloop_tests::{Client, Stack, StackOptions, free_port, script};
use anyhow::Result;
use clap::Parser;
use serde_json::json;
use uuid::Uuid;

/// Ageing benchmark: retention under load, latencies with and without it.
#[derive(Debug, Clone, Parser)]
#[command(name = "bench-retention")]
struct Args {
    /// Journal rows of the aged threads.
    #[arg(long, default_value_t = 1_000_000)]
    journal_rows: i64,
    /// Terminal runs (ended 40 days ago), one step each.
    #[arg(long, default_value_t = 200_000)]
    terminal_runs: i64,
    /// Seconds of load in phase A (phase B runs until retention finishes, at most 600 s).
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Chat posts per second.
    #[arg(long, default_value_t = 20)]
    rate: u64,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// Latencies of one phase (ms).
#[derive(Default)]
struct Phase {
    claim: Vec<f64>,
    window: Vec<f64>,
    runs: usize,
    seconds: f64,
}

impl Phase {
    fn row(&mut self, name: &str) {
        self.claim.sort_by(f64::total_cmp);
        self.window.sort_by(f64::total_cmp);
        println!(
            "{name:<28} {:>6} runs in {:>5.1} s | enqueue->claim p50 {:>7.1} ms p99 {:>7.1} ms | window p50 {:>6.1} ms p99 {:>6.1} ms ({} reads)",
            self.runs,
            self.seconds,
            percentile(&self.claim, 0.5),
            percentile(&self.claim, 0.99),
            percentile(&self.window, 0.5),
            percentile(&self.window, 0.99),
            self.window.len()
        );
    }
}

async fn age(db: &tokio_postgres::Client, args: &Args) -> Result<()> {
    let threads = (args.terminal_runs / 10).max(1);
    let per_thread = (args.journal_rows / threads).max(1);
    let started = Instant::now();
    db.batch_execute(&format!(
        "INSERT INTO principals (id, name) VALUES ('00000000-0000-0000-0000-0000000000a1', 'aged');
         CREATE TEMP TABLE aged AS SELECT gen_random_uuid() AS id, g AS n FROM generate_series(1, {threads}) g;
         INSERT INTO threads (id, owner_id, title, last_event_sequence, created_at, updated_at, deleted_at)
              SELECT id, '00000000-0000-0000-0000-0000000000a1', 'aged ' || n, {per_thread}, now() - interval '41 days',
                     now() - interval '40 days', CASE WHEN n % 10 = 0 THEN now() - interval '10 days' END FROM aged;
         INSERT INTO thread_events (thread_id, sequence, kind, payload, created_at)
              SELECT a.id, s, 'message', '{{\"sequence\": 1, \"content\": \"an aged event of about a hundred bytes, padded to look like a message\"}}',
                     now() - interval '40 days' FROM aged a, generate_series(1, {per_thread}) s;
         CREATE TEMP TABLE aged_runs AS SELECT gen_random_uuid() AS id, a.id AS thread_id, r
              FROM aged a, generate_series(1, 10) r;
         INSERT INTO runs (id, thread_id, principal_id, status, model, created_at, queued_at, started_at, finished_at, updated_at, steps_used, attempts)
              SELECT id, thread_id, '00000000-0000-0000-0000-0000000000a1', 'completed', 'mock',
                     now() - interval '40 days', now() - interval '40 days', now() - interval '40 days',
                     now() - interval '40 days' + r * interval '1 second', now() - interval '40 days', 1, 1 FROM aged_runs;
         INSERT INTO run_steps (run_id, sequence, idempotency_key, status, attempt, lease_epoch, worker_id, model, started_at, finished_at)
              SELECT id, 1, 'run:' || id || ':step:1', 'completed', 1, 1, 'aged', 'mock', now() - interval '40 days', now() - interval '40 days'
                FROM aged_runs;
         INSERT INTO command_receipts (principal_id, command_id, fingerprint, created_at)
              SELECT '00000000-0000-0000-0000-0000000000a1', 'aged-' || g, 'f', now() - interval '2 days' FROM generate_series(1, 100000) g;"
    ))
    .await?;
    let count = |sql: &'static str| async move { db.query_one(sql, &[]).await.map(|r| r.get::<_, i64>(0)) };
    println!(
        "aged in {:.1} s: {} threads ({} soft-deleted), {} journal rows, {} terminal runs, {} step rows, {} receipts (no ANALYZE; autovacuum: {})",
        started.elapsed().as_secs_f64(),
        count("SELECT count(*) FROM threads").await?,
        count("SELECT count(*) FROM threads WHERE deleted_at IS NOT NULL").await?,
        count("SELECT count(*) FROM thread_events").await?,
        count("SELECT count(*) FROM runs").await?,
        count("SELECT count(*) FROM run_steps").await?,
        count("SELECT count(*) FROM command_receipts").await?,
        db.query_one("SHOW autovacuum", &[]).await?.get::<_, String>(0),
    );
    Ok(())
}

/// Posts `rate` chats per second round-robin over `threads` (FIFO policy) until `stop`, while a
/// reader fetches windows; returns the run ids and the window latencies (ms).
async fn load(client: &Client, threads: &[String], rate: u64, stop: Arc<AtomicBool>) -> (Vec<Uuid>, Vec<f64>) {
    let reader = {
        let (client, threads, stop) = (client.clone(), threads.to_vec(), stop.clone());
        tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let t = Instant::now();
                if let Ok(r) = client.get(&format!("/api/threads/{}", threads[i % threads.len()])).await
                    && r.status == 200
                {
                    lat.push(t.elapsed().as_secs_f64() * 1000.0);
                }
                i += 7;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            lat
        })
    };
    let mut runs = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate.max(1)));
    let mut i = 0;
    let mut posts = tokio::task::JoinSet::new();
    while !stop.load(Ordering::SeqCst) {
        tick.tick().await;
        let (client, thread) = (client.clone(), threads[i % threads.len()].clone());
        i += 1;
        posts.spawn(async move {
            let body = json!({"content": script(json!([{"text": "one two three", "chunkDelayMs": 20}]))});
            let r = client.send(reqwest::Method::POST, &format!("/api/threads/{thread}/chat"), Some(body), &[]).await.ok()?;
            r.body["run"]["id"].as_str().and_then(|id| Uuid::parse_str(id).ok())
        });
        while let Some(Ok(done)) = posts.try_join_next() {
            runs.extend(done);
        }
    }
    while let Some(done) = posts.join_next().await {
        runs.extend(done.ok().flatten());
    }
    (runs, reader.await.unwrap_or_default())
}

async fn claim_latencies(db: &tokio_postgres::Client, runs: &[Uuid]) -> Result<Vec<f64>> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let open: i64 = db.query_one("SELECT count(*) FROM runs WHERE id = ANY($1) AND status NOT IN ('completed', 'failed', 'cancelled')", &[&runs]).await?.get(0);
        if open == 0 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(db
        .query("SELECT extract(epoch FROM started_at - queued_at)::float8 * 1000 FROM runs WHERE id = ANY($1) AND started_at IS NOT NULL", &[&runs])
        .await?
        .iter()
        .map(|r| r.get::<_, f64>(0))
        .collect())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> Result<()> {
    let args = Args::parse();
    let mut stack = Stack::start("bench_retention", StackOptions { workers: 0, ..Default::default() }).await?;
    let db = stack.db.client().await?;
    age(&db, &args).await?;
    let client = stack.client();
    let mut threads = Vec::new();
    for _ in 0..40 {
        let id = client.create_thread().await?;
        client.send(reqwest::Method::PATCH, &format!("/api/threads/{id}"), Some(json!({"metadata": {"multitask": "enqueue"}})), &[]).await?;
        threads.push(id);
    }
    let base = [
        ("WORKER_CONCURRENCY", "4"),
        ("JOURNAL_RETENTION_EVENTS", "10"),
        ("RUST_LOG", "warn,agentloop_worker::maintenance=info"),
    ];

    // Phase A: retention off.
    for _ in 0..2 {
        let mut env = base.to_vec();
        env.push(("MAINTENANCE_INTERVAL_MS", "86400000"));
        stack.add_worker(&env)?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let timer = {
        let stop = stop.clone();
        let secs = args.seconds;
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(secs)).await;
            stop.store(true, Ordering::SeqCst);
        })
    };
    let (runs_a, window_a) = load(&client, &threads, args.rate, stop.clone()).await;
    timer.await?;
    let mut a = Phase { claim: claim_latencies(&db, &runs_a).await?, window: window_a, runs: runs_a.len(), seconds: started.elapsed().as_secs_f64() };
    for w in &mut stack.workers {
        w.signal(agentloop_tests::Sig::SIGTERM);
        w.wait_exit(Duration::from_secs(20));
    }
    stack.workers.clear();

    // Phase B: retention on, same load, until every task finished a pass.
    let metrics_port = free_port();
    for i in 0..2 {
        let listen = format!("127.0.0.1:{}", if i == 0 { metrics_port } else { free_port() });
        let mut env = base.to_vec();
        env.push(("MAINTENANCE_INTERVAL_MS", "1000"));
        env.push(("WORKER_METRICS_LISTEN", listen.as_str()));
        stack.add_worker(&env)?;
    }
    let load_events_before: i64 = db.query_one("SELECT coalesce(sum(last_event_sequence), 0)::bigint FROM threads WHERE title = 'test'", &[]).await?.get(0);
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let watcher = {
        let (stop, url) = (stop.clone(), stack.db.url.clone());
        tokio::spawn(async move {
            let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.expect("connect");
            tokio::spawn(conn);
            let began = Instant::now();
            let mut finished: Vec<(String, f64)> = Vec::new();
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let rows = db
                    .query("SELECT task, rows_deleted FROM agentloop_maintenance WHERE last_pass_finished_at IS NOT NULL ORDER BY task", &[])
                    .await
                    .unwrap_or_default();
                for r in rows {
                    let task: String = r.get(0);
                    if !finished.iter().any(|(t, _)| *t == task) {
                        finished.push((task, began.elapsed().as_secs_f64()));
                    }
                }
                if finished.len() >= 4 || began.elapsed() > Duration::from_secs(600) {
                    // Keep the load a few seconds past the end of the passes for the comparison.
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    stop.store(true, Ordering::SeqCst);
                    return finished;
                }
            }
        })
    };
    let (runs_b, window_b) = load(&client, &threads, args.rate, stop.clone()).await;
    let finished = watcher.await?;
    let seconds_b = started.elapsed().as_secs_f64();
    let mut b = Phase { claim: claim_latencies(&db, &runs_b).await?, window: window_b, runs: runs_b.len(), seconds: seconds_b };
    let load_events_after: i64 = db.query_one("SELECT coalesce(sum(last_event_sequence), 0)::bigint FROM threads WHERE title = 'test'", &[]).await?.get(0);
    let metrics = reqwest::get(format!("http://127.0.0.1:{metrics_port}/metrics")).await?.text().await.unwrap_or_default();

    println!();
    println!("== bench-retention: {} journal rows, {} terminal runs, load {} chats/s", args.journal_rows, args.terminal_runs, args.rate);
    a.row("A: retention off");
    b.row("B: retention running");
    let ratio = |x: f64, y: f64| if x > 0.0 { y / x } else { f64::NAN };
    let claim_ratio = ratio(percentile(&a.claim, 0.99), percentile(&b.claim, 0.99));
    let window_ratio = ratio(percentile(&a.window, 0.99), percentile(&b.window, 0.99));
    let verdict = |r: f64| if r <= 1.2 { "PASS" } else { "FAIL" };
    println!("claim p99 B/A  {claim_ratio:.2}  (target <= 1.20: {})", verdict(claim_ratio));
    println!("window p99 B/A {window_ratio:.2}  (target <= 1.20: {})", verdict(window_ratio));
    let mut total = 0;
    for row in db.query("SELECT task, rows_deleted, last_pass_finished_at IS NOT NULL FROM agentloop_maintenance ORDER BY task", &[]).await? {
        let (task, deleted, done): (String, i64, bool) = (row.get(0), row.get(1), row.get(2));
        total += deleted;
        let at = finished.iter().find(|(t, _)| *t == task).map_or("not finished".to_owned(), |(_, s)| format!("pass finished after {s:.1} s"));
        println!("retention {task:<9} {deleted:>9} rows deleted; {at}{}", if done { "" } else { " (still running)" });
    }
    let batches = sum_metric(&metrics, "agentloop_maintenance_batch_duration_seconds_count", &[]);
    let under_1s = sum_metric(&metrics, "agentloop_maintenance_batch_duration_seconds_bucket", &["le=\"1\""]);
    let under_250 = sum_metric(&metrics, "agentloop_maintenance_batch_duration_seconds_bucket", &["le=\"0.25\""]);
    let added = load_events_after - load_events_before;
    println!(
        "pruning: {total} rows in {seconds_b:.1} s = {:.0} rows/s, against {added} journal rows added by the load ({:.0}/s): keeps up {}x over",
        total as f64 / seconds_b,
        added as f64 / seconds_b,
        if added > 0 { (total / added.max(1)).to_string() } else { "inf".into() }
    );
    println!("batches (worker 1): {batches} in all, {under_250} under 250 ms, {under_1s} under 1 s");
    let dbr = &db;
    let left = |sql: &'static str| async move { dbr.query_one(sql, &[]).await.map(|r| r.get::<_, i64>(0)) };
    println!(
        "left: {} journal rows, {} step rows, {} receipts, {} soft-deleted threads",
        left("SELECT count(*) FROM thread_events").await?,
        left("SELECT count(*) FROM run_steps").await?,
        left("SELECT count(*) FROM command_receipts").await?,
        left("SELECT count(*) FROM threads WHERE deleted_at IS NOT NULL").await?,
    );
    let scans = db.query("SELECT relname::text, seq_scan FROM pg_stat_user_tables WHERE relname IN ('runs', 'threads', 'thread_events') ORDER BY 1", &[]).await?;
    println!(
        "sequential scans (whole run, autovacuum off, never analysed): {}",
        scans.iter().map(|r| format!("{} {}", r.get::<_, String>(0), r.get::<_, i64>(1))).collect::<Vec<_>>().join(", ")
    );
    drop(stack);
    Ok(())
}
