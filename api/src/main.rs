//! `agentloop-api`: the HTTP API server and its admin verbs.

use agentloop_api::{ApiConfig, Application};
use agentloop_shared::config::{DbArgs, LogArgs};
use agentloop_shared::{db, telemetry};
use anyhow::Context;
use clap::{Parser, Subcommand};

/// agentloop API: threads, chat commands, reads, live updates and the web UI.
#[derive(Debug, Parser)]
#[command(name = "agentloop-api", version)]
struct Cli {
    #[command(flatten)]
    log: LogArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve HTTP until SIGTERM/SIGINT.
    Run(ApiConfig),
    /// Apply pending database migrations and exit.
    Migrate {
        #[command(flatten)]
        db: DbArgs,
    },
}

#[actix_web::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    telemetry::init(cli.log.log_format);
    match cli.command {
        Command::Run(config) => {
            let app = Application::build(config).await.context("starting the API")?;
            tracing::info!(port = app.port(), "agentloop-api listening");
            app.run_until_stopped().await.context("serving")
        }
        Command::Migrate { db } => {
            let applied = db::run_migrations(&db.database_url).await.context("applying migrations")?;
            tracing::info!(applied = applied.len(), "migrations applied");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn verify_cli() {
        super::Cli::command().debug_assert();
    }
}
