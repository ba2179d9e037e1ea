//! Fan-out of journal wake-ups to every SSE/long-poll client of this process (SPEC §10).
//!
//! The process holds ONE listener connection (outside the pool). A `<thread_id>:<sequence>`
//! notification bumps that thread's watch channel; a listener reconnect (or coalesced overflow)
//! bumps every channel, so every client re-reads the journal from its own cursor and no event is
//! lost. Clients always read events from the journal table, never from the notification.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use agentloop_shared::events::THREADS_CHANNEL;
use agentloop_shared::scheduler::listener::{self, ListenerEvent};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Per-thread wake-up channels.
#[derive(Default)]
pub struct Hub {
    threads: Mutex<HashMap<Uuid, watch::Sender<u64>>>,
}

impl Hub {
    /// Subscribes to wake-ups of `thread_id`. The receiver's value is a change counter; only its
    /// change matters.
    pub fn subscribe(&self, thread_id: Uuid) -> watch::Receiver<u64> {
        let mut threads = self.threads.lock().expect("hub lock");
        if threads.len() > 1024 {
            threads.retain(|_, tx| tx.receiver_count() > 0);
        }
        threads.entry(thread_id).or_insert_with(|| watch::channel(0).0).subscribe()
    }

    fn wake(&self, thread_id: Uuid) {
        if let Some(tx) = self.threads.lock().expect("hub lock").get(&thread_id) {
            tx.send_modify(|n| *n += 1);
        }
    }

    fn wake_all(&self) {
        for tx in self.threads.lock().expect("hub lock").values() {
            tx.send_modify(|n| *n += 1);
        }
    }

    /// Number of threads with at least one subscriber.
    pub fn watched_threads(&self) -> usize {
        self.threads.lock().expect("hub lock").values().filter(|tx| tx.receiver_count() > 0).count()
    }

    /// Runs the listener loop until `shutdown` fires.
    pub async fn run(self: std::sync::Arc<Self>, database_url: String, shutdown: CancellationToken) {
        let mut rx = listener::spawn(database_url, "agentloop-api-listener", vec![THREADS_CHANNEL], Duration::from_secs(5), shutdown.clone());
        while let Some(event) = rx.recv().await {
            match event {
                ListenerEvent::Notification { payload, .. } => {
                    if let Some(id) = payload.split_once(':').and_then(|(id, _)| Uuid::parse_str(id).ok()) {
                        self.wake(id);
                    }
                }
                ListenerEvent::Resync => self.wake_all(),
            }
        }
    }
}
