//! API commands that change a thread's runs, messages, approvals or operations (SPEC §13). Each
//! is ONE call of its step function (`migrations/2026-12-01-000005_durable_core`): one
//! transaction taking the locks in the one order (thread, then its runs, then approvals and
//! operations), so no two commands — and no command and a worker's step — can deadlock, and a
//! business refusal (`AL4xx`) rolls everything back. The api validates input first; these
//! functions only shape the arguments and pick the replay rule.

use serde::Serialize;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::store::{Replay, Store, StoreError};

/// How the model of a new run is chosen: the request's, else the thread's, else the server's
/// default; `models` (the configured ids) makes an unconfigured one a 409
/// `model_not_configured` at once instead of a failed run.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelChoice {
    pub model: Option<String>,
    pub default_model: Option<String>,
    pub models: Vec<String>,
}

/// A user turn's content with its accounting.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Turn {
    /// A string or an array of content parts.
    pub content: Value,
    /// Tokens (approximate).
    pub token_estimate: i32,
    /// Stored size in bytes.
    pub byte_size: usize,
}

/// `POST /api/threads/{id}/chat`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Chat {
    pub principal_id: Uuid,
    pub thread_id: Uuid,
    /// The idempotency key (header or body), if any.
    pub command_id: Option<String>,
    /// Fingerprint of the request (a reused key with another body is a conflict).
    pub fingerprint: String,
    #[serde(flatten)]
    pub turn: Turn,
    /// `reject` | `enqueue` | `interrupt`; `None`: the thread's `metadata.multitask`.
    pub multitask: Option<&'static str>,
    pub max_steps: i32,
    #[serde(flatten)]
    pub model: ModelChoice,
}

async fn run(store: &Store, function: &'static str, arg: &impl Serialize, replay: Replay) -> Result<Value, StoreError> {
    let arg = serde_json::to_value(arg).map_err(|e| StoreError::Deterministic { sqlstate: "XX000".into(), message: e.to_string() })?;
    store.call(function, &arg, replay, None).await
}

/// [`run`] for a command that inserts a run: the W3C `traceparent` of the current request
/// ([`crate::telemetry::traceparent`]), if any, is stored on the new run so the worker's spans
/// join the request's trace (`migrations/…000012_trace_context`). The receipt fingerprint is
/// computed before and never includes it.
async fn run_traced(store: &Store, function: &'static str, arg: &impl Serialize, replay: Replay) -> Result<Value, StoreError> {
    let mut arg = serde_json::to_value(arg).map_err(|e| StoreError::Deterministic { sqlstate: "XX000".into(), message: e.to_string() })?;
    if let (Some(traceparent), Some(object)) = (crate::telemetry::traceparent(), arg.as_object_mut()) {
        object.insert("traceparent".into(), Value::String(traceparent));
    }
    store.call(function, &arg, replay, None).await
}

/// Persists the user turn and enqueues its run (`queued`, or `pending` behind the active run),
/// or replays the receipt of the same idempotency key. Returns `{run, message}` (`message` null
/// for a pending run). Refusals: 404 `not_found`, 409 `run_active` / `approval_required` /
/// `idempotency_conflict` / `model_not_configured`, 400 `no_model`. Safe to resend after an
/// unknown outcome only when it carries an idempotency key.
pub async fn chat(store: &Store, command: &Chat) -> Result<Value, StoreError> {
    let replay = if command.command_id.is_some() { Replay::Safe } else { Replay::Unsafe };
    run_traced(store, "agentloop_chat", command, replay).await
}

/// Cancels a run (idempotent): see `agentloop_cancel`. Returns the run.
pub async fn cancel_run(store: &Store, principal: Uuid, run_id: Uuid) -> Result<Value, StoreError> {
    run(store, "agentloop_cancel_run", &json!({"principalId": principal, "runId": run_id}), Replay::Safe).await
}

/// Cancels a thread's active run and every pending run behind it. Returns `{runs}`.
pub async fn cancel_thread(store: &Store, principal: Uuid, thread_id: Uuid) -> Result<Value, StoreError> {
    run(store, "agentloop_cancel_thread", &json!({"principalId": principal, "threadId": thread_id}), Replay::Safe).await
}

