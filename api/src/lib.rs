//! agentloop HTTP API (SPEC §2, §10, §11, §13): authenticates, validates, persists user turns
//! and commands, enqueues runs, serves reads, streams updates (SSE, long-poll) and the web UI.
//! It never calls a model, runs a tool or holds a run.

pub mod budget;
pub mod connection;
pub mod error;
pub mod extract;
pub mod hub;
pub mod limits;
pub mod mcp;
pub mod middleware;
pub mod openapi;
pub mod openapi_protocols;
pub mod reads;
pub mod routes;
pub mod validate;
pub mod views;

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::Server;
use actix_web::{App, HttpServer, web};
use agentloop_shared::auth::{self, Principal};
use agentloop_shared::config::{DbArgs, parse_millis};
use agentloop_shared::db::{self, PgPool};
use agentloop_shared::provider::catalog::{ModelArgs, ModelCatalog};
use anyhow::Context;
use tokio_util::sync::CancellationToken;

/// Options of `agentloop-api run`.
#[derive(Debug, Clone, clap::Args)]
pub struct ApiConfig {
    #[command(flatten)]
    pub db: DbArgs,

    #[command(flatten)]
    pub models: ModelArgs,

    /// Address to listen on (port 0 picks a free port).
    #[arg(long, env = "API_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: String,

    /// DEVELOPMENT ONLY: requests from a loopback address without a bearer key act as the
    /// principal `local`.
    #[arg(long, env = "DEV_LOOPBACK_PRINCIPAL", default_value_t = false, action = clap::ArgAction::Set)]
    pub dev_loopback_principal: bool,

    /// SSE heartbeat interval in ms.
    #[arg(long, env = "SSE_HEARTBEAT_MS", default_value = "15000", value_parser = agentloop_shared::config::millis_at_least("SSE_HEARTBEAT_MS", 1000))]
    pub sse_heartbeat: Duration,

    /// Live-update transport: auto | sse | long-poll (anything else stops the api at start). With
    /// `long-poll` the SSE route answers 503 `sse_unavailable`.
    #[arg(long, env = "EVENTS_TRANSPORT", value_enum, default_value = "auto", ignore_case = true)]
    pub events_transport: Transport,

    /// Default long-poll wait in ms when the request gives no `timeoutMs`.
    #[arg(long, env = "LONG_POLL_TIMEOUT_MS", default_value = "25000", value_parser = agentloop_shared::config::millis_at_least("LONG_POLL_TIMEOUT_MS", 100))]
    pub long_poll_timeout: Duration,

    /// Connections of the command pool (the durable write path); reads use `DB_POOL_SIZE`.
    #[arg(long, env = "DB_COMMAND_POOL_SIZE", default_value_t = 4, value_parser = agentloop_shared::config::pool_size)]
    pub db_command_pool_size: usize,

    /// Maximum JSON request body in bytes.
    #[arg(long, env = "API_MAX_BODY_BYTES", default_value_t = 1024 * 1024, value_parser = agentloop_shared::config::count_at_least("API_MAX_BODY_BYTES", 1024))]
    pub max_body_bytes: usize,

    /// The workers' lease duration in ms (`WORKER_LEASE_MS`, read here only to judge a running
    /// run's liveness for clients: `GET /api/runs/{id}` `liveness`).
    #[arg(long = "worker-lease-ms", env = "WORKER_LEASE_MS", default_value = "15000", value_parser = agentloop_shared::config::millis_at_least("WORKER_LEASE_MS", 500))]
    pub worker_lease: Duration,

    /// The workers' lease renewal interval in ms (`WORKER_RENEW_MS`; liveness only, as above).
    #[arg(long = "worker-renew-ms", env = "WORKER_RENEW_MS", default_value = "5000", value_parser = agentloop_shared::config::millis_at_least("WORKER_RENEW_MS", 100))]
    pub worker_renew: Duration,

    /// A queued run no worker claimed for longer than this (ms) is reported `unclaimed`.
    #[arg(long, env = "UNCLAIMED_AFTER_MS", default_value = "10000", value_parser = agentloop_shared::config::millis_at_least("UNCLAIMED_AFTER_MS", 100))]
    pub unclaimed_after: Duration,

    /// HTTP worker threads (default: number of CPUs).
    #[arg(long, env = "API_WORKERS")]
    pub http_workers: Option<usize>,

