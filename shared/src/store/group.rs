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
//! - A group that fails for any reason is split: each item is sent again alone, with its own
//!   deadline ([`Store::call`]'s retries), so one item's error never becomes another's.
//! - A call whose caller has gone (an aborted slice) is dropped before its group is sent.
//! - Memory: at most one waiting call per slice (each slice awaits its call), bounded by the
//!   worker's concurrency; a group holds at most [`MAX_ITEMS`] items.

use std::sync::Arc;
use std::time::Instant;

use serde_json::{Value, json};
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::{Replay, Store, StoreError};

/// Groups of one function in flight at once, per store. One: calls that arrive while a group
/// runs form the next one. bench-scheduler, 2 workers x 16 slots, same hour: 497 / 443 runs/s
/// with one in flight, 394 / 359 with two (groups rarely form), 374 / 346 ungrouped. A group
/// waits only for the locks its items would have waited for alone, and every step statement
/// holds its locks for one statement, so one group in flight does not stall the others for long.
pub const MAX_IN_FLIGHT: usize = 1;
/// Items of one group at most.
pub const MAX_ITEMS: usize = 32;

/// One waiting call.
struct Request {
    arg: Value,
    deadline: Instant,
    reply: oneshot::Sender<Result<Value, StoreError>>,
}

/// The sender side of one grouped function ([`Store::grouping`]).
#[derive(Clone)]
pub(crate) struct Grouper {
    tx: mpsc::UnboundedSender<Request>,
}

impl Grouper {
    /// Starts the task of `function` (grouped as `group_function`) on `store`, a store without
    /// groupers (the task must not keep its own channel open).
    pub(crate) fn spawn(store: Store, function: &'static str, group_function: &'static str) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(store, function, group_function, rx));
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

async fn run(store: Store, function: &'static str, group_function: &'static str, mut rx: mpsc::UnboundedReceiver<Request>) {
    let permits = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        // Waiting for a permit is where a group forms: calls arriving meanwhile join it.
        let Ok(permit) = permits.clone().acquire_owned().await else { return };
        let mut batch = vec![first];
        while batch.len() < MAX_ITEMS {
            match rx.try_recv() {
                Ok(request) => batch.push(request),
                Err(_) => break,
            }
        }
        let store = store.clone();
        tokio::spawn(async move {
            send(&store, function, group_function, batch).await;
            drop(permit);
        });
    }
}

/// Sends `batch`: alone when it is one call, else as one group, split on failure.
async fn send(store: &Store, function: &'static str, group_function: &'static str, mut batch: Vec<Request>) {
    batch.retain(|r| !r.reply.is_closed());
    if batch.len() <= 1 {
        if let Some(r) = batch.pop() {
            let result = store.call(function, &r.arg, Replay::Safe, Some(r.deadline)).await;
            let _ = r.reply.send(result);
        }
        return;
    }
    batch.sort_by(|a, b| a.arg["threadId"].as_str().cmp(&b.arg["threadId"].as_str()));
    let deadline = batch.iter().map(|r| r.deadline).min().unwrap_or_else(Instant::now);
    let items: Vec<Value> = batch.iter_mut().map(|r| r.arg.take()).collect();
    let n = items.len();
    let group = json!({ "items": items });
    metrics::histogram!("agentloop_step_group_items", "function" => function).record(n as f64);
    match store.call(group_function, &group, Replay::Safe, Some(deadline)).await {
        Ok(Value::Array(results)) if results.len() == n => {
            for (r, value) in batch.into_iter().zip(results) {
                let _ = r.reply.send(Ok(value));
            }
        }
        other => {
            let error = match other {
                Ok(value) => format!("unexpected group answer: {}", value.to_string().chars().take(200).collect::<String>()),
                Err(e) => e.to_string(),
            };
            tracing::warn!(db.function = group_function, items = n, %error, "group failed; sending its items one by one");
            metrics::counter!("agentloop_step_groups_split_total", "function" => function).increment(1);
            let Value::Object(mut group) = group else { unreachable!("built above") };
            let Some(Value::Array(items)) = group.remove("items") else { unreachable!("built above") };
            let calls = batch.into_iter().zip(items).map(|(r, arg)| async move {
                let result = store.call(function, &arg, Replay::Safe, Some(r.deadline)).await;
                let _ = r.reply.send(result);
            });
            futures_util::future::join_all(calls).await;
        }
    }
}
