//! The claim (SPEC §5 "Claim"): one call of `agentloop_claim`, one statement.

use std::time::Duration;

use serde::Deserialize;
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
    /// Earliest lease expiry of a run another worker holds, in ms from now (negative when
    /// already expired): the recovery timer.
    pub next_expiry_ms: Option<i64>,
    /// A queued run was skipped because another transaction held its row lock: look again soon.
    pub queued_left: bool,
}

/// Claims at most `limit` runs for `owner` under a lease of `lease` (database clock): `queued`
/// runs and `running` runs whose lease expired (recovery needs no sweeper), in creation order,
/// `FOR UPDATE SKIP LOCKED` via the partial index `runs_claimable`. With `adopt` (set after a
/// claim that failed: its answer may have been lost), runs `owner` holds but does not list in
/// `inflight` are re-adopted first; and a claim whose outcome is unknown is sent again with
/// `adopt`, so no claimed run waits for its lease to expire.
pub async fn claim(store: &Store, owner: &str, limit: usize, lease: Duration, inflight: &[Uuid], adopt: bool) -> Result<Claimed, StoreError> {
    let arg = json!({"owner": owner, "limit": limit, "leaseMs": lease.as_millis() as u64, "inflight": inflight, "adopt": adopt});
    let value = store.call("agentloop_claim", &arg, Replay::Safe, None).await?;
    serde_json::from_value(value).map_err(|e| StoreError::Deterministic { sqlstate: "XX000".into(), message: e.to_string() })
}
