//! The steps a slice commits (SPEC §6), each ONE fenced call of a step function:
//!
//! - [`start_slice`] — `agentloop_slice_start`: step row `run:{id}:step:{n}`, uncertain
//!   operations block the run, the model context is loaded and its size recorded, the `run`
//!   event journaled;
//! - [`commit`] — `agentloop_commit`: a [`Commit`] value (messages, operation transitions,
//!   approvals, snapshot, journal events, context size, usage deltas, and the slice's
//!   [`SliceEnd`] with the run transition and FIFO promotion). Idempotent by its commit id: after
//!   an unknown outcome the same value is sent again and the first result comes back;
//! - [`flush_streams`] — `agentloop_stream`: the partial answers of every slice a worker is
//!   streaming, in one transaction.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use uuid::Uuid;

use super::lease::Lease;
use crate::approvals::{Approval, NewApproval};
use crate::messages::{Message, NewMessage};
use crate::operations::Operation;
use crate::runs::Run;
use crate::store::{Replay, Store, StoreError};

fn decode<T: serde::de::DeserializeOwned>(value: Value) -> Result<T, StoreError> {
    serde_json::from_value(value).map_err(|e| StoreError::Deterministic { sqlstate: "XX000".into(), message: format!("decoding a step result: {e}") })
}

/// The live snapshot a context was built from.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotRef {
    pub version: i32,
    pub summary: String,
    /// First and last canonical sequence the summary covers.
    pub from_sequence: i64,
    pub to_sequence: i64,
    /// Tokens of the summary.
    pub token_estimate: i32,
}

/// The model context as stored (SPEC §6 step 2).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadedContext {
    pub snapshot: Option<SnapshotRef>,
    /// With a snapshot: active system/developer rows before its coverage.
    pub instructions: Vec<Message>,
    /// Active rows (after the snapshot's coverage, when there is one).
    pub messages: Vec<Message>,
    /// Sum of the rows' token estimates (at least 1 each) plus the summary's.
    pub tokens: i64,
}

/// The run's last tool-call message and which of its calls already have a result.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OpenCalls {
    pub message: Message,
    /// Tool-call ids answered by a `tool` row after the message.
    pub answered: Vec<String>,
}

/// What a slice starts from.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SliceStart {
    pub step: StepRef,
    pub run: Run,
    /// The thread's metadata (compaction knobs, `stateless`, ...).
    pub metadata: Value,
    pub context: LoadedContext,
    pub open: Option<OpenCalls>,
    /// The run's approvals (only when `open` is set).
    pub approvals: Vec<Approval>,
    /// The run's operations (only when `open` is set).
    pub operations: Vec<Operation>,
}

/// The step row of the slice.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct StepRef {
    pub id: i64,
    pub sequence: i32,
    /// Tool calls of the step so far: more than 0 when the step is re-opened (a slot given back,
    /// a shutdown hand-back, a recovery); they count towards the slice's tool-call limit.
    #[serde(default, rename = "toolCalls")]
    pub tool_calls: i32,
}

/// Result of [`start_slice`].
#[derive(Debug)]
pub enum Started {
    /// The lease is gone: write nothing.
    Lost,
    /// Operations of an earlier attempt have an unknown outcome: the run is now `blocked`.
    Blocked(Box<Run>),
    /// The slice can run.
    Ready(Box<SliceStart>),
}

/// Starts slice `step_sequence` of the leased run with `model` (see the module docs).
/// `tool_tokens` (the tool schemas' size) is added to the recorded context size;
/// `context_limit` is the model's.
pub async fn start_slice(
    store: &Store,
    lease: &Lease,
    step_sequence: i32,
    model: &str,
    tool_tokens: i64,
    context_limit: Option<i64>,
    deadline: Instant,
) -> Result<Started, StoreError> {
    let mut arg = lease.fence_json();
    arg["stepSequence"] = json!(step_sequence);
    arg["model"] = json!(model);
    arg["toolTokens"] = json!(tool_tokens);
    arg["contextLimit"] = json!(context_limit);
    let value = store.call("agentloop_slice_start", &arg, Replay::Safe, Some(deadline)).await?;
    started_from(value)
}

