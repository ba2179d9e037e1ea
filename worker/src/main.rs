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
    Run(WorkerConfig),
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
    },
    /// Revoke API keys by their 10-character prefix (as shown at creation) or by the full key.
    RevokeKey {
        #[command(flatten)]
        db: DbArgs,
        /// Key prefix (e.g. al_1a2b3c4) or the whole key.
        #[arg(long)]
        key: String,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    telemetry::init(cli.log.log_format);
    match cli.command {
        Command::Run(config) => {
            let shutdown = CancellationToken::new();
            tokio::spawn(signal_shutdown(shutdown.clone()));
            agentloop_worker::runner::run(config, shutdown).await
        }
        Command::Migrate { db } => {
            let applied = db::run_migrations(&db.database_url).await.context("applying migrations")?;
            tracing::info!(applied = applied.len(), versions = ?applied, "migrations applied");
            Ok(())
        }
        Command::CreateKey { db, principal } => {
            let mut conn = AsyncPgConnection::establish(&db.database_url).await.context("connecting")?;
            let key = auth::create_key(&mut conn, &principal).await.context("creating the key")?;
            println!("{key}");
            Ok(())
        }
        Command::RevokeKey { db, key } => {
            let mut conn = AsyncPgConnection::establish(&db.database_url).await.context("connecting")?;
            let revoked = auth::revoke_key(&mut conn, &key).await.context("revoking")?;
            println!("revoked {revoked} key(s)");
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
