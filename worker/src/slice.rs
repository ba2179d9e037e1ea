//! One slice of a run (SPEC §6): step row and context, streamed model call, tools, checkpoints,
//! and the run transition at its end. Every durable effect is one [`Commit`] value applied by
//! one fenced step function (`agentloop_shared::scheduler::step`); nothing here opens a
//! transaction or holds a connection across a model or tool call.
//!
//! Faults, classified once (`agentloop_shared::store::fault`): transient database faults are
//! retried inside each step call while the lease lasts, then the run is handed back
//! ([`SliceEnd::Handback`], no step consumed; `faults + 1` unless the database was unavailable
//! to everyone — an outage is not the run's fault); a hand-back that cannot be written either
//! leaves the run to the worker's next claim ([`Released`]); deterministic faults and panics
//! fail the run with `internal_error`; a lost lease stops the slice without writing.
//!
//! Aborts ([`SliceControl`]: cancellation, shutdown, lease loss) are honoured at safe points:
//! before and during a model call (the request is dropped) and during a tool call — never in
//! the middle of a commit. A cancelled stream's partial answer is committed as an assistant
//! message marked `stopped`, in the transaction that ends the run.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentloop_shared::context::{self, ContextMessage};
use agentloop_shared::messages::{NewMessage, role};
use agentloop_shared::provider::catalog::{ModelCatalog, ModelConfig};
use agentloop_shared::provider::client::{ChatRequest, ProviderClient, StreamDelta};
use agentloop_shared::provider::projection;
use agentloop_shared::runs::Run;
use agentloop_shared::scheduler::step::{self, ContextSize, Started};
use agentloop_shared::scheduler::{Commit, Committed, Lease, Released, SliceEnd, Usage};
use agentloop_shared::store::{Store, StoreError};
use agentloop_shared::tools::ToolRegistry;
use agentloop_shared::compaction;
use futures_util::FutureExt;
use serde_json::json;
use tracing::Instrument;
use uuid::Uuid;

use crate::control::{AbortReason, SliceControl};
use crate::streaming::{Partial, StreamHub};

/// Everything a slice needs, shared by all slices of a worker process.
pub struct SliceEnv {
    pub store: Store,
    pub provider: ProviderClient,
    pub catalog: Arc<ModelCatalog>,
    pub tools: Arc<ToolRegistry>,
    pub streams: Arc<StreamHub>,
    /// Lease duration.
    pub lease: Duration,
    /// Renewal interval (< lease / 2).
    pub renew: Duration,
    /// Tool calls per slice before the run is requeued.
    pub tool_call_limit: u32,
    /// Consecutive faulted attempts after which a run fails `abandoned`.
    pub max_recoveries: i32,
    /// How long a paid answer is kept through a database outage (`WORKER_OUTAGE_HOLD_MS`).
    pub outage_hold: Duration,
    /// Decision deadline of a tool approval (SPEC: 24 h by default).
    pub approval_timeout: Duration,
    /// Tokens of the last tool-schema set seen (tokenizing schemas costs milliseconds; the set
    /// changes only when MCP servers come and go).
    pub schema_tokens_cache: std::sync::Mutex<Option<(String, i64)>>,
    /// Automatic titles after a thread's first answer (bounded background tasks).
    pub titles: crate::title::Titles,
    /// MCP sign-in settings (`OAUTH_*`).
    pub oauth: crate::tool_calls::SignInSettings,
    /// How long a model call that failed transiently is tried again (`MODEL_RETRY_MS`).
    pub model_retry: Duration,
    /// Whether a slot is wanted by another principal (`crate::slot_yield`).
    pub slots: Arc<crate::slot_yield::SlotPressure>,
}

impl SliceEnv {
    /// Tokens of `specs`, cached while the set is unchanged.
    pub fn schema_tokens(&self, specs: &[serde_json::Value]) -> i64 {
        let key = serde_json::Value::Array(specs.to_vec()).to_string();
        let mut cache = self.schema_tokens_cache.lock().expect("schema tokens cache");
        if let Some((k, n)) = cache.as_ref() && *k == key {
            return *n;
        }
        let n = context::schema_tokens(specs);
        *cache = Some((key, n));
        n
    }
}

