//! What a worker knows about each slice it executes, and the one lease keeper that renews them.
//!
//! A [`SliceControl`] carries the slice's fencing token, an abort signal with its first reason,
//! and the last moment its lease was confirmed extended (a renewal answered `ok`, or one of its
//! own steps committed — every step extends the lease). The [`keeper`] renews the leases of all
//! slices of the process in ONE statement every `renew` interval on a dedicated connection (a
//! pool under back-pressure cannot delay renewals), never waits on a row lock, and aborts a
//! slice whose lease is lost or was not confirmed for `lease - renew` (a worker cut off from
//! the database stops before another worker may claim the run).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentloop_shared::scheduler::{self, Renewal};
use agentloop_shared::store::Store;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Why a slice was aborted (first reason wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortReason {
    /// Cancellation requested: end the run `cancelled` (keeping a partial answer, marked stopped).
    Cancel,
    /// Worker shutdown: hand the run back (`queued`).
    Shutdown,
    /// The lease is gone (a renewal or a step found another fencing token): write nothing more.
    LeaseLost,
    /// The lease could not be confirmed for `lease - renew` (renewals failed or hung: the
    /// database is away, or this worker is cut off from it): stop before another worker may
    /// claim the run, then hand it back with a fenced write if the lease still holds — an
    /// outage is not the run's fault (`SliceEnd::Handback { fault: false }`; counted ten to a
    /// fault, migration 000023).
    Unconfirmed,
}

struct State {
    reason: Option<AbortReason>,
    confirmed: Instant,
    /// The slice committed its end: its lease is released on purpose.
    ended: bool,
    /// When the call with external effects in flight was sent, if one is.
    effect_since: Option<Instant>,
}

/// Handle on one running slice; cheap to clone.
#[derive(Clone)]
pub struct SliceControl {
    /// The run's fencing token.
    pub epoch: i64,
    token: CancellationToken,
    /// Cancelled by every abort but a shutdown: a call with external effects in flight is let
    /// finish on shutdown (its outcome is then known and committed), within the grace period.
    effects: CancellationToken,
    /// Cancelled by a cancellation or a lost lease, and by [`SliceControl::stop_model_calls`]
    /// when the shutdown grace period runs short: a model call in flight at SIGTERM, or when the
    /// lease cannot be confirmed, is let finish and its answer checkpointed (it is paid for),
    /// instead of being dropped and paid again.
    model: CancellationToken,
    state: Arc<Mutex<State>>,
}

impl SliceControl {
    /// A control for a run claimed with fencing token `epoch` by a claim sent at `claimed`
    /// (the database started the lease after that instant, so counting from it is safe).
    pub fn new(epoch: i64, claimed: Instant) -> Self {
        Self {
            epoch,
            token: CancellationToken::new(),
            effects: CancellationToken::new(),
            model: CancellationToken::new(),
            state: Arc::new(Mutex::new(State { reason: None, confirmed: claimed, ended: false, effect_since: None })),
        }
    }

    /// Aborts the slice for `reason` (a later reason does not replace the first).
    pub fn abort(&self, reason: AbortReason) {
        let mut state = self.state.lock().expect("slice state");
        if state.reason.is_none() {
            state.reason = Some(reason);
        }
        if reason != AbortReason::Shutdown {
            self.effects.cancel();
        }
        // A model call needs no database: one in flight when the lease cannot be confirmed
        // (the database away) is let finish — it is paid for, and its fenced checkpoint is held
        // through the outage (`step::commit`'s hold). Only a cancellation or a lost lease drop it.
        if !matches!(reason, AbortReason::Shutdown | AbortReason::Unconfirmed) {
            self.model.cancel();
        }
        self.token.cancel();
    }

    /// Drops a model call still in flight after a shutdown abort (the grace period is running
    /// out: the run must be handed back before the process exits).
    pub fn stop_model_calls(&self) {
        self.model.cancel();
    }

    /// Whether calls with external effects were told to stop (any abort but a shutdown).
    pub fn effects_stopped(&self) -> bool {
        self.effects.is_cancelled()
    }

    /// Resolves when a model call in flight must be dropped: a cancellation, a lost lease, or
    /// [`SliceControl::stop_model_calls`].
    pub async fn model_call_stopped(&self) {
        self.model.cancelled().await
    }

    /// The abort reason, if aborted.
    pub fn reason(&self) -> Option<AbortReason> {
        self.state.lock().expect("slice state").reason
    }

    /// Resolves when the slice is aborted.
    pub async fn aborted(&self) {
        self.token.cancelled().await
    }

    /// A token cancelled when the slice is aborted (handed to tools).
    pub fn cancel_token(&self) -> CancellationToken {
        self.token.child_token()
    }

    /// A token for a call with external effects: cancelled by a cancellation or a lost lease,
    /// not by a shutdown.
    pub fn effect_token(&self) -> CancellationToken {
        self.effects.child_token()
    }

    /// Records that a call with external effects is sent now (`true`) or has its outcome
    /// (`false`): a shutdown waits for it beyond the grace period (`WORKER_EFFECT_DRAIN_MS`).
    pub fn effect_in_flight(&self, sent: bool) {
        self.state.lock().expect("slice state").effect_since = sent.then(Instant::now);
    }

    /// When the call with external effects in flight was sent, if one is.
    pub fn effect_since(&self) -> Option<Instant> {
        self.state.lock().expect("slice state").effect_since
    }

    /// Records that the lease was extended now.
    pub fn confirm(&self) {
        self.confirm_at(Instant::now());
    }

    /// Records that the lease was extended by a statement sent at `sent` (the database counts
    /// the extension from its transaction's start, which is no earlier): a step that waited —
    /// for a lock, or for the other items of its group — does not count the wait as lease time.
    /// Never moves the confirmation back.
    pub fn confirm_at(&self, sent: Instant) {
        let mut state = self.state.lock().expect("slice state");
        state.confirmed = state.confirmed.max(sent);
    }

    /// Records that the slice committed its end (the lease is released, not lost).
    pub fn end(&self) {
        self.state.lock().expect("slice state").ended = true;
    }

    /// Whether the slice committed its end.
    pub fn ended(&self) -> bool {
        self.state.lock().expect("slice state").ended
    }

    /// When the lease was last confirmed.
    pub fn confirmed(&self) -> Instant {
        self.state.lock().expect("slice state").confirmed
    }
}

/// The slices this process executes, by run id.
pub type InFlight = Arc<Mutex<HashMap<Uuid, SliceControl>>>;

/// This worker's view of database outages, shared by the claim loop and the lease keeper: when
/// its calls started failing, and for how long after they succeeded again its claims spare the
/// runs whose lease expired meanwhile.
///
/// After an outage every lease has expired, but their owners are mostly alive: a slice holds its
/// paid answer or streams on, a slice that could not write its end is named in its worker's next
/// claim. A worker that came out of the outage first would otherwise take those runs as
/// recoveries (a fault each, the held answer refused by the fence and paid again). So for one
/// lease after its own outage ended, a worker's claims leave running runs whose lease expired
/// from one lease before the outage began (`spareMs`, migration 000026); their owners renew,
/// write or hand them back, and a run whose owner died is recovered one lease later than usual.
#[derive(Clone, Default)]
pub struct Outages(Arc<Mutex<OutageState>>);

#[derive(Default)]
struct OutageState {
    failing_since: Option<Instant>,
    /// The last outage: when it began and until when claims spare.
    spare: Option<(Instant, Instant)>,
}

impl Outages {
    /// A database call sent at `sent` failed for want of the database.
    pub fn failed(&self, sent: Instant) {
        let mut state = self.0.lock().expect("outage state");
        state.failing_since = Some(state.failing_since.map_or(sent, |since| since.min(sent)));
    }

    /// A database call succeeded: an outage in progress ended now; claims spare for `lease`.
    pub fn succeeded(&self, lease: Duration) {
        let mut state = self.0.lock().expect("outage state");
        if let Some(since) = state.failing_since.take() {
            state.spare = Some((since, Instant::now() + lease));
        }
    }

    /// What a claim sent now spares: runs whose lease expired less than this long ago (the
    /// outage and one lease before it), and when that ends; `None` outside a spare window. An
    /// outage not yet seen to end counts as ending now (the claim may be the first call that
    /// succeeds).
    pub fn spare(&self, lease: Duration) -> Option<(Duration, Instant)> {
        let state = self.0.lock().expect("outage state");
        let now = Instant::now();
        let (since, until) = match (state.failing_since, state.spare) {
            (Some(since), _) => (since, now + lease),
            (None, Some(window)) => window,
            (None, None) => return None,
        };
        (now < until).then(|| (now.saturating_duration_since(since) + lease, until))
    }
}

/// The lease keeper: every `renew`, renews all leases in `in_flight` in one statement on
/// `store` (a dedicated one-connection store); applies the answers; aborts slices whose lease
/// was not confirmed for `lease - renew`. Runs until `stop`.
pub async fn keeper(store: Store, owner: String, lease: Duration, renew: Duration, in_flight: InFlight, outages: Outages, stop: CancellationToken) {
    let watchdog = lease.saturating_sub(renew);
    let mut tick = tokio::time::interval(renew);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let slices: Vec<(Uuid, SliceControl)> =
            in_flight.lock().expect("in-flight lock").iter().map(|(id, c)| (*id, c.clone())).collect();
        if slices.is_empty() {
            continue;
        }
        let leases: Vec<(Uuid, i64)> = slices.iter().map(|(id, c)| (*id, c.epoch)).collect();
        // Bounded, so the watchdog below runs every tick even when the database hangs.
        let sent = Instant::now();
        let renewal = tokio::time::timeout(renew, scheduler::lease::renew(&store, &owner, lease, &leases)).await;
        match renewal.unwrap_or_else(|_| Err(agentloop_shared::store::StoreError::Unavailable("renewal timed out".into()))) {
            Ok(answers) => {
                outages.succeeded(lease);
                for (id, control) in &slices {
                    match answers.get(id) {
                        Some(Renewal::Ok) => control.confirm(),
                        Some(Renewal::Cancel) => {
                            control.confirm();
                            control.abort(AbortReason::Cancel);
                        }
                        Some(Renewal::Busy) | None => {}
                        Some(Renewal::Lost) if control.ended() => {}
                        Some(Renewal::Lost) => {
                            tracing::warn!(run.id = %id, "lease renewal matched no row: the run is no longer ours");
                            metrics::counter!("agentloop_lease_lost_total").increment(1);
                            control.abort(AbortReason::LeaseLost);
                        }
                    }
                }
            }
            Err(error) => {
                outages.failed(sent);
                tracing::warn!(%error, "lease renewal failed");
                metrics::counter!("agentloop_lease_renew_failures_total").increment(1);
            }
        }
        for (id, control) in &slices {
            // After a shutdown abort too: a model call let finish on shutdown must still stop
            // when the lease can no longer be confirmed.
            if control.reason().is_none_or(|r| r == AbortReason::Shutdown)
                && !control.effects_stopped()
                && !control.ended()
                && control.confirmed().elapsed() >= watchdog
            {
                tracing::warn!(run.id = %id, since_ms = control.confirmed().elapsed().as_millis() as u64,
                               "watchdog: lease not confirmed for lease - renew; stopping the slice");
                metrics::counter!("agentloop_lease_lost_total").increment(1);
                control.abort(AbortReason::Unconfirmed);
            }
        }
    }
}
