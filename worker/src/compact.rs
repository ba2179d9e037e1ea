//! Compaction inside the worker (SPEC §8): the summariser that calls the run's model, automatic
//! compaction before a model call when the context is over the threshold, and manual compaction
//! runs that fill a child thread. Every write is a checkpoint ([`Slice::commit`]).

use std::sync::Mutex;

use agentloop_shared::compaction::{self, CompactionError, Progress, Settings, Summarizer};
use agentloop_shared::context::{self, ContextMessage};
use agentloop_shared::messages::{self, NewMessage, role};
use agentloop_shared::provider::catalog::ModelConfig;
use agentloop_shared::provider::client::{ChatRequest, ProviderClient};
use agentloop_shared::runs::Run;
use agentloop_shared::scheduler::step::{ContextSize, Coverage, JournalEvent, SliceEnd, SnapshotRef, SnapshotWrite};
use agentloop_shared::scheduler::Commit;
use agentloop_shared::tokens;
use futures_util::future::BoxFuture;
use serde_json::json;
use uuid::Uuid;

use crate::slice::{Slice, SliceError, failed};

/// Summarises with the run's model: no tools, no history, no usage written to the thread.
/// Records the progress of each call ("reducing context, part i/n") to be journaled.
struct ModelSummarizer<'a> {
    provider: &'a ProviderClient,
    model: &'a ModelConfig,
    run_id: Uuid,
    progress: Mutex<Option<Progress>>,
    /// Progress events not journaled yet (written with the next commit).
    events: Mutex<Vec<JournalEvent>>,
    /// The slice's control: an abort (a shutdown, a cancellation) starts no further summary
    /// call, and a call dropped by it ends `Stopped`; the parts already paid for are kept.
    control: crate::control::SliceControl,
}

impl Summarizer for ModelSummarizer<'_> {
    fn summarize(&self, transcript: String, target_tokens: i64) -> BoxFuture<'_, Result<String, CompactionError>> {
        Box::pin(async move {
            if let Some(p) = self.progress.lock().expect("progress lock").take() {
                let payload = json!({"runId": self.run_id, "pass": p.pass, "part": p.part, "of": p.of,
                                     "label": format!("reducing context, part {}/{}", p.part, p.of)});
                self.events.lock().expect("events lock").push(JournalEvent { kind: "compaction", payload });
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
            let mut ignore = |_| {};
            let turn = tokio::select! {
                turn = self.provider.stream_chat(self.model, &request, &mut ignore) => turn,
                () = self.control.model_call_stopped() => return Err(CompactionError::Stopped),
            }
            .map_err(|e| CompactionError::Model(e.to_string()))?;
            if !turn.tool_calls.is_empty() {
                return Err(CompactionError::EmptySummary);
            }
            Ok(turn.content)
        })
    }

    fn stopped(&self) -> bool {
        self.control.reason().is_some()
    }
}

/// Runs the summariser over `context`. Returns the result with its progress events, for the
/// caller to journal (or not) in the commit that saves the summary: a commit of their own
/// before that one carried no paid work, so it was not held through an outage, and its failure
/// threw away the summary that had been paid for (acceptance probe E: an outage past the lease
/// during a summary call). When compaction fails, the events are journaled here (nothing paid
/// is kept).
async fn run_compaction(
    slice: &mut Slice,
    model: &ModelConfig,
    context: &[ContextMessage],
    settings: &Settings,
) -> Result<(compaction::Compacted, Vec<JournalEvent>), SliceError> {
    let env = slice.env.clone();
    let summarizer = ModelSummarizer {
        provider: &env.provider,
        model,
        run_id: slice.lease.run_id,
        progress: Mutex::new(None),
        events: Mutex::new(Vec::new()),
        control: slice.control.clone(),
    };
    let slot = &summarizer.progress;
    let mut on_progress = |p: Progress| *slot.lock().expect("progress lock") = Some(p);
    // Not raced against the slice's abort as a whole: a stop ends the summarising early, and
    // the parts already paid for come back as a partial compaction to be committed.
    let result = compaction::compact(context, settings, &summarizer, &mut on_progress).await;
    let events = std::mem::take(&mut *summarizer.events.lock().expect("events lock"));
    match result {
        Ok(compacted) => Ok((compacted, events)),
        Err(CompactionError::Stopped) => Err(SliceError::Aborted),
        Err(e) => {
            if !events.is_empty() {
                slice.commit(Commit { events, ..Commit::default() }).await?;
            }
            Err(failed(e.code(), e.to_string()))
        }
    }
}

