//! Slots given back between steps (migration 000042).
//!
//! Fair claims hand a free slot to the principal with the fewest runs running, but a slot is
//! freed only when its slice ends, and a slice of a long agent loop runs up to
//! `WORKER_TOOL_CALL_LIMIT` tool calls and as many model calls: one principal could hold every
//! slot of the fleet for that long while another principal's one-line turn waited (acceptance
//! probe H, H-3). So a slice asks, between two steps (after a tool batch is committed), whether
//! its slot is wanted — only when this worker's slots are all busy and it has been told of a
//! queued run since they filled, and at most once per `WORKER_YIELD_CHECK_MS` for the whole
//! process. The database answers ([`agentloop_slot_wanted`]) whether another principal has a
//! run queued for at least that long and runs at least two fewer than this run's principal; if
//! so the slice ends `interrupted` (the run goes back to `queued`, its step not consumed, its
//! progress committed) and the next claim gives the slot to the principal that waited.
//!
//! A model call in progress is never cut for this: the bound on another principal's wait is
//! one step of the slowest running slice, not a whole slice.
//!
//! [`agentloop_slot_wanted`]: ../../migrations/2026-12-06-000042_slot_yield/up.sql

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use agentloop_shared::store::{Replay, Store};
use serde_json::json;
use uuid::Uuid;

/// What the claim loop knows about this worker's slots, shared with its slices.
pub struct SlotPressure {
    /// Every slot is busy.
    full: AtomicBool,
    /// A run was queued (a `queued:` notification or a listener resync) while every slot was
    /// busy; cleared when a slot is free again.
    waiting: AtomicBool,
    /// When the next question may be asked (one per `every` for the process).
    next: Mutex<Instant>,
    every: Option<Duration>,
    models: Vec<String>,
}

impl SlotPressure {
    /// `every`: `WORKER_YIELD_CHECK_MS` (`None`: never give a slot back); `models`: the models
    /// this worker serves (only runs of those can take the slot here).
    pub fn new(every: Option<Duration>, models: Vec<String>) -> Self {
        Self { full: AtomicBool::new(false), waiting: AtomicBool::new(false), next: Mutex::new(Instant::now()), every, models }
    }

    /// The claim loop's view after each change: `full` when no slot is free.
    pub fn set_full(&self, full: bool) {
        self.full.store(full, Ordering::Relaxed);
        if !full {
            self.waiting.store(false, Ordering::Relaxed);
        }
    }

    /// A run was queued somewhere (notification or resync).
    pub fn queued(&self) {
        if self.full.load(Ordering::Relaxed) {
            self.waiting.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the slice of run `run_id` should give its slot back now: asks the database
    /// when the slots are full and a run was queued since, at most once per period for the
    /// process. A database error answers no (the slice goes on; the question is asked again
    /// after the period).
    pub async fn slot_wanted(&self, store: &Store, run_id: Uuid) -> bool {
        let Some(every) = self.every else { return false };
        if !self.full.load(Ordering::Relaxed) || !self.waiting.load(Ordering::Relaxed) {
            return false;
        }
        {
            let mut next = self.next.lock().expect("slot pressure lock");
            let now = Instant::now();
            if now < *next {
                return false;
            }
            *next = now + every;
        }
        let arg = json!({"runId": run_id, "models": self.models, "waitedMs": every.as_millis() as u64});
        match store.call("agentloop_slot_wanted", &arg, Replay::Safe, None).await {
            Ok(value) => value["wanted"].as_bool() == Some(true),
            Err(error) => {
                tracing::warn!(%error, "could not ask whether the slot is wanted; going on");
                false
            }
        }
    }
}
