//! Sweep of the OpenAI endpoint's abandoned hidden threads (issue 12, part 1).
//!
//! `POST /v1/chat/completions` runs on a hidden thread whose api process holds a lease on it
//! (`openai_requests`, renewed every lease/3). When the request ends the api cancels the run and
//! deletes the thread itself; when the api process dies mid-request nobody does — so every
//! worker runs this sweep every `HIDDEN_THREAD_SWEEP_MS`: one indexed probe of
//! `openai_requests` for expired leases; for each, the run is cancelled (its worker aborts at the
//! next safe point) and the thread is deleted once no run of it is active (a later pass). Threads
//! another transaction holds are skipped (SKIP LOCKED), so concurrent sweeps never wait.
//!
//! After a database outage every api's leases look expired, though the apis are alive and
//! waiting for their runs: for a while after an outage this worker saw ([`Outages`]), the sweep
//! spares leases that expired since the outage began, plus one request lease
//! (`OPENAI_REQUEST_LEASE_MS`, as set on the apis) — time for the apis to renew (verification
//! probe G: an outage longer than the request lease cancelled live requests, one after its
//! payment).

use std::time::Duration;

use agentloop_shared::commands;
use agentloop_shared::store::Store;
use tokio_util::sync::CancellationToken;

use crate::control::Outages;

/// Requests handled per pass.
const BATCH: i64 = 100;

/// Sweeps every `interval` until `shutdown`; `request_lease` is the apis' request lease,
/// `lease` the workers' (the outage window of [`Outages`]).
pub async fn run(store: Store, interval: Duration, request_lease: Duration, lease: Duration, outages: Outages, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let started = std::time::Instant::now();
        let spare = outages.spare(request_lease.max(lease)).map_or(Duration::ZERO, |(spare, _)| spare);
        match commands::openai_sweep(&store, BATCH, spare).await {
            Ok((purged, pending, _)) => {
                outages.succeeded(lease);
                if purged + pending > 0 {
                    tracing::info!(purged, pending, "abandoned hidden threads of the OpenAI endpoint swept");
                    metrics::counter!("agentloop_hidden_threads_purged_total").increment(purged as u64);
                }
            }
            Err(error) => {
                if matches!(error, agentloop_shared::store::StoreError::Outage(_) | agentloop_shared::store::StoreError::Unavailable(_)) {
                    outages.failed(started);
                }
                tracing::warn!(%error, "hidden-thread sweep failed; retried at the next pass");
            }
        }
    }
}