/// Soft-deletes a thread, cancelling its runs and approvals. Not safe to resend (a second call
/// is a 404), so an unknown outcome is reported as such.
pub async fn delete_thread(store: &Store, principal: Uuid, thread_id: Uuid) -> Result<Value, StoreError> {
    run(store, "agentloop_delete_thread", &json!({"principalId": principal, "threadId": thread_id}), Replay::Unsafe).await
}

/// A human decision on a tool approval.
#[derive(Debug, Clone)]
pub enum Decision {
    /// Run the call, with `arguments` (validated against the stored schema) instead of the
    /// proposal when given.
    Approve { arguments: Option<Value> },
    /// Do not run it; the model reads "Tool call declined by the user. Reason: ...".
    Reject { reason: Option<String> },
}

/// Decides approval `approval_id` (compare-and-set). Returns `{approval, run}`; 404, 409
/// `approval_decided`.
pub async fn decide(store: &Store, principal: Uuid, approval_id: Uuid, decision: Decision) -> Result<Value, StoreError> {
    let arg = match decision {
        Decision::Approve { arguments } => json!({"principalId": principal, "approvalId": approval_id, "decision": "approve", "arguments": arguments}),
        Decision::Reject { reason } => json!({"principalId": principal, "approvalId": approval_id, "decision": "reject", "reason": reason}),
    };
    run(store, "agentloop_decide", &arg, Replay::Unsafe).await
}

/// An explicit resolution of an uncertain operation (SPEC §7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The effect happened; `result` (or a note) becomes the call's result.
    Completed { result: Option<String> },
    /// It did not happen; the call's result says so.
    Failed { reason: Option<String> },
    /// It is safe to run again: the next slice dispatches it again under the same key.
    Retry,
}

/// Resolves uncertain operation `key` of blocked run `run_id` (optionally only if the run's
/// `updatedAt` is still `expected_updated_at`). Returns `{operation, run}`; 404, 409
/// `stale_resolve`.
pub async fn resolve(
    store: &Store,
    principal: Uuid,
    run_id: Uuid,
    key: &str,
    outcome: Outcome,
    expected_updated_at: Option<chrono::DateTime<chrono::Utc>>,
) -> Result<Value, StoreError> {
    let (label, result, reason) = match outcome {
        Outcome::Completed { result } => ("completed", result, None),
        Outcome::Failed { reason } => ("failed", None, reason),
        Outcome::Retry => ("retry", None, None),
    };
    let arg = json!({"principalId": principal, "runId": run_id, "key": key, "outcome": label, "result": result,
                     "reason": reason, "expectedUpdatedAt": expected_updated_at});
    run(store, "agentloop_resolve", &arg, Replay::Unsafe).await
}

/// Options of the runs that branch operations enqueue.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RunOptions {
    pub max_steps: i32,
    #[serde(flatten)]
    pub model: ModelChoice,
    /// Replace messages whose tool calls took effect (else 409 `effects_in_branch`).
    pub repeat_effects: bool,
}

/// Replaces user message `sequence` (it and everything after become inactive, kept as a branch
/// the user can switch back to: `agentloop_edit_branching`) and enqueues a run. Returns
/// `{run, message, deactivated}`; 404, 400 `not_a_user_message`, 409 `run_active` /
/// `approval_required` / `model_not_configured`.
pub async fn edit(store: &Store, principal: Uuid, thread_id: Uuid, sequence: i64, turn: Turn, options: RunOptions) -> Result<Value, StoreError> {
    let mut arg = serde_json::to_value(&options).unwrap_or_default();
    extend(&mut arg, json!({"principalId": principal, "threadId": thread_id, "sequence": sequence}));
    extend(&mut arg, serde_json::to_value(&turn).unwrap_or_default());
    run_traced(store, "agentloop_edit_branching", &arg, Replay::Unsafe).await
}

