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
    Run(Box<ApiConfig>),
    /// Apply pending database migrations and exit.
    Migrate {
        #[command(flatten)]
        db: DbArgs,
    },
}

/// jemalloc, not glibc's malloc: the api's memory comes in bursts of large, short-lived blocks
/// (a MiB request body, its JSON, the step function's argument and answer). glibc raises its
/// mmap threshold after the first such block is freed, so later ones come from per-thread
/// arenas that are never trimmed: RSS stayed at its peak after clients left (bench-hostile:
/// 70 → 297 → 294 MiB). jemalloc's background threads purge freed pages after
/// `dirty_decay_ms` whatever the process does next: 1 s, compiled in from `.cargo/config.toml`
/// (`JEMALLOC_SYS_WITH_MALLOC_CONF`; `_RJEM_MALLOC_CONF` overrides it at run time).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[actix_web::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Without background threads jemalloc purges only when the process allocates again, so an
    // idle api after a burst would keep its peak.
    if let Err(error) = tikv_jemalloc_ctl::background_thread::write(true) {
        tracing::warn!(%error, "jemalloc background threads unavailable; freed memory returns to the OS only on later allocations");
    }
    match cli.command {
        Command::Run(config) => {
            let _traces = telemetry::init_with_traces(cli.log.log_format, "agentloop-api");
            let app = Application::build(*config).await.context("starting the API")?;
            tokio::spawn(allocator_metrics());
            tracing::info!(port = app.port(), "agentloop-api listening");
            app.run_until_stopped().await.context("serving")
        }
        Command::Migrate { db } => {
            telemetry::init(cli.log.log_format);
            let applied = db::run_migrations(&db.database_url).await.context("applying migrations")?;
            tracing::info!(applied = applied.len(), "migrations applied");
            Ok(())
        }
    }
}

/// `agentloop_allocator_allocated_bytes` (held by live objects) and
/// `agentloop_allocator_resident_bytes` (pages the allocator keeps resident), every 5 s: their
/// gap is memory freed but not yet given back.
async fn allocator_metrics() {
    loop {
        if tikv_jemalloc_ctl::epoch::advance().is_ok()
            && let (Ok(allocated), Ok(resident)) = (tikv_jemalloc_ctl::stats::allocated::read(), tikv_jemalloc_ctl::stats::resident::read())
        {
            metrics::gauge!("agentloop_allocator_allocated_bytes").set(allocated as f64);
            metrics::gauge!("agentloop_allocator_resident_bytes").set(resident as f64);
        }
        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
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
