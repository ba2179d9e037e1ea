//! The durable write path (issue 9: "a step is a value, committed once").
//!
//! Every durable step — a claim, a lease renewal, a slice start, a checkpoint, a streaming
//! flush, and every API command that changes a thread's runs — is computed in memory as a JSON
//! value and applied by ONE PostgreSQL function (`migrations/2026-12-01-000005_durable_core`) in
//! ONE statement: one transaction, one round trip, the statement prepared once per connection,
//! the lock order (thread, then runs, then approvals/operations) and the fence built into the
//! function, at most one notification per channel — sent in the step's transaction, or, for the
//! workers' steps ([`Store::with_deferred_notifications`]), by a statement pipelined right
//! behind it so that steps share WAL flushes. [`Store::call`] is the only way in: it
//! cleans NUL characters out of the value, bounds each attempt by a timeout, classifies
//! failures once ([`fault`]) and retries what is safe to retry until the caller's deadline.
//!
//! The typed steps live with their protocol: [`crate::scheduler`] (claim, lease, slice start,
//! checkpoint, streaming) and [`crate::commands`] (API commands).

pub mod fault;
pub mod group;
pub mod pool;

use std::time::{Duration, Instant};

use backon::BackoffBuilder;
use serde_json::Value;

pub use fault::Fault;
pub use pool::{CallOutcome, PoolSettings, StoreConn, StorePool};

/// Whether a call may be sent again when its outcome is unknown (the connection broke after
/// the statement may have been sent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replay {
    /// Applying the same value twice has the effect of applying it once (worker steps carry a
    /// commit id; claims re-adopt; commands with an idempotency key replay their receipt).
    Safe,
    /// A second application would repeat the effect: an unknown outcome is reported as such.
    Unsafe,
}

/// A failed call, after the retries [`Store::call`] was allowed to make.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// A step function refused the command (HTTP `status`, stable `code`).
    #[error("{code}: {message}")]
    Refused { status: u16, code: String, message: String },
    /// The call kept failing with transient faults until the deadline; the last one was a
    /// [`Fault::Retry`]: possibly this call's own doing (a statement timeout, a deadlock).
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// The database was unavailable to every caller until the deadline (the last fault was a
    /// [`Fault::Outage`]: connections lost or refused, shutdown, read-only, disk full, no
    /// connection): nothing about the call is to blame.
    #[error("database unavailable: {0}")]
    Outage(String),
    /// The connection broke while a replay-unsafe command may have been committed.
    #[error("the outcome is unknown: {0}")]
    OutcomeUnknown(String),
    /// A constraint, data or programming error: retrying would fail the same way.
    #[error("database error {sqlstate}: {message}")]
    Deterministic { sqlstate: String, message: String },
}

/// How long a call that outlived its timeout is waited for after its cancel request was sent
/// ([`Store`]'s `attempt`): the server answers a cancelled statement at its next interrupt check,
/// well within this unless it is unreachable.
pub const CANCEL_GRACE: Duration = Duration::from_secs(2);

/// Timing of [`Store`] calls.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Longest wait for one attempt's answer; then the statement is cancelled and waited for
    /// [`CANCEL_GRACE`] more before its outcome is taken as unknown (and its connection
    /// discarded).
    pub call_timeout: Duration,
    /// Default deadline for a call's retries (commands); worker steps pass their own.
    pub retry_for: Duration,
}

/// The durable write path's connections and call discipline. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    pool: StorePool,
    timing: Timing,
    /// Step functions whose calls are grouped ([`Store::grouping`]), by name.
    groups: std::sync::Arc<std::collections::HashMap<&'static str, group::Grouper>>,
}

impl Store {
    /// A store over a new pool (no connection opened yet).
    pub fn new(settings: &PoolSettings, timing: Timing) -> anyhow::Result<Self> {
        Ok(Self { pool: pool::build(settings)?, timing, groups: Default::default() })
    }

    /// A store whose connections carry extra session settings (`-c name=value ...`), e.g. the
    /// api's per-principal limits read by the triggers of `migrations/…000006_hostile_clients`.
    pub fn with_options(settings: &PoolSettings, timing: Timing, extra_options: &str) -> anyhow::Result<Self> {
        Ok(Self { pool: pool::build_with(settings, extra_options, false)?, timing, groups: Default::default() })
    }

    /// A store whose calls send their notifications right after their commit instead of in it
    /// (the workers' steps; see [`StoreConn::call_json`] and
    /// `migrations/…000018_deferred_notify`): steps then share WAL flushes.
    pub fn with_deferred_notifications(settings: &PoolSettings, timing: Timing) -> anyhow::Result<Self> {
        Ok(Self { pool: pool::build_with(settings, "", true)?, timing, groups: Default::default() })
    }