/// Errors that end a slice.
#[derive(Debug, thiserror::Error)]
pub enum SliceError {
    /// Aborted at a safe point (see [`SliceControl::reason`]).
    #[error("aborted")]
    Aborted,
    /// The lease is gone: write nothing more.
    #[error("lease lost")]
    LeaseLost,
    /// The run fails with a stable code.
    #[error("{code}: {message}")]
    Failed { code: String, message: String },
    /// Transient database faults lasted as long as the lease (the last one possibly this
    /// slice's own doing: a statement timeout, a deadlock): hand the run back, `faults + 1`.
    #[error("transient database fault: {0}")]
    Transient(String),
    /// The database was unavailable to every caller as long as the lease lasted
    /// ([`StoreError::Outage`]): hand the run back without counting a fault.
    #[error("database outage: {0}")]
    Outage(String),
    /// A deterministic database or programming error: fail the run (`internal_error`).
    #[error("internal: {0}")]
    Internal(String),
}

impl From<StoreError> for SliceError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(m) | StoreError::OutcomeUnknown(m) => SliceError::Transient(m),
            StoreError::Outage(m) => SliceError::Outage(m),
            StoreError::Deterministic { sqlstate, message } => SliceError::Internal(format!("{sqlstate}: {message}")),
            StoreError::Refused { code, message, .. } => SliceError::Internal(format!("{code}: {message}")),
        }
    }
}

pub(crate) fn failed(code: &str, message: impl Into<String>) -> SliceError {
    SliceError::Failed { code: code.into(), message: message.into() }
}

/// One slice in progress: the lease, the step row, usage not yet committed, and the partial
/// answer of the model call in flight.
pub struct Slice {
    pub(crate) env: Arc<SliceEnv>,
    pub(crate) lease: Lease,
    pub(crate) control: SliceControl,
    pub(crate) step_id: Option<i64>,
    /// Usage since the last commit (committed as deltas).
    pub(crate) usage: Usage,
    /// The partial answer of the current model call (kept for a cancellation).
    partial: Option<Arc<std::sync::Mutex<Partial>>>,
    /// This slice streamed a model call (the partial the database holds is its own, not one
    /// of a dead attempt's to keep on a cancel).
    streamed: bool,
}

impl Slice {
    /// Commits `commit` (with the usage accumulated since the last commit). Deadline: the
    /// lease as last confirmed (asked again while a paid answer is held: step::commit).
    /// `LeaseLost` when the fence failed.
    pub(crate) async fn commit(&mut self, mut commit: Commit) -> Result<Committed, SliceError> {
        commit.usage = self.usage;
        let ends = commit.end.is_some();
        let (control, margin) = (self.control.clone(), self.env.lease.saturating_sub(self.env.renew / 2));
        let deadline = move || control.confirmed() + margin;
        let started = Instant::now();
        // Paid work (a model answer, tool results, a compaction summary) is held through every
        // transient fault, up to WORKER_OUTAGE_HOLD_MS: the write is fenced (step::commit).
        let hold = commit.carries_paid_work().then(|| started + self.env.outage_hold);
        let result = step::commit(&self.env.store, &self.lease, self.step_id, &commit, &deadline, hold).await;
        metrics::histogram!("agentloop_commit_duration_seconds").record(started.elapsed().as_secs_f64());
        match result? {
            Some(done) => {
                self.usage = Usage::default();
                self.control.confirm_at(started);
                if ends {
                    self.control.end();
                }
                if done.cancel_requested && done.status == agentloop_shared::runs::status::RUNNING {
                    self.control.abort(AbortReason::Cancel);
                }
                Ok(done)
            }
            None => Err(SliceError::LeaseLost),
        }
    }

