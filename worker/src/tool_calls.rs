//! The tool calls of a slice (SPEC §6 step 5, §7): approval policy, human approvals, and the
//! operations ledger for calls with external effects.
//!
//! The assistant tool-call message is checkpointed BEFORE any call runs, so every call is
//! durable before its effect; each result is then appended in its own fenced transaction (with
//! the call's operation outcome, for non-idempotent tools). A slice therefore starts with
//! [`resume`]: operations a dead attempt left `dispatched` become `uncertain` and block the run;
//! otherwise the unanswered calls of the run's last tool-call message are answered (approved
//! calls run now, declined ones get their result, calls interrupted by a crash are redone or —
//! for non-idempotent tools that were never dispatched — dispatched) before the model is called.
//!
//! For each unanswered call, in order ([`run_batch`]):
//! - an approval row decides: `approved` runs with the approved (maybe edited) arguments,
//!   `rejected`/`expired`/`cancelled` gets "Tool call declined by the user.";
//! - otherwise the policy: `deny` gets an error result, `ask` (with valid arguments) joins the
//!   approval batch — or, on the stateless endpoint's thread where nobody can decide, fails
//!   closed with an error result — and `auto` runs.
//!
//! When the batch needs approvals, its rows are inserted in the fenced transaction that parks
//! the run in `waiting_approval` and releases the lease; the `auto` calls have run by then.

use std::collections::HashSet;
use std::time::Instant;

use agentloop_shared::approvals::{self, Approval, NewApproval};
use agentloop_shared::context::ContextMessage;
use agentloop_shared::messages::{self, NewMessage, Provenance, ToolCallRef, role};
use agentloop_shared::operations::{self, status as op_status};
use agentloop_shared::runs::Run;
use agentloop_shared::scheduler::Lease;
use agentloop_shared::scheduler::lease::{self, SliceEnd};
use agentloop_shared::tools::{Policy, ToolContext, ToolOutcome};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::slice::{SliceEnv, SliceError, SliceState};

/// The calls of one assistant message that still need an answer.
pub struct Batch {
    /// Sequence of the assistant tool-call message.
    pub message_sequence: i64,
    /// Its calls, in order.
    pub calls: Vec<ToolCallRef>,
    /// Ids of calls that already have a result.
    pub answered: HashSet<String>,
    /// Provenance of the results appended now.
    pub provenance: Provenance,
}

/// What [`run_batch`] did.
#[derive(Default)]
pub struct BatchOutcome {
    /// Result messages appended, in order, with their identities.
    pub results: Vec<ContextMessage>,
    /// Calls answered in this slice.
    pub answered: u32,
    /// The slice ended (the run waits for approval or is blocked): stop, the lease is released.
    pub ended: bool,
}

/// Text an `ask` call gets when nobody can approve it (the stateless endpoint's hidden thread,
/// `metadata.stateless = true`): it fails closed.
fn no_owner(name: &str) -> String {
    format!("Tool `{name}` needs a human approval, and this request has no interactive owner (stateless API): it was not run.")
}

/// Text a call of a `deny` tool gets.
fn denied(name: &str) -> String {
    format!("Tool `{name}` is not allowed by the operator's policy (deny); it was not run.")
}

/// Start of a slice: blocks the run on operations left `dispatched` (or `uncertain`), else
/// answers the unanswered calls of the run's last tool-call message. `None` when there was
/// nothing to do.
pub async fn resume(
    env: &SliceEnv,
    run: &Run,
    lease: &Lease,
    cancel: &CancellationToken,
    state: &mut SliceState,
    provenance: Provenance,
) -> Result<Option<BatchOutcome>, SliceError> {
    let (step_id, usage) = (state.step_id, state.usage);
    let (blocked, group) = fenced!(env.pool, lease, |conn| {
        let uncertain = operations::mark_uncertain(conn, lease.run_id).await?;
        if !uncertain.is_empty() {
            let end = SliceEnd::Blocked { message: operations::blocker_message(&uncertain) };
            lease::end_slice(conn, lease, step_id, usage, &end).await?;
            return Ok((true, None));
        }
        Ok((false, messages::last_tool_call_group(conn, lease.thread_id, lease.run_id).await?))
    })?;
    if blocked {
        tracing::warn!("operations with an unknown outcome: the run is blocked");
        return Ok(Some(BatchOutcome { ended: true, ..BatchOutcome::default() }));
    }
    let Some((message, answered)) = group else { return Ok(None) };
    let calls = messages::tool_calls_of(message.tool_calls.as_ref());
    let answered: HashSet<String> = answered.into_iter().collect();
    if calls.iter().all(|c| answered.contains(&c.id)) {
        return Ok(None);
    }
    tracing::info!(pending = calls.iter().filter(|c| !answered.contains(&c.id)).count(), "answering the calls of the last tool-call message");
    let batch = Batch { message_sequence: message.sequence, calls, answered, provenance };
    run_batch(env, run, lease, cancel, state, batch).await.map(Some)
}

