//! Named counters shared by the workload, the faults and the checks, plus timestamped notes
//! (the fault timeline) for evidence.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Clone-able counters: `name -> count`.
#[derive(Clone)]
pub struct Tally {
    counts: Arc<Mutex<BTreeMap<String, u64>>>,
    notes: Arc<Mutex<Vec<(f64, String)>>>,
    started: Instant,
}

impl Default for Tally {
    fn default() -> Self {
        Self { counts: Arc::default(), notes: Arc::default(), started: Instant::now() }
    }
}

impl Tally {
    pub fn add(&self, name: &str, n: u64) {
        *self.counts.lock().expect("tally lock").entry(name.to_owned()).or_insert(0) += n;
    }

    pub fn get(&self, name: &str) -> u64 {
        self.counts.lock().expect("tally lock").get(name).copied().unwrap_or(0)
    }

    /// Every counter whose name starts with `prefix`, prefix removed.
    pub fn with_prefix(&self, prefix: &str) -> Vec<(String, u64)> {
        self.counts
            .lock()
            .expect("tally lock")
            .iter()
            .filter_map(|(k, v)| k.strip_prefix(prefix).map(|s| (s.to_owned(), *v)))
            .collect()
    }

    pub fn all(&self) -> BTreeMap<String, u64> {
        self.counts.lock().expect("tally lock").clone()
    }

    /// Records a timestamped note (seconds since the start).
    pub fn note(&self, text: impl Into<String>) {
        let t = self.started.elapsed().as_secs_f64();
        self.notes.lock().expect("tally lock").push((t, text.into()));
    }

    pub fn notes(&self) -> Vec<(f64, String)> {
        self.notes.lock().expect("tally lock").clone()
    }

    /// Seconds since the start (the clock of the notes).
    pub fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }
}