/// Decodes an `agentloop_slice_start` answer: from [`start_slice`], or one the claim made
/// ([`super::claim::Claimed::starts`]).
pub fn started_from(value: Value) -> Result<Started, StoreError> {
    if value.get("lost").and_then(Value::as_bool) == Some(true) {
        return Ok(Started::Lost);
    }
    if value.get("ended").is_some() {
        return Ok(Started::Blocked(Box::new(decode(value["run"].clone())?)));
    }
    Ok(Started::Ready(Box::new(decode(value)?)))
}

/// How a slice ends (the run transition written with its last commit; `agentloop_end_run`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum SliceEnd {
    /// Final answer: the run is `completed`.
    Completed,
    /// Per-slice tool-call limit reached: the same run goes back to `queued`.
    Requeued,
    /// Shutdown with the lease still held: back to `queued`, the step not consumed.
    Interrupted,
    /// The slot was given to another principal between two steps (the worker's
    /// `slot_yield`, migration 000042): written as [`SliceEnd::Interrupted`] — back to
    /// `queued`, the step not consumed.
    #[serde(rename = "interrupted")]
    Yielded,
    /// A transient fault the slice could not outlast: back to `queued`, the step not consumed;
    /// with `fault`, `faults + 1` (a run that keeps faulting without progress ends
    /// `abandoned`). Without: the database was unavailable to everyone (an outage, migration
    /// 000023), which says nothing about the run.
    Handback { fault: bool },
    /// The run failed with a stable code.
    Failed { code: String, message: String },
    /// Cancellation was requested and honoured. With `keep_streamed` (the slice has no partial
    /// answer of its own, e.g. a recovery of a run whose worker died mid-stream) the database
    /// commits the partial answer it holds (streaming snapshot + deltas) as a stopped message.
    #[serde(rename_all = "camelCase")]
    Cancelled { keep_streamed: bool },
    /// Tool calls wait for a human decision (lease released).
    WaitingApproval,
    /// A tool call waits for the user's sign-in at an MCP server (lease released); written by
    /// [`crate::mcp_auth::park`] only, with the authorization row.
    WaitingAuthorization,
    /// An operation's outcome is unknown (SPEC §7).
    Blocked,
}

impl SliceEnd {
    /// A short label (metrics, logs).
    pub fn label(&self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::Requeued => "requeued",
            Self::Interrupted => "interrupted",
            Self::Yielded => "yielded",
            Self::Handback { .. } => "handback",
            Self::Failed { .. } => "failed",
            Self::Cancelled { .. } => "cancelled",
            Self::WaitingApproval => "waiting_approval",
            Self::WaitingAuthorization => "waiting_authorization",
            Self::Blocked => "blocked",
        }
    }
}

/// A change of the operations ledger (SPEC §7).
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum OperationChange {
    /// New (or `prepared` after a `retry` resolve) -> `dispatched`, committed before the call
    /// leaves the process.
    #[serde(rename_all = "camelCase")]
    Dispatch { key: String, tool_call_id: String, tool_name: String, arguments: Value },
    /// `dispatched` -> `completed` | `failed` | `uncertain`, with the (bounded) result text.
    Finish { key: String, status: &'static str, result: String },
}

/// A compaction snapshot to write (SPEC §8).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotWrite {
    pub summary: String,
    pub token_estimate: i32,
    /// Timestamp identities of the canonical rows the summary covers.
    pub identities: Vec<i64>,
    /// The folded earlier snapshot's coverage, when the summary includes it.
    pub previous: Option<Coverage>,
    /// The `compaction` journal event (`snapshotVersion` is added).
    pub event: Value,
}

/// A snapshot's canonical coverage.
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Coverage {
    pub from_sequence: i64,
    pub to_sequence: i64,
}

/// A journal event written with a commit.
#[derive(Debug, Clone, Serialize)]
pub struct JournalEvent {
    pub kind: &'static str,
    pub payload: Value,
}

/// The context size recorded before a model call (tokens).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ContextSize {
    pub tokens: i64,
    pub limit: Option<i64>,
}

/// Usage accumulated since the previous commit (added to the step and the run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    pub model_calls: i32,
    pub tool_calls: i32,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
}

impl Usage {
    /// Whether nothing was counted.
    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}

/// Everything one checkpoint writes, in one transaction (see [`commit`]).
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Commit {
    /// Appended in order with provenance (run, step).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub messages: Vec<NewMessage>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub operations: Vec<OperationChange>,
    /// Approval rows to create (the batch of `ask` calls), with their deadline.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub approvals: Vec<NewApproval>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub approval_timeout_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<SnapshotWrite>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<JournalEvent>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<ContextSize>,
    #[serde(skip_serializing_if = "Usage::is_zero")]
    pub usage: Usage,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub end: Option<SliceEnd>,
}

