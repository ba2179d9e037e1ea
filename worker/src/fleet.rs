//! The fleet's tool policy (migration 000039; [`agentloop_shared::tools::FleetPolicy`]).
//!
//! Every worker publishes its tools file's policies and idempotency overrides to
//! `worker_tool_policies` every `FLEET_POLICY_REFRESH_MS` and reads the other live workers'
//! (rows seen within four periods); its [`ToolRegistry`] then applies, per tool, the strictest
//! policy of them all. The first publication happens before the worker claims anything; a
//! worker that cannot publish keeps what it last read (a stricter fleet stays strict). A
//! worker leaving cleanly removes its row once its slices have ended; one that dies is forgotten
//! after its row's time to live (four of its own periods).

use std::sync::Arc;
use std::time::Duration;

use agentloop_shared::store::{Replay, Store, StoreError};
use agentloop_shared::tools::{FleetPolicy, ToolRegistry};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// Rows older than this many refresh periods are of workers gone.
pub const TTL_PERIODS: u32 = 4;

/// Publishes this worker's policy and applies the other live workers' to `tools`. Returns how
/// many others there are.
pub async fn publish(store: &Store, worker_id: &str, tools: &ToolRegistry, every: Duration) -> Result<usize, StoreError> {
    let arg = json!({"workerKey": worker_id, "policy": tools.published(), "ttlMs": (every * TTL_PERIODS).as_millis() as u64});
    let value = store.call("agentloop_publish_tool_policy", &arg, Replay::Safe, None).await?;
    let mut others = Vec::new();
    for policy in value["others"].as_array().into_iter().flatten() {
        match serde_json::from_value::<FleetPolicy>(policy.clone()) {
            Ok(policy) => others.push(policy),
            // A newer worker's policy this one cannot read: every tool it names asks.
            Err(error) => {
                tracing::warn!(%error, "another worker's tool policy is unreadable; its tools ask for approval here");
                others.push(FleetPolicy::unreadable(policy));
            }
        }
    }
    let n = others.len();
    let differs = others.iter().any(|o| *o != tools.published());
    tools.set_fleet(others);
    metrics::gauge!("agentloop_fleet_tool_policies").set(n as f64 + 1.0);
    metrics::gauge!("agentloop_fleet_tool_policies_differ").set(if differs { 1.0 } else { 0.0 });
    Ok(n)
}

/// Publishes every `every` until `stop` (the runner withdraws the row with [`leave`] once its
/// slices have ended: until then they still run calls under this worker's policy).
pub async fn run(store: Store, worker_id: String, tools: Arc<ToolRegistry>, every: Duration, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        if let Err(error) = publish(&store, &worker_id, &tools, every).await {
            tracing::warn!(%error, "could not publish the tool policy; keeping the fleet's last known");
        }
    }
}

/// Removes this worker's row at the end of a clean shutdown (at most 2 s; else it expires by
/// its time to live).
pub async fn leave(store: &Store, worker_id: &str) {
    let arg = json!({"workerKey": worker_id, "leaving": true});
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    if let Err(error) = store.call("agentloop_publish_tool_policy", &arg, Replay::Safe, Some(deadline)).await {
        tracing::warn!(%error, "could not withdraw the tool policy; it expires by itself");
    }
}
