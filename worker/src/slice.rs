//! One slice of a run (SPEC §6): step row, context, streamed model call, tools, checkpoint,
//! and the run transition at its end — every write fenced by the lease (SPEC §5 "Fencing").
//!
//! A slice is aborted at once (dropping the in-flight model request) when its [`SliceControl`]
//! fires: on cancellation (the run ends `cancelled`), shutdown (the run goes back to `queued`),
//! or lease loss (nothing more is written: the run belongs to someone else now).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentloop_shared::context::{self, ContextMessage};
use agentloop_shared::db::PgPool;
use agentloop_shared::messages::{self, NewMessage, Provenance, role};
use agentloop_shared::provider::catalog::{ModelCatalog, ModelConfig};
use agentloop_shared::provider::client::{ChatRequest, ProviderClient, StreamDelta};
use agentloop_shared::provider::projection;
use agentloop_shared::runs::Run;
use agentloop_shared::scheduler::lease::{self, FencedError, SliceEnd, SliceUsage};
use agentloop_shared::scheduler::{Lease, LeaseLost};
use agentloop_shared::tools::ToolRegistry;
use agentloop_shared::{compaction, events, threads};
use diesel_async::AsyncConnection;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Everything a slice needs, shared by all slices of a worker process.
pub struct SliceEnv {
    pub pool: PgPool,
    pub provider: ProviderClient,
    pub catalog: Arc<ModelCatalog>,
    pub tools: Arc<ToolRegistry>,
    /// Lease duration.
    pub lease: Duration,
    /// Renewal interval (< lease / 2).
    pub renew: Duration,
    /// Tool calls per slice before the run is requeued.
    pub tool_call_limit: u32,
    /// Recoveries after which a run fails `abandoned`.
    pub max_recoveries: i32,
    /// Minimum interval between streaming-column writes.
    pub stream_throttle: Duration,
    /// Decision deadline of a tool approval (SPEC: 24 h by default).
    pub approval_timeout: Duration,
}

/// Why a slice was aborted (first reason wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortReason {
    /// Cancellation requested: end the run `cancelled`.
    Cancel,
    /// Worker shutdown: hand the run back (`queued`).
    Shutdown,
    /// The lease is gone (or could not be renewed in time): write nothing more.
    LeaseLost,
}

/// Handle to abort a running slice.
#[derive(Clone, Default)]
pub struct SliceControl {
    token: CancellationToken,
    reason: Arc<Mutex<Option<AbortReason>>>,
}

impl SliceControl {
    /// Aborts the slice for `reason` (ignored if it was already aborted for another reason).
    pub fn abort(&self, reason: AbortReason) {
        let mut current = self.reason.lock().expect("abort reason lock");
        if current.is_none() {
            *current = Some(reason);
        }
        self.token.cancel();
    }

    fn reason(&self) -> Option<AbortReason> {
        *self.reason.lock().expect("abort reason lock")
    }

    /// A token cancelled when the slice is aborted (handed to tools).
    pub(crate) fn cancel_token(&self) -> CancellationToken {
        self.token.child_token()
    }
}

/// Errors that end a slice.
#[derive(Debug, thiserror::Error)]
pub enum SliceError {
    #[error("aborted")]
    Aborted,
    #[error("lease lost")]
    LeaseLost,
    #[error("{code}: {message}")]
    Failed { code: String, message: String },
    #[error("database: {0}")]
    Db(String),
}

impl From<FencedError> for SliceError {
    fn from(e: FencedError) -> Self {
        match e {
            FencedError::LeaseLost(_) => SliceError::LeaseLost,
            FencedError::Query(q) => SliceError::Db(q.to_string()),
        }
    }
}

impl From<diesel::result::Error> for SliceError {
    fn from(e: diesel::result::Error) -> Self {
        SliceError::Db(e.to_string())
    }
}

impl From<diesel_async::pooled_connection::deadpool::PoolError> for SliceError {
    fn from(e: diesel_async::pooled_connection::deadpool::PoolError) -> Self {
        SliceError::Db(e.to_string())
    }
}

