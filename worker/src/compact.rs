//! Compaction inside the worker (SPEC §8): the summariser that calls the run's model, automatic
//! compaction before a model call when the context is over the threshold, and manual compaction
//! runs that fill a child thread.

use std::sync::Mutex;

use agentloop_shared::compaction::{self, CompactionError, Progress, Settings, Summarizer};
use agentloop_shared::context::{self, ContextMessage};
use agentloop_shared::messages::{self, NewMessage, Provenance, role};
use agentloop_shared::provider::catalog::ModelConfig;
use agentloop_shared::provider::client::ChatRequest;
use agentloop_shared::scheduler::Lease;
use agentloop_shared::scheduler::lease::{self, SliceEnd};
use agentloop_shared::snapshots::{self, Snapshot};
use agentloop_shared::{events, runs::Run, tokens};
use futures_util::future::BoxFuture;
use serde_json::json;

use crate::slice::{SliceEnv, SliceError, SliceState, failed};

/// Summarises with the run's model: no tools, no history, no usage written to the thread.
/// Journals `compaction {runId, pass, part, of}` before each call ("reducing context, part i/n").
struct ModelSummarizer<'a> {
    env: &'a SliceEnv,
    model: &'a ModelConfig,
    lease: &'a Lease,
    progress: Mutex<Option<Progress>>,
}

impl Summarizer for ModelSummarizer<'_> {
    fn summarize(&self, transcript: String, target_tokens: i64) -> BoxFuture<'_, Result<String, CompactionError>> {
        Box::pin(async move {
            let progress = self.progress.lock().expect("progress lock").take();
            if let Some(p) = progress {
                let event = json!({"runId": self.lease.run_id, "pass": p.pass, "part": p.part, "of": p.of,
                                   "label": format!("reducing context, part {}/{}", p.part, p.of)});
                let lease = self.lease;
                let written: Result<(), SliceError> = fenced!(self.env.pool, lease, |conn| {
                    events::append(conn, lease.thread_id, events::kind::COMPACTION, &event).await?;
                    Ok(())
                });
                written.map_err(|e| CompactionError::Model(e.to_string()))?;
            }
            let request = ChatRequest {
                messages: vec![
                    json!({"role": "system", "content": compaction::SUMMARY_PROMPT}),
                    json!({"role": "user", "content": format!("{transcript}\n\nWrite the summary now, in at most about {target_tokens} tokens.")}),
                ],
                tools: Vec::new(),
                tool_choice: None,
                max_tokens: Some((target_tokens * 2).clamp(256, 16_000) as u32),
                temperature: None,
            };
            let turn = self
                .env
                .provider
                .stream_chat(self.model, &request, &mut |_| {})
                .await
                .map_err(|e| CompactionError::Model(e.to_string()))?;
            if !turn.tool_calls.is_empty() {
                return Err(CompactionError::EmptySummary);
            }
            Ok(turn.content)
        })
    }
}

async fn run_compaction(
    env: &SliceEnv,
    model: &ModelConfig,
    lease: &Lease,
    context: &[ContextMessage],
    settings: &Settings,
) -> Result<compaction::Compacted, SliceError> {
    let summarizer = ModelSummarizer { env, model, lease, progress: Mutex::new(None) };
    let slot = &summarizer.progress;
    let mut on_progress = |p: Progress| *slot.lock().expect("progress lock") = Some(p);
    compaction::compact(context, settings, &summarizer, &mut on_progress)
        .await
        .map_err(|e| failed(e.code(), e.to_string()))
}

/// Automatic compaction (SPEC §6 step 3): summarises the middle of `context`, writes the next
/// snapshot version (fenced) and returns the new context: instructions + summary + tail.
pub async fn automatic(
    env: &SliceEnv,
    model: &ModelConfig,
    lease: &Lease,
    context: &[ContextMessage],
    previous: Option<&Snapshot>,
    settings: &Settings,
) -> Result<(Vec<ContextMessage>, Option<Snapshot>), SliceError> {
    let compacted = run_compaction(env, model, lease, context, settings).await?;
    let snapshot = fenced!(env.pool, lease, |conn| {
        let snapshot = snapshots::insert(
            conn,
            lease.thread_id,
            &compacted.summary,
            compacted.summary_tokens as i32,
            &compacted.covered,
            previous.filter(|_| compacted.folded_summary),
            Some(lease.run_id),
        )
        .await?;
        let event = json!({"runId": lease.run_id, "done": true, "passes": compacted.passes, "calls": compacted.calls,
                           "inputTokens": compacted.input_tokens, "summaryTokens": compacted.summary_tokens,
                           "snapshotVersion": snapshot.as_ref().map(|s| s.version)});
        events::append(conn, lease.thread_id, events::kind::COMPACTION, &event).await?;
        Ok(snapshot)
    })?;
    tracing::info!(passes = compacted.passes, calls = compacted.calls, input_tokens = compacted.input_tokens,
                   summary_tokens = compacted.summary_tokens, "context compacted");
    let mut next = compacted.instructions;
    next.push(context::summary_message(&compacted.summary));
    next.extend(compacted.tail);
    Ok((next, snapshot))
}

/// A manual compaction run (SPEC §8): summarises the source thread's context and writes the
/// child thread's history — instructions, the summary as a plain system message (the internal
/// marker never reaches a child thread), the verbatim tail — then completes the run. The source
/// thread is never modified.
pub async fn manual(
    env: &SliceEnv,
    run: &Run,
    lease: &Lease,
    model: &ModelConfig,
    state: &mut SliceState,
) -> Result<(), SliceError> {
    let source = run.source_thread_id.ok_or_else(|| failed("compaction_failed", "the compaction run has no source thread"))?;
    let (context, metadata) = {
        let mut conn = env.pool.get().await?;
        let (context, _) = context::load(&mut conn, source).await?;
        let thread = agentloop_shared::threads::get(&mut conn, source).await?;
        (context, thread.metadata)
    };
    let settings = Settings::from_metadata(&metadata, model.context_tokens);
    let (instructions, summary, tail) = match run_compaction(env, model, lease, &context, &settings).await {
        Ok(c) => (c.instructions, Some(c.summary), c.tail),
        Err(SliceError::Failed { code, .. }) if code == "compaction_nothing_to_compact" => {
            let split = compaction::split(&context, settings.recent_messages);
            (split.instructions, None, split.tail)
        }
        Err(e) => return Err(e),
    };
    let mut history: Vec<NewMessage> = instructions.into_iter().map(|c| c.message).collect();
    if let Some(summary) = summary {
        history.push(NewMessage::text(role::SYSTEM, format!("Summary of the earlier conversation:\n{summary}")));
    }
    // Earlier summaries in the tail of the source keep their text but lose the marker.
    history.extend(tail.into_iter().map(|c| {
        let mut m = c.message;
        if context::is_summary(&m) {
            let text = messages::content_text(&m.content).replace(agentloop_shared::provider::projection::SUMMARY_MARKER, "");
            m = NewMessage::text(role::SYSTEM, text.trim());
        }
        m
    }));
    for m in &mut history {
        m.token_estimate = tokens::estimate_message(&m.content, m.tool_calls.as_ref()) as i32;
    }
    let identities = vec![None; history.len()];
    let provenance = Provenance { run_id: Some(run.id), step_id: state.step_id };
    let (usage, step_id) = (state.usage, state.step_id);
    fenced!(env.pool, lease, |conn| {
        messages::append(conn, lease.thread_id, provenance, &history, &identities).await?;
        lease::end_slice(conn, lease, step_id, usage, &SliceEnd::Completed).await?;
        Ok(())
    })
}
