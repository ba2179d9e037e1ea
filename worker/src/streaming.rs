//! The stream flusher: ONE task per worker writes the partial answers of ALL its streaming
//! slices, every `throttle`, in ONE transaction (`agentloop_stream`): a `streaming` journal event
//! per slice that got new text (a delta with its UTF-16 offset, not the whole text) and, for a
//! new partial and then spaced by its growth (`wants_snapshot`), the whole partial in
//! `threads.streaming_message` so a reader can rebuild it from that plus the later deltas. The
//! database work per streaming run is therefore bounded by the flush rate, not by the token
//! rate, and a thousand streams cost one transaction per tick.
//!
//! A thread another session holds is skipped, not waited for (SKIP LOCKED, migration 000030):
//! one locked thread must not freeze every other stream of the worker, nor the commits that
//! wait for the flush in progress; its text goes with the next flush.
//!
//! A slice [`StreamHub::open`]s a stream before its model call and [`Stream::finish`]es it
//! before it commits the answer: `finish` waits for a flush in progress, so no streaming event of
//! the call can land after the committed message. Dropping a [`Stream`] (an aborted slice, a
//! panic) unregisters it at once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentloop_shared::scheduler::Lease;
use agentloop_shared::scheduler::step::{self, StreamItem, StreamSnapshot};
use agentloop_shared::store::Store;
use agentloop_shared::streaming::utf16_len;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::control::{AbortReason, SliceControl};

/// A whole-partial snapshot is written at least every this many flushes of a stream while its
/// partial is small (under [`SNAPSHOT_LARGE`] bytes at the last snapshot) ...
pub const SNAPSHOT_EVERY: u32 = 8;
/// ... every this many flushes once it is larger ...
pub const SNAPSHOT_EVERY_LARGE: u32 = 256;
/// ... and whenever the partial grew by this many bytes, or by half its size at the
/// last snapshot if that is more, since the last one.
const SNAPSHOT_BYTES: usize = 16 * 1024;
/// The size from which snapshots are spaced by [`SNAPSHOT_EVERY_LARGE`].
const SNAPSHOT_LARGE: usize = 64 * 1024;

/// Whether the flush after `flushes` flushes (`since` of them since the last snapshot) writes a
/// snapshot of a partial of `size` bytes whose last snapshot held `snapshotted` bytes.
///
/// Every snapshot rewrites the whole partial, so a rule of "every 8 flushes or 16 KiB" made the
/// WAL of one answer quadratic in its size: a 2.4 MB answer streamed over 250 s wrote 139 MB of
/// WAL (probe O, M-3). Spaced by growth in proportion to the size, the snapshots of an answer
/// sum to a few times its size; a reader applies at most [`SNAPSHOT_EVERY_LARGE`] deltas after
/// the last one.
fn wants_snapshot(flushes: u32, since: u32, size: usize, snapshotted: usize) -> bool {
    let every = if snapshotted < SNAPSHOT_LARGE { SNAPSHOT_EVERY } else { SNAPSHOT_EVERY_LARGE };
    flushes == 0 || since + 1 >= every || size.saturating_sub(snapshotted) >= SNAPSHOT_BYTES.max(snapshotted / 2)
}

/// The partial answer of one model call.
#[derive(Default)]
pub struct Partial {
    pub content: String,
    pub reasoning: String,
    sent_bytes: usize,
    sent_units: usize,
    sent_reasoning_bytes: usize,
    sent_reasoning_units: usize,
    flushes: u32,
    snapshot_bytes: usize,
    /// `flushes` at the last snapshot.
    snapshot_flush: u32,
}

struct Entry {
    lease: Lease,
    control: SliceControl,
    partial: Arc<Mutex<Partial>>,
}

/// A stream's item in a flush, with what it will have sent once the flush commits:
/// `(content bytes, content UTF-16 units, reasoning bytes, reasoning UTF-16 units)`.
type Pending = (StreamItem, Arc<Mutex<Partial>>, SliceControl, (usize, usize, usize, usize));

/// The flusher's registry.
pub struct StreamHub {
    streams: Mutex<HashMap<Uuid, Entry>>,
    /// Held for the whole of a flush; `finish` takes it to wait for a flush in progress.
    flushing: tokio::sync::Mutex<()>,
}

/// A registered stream; see the module docs.
pub struct Stream {
    hub: Arc<StreamHub>,
    run_id: Uuid,
    /// The partial the provider callback appends to.
    pub partial: Arc<Mutex<Partial>>,
}

impl StreamHub {
    /// An empty hub.
    pub fn new() -> Arc<Self> {
        Arc::new(Self { streams: Mutex::new(HashMap::new()), flushing: tokio::sync::Mutex::new(()) })
    }

    /// Registers the partial of a new model call of the leased run (offset 0).
    pub fn open(self: &Arc<Self>, lease: &Lease, control: &SliceControl) -> Stream {
        let partial = Arc::new(Mutex::new(Partial::default()));
        self.streams.lock().expect("streams lock").insert(
            lease.run_id,
            Entry { lease: lease.clone(), control: control.clone(), partial: partial.clone() },
        );
        Stream { hub: self.clone(), run_id: lease.run_id, partial }
    }

