//! Grouped step calls (issue 9: "grouped commits"; `migrations/…000022_grouped_steps`).
//!
//! A worker runs many slices at once, and under load several of them reach a checkpoint (or a
//! slice start) at the same moment. Each call of a grouped function goes to the function's
//! [`Grouper`]: a task that sends whatever calls are waiting as ONE statement of the group
//! function (`agentloop_commit_group`, `agentloop_slice_start_group`) — one transaction, one
//! round trip, one notification flush — with at most [`MAX_IN_FLIGHT`] group of one function
//! in flight per store. Calls that arrive while it runs wait and form the next group,
//! so a lone call goes at once, alone, as before (no timer, no added latency), and grouping
//! grows with the load by itself.
//!
//! - Items are sorted by thread id: every group locks its threads in id order, the order of
//!   every other statement that locks several threads (the stream flush, the sign-in sweep).
//! - Each item is exactly the call it would have been alone (its own fence, its own commit id),
//!   so a group is replay-safe when its items are; only [`crate::store::Replay::Safe`] calls are
//!   grouped.
//! - A group is tried ONCE, and its group function waits at most 250 ms for any lock
//!   (`lock_timeout` on the function): a group that fails for any reason — an item whose
//!   thread another session holds, a poison item, a lost connection — is split, and each item
//!   sent alone with its own deadline and retries ([`Store::call`]), outside the group slot. So
//!   one item's error or lock wait never becomes another's, and a blocked item stalls the
//!   worker's other steps for at most the lock timeout, not for its own wait.
//! - A call whose caller has gone (an aborted slice) is dropped before its group is sent, and a
//!   call sent alone is dropped when its caller goes (CI found a lone checkpoint of an aborted
//!   slice landing after the outage that aborted it, extending a lease nobody executed); one
//!   whose deadline passed while it waited is sent alone, once, without retries — what
//!   [`Store::call`] gives any call past its deadline (a slice's hand-back must still be tried:
//!   CI caught a version that refused it).
//! - Memory: at most one waiting call per slice (each slice awaits its call), bounded by the
//!   worker's concurrency; a group holds at most [`GroupSpec::max_items`] items.

use std::sync::Arc;
use std::time::Instant;

use serde_json::{Value, json};
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::{Replay, Store, StoreError};

/// Groups of one function in flight at once, per store. One: calls that arrive while a group
/// runs form the next one. bench-scheduler, 2 workers x 16 slots, same hour: 497 / 443 runs/s
/// with one in flight, 394 / 359 with two (groups rarely form), 374 / 346 ungrouped. A group
/// waits for a lock at most 250 ms before it is split (see the module docs), so one group in
/// flight does not stall the others for long.
pub const MAX_IN_FLIGHT: usize = 1;

/// One waiting call.
struct Request {
    arg: Value,
    deadline: Instant,
    reply: oneshot::Sender<Result<Value, StoreError>>,
}

/// One grouped step function ([`Store::grouping`]).
#[derive(Debug, Clone, Copy)]
pub struct GroupSpec {
    /// The step function, e.g. `agentloop_commit`.
    pub function: &'static str,
    /// Its group function: `{items: [arg, ...]}` -> `[result, ...]`, in order.
    pub group_function: &'static str,
    /// Items of one group at most (bounds a group's statement time and answer size: a slice
    /// start's answer carries the thread's whole context).
    pub max_items: usize,
}

/// The sender side of one grouped function ([`Store::grouping`]).
#[derive(Clone)]
pub(crate) struct Grouper {
    tx: mpsc::UnboundedSender<Request>,
}

impl Grouper {
    /// Starts the task of `spec` on `store`, a store without groupers (the task must not keep
    /// its own channel open).
    pub(crate) fn spawn(store: Store, spec: GroupSpec) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(store, spec, rx));
        Self { tx }
    }

    /// Queues a call (its `arg` already cleaned) and awaits its own result. Errors as
    /// [`Store::call`]; `Unavailable` when the grouper is gone.
    pub(crate) async fn call(&self, arg: Value, deadline: Instant) -> Result<Value, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Request { arg, deadline, reply })
            .map_err(|_| StoreError::Unavailable("the step grouper has stopped".into()))?;
        answer.await.map_err(|_| StoreError::Unavailable("the step grouper dropped the call".into()))?
    }
}

async fn run(store: Store, spec: GroupSpec, mut rx: mpsc::UnboundedReceiver<Request>) {
    let permits = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        // Waiting for a permit is where a group forms: calls arriving meanwhile join it.
        let Ok(permit) = permits.clone().acquire_owned().await else { return };
        let mut batch = vec![first];
        while batch.len() < spec.max_items.max(1) {
            match rx.try_recv() {
                Ok(request) => batch.push(request),
                Err(_) => break,
            }
        }
        let store = store.clone();
        tokio::spawn(async move {
            let left = send(&store, spec, batch).await;
            // The next group need not wait for the items sent alone.
            drop(permit);
            alone(&store, spec.function, left).await;
        });
    }
}

/// Sends `batch` as one group, in ONE attempt; returns the items to send alone: all of them
/// when the group failed for any reason (a lock wait past the group's `lock_timeout`, a poison
/// item, a lost connection: each item then replays or fails on its own), or a lone item.
async fn send(store: &Store, spec: GroupSpec, mut batch: Vec<Request>) -> Vec<Request> {
    let now = Instant::now();
    batch.retain(|r| !r.reply.is_closed());
    // A call whose deadline passed while it waited goes alone: one attempt and no retry, as
    // `Store::call` gives any call past its deadline (a slice's hand-back must still be tried).
    let (mut left, mut batch): (Vec<_>, Vec<_>) = batch.into_iter().partition(|r| r.deadline <= now);
    if batch.len() <= 1 {
        left.append(&mut batch);
        return left;
    }
    batch.sort_by(|a, b| a.arg["threadId"].as_str().cmp(&b.arg["threadId"].as_str()));
    let n = batch.len();
    let group = json!({ "items": batch.iter().map(|r| r.arg.clone()).collect::<Vec<_>>() });
    metrics::histogram!("agentloop_step_group_items", "function" => spec.function).record(n as f64);
    // Each item was cleaned when it was queued (`Store::call_with`): the group goes as it is.
    let error = match store.attempt(spec.group_function, &group, true).await {
        Ok(Value::Array(results)) if results.len() == n => {
            for (r, value) in batch.into_iter().zip(results) {
                let _ = r.reply.send(Ok(value));
            }
            return left;
        }
        Ok(value) => format!("unexpected group answer: {}", value.to_string().chars().take(200).collect::<String>()),
        Err(fault) => format!("{fault:?}"),
    };
    tracing::warn!(db.function = spec.group_function, items = n, %error, "group failed; sending its items one by one");
    metrics::counter!("agentloop_step_groups_split_total", "function" => spec.function).increment(1);
    left.append(&mut batch);
    left
}

/// Sends each item alone ([`Store::call`]: its own retries, until its own deadline). A call
/// whose caller goes away meanwhile (a slice aborted on a lost lease or a cancel) is dropped
/// with it, as the caller's own call future would have been: a step its slice gave up on must
/// not land later and extend a lease nobody executes.
async fn alone(store: &Store, function: &'static str, items: Vec<Request>) {
    let calls = items.into_iter().map(|mut r| async move {
        let result = tokio::select! {
            result = store.call(function, &r.arg, Replay::Safe, Some(r.deadline)) => result,
            _ = r.reply.closed() => return,
        };
        let _ = r.reply.send(result);
    });
    futures_util::future::join_all(calls).await;
}