pub(crate) fn failed(code: &str, message: impl Into<String>) -> SliceError {
    SliceError::Failed { code: code.into(), message: message.into() }
}

/// Mutable evidence of the slice, written at its end whatever way it ends.
#[derive(Default)]
pub struct SliceState {
    pub(crate) step_id: Option<i64>,
    pub(crate) usage: SliceUsage,
}

/// Executes one slice of the claimed `run` until it ends or `control` aborts it.
pub async fn execute(env: Arc<SliceEnv>, run: Run, control: SliceControl) {
    let lease = Lease::of(&run);
    let span = tracing::info_span!("slice", run.id = %run.id, thread.id = %run.thread_id, run.attempt = run.attempts, lease.epoch = run.lease_epoch);
    async {
        let started = Instant::now();
        let keeper = tokio::spawn(keep_lease(env.clone(), lease.clone(), control.clone()));
        let mut state = SliceState::default();
        let outcome = tokio::select! {
            result = body(&env, &run, &lease, &control, &mut state) => result,
            _ = control.token.cancelled() => Err(SliceError::Aborted),
        };
        keeper.abort();
        let end = match outcome {
            Ok(()) => None,
            Err(SliceError::Aborted) => match control.reason().inspect(|reason| tracing::warn!(?reason, "slice aborted")) {
                Some(AbortReason::Cancel) => Some(SliceEnd::Cancelled),
                Some(AbortReason::Shutdown) => Some(SliceEnd::Interrupted),
                Some(AbortReason::LeaseLost) | None => None,
            },
            Err(SliceError::LeaseLost) => {
                tracing::warn!("lease lost; slice stops without writing");
                None
            }
            Err(SliceError::Failed { code, message }) => {
                tracing::warn!(error.code = %code, "run failed");
                Some(SliceEnd::Failed { code, message })
            }
            Err(SliceError::Db(error)) => {
                // A statement that fails while the database still accepts the fenced end-of-slice
                // write would fail again on every retry: end the run with an error instead of
                // requeueing it into a hot loop. If the database is unreachable, this write fails
                // too and the lease-expiry recovery (bounded by WORKER_MAX_RECOVERIES) takes over.
                tracing::error!(%error, "database error in slice; failing the run");
                Some(SliceEnd::Failed { code: "internal_error".into(), message: "a database error interrupted the run".into() })
            }
        };
        let label = match (&end, control.reason()) {
            (Some(SliceEnd::Completed), _) => "completed",
            (Some(SliceEnd::Requeued), _) => "requeued",
            (Some(SliceEnd::Interrupted), _) => "interrupted",
            (Some(SliceEnd::Failed { .. }), _) => "failed",
            (Some(SliceEnd::Cancelled), _) => "cancelled",
            (Some(SliceEnd::WaitingApproval), _) => "waiting_approval",
            (Some(SliceEnd::Blocked { .. }), _) => "blocked",
            (None, _) => "lease_lost",
        };
        metrics::counter!("agentloop_slices_total", "end" => label).increment(1);
        metrics::histogram!("agentloop_slice_duration_seconds").record(started.elapsed().as_secs_f64());
        if label == "lease_lost" {
            metrics::counter!("agentloop_lease_lost_total").increment(1);
        }
        if let Some(end) = end {
            if let Err(error) = write_end(&env.pool, &lease, &state, &end).await {
                tracing::warn!(%error, "could not record the slice end; the lease will expire and the run be recovered");
            }
        }
        tracing::info!(duration_ms = started.elapsed().as_millis() as u64, "slice ended");
    }
    .instrument(span)
    .await
}

async fn write_end(pool: &PgPool, lease: &Lease, state: &SliceState, end: &SliceEnd) -> Result<(), SliceError> {
    fenced!(pool, lease, |conn| {
        lease::end_slice(conn, lease, state.step_id, state.usage, end).await?;
        Ok(())
    })
}

