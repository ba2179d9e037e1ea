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
//!
//! A request sent with an `Idempotency-Key` (migration 000036) has a receipt: a resend of it
//! while it runs *attaches* to the same run ([`Started::Open`] with the next attachment, in any
//! api process), one after it ended gets its recorded outcome ([`Started::Replay`]). Its client
//! going away does not cancel the run: the handle *detaches* — the run goes on to its end, its
//! outcome is recorded on the receipt for the resend the client's SDK is about to make, and the
//! request ends as above. Only the newest attachment ends the request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentloop_shared::commands::{self, OpenAiKey};
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
    pub(super) store: Store,
    pub(super) pool: PgPool,
    pub(super) hub: Arc<crate::hub::Hub>,
    /// Open requests of this process by hidden thread, with how many handles (attachments) of
    /// this process hold each.
    open: Mutex<HashMap<Uuid, usize>>,
}

/// What [`HiddenRequests::start`] found or made.
pub enum Started {
    /// A new request, or a resend of a keyed one in flight attached to it.
    Open(HiddenRequest),
    /// A resend of a keyed request that ended: its recorded `{status, body}`.
    Replay(Value),
    /// A resend of a keyed request that its api's death ended after a tool call took effect:
    /// its thread was kept as the record, and it is not run again.
    Interrupted { thread_id: Uuid, run_id: Uuid },
}

