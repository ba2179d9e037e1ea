//! The claim loop (SPEC §5): concurrency, wake-ups, recovery timer, shutdown.
//!
//! Idle, the loop blocks on the LISTEN connection, on a timer for the earliest lease expiry of
//! another worker's run, and on a slow safety poll; it issues no other queue query. A claim pass
//! runs when a `queued:` notification arrives, when a slot frees, when the listener resyncs, or
//! when a timer fires; it claims at most the number of free slots in one statement.
//!
//! Connections: the step pool (`DB_POOL_SIZE`, shared by every slice: waiting for a connection
//! is back-pressure, never a failed run), one dedicated connection each for the lease keeper and
//! the stream flusher, the LISTEN connection, and a two-connection pool for maintenance —
//! whatever the concurrency.

use std::sync::Arc;
use std::time::{Duration, Instant};

use agentloop_shared::db;
use agentloop_shared::events::RUNS_CHANNEL;
use agentloop_shared::provider::client::ProviderClient;
use agentloop_shared::scheduler::listener::{self, ListenerEvent};
use agentloop_shared::scheduler::{self, step};
use agentloop_shared::store::group::GroupSpec;
use agentloop_shared::store::{PoolSettings, Store, Timing};
use agentloop_shared::tasks::spawn_critical as critical;
use agentloop_shared::tools::{BuiltinToolConfig, ToolRegistry, ToolsConfig};
use anyhow::Context;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use uuid::Uuid;

use crate::WorkerConfig;
use crate::control::{self, AbortReason, InFlight, SliceControl};
use crate::slice::{self, SliceEnv};
use crate::streaming::StreamHub;

/// An MCP sign-in whose code exchange started longer ago than this is given up by the sweep
/// (the exchange itself is bounded by 10 s; the api that ran it may have died mid-way).
const SIGNIN_STUCK_AFTER: Duration = Duration::from_secs(60);