/// Answers every unanswered call of `batch` in order (see the module docs); parks the run in
/// `waiting_approval` when calls need a decision, blocks it when an operation is uncertain.
pub async fn run_batch(
    env: &SliceEnv,
    run: &Run,
    lease: &Lease,
    cancel: &CancellationToken,
    state: &mut SliceState,
    batch: Batch,
) -> Result<BatchOutcome, SliceError> {
    let mut out = BatchOutcome::default();
    let approvals: Vec<Approval> = {
        let mut conn = env.pool.get().await?;
        approvals::for_run(&mut conn, run.id).await?
    };
    let mut needs: Vec<NewApproval> = Vec::new();
    let mut interactive: Option<bool> = None;
    for call in batch.calls.iter().filter(|c| !batch.answered.contains(&c.id)) {
        let approval = approvals.iter().find(|a| a.tool_call_id == call.id);
        let step = match approval.map(|a| a.status.as_str()) {
            Some(approvals::status::APPROVED) => {
                let approval = approval.expect("matched");
                let arguments = approval.approved_arguments.clone().unwrap_or_else(|| approval.arguments.clone());
                let edited = approval.arguments_edited.then_some(&arguments);
                execute(env, run, lease, cancel, state, &batch, call, &arguments.to_string(), edited).await?
            }
            Some(approvals::status::PENDING) => {
                let approval = approval.expect("matched");
                needs.push(NewApproval {
                    tool_call_id: call.id.clone(),
                    tool_name: call.name.clone(),
                    arguments: approval.arguments.clone(),
                    parameters: approval.parameters.clone(),
                });
                Step::Waiting
            }
            Some(_) => {
                let reason = approval.and_then(|a| a.reason.as_deref());
                Step::Answer(result_for(call, approvals::declined_result(reason)))
            }
            None => match env.tools.policy(&call.name) {
                Policy::Deny => Step::Answer(result_for(call, denied(&call.name))),
                Policy::Ask if !is_interactive(env, run, &mut interactive).await? => {
                    Step::Answer(result_for(call, no_owner(&call.name)))
                }
                Policy::Ask => match env.tools.prepare(&call.name, &call.arguments).await {
                    Ok((tool, arguments)) => {
                        needs.push(NewApproval {
                            tool_call_id: call.id.clone(),
                            tool_name: call.name.clone(),
                            arguments,
                            parameters: tool.parameters(),
                        });
                        Step::Waiting
                    }
                    Err(outcome) => Step::Answer(result_for(call, outcome.content)),
                },
                Policy::Auto => execute(env, run, lease, cancel, state, &batch, call, &call.arguments, None).await?,
            },
        };
        match step {
            Step::Waiting => {}
            Step::Answer(message) => {
                let identity = append(env, lease, batch.provenance, &message, None).await?;
                out.results.push(ContextMessage { identity, message });
                out.answered += 1;
                state.usage.tool_calls += 1;
            }
            Step::Appended(context) => {
                out.results.push(context);
                out.answered += 1;
                state.usage.tool_calls += 1;
            }
            Step::Blocked => {
                out.ended = true;
                return Ok(out);
            }
        }
    }
    if !needs.is_empty() {
        let (step_id, usage, timeout) = (state.step_id, state.usage, env.approval_timeout);
        let sequence = batch.message_sequence;
        let parked = fenced!(env.pool, lease, |conn| {
            // A cancellation requested while the batch ran wins: nobody would decide.
            if lease.fence(conn).await?.cancel_requested {
                lease::end_slice(conn, lease, step_id, usage, &SliceEnd::Cancelled).await?;
                return Ok(false);
            }
            approvals::insert_batch(conn, lease.run_id, lease.thread_id, sequence, &needs, timeout).await?;
            lease::end_slice(conn, lease, step_id, usage, &SliceEnd::WaitingApproval).await?;
            // Workers re-read the earliest approval deadline (their expiry timer).
            agentloop_shared::events::notify_runs(conn, "approval", lease.run_id).await?;
            Ok(true)
        })?;
        if parked {
            tracing::info!(approvals = needs.len(), "tool calls need approval: the run waits");
            metrics::counter!("agentloop_tool_approvals_requested_total").increment(needs.len() as u64);
        }
        out.ended = true;
    }
    Ok(out)
}

/// Whether someone can decide approvals for `run` (its thread is not the stateless endpoint's);
/// read once per batch.
async fn is_interactive(env: &SliceEnv, run: &Run, cached: &mut Option<bool>) -> Result<bool, SliceError> {
    if let Some(known) = *cached {
        return Ok(known);
    }
    let mut conn = env.pool.get().await?;
    let metadata = agentloop_shared::threads::get(&mut conn, run.thread_id).await?.metadata;
    let known = metadata.get("stateless").and_then(Value::as_bool) != Some(true);
    *cached = Some(known);
    Ok(known)
}