impl HiddenRequests {
    /// A registry for this process (`holder` = `<host>-<pid>-<random>`).
    pub fn new(store: Store, pool: PgPool, hub: Arc<crate::hub::Hub>, lease: Duration) -> Arc<Self> {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "api".into());
        let holder = format!("{host}-{}-{:06x}", std::process::id(), Uuid::new_v4().as_u128() & 0xff_ffff);
        Arc::new(Self { holder, lease, store, pool, hub, open: Mutex::new(HashMap::new()) })
    }

    /// Renews every open request every lease/3 until `shutdown`.
    pub async fn keeper(self: Arc<Self>, shutdown: CancellationToken) {
        let every = self.lease / 3;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let threads: Vec<Uuid> = self.open.lock().expect("hidden requests lock").keys().copied().collect();
            if threads.is_empty() {
                continue;
            }
            if let Err(error) = commands::openai_renew(&self.store, &self.holder, self.lease.as_millis() as u64, &threads).await {
                tracing::warn!(%error, requests = threads.len(), "renewing the leases of open OpenAI requests failed; retried");
            }
        }
    }

    /// Creates the hidden thread with `messages`, its run and the lease (one transaction), and
    /// returns the request's handle; with `key`, a resend attaches, replays or is refused (see
    /// [`Started`]).
    pub async fn start(
        self: &Arc<Self>,
        principal: Uuid,
        model: &str,
        messages: &[agentloop_shared::messages::NewMessage],
        client_tools: &[Value],
        settings: &Value,
        key: Option<OpenAiKey<'_>>,
    ) -> Result<Started, super::V1Error> {
        let keyed = key.is_some();
        let created = commands::openai_start(
            &self.store,
            principal,
            model,
            messages,
            client_tools,
            settings,
            &self.holder,
            self.lease.as_millis() as u64,
            key,
        )
        .await?;
        let id = |v: &Value| v.as_str().and_then(|s| Uuid::parse_str(s).ok());
        if let Some(recorded) = created.get("replay") {
            return Ok(Started::Replay(recorded.clone()));
        }
        if let Some(i) = created.get("interrupted") {
            if let (Some(thread_id), Some(run_id)) = (id(&i["threadId"]), id(&i["runId"])) {
                return Ok(Started::Interrupted { thread_id, run_id });
            }
        }
        let (Some(thread_id), Some(run_id), Some(attachment)) =
            (id(&created["threadId"]), id(&created["run"]["id"]), created["attachment"].as_i64())
        else {
            return Err(crate::error::ApiError::Internal(anyhow::anyhow!("agentloop_openai_start returned {created}")).into());
        };
        if created["attached"].as_bool() == Some(true) {
            tracing::info!(thread.id = %thread_id, run.id = %run_id, attachment, "OpenAI request resent with its Idempotency-Key: attached to its run");
            metrics::counter!("agentloop_openai_attached_total").increment(1);
        }
        self.hold(thread_id);
        let model = created["run"]["model"].as_str().unwrap_or(model).to_owned();
        Ok(Started::Open(HiddenRequest { registry: self.clone(), principal, thread_id, run_id, attachment, keyed, model, done: false }))
    }

    fn hold(&self, thread_id: Uuid) {
        let mut open = self.open.lock().expect("hidden requests lock");
        let n = open.entry(thread_id).or_insert(0);
        if *n == 0 {
            metrics::gauge!("agentloop_openai_open_requests").increment(1.0);
        }
        *n += 1;
    }

    fn close(&self, thread_id: Uuid) {
        let mut open = self.open.lock().expect("hidden requests lock");
        if let Some(n) = open.get_mut(&thread_id) {
            *n -= 1;
            if *n == 0 {
                open.remove(&thread_id);
                metrics::gauge!("agentloop_openai_open_requests").decrement(1.0);
            }
        }
    }

    /// A keyed request whose client went away: the run goes on to its end (still renewed by this
    /// process), its outcome is recorded for the resend, and the request ends — unless a newer
    /// attachment holds it by then, which ends it instead.
    async fn detach(self: Arc<Self>, request: Detached) {
        let Detached { principal, thread_id, run_id, attachment, model } = request;
        let ended = super::chat_completions::wait_for_end(&self.pool, &self.store, &self.hub, principal, thread_id, run_id).await;
        let response = match ended {
            Ok(run) => {
                let chunker = super::stream::Chunker::new(run_id, &model, false);
                super::chat_completions::ended(&self.pool, &self.store, &chunker, thread_id, run_id, &run).await
            }
            Err(error) => Err(error),
        };
        let recorded = super::chat_completions::recorded(&response);
        self.close(thread_id);
        self.release(principal, thread_id, run_id, false, Some(attachment), Some(recorded)).await;
    }

    /// Cancels and deletes the hidden thread (or keeps it: `delivered`, see
    /// [`commands::openai_finish`]; `attachment` and `response` as there); when its run is still
    /// ending, waits for it (up to [`RELEASE_WAIT`]) and deletes it then.
    async fn release(
        self: Arc<Self>,
        principal: Uuid,
        thread_id: Uuid,
        run_id: Uuid,
        delivered: bool,
        attachment: Option<i64>,
        response: Option<Value>,
    ) {
        let deadline = tokio::time::Instant::now() + RELEASE_WAIT;
        loop {
            match commands::openai_finish(&self.store, principal, thread_id, delivered, attachment, response.as_ref()).await {
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

/// What a detached keyed request needs to finish.
struct Detached {
    principal: Uuid,
    thread_id: Uuid,
    run_id: Uuid,
    attachment: i64,
    model: String,
}

/// One open request (see the module docs).
pub struct HiddenRequest {
    registry: Arc<HiddenRequests>,
    pub principal: Uuid,
    pub thread_id: Uuid,
    pub run_id: Uuid,
    /// Which attachment of the request this handle is (1 for the request that started it).
    attachment: i64,
    /// Sent with an `Idempotency-Key`: its outcome is recorded, and its client going away
    /// detaches it instead of cancelling the run.
    keyed: bool,
    /// The run's model (for a recorded completion).
    pub model: String,
    done: bool,
}

impl HiddenRequest {
    /// Whether the request has a receipt whose outcome [`Self::finish`] records.
    pub fn keyed(&self) -> bool {
        self.keyed
    }

    /// The request ended: cancel what is still active and delete the thread (in the background
    /// when the run still has to end). `answered`: the client got the run's answer — else (an
    /// error, a timeout) the thread's title says it was not ([`commands::openai_finish`]).
    /// `response` (`{status, body}`, keyed requests): the outcome a resend of the key gets.
    pub async fn finish(mut self, answered: bool, response: Option<Value>) {
        self.done = true;
        self.registry.close(self.thread_id);
        let attachment = self.keyed.then_some(self.attachment);
        let response = response.filter(|_| self.keyed);
        match commands::openai_finish(&self.registry.store, self.principal, self.thread_id, answered, attachment, response.as_ref()).await {
            Ok(true) => {}
            Ok(false) | Err(_) => {
                tokio::spawn(self.registry.clone().release(self.principal, self.thread_id, self.run_id, answered, attachment, response));
            }
        }
    }
}

impl Drop for HiddenRequest {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if self.keyed {
            // Still held (renewed) until the detached task ends it.
            tracing::info!(thread.id = %self.thread_id, run.id = %self.run_id, "OpenAI request with an Idempotency-Key left by its client: its run goes on for a resend");
            metrics::counter!("agentloop_openai_detached_total").increment(1);
            let detached = Detached {
                principal: self.principal,
                thread_id: self.thread_id,
                run_id: self.run_id,
                attachment: self.attachment,
                model: std::mem::take(&mut self.model),
            };
            tokio::spawn(self.registry.clone().detach(detached));
            return;
        }
        self.registry.close(self.thread_id);
        tracing::info!(thread.id = %self.thread_id, run.id = %self.run_id, "OpenAI request abandoned by its client: cancelling its run");
        metrics::counter!("agentloop_openai_abandoned_total").increment(1);
        tokio::spawn(self.registry.clone().release(self.principal, self.thread_id, self.run_id, false, None, None));
    }
}