    /// Parks the run for an MCP sign-in: `commit` (ending [`SliceEnd::WaitingAuthorization`])
    /// with the authorization row, in one transaction ([`agentloop_shared::mcp_auth::park`]).
    /// Deadline and bookkeeping as [`Slice::commit`].
    pub(crate) async fn park_authorization(
        &mut self,
        mut commit: Commit,
        park: &agentloop_shared::mcp_auth::Park<'_>,
        key: &agentloop_shared::secrets::SecretsKey,
    ) -> Result<Committed, SliceError> {
        commit.usage = self.usage;
        let deadline = self.control.confirmed() + self.env.lease.saturating_sub(self.env.renew / 2);
        let result = agentloop_shared::mcp_auth::park(&self.env.store, &self.lease, self.step_id, &commit, park, key, deadline).await;
        match result? {
            Some(done) => {
                self.usage = Usage::default();
                self.control.confirm();
                self.control.end();
                Ok(done)
            }
            None => Err(SliceError::LeaseLost),
        }
    }

    /// `Err(Aborted)` when the slice was aborted (a safe point).
    pub(crate) fn check_abort(&self) -> Result<(), SliceError> {
        if self.control.reason().is_some() { Err(SliceError::Aborted) } else { Ok(()) }
    }
}

/// Executes one slice of the claimed `run` until it ends or is aborted.
///
/// `claim_start`: the slice start the claim already wrote for this run
/// ([`agentloop_shared::scheduler::Claimed::starts`]); `None` to start it here.
///
/// Returns the run as [`Released`] when the slice could not record its end because of a
/// transient fault (the run stays `running` under this worker's lease): the worker names it in
/// its next claim, which takes it back without counting a fault (migration 000023).
pub async fn execute(env: Arc<SliceEnv>, run: Run, control: SliceControl, claim_start: Option<serde_json::Value>) -> Option<Released> {
    let lease = Lease::of(&run, env.lease);
    let span = tracing::info_span!("slice", run.id = %run.id, thread.id = %run.thread_id, run.attempt = run.attempts, lease.epoch = run.lease_epoch);
    // The run's trace context (the api request that created it): this slice joins its trace.
    agentloop_shared::telemetry::set_remote_parent(&span, run.traceparent.as_deref());
    async move {
        let started = Instant::now();
        let mut slice = Slice { env: env.clone(), lease, control: control.clone(), step_id: None, usage: Usage::default(), partial: None, streamed: false };
        let outcome = match AssertUnwindSafe(body(&mut slice, &run, claim_start)).catch_unwind().await {
            Ok(outcome) => outcome,
            Err(panic) => {
                let what = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
                tracing::error!(panic = what.as_deref().unwrap_or("?"), "slice panicked");
                Err(SliceError::Internal(format!("panic: {}", what.unwrap_or_default())))
            }
        };
        let ended_cleanly = outcome.is_ok();
        let mut released = None;
        let end = match outcome {
            Ok(end) => {
                tracing::info!(end = end.label(), "slice ended");
                metrics::counter!("agentloop_slices_total", "end" => end.label()).increment(1);
                None
            }
            Err(SliceError::Aborted) => match control.reason() {
                Some(AbortReason::Cancel) => Some(SliceEnd::Cancelled { keep_streamed: false }),
                Some(AbortReason::Shutdown) => Some(SliceEnd::Interrupted),
                // Fenced: written only if no other worker took the run meanwhile.
                Some(AbortReason::Unconfirmed) => Some(SliceEnd::Handback { fault: false }),
                Some(AbortReason::LeaseLost) | None => None,
            },
            Err(SliceError::LeaseLost) => None,
            Err(SliceError::Failed { code, message }) => {
                tracing::warn!(error.code = %code, "run failed");
                Some(SliceEnd::Failed { code, message })
            }
            Err(SliceError::Transient(error)) => {
                tracing::warn!(%error, "database unavailable while the lease lasted; handing the run back");
                Some(SliceEnd::Handback { fault: true })
            }
            Err(SliceError::Outage(error)) => {
                tracing::warn!(%error, "database outage while the lease lasted; handing the run back (not its fault)");
                Some(SliceEnd::Handback { fault: false })
            }
            Err(SliceError::Internal(error)) => {
                tracing::error!(%error, "internal error in slice; failing the run");
                Some(SliceEnd::Failed { code: "internal_error".into(), message: "an internal error interrupted the run".into() })
            }
        };
        if let Some(end) = end {
            let label = end.label();
            let faulting = end == SliceEnd::Handback { fault: true };
            let mut commit = Commit { end: Some(end), ..Commit::default() };
            if label == "cancelled" {
                match slice.stopped_partial() {
                    Some(partial) => commit.messages.push(partial),
                    // Nothing streamed here: keep what an earlier attempt streamed, if anything.
                    None if !slice.streamed => commit.end = Some(SliceEnd::Cancelled { keep_streamed: true }),
                    // A call of this slice failed and its partial was dropped (a cancel during
                    // the pause before calling again keeps nothing of it: verification probe L,
                    // L-2).
                    None => {}
                }
            }
            match slice.commit(commit).await {
                Ok(done) => {
                    tracing::info!(end = label, status = %done.status, "slice ended");
                    metrics::counter!("agentloop_slices_total", "end" => label).increment(1);
                }
                Err(SliceError::LeaseLost) => {
                    tracing::warn!(end = label, "lease lost before the slice end was written");
                    metrics::counter!("agentloop_slices_total", "end" => "lease_lost").increment(1);
                }
                Err(error @ (SliceError::Transient(_) | SliceError::Outage(_))) => {
                    tracing::warn!(%error, end = label, "could not record the slice end; the next claim takes the run back");
                    metrics::counter!("agentloop_slices_total", "end" => "unrecorded").increment(1);
                    let fault = faulting || !matches!(error, SliceError::Outage(_));
                    released = Some(Released { run_id: run.id, epoch: run.lease_epoch, fault });
                }
                Err(error) => {
                    tracing::warn!(%error, end = label, "could not record the slice end; the lease will expire and the run be recovered");
                    metrics::counter!("agentloop_slices_total", "end" => "unrecorded").increment(1);
                }
            }
        } else if !ended_cleanly {
            metrics::counter!("agentloop_slices_total", "end" => "lease_lost").increment(1);
        }
        metrics::histogram!("agentloop_slice_duration_seconds").record(started.elapsed().as_secs_f64());
        tracing::debug!(duration_ms = started.elapsed().as_millis() as u64, "slice done");
        released
    }
    .instrument(span)
    .await
}