async fn body(
    env: &SliceEnv,
    run: &Run,
    lease: &Lease,
    control: &SliceControl,
    state: &mut SliceState,
) -> Result<(), SliceError> {
    if run.recoveries > env.max_recoveries {
        return Err(failed(
            "abandoned",
            format!("the run was recovered {} times after its worker stopped renewing the lease", run.recoveries - 1),
        ));
    }
    if run.cancel_requested_at.is_some() {
        control.abort(AbortReason::Cancel);
        return Err(SliceError::Aborted);
    }
    if run.steps_used >= run.max_steps {
        return Err(failed("budget_exhausted", format!("the run used all {} of its steps (maxSteps)", run.max_steps)));
    }
    let model = env
        .catalog
        .get(&run.model)
        .ok_or_else(|| failed("model_not_configured", format!("model '{}' is not configured", run.model)))?;

    let mut conn = env.pool.get().await?;
    let step_sequence = run.steps_used + 1;
    let step = (*conn)
        .transaction(async |conn| lease.begin_step(conn, step_sequence, run.attempts, &model.id).await)
        .await?;
    state.step_id = Some(step.id);
    tracing::info!(step.sequence = step.sequence, model.name = %model.id, run.kind = %run.kind, "slice started");
    if run.kind == agentloop_shared::runs::kind::COMPACTION {
        drop(conn);
        return crate::compact::manual(env, run, lease, model, state).await;
    }
    // SPEC §6-§7: operations a dead attempt left dispatched block the run; the unanswered calls
    // of the run's last tool-call message (approved, or interrupted by a crash) are answered
    // before the model is called. Never holds `conn` across a tool call.
    drop(conn);
    let step_provenance = Provenance { run_id: Some(run.id), step_id: Some(step.id) };
    let resumed = crate::tool_calls::resume(env, run, lease, &control.cancel_token(), state, step_provenance).await?;
    if resumed.is_some_and(|r| r.ended) {
        return Ok(());
    }
    let mut conn = env.pool.get().await?;
    let (mut context, mut snapshot) = context::load(&mut conn, run.thread_id).await?;
    let metadata = threads::get(&mut conn, run.thread_id).await?.metadata;
    drop(conn); // never hold a pooled connection across a model or tool call
    let settings = compaction::Settings::from_metadata(&metadata, model.context_tokens);
    let tool_specs = if model.supports_tools { env.tools.specs() } else { Vec::new() };
    let provenance = Provenance { run_id: Some(run.id), step_id: Some(step.id) };
    let mut slice_tool_calls: u32 = 0;

    loop {
        let mut tokens = context::estimate_tokens(&context, &tool_specs);
        if tokens > settings.threshold {
            tracing::info!(tokens, threshold = settings.threshold, "context over the compaction threshold");
            (context, snapshot) =
                crate::compact::automatic(env, model, lease, &context, snapshot.as_ref(), &settings).await?;
            tokens = context::estimate_tokens(&context, &tool_specs);
        }
        let limit = model.context_tokens.map(|t| t as i32);
        fenced!(env.pool, lease, |conn| {
            lease::record_context(conn, lease, step.id, tokens as i32, limit).await?;
            Ok(())
        })?;

        let request = ChatRequest {
            messages: projection::project_for(model, &context),
            tools: tool_specs.clone(),
            tool_choice: None,
            max_tokens: None,
            temperature: None,
        };
        let turn = call_model(env, model, &request, lease, control).await?;
        state.usage.model_calls += 1;
        if let Some(usage) = &turn.usage {
            state.usage.prompt_tokens += usage.prompt_tokens as i64;
            state.usage.completion_tokens += usage.completion_tokens as i64;
        }

        let mut assistant = NewMessage::text(role::ASSISTANT, turn.content.clone());
        assistant.reasoning = turn.reasoning.clone().filter(|r| !r.is_empty());
        if !turn.tool_calls.is_empty() {
            let calls: Vec<_> = turn
                .tool_calls
                .iter()
                .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                .collect();
            let calls = serde_json::Value::Array(calls);
            assistant.token_estimate += agentloop_shared::tokens::estimate_text(&calls.to_string()) as i32;
            assistant.tool_calls = Some(calls);
        }

        if turn.tool_calls.is_empty() {
            // Final answer: the message and the run's completion in one transaction.
            let (usage, step_id) = (state.usage, state.step_id);
            fenced!(env.pool, lease, |conn| {
                messages::append(conn, lease.thread_id, provenance, std::slice::from_ref(&assistant), &[None]).await?;
                threads::set_streaming(conn, lease.thread_id, None).await?;
                lease::end_slice(conn, lease, step_id, usage, &SliceEnd::Completed).await?;
                Ok(())
            })?;
            tracing::info!(end = ?SliceEnd::Completed, tool_calls = slice_tool_calls, "slice checkpointed its end");
            return Ok(());
        }

        // Tool calls (SPEC §6 step 5, §7): the call message is checkpointed before any call runs,
        // then each result is appended as it arrives (see `tool_calls`).
        let inserted = fenced!(env.pool, lease, |conn| {
            let inserted = messages::append(conn, lease.thread_id, provenance, std::slice::from_ref(&assistant), &[None]).await?;
            threads::set_streaming(conn, lease.thread_id, None).await?;
            Ok(inserted)
        })?;
        let Some((_, row)) = inserted.into_iter().next() else {
            return Err(SliceError::Db("the assistant tool-call message was not appended".into()));
        };
        let calls = turn
            .tool_calls
            .iter()
            .map(|c| messages::ToolCallRef { id: c.id.clone(), name: c.name.clone(), arguments: c.arguments.clone() })
            .collect();
        context.push(ContextMessage { identity: Some(row.timestamp_ms), message: assistant });
        let batch = crate::tool_calls::Batch {
            message_sequence: row.sequence,
            calls,
            answered: std::collections::HashSet::new(),
            provenance,
        };
        let outcome = crate::tool_calls::run_batch(env, run, lease, &control.cancel_token(), state, batch).await?;
        context.extend(outcome.results);
        if outcome.ended {
            return Ok(());
        }
        slice_tool_calls += outcome.answered;
        if slice_tool_calls >= env.tool_call_limit {
            let (usage, step_id) = (state.usage, state.step_id);
            fenced!(env.pool, lease, |conn| {
                lease::end_slice(conn, lease, step_id, usage, &SliceEnd::Requeued).await?;
                Ok(())
            })?;
            tracing::info!(end = ?SliceEnd::Requeued, tool_calls = slice_tool_calls, "slice checkpointed its end");
            return Ok(());
        }
    }
}