/// A new answer from `sequence` (see `agentloop_regenerate`; the replaced rows are kept as a
/// branch: `agentloop_regenerate_branching`). Returns `{run, deactivated}`.
pub async fn regenerate(store: &Store, principal: Uuid, thread_id: Uuid, sequence: i64, options: RunOptions) -> Result<Value, StoreError> {
    let mut arg = serde_json::to_value(&options).unwrap_or_default();
    extend(&mut arg, json!({"principalId": principal, "threadId": thread_id, "sequence": sequence}));
    run_traced(store, "agentloop_regenerate_branching", &arg, Replay::Unsafe).await
}

/// Deactivates message `sequence` with its whole tool group. Returns `{deactivated}`.
/// 409 `effects_in_branch` when the group holds calls that took effect, unless `repeat_effects`.
pub async fn delete_message(store: &Store, principal: Uuid, thread_id: Uuid, sequence: i64, repeat_effects: bool) -> Result<Value, StoreError> {
    let arg = json!({"principalId": principal, "threadId": thread_id, "sequence": sequence, "repeatEffects": repeat_effects});
    run(store, "agentloop_delete_message", &arg, Replay::Unsafe).await
}

/// Manual compaction into a child thread. Returns `{thread, run}`.
pub async fn compact(store: &Store, principal: Uuid, thread_id: Uuid, model: ModelChoice) -> Result<Value, StoreError> {
    let mut arg = serde_json::to_value(&model).unwrap_or_default();
    extend(&mut arg, json!({"principalId": principal, "threadId": thread_id}));
    run_traced(store, "agentloop_compact", &arg, Replay::Unsafe).await
}

/// The stateless endpoint's hidden thread with `messages` (already shaped as step-function
/// messages) and its one-slice run. Returns `{threadId, run}`.
pub async fn stateless(store: &Store, principal: Uuid, model: &str, messages: &[crate::messages::NewMessage]) -> Result<Value, StoreError> {
    run_traced(store, "agentloop_stateless", &json!({"principalId": principal, "model": model, "messages": messages}), Replay::Unsafe).await
}

/// Creates a thread (title already validated) and journals its `thread` event. Returns the
/// thread. Not safe to resend after an unknown outcome (it would create a second thread).
pub async fn create_thread(store: &Store, principal: Uuid, title: String, model: Option<String>, metadata: Value) -> Result<Value, StoreError> {
    let arg = json!({"principalId": principal, "title": title, "model": model, "metadata": metadata});
    run(store, "agentloop_create_thread", &arg, Replay::Unsafe).await
}

/// Changes a thread's given fields (others untouched) and journals `thread`. Returns the thread;
/// 404. Safe to resend (it sets the same values again).
pub async fn update_thread(
    store: &Store,
    principal: Uuid,
    thread_id: Uuid,
    title: Option<String>,
    model: Option<String>,
    metadata: Option<Value>,
) -> Result<Value, StoreError> {
    let arg = json!({"principalId": principal, "threadId": thread_id, "title": title, "model": model, "metadata": metadata});
    run(store, "agentloop_update_thread", &arg, Replay::Safe).await
}

/// Shows another alternative of a fork (`agentloop_activate_branch`): `sequence` is the active
/// message that starts the shown alternative, `first_sequence` the first message of the one to
/// show. Returns `{parentSequence, activated, deactivated}`; 404, 409 `run_active` /
/// `approval_required`. Not replay-safe (a second call switches back).
pub async fn activate_branch(
    store: &Store,
    principal: Uuid,
    thread_id: Uuid,
    sequence: i64,
    first_sequence: i64,
    repeat_effects: bool,
) -> Result<Value, StoreError> {
    let arg = json!({"principalId": principal, "threadId": thread_id, "sequence": sequence, "firstSequence": first_sequence,
                     "repeatEffects": repeat_effects});
    run(store, "agentloop_activate_branch", &arg, Replay::Unsafe).await
}

/// Undoes a thread delete made less than `window` ago (`agentloop_restore_thread`). Returns the
/// thread; 404 when there is nothing to restore. Idempotent in effect, but a second call is a
/// 404, so an unknown outcome is reported as such.
pub async fn restore_thread(store: &Store, principal: Uuid, thread_id: Uuid, window: std::time::Duration) -> Result<Value, StoreError> {
    let arg = json!({"principalId": principal, "threadId": thread_id, "windowMs": window.as_millis() as u64});
    run(store, "agentloop_restore_thread", &arg, Replay::Unsafe).await
}