impl Slice {
    /// The partial answer of an interrupted model call as an assistant message marked stopped.
    fn stopped_partial(&self) -> Option<NewMessage> {
        let partial = self.partial.as_ref()?;
        let p = partial.lock().ok()?;
        if p.content.is_empty() && p.reasoning.is_empty() {
            return None;
        }
        let mut message = NewMessage::text(role::ASSISTANT, p.content.clone());
        message.reasoning = (!p.reasoning.is_empty()).then(|| p.reasoning.clone());
        message.stopped = true;
        Some(message)
    }
}

/// Pre-checks that end the run before its step starts.
fn precheck(env: &SliceEnv, run: &Run, control: &SliceControl) -> Result<(), SliceError> {
    if run.faults > env.max_recoveries {
        return Err(failed(
            "abandoned",
            format!(
                "the run was interrupted {} times in a row without progress (worker crashes, lost leases or database faults)",
                run.faults
            ),
        ));
    }
    if run.cancel_requested_at.is_some() {
        control.abort(AbortReason::Cancel);
        return Err(SliceError::Aborted);
    }
    if run.steps_used >= run.max_steps {
        return Err(failed("budget_exhausted", format!("the run used all {} of its steps (maxSteps)", run.max_steps)));
    }
    Ok(())
}

async fn body(slice: &mut Slice, run: &Run, claim_start: Option<serde_json::Value>) -> Result<SliceEnd, SliceError> {
    let env = slice.env.clone();
    precheck(&env, run, &slice.control)?;
    let model = env
        .catalog
        .get(&run.model)
        .ok_or_else(|| failed("model_not_configured", format!("model '{}' is not configured", run.model)))?;
    let mut tool_specs = if model.supports_tools { env.tools.specs() } else { Vec::new() };
    let mut tool_tokens = env.schema_tokens(&tool_specs);
    let deadline = slice.control.confirmed() + env.lease.saturating_sub(env.renew / 2);
    let from_claim = claim_start.is_some();
    let sent = Instant::now();
    let started = match claim_start {
        Some(value) => step::started_from(value)?,
        None => {
            step::start_slice(
                &env.store,
                &slice.lease,
                run.steps_used + 1,
                &model.id,
                tool_tokens,
                model.context_tokens.map(|t| t as i64),
                deadline,
            )
            .await?
        }
    };
    let start = match started {
        Started::Lost => return Err(SliceError::LeaseLost),
        Started::Blocked(_) => {
            tracing::warn!("operations with an unknown outcome: the run is blocked");
            return Ok(SliceEnd::Blocked);
        }
        Started::Ready(start) => start,
    };
    // A start made by the claim extended the lease no later than the claim was sent, which
    // is what the control already counts from.
    if !from_claim {
        slice.control.confirm_at(sent);
    }
    slice.step_id = Some(start.step.id);
    tracing::info!(step.sequence = start.step.sequence, model.name = %model.id, run.kind = %run.kind, "slice started");
    if run.kind == agentloop_shared::runs::kind::COMPACTION {
        return crate::compact::manual(slice, run, model).await;
    }
    let interactive = start.metadata.get("stateless").and_then(serde_json::Value::as_bool) != Some(true);
    // The OpenAI endpoint's client-side tools (issue 12): offered, never run here.
    let client_tools = crate::client_tools::ClientTools::from_metadata(&start.metadata);
    if !client_tools.is_empty() && model.supports_tools {
        tool_specs = client_tools.merge(tool_specs);
        tool_tokens = context::schema_tokens(&tool_specs);
    }
    let settings = compaction::Settings::from_metadata(&start.metadata, model.context_tokens);
    let (mut context, mut snapshot) = context::from_loaded(&start.context);
    // No message enters the model's context larger than a turn it takes (a model's own huge
    // tool call left every later turn failing): the copy is cut, the history is not.
    let turn_limit = agentloop_shared::generation::max_input_tokens(model, &start.metadata);
    context::bound_messages(&mut context, turn_limit);
    // The limit is per step: a step re-opened (its slot given back, a hand-back, a recovery)
    // goes on from the calls it made (verification probe L, L-1).
    let mut slice_tool_calls: u32 = start.step.tool_calls.max(0) as u32;

    // SPEC §6-§7: the unanswered calls of the run's last tool-call message (approved, declined,
    // or interrupted by a crash) are answered before the model is called.
    if let Some(open) = &start.open {
        let batch = crate::tool_calls::Batch::open(open);
        if !batch.is_done() {
            tracing::info!(pending = batch.pending(), "answering the calls of the last tool-call message");
            let size = ContextSize { tokens: context::messages_tokens(&context) + tool_tokens, limit: model.context_tokens.map(|t| t as i64) };
            match crate::tool_calls::run_batch(slice, &batch, &start.approvals, &start.operations, interactive, size).await? {
                crate::tool_calls::BatchEnd::Ended(end) => return Ok(end),
                crate::tool_calls::BatchEnd::Answered { results, answered } => {
                    context.extend(results);
                    slice_tool_calls += answered;
                }
            }
        }
    }

    let mut compaction_failed = false;
    loop {
        slice.check_abort()?;
        let cut = context::bound_messages(&mut context, turn_limit);
        if cut > 0 {
            tracing::info!(messages = cut, max_tokens = turn_limit, "messages larger than a turn cut in the model's context");
        }
        let tokens = context::messages_tokens(&context) + tool_tokens;
        if tokens > settings.threshold && !compaction_failed {
            tracing::info!(tokens, threshold = settings.threshold, "context over the compaction threshold");
            match crate::compact::automatic(slice, model, &context, snapshot.as_ref(), &settings, tool_tokens).await {
                Ok((next, next_snapshot)) => {
                    context = next;
                    snapshot = next_snapshot;
                }
                Err(SliceError::Failed { code, message })
                    if model.context_tokens.is_none_or(|limit| tokens <= limit as i64) =>
                {
                    // The context still fits the model: go on without compacting (issue 9).
                    tracing::warn!(error.code = %code, %message, tokens, "compaction did not reduce the context; it still fits the model, continuing");
                    compaction_failed = true;
                }
                Err(e) => return Err(e),
            }
        }
        slice.check_abort()?;
        // The thread's generation settings (issue 11), never more than the context has left.
        let (max_tokens, temperature) =
            agentloop_shared::generation::request_settings(model, &start.metadata, context::messages_tokens(&context) + tool_tokens);
        let request = ChatRequest {
            messages: projection::project_for(model, &context),
            tools: tool_specs.clone(),
            tool_choice: None,
            max_tokens,
            temperature,
        };
        let turn = call_model(slice, model, &request, if interactive { env.model_retry } else { Duration::ZERO }).await?;
        slice.usage.model_calls += 1;
        if let Some(usage) = &turn.usage {
            slice.usage.prompt_tokens += usage.prompt_tokens as i64;
            slice.usage.completion_tokens += usage.completion_tokens as i64;
        }

        let mut assistant = NewMessage::text(role::ASSISTANT, turn.content.clone());
        assistant.reasoning = turn.reasoning.clone().filter(|r| !r.is_empty());
        assistant.finish_reason = turn.cut_reason().map(str::to_owned);
        if turn.tool_calls.is_empty() {
            // Final answer: the message and the run's completion in one transaction.
            slice.commit(Commit { messages: vec![assistant], end: Some(SliceEnd::Completed), ..Commit::default() }).await?;
            tracing::info!(tool_calls = slice_tool_calls, "final answer checkpointed");
            // The first answer of an untitled interactive thread (the api marks it
            // `metadata.autoTitle`): title it in the background (issue 11).
            let mut users = context.iter().filter(|c| c.message.role == role::USER);
            let untitled = start.metadata.get("autoTitle").and_then(serde_json::Value::as_bool) == Some(true);
            if let (true, true, None, Some(first), None) = (interactive, untitled, snapshot.as_ref(), users.next(), users.next()) {
                let question = agentloop_shared::messages::content_text(&first.message.content);
                env.titles.spawn(env.store.clone(), env.provider.clone(), model.clone(), run.thread_id, question, turn.content.clone());
            }
            return Ok(SliceEnd::Completed);
        }
        // Identity is ours (issue 9): every call gets an id unique within the run, whatever the
        // provider sent (reused ids, `call_0` in every response, duplicates in one message); the
        // provider's id is kept as `providerId`. Approvals and operations key on our id.
        let calls: Vec<agentloop_shared::messages::ToolCallRef> = turn
            .tool_calls
            .iter()
            .map(|c| agentloop_shared::messages::ToolCallRef {
                id: format!("call_{}", &Uuid::new_v4().simple().to_string()[..24]),
                name: c.name.clone(),
                arguments: c.arguments.clone(),
            })
            .collect();
        let wire: Vec<_> = calls
            .iter()
            .zip(&turn.tool_calls)
            .map(|(ours, theirs)| {
                json!({"id": ours.id, "providerId": theirs.id, "type": "function",
                       "function": {"name": ours.name, "arguments": ours.arguments}})
            })
            .collect();
        let mut wire = serde_json::Value::Array(wire);
        assistant.token_estimate += agentloop_shared::tokens::estimate_text(&wire.to_string()) as i32;
        if calls.iter().any(|c| client_tools.contains(&c.name)) {
            return client_turn(slice, assistant, wire, &calls, &client_tools).await;
        }
        client_tools.mark(&mut wire);
        assistant.tool_calls = Some(wire);
        // The call message is checkpointed before any call runs (SPEC §7).
        let done = slice.commit(Commit { messages: vec![assistant.clone()], ..Commit::default() }).await?;
        let identity = done.messages.first().copied();
        context.push(ContextMessage { identity: identity.map(|i| i.timestamp), message: assistant });
        let batch = crate::tool_calls::Batch::new(identity.map_or(0, |i| i.sequence), calls);
        let size = ContextSize { tokens: context::messages_tokens(&context) + tool_tokens, limit: model.context_tokens.map(|t| t as i64) };
        match crate::tool_calls::run_batch(slice, &batch, &[], &[], interactive, size).await? {
            crate::tool_calls::BatchEnd::Ended(end) => return Ok(end),
            crate::tool_calls::BatchEnd::Answered { results, answered } => {
                context.extend(results);
                slice_tool_calls += answered;
            }
        }
        if slice_tool_calls >= env.tool_call_limit {
            slice.commit(Commit { end: Some(SliceEnd::Requeued), ..Commit::default() }).await?;
            tracing::info!(tool_calls = slice_tool_calls, "tool-call limit of the slice reached: requeued");
            return Ok(SliceEnd::Requeued);
        }
        // Between two steps: another principal waiting with fewer runs running gets this slot
        // (`crate::slot_yield`); the run goes back to the queue, its step not consumed.
        if env.slots.slot_wanted(&env.store, run.id).await {
            slice.commit(Commit { end: Some(SliceEnd::Yielded), ..Commit::default() }).await?;
            tracing::info!(tool_calls = slice_tool_calls, "slot given to a principal with fewer runs running: requeued");
            return Ok(SliceEnd::Yielded);
        }
    }
}