/// Partial answer shared between the provider callback and the streaming writer.
#[derive(Default)]
struct Partial {
    content: String,
    reasoning: String,
    version: u64,
}

/// Calls the model with streaming; the partial answer goes to `threads.streaming_message`
/// (throttled, fenced) and never to history.
async fn call_model(
    env: &SliceEnv,
    model: &ModelConfig,
    request: &ChatRequest,
    lease: &Lease,
    control: &SliceControl,
) -> Result<agentloop_shared::provider::client::AssistantTurn, SliceError> {
    let partial = Arc::new(Mutex::new(Partial::default()));
    let stop = CancellationToken::new();
    let writer = tokio::spawn(stream_writer(
        env.pool.clone(),
        lease.clone(),
        partial.clone(),
        env.stream_throttle,
        stop.clone(),
        control.clone(),
    ));
    let sink = partial.clone();
    let mut on_delta = move |delta: StreamDelta| {
        let mut p = sink.lock().expect("partial lock");
        match delta {
            StreamDelta::Text(t) => p.content.push_str(&t),
            StreamDelta::Reasoning(r) => p.reasoning.push_str(&r),
        }
        p.version += 1;
    };
    let started = Instant::now();
    let result = env.provider.stream_chat(model, request, &mut on_delta).await;
    stop.cancel();
    let _ = writer.await;
    metrics::histogram!("agentloop_model_call_duration_seconds").record(started.elapsed().as_secs_f64());
    metrics::counter!("agentloop_model_calls_total", "outcome" => if result.is_ok() { "ok" } else { "error" }).increment(1);
    match result {
        Ok(turn) => {
            tracing::info!(
                model.name = %model.id,
                duration_ms = started.elapsed().as_millis() as u64,
                tool_calls = turn.tool_calls.len(),
                malformed_chunks = turn.malformed_chunks,
                "model call"
            );
            Ok(turn)
        }
        Err(e) => Err(failed(e.code(), e.to_string())),
    }
}

