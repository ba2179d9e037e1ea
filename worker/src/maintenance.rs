//! Periodic housekeeping, run by at most one worker at a time (`pg_try_advisory_xact_lock`):
//! prune command receipts older than their retention (SPEC §11: at least 24 h) and trim every
//! thread's event journal to its newest events (SPEC §10). Not a queue query: it never touches
//! `runs`.

use std::time::Duration;

use agentloop_shared::db::PgPool;
use agentloop_shared::{events, receipts};
use diesel_async::{AsyncConnection, RunQueryDsl};
use tokio_util::sync::CancellationToken;

/// Advisory lock key of the maintenance pass.
const MAINTENANCE_LOCK_KEY: i64 = 0x6167_6d61_696e_7400; // "agmaint"

/// Retention settings.
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    /// Interval between passes.
    pub interval: Duration,
    /// Receipts older than this many hours are deleted (>= 24).
    pub receipt_hours: i64,
    /// Journal events kept per thread.
    pub journal_events: i64,
}

/// Runs a pass every `retention.interval` until `shutdown`.
pub async fn run(pool: PgPool, retention: Retention, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(retention.interval) => {}
        }
        match pass(&pool, retention).await {
            Ok(Some((receipts, events))) => tracing::info!(receipts, events, "maintenance pass"),
            Ok(None) => tracing::debug!("maintenance pass skipped: another worker holds the lock"),
            Err(error) => tracing::warn!(%error, "maintenance pass failed"),
        }
    }
}

/// One pass; `None` when another worker is doing it.
pub async fn pass(pool: &PgPool, retention: Retention) -> anyhow::Result<Option<(usize, usize)>> {
    let mut conn = pool.get().await?;
    let done = (*conn)
        .transaction(async |conn| {
            #[derive(diesel::QueryableByName)]
            struct Locked {
                #[diesel(sql_type = diesel::sql_types::Bool)]
                locked: bool,
            }
            let lock: Locked = diesel::sql_query("SELECT pg_try_advisory_xact_lock($1) AS locked")
                .bind::<diesel::sql_types::BigInt, _>(MAINTENANCE_LOCK_KEY)
                .get_result(conn)
                .await?;
            if !lock.locked {
                return Ok::<_, diesel::result::Error>(None);
            }
            let receipts = receipts::prune(conn, retention.receipt_hours.max(24)).await?;
            let events = events::prune_all(conn, retention.journal_events.max(1)).await?;
            Ok(Some((receipts, events)))
        })
        .await?;
    Ok(done)
}