    /// On SIGTERM/SIGINT, ms during which `/readyz` answers 503 `draining` while everything is
    /// still served, so load balancers stop routing here before the listener closes; then
    /// in-flight requests get 5 s to finish. A second signal stops at once.
    #[arg(long, env = "API_SHUTDOWN_DRAIN_MS", default_value = "5000", value_parser = parse_millis)]
    pub shutdown_drain: Duration,
    /// Lease in ms of a `POST /v1/chat/completions` request on its hidden thread (renewed every
    /// third of it while the request is open); when this process dies the workers' sweep cancels
    /// and deletes the hidden threads whose lease expired.
    #[arg(long, env = "OPENAI_REQUEST_LEASE_MS", default_value = "30000", value_parser = agentloop_shared::config::millis_at_least("OPENAI_REQUEST_LEASE_MS", 1000))]
    pub openai_request_lease: Duration,

    /// Largest `POST /api/threads/import` body in bytes (also the bound of one message).
    #[arg(long, env = "IMPORT_MAX_BYTES", default_value_t = 16 * 1024 * 1024, value_parser = agentloop_shared::config::count_at_least("IMPORT_MAX_BYTES", 1024))]
    pub import_max_bytes: usize,

    /// Most messages one import may hold.
    #[arg(long, env = "IMPORT_MAX_MESSAGES", default_value_t = 10_000, value_parser = agentloop_shared::config::count_at_least("IMPORT_MAX_MESSAGES", 1))]
    pub import_max_messages: usize,
    #[command(flatten)]
    pub hostile: HostileArgs,

    #[command(flatten)]
    pub webhooks: agentloop_shared::webhooks::WebhookArgs,

    /// MCP sign-in: `OAUTH_TOKENS_KEY` (the callback stores tokens with it).
    #[command(flatten)]
    pub oauth: agentloop_shared::mcp_auth::OAuthArgs,

    /// Webhooks per principal (global, counted in PostgreSQL); 429 `too_many_webhooks` above.
    #[arg(long, env = "WEBHOOK_MAX_PER_PRINCIPAL", default_value_t = 20)]
    pub webhook_max_per_principal: u32,
}