/// Automatic compaction (SPEC §6 step 3): summarises the middle of `context`, commits the next
/// snapshot version (and the new context size) and returns the new context: instructions +
/// summary + tail.
pub async fn automatic(
    slice: &mut Slice,
    model: &ModelConfig,
    context: &[ContextMessage],
    previous: Option<&SnapshotRef>,
    settings: &Settings,
    tool_tokens: i64,
) -> Result<(Vec<ContextMessage>, Option<SnapshotRef>), SliceError> {
    // The progress events would be journaled in the same transaction as the result, after its
    // `compaction` event (`done`), and would read as still running: the result says it all.
    let (compacted, _progress) = run_compaction(slice, model, context, settings).await?;
    let mut next = compacted.instructions.clone();
    next.push(context::summary_message(&compacted.summary, compacted.summary_tokens as i32));
    next.extend(compacted.tail.iter().cloned());
    let folded = previous.filter(|_| compacted.folded_summary);
    let event = json!({"runId": slice.lease.run_id, "done": true, "passes": compacted.passes, "calls": compacted.calls,
                       "inputTokens": compacted.input_tokens, "summaryTokens": compacted.summary_tokens});
    let size = ContextSize { tokens: context::messages_tokens(&next) + tool_tokens, limit: model.context_tokens.map(|t| t as i64) };
    let done = slice
        .commit(Commit {
            snapshot: Some(SnapshotWrite {
                summary: compacted.summary.clone(),
                token_estimate: compacted.summary_tokens as i32,
                identities: compacted.covered.clone(),
                previous: folded.map(|p| Coverage { from_sequence: p.from_sequence, to_sequence: p.to_sequence }),
                event,
            }),
            context: Some(size),
            ..Commit::default()
        })
        .await?;
    tracing::info!(passes = compacted.passes, calls = compacted.calls, input_tokens = compacted.input_tokens,
                   summary_tokens = compacted.summary_tokens, "context compacted");
    let snapshot = match (done.snapshot_version, done.snapshot_from, done.snapshot_to) {
        (Some(version), Some(from_sequence), Some(to_sequence)) => Some(SnapshotRef {
            version,
            summary: compacted.summary.clone(),
            from_sequence,
            to_sequence,
            token_estimate: compacted.summary_tokens as i32,
        }),
        _ => None,
    };
    Ok((next, snapshot.or_else(|| previous.cloned())))
}

/// A manual compaction run (SPEC §8): summarises the source thread's context and writes the
/// child thread's history — instructions, the summary as a plain system message (the internal
/// marker never reaches a child thread), the verbatim tail — then completes the run. The source
/// thread is never modified.
pub async fn manual(slice: &mut Slice, run: &Run, model: &ModelConfig) -> Result<SliceEnd, SliceError> {
    let source = run.source_thread_id.ok_or_else(|| failed("compaction_failed", "the compaction run has no source thread"))?;
    let (loaded, metadata) = context::read(&slice.env.store, source).await?;
    let (mut context, _) = context::from_loaded(&loaded);
    context::bound_messages(&mut context, agentloop_shared::generation::max_input_tokens(model, &metadata));
    let settings = Settings::from_metadata(&metadata, model.context_tokens);
    let (instructions, summary, tail, events) = match run_compaction(slice, model, &context, &settings).await {
        Ok((c, events)) => (c.instructions, Some(c.summary), c.tail, events),
        Err(SliceError::Failed { code, .. }) if code == "compaction_nothing_to_compact" => {
            let split = compaction::split(&context, settings.recent_messages);
            (split.instructions, None, split.tail, Vec::new())
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
    slice.commit(Commit { messages: history, events, end: Some(SliceEnd::Completed), ..Commit::default() }).await?;
    Ok(SliceEnd::Completed)
}
