//! Command-line/environment option groups that both binaries flatten into their clap parsers.
//! Every option has a long flag and an environment variable; secrets hide their values.

use std::time::Duration;

/// PostgreSQL connection options.
#[derive(Debug, Clone, clap::Args)]
pub struct DbArgs {
    /// PostgreSQL URL, e.g. postgres://agentloop@127.0.0.1:5432/agentloop
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,

    /// Maximum pooled connections of this process (the LISTEN connection is extra).
    #[arg(long, env = "DB_POOL_SIZE", default_value_t = 8)]
    pub db_pool_size: usize,

    /// A pooled connection unused this long is closed (ms; 0 keeps them). A connection that
    /// once carried a large row keeps buffers that size (the PostgreSQL client never shrinks
    /// them), so an idle pool gives that memory back by reconnecting later (`db::reap_idle`).
    #[arg(long, env = "DB_POOL_IDLE_TIMEOUT_MS", default_value = "30000", value_parser = parse_millis)]
    pub db_pool_idle_timeout: Duration,

    /// Apply pending migrations at start-up (under pg_advisory_lock) before serving.
    #[arg(long, env = "MIGRATE_ON_START", default_value_t = false, action = clap::ArgAction::Set)]
    pub migrate_on_start: bool,
}

/// Logging options (`RUST_LOG` selects levels, e.g. `info,agentloop=debug`).
#[derive(Debug, Clone, clap::Args)]
pub struct LogArgs {
    /// Log line format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Parses a duration in milliseconds (clap value parser).
pub fn parse_millis(s: &str) -> Result<Duration, String> {
    s.parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|e| format!("expected milliseconds: {e}"))
}
