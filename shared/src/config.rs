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
    #[arg(long, env = "DB_POOL_SIZE", default_value_t = 8, value_parser = pool_size)]
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

/// A pool size (`DB_POOL_SIZE`, `DB_COMMAND_POOL_SIZE`): 1 to 10,000 connections (a pool of
/// none answers every request `database_unavailable` while PostgreSQL is healthy: acceptance
/// probe J; a huge one panicked: verification probe L).
pub fn pool_size(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=10_000).contains(&n) => Ok(n),
        Ok(_) => Err("a pool size (DB_POOL_SIZE, DB_COMMAND_POOL_SIZE) must be 1 to 10000 connections".into()),
        Err(e) => Err(format!("a pool size (DB_POOL_SIZE, DB_COMMAND_POOL_SIZE): expected a number of connections: {e}")),
    }
}

/// Parses a duration in milliseconds, 0 to [`MAX_MILLIS`] (clap value parser).
pub fn parse_millis(s: &str) -> Result<Duration, String> {
    millis("a duration", 0, s)
}

/// `s` as milliseconds of setting `name`, `min` to [`MAX_MILLIS`]. The ceiling is far above any
/// sensible setting, so every interval, lease and timeout can be added to a timestamp
/// (verification probe L, L-6: i64::MAX ms made every claim fail and every /v1 request answer 500).
fn millis(name: &str, min: u64, s: &str) -> Result<Duration, String> {
    let ms = s.trim().parse::<u64>().map_err(|e| format!("{name}: expected milliseconds: {e}"))?;
    if ms < min {
        return Err(format!("{name} must be at least {min} ms"));
    }
    if ms > MAX_MILLIS {
        return Err(format!("{name} must be at most {MAX_MILLIS} ms (366 days)"));
    }
    Ok(Duration::from_millis(ms))
}

/// The largest duration setting: 366 days in ms.
pub const MAX_MILLIS: u64 = 366 * 24 * 3600 * 1000;

/// A clap value parser of setting `name`, a duration in milliseconds of at least `min` ms: an interval that
/// drives a timer (`tokio::time::interval` panics on zero, and a heartbeat of 1 ms floods its
/// clients), refused at start with the setting's name instead (acceptance probe J: 
/// `WORKER_RENEW_MS=0` started a worker whose lease keeper had died, and its runs were taken over
/// and their paid answers asked again).
pub fn millis_at_least(name: &'static str, min: u64) -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync + 'static {
    move |s: &str| millis(name, min, s)
}

/// A clap value parser of setting `name`, a count (or a size in bytes) of at least `min`
/// (acceptance probe J, F6: a zero that made every chat, body or live connection refused, or
/// that read as "unlimited", was accepted without a word).
pub fn count_at_least(name: &'static str, min: usize) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    move |s: &str| {
        let n = s.trim().parse::<usize>().map_err(|e| format!("{name}: expected a whole number: {e}"))?;
        if n < min {
            return Err(format!("{name} must be at least {min}"));
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_have_a_floor() {
        let parse = millis_at_least("SOME_MS", 100);
        assert_eq!(parse("250"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("0").unwrap_err(), "SOME_MS must be at least 100 ms");
        assert!(parse("99").is_err() && parse("x").is_err());
    }
}