/// A turn that called a client-side tool ends the run (see `crate::client_tools`): the
/// assistant message with every call (client ones marked), a result row per call, and the run's
/// completion, in one commit.
async fn client_turn(
    slice: &mut Slice,
    mut assistant: NewMessage,
    mut wire: serde_json::Value,
    calls: &[agentloop_shared::messages::ToolCallRef],
    client_tools: &crate::client_tools::ClientTools,
) -> Result<SliceEnd, SliceError> {
    client_tools.mark(&mut wire);
    assistant.tool_calls = Some(wire);
    let mut messages = vec![assistant];
    for call in calls {
        let text = if client_tools.contains(&call.name) {
            crate::client_tools::CLIENT_CALL_RESULT
        } else {
            crate::client_tools::SKIPPED_SERVER_CALL_RESULT
        };
        let mut result = NewMessage::text(role::TOOL, text);
        result.tool_call_id = Some(call.id.clone());
        messages.push(result);
    }
    slice.commit(Commit { messages, end: Some(SliceEnd::Completed), ..Commit::default() }).await?;
    tracing::info!(client_calls = calls.iter().filter(|c| client_tools.contains(&c.name)).count(), "client-side tool calls returned to the caller");
    Ok(SliceEnd::Completed)
}

/// Calls the model with streaming; the partial answer goes to the stream flusher (never to
/// history). A cancellation or a lost lease drops the request at once; a shutdown lets it
/// finish (the answer is paid for: it is checkpointed, then the run handed back at the next safe
/// point) unless the grace period runs short ([`SliceControl::model_call_stopped`]).
///
/// A call that failed transiently ([`ProviderError::transient`]) is made again, from the start
/// (a new partial: watchers see it restart, as after a recovery), after a pause doubling from 1 s
/// to 30 s, while `patience` since the first failure lasts (`MODEL_RETRY_MS`); a cancel, a lost
/// lease or a shutdown ends the pause. Then the run fails with the last error's code.
///
/// [`ProviderError::transient`]: agentloop_shared::provider::client::ProviderError::transient
async fn call_model(
    slice: &mut Slice,
    model: &ModelConfig,
    request: &ChatRequest,
    patience: Duration,
) -> Result<agentloop_shared::provider::client::AssistantTurn, SliceError> {
    let mut first_failure: Option<Instant> = None;
    let mut pause = Duration::from_secs(1);
    loop {
        match call_model_once(slice, model, request).await? {
            Ok(turn) => return Ok(turn),
            Err(e) => {
                // The failed call's partial is not an answer: a cancel during the pause keeps
                // nothing of it.
                slice.partial = None;
                let since = *first_failure.get_or_insert_with(Instant::now);
                // The last pause ends with the window, and one more call is made then (a pause
                // that would pass it was not taken: verification probe L, L-3).
                let left = patience.saturating_sub(since.elapsed());
                if !e.transient() || left.is_zero() {
                    return Err(failed(e.code(), e.to_string()));
                }
                let wait = pause.min(left);
                tracing::warn!(model.name = %model.id, error.code = e.code(), error = %e, pause_ms = wait.as_millis() as u64,
                               "model call failed; calling again after a pause (MODEL_RETRY_MS)");
                metrics::counter!("agentloop_model_call_retries_total", "model" => model.id.clone(), "code" => e.code()).increment(1);
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = slice.control.aborted() => return Err(SliceError::Aborted),
                }
                pause = (pause * 2).min(Duration::from_secs(30));
            }
        }
    }
}

