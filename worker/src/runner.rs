//! The claim loop (SPEC §5): concurrency, wake-ups, recovery timer, shutdown.
//!
//! Idle, the loop blocks on the LISTEN connection, on a timer for the earliest lease expiry of
//! another worker's run, and on a slow safety poll; it issues no other queue query. A claim pass
//! runs when a `queued:` notification arrives, when a slot frees, when the listener resyncs, or
//! when a timer fires; it claims at most the number of free slots in one statement.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentloop_shared::db::{self, PgPool};
use agentloop_shared::events::RUNS_CHANNEL;
use agentloop_shared::provider::client::ProviderClient;
use agentloop_shared::scheduler::listener::{self, ListenerEvent};
use agentloop_shared::scheduler::{self as sched, claim::next_lease_expiry_ms};
use agentloop_shared::approvals;
use agentloop_shared::tools::{BuiltinToolConfig, ToolRegistry, ToolsConfig};
use anyhow::Context;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::WorkerConfig;
use crate::slice::{self, AbortReason, SliceControl, SliceEnv};

/// Runs the worker until `shutdown` fires, then hands in-flight runs back within the grace
/// period.
pub async fn run(config: WorkerConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    config.validate()?;
    let worker_id = crate::worker_identity(config.worker_id.as_deref());
    if let Some(addr) = config.metrics_listen {
        agentloop_shared::telemetry::metrics::serve(addr).context("serving metrics")?;
    }
    if config.db.migrate_on_start {
        db::run_migrations(&config.db.database_url).await.context("migrating")?;
    }
    let pool = db::build_pool(
        &config.db.database_url,
        config.db.db_pool_size.max(config.concurrency as usize * 2 + 2),
        &format!("agentloop-worker {worker_id}"),
        Duration::from_secs(30),
    )?;
    let catalog = Arc::new(config.models.catalog().context("loading the model catalog")?);
    let mut registry = ToolRegistry::builtin(&BuiltinToolConfig {
        max_sleep_seconds: config.max_sleep_seconds,
        ..BuiltinToolConfig::default()
    });
    if let Some(path) = &config.tools_file {
        registry.configure(&ToolsConfig::load(path).context("loading TOOLS_FILE")?);
    }
    if config.test_tools {
        tracing::warn!("AGENTLOOP_TEST_TOOLS is on: the test tool record_effect is offered");
        crate::test_tools::RecordEffect::install(&pool).await;
        registry.register(Arc::new(crate::test_tools::RecordEffect { pool: pool.clone() }));
    }
    for (server, error) in registry.connect_mcp().await {
        tracing::warn!(mcp.server = %server, %error, "MCP server unavailable at start-up; retried when its tools are called");
    }
    let tools = Arc::new(registry);
    let env = Arc::new(SliceEnv {
        pool: pool.clone(),
        provider: ProviderClient::new(),
        catalog,
        tools,
        lease: config.lease,
        renew: config.renew,
        tool_call_limit: config.tool_call_limit,
        max_recoveries: config.max_recoveries,
        stream_throttle: config.stream_throttle,
        approval_timeout: config.approval_timeout,
    });
    agentloop_shared::tokens::warm_up().await;
    tracing::info!(worker.id = %worker_id, concurrency = config.concurrency, "worker started");

    let listener_stop = CancellationToken::new();
    tokio::spawn(crate::maintenance::run(
        pool.clone(),
        crate::maintenance::Retention {
            interval: config.maintenance_interval,
            receipt_hours: config.receipt_retention_hours,
            journal_events: config.journal_retention_events,
        },
        listener_stop.clone(),
    ));
    let mut notifications =
        listener::spawn(config.db.database_url.clone(), "agentloop-worker-listener", vec![RUNS_CHANNEL], Duration::from_secs(5), listener_stop.clone());
    let in_flight: Arc<Mutex<HashMap<Uuid, SliceControl>>> = Arc::default();
    let mut slices = JoinSet::new();
    let slots = config.concurrency as usize;
    let mut pass_wanted = true;
    let mut next_timer = config.safety_poll;
    // Approval deadlines (SPEC: undecided approvals expire): swept at start-up, when a run parks
    // (`approval:<id>` notification), and when the earliest known deadline passes.
    let mut approvals_check = true;
    let mut approval_deadline: Option<Instant> = None;

    while !shutdown.is_cancelled() {
        if approvals_check {
            approvals_check = false;
            match sweep_approvals(&pool).await {
                Ok((expired, next_ms)) => {
                    if expired > 0 {
                        tracing::info!(expired, "tool approvals expired");
                        metrics::counter!("agentloop_tool_approvals_expired_total").increment(expired as u64);
                        pass_wanted = true;
                    }
                    approval_deadline = next_ms.map(|ms| Instant::now() + Duration::from_millis(ms.max(0) as u64 + 50));
                }
                Err(error) => {
                    tracing::warn!(%error, "approval expiry sweep failed; retrying");
                    approval_deadline = Some(Instant::now() + Duration::from_secs(1));
                }
            }
        }
        if pass_wanted && slices.len() < slots {
            let free = slots - slices.len();
            match claim_pass(&pool, &worker_id, free, config.lease).await {
                Ok((claimed, expiry, skipped)) => {
                    pass_wanted = claimed.len() == free;
                    next_timer = expiry.map_or(config.safety_poll, |ms| {
                        Duration::from_millis(ms.max(0) as u64 + 50).min(config.safety_poll)
                    });
                    if skipped {
                        // A queued run was locked by someone else's transaction: look again soon.
                        next_timer = next_timer.min(Duration::from_millis(100));
                    }
                    for run in claimed {
                        tracing::info!(run.id = %run.id, run.attempt = run.attempts, "claimed");
                        metrics::counter!("agentloop_claims_total").increment(1);
                        let control = SliceControl::default();
                        in_flight.lock().expect("in-flight lock").insert(run.id, control.clone());
                        let (env, in_flight) = (env.clone(), in_flight.clone());
                        slices.spawn(async move {
                            let id = run.id;
                            slice::execute(env, run, control).await;
                            in_flight.lock().expect("in-flight lock").remove(&id);
                        });
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "claim pass failed; retrying");
                    next_timer = Duration::from_secs(1);
                }
            }
        }
        let approval_wait = approval_deadline.map_or(next_timer, |d| d.saturating_duration_since(Instant::now()));
        tokio::select! {
            _ = shutdown.cancelled() => break,
            event = notifications.recv() => match event {
                Some(ListenerEvent::Notification { payload, .. }) => match payload.split_once(':') {
                    Some(("cancel", id)) => {
                        if let Some(control) = Uuid::parse_str(id).ok().and_then(|id| in_flight.lock().expect("in-flight lock").get(&id).cloned()) {
                            control.abort(AbortReason::Cancel);
                        }
                    }
                    Some(("approval", _)) => approvals_check = true,
                    _ => pass_wanted = true,
                },
                Some(ListenerEvent::Resync) => pass_wanted = true,
                None => anyhow::bail!("listener task ended"),
            },
            Some(_) = slices.join_next(), if !slices.is_empty() => pass_wanted = true,
            _ = tokio::time::sleep(next_timer) => pass_wanted = true,
            _ = tokio::time::sleep(approval_wait), if approval_deadline.is_some() => approvals_check = true,
        }
    }

    tracing::info!(in_flight = slices.len(), "shutting down: handing runs back");
    for control in in_flight.lock().expect("in-flight lock").values() {
        control.abort(AbortReason::Shutdown);
    }
    let drained = tokio::time::timeout(config.shutdown_grace, async {
        while slices.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!("grace period elapsed with slices still running; their leases will expire");
    }
    listener_stop.cancel();
    Ok(())
}

/// The approval expiry sweep ([`approvals::expire_due`], one index probe when nothing is due)
/// and the earliest pending deadline in ms from now.
async fn sweep_approvals(pool: &PgPool) -> anyhow::Result<(usize, Option<i64>)> {
    let mut conn = pool.get().await?;
    let expired = approvals::expire_due(&mut conn, 100).await?;
    let next = approvals::next_deadline_ms(&mut conn).await?;
    Ok((expired, next))
}

/// One claim pass: claims up to `free` runs, then reads the earliest lease expiry of runs this
/// worker does not hold (the recovery timer) and whether a queued run was left behind (skipped
/// while locked by another transaction).
async fn claim_pass(
    pool: &PgPool,
    worker_id: &str,
    free: usize,
    lease: Duration,
) -> anyhow::Result<(Vec<agentloop_shared::runs::Run>, Option<i64>, bool)> {
    let mut conn = pool.get().await?;
    let claimed = sched::claim(&mut conn, worker_id, free as i64, lease).await?;
    let expiry = next_lease_expiry_ms(&mut conn, worker_id).await?;
    let skipped = claimed.len() < free && sched::claim::any_queued(&mut conn).await?;
    Ok((claimed, expiry, skipped))
}
