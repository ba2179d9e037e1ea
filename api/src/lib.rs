//! agentloop HTTP API (SPEC §2, §10, §11, §13): authenticates, validates, persists user turns
//! and commands, enqueues runs, serves reads, streams updates (SSE, long-poll) and the web UI.
//! It never calls a model, runs a tool or holds a run.

pub mod error;
pub mod extract;
pub mod hub;
pub mod openapi;
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
    #[arg(long, env = "SSE_HEARTBEAT_MS", default_value = "15000", value_parser = parse_millis)]
    pub sse_heartbeat: Duration,

    /// Live-update transport: auto | sse | long-poll (anything else means auto). With
    /// `long-poll` the SSE route answers 503 `sse_unavailable`.
    #[arg(long, env = "EVENTS_TRANSPORT", default_value = "auto")]
    pub events_transport: String,

    /// Default long-poll wait in ms when the request gives no `timeoutMs`.
    #[arg(long, env = "LONG_POLL_TIMEOUT_MS", default_value = "25000", value_parser = parse_millis)]
    pub long_poll_timeout: Duration,

    /// Maximum JSON request body in bytes.
    #[arg(long, env = "API_MAX_BODY_BYTES", default_value_t = 1024 * 1024)]
    pub max_body_bytes: usize,

    /// HTTP worker threads (default: number of CPUs).
    #[arg(long, env = "API_WORKERS")]
    pub http_workers: Option<usize>,
}

/// Live-update transports (SPEC §10).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Auto,
    Sse,
    LongPoll,
}

impl Transport {
    /// Parses the configured value; invalid values fall back to `auto`.
    pub fn parse(value: &str) -> Self {
        match value.trim().to_ascii_lowercase().as_str() {
            "sse" => Self::Sse,
            "long-poll" | "longpoll" | "long_poll" => Self::LongPoll,
            "auto" => Self::Auto,
            other => {
                tracing::warn!(value = other, "unknown EVENTS_TRANSPORT; using auto");
                Self::Auto
            }
        }
    }

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
    pub pool: PgPool,
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
    pub catalog: ModelCatalog,
    pub hub: Arc<hub::Hub>,
    pub loopback_principal: Option<Principal>,
    pub transport: Transport,
    pub sse_heartbeat: Duration,
    pub long_poll_timeout: Duration,
}

/// A bound, not yet running API server.
pub struct Application {
    port: u16,
    server: Server,
    shutdown: CancellationToken,
}

impl Application {
    /// Connects, optionally migrates, resolves the loopback principal, starts the listener and
    /// binds `config.listen` (port 0 in tests).
    pub async fn build(config: ApiConfig) -> anyhow::Result<Self> {
        if config.db.migrate_on_start {
            db::run_migrations(&config.db.database_url).await.context("migrating")?;
        }
        let pool = db::build_pool(&config.db.database_url, config.db.db_pool_size, "agentloop-api", Duration::from_secs(10))?;
        let catalog = match config.models.catalog() {
            Ok(catalog) => catalog,
            Err(error) => {
                tracing::warn!(%error, "no model configured; chat requests will be refused");
                ModelCatalog { models: Vec::new() }
            }
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
        let hub = Arc::new(hub::Hub::default());
        tokio::spawn(hub.clone().run(config.db.database_url.clone(), shutdown.clone()));
        let state = web::Data::new(AppState {
            pool,
            metrics: agentloop_shared::telemetry::metrics::install(),
            catalog,
            hub,
            loopback_principal,
            transport: Transport::parse(&config.events_transport),
            sse_heartbeat: config.sse_heartbeat,
            long_poll_timeout: config.long_poll_timeout,
        });
        let listener = TcpListener::bind(&config.listen).with_context(|| format!("binding {}", config.listen))?;
        let port = listener.local_addr()?.port();
        let max_body = config.max_body_bytes;
        let mut server = HttpServer::new(move || {
            App::new()
                .app_data(state.clone())
                .app_data(web::JsonConfig::default().limit(max_body).error_handler(error::json_error))
                .app_data(web::QueryConfig::default().error_handler(error::query_error))
                .app_data(web::PathConfig::default().error_handler(error::path_error))
                .wrap(tracing_actix_web::TracingLogger::default())
                .configure(routes::configure)
        })
        .shutdown_timeout(5)
        // SSE events are small writes: without TCP_NODELAY each waits ~35 ms for Nagle/delayed ACK.
        .tcp_nodelay(true)
        .listen(listener)?;
        if let Some(workers) = config.http_workers {
            server = server.workers(workers);
        }
        Ok(Self { port, server: server.run(), shutdown })
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Serves until the server stops (SIGTERM/SIGINT are handled by actix).
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        let result = self.server.await;
        self.shutdown.cancel();
        result
    }
}
