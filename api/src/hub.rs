//! Fan-out of journal events to every SSE/long-poll client of this process (SPEC §10).
//!
//! The process holds ONE listener connection (outside the pool). A `<thread_id>:<sequence>`
//! notification bumps that thread's watch channel; a listener reconnect (or coalesced overflow)
//! bumps every channel and marks every cache stale, so every client re-reads from its own
//! cursor and no event is lost. Events always come from the journal table, never from the
//! notification: the notification only says "something newer than N exists".
//!
//! Reads are shared per thread: clients of one thread take the thread's lock in turn; the first
//! one after a wake-up reads the journal once and caches the events, the others are served from
//! the cache. One new event therefore costs one journal read per thread, not one per client.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentloop_shared::db::PgPool;
use agentloop_shared::events::{THREADS_CHANNEL, ThreadEvent};
use agentloop_shared::scheduler::listener::{self, ListenerEvent};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::routes::updates::{BATCH, Batch, next_batch};

/// Events kept per thread in the shared cache.
const CACHE_EVENTS: usize = 512;

/// One thread's wake-up channel and shared read cache.
pub struct ThreadFeed {
    wake: watch::Sender<u64>,
    /// Highest journal sequence announced by a notification or read from the database.
    known: AtomicI64,
    /// Set by a listener resync: the next reader must ask the database for the current end.
    stale: AtomicBool,
    /// Contiguous recent events (ascending sequences), filled by whoever read the journal.
    cache: tokio::sync::Mutex<VecDeque<ThreadEvent>>,
}

/// Per-thread feeds.
#[derive(Default)]
pub struct Hub {
    threads: Mutex<HashMap<Uuid, Arc<ThreadFeed>>>,
}

impl Hub {
    fn feed(&self, thread_id: Uuid) -> Arc<ThreadFeed> {
        let mut threads = self.threads.lock().expect("hub lock");
        if threads.len() > 1024 {
            threads.retain(|_, f| f.wake.receiver_count() > 0);
        }
        threads
            .entry(thread_id)
            .or_insert_with(|| {
                Arc::new(ThreadFeed {
                    wake: watch::channel(0).0,
                    known: AtomicI64::new(0),
                    stale: AtomicBool::new(true),
                    cache: tokio::sync::Mutex::new(VecDeque::new()),
                })
            })
            .clone()
    }

    /// Subscribes to wake-ups of `thread_id`. Only the receiver's changes matter.
    pub fn subscribe(&self, thread_id: Uuid) -> watch::Receiver<u64> {
        self.feed(thread_id).wake.subscribe()
    }

    /// The next batch for a client of `thread_id` at `cursor`: served from the shared cache when
    /// it covers everything known, else read from the journal (once for all waiting clients).
    pub async fn next_batch(&self, pool: &PgPool, thread_id: Uuid, cursor: i64) -> Result<Batch, String> {
        let feed = self.feed(thread_id);
        let mut cache = feed.cache.lock().await;
        let known = feed.known.load(Ordering::Acquire);
        if !feed.stale.load(Ordering::Acquire) && cursor <= known {
            let first = cache.front().map(|e| e.sequence);
            let last = cache.back().map(|e| e.sequence);
            if cursor == known {
                return Ok(Batch::Events(Vec::new()));
            }
            if let (Some(first), Some(last)) = (first, last) {
                if first <= cursor + 1 && last >= known {
                    let events = cache.iter().filter(|e| e.sequence > cursor).take(BATCH as usize).cloned().collect();
                    return Ok(Batch::Events(events));
                }
            }
        }
        let mut conn = pool.get().await.map_err(|e| e.to_string())?;
        let current = agentloop_shared::threads::get(&mut conn, thread_id).await.map_err(|e| e.to_string())?.last_event_sequence;
        let batch = next_batch(&mut conn, thread_id, cursor, current).await.map_err(|e| e.to_string())?;
        feed.known.fetch_max(current, Ordering::AcqRel);
        feed.stale.store(false, Ordering::Release);
        if let Batch::Events(events) = &batch {
            if let Some(first) = events.first() {
                let contiguous = cache.back().is_some_and(|b| b.sequence + 1 == first.sequence);
                let covered = cache.back().is_some_and(|b| b.sequence >= first.sequence);
                if !contiguous && !covered {
                    cache.clear();
                }
                for e in events {
                    if cache.back().is_none_or(|b| e.sequence == b.sequence + 1) {
                        cache.push_back(e.clone());
                    }
                }
                while cache.len() > CACHE_EVENTS {
                    cache.pop_front();
                }
            }
        }
        Ok(batch)
    }

    fn wake(&self, thread_id: Uuid, sequence: Option<i64>) {
        let feed = self.threads.lock().expect("hub lock").get(&thread_id).cloned();
        if let Some(feed) = feed {
            match sequence {
                Some(s) => {
                    feed.known.fetch_max(s, Ordering::AcqRel);
                }
                None => feed.stale.store(true, Ordering::Release),
            }
            feed.wake.send_modify(|n| *n += 1);
        }
    }

    fn wake_all(&self) {
        let feeds: Vec<Arc<ThreadFeed>> = self.threads.lock().expect("hub lock").values().cloned().collect();
        for feed in feeds {
            feed.stale.store(true, Ordering::Release);
            feed.wake.send_modify(|n| *n += 1);
        }
    }

    /// Number of threads with at least one subscriber.
    pub fn watched_threads(&self) -> usize {
        self.threads.lock().expect("hub lock").values().filter(|f| f.wake.receiver_count() > 0).count()
    }

    /// Runs the listener loop until `shutdown` fires.
    pub async fn run(self: Arc<Self>, database_url: String, shutdown: CancellationToken) {
        let mut rx = listener::spawn(database_url, "agentloop-api-listener", vec![THREADS_CHANNEL], Duration::from_secs(5), shutdown.clone());
        while let Some(event) = rx.recv().await {
            match event {
                ListenerEvent::Notification { payload, .. } => {
                    if let Some((id, seq)) = payload.split_once(':') {
                        if let Ok(id) = Uuid::parse_str(id) {
                            self.wake(id, seq.parse().ok());
                        }
                    }
                }
                ListenerEvent::Resync => self.wake_all(),
            }
        }
    }
}
