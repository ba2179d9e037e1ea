//! Sweep of the OpenAI endpoint's abandoned hidden threads (issue 12, part 1).
//!
//! `POST /v1/chat/completions` runs on a hidden thread whose api process holds a lease on it
//! (`openai_requests`, renewed every lease/3). When the request ends the api cancels the run and
//! deletes the thread itself; when the api process dies mid-request nobody does — so every
//! worker runs this sweep every `HIDDEN_THREAD_SWEEP_MS`: one indexed probe of
//! `openai_requests` for expired leases; for each, the run is cancelled (its worker aborts at the
//! next safe point) and the thread is deleted once no run of it is active (a later pass). Threads
//! another transaction holds are skipped (SKIP LOCKED), so concurrent sweeps never wait.

use std::time::Duration;

use agentloop_shared::commands;
use agentloop_shared::store::Store;
use tokio_util::sync::CancellationToken;

/// Requests handled per pass.
const BATCH: i64 = 100;

/// Sweeps every `interval` until `shutdown`.
pub async fn run(store: Store, interval: Duration, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        match commands::openai_sweep(&store, BATCH).await {
            Ok((purged, pending, _)) if purged + pending > 0 => {
                tracing::info!(purged, pending, "abandoned hidden threads of the OpenAI endpoint swept");
                metrics::counter!("agentloop_hidden_threads_purged_total").increment(purged as u64);
            }
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "hidden-thread sweep failed; retried at the next pass"),
        }
    }
}