/// What happened to one call.
enum Step {
    /// A result to append.
    Answer(NewMessage),
    /// The result is already appended (with the operation outcome).
    Appended(ContextMessage),
    /// Joins the approval batch.
    Waiting,
    /// The run is blocked (already written).
    Blocked,
}

fn result_for(call: &ToolCallRef, text: String) -> NewMessage {
    let mut message = NewMessage::text(role::TOOL, text);
    message.tool_call_id = Some(call.id.clone());
    message
}

/// The content of a result; notes arguments the user edited before approving.
fn content_of(outcome: &ToolOutcome, edited: Option<&Value>) -> String {
    match edited {
        Some(arguments) => format!("[The user edited the arguments before approving; the tool ran with {arguments}]\n{}", outcome.content),
        None => outcome.content.clone(),
    }
}

/// Appends one result (fenced; with `finish` = `(key, ok, text)` the operation's outcome in the
/// same transaction) and returns its identity.
async fn append(
    env: &SliceEnv,
    lease: &Lease,
    provenance: Provenance,
    message: &NewMessage,
    finish: Option<(&str, bool, &str)>,
) -> Result<Option<i64>, SliceError> {
    let inserted = fenced!(env.pool, lease, |conn| {
        if let Some((key, ok, text)) = finish {
            operations::finish(conn, key, ok, text).await?;
        }
        Ok(messages::append(conn, lease.thread_id, provenance, std::slice::from_ref(message), &[None]).await?)
    })?;
    Ok(inserted.first().map(|(_, row)| row.timestamp_ms))
}

/// Runs one call. Idempotent tools just run; others go through the ledger: `prepared`, then
/// `dispatched` (committed before the call leaves), then the outcome with the result.
#[allow(clippy::too_many_arguments)]
async fn execute(
    env: &SliceEnv,
    run: &Run,
    lease: &Lease,
    cancel: &CancellationToken,
    state: &mut SliceState,
    batch: &Batch,
    call: &ToolCallRef,
    raw_arguments: &str,
    edited: Option<&Value>,
) -> Result<Step, SliceError> {
    let key = operations::key(run.id, &call.id);
    let (tool, arguments) = match env.tools.prepare(&call.name, raw_arguments).await {
        Ok(prepared) => prepared,
        Err(outcome) => return Ok(Step::Answer(result_for(call, outcome.content))),
    };
    let ctx = ToolContext { idempotency_key: key.clone(), cancel: cancel.child_token() };
    let started = Instant::now();
    let ledger = !env.tools.is_idempotent(&call.name);
    if ledger {
        let existing = {
            let mut conn = env.pool.get().await?;
            operations::get(&mut conn, &key).await?
        };
        match existing.as_ref().map(|o| o.status.as_str()) {
            Some(op_status::COMPLETED | op_status::FAILED) => {
                return Ok(Step::Answer(operations::result_message(existing.as_ref().expect("matched"))));
            }
            Some(op_status::DISPATCHED | op_status::UNCERTAIN) => {
                let (step_id, usage) = (state.step_id, state.usage);
                fenced!(env.pool, lease, |conn| {
                    let uncertain = operations::mark_uncertain(conn, lease.run_id).await?;
                    let end = SliceEnd::Blocked { message: operations::blocker_message(&uncertain) };
                    lease::end_slice(conn, lease, step_id, usage, &end).await?;
                    Ok(())
                })?;
                return Ok(Step::Blocked);
            }
            _ => {}
        }
        let (thread_id, epoch) = (lease.thread_id, lease.epoch);
        let dispatched = fenced!(env.pool, lease, |conn| {
            let prepared = operations::prepare(conn, run.id, thread_id, epoch, &call.id, &call.name, &arguments).await?;
            Ok(prepared.is_some() && operations::dispatch(conn, &key, epoch).await?)
        })?;
        if !dispatched {
            return Err(SliceError::Db(format!("operation {key} changed state under this slice")));
        }
    }
    let outcome = env.tools.invoke(tool.as_ref(), arguments, ctx).await;
    if ledger && cancel.is_cancelled() {
        // The slice is being aborted mid-effect: the outcome is unknown. The slice end marks the
        // operation uncertain.
        return Err(SliceError::Aborted);
    }
    tracing::info!(tool.name = %call.name, tool.error = outcome.is_error, tool.ledger = ledger, duration_ms = started.elapsed().as_millis() as u64, "tool call");
    metrics::counter!("agentloop_tool_calls_total", "tool" => call.name.clone(), "error" => outcome.is_error.to_string()).increment(1);
    let message = result_for(call, content_of(&outcome, edited));
    let finish = ledger.then_some((key.as_str(), !outcome.is_error, message.content.as_str().unwrap_or_default()));
    let identity = append(env, lease, batch.provenance, &message, finish).await?;
    Ok(Step::Appended(ContextMessage { identity, message }))
}