/// Whether thread `thread_id` is still untitled (`agentloop_auto_title` without a title: a read).
pub async fn needs_title(store: &Store, thread_id: Uuid) -> Result<bool, StoreError> {
    let v = run(store, "agentloop_auto_title", &json!({"threadId": thread_id}), Replay::Safe).await?;
    Ok(v.get("needed").and_then(Value::as_bool).unwrap_or(false))
}

/// Sets an automatic title on a thread that is still untitled (`agentloop_auto_title`; a
/// rename always wins). Returns whether it was set. Replay-safe: a second call changes nothing.
pub async fn auto_title(store: &Store, thread_id: Uuid, title: &str) -> Result<bool, StoreError> {
    let v = run(store, "agentloop_auto_title", &json!({"threadId": thread_id, "title": title}), Replay::Safe).await?;
    Ok(v.get("set").and_then(Value::as_bool).unwrap_or(false))
}

fn extend(target: &mut Value, more: Value) {
    if let (Some(t), Value::Object(m)) = (target.as_object_mut(), more) {
        t.extend(m);
    }
}

/// `POST /api/threads/import` (issue 12): a new thread holding an imported history, in ONE
/// transaction (`agentloop_import`): receipt, thread, messages with gap-free sequences and
/// strictly increasing timestamp identities, one `thread` journal event. `arg` is the step
/// function's argument (see the migration `2026-12-02-000008_openai_import_mcp`). Returns
/// `{thread, messages, format, repairs}` (plus `replayed: true` for a replayed receipt); 409
/// `idempotency_conflict`. Safe to resend after an unknown outcome only with an idempotency key.
pub async fn import_thread(store: &Store, arg: &Value) -> Result<Value, StoreError> {
    let replay = if arg.get("commandId").is_some_and(|k| !k.is_null()) { Replay::Safe } else { Replay::Unsafe };
    store.call("agentloop_import", arg, replay, None).await
}

/// The idempotency key of a `/v1` request: the receipt's command id (`v1:<Idempotency-Key>`)
/// and the request's fingerprint ([`crate::receipts::fingerprint`]).
pub struct OpenAiKey<'a> {
    pub command_id: &'a str,
    pub fingerprint: &'a str,
}

/// Messages a `/v1/chat/completions` request may carry, and its conversation may hold once the
/// server's own calls of earlier requests are put back (migration 000041: 400
/// `too_many_messages`).
pub const OPENAI_MAX_MESSAGES: usize = 10_000;

/// The OpenAI endpoint's hidden thread (`agentloop_openai_start`): `messages` (step-function
/// messages), a one-slice run, `client_tools` (OpenAI function specs the worker offers and
/// returns to the caller instead of running), `settings` (`{maxTokens?, temperature?}`, the
/// thread's generation settings) and the request's lease row held by `holder` for `lease_ms`.
/// Returns `{threadId, run, attachment}`. With `key` (migration 000036): a resend of
/// a request in flight attaches to it (`attached: true`, the next `attachment`), one that ended
/// returns `{replay: {status, body}}`, one whose api died after an effect
/// `{interrupted: {threadId, runId}}`; 409 `idempotency_conflict` for another body. Safe to
/// resend after an unknown outcome only with a key.
pub async fn openai_start(
    store: &Store,
    principal: Uuid,
    model: &str,
    messages: &[crate::messages::NewMessage],
    client_tools: &[Value],
    settings: &Value,
    holder: &str,
    lease_ms: u64,
    key: Option<OpenAiKey<'_>>,
) -> Result<Value, StoreError> {
    let mut arg = json!({"principalId": principal, "model": model, "messages": messages, "clientTools": client_tools,
                         "settings": settings, "holder": holder, "leaseMs": lease_ms, "maxMessages": OPENAI_MAX_MESSAGES});
    let replay = match key {
        Some(key) => {
            arg["commandId"] = json!(key.command_id);
            arg["fingerprint"] = json!(key.fingerprint);
            Replay::Safe
        }
        None => Replay::Unsafe,
    };
    run_traced(store, "agentloop_openai_start", &arg, replay).await
}