/// Runs the worker until `shutdown` fires, then hands in-flight runs back within the grace
/// period.
pub async fn run(config: WorkerConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    config.validate()?;
    let worker_id = crate::worker_identity(config.worker_id.as_deref());
    if let Some(addr) = config.metrics_listen {
        agentloop_shared::telemetry::metrics::serve(addr).context("serving metrics")?;
        agentloop_shared::telemetry::metrics::zero_counters(&[
            ("agentloop_claims_total", &[]),
            ("agentloop_lease_lost_total", &[]),
            ("agentloop_lease_renew_failures_total", &[]),
            ("agentloop_commits_held_total", &[]),
            ("agentloop_stream_flushes_total", &[]),
            ("agentloop_webhook_deliveries_failed_total", &[]),
            ("agentloop_tool_approvals_requested_total", &[]),
            ("agentloop_tool_approvals_expired_total", &[]),
            ("agentloop_slices_total", &[("end", "completed")]),
            ("agentloop_slices_total", &[("end", "failed")]),
            ("agentloop_slices_total", &[("end", "handback")]),
            ("agentloop_slices_total", &[("end", "lease_lost")]),
        ]);
    }
    db::check_url(&config.db.database_url).await?;
    if config.db.migrate_on_start {
        db::run_migrations(&config.db.database_url).await.context("migrating")?;
    }
    db::require_schema(&config.db.database_url).await?;
    let application_name = format!("agentloop-worker {worker_id}");
    let timing = Timing { call_timeout: (config.lease / 3).max(Duration::from_secs(1)), retry_for: config.lease / 2 };
    let settings = PoolSettings {
        database_url: config.db.database_url.clone(),
        application_name: application_name.clone(),
        statement_timeout: Duration::from_secs(30),
        max_size: config.db.db_pool_size,
        wait_timeout: timing.call_timeout,
    };
    // Every worker step sends its notifications right after its commit, not in it (issue 9:
    // notifying commits are serialised by PostgreSQL through their WAL flush; see
    // `Store::with_deferred_notifications`).
    // Checkpoints and slice starts that meet are sent as one statement (issue 9: grouped
    // commits; `agentloop_shared::store::group`).
    // A start's answer carries the thread's whole context: fewer per group.
    let store = Store::with_deferred_notifications(&settings, timing)?.grouping(&[
        GroupSpec { function: "agentloop_commit", group_function: "agentloop_commit_group", max_items: 32 },
        GroupSpec { function: "agentloop_slice_start", group_function: "agentloop_slice_start_group", max_items: 8 },
    ]);
    // Renewals never notify: the keeper needs no flush behind each one.
    let keeper_store = Store::new(
        &PoolSettings { max_size: 1, statement_timeout: config.renew, ..settings.clone() },
        Timing { call_timeout: config.renew, retry_for: config.renew },
    )?;
    let maintenance_pool = db::build_pool(&config.db.database_url, 2, &application_name, Duration::from_secs(30))?;
    // Idle connections of the step and maintenance pools close (their buffers grow with the
    // largest row carried); the lease keeper's and the stream flusher's single connections stay.
    store.reap_idle(config.db.db_pool_idle_timeout);
    db::reap_idle(&maintenance_pool, config.db.db_pool_idle_timeout);
    let catalog = Arc::new(config.models.catalog().context("loading the model catalog")?);
    let mut registry = ToolRegistry::builtin(&BuiltinToolConfig {
        max_sleep_seconds: config.max_sleep_seconds,
        ..BuiltinToolConfig::default()
    });
    let mut tools_source = String::from("builtin");
    if let Some(path) = &config.tools_file {
        let (tools, text) = ToolsConfig::load_with_text(path).context("loading TOOLS_FILE")?;
        registry.configure(&tools);
        tools_source = text;
    }
    if config.test_tools {
        tools_source.push_str("\n+test tools");
    }
    // The fleet should agree on its tools and models: each worker publishes what it runs with,
    // and an alert fires when workers differ (AgentloopWorkersDisagree). Meanwhile every worker
    // applies the strictest tool policy of the live fleet (worker/src/fleet.rs; acceptance probe
    // E: a worker with a laxer tools file ran a payment without approval).
    let tools_fingerprint = agentloop_shared::tools::mcp::fingerprint(&tools_source)[..12].to_owned();
    let models = catalog.models.iter().map(|m| m.id.as_str()).collect::<Vec<_>>().join(",");
    tracing::info!(tools.fingerprint = %tools_fingerprint, %models, "worker configuration");
    metrics::gauge!("agentloop_worker_config_info", "tools" => tools_fingerprint, "models" => models).set(1.0);
    if config.test_tools {
        tracing::warn!("AGENTLOOP_TEST_TOOLS is on: the test tools record_effect and crash_slice are offered");
        crate::test_tools::RecordEffect::install(&maintenance_pool).await;
        registry.register(Arc::new(crate::test_tools::RecordEffect { pool: maintenance_pool.clone() }));
        registry.register(Arc::new(crate::test_tools::CrashSlice));
    }
    for (server, error) in registry.connect_mcp().await {
        tracing::warn!(mcp.server = %server, %error, "MCP server unavailable at start-up; retried when its tools are called");
    }
    let problems = registry.config_problems();
    anyhow::ensure!(problems.is_empty(), "TOOLS_FILE: {}", problems.join("; "));
    let stop = CancellationToken::new();
    let streams = StreamHub::new();
    // The flusher has its own connection: streaming must not queue behind slice starts and
    // checkpoints waiting for the step pool (a thousand slices starting at once).
    let stream_store = Store::with_deferred_notifications(
        &PoolSettings { max_size: 1, ..settings.clone() },
        Timing { call_timeout: timing.call_timeout, retry_for: config.stream_throttle },
    )?;
    let _flusher = AbortOnDropHandle::new(critical("stream flusher", stop.clone(), streams.clone().run(stream_store, worker_id.clone(), config.stream_throttle, stop.clone())));
    let slots_pressure = Arc::new(crate::slot_yield::SlotPressure::new(
        (!config.yield_check.is_zero()).then_some(config.yield_check),
        catalog.models.iter().map(|m| m.id.clone()).collect(),
    ));
    let env = Arc::new(SliceEnv {
        store: store.clone(),
        provider: ProviderClient::with_limits(config.model_stream_idle, config.model_max_answer_bytes),
        catalog,
        tools: Arc::new(registry),
        streams,
        lease: config.lease,
        renew: config.renew,
        tool_call_limit: config.tool_call_limit,
        max_recoveries: config.max_recoveries,
        outage_hold: config.outage_hold,
        approval_timeout: config.approval_timeout,
        schema_tokens_cache: std::sync::Mutex::new(None),
        titles: crate::title::Titles::default(),
        model_retry: config.model_retry,
        slots: slots_pressure.clone(),
        oauth: crate::tool_calls::SignInSettings {
            key: config.oauth.tokens_key().context("OAUTH_TOKENS_KEY")?.map(Arc::new),
            redirect_url: config.oauth.oauth_redirect_url.clone().filter(|u| !u.trim().is_empty()),
            ttl: Duration::from_millis(config.oauth.oauth_signin_ttl_ms.max(1000)),
            client: agentloop_shared::mcp_auth::client(),
        },
    });
    agentloop_shared::tokens::warm_up().await;
    tracing::info!(worker.id = %worker_id, concurrency = config.concurrency, pool = config.db.db_pool_size, "worker started");

    // The fleet's strictest tool policy applies before the first claim (worker/src/fleet.rs).
    match crate::fleet::publish(&store, &worker_id, &env.tools, config.fleet_policy_refresh).await {
        Ok(others) => tracing::info!(others, "tool policy published"),
        Err(error) => tracing::warn!(%error, "could not publish the tool policy; retried every FLEET_POLICY_REFRESH_MS"),
    }
    critical("fleet tool policy", stop.clone(), crate::fleet::run(store.clone(), worker_id.clone(), env.tools.clone(), config.fleet_policy_refresh, stop.clone()));

    let in_flight: InFlight = Arc::default();
    let outages = control::Outages::default();
    let _keeper = AbortOnDropHandle::new(critical("lease keeper", stop.clone(), control::keeper(
        keeper_store,
        worker_id.clone(),
        config.lease,
        config.renew,
        in_flight.clone(),
        outages.clone(),
        stop.clone(),
    )));
    critical("maintenance", stop.clone(), crate::maintenance::run(
        maintenance_pool.clone(),
        crate::maintenance::Retention {
            interval: config.maintenance_interval,
            receipt_hours: config.receipt_retention_hours,
            journal_events: config.journal_retention_events,
            step_hours: config.run_step_retention_hours,
            deleted_thread_hours: config.deleted_thread_retention_hours,
        },
        stop.clone(),
    ));
    if config.metrics_listen.is_some() {
        tokio::spawn(crate::maintenance::sample(maintenance_pool.clone(), stop.clone()));
    }
    critical("hidden-thread sweep", stop.clone(), crate::hidden_threads::run(
        store.clone(),
        config.hidden_thread_sweep,
        config.openai_request_lease,
        config.lease,
        outages.clone(),
        stop.clone(),
    ));
    // Webhook deliveries: woken by the outbox trigger's notification on the same listener.
    let webhook_wake = Arc::new(tokio::sync::Notify::new());
    let secrets_key = config.webhooks.secrets_key().context("WEBHOOK_SECRETS_KEY")?.map(Arc::new);
    let webhook_stop = CancellationToken::new();
    let webhook_dispatcher = tokio::spawn(crate::webhooks::run(
        store.clone(),
        worker_id.clone(),
        crate::webhooks::Settings {
            concurrency: config.webhook_concurrency as usize,
            per_principal: config.webhook_concurrency_per_principal,
            max_attempts: config.webhook_max_attempts,
            retry_base: config.webhook_retry_base,
            retry_max: config.webhook_retry_max,
            timeout: config.webhook_timeout,
            allow_private: config.webhooks.webhook_allow_private_targets,
            safety_poll: config.safety_poll,
            shutdown_grace: config.shutdown_grace,
        },
        secrets_key,
        webhook_wake.clone(),
        webhook_stop.clone(),
    ));
    {
        let (store, stop, interval, hours) =
            (store.clone(), stop.clone(), config.maintenance_interval, config.webhook_delivery_retention_hours);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(interval) => {}
                }
                let deleted = crate::webhooks::prune(&store, hours, &stop).await;
                if deleted > 0 {
                    tracing::info!(deleted, "old webhook deliveries pruned");
                }
            }
        });
    }
    let mut notifications = listener::spawn(
        config.db.database_url.clone(),
        "agentloop-worker-listener",
        vec![RUNS_CHANNEL, agentloop_shared::webhooks::WEBHOOKS_CHANNEL],
        Duration::from_secs(5),
        stop.clone(),
    );
    let mut slices = JoinSet::new();
    let slots = config.concurrency as usize;
    // The worker claims only runs of the models it serves (a fleet in a rolling upgrade may
    // differ): the others wait for a worker that has them.
    let model_ids: Vec<String> = env.catalog.models.iter().map(|m| m.id.clone()).collect();
    let mut pass_wanted = true;
    // After a failed claim pass its answer may have been lost: the next pass re-adopts.
    let mut adopt_next = false;
    // Runs whose slice could not record its end (a transient fault outlasted the retries): the
    // next claim pass takes them back (scheduler::Released). At most one per slice that ended;
    // one the claim did not take (no free slot, its row locked by a statement of the old slice)
    // is named again, in at most RELEASE_PASSES successful passes.
    let mut released: Vec<(scheduler::Released, u32)> = Vec::new();
    // When the last successful claim pass ended and how long it took.
    let mut last_pass: Option<(Instant, Duration)> = None;
    let mut next_timer = config.safety_poll;
    // Approval deadlines (SPEC: undecided approvals expire): swept at start-up, when a run parks
    // (`approval:<id>` notification), and when the earliest known deadline passes.
    let mut approvals_check = true;
    let mut approval_deadline: Option<Instant> = None;

    while !shutdown.is_cancelled() {
        if approvals_check {
            approvals_check = false;
            // The same sweep ends MCP sign-ins that cannot complete on their own (an interrupted
            // exchange, an expired link, one a later token satisfies) and requeues their runs.
            let swept = match step::expire_approvals(&store, 100).await {
                Ok(approvals) => step::sweep_signins(&store, SIGNIN_STUCK_AFTER, 100).await.map(|signins| (approvals, signins)),
                Err(e) => Err(e),
            };
            match swept {
                Ok(((expired, next_ms), (signins, signin_next_ms))) => {
                    if expired > 0 {
                        tracing::info!(expired, "tool approvals expired");
                        metrics::counter!("agentloop_tool_approvals_expired_total").increment(expired as u64);
                        pass_wanted = true;
                    }
                    if signins > 0 {
                        tracing::info!(ended = signins, "MCP sign-ins ended by the sweep; their runs are requeued");
                        pass_wanted = true;
                    }
                    let next_ms = match (next_ms, signin_next_ms) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
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
            let inflight: Vec<Uuid> = in_flight.lock().expect("in-flight lock").keys().copied().collect();
            let started = Instant::now();
            // Slices started by the claim cost one transaction and one round trip less, but the
            // claim pass is serial (one in flight per worker): while passes run back to back they
            // are the worker's bottleneck, and slices starting themselves in parallel finish
            // more runs (bench-scheduler: 280 vs 330 runs/s on 2 cores). So the claim starts
            // slices only while the claim loop has spare time: the gap since the last pass
            // ended is at least as long as that pass took (under half busy).
            // Never right after a failed pass: a claim whose starts fail as a whole (a timeout, a
            // cancelled statement, which no subtransaction catches) must not fail every pass.
            let spare = !adopt_next && last_pass.is_none_or(|(ended, took): (Instant, Duration)| ended.elapsed() >= took);
            let start = (config.claim_starts > 0 && spare).then(|| claim_start_options(&env, config.claim_starts as usize, config.max_recoveries));
            let naming: Vec<scheduler::Released> = released.iter().map(|(r, _)| *r).collect();
            let spared = outages.spare(config.lease);
            let pass = scheduler::Pass {
                owner: &worker_id,
                limit: free,
                lease: config.lease,
                inflight: &inflight,
                released: &naming,
                adopt: adopt_next,
                start: start.as_ref(),
                spare: spared.map(|(d, _)| d),
                models: Some(&model_ids),
            };
            match scheduler::claim(&store, &pass).await {
                Ok(claimed) => {
                    adopt_next = false;
                    outages.succeeded(config.lease);
                    // Taken back, or no longer this worker's to take (claimed meanwhile, ended),
                    // or named often enough: its lease expires and any worker recovers it.
                    released.retain_mut(|(r, passes)| {
                        *passes += 1;
                        *passes < RELEASE_PASSES && !claimed.runs.iter().any(|run| run.id == r.run_id)
                    });
                    last_pass = Some((Instant::now(), started.elapsed()));
                    metrics::histogram!("agentloop_claim_duration_seconds").record(started.elapsed().as_secs_f64());
                    pass_wanted = claimed.runs.len() == free;
                    next_timer = claimed.next_expiry_ms.map_or(config.safety_poll, |ms| {
                        Duration::from_millis(ms.max(0) as u64 + 50).min(config.safety_poll)
                    });
                    if let Some((_, until)) = spared {
                        // The spared runs become claimable when the window ends.
                        next_timer = next_timer.min(until.saturating_duration_since(Instant::now()) + Duration::from_millis(50));
                    }
                    if claimed.queued_left {
                        // A queued run was locked by someone else's transaction: look again soon.
                        next_timer = next_timer.min(Duration::from_millis(100));
                    }
                    let mut starts = claimed.starts;
                    for run in claimed.runs {
                        let claim_start = starts.remove(&run.id);
                        tracing::info!(run.id = %run.id, run.attempt = run.attempts, started = claim_start.is_some(), "claimed");
                        metrics::counter!("agentloop_claims_total").increment(1);
                        let control = SliceControl::new(run.lease_epoch, started);
                        in_flight.lock().expect("in-flight lock").insert(run.id, control.clone());
                        let (env, in_flight) = (env.clone(), in_flight.clone());
                        slices.spawn(async move {
                            let (id, epoch) = (run.id, run.lease_epoch);
                            let released = slice::execute(env, run, control, claim_start).await;
                            // Only this slice's entry: a newer slice of the same run (claimed by
                            // this worker again after the lease expired) must stay renewed.
                            let mut in_flight = in_flight.lock().expect("in-flight lock");
                            if in_flight.get(&id).is_some_and(|c| c.epoch == epoch) {
                                in_flight.remove(&id);
                            }
                            released
                        });
                    }
                }
                Err(error) => {
                    adopt_next = true;
                    outages.failed(started);
                    tracing::warn!(%error, "claim pass failed; retrying");
                    // A lost answer is re-read at once (the next pass re-adopts what it claimed);
                    // a database that stayed away for the store's whole retry window, in a second.
                    next_timer = if matches!(error, agentloop_shared::store::StoreError::OutcomeUnknown(_)) {
                        Duration::from_millis(20)
                    } else {
                        Duration::from_secs(1)
                    };
                }
            }
        }
        env.slots.set_full(slices.len() >= slots);
        let approval_wait = approval_deadline.map_or(next_timer, |d| d.saturating_duration_since(Instant::now()));
        tokio::select! {
            _ = shutdown.cancelled() => break,
            event = notifications.recv() => match event {
                Some(ListenerEvent::Notification { channel, .. }) if channel == agentloop_shared::webhooks::WEBHOOKS_CHANNEL => {
                    webhook_wake.notify_one();
                }
                Some(ListenerEvent::Notification { payload, .. }) => {
                    for entry in payload.split(',') {
                        match entry.split_once(':') {
                            Some(("cancel", id)) => {
                                let control = Uuid::parse_str(id).ok().and_then(|id| in_flight.lock().expect("in-flight lock").get(&id).cloned());
                                if let Some(control) = control {
                                    control.abort(AbortReason::Cancel);
                                }
                            }
                            Some(("approval", _)) => approvals_check = true,
                            _ => {
                                pass_wanted = true;
                                env.slots.queued();
                            }
                        }
                    }
                }
                Some(ListenerEvent::Resync) => {
                    pass_wanted = true;
                    env.slots.queued();
                    webhook_wake.notify_one();
                }
                None => anyhow::bail!("listener task ended"),
            },
            Some(joined) = slices.join_next(), if !slices.is_empty() => {
                match joined {
                    Ok(Some(run)) => released.push((run, 0)),
                    Ok(None) => {}
                    Err(error) => tracing::error!(%error, "a slice task died"),
                }
                pass_wanted = true;
            }
            _ = tokio::time::sleep(next_timer) => pass_wanted = true,
            _ = tokio::time::sleep(approval_wait), if approval_deadline.is_some() => approvals_check = true,
        }
    }

    tracing::info!(in_flight = slices.len(), "shutting down: handing runs back");
    webhook_stop.cancel();
    for control in in_flight.lock().expect("in-flight lock").values() {
        control.abort(AbortReason::Shutdown);
    }
    // Model calls in flight finish and are checkpointed (they are paid for) while the grace
    // period leaves time to hand their runs back; then the ones still streaming are dropped.
    let grace_ends = tokio::time::Instant::now() + config.shutdown_grace;
    let model_calls_end = grace_ends - shutdown_reserve(config.shutdown_grace);
    // A call with external effects already sent is waited for past the grace, up to
    // WORKER_EFFECT_DRAIN_MS from when it was sent: cut, its outcome would be unknown.
    let effects_end = || {
        in_flight
            .lock()
            .expect("in-flight lock")
            .values()
            .filter_map(|c| c.effect_since())
            .map(|since| tokio::time::Instant::from_std(since) + config.effect_drain)
            .max()
    };
    let drained = async {
        let mut model_calls_stopped = false;
        let mut deadline = grace_ends;
        loop {
            tokio::select! {
                joined = slices.join_next() => if joined.is_none() { break Ok(()) },
                _ = tokio::time::sleep_until(deadline) => match effects_end().filter(|end| *end > deadline) {
                    Some(end) => {
                        tracing::info!(wait_ms = end.saturating_duration_since(deadline).as_millis() as u64,
                                       "grace period over; waiting for calls with external effects in flight");
                        deadline = end;
                    }
                    None => break Err(()),
                },
                _ = tokio::time::sleep_until(model_calls_end), if !model_calls_stopped => {
                    model_calls_stopped = true;
                    let controls = in_flight.lock().expect("in-flight lock").values().cloned().collect::<Vec<_>>();
                    tracing::info!(slices = controls.len(), "shutdown grace running short: dropping model calls still streaming");
                    for control in controls {
                        control.stop_model_calls();
                    }
                }
            }
        }
    }
    .await;
    if drained.is_err() {
        tracing::warn!("grace period elapsed with slices still running; their leases will expire");
    }
    // Deliveries in flight had the same grace (they run concurrently with the hand-back).
    if tokio::time::timeout(Duration::from_secs(1), webhook_dispatcher).await.is_err() {
        tracing::warn!("webhook deliveries still in flight at exit; they are sent again after their lease");
    }
    crate::fleet::leave(&store, &worker_id).await;
    stop.cancel();
    Ok(())
}

/// Successful claim passes that name a released run (`scheduler::Released`) before it is left
/// to lease expiry.
const RELEASE_PASSES: u32 = 3;

/// The end of a shutdown's grace period kept for handing runs back after model calls that were
/// let finish (`WORKER_SHUTDOWN_GRACE_MS`): a third of it, at most 3 s.
fn shutdown_reserve(grace: Duration) -> Duration {
    (grace / 3).min(Duration::from_secs(3))
}

/// Size budget of the slice starts one claim answers (their contexts), in bytes: the claim stops
/// starting runs once its answer is this large; the rest start themselves.
const CLAIM_STARTS_MAX_BYTES: i64 = 4 << 20;

/// What a claim pass needs to start slices itself ([`scheduler::claim::StartOptions`]): per
/// configured model, the id recorded on the step, the tool schemas' tokens (as the slice counts
/// them) and the context window.
fn claim_start_options(env: &SliceEnv, limit: usize, max_recoveries: i32) -> scheduler::claim::StartOptions {
    let specs = env.tools.specs();
    let tool_tokens = env.schema_tokens(&specs);
    let models = env
        .catalog
        .models
        .iter()
        .map(|m| {
            let start = scheduler::claim::ModelStart {
                model: m.id.clone(),
                tool_tokens: if m.supports_tools { tool_tokens } else { 0 },
                context_limit: m.context_tokens.map(i64::from),
            };
            (m.id.clone(), start)
        })
        .collect();
    scheduler::claim::StartOptions { limit, max_recoveries, max_bytes: CLAIM_STARTS_MAX_BYTES, models }
}