/// Bounds against hostile clients (issue 10): rates, per-principal limits, the live-update
/// hub's memory, timeouts. Which are per process and which global: `limits.rs`, README.
#[derive(Debug, Clone, clap::Args)]
pub struct HostileArgs {
    /// Sustained requests per second per principal (per api process); 429 `rate_limited` above.
    #[arg(long, env = "API_RATE_PER_SECOND", default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    pub rate_per_second: u32,
    /// Requests a principal may send at once above the sustained rate (per api process).
    #[arg(long, env = "API_RATE_BURST", default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    pub rate_burst: u32,
    /// Failed authentications per minute per source address (IPv6: per /64) before it gets 429
    /// `too_many_failed_auth` (per api process).
    #[arg(long, env = "AUTH_FAILURES_PER_MINUTE", default_value_t = 20)]
    pub auth_failures_per_minute: u32,
    /// Number of reverse proxies in front of the api whose `X-Forwarded-For` entries are
    /// trusted (0: the TCP peer is the client).
    #[arg(long, env = "TRUSTED_PROXY_HOPS", default_value_t = 0)]
    pub trusted_proxy_hops: usize,
    /// Open SSE/long-poll connections per principal (per api process).
    #[arg(long, env = "LIVE_MAX_PER_PRINCIPAL", default_value_t = 32, value_parser = agentloop_shared::config::count_at_least("LIVE_MAX_PER_PRINCIPAL", 1))]
    pub live_per_principal: usize,
    /// Searches and exports of one principal running at once (per api process); the next
    /// waits up to 10 s, then 429 `too_many_heavy_reads`.
    #[arg(long, env = "HEAVY_READS_PER_PRINCIPAL", default_value_t = 2, value_parser = agentloop_shared::config::count_at_least("HEAVY_READS_PER_PRINCIPAL", 1))]
    pub heavy_reads_per_principal: usize,
    /// Open SSE/long-poll connections of this api process in all.
    #[arg(long, env = "LIVE_MAX_CONNECTIONS", default_value_t = 10_000, value_parser = agentloop_shared::config::count_at_least("LIVE_MAX_CONNECTIONS", 1))]
    pub live_total: usize,
    /// Runs in queued|running|waiting_approval|blocked per principal (global, counted in
    /// PostgreSQL); 429 `too_many_active_runs` above.
    #[arg(long, env = "MAX_ACTIVE_RUNS_PER_PRINCIPAL", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_active_runs: u32,
    /// Pending turns (waiting behind an active run) per principal (global); 429
    /// `too_many_queued_turns` above.
    #[arg(long, env = "MAX_QUEUED_TURNS_PER_PRINCIPAL", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_queued_turns: u32,
    /// Threads (not deleted) per principal (global); 429 `too_many_threads` above.
    #[arg(long, env = "MAX_THREADS_PER_PRINCIPAL", default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_threads: u32,
    /// Bytes of request bodies this api process holds at once (see `budget.rs`): a request
    /// with a body takes its `Content-Length` of it (a chunked one its whole body limit) until
    /// its route has answered; beyond it requests wait, at most `API_BODY_TIMEOUT_MS`, then get
    /// 503 `server_busy`.
    #[arg(long, env = "MAX_BODY_BYTES_IN_FLIGHT", default_value_t = 32 * 1024 * 1024, value_parser = agentloop_shared::config::count_at_least("MAX_BODY_BYTES_IN_FLIGHT", 1024))]
    pub max_body_bytes_in_flight: usize,
    /// A request body must arrive within this many ms (408 `body_timeout`; it is also the
    /// longest wait for the body budget, 503 `server_busy`).
    #[arg(long, env = "API_BODY_TIMEOUT_MS", default_value = "10000", value_parser = agentloop_shared::config::millis_at_least("API_BODY_TIMEOUT_MS", 100))]
    pub body_timeout: Duration,
    /// Longest long-poll wait in ms (a larger `timeoutMs` is cut to it).
    #[arg(long, env = "LONG_POLL_MAX_MS", default_value = "60000", value_parser = agentloop_shared::config::millis_at_least("LONG_POLL_MAX_MS", 100))]
    pub long_poll_max: Duration,
    /// An SSE stream is closed after this many ms (0: never); clients resume with
    /// `Last-Event-ID`. Lets load balancers rebalance long-lived connections.
    #[arg(long, env = "SSE_MAX_STREAM_MS", default_value = "0", value_parser = parse_millis)]
    pub sse_max_stream: Duration,
    /// How often open live-update connections are checked for revoked or expired keys and
    /// ended sessions, in ms.
    #[arg(long, env = "REVOCATION_CHECK_MS", default_value = "2000", value_parser = agentloop_shared::config::millis_at_least("REVOCATION_CHECK_MS", 100))]
    pub revocation_check: Duration,
    /// Browser sessions (`POST /api/session`) last this many ms.
    #[arg(long, env = "SESSION_TTL_MS", default_value = "604800000", value_parser = agentloop_shared::config::millis_at_least("SESSION_TTL_MS", 60000))]
    pub session_ttl: Duration,
    /// Bytes of journal events the live-update hub caches in all.
    #[arg(long, env = "HUB_CACHE_BYTES", default_value_t = 16 * 1024 * 1024)]
    pub hub_cache_bytes: usize,
    /// Bytes of journal events the hub caches per thread.
    #[arg(long, env = "HUB_THREAD_CACHE_BYTES", default_value_t = 512 * 1024)]
    pub hub_thread_cache_bytes: usize,
    /// A live event whose payload is larger is sent slimmed (large members left out, listed in
    /// `omitted`; the client re-reads the row).
    #[arg(long, env = "LIVE_EVENT_MAX_BYTES", default_value_t = 64 * 1024)]
    pub live_event_max_bytes: usize,
}

/// Live-update transports (SPEC §10). A value clap does not know stops the api at start (it
/// fell back to `auto` with a warning: an operator who meant `long-poll` behind a proxy that
/// breaks SSE got SSE — acceptance probe J).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    Auto,
    Sse,
    #[value(alias = "longpoll", alias = "long_poll")]
    LongPoll,
}

impl Transport {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Sse => "sse",
            Self::LongPoll => "long-poll",
        }
    }
}

