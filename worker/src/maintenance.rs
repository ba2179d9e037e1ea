//! Retention and queue figures: the background work that keeps every table bounded at any age
//! (docs/operations.md "Retention").
//!
//! A pass runs every `MAINTENANCE_INTERVAL_MS` on at most one worker at a time (a session
//! `pg_try_advisory_lock` held on a dedicated connection for the pass; a worker that dies
//! releases it with its session). It runs four tasks, each a loop of bounded batches — one call
//! of one SQL function (migration `2026-12-02-000010_operations`), one short transaction:
//!
//! | task | deletes | function |
//! |---|---|---|
//! | `receipts` | idempotency receipts older than `RECEIPT_RETENTION_HOURS` (SPEC §11: at least 24) | `agentloop_prune_receipts` |
//! | `journal` | each thread's journal events beyond its newest `JOURNAL_RETENTION_EVENTS` (SPEC §10) | `agentloop_prune_journal` |
//! | `steps` | the step rows of runs that ended more than `RUN_STEP_RETENTION_HOURS` ago | `agentloop_prune_steps` |
//! | `threads` | threads soft-deleted more than `DELETED_THREAD_RETENTION_HOURS` ago, children first | `agentloop_purge_threads` |
//!
//! Never one statement over everything: a batch's size adapts so it takes about
//! [`BATCH_TARGET`] (halved when a batch took more than twice that, doubled when it took less
//! than half), and the pass pauses twice as long as each batch took, so pruning uses at most a
//! third of one PostgreSQL backend. Progress is kept in `agentloop_maintenance` after every batch, so a
//! pass interrupted by a restart resumes where it stopped (the journal walk from its last
//! thread, the step walk from its last run; the step walk never restarts, since a run that ended
//! never changes).
//!
//! The worker also samples the queue figures (`agentloop_queue_stats()`: runs per status,
//! expired leases, the oldest queued run, the NOTIFY queue's fill) every [`SAMPLE_INTERVAL`] into
//! gauges when it serves metrics.

use std::time::{Duration, Instant};

use agentloop_shared::db::PgPool;
use diesel::sql_types::{BigInt, Jsonb, Text};
use diesel_async::RunQueryDsl;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// Advisory lock key of the maintenance pass.
const MAINTENANCE_LOCK_KEY: i64 = 0x6167_6d61_696e_7400; // "agmaint"

/// Time one retention batch should take.
pub const BATCH_TARGET: Duration = Duration::from_millis(200);

/// Interval of the queue-figure sample.
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(15);

/// Retention settings.
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    /// Interval between passes.
    pub interval: Duration,
    /// Receipts older than this many hours are deleted (>= 24).
    pub receipt_hours: i64,
    /// Journal events kept per thread (>= 1).
    pub journal_events: i64,
    /// Step rows of runs that ended this many hours ago are deleted.
    pub step_hours: i64,
    /// Threads soft-deleted this many hours ago are deleted with everything under them.
    pub deleted_thread_hours: i64,
}

/// What one pass deleted, per task (rows).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PassReport {
    pub receipts: i64,
    pub journal: i64,
    pub steps: i64,
    pub threads: i64,
    /// Batches run in all.
    pub batches: u64,
}

/// Runs a pass every `retention.interval` (the first one after one interval) until `shutdown`.
pub async fn run(pool: PgPool, retention: Retention, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(retention.interval) => {}
        }
        match pass(&pool, retention, &shutdown).await {
            Ok(Some(report)) => tracing::info!(
                receipts = report.receipts, journal = report.journal, steps = report.steps,
                threads = report.threads, batches = report.batches, "maintenance pass"),
            Ok(None) => tracing::debug!("maintenance pass skipped: another worker holds the lock"),
            Err(error) => tracing::warn!(error = %format!("{error:#}"), "maintenance pass failed; resumed at the next one"),
        }
    }
}

/// Samples the queue figures into gauges every [`SAMPLE_INTERVAL`] until `shutdown`.
pub async fn sample(pool: PgPool, shutdown: CancellationToken) {
    loop {
        if let Err(error) = sample_once(&pool).await {
            tracing::debug!(%error, "queue figures not sampled");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(SAMPLE_INTERVAL) => {}
        }
    }
}

#[derive(diesel::QueryableByName)]
struct JsonRow {
    #[diesel(sql_type = Jsonb)]
    value: Value,
}

async fn sample_once(pool: &PgPool) -> anyhow::Result<()> {
    let mut conn = pool.get().await?;
    let row: JsonRow = diesel::sql_query("SELECT agentloop_queue_stats() AS value").get_result(&mut conn).await?;
    let stats = row.value;
    for status in ["pending", "queued", "running", "expired", "waiting_approval", "blocked"] {
        metrics::gauge!("agentloop_runs", "status" => status).set(stats[status].as_f64().unwrap_or(0.0));
    }
    metrics::gauge!("agentloop_oldest_queued_run_age_seconds").set(stats["oldestQueuedSeconds"].as_f64().unwrap_or(0.0));
    metrics::gauge!("agentloop_notification_queue_usage_ratio").set(stats["notificationQueueUsage"].as_f64().unwrap_or(0.0));
    Ok(())
}

/// One task's batch loop state.
struct Task {
    name: &'static str,
    function: &'static str,
    /// Current batch size (rows), adapted to [`BATCH_TARGET`].
    size: i64,
    min: i64,
    max: i64,
}

impl Task {
    fn new(name: &'static str, function: &'static str) -> Self {
        Self { name, function, size: 1000, min: 50, max: 50_000 }
    }

