//! The hidden threads of `POST /v1/chat/completions` and their lifetime (issue 12, part 1).
//!
//! Each request runs on a hidden thread (`metadata.stateless`) created with its run and a lease
//! row (`openai_requests`) in one transaction (`agentloop_openai_start`). This process holds the
//! lease: ONE keeper task renews every open request of the process in one statement every
//! lease/3. A [`HiddenRequest`] is the handle of one request:
//! - [`HiddenRequest::finish`] after the answer: the run is cancelled if still active and the
//!   thread deleted (`agentloop_openai_finish`); a stateless API keeps no conversation — except
//!   the record of an external effect the client cannot know about (a call of unknown outcome;
//!   a request not answered after a call took effect): that thread is kept (migration 000029);
//! - dropping it unfinished (the client disconnected, the handler future was dropped) does the
//!   same from a spawned task: the run is cancelled at once — a running run's worker aborts at
//!   its next safe point — and the thread is deleted as soon as the run has ended;
//! - if this process dies, its leases expire and the workers' sweep (`HIDDEN_THREAD_SWEEP_MS`)
//!   cancels the runs and deletes the threads.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentloop_shared::commands;
use agentloop_shared::db::PgPool;
use agentloop_shared::runs;
use agentloop_shared::store::Store;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Longest time a released request waits for its cancelled run to end before leaving the
/// deletion to the workers' sweep.
const RELEASE_WAIT: Duration = Duration::from_secs(60);

/// The open requests of this process and their lease.
pub struct HiddenRequests {
    /// This process's identity in `openai_requests.holder`.
    pub holder: String,
    /// Lease of a request; renewed every third of it.
    pub lease: Duration,
    store: Store,
    pool: PgPool,
    open: Mutex<HashSet<Uuid>>,
}

impl HiddenRequests {
    /// A registry for this process (`holder` = `<host>-<pid>-<random>`).
    pub fn new(store: Store, pool: PgPool, lease: Duration) -> Arc<Self> {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "api".into());
        let holder = format!("{host}-{}-{:06x}", std::process::id(), Uuid::new_v4().as_u128() & 0xff_ffff);
        Arc::new(Self { holder, lease, store, pool, open: Mutex::new(HashSet::new()) })
    }

    /// Renews every open request every lease/3 until `shutdown`.
    pub async fn keeper(self: Arc<Self>, shutdown: CancellationToken) {
        let every = self.lease / 3;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let threads: Vec<Uuid> = self.open.lock().expect("hidden requests lock").iter().copied().collect();
            if threads.is_empty() {
                continue;
            }
            if let Err(error) = commands::openai_renew(&self.store, &self.holder, self.lease.as_millis() as u64, &threads).await {
                tracing::warn!(%error, requests = threads.len(), "renewing the leases of open OpenAI requests failed; retried");
            }
        }
    }

    /// Creates the hidden thread with `messages`, its run and the lease (one transaction), and
    /// returns the request's handle with the `{threadId, run}` answer.
    pub async fn start(
        self: &Arc<Self>,
        principal: Uuid,
        model: &str,
        messages: &[agentloop_shared::messages::NewMessage],
        client_tools: &[Value],
    ) -> Result<(HiddenRequest, Value), super::V1Error> {
        let created =
            commands::openai_start(&self.store, principal, model, messages, client_tools, &self.holder, self.lease.as_millis() as u64)
                .await?;
        let id = |v: &Value| v.as_str().and_then(|s| Uuid::parse_str(s).ok());
        let (Some(thread_id), Some(run_id)) = (id(&created["threadId"]), id(&created["run"]["id"])) else {
            return Err(crate::error::ApiError::Internal(anyhow::anyhow!("agentloop_openai_start returned {created}")).into());
        };
        self.open.lock().expect("hidden requests lock").insert(thread_id);
        metrics::gauge!("agentloop_openai_open_requests").increment(1.0);
        Ok((HiddenRequest { registry: self.clone(), principal, thread_id, run_id, done: false }, created))
    }

    fn close(&self, thread_id: Uuid) {
        if self.open.lock().expect("hidden requests lock").remove(&thread_id) {
            metrics::gauge!("agentloop_openai_open_requests").decrement(1.0);
        }
    }

    /// Cancels and deletes the hidden thread (or keeps it: `delivered`, see
    /// [`commands::openai_finish`]); when its run is still ending, waits for it (up to
    /// [`RELEASE_WAIT`]) and deletes it then.
    async fn release(self: Arc<Self>, principal: Uuid, thread_id: Uuid, run_id: Uuid, delivered: bool) {
        let deadline = tokio::time::Instant::now() + RELEASE_WAIT;
        loop {
            match commands::openai_finish(&self.store, principal, thread_id, delivered).await {
                Ok(true) => return,
                Ok(false) => {}
                Err(error) => tracing::warn!(%error, thread.id = %thread_id, "releasing a hidden thread failed; retrying"),
            }
            // Wait for the cancelled run to end (a running one ends at its worker's next safe point).
            loop {
                if tokio::time::Instant::now() >= deadline {
                    tracing::warn!(thread.id = %thread_id, "the cancelled run of a hidden thread has not ended; the workers' sweep deletes it");
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                let Ok(mut conn) = self.pool.get().await else { continue };
                match runs::get(&mut conn, run_id).await {
                    Ok(run) if run.is_terminal() => break,
                    Ok(_) => {}
                    Err(diesel::result::Error::NotFound) => return,
                    Err(_) => {}
                }
            }
        }
    }
}

/// One open request (see the module docs).
pub struct HiddenRequest {
    registry: Arc<HiddenRequests>,
    pub principal: Uuid,
    pub thread_id: Uuid,
    pub run_id: Uuid,
    done: bool,
}

impl HiddenRequest {
    /// The request ended: cancel what is still active and delete the thread (in the background
    /// when the run still has to end). `answered`: the client got the run's answer — else (an
    /// error, a timeout) a thread whose tool calls took effect is kept, as the record of what
    /// the client was not told ([`commands::openai_finish`]).
    pub async fn finish(mut self, answered: bool) {
        self.done = true;
        self.registry.close(self.thread_id);
        match commands::openai_finish(&self.registry.store, self.principal, self.thread_id, answered).await {
            Ok(true) => {}
            Ok(false) | Err(_) => {
                tokio::spawn(self.registry.clone().release(self.principal, self.thread_id, self.run_id, answered));
            }
        }
    }
}

impl Drop for HiddenRequest {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        self.registry.close(self.thread_id);
        tracing::info!(thread.id = %self.thread_id, run.id = %self.run_id, "OpenAI request abandoned by its client: cancelling its run");
        metrics::counter!("agentloop_openai_abandoned_total").increment(1);
        tokio::spawn(self.registry.clone().release(self.principal, self.thread_id, self.run_id, false));
    }
}