/// Shared state of every handler.
pub struct AppState {
    /// Reads.
    pub pool: PgPool,
    /// Commands (the durable write path: one step function call each).
    pub store: agentloop_shared::store::Store,
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
    pub catalog: ModelCatalog,
    pub hub: Arc<hub::Hub>,
    pub loopback_principal: Option<Principal>,
    pub transport: Transport,
    pub sse_heartbeat: Duration,
    pub long_poll_timeout: Duration,
    /// Set from SIGTERM until exit: `/readyz` fails so load balancers drain this process.
    pub draining: std::sync::atomic::AtomicBool,
    /// Longest long-poll wait.
    pub long_poll_max: Duration,
    /// SSE streams end after this (zero: never).
    pub sse_max_stream: Duration,
    /// Rate limits and the registry of open live-update connections.
    pub limits: Arc<limits::Limits>,
    /// `TRUSTED_PROXY_HOPS`.
    pub trusted_proxy_hops: usize,
    /// `API_MAX_BODY_BYTES`.
    pub max_body_bytes: usize,
    /// `API_BODY_TIMEOUT_MS`.
    pub body_timeout: Duration,
    /// `MAX_BODY_BYTES_IN_FLIGHT`.
    pub body_budget: budget::BodyBudget,
    /// `IMPORT_MAX_BYTES`: the body limit of `POST /api/threads/import`.
    pub import_max_bytes: usize,
    /// `SESSION_TTL_MS`.
    pub session_ttl: Duration,
    /// Liveness thresholds (ms): the workers' lease and renewal interval, and how long a queued
    /// run may wait before it is reported `unclaimed`.
    pub liveness: Liveness,
    /// Webhook settings (secrets key, private targets, per-principal bound).
    pub webhooks: routes::webhooks::WebhookState,
    /// MCP sign-in settings (tokens key, token-request client).
    pub oauth: routes::oauth::OAuthState,
}

/// Liveness thresholds of `GET /api/runs/{id}` (ms).
#[derive(Debug, Clone, Copy)]
pub struct Liveness {
    pub lease_ms: i64,
    pub renew_ms: i64,
    pub unclaimed_ms: i64,
}

/// A bound, not yet running API server.
pub struct Application {
    port: u16,
    server: Server,
    shutdown: CancellationToken,
    state: web::Data<AppState>,
    drain: Duration,
}