/// Renews the leases of the open requests `threads` held by `holder` (one statement). Returns
/// how many were renewed.
pub async fn openai_renew(store: &Store, holder: &str, lease_ms: u64, threads: &[Uuid]) -> Result<i64, StoreError> {
    let value = run(store, "agentloop_openai_renew", &json!({"holder": holder, "leaseMs": lease_ms, "threadIds": threads}), Replay::Safe).await?;
    Ok(value["renewed"].as_i64().unwrap_or(0))
}

/// Ends a hidden thread's request: cancels its runs and deletes the thread when none is active,
/// else releases it for the sweep (`agentloop_openai_finish`). Idempotent. Returns whether the
/// thread is gone.
///
/// `delivered`: whether the client got the run's answer (an error does not count: it does not
/// tell what the tool calls did); a thread whose request ended without it after a tool call
/// took effect is kept (migration 000029), as is one whose run left a call of unknown outcome.
///
/// `attachment` (keyed requests, migration 000036): only the newest attachment of a request ends
/// it (an older one's call does nothing and answers gone); `response` (`{status, body}`) is kept
/// on the request's receipt for resends of its key.
pub async fn openai_finish(
    store: &Store,
    principal: Uuid,
    thread_id: Uuid,
    delivered: bool,
    attachment: Option<i64>,
    response: Option<&Value>,
) -> Result<bool, StoreError> {
    let mut arg = json!({"principalId": principal, "threadId": thread_id, "delivered": delivered});
    if let Some(attachment) = attachment {
        arg["attachment"] = json!(attachment);
    }
    if let Some(response) = response {
        arg["response"] = response.clone();
    }
    let value = run(store, "agentloop_openai_finish", &arg, Replay::Safe).await?;
    Ok(value["gone"].as_bool() == Some(true))
}

/// Notes the client-side calls of a `/v1` request's completed run before the api returns them
/// (`agentloop_openai_note_client_calls`, migration 000038), when its thread holds an effect (it
/// is kept): the client's next request carrying one of those calls gets the run's server calls
/// and their results put back before it, so the model sees what the server already did.
/// Idempotent; returns how many calls were noted (0 for a run without effects).
pub async fn openai_note_client_calls(store: &Store, thread_id: Uuid) -> Result<i64, StoreError> {
    let value = run(store, "agentloop_openai_note_client_calls", &json!({"threadId": thread_id}), Replay::Safe).await?;
    Ok(value["noted"].as_i64().unwrap_or(0))
}

/// A `/v1` request cancels its own run (`agentloop_openai_cancel`): a run that waits for a human
/// (an approval, an uncertain effect) cannot be resolved by a stateless caller. The principal
/// commands do not find a hidden thread (migration 000029), so the request uses this one.
pub async fn openai_cancel(store: &Store, principal: Uuid, thread_id: Uuid) -> Result<Value, StoreError> {
    run(store, "agentloop_openai_cancel", &json!({"principalId": principal, "threadId": thread_id}), Replay::Safe).await
}

/// How long [`openai_sweep`] retries transient faults.
pub const SWEEP_RETRY: std::time::Duration = std::time::Duration::from_millis(500);

/// The workers' sweep of abandoned hidden threads (`agentloop_openai_sweep`): `(purged,
/// still pending, ms until the earliest lease of a held request expires)`.
///
/// `spare`: leases that expired less than this long ago are left (after an outage, see
/// `worker/src/hidden_threads.rs`).
///
/// Not retried through an outage (one short window, [`SWEEP_RETRY`]): `spare` is decided when
/// the call is sent, and a call that waited out an outage would sweep with the spare of before
/// it — the failure is reported instead, and the next pass spares what the outage let expire.
pub async fn openai_sweep(store: &Store, limit: i64, spare: std::time::Duration) -> Result<(i64, i64, Option<i64>), StoreError> {
    let arg = json!({"limit": limit, "spareMs": spare.as_millis() as u64});
    let value = store.call("agentloop_openai_sweep", &arg, Replay::Safe, Some(std::time::Instant::now() + SWEEP_RETRY)).await?;
    Ok((value["purged"].as_i64().unwrap_or(0), value["pending"].as_i64().unwrap_or(0), value["nextExpiryMs"].as_i64()))
}