    /// The function's argument for one batch.
    fn argument(&self, retention: Retention, cursor: &Value) -> Value {
        match self.name {
            "receipts" => json!({"keepHours": retention.receipt_hours.max(24), "limit": self.size}),
            "journal" => json!({"keep": retention.journal_events.max(1), "rows": self.size, "threads": (self.size / 2).clamp(50, 2000), "after": cursor}),
            "steps" => json!({"keepHours": retention.step_hours.max(0), "rows": self.size, "runs": (self.size / 4).clamp(10, 2000), "after": cursor}),
            _ => json!({"keepHours": retention.deleted_thread_hours.max(0), "rows": self.size}),
        }
    }

    /// Halves the batch after a slow one, doubles it after a fast one.
    fn adapt(&mut self, took: Duration) {
        if took > BATCH_TARGET * 2 {
            self.size = (self.size / 2).max(self.min);
        } else if took < BATCH_TARGET / 2 {
            self.size = (self.size * 2).min(self.max);
        }
    }
}

/// One pass over every task; `None` when another worker holds the maintenance lock. Stops early
/// (progress kept) when `shutdown` fires.
pub async fn pass(pool: &PgPool, retention: Retention, shutdown: &CancellationToken) -> anyhow::Result<Option<PassReport>> {
    let mut conn = pool.get().await?;
    #[derive(diesel::QueryableByName)]
    struct Locked {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        locked: bool,
    }
    let lock: Locked = diesel::sql_query("SELECT pg_try_advisory_lock($1) AS locked")
        .bind::<BigInt, _>(MAINTENANCE_LOCK_KEY)
        .get_result(&mut conn)
        .await?;
    if !lock.locked {
        return Ok(None);
    }
    let mut report = PassReport::default();
    let result = async {
        for mut task in [
            Task::new("receipts", "agentloop_prune_receipts"),
            Task::new("journal", "agentloop_prune_journal"),
            Task::new("steps", "agentloop_prune_steps"),
            Task::new("threads", "agentloop_purge_threads"),
        ] {
            let deleted = run_task(&mut conn, &mut task, retention, shutdown, &mut report.batches).await?;
            match task.name {
                "receipts" => report.receipts = deleted,
                "journal" => report.journal = deleted,
                "steps" => report.steps = deleted,
                _ => report.threads = deleted,
            }
            if shutdown.is_cancelled() {
                break;
            }
        }
        anyhow::Ok(())
    }
    .await;
    let _ = diesel::sql_query("SELECT pg_advisory_unlock($1)").bind::<BigInt, _>(MAINTENANCE_LOCK_KEY).execute(&mut conn).await;
    result.map(|()| Some(report))
}

/// Runs `task`'s batches until one reports `done` (or `shutdown`); returns rows deleted.
async fn run_task(
    conn: &mut agentloop_shared::db::PgConn,
    task: &mut Task,
    retention: Retention,
    shutdown: &CancellationToken,
    batches: &mut u64,
) -> anyhow::Result<i64> {
    let state: JsonRow = diesel::sql_query(
        "INSERT INTO agentloop_maintenance (task, pass_started_at) VALUES ($1, now())
         ON CONFLICT (task) DO UPDATE SET pass_started_at = coalesce(agentloop_maintenance.pass_started_at, now())
         RETURNING coalesce(cursor, 'null'::jsonb) AS value",
    )
    .bind::<Text, _>(task.name)
    .get_result(&mut **conn)
    .await?;
    let mut cursor = state.value;
    let mut total = 0;
    loop {
        let started = Instant::now();
        let row: JsonRow = diesel::sql_query(format!("SELECT {}($1) AS value", task.function))
            .bind::<Jsonb, _>(task.argument(retention, &cursor))
            .get_result(&mut **conn)
            .await?;
        let took = started.elapsed();
        *batches += 1;
        let deleted = row.value["deleted"].as_i64().unwrap_or(0);
        let done = row.value["done"].as_bool().unwrap_or(true);
        total += deleted;
        metrics::counter!("agentloop_maintenance_rows_deleted_total", "task" => task.name).increment(deleted.max(0) as u64);
        metrics::histogram!("agentloop_maintenance_batch_duration_seconds", "task" => task.name).record(took.as_secs_f64());
        if let Some(next) = row.value.get("cursor") {
            cursor = next.clone();
        }
        // The journal walk starts again from the first thread at the next pass; the step walk
        // never looks back (a run that ended never changes).
        let saved = if done && task.name == "journal" { Value::Null } else { cursor.clone() };
        diesel::sql_query(
            "UPDATE agentloop_maintenance SET cursor = $2, rows_deleted = rows_deleted + $3, updated_at = now(),
                    last_pass_finished_at = CASE WHEN $4 THEN now() ELSE last_pass_finished_at END,
                    pass_started_at = CASE WHEN $4 THEN NULL ELSE pass_started_at END
              WHERE task = $1",
        )
        .bind::<Text, _>(task.name)
        .bind::<Jsonb, _>(saved)
        .bind::<BigInt, _>(deleted)
        .bind::<diesel::sql_types::Bool, _>(done)
        .execute(&mut **conn)
        .await?;
        if done {
            metrics::gauge!("agentloop_maintenance_last_pass_timestamp_seconds", "task" => task.name)
                .set(agentloop_shared::telemetry::metrics::unix_now());
            return Ok(total);
        }
        task.adapt(took);
        // At most a third of one backend: pause twice as long as the batch took.
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(total),
            _ = tokio::time::sleep(took * 2) => {}
        }
    }
}