    /// One flush: every stream with unsent text, in one transaction.
    async fn flush(&self, store: &Store, owner: &str) {
        let _guard = self.flushing.lock().await;
        let pending: Vec<Pending> = {
            let streams = self.streams.lock().expect("streams lock");
            streams
                .values()
                .filter_map(|e| {
                    let p = e.partial.lock().expect("partial lock");
                    if p.content.len() == p.sent_bytes && p.reasoning.len() == p.sent_reasoning_bytes {
                        return None;
                    }
                    let delta = p.content[p.sent_bytes..].to_owned();
                    let reasoning_delta = (p.reasoning.len() > p.sent_reasoning_bytes).then(|| p.reasoning[p.sent_reasoning_bytes..].to_owned());
                    let snapshot = wants_snapshot(p.flushes, p.flushes - p.snapshot_flush, p.content.len() + p.reasoning.len(), p.snapshot_bytes)
                        .then(|| StreamSnapshot { content: p.content.clone(), reasoning: p.reasoning.clone() });
                    let sent = (
                        p.content.len(),
                        p.sent_units + utf16_len(&delta),
                        p.reasoning.len(),
                        p.sent_reasoning_units + reasoning_delta.as_deref().map_or(0, utf16_len),
                    );
                    let item = StreamItem {
                        run_id: e.lease.run_id,
                        epoch: e.lease.epoch,
                        thread_id: e.lease.thread_id,
                        offset: p.sent_units,
                        delta,
                        reasoning_offset: reasoning_delta.as_ref().map(|_| p.sent_reasoning_units),
                        reasoning_delta,
                        snapshot,
                    };
                    Some((item, e.partial.clone(), e.control.clone(), sent))
                })
                .collect()
        };
        if pending.is_empty() {
            return;
        }
        let items: Vec<StreamItem> = pending.iter().map(|(item, ..)| item.clone()).collect();
        match step::flush_streams(store, owner, &items).await {
            Ok(unflushed) => {
                for (item, partial, control, sent) in &pending {
                    if unflushed.lost.contains(&item.run_id) {
                        control.abort(AbortReason::LeaseLost);
                        continue;
                    }
                    if unflushed.skipped.contains(&item.run_id) {
                        // Its thread was held by another session: not advanced, sent again.
                        continue;
                    }
                    let mut p = partial.lock().expect("partial lock");
                    (p.sent_bytes, p.sent_units, p.sent_reasoning_bytes, p.sent_reasoning_units) = *sent;
                    if item.snapshot.is_some() {
                        p.snapshot_bytes = p.content.len() + p.reasoning.len();
                        p.snapshot_flush = p.flushes;
                    }
                    p.flushes += 1;
                }
                metrics::counter!("agentloop_stream_flushes_total").increment(1);
                metrics::histogram!("agentloop_stream_flush_items").record(items.len() as f64);
            }
            // Not advanced: the next flush resends from the last confirmed offsets.
            Err(error) => tracing::warn!(%error, streams = items.len(), "streaming flush failed; will resend"),
        }
    }

    /// The flusher loop: a flush every `throttle` until `stop`.
    pub async fn run(self: Arc<Self>, store: Store, owner: String, throttle: Duration, stop: CancellationToken) {
        let mut tick = tokio::time::interval(throttle);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => self.flush(&store, &owner).await,
            }
        }
    }
}

impl Stream {
    /// Unregisters the stream after any flush in progress (call before committing the answer).
    pub async fn finish(self) {
        let _guard = self.hub.flushing.lock().await;
        self.hub.streams.lock().expect("streams lock").remove(&self.run_id);
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Ok(mut streams) = self.hub.streams.lock()
            && streams.get(&self.run_id).is_some_and(|e| Arc::ptr_eq(&e.partial, &self.partial))
        {
            streams.remove(&self.run_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The snapshots of one long answer, streamed in even pieces, cost a few times its size in
    /// all (probe O, M-3: every 8 flushes or 16 KiB rewrote a 2.4 MB answer ~125 times, 139 MB of
    /// WAL); a short answer keeps a snapshot every 8 flushes; a reader never applies more than
    /// SNAPSHOT_EVERY_LARGE deltas after one.
    #[test]
    fn snapshots_of_one_answer_cost_a_few_times_its_size() {
        let written = |size: usize, flushes: u32| {
            let (mut snapshotted, mut at, mut total, mut longest_gap) = (0usize, 0u32, 0usize, 0u32);
            for f in 0..flushes {
                let now = size * (f as usize + 1) / flushes as usize;
                if wants_snapshot(f, f - at, now, snapshotted) {
                    total += now;
                    snapshotted = now;
                    longest_gap = longest_gap.max(f - at);
                    at = f;
                }
            }
            (total, longest_gap)
        };
        let (total, gap) = written(2_400_000, 1000);
        assert!(total < 4 * 2_400_000, "snapshots of a 2.4 MB answer wrote {total} bytes");
        assert!(gap <= SNAPSHOT_EVERY_LARGE, "{gap} flushes between two snapshots");
        let (_, gap) = written(20_000, 200);
        assert!(gap <= SNAPSHOT_EVERY, "a short answer is snapshotted every {SNAPSHOT_EVERY} flushes: {gap}");
    }
}