/// Writes the partial answer at most every `throttle` while the model streams.
async fn stream_writer(
    pool: PgPool,
    lease: Lease,
    partial: Arc<Mutex<Partial>>,
    throttle: Duration,
    stop: CancellationToken,
    control: SliceControl,
) {
    let mut written_version = 0;
    let mut written_units = 0usize; // UTF-16 code units already sent (what browsers count)
    let mut written_bytes = 0usize;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(throttle) => {}
        }
        let (content, reasoning, version) = {
            let p = partial.lock().expect("partial lock");
            (p.content.clone(), p.reasoning.clone(), p.version)
        };
        if version == written_version {
            continue;
        }
        let delta = &content[written_bytes..];
        let streaming = json!({"runId": lease.run_id, "content": content, "reasoning": reasoning});
        let event = json!({"runId": lease.run_id, "offset": written_units, "delta": delta});
        let thread_id = lease.thread_id;
        let result = fenced!(pool, lease, |conn| {
            threads::set_streaming(conn, thread_id, Some(&streaming)).await?;
            events::append(conn, thread_id, events::kind::STREAMING, &event).await?;
            Ok(())
        });
        match result {
            Ok(()) => {
                written_version = version;
                written_units += delta.encode_utf16().count();
                written_bytes = content.len();
            }
            Err(SliceError::LeaseLost) => {
                control.abort(AbortReason::LeaseLost);
                return;
            }
            Err(error) => tracing::warn!(%error, "streaming write failed; will retry"),
        }
    }
}

/// Renews the lease every `renew`; aborts the slice when the lease is lost, when cancellation
/// is requested, or (watchdog) when no renewal succeeded for `lease - renew`, so a worker cut off
/// from the database stops before another worker may claim the run.
async fn keep_lease(env: Arc<SliceEnv>, lease: Lease, control: SliceControl) {
    let mut last_ok = Instant::now();
    let watchdog = env.lease.saturating_sub(env.renew);
    loop {
        tokio::select! {
            _ = control.token.cancelled() => return,
            _ = tokio::time::sleep(env.renew) => {}
        }
        if last_ok.elapsed() >= env.lease {
            // The process was stalled (e.g. SIGSTOP) past its lease: it may already be claimed.
            tracing::warn!(since_ms = last_ok.elapsed().as_millis() as u64, "no lease renewal within the lease; stopping");
            control.abort(AbortReason::LeaseLost);
            return;
        }
        let attempt = async {
            let mut conn = env.pool.get().await.map_err(|e| e.to_string())?;
            Ok::<_, String>(lease.renew(&mut conn, env.lease).await)
        };
        match tokio::time::timeout(env.renew, attempt).await {
            Ok(Ok(Ok(fence))) => {
                last_ok = Instant::now();
                if fence.cancel_requested {
                    control.abort(AbortReason::Cancel);
                }
            }
            Ok(Ok(Err(FencedError::LeaseLost(LeaseLost)))) => {
                tracing::warn!("lease renewal matched no row: the run is no longer ours");
                control.abort(AbortReason::LeaseLost);
                return;
            }
            failure => {
                let error = match failure {
                    Ok(Ok(Err(FencedError::Query(q)))) => q.to_string(),
                    Ok(Err(pool)) => pool,
                    _ => "timed out".to_owned(),
                };
                tracing::warn!(%error, "lease renewal failed");
                if last_ok.elapsed() >= watchdog {
                    tracing::warn!("watchdog: no successful renewal for lease - renew; stopping");
                    control.abort(AbortReason::LeaseLost);
                    return;
                }
            }
        }
    }
}