impl Commit {
    /// Whether the commit carries work that was paid for or took effect and would be lost with
    /// it: messages (a model answer, tool results, a stopped partial) or a compaction summary.
    /// [`commit`] holds such a commit through transient faults (its `hold`).
    pub fn carries_paid_work(&self) -> bool {
        !self.messages.is_empty() || self.snapshot.is_some()
    }
}

/// What a commit did.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Committed {
    /// `(sequence, timestamp identity)` of each appended message, in order.
    pub messages: Vec<Identity>,
    /// The run's status after the commit.
    pub status: String,
    /// Cancellation was requested (stop at the next safe point).
    pub cancel_requested: bool,
    /// The snapshot version written, if any, and its canonical coverage.
    pub snapshot_version: Option<i32>,
    pub snapshot_from: Option<i64>,
    pub snapshot_to: Option<i64>,
    /// The commit had already been applied by an earlier attempt whose answer was lost.
    #[serde(default)]
    pub replayed: bool,
}

/// A canonical row's cursor and identity.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct Identity {
    pub sequence: i64,
    pub timestamp: i64,
}

/// Applies `commit` for the leased run (step `step_id`, when the step row exists). `None` when
/// the lease is gone (nothing was written). Retries transient faults and unknown outcomes
/// (with the same commit id) until `deadline()`: the lease as last confirmed, asked again when
/// the retries run out.
///
/// `hold`: for a commit that carries a paid model answer (or a tool's result), the latest
/// instant to keep retrying it past that deadline, through every transient fault — a database
/// outage ([`StoreError::Outage`]) and statement, lock and pool timeouts
/// ([`StoreError::Unavailable`]) alike, whether or not the lease is being confirmed meanwhile:
/// - another session holds the thread's row while the database answers the renewals
///   (acceptance probe: a 20 s `SELECT ... FOR UPDATE` on the thread handed the run back and
///   paid the answer again);
/// - the worker's connections freeze (a half-open network path, a stalled proxy): a timeout is
///   all the worker sees, the renewals time out too, and a frozen path cannot be told from a
///   lock wait (chaos soak: the answer arrived during a 2 s freeze, the checkpoint gave up at
///   the lease's deadline, and the run was taken again and paid twice).
/// Each try after the first waits at least 1 s from the start of the one before and may take
/// until the later of the lease's deadline and 1 s from now.
///
/// Safe because the write is fenced (owner + fencing token, not the lease's expiry): the answer
/// is saved if no other worker took the run meanwhile, else the fence answers `None`. The same
/// commit id is sent every time, so an attempt whose outcome was unknown is found, not applied
/// twice. Every hold ends at `hold` (`WORKER_OUTAGE_HOLD_MS` after the commit began), so a
/// commit that can never be written still ends its run's slice.
pub async fn commit(
    store: &Store,
    lease: &Lease,
    step_id: Option<i64>,
    commit: &Commit,
    deadline: &(dyn Fn() -> Instant + Send + Sync),
    hold: Option<Instant>,
) -> Result<Option<Committed>, StoreError> {
    let mut arg = serde_json::to_value(commit).map_err(|e| StoreError::Deterministic { sqlstate: "XX000".into(), message: e.to_string() })?;
    let fence = lease.fence_json();
    if let (Some(obj), Value::Object(f)) = (arg.as_object_mut(), fence) {
        obj.extend(f);
        obj.insert("commitId".into(), json!(Uuid::new_v4()));
        obj.insert("stepId".into(), json!(step_id));
    }
    let lease_deadline = deadline;
    let mut deadline = lease_deadline();
    let held = |hold: Option<Instant>| hold.is_some_and(|h| Instant::now() + OUTAGE_RETRY < h);
    let value = loop {
        let began = Instant::now();
        match store.call("agentloop_commit", &arg, Replay::Safe, Some(deadline)).await {
            Err(StoreError::Outage(message) | StoreError::Unavailable(message)) if held(hold) => {
                tracing::warn!(run.id = %lease.run_id, error = %message, "database unavailable: holding the paid answer until it can be written");
                metrics::counter!("agentloop_commits_held_total").increment(1);
                tokio::time::sleep_until((began + OUTAGE_RETRY).into()).await;
                deadline = lease_deadline().max(Instant::now() + OUTAGE_RETRY);
            }
            result => break result?,
        }
    };
    if value.get("lost").and_then(Value::as_bool) == Some(true) {
        return Ok(None);
    }
    if value.get("replayed").and_then(Value::as_bool) == Some(true) {
        // The first attempt committed and its connection broke: its notifications, sent after
        // the commit (`Store::with_deferred_notifications`), may be lost. Best effort: the
        // commit stands either way.
        if let Err(error) = store.call("agentloop_renotify", &json!({"threadId": lease.thread_id}), Replay::Safe, Some(deadline)).await {
            tracing::warn!(%error, "could not announce a replayed commit");
        }
    }
    decode(value).map(Some)
}