impl Application {
    /// Connects, optionally migrates, resolves the loopback principal, starts the listener and
    /// binds `config.listen` (port 0 in tests).
    pub async fn build(config: ApiConfig) -> anyhow::Result<Self> {
        db::check_url(&config.db.database_url).await?;
        if config.db.migrate_on_start {
            db::run_migrations(&config.db.database_url).await.context("migrating")?;
        }
        db::require_schema(&config.db.database_url).await?;
        let pool = db::build_pool(&config.db.database_url, config.db.db_pool_size, "agentloop-api", Duration::from_secs(10))?;
        let h = &config.hostile;
        // Per-principal bounds counted in PostgreSQL travel as session settings of the command
        // connections (`migrations/…000006_hostile_clients`).
        let limit_options = format!(
            "-c agentloop.max_active_runs={} -c agentloop.max_queued_turns={} -c agentloop.max_threads={}",
            h.max_active_runs, h.max_queued_turns, h.max_threads
        );
        let store = agentloop_shared::store::Store::with_options(
            &agentloop_shared::store::PoolSettings {
                database_url: config.db.database_url.clone(),
                application_name: "agentloop-api".into(),
                statement_timeout: Duration::from_secs(10),
                max_size: config.db_command_pool_size,
                wait_timeout: Duration::from_secs(5),
            },
            // The call waits 2 s past the statement timeout, then cancels its statement and
            // waits for the answer (`store::CANCEL_GRACE`), so a command PostgreSQL cancelled
            // (57014: certainly not committed) is answered as such — 503
            // `database_unavailable` — instead of `outcome_unknown` (acceptance probe N, N-1:
            // a 15 MB import that took PostgreSQL over 10 s answered "may or may not have taken
            // effect", and a client retrying with its key paid the 10 s again each time).
            agentloop_shared::store::Timing { call_timeout: Duration::from_secs(12), retry_for: Duration::from_secs(5) },
            &limit_options,
        )?;
        db::reap_idle(&pool, config.db.db_pool_idle_timeout);
        store.reap_idle(config.db.db_pool_idle_timeout);
        // No model at all: an api may serve reads (chat is refused `no_model`). A model
        // configuration that is there but wrong (a missing MODELS_FILE, a bad MODEL_BASE_URL, an
        // empty MODEL_NAME) stops the start like the worker's does, instead of an api that
        // says it is ready and refuses every chat (acceptance probe J, F5).
        let catalog = match config.models.catalog() {
            Ok(catalog) => catalog,
            Err(agentloop_shared::provider::catalog::CatalogError::NotConfigured) => {
                tracing::warn!("no model configured (MODELS_FILE or MODEL_BASE_URL); chat requests will be refused no_model");
                ModelCatalog { models: Vec::new() }
            }
            Err(error) => return Err(anyhow::anyhow!(error).context("loading the model catalog (MODELS_FILE / MODEL_*)")),
        };
        let loopback_principal = if config.dev_loopback_principal {
            let mut conn = pool.get().await.context("connecting to PostgreSQL")?;
            tracing::warn!("DEV_LOOPBACK_PRINCIPAL is on: loopback requests without a key act as 'local'");
            Some(auth::ensure_principal(&mut conn, auth::LOOPBACK_PRINCIPAL).await?)
        } else {
            None
        };
        agentloop_shared::tokens::warm_up().await;
        let shutdown = CancellationToken::new();
        let hub = Arc::new(hub::Hub::new(hub::HubBounds {
            total_bytes: h.hub_cache_bytes,
            thread_bytes: h.hub_thread_cache_bytes,
            event_bytes: h.live_event_max_bytes,
        }));
        agentloop_shared::tasks::spawn_critical("live-update hub sweep", shutdown.clone(), hub.clone().sweep(shutdown.clone()));
        let limits = Arc::new(limits::Limits::new(limits::LimitSettings {
            rate_per_second: h.rate_per_second,
            rate_burst: h.rate_burst,
            auth_failures_per_minute: h.auth_failures_per_minute,
            live_per_principal: h.live_per_principal,
            live_total: h.live_total,
            heavy_reads_per_principal: h.heavy_reads_per_principal,
        }));
        agentloop_shared::tasks::spawn_critical("live-update listener", shutdown.clone(), hub.clone().run(config.db.database_url.clone(), shutdown.clone()));
        let metrics = agentloop_shared::telemetry::metrics::install();
        agentloop_shared::telemetry::metrics::zero_counters(&[
            ("agentloop_auth_failures_total", &[]),
            ("agentloop_runs_enqueued_total", &[("status", "queued")]),
            ("agentloop_tool_approvals_decided_total", &[("decision", "approved")]),
            ("agentloop_tool_approvals_decided_total", &[("decision", "rejected")]),
            ("agentloop_openai_detached_total", &[]),
            ("agentloop_openai_abandoned_total", &[]),
        ]);
        let state = web::Data::new(AppState {
            pool,
            store,
            metrics,
            catalog,
            hub,
            loopback_principal,
            transport: config.events_transport,
            sse_heartbeat: config.sse_heartbeat,
            long_poll_timeout: config.long_poll_timeout.min(h.long_poll_max),
            long_poll_max: h.long_poll_max,
            sse_max_stream: h.sse_max_stream,
            limits,
            trusted_proxy_hops: h.trusted_proxy_hops,
            max_body_bytes: config.max_body_bytes,
            body_timeout: h.body_timeout,
            body_budget: budget::BodyBudget::new(h.max_body_bytes_in_flight),
            import_max_bytes: config.import_max_bytes,
            session_ttl: h.session_ttl,
            liveness: Liveness {
                lease_ms: config.worker_lease.as_millis() as i64,
                renew_ms: config.worker_renew.as_millis() as i64,
                unclaimed_ms: config.unclaimed_after.as_millis() as i64,
            },
            draining: std::sync::atomic::AtomicBool::new(false),
            webhooks: routes::webhooks::WebhookState {
                key: config.webhooks.secrets_key().context("WEBHOOK_SECRETS_KEY")?,
                allow_private: config.webhooks.webhook_allow_private_targets,
                max_per_principal: config.webhook_max_per_principal,
            },
            oauth: routes::oauth::OAuthState {
                key: config.oauth.tokens_key().context("OAUTH_TOKENS_KEY")?,
                client: agentloop_shared::mcp_auth::client(),
            },
        });
        let app_state = state.clone();
        agentloop_shared::tasks::spawn_critical("revocation check", shutdown.clone(), limits::revocation_loop(state.clone(), h.revocation_check, shutdown.clone()));
        let hidden = routes::openai::hidden::HiddenRequests::new(state.store.clone(), state.pool.clone(), state.hub.clone(), config.openai_request_lease);
        agentloop_shared::tasks::spawn_critical("/v1 request lease keeper", shutdown.clone(), hidden.clone().keeper(shutdown.clone()));
        let hidden = web::Data::from(hidden);
        let mcp = web::Data::new(mcp::service(state.clone(), config.max_body_bytes));
        let import_limits = web::Data::new(routes::threads::import_thread::ImportLimits {
            max_bytes: config.import_max_bytes,
            max_messages: config.import_max_messages,
        });
        let listener = TcpListener::bind(&config.listen).with_context(|| format!("binding {}", config.listen))?;
        let port = listener.local_addr()?.port();
        let max_body = config.max_body_bytes;
        let mut server = HttpServer::new(move || {
            App::new()
                .app_data(state.clone())
                .app_data(hidden.clone())
                .app_data(mcp.clone())
                .app_data(import_limits.clone())
                .app_data(web::JsonConfig::default().limit(max_body).error_handler(error::json_error))
                .app_data(web::QueryConfig::default().error_handler(error::query_error))
                .app_data(web::PathConfig::default().error_handler(error::path_error))
                .wrap(actix_web::middleware::from_fn(middleware::edge))
                // Outermost: OpenAI's error shape on `/v1/*` for every error, also the edge's
                // own refusals (415, invalid JSON, 413) and unknown `/v1/` paths (issue 12).
                .wrap(actix_web::middleware::from_fn(routes::openai::openai_errors))
                .configure(routes::configure)
        })
        .shutdown_timeout(5)
        // SSE events are small writes: without TCP_NODELAY each waits ~35 ms for Nagle/delayed ACK.
        .tcp_nodelay(true)
        // Waiting requests notice a departed client by its socket (connection.rs).
        .on_connect(connection::on_connect)
        // Signals are handled by `run_until_stopped` (drain first, then stop).
        .disable_signals()
        .listen(listener)?;
        if let Some(workers) = config.http_workers {
            server = server.workers(workers);
        }
        Ok(Self { port, server: server.run(), shutdown, state: app_state, drain: config.shutdown_drain })
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Serves until SIGTERM/SIGINT: then `/readyz` fails for `API_SHUTDOWN_DRAIN_MS` while
    /// everything else is still served (load balancers take the process out of rotation), then
    /// the listener closes and in-flight requests get 5 s (SSE streams end; clients resume on
    /// another process with `Last-Event-ID`). A second signal skips the drain.
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        let handle = self.server.handle();
        let (state, drain) = (self.state.clone(), self.drain);
        tokio::spawn(async move {
            use tokio::signal::unix::{SignalKind, signal};
            let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
                tracing::error!("cannot handle SIGTERM/SIGINT");
                return;
            };
            tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
            state.draining.store(true, std::sync::atomic::Ordering::SeqCst);
            metrics::gauge!("agentloop_draining").set(1.0);
            tracing::info!(drain_ms = drain.as_millis() as u64, "shutting down: /readyz fails while load balancers drain this process");
            tokio::select! {
                _ = tokio::time::sleep(drain) => {}
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::info!("closing the listener; in-flight requests get 5 s");
            handle.stop(true).await;
        });
        let result = self.server.await;
        self.shutdown.cancel();
        result
    }
}

impl AppState {
    /// How a new run picks its model: `requested` (already validated), else the thread's, else
    /// the server's default, refused at once when the server does not configure it.
    pub fn model_choice(&self, requested: Option<String>) -> agentloop_shared::commands::ModelChoice {
        agentloop_shared::commands::ModelChoice {
            model: requested,
            default_model: self.catalog.default_model().map(|m| m.id.clone()),
            models: self.catalog.models.iter().map(|m| m.id.clone()).collect(),
        }
    }
}

/// A user turn's content with its accounting (tokens: 4 per message plus the text's estimate).
pub fn turn(content: &serde_json::Value) -> agentloop_shared::commands::Turn {
    let text = agentloop_shared::messages::content_text(content);
    let message = agentloop_shared::messages::NewMessage {
        role: agentloop_shared::messages::role::USER.into(),
        content: content.clone(),
        tool_calls: None,
        tool_call_id: None,
        reasoning: None,
        token_estimate: (4 + agentloop_shared::tokens::estimate_text(&text)) as i32,
        stopped: false,
        finish_reason: None,
    };
    agentloop_shared::commands::Turn { byte_size: message.byte_size(), token_estimate: message.token_estimate, content: content.clone() }
}
