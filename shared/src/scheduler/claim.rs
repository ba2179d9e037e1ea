//! The claim (SPEC §5 "Claim"): one call of `agentloop_claim`, one statement. The same
//! transaction starts the first slice of runs claimed from `queued` (migration 000020; see
//! [`StartOptions`]), so such a run costs no separate slice-start transaction.

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::json;
use uuid::Uuid;

use crate::runs::Run;
use crate::store::{Replay, Store, StoreError};

/// What a claim pass got.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Claimed {
    /// Runs now held by this worker (re-adopted ones first), each with its new fencing token.
    pub runs: Vec<Run>,
    /// Earliest lease expiry of a run the caller could claim later (another worker's, or its
    /// own that it no longer executes), in ms from now (negative when already expired): the
    /// recovery timer.
    pub next_expiry_ms: Option<i64>,
    /// A queued run was skipped because another transaction held its row lock: look again soon.
    pub queued_left: bool,
    /// Runs whose slice the claim already started, by run id: the raw `agentloop_slice_start`
    /// answer, decoded with [`super::step::started_from`]. Every other run in `runs` is started
    /// by its slice ([`super::step::start_slice`]).
    #[serde(default)]
    pub starts: HashMap<Uuid, serde_json::Value>,
}

/// What the claim needs to start slices itself (`p.start` of `agentloop_claim`).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StartOptions {
    /// At most this many runs are started in the claim's transaction (each is one
    /// subtransaction; keep it well under PostgreSQL's 64 cached subtransactions).
    pub limit: usize,
    /// The worker's pre-check: a run interrupted more often than this is not started (the
    /// worker fails it `abandoned`).
    pub max_recoveries: i32,
    /// Size budget of the starts in one claim answer, in bytes (`pg_column_size` of the
    /// `starts` object): no further run is started once it is reached, so the answer and the
    /// time the claim holds its locks stay bounded however large the threads' contexts are.
    pub max_bytes: i64,
    /// Per configured model id: what `agentloop_slice_start` records. A run whose model is not
    /// listed is left to the worker (which fails it `model_not_configured`).
    pub models: HashMap<String, ModelStart>,
}

/// A run the caller's slice left `running` under its lease because it could not record the
/// slice's end (a transient fault outlasted the store's retries). Named in the next claim
/// (`p.released`), it is taken back at once with a new fencing token, without counting a
/// recovery, and a fault only when [`Released::fault`] says so (migration 000023): a partial
/// database outage must not fail runs `abandoned`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Released {
    pub run_id: Uuid,
    /// The fencing token the slice held; a run claimed by anyone since is not taken.
    pub epoch: i64,
    /// Count a fault when it is taken back: the end the slice could not write was a faulting
    /// hand-back, or what stopped the write was not an outage (a poison run still ends).
    pub fault: bool,
}

/// The per-model part of a slice start.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelStart {
    /// The model id recorded on the step row.
    pub model: String,
    /// Tokens of the tool schemas offered to this model, added to the recorded context size.
    pub tool_tokens: i64,
    /// The model's context window in tokens, when configured.
    pub context_limit: Option<i64>,
}

/// One claim pass of a worker ([`claim`]).
#[derive(Debug, Clone, Copy)]
pub struct Pass<'a> {
    /// The worker's identity (`lease_owner`).
    pub owner: &'a str,
    /// Runs to claim at most (the worker's free slots).
    pub limit: usize,
    /// The lease each claimed run gets (database clock).
    pub lease: Duration,
    /// The runs the worker executes now: never claimed, adopted or counted by the timer.
    pub inflight: &'a [Uuid],
    /// Runs whose slice could not write its end ([`Released`]).
    pub released: &'a [Released],
    /// Re-adopt the runs the worker holds but does not list in `inflight` (after a failed pass).
    pub adopt: bool,
    /// Start slices in the same transaction ([`StartOptions`]).
    pub start: Option<&'a StartOptions>,
    /// Leave `running` runs whose lease expired less than this long ago (the worker's last
    /// database outage and one lease before it: their owners are likely alive; see the worker's
    /// `control::Outages`).
    pub spare: Option<Duration>,
    /// The model ids the worker serves (its catalog): runs of other models are left to other
    /// workers (migration 000033). `None`: any model.
    pub models: Option<&'a [String]>,
}

/// Claims at most `pass.limit` runs for `pass.owner` under a lease of `pass.lease` (database
/// clock): `queued` runs and `running` runs whose lease expired (recovery needs no sweeper), in
/// creation order, `FOR UPDATE SKIP LOCKED` via the partial index `runs_claimable`. With
/// `adopt` (set after a claim that failed: its answer may have been lost), runs the owner holds
/// but does not list in `inflight` are re-adopted first; and a claim whose outcome is unknown
/// ([`StoreError::OutcomeUnknown`]) is sent again by the caller with `adopt`, so no claimed run
/// waits for its lease to expire (adopted runs are never started by the claim: their slices
/// start them). With `start`, the claim also starts slices (see [`StartOptions`] and
/// [`Claimed::starts`]). `released` runs (see [`Released`]) that are still `running` under the
/// owner with their epoch are taken back first, after adopted ones. Runs in `inflight` are
/// never claimed (their slice still executes them); `spare` leaves recently expired ones
/// (migration 000026); with `models`, only runs of those models are claimed (000033).
pub async fn claim(store: &Store, pass: &Pass<'_>) -> Result<Claimed, StoreError> {
    let Pass { owner, limit, lease, inflight, released, adopt, start, spare, models } = *pass;
    let arg = json!({"owner": owner, "limit": limit, "leaseMs": lease.as_millis() as u64, "inflight": inflight,
                     "released": released, "adopt": adopt, "start": start,
                     "spareMs": spare.map(|d| d.as_millis() as u64), "models": models});
    // Not replayed by the store: the same argument sent again would not re-adopt what a lost
    // attempt claimed (those runs would wait for their lease to expire and count a fault). The
    // caller sends its next pass with `adopt` instead.
    // A claim that starts no slice journals nothing: no notification flush behind it.
    let value = match start {
        Some(_) => store.call("agentloop_claim", &arg, Replay::Unsafe, None).await?,
        None => store.call_quiet("agentloop_claim", &arg, Replay::Unsafe, None).await?,
    };
    serde_json::from_value(value).map_err(|e| StoreError::Deterministic { sqlstate: "XX000".into(), message: e.to_string() })
}