/// One streamed model call (see [`call_model`]): `Ok(Err(_))` is the provider's error.
async fn call_model_once(
    slice: &mut Slice,
    model: &ModelConfig,
    request: &ChatRequest,
) -> Result<Result<agentloop_shared::provider::client::AssistantTurn, agentloop_shared::provider::client::ProviderError>, SliceError> {
    let stream = slice.env.streams.open(&slice.lease, &slice.control);
    slice.streamed = true;
    let partial = stream.partial.clone();
    slice.partial = Some(partial.clone());
    let sink = partial.clone();
    let mut on_delta = move |delta: StreamDelta| {
        let mut p = sink.lock().expect("partial lock");
        match delta {
            StreamDelta::Text(t) => p.content.push_str(&t),
            StreamDelta::Reasoning(r) => p.reasoning.push_str(&r),
        }
    };
    let started = Instant::now();
    let env = slice.env.clone();
    let control = slice.control.clone();
    let result = tokio::select! {
        result = env.provider.stream_chat(model, request, &mut on_delta) => result,
        _ = control.model_call_stopped() => {
            drop(stream);
            return Err(SliceError::Aborted);
        }
    };
    stream.finish().await;
    let outcome = if result.is_ok() { "ok" } else { "error" };
    metrics::histogram!("agentloop_model_call_duration_seconds", "model" => model.id.clone(), "outcome" => outcome)
        .record(started.elapsed().as_secs_f64());
    metrics::counter!("agentloop_model_calls_total", "model" => model.id.clone(), "outcome" => outcome).increment(1);
    if let Ok(usage) = result.as_ref().map(|turn| turn.usage.as_ref()) {
        let usage = usage.cloned().unwrap_or_default();
        metrics::counter!("agentloop_model_tokens_total", "model" => model.id.clone(), "kind" => "prompt").increment(usage.prompt_tokens);
        metrics::counter!("agentloop_model_tokens_total", "model" => model.id.clone(), "kind" => "completion")
            .increment(usage.completion_tokens);
    }
    match result {
        Ok(turn) => {
            slice.partial = None;
            tracing::info!(
                model.name = %model.id,
                duration_ms = started.elapsed().as_millis() as u64,
                tool_calls = turn.tool_calls.len(),
                malformed_chunks = turn.malformed_chunks,
                "model call"
            );
            Ok(Ok(turn))
        }
        Err(e) => Ok(Err(e)),
    }
}