    /// This store, with the replay-safe calls of each spec's function grouped: calls that wait
    /// while an earlier group runs are sent together as one call of its group function
    /// (`{items: [arg, ...]}` -> `[result, ...]`), see [`group`]. Needs a tokio runtime (one
    /// task per spec).
    pub fn grouping(self, specs: &[group::GroupSpec]) -> Self {
        let inner = Self { groups: Default::default(), ..self.clone() };
        let groups = specs.iter().map(|&spec| (spec.function, group::Grouper::spawn(inner.clone(), spec))).collect();
        Self { groups: std::sync::Arc::new(groups), ..self }
    }

    /// Closes this store's connections unused for `idle` ([`crate::db::reap_idle`]).
    pub fn reap_idle(&self, idle: Duration) {
        crate::db::reap_idle(&self.pool, idle);
    }

    /// The configured timing.
    pub fn timing(&self) -> Timing {
        self.timing
    }

    /// Pool status for metrics: `(size, available, waiting)`.
    pub fn pool_status(&self) -> (usize, usize, usize) {
        let s = self.pool.status();
        (s.size, s.available, s.waiting)
    }

    /// Calls step function `function` with `arg`, retrying transient faults (and unknown
    /// outcomes when `replay` is [`Replay::Safe`]) with exponential backoff and jitter until
    /// `deadline` (default: now + `timing.retry_for`).
    ///
    /// Errors: [`StoreError::Refused`] (the function's business refusal), `Deterministic`,
    /// `Unavailable` (deadline passed), `OutcomeUnknown` (replay-unsafe call lost mid-flight).
    pub async fn call(&self, function: &'static str, arg: &Value, replay: Replay, deadline: Option<Instant>) -> Result<Value, StoreError> {
        self.call_with(function, arg, replay, deadline, true).await
    }

    /// [`Store::call`] for a step that is known to send no notification (a claim that starts no
    /// slice): on a store with deferred notifications no flush statement is pipelined behind it
    /// (one transaction less per claim; a notification it did send would go out in its own
    /// transaction, as on any other store).
    pub async fn call_quiet(&self, function: &'static str, arg: &Value, replay: Replay, deadline: Option<Instant>) -> Result<Value, StoreError> {
        self.call_with(function, arg, replay, deadline, false).await
    }

