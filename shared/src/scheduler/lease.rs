//! Leases and fencing (SPEC §5 "Lease", "Fencing").
//!
//! A worker holds a run through a [`Lease`]: `(run_id, owner, epoch)`, where `epoch` is the
//! fencing token its claim set. Every step it writes ([`crate::scheduler::step`]) is one call of
//! a step function that first locks the thread, then runs the fence
//! `UPDATE runs SET lease_expires_at = now() + lease WHERE id = $run AND lease_owner = $me AND
//! lease_epoch = $mine AND status = 'running'` and writes nothing when it matched no row: a
//! worker that lost its lease writes nothing. Renewal ([`renew`]) covers every run of a worker
//! in one statement and never waits on a row lock.

use std::collections::HashMap;
use std::time::Duration;

use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use crate::runs::Run;
use crate::store::{Replay, Store, StoreError};

/// The lease a worker holds on a claimed run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub run_id: Uuid,
    pub thread_id: Uuid,
    pub owner: String,
    /// The fencing token of the claim.
    pub epoch: i64,
    /// The lease duration each step extends it by.
    pub duration: Duration,
}

impl Lease {
    /// The lease of a freshly claimed `run`, renewed by `duration` at each step.
    pub fn of(run: &Run, duration: Duration) -> Self {
        Self {
            run_id: run.id,
            thread_id: run.thread_id,
            owner: run.lease_owner.clone().unwrap_or_default(),
            epoch: run.lease_epoch,
            duration,
        }
    }

    /// The fence fields every step function takes.
    pub(crate) fn fence_json(&self) -> serde_json::Value {
        json!({
            "runId": self.run_id, "threadId": self.thread_id, "owner": self.owner,
            "epoch": self.epoch, "leaseMs": self.duration.as_millis() as u64,
        })
    }
}

/// The lease is no longer held (expired and re-claimed, run cancelled or ended elsewhere): the
/// caller must stop and write nothing more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("lease lost")]
pub struct LeaseLost;

/// The result of renewing one lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Renewal {
    /// Extended to now + lease.
    Ok,
    /// Extended; cancellation was requested (the slice should stop at its next safe point).
    Cancel,
    /// The run row was locked right now (normally by the worker's own step, which extends the
    /// lease itself): not waited for; try again soon.
    Busy,
    /// The lease is gone.
    Lost,
}

/// Renews every lease of `owner` listed in `leases` (`(run id, epoch)`) to now + `duration` in
/// one statement. Row locks are skipped, never waited for ([`Renewal::Busy`]).
pub async fn renew(store: &Store, owner: &str, duration: Duration, leases: &[(Uuid, i64)]) -> Result<HashMap<Uuid, Renewal>, StoreError> {
    let runs: Vec<_> = leases.iter().map(|(id, epoch)| json!({"runId": id, "epoch": epoch})).collect();
    let arg = json!({"owner": owner, "leaseMs": duration.as_millis() as u64, "runs": runs});
    let value = store.call("agentloop_renew", &arg, Replay::Safe, Some(std::time::Instant::now() + store.timing().call_timeout)).await?;
    serde_json::from_value(value).map_err(|e| StoreError::Deterministic { sqlstate: "XX000".into(), message: e.to_string() })
}