/// How often a held commit is tried again while the database is away ([`commit`]'s `hold`).
const OUTAGE_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// One slice's streaming progress since its last flush.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamItem {
    pub run_id: Uuid,
    pub epoch: i64,
    pub thread_id: Uuid,
    /// UTF-16 code units of the partial text before `delta` (0 restarts the partial).
    pub offset: usize,
    pub delta: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_offset: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_delta: Option<String>,
    /// The whole partial, written to `threads.streaming_message` now and then.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<StreamSnapshot>,
}

/// The whole partial answer.
#[derive(Debug, Clone, Serialize)]
pub struct StreamSnapshot {
    pub content: String,
    pub reasoning: String,
}

/// What a stream flush did not write ([`flush_streams`]).
#[derive(Debug, Default, Deserialize)]
pub struct Unflushed {
    /// Runs whose lease is gone: their slices stop.
    pub lost: Vec<Uuid>,
    /// Runs whose thread another session held (SKIP LOCKED, migration 000030): sent again by the
    /// next flush.
    #[serde(default)]
    pub skipped: Vec<Uuid>,
}

/// Writes the streaming progress of every item whose lease `owner` still holds and whose thread
/// no other session holds, in one transaction. Returns the runs whose lease is gone and those
/// skipped. Not retried: the next flush resends from the last confirmed offset, and offsets make
/// an overlap harmless.
pub async fn flush_streams(store: &Store, owner: &str, items: &[StreamItem]) -> Result<Unflushed, StoreError> {
    let arg = json!({"owner": owner, "items": items});
    let value = store.call("agentloop_stream", &arg, Replay::Safe, Some(Instant::now())).await?;
    decode(value)
}

/// Records the known outcome (`completed` | `failed`, with its result text) of operation `key`
/// that this lease dispatched, after the checkpoint carrying it could not be committed (lease
/// lost, or the database away too long): see `agentloop_record_outcome`. Retries until
/// `deadline`. Returns whether the row was still waiting for it.
pub async fn record_outcome(store: &Store, lease: &Lease, key: &str, status: &str, result: &str, deadline: Instant) -> Result<bool, StoreError> {
    let arg = json!({"runId": lease.run_id, "threadId": lease.thread_id, "key": key, "epoch": lease.epoch,
                     "status": status, "result": result});
    let value = store.call("agentloop_record_outcome", &arg, Replay::Safe, Some(deadline)).await?;
    Ok(value["recorded"].as_bool() == Some(true))
}

/// Ends MCP sign-ins that cannot complete on their own (`agentloop_mcp_sweep`: an exchange
/// interrupted for over `stuck`, an expired link; a pending one a later token of the same
/// principal and server satisfies) and requeues their runs. Returns `(ended, ms until the next
/// deadline)`.
pub async fn sweep_signins(store: &Store, stuck: std::time::Duration, limit: i64) -> Result<(i64, Option<i64>), StoreError> {
    let arg = json!({"stuckMs": stuck.as_millis() as u64, "limit": limit});
    let value = store.call("agentloop_mcp_sweep", &arg, Replay::Safe, None).await?;
    Ok((value["ended"].as_i64().unwrap_or(0), value["nextDeadlineMs"].as_i64()))
}

/// The approval expiry sweep (`agentloop_expire_approvals`): `(expired, ms until the next
/// pending deadline)`.
pub async fn expire_approvals(store: &Store, limit: i64) -> Result<(i64, Option<i64>), StoreError> {
    let value = store.call("agentloop_expire_approvals", &json!({"limit": limit}), Replay::Safe, None).await?;
    Ok((value["expired"].as_i64().unwrap_or(0), value["nextDeadlineMs"].as_i64()))
}