    async fn call_with(&self, function: &'static str, arg: &Value, replay: Replay, deadline: Option<Instant>, defer: bool) -> Result<Value, StoreError> {
        let deadline = deadline.unwrap_or_else(|| Instant::now() + self.timing.retry_for);
        let arg = crate::text::clean_json(arg);
        if let Some(grouper) = self.groups.get(function).filter(|_| defer && replay == Replay::Safe) {
            return grouper.call(arg.into_owned(), deadline).await;
        }
        let mut delays = backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(20))
            .with_max_delay(Duration::from_secs(1))
            .with_jitter()
            .without_max_times()
            .build();
        loop {
            let fault = match self.attempt(function, &arg, defer).await {
                Ok(value) => return Ok(value),
                Err(fault) => fault,
            };
            let label = match &fault {
                Fault::Refused { status, code, message } => {
                    return Err(StoreError::Refused { status: *status, code: code.clone(), message: message.clone() });
                }
                Fault::Deterministic { sqlstate, message } => {
                    tracing::error!(db.function = function, db.sqlstate = %sqlstate, error = %message, "step function failed");
                    return Err(StoreError::Deterministic { sqlstate: sqlstate.clone(), message: message.clone() });
                }
                Fault::Unknown(message) if replay == Replay::Unsafe => {
                    metrics::counter!("agentloop_store_faults_total", "function" => function, "fault" => "unknown").increment(1);
                    return Err(StoreError::OutcomeUnknown(message.clone()));
                }
                Fault::Retry(_) => "retry",
                Fault::Outage(_) => "outage",
                Fault::Unknown(_) => "unknown",
            };
            metrics::counter!("agentloop_store_faults_total", "function" => function, "fault" => label).increment(1);
            let delay = delays.next().unwrap_or(Duration::from_secs(1));
            let (message, outage) = match fault {
                Fault::Retry(m) | Fault::Unknown(m) => (m, false),
                Fault::Outage(m) => (m, true),
                _ => unreachable!("handled above"),
            };
            if Instant::now() + delay >= deadline {
                tracing::warn!(db.function = function, error = %message, "database unavailable until the deadline");
                return Err(if outage { StoreError::Outage(message) } else { StoreError::Unavailable(message) });
            }
            tracing::warn!(db.function = function, fault = label, error = %message, delay_ms = delay.as_millis() as u64, "transient database fault; retrying");
            tokio::time::sleep(delay).await;
        }
    }

    /// One attempt: a connection from the pool, then the call under the call timeout. A call
    /// that has not answered by then is cancelled (PostgreSQL's cancel request, on a connection
    /// of its own) and waited for [`CANCEL_GRACE`] more: a statement that then answers — with
    /// its result, or cancelled (57014: certainly not committed) — has a known outcome; only a
    /// server that stays silent leaves it unknown. The call timeout counts from before the
    /// argument is encoded and sent, PostgreSQL's `statement_timeout` from when the statement
    /// starts, so a large argument or a slow client could see its own timeout first although
    /// the server would cancel soon after (a 12 MB import under load answered "may or may not
    /// have taken effect"). A connection whose call was cancelled, failed without a server
    /// answer, or was refused as read-only, is discarded.
    async fn attempt(&self, function: &'static str, arg: &Value, defer: bool) -> Result<Value, Fault> {
        let mut conn = self.pool.get().await.map_err(|e| fault::classify_pool(&e))?;
        let cancel = conn.client().cancel_token();
        let mut cancelled = false;
        let answer = {
            let call = conn.call_json(function, arg, defer);
            tokio::pin!(call);
            match tokio::time::timeout(self.timing.call_timeout, &mut call).await {
                Ok(answer) => Some(answer),
                Err(_) => {
                    cancelled = true;
                    metrics::counter!("agentloop_store_cancels_total", "function" => function).increment(1);
                    let grace = async {
                        let _ = cancel.cancel_query(tokio_postgres::NoTls).await;
                        (&mut call).await
                    };
                    tokio::time::timeout(CANCEL_GRACE, grace).await.ok()
                }
            }
        };
        let Some(answer) = answer else {
            drop(deadpool::managed::Object::take(conn));
            return Err(Fault::Unknown(format!(
                "no answer within {} ms, nor {} ms after a cancel request",
                self.timing.call_timeout.as_millis(),
                CANCEL_GRACE.as_millis()
            )));
        };
        // A cancel request may reach the server after the statement ended on its own: on a
        // connection back in the pool it could stop the next caller's statement.
        let keep = !cancelled;
        match answer {
            Ok(outcome) => {
                if outcome.unsent.is_some() || !keep {
                    drop(deadpool::managed::Object::take(conn));
                }
                if let Some(unsent) = outcome.unsent {
                    self.send_unsent(function, &unsent).await;
                }
                Ok(outcome.value)
            }
            Err(error) => {
                let fault = fault::classify(&error);
                // A session that refused a write as read-only (25006) may stay read-only (it
                // reached a standby, or a primary demoted by a failover): never reuse it.
                let read_only = error.as_db_error().is_some_and(|db| db.code().code() == "25006");
                if !keep || conn.is_closed() || read_only || matches!(fault, Fault::Unknown(_)) {
                    drop(deadpool::managed::Object::take(conn));
                }
                Err(fault)
            }
        }
    }

    /// Sends notifications whose pipelined flush failed (the step committed), on another
    /// connection, once, within the call timeout. Losing them only delays: listeners resync
    /// when they reconnect, workers claim at their next pass or safety poll.
    async fn send_unsent(&self, function: &'static str, unsent: &Value) {
        let sent = tokio::time::timeout(self.timing.call_timeout, async {
            let conn = self.pool.get().await.map_err(|e| format!("{e}"))?;
            conn.client()
                .query_one("SELECT agentloop_send_deferred($1::jsonb)", &[unsent])
                .await
                .map_err(|e| format!("{e}"))
        })
        .await;
        match sent {
            Ok(Ok(_)) => metrics::counter!("agentloop_notifications_resent_total", "function" => function).increment(1),
            Ok(Err(error)) => tracing::warn!(db.function = function, %error, "deferred notifications lost"),
            Err(_) => tracing::warn!(db.function = function, "deferred notifications lost (timeout)"),
        }
    }

    /// A pooled connection for ad-hoc statements (maintenance, test tools).
    pub async fn conn(&self) -> Result<deadpool::managed::Object<pool::StoreManager>, StoreError> {
        self.pool.get().await.map_err(|e| match fault::classify_pool(&e) {
            Fault::Deterministic { sqlstate, message } => StoreError::Deterministic { sqlstate, message },
            Fault::Outage(message) => StoreError::Outage(message),
            other => StoreError::Unavailable(format!("{other:?}")),
        })
    }
}
