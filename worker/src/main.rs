//! `agentloop-worker`: the worker daemon and admin verbs.

use agentloop_shared::config::{DbArgs, LogArgs};
use agentloop_shared::{auth, db, telemetry};
use agentloop_worker::WorkerConfig;
use anyhow::Context;
use clap::{Parser, Subcommand};
use diesel_async::{AsyncConnection, AsyncPgConnection};
use tokio_util::sync::CancellationToken;

/// agentloop worker: claims agent runs from PostgreSQL under leases and executes them.
#[derive(Debug, Parser)]
#[command(name = "agentloop-worker", version)]
struct Cli {
    #[command(flatten)]
    log: LogArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the worker daemon until SIGTERM/SIGINT.
    Run(Box<WorkerConfig>),
    /// Apply pending database migrations and exit.
    Migrate {
        #[command(flatten)]
        db: DbArgs,
    },
    /// Create an API key for a principal (created if absent); prints only the key.
    CreateKey {
        #[command(flatten)]
        db: DbArgs,
        /// Principal name.
        #[arg(long)]
        principal: String,
        /// A label for the key, shown by `list-keys` (e.g. "laptop", "ci").
        #[arg(long)]
        name: Option<String>,
        /// When the key stops working: an RFC 3339 time (2027-01-31T00:00:00Z) or a duration
        /// from now (90d, 12h). Default: never.
        #[arg(long)]
        expires: Option<String>,
    },
    /// List API keys (never the keys themselves): principal, prefix, name, created, last used
    /// (minute resolution), expires, status.
    ListKeys {
        #[command(flatten)]
        db: DbArgs,
        /// Only this principal's keys.
        #[arg(long)]
        principal: Option<String>,
        /// Include revoked and expired keys.
        #[arg(long, default_value_t = false)]
        all: bool,
        /// One JSON object per line instead of a table.
        #[arg(long, default_value_t = false)]
        json: bool,
    },
    /// Revoke one principal's API keys by the whole key or its first 8 to 10 characters (exits 1
    /// when none matched). Keys of other principals are never touched. Open live-update
    /// connections and browser sessions of a revoked key end within seconds.
    RevokeKey {
        #[command(flatten)]
        db: DbArgs,
        /// The principal whose key it is.
        #[arg(long)]
        principal: String,
        /// Key prefix (e.g. al_1a2b3c4) or the whole key.
        #[arg(long)]
        key_prefix: String,
    },
}

/// jemalloc with background purging, as in the api (`api/src/main.rs`): with glibc's malloc a
/// worker kept the high-water mark of its largest answers for good (idle workers at 300-460 MiB
/// after 4 MB answers and a 40,000-call answer, started at 75; acceptance probe N, N-12).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Err(error) = tikv_jemalloc_ctl::background_thread::write(true) {
        eprintln!("jemalloc background threads unavailable ({error}); freed memory returns to the OS only on later allocations");
    }
    if !matches!(cli.command, Command::Run(_)) {
        telemetry::init(cli.log.log_format);
    }
    match cli.command {
        Command::Run(config) => {
            let _traces = telemetry::init_with_traces(cli.log.log_format, "agentloop-worker");
            let shutdown = CancellationToken::new();
            tokio::spawn(signal_shutdown(shutdown.clone()));
            agentloop_worker::runner::run(*config, shutdown).await
        }
        Command::Migrate { db } => {
            let applied = db::run_migrations(&db.database_url).await.context("applying migrations")?;
            tracing::info!(applied = applied.len(), versions = ?applied, "migrations applied");
            Ok(())
        }
        Command::CreateKey { db, principal, name, expires } => {
            auth::check_name("--principal", &principal).map_err(|e| anyhow::anyhow!(e))?;
            if let Some(name) = &name {
                auth::check_name("--name", name).map_err(|e| anyhow::anyhow!(e))?;
            }
            let expires_at = expires
                .as_deref()
                .map(|text| auth::parse_expiry(text, chrono::Utc::now()))
                .transpose()
                .map_err(|e| anyhow::anyhow!("--expires: {e}"))?;
            let mut conn = AsyncPgConnection::establish(&db.database_url).await.context("connecting")?;
            let key = auth::create_key(&mut conn, &principal, name.as_deref(), expires_at).await.context("creating the key")?;
            println!("{key}");
            Ok(())
        }
        Command::ListKeys { db, principal, all, json } => {
            let mut conn = AsyncPgConnection::establish(&db.database_url).await.context("connecting")?;
            let keys = auth::list_keys(&mut conn, principal.as_deref(), all).await.context("listing keys")?;
            let time = |t: Option<chrono::DateTime<chrono::Utc>>| t.map_or_else(|| "-".to_owned(), |t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string());
            if json {
                for key in &keys {
                    println!("{}", serde_json::to_string(key)?);
                }
            } else {
                println!("{:<16} {:<10} {:<20} {:<20} {:<20} {:<20} STATUS", "PRINCIPAL", "PREFIX", "NAME", "CREATED", "LAST USED", "EXPIRES");
                for k in &keys {
                    println!(
                        "{:<16} {:<10} {:<20} {:<20} {:<20} {:<20} {}",
                        k.principal,
                        k.prefix,
                        k.name.as_deref().unwrap_or("-"),
                        time(Some(k.created_at)),
                        time(k.last_used_at),
                        time(k.expires_at),
                        k.status
                    );
                }
            }
            Ok(())
        }
        Command::RevokeKey { db, principal, key_prefix } => {
            let mut conn = AsyncPgConnection::establish(&db.database_url).await.context("connecting")?;
            let revoked = auth::revoke_key(&mut conn, &principal, &key_prefix).await.context("revoking")?;
            println!("revoked {revoked} key(s)");
            anyhow::ensure!(revoked > 0, "no live key of principal {principal:?} matches {key_prefix:?}");
            Ok(())
        }
    }
}

/// Fires `shutdown` on the first SIGTERM or SIGINT.
async fn signal_shutdown(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
    shutdown.cancel();
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn verify_cli() {
        super::Cli::command().debug_assert();
    }
}
