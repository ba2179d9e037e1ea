//! Fan-out of journal events to every SSE/long-poll client of this process (SPEC §10).
//!
//! The process holds ONE listener connection (outside the pool). A notification on
//! `agentloop_threads` carries one or more `<thread_id>:<sequence>` entries separated by commas
//! (e.g. `uuid1:17,uuid2:4`); each bumps that thread's watch channel. A listener reconnect (or
//! coalesced overflow, or a payload that cannot be parsed) is a *resync*: it advances the hub's
//! generation and bumps every channel, so every client re-reads from its own cursor and no event
//! is lost. Events always come from the journal table, never from the notification: the
//! notification only says "something newer than N exists".
//!
//! Reads are shared per thread: clients of one thread take the thread's lock in turn; the first
//! one after a wake-up reads the journal once and caches the events, the others are served from
//! the cache. One new event therefore costs one journal read per thread, not one per client.
//!
//! Memory is bounded by configuration, never by clients (issue 10 point 1): a journal read
//! takes at most [`BATCH`] events and [`BATCH_BYTES`] of payload (at least one event); an event
//! whose payload is larger than `LIVE_EVENT_MAX_BYTES` is slimmed before it is cached or served
//! ([`slim`]: long strings cut, other large members left out and named in `omitted`, with
//! `truncated: true` — the client re-reads the row); each thread's cache holds at most
//! `HUB_THREAD_CACHE_BYTES` and all caches together `HUB_CACHE_BYTES` (beyond it, caches of
//! unwatched threads are dropped first, then others); a feed nobody watches is freed by the
//! sweep every [`SWEEP_INTERVAL`].
//!
//! Freshness is a generation count, not a flag: a reader records the hub's generation before it
//! reads and marks the feed synced only up to that generation; the cache is trusted only while
//! the feed's synced generation equals the current one. A resync that lands while a read is in
//! flight (the read may have started before the events the resync stands for) therefore leaves
//! the feed needing another read instead of being swallowed by the read's end.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentloop_shared::db::PgPool;
use agentloop_shared::events::{THREADS_CHANNEL, ThreadEvent};
use agentloop_shared::scheduler::listener::{self, ListenerEvent};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::routes::updates::{BATCH, Batch, next_batch};

/// Most payload bytes of one journal read, and of one batch served to a client (at least one
/// event either way).
pub const BATCH_BYTES: usize = 1024 * 1024;

/// How often feeds nobody watches are freed.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Memory bounds of the hub (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct HubBounds {
    /// All caches together, bytes.
    pub total_bytes: usize,
    /// One thread's cache, bytes.
    pub thread_bytes: usize,
    /// Largest payload served whole, bytes.
    pub event_bytes: usize,
}

impl Default for HubBounds {
    fn default() -> Self {
        Self { total_bytes: 16 * 1024 * 1024, thread_bytes: 512 * 1024, event_bytes: 64 * 1024 }
    }
}

/// The approximate size of an event in memory (its payload as JSON text plus a fixed part).
pub fn event_bytes(event: &ThreadEvent) -> usize {
    json_len(&event.payload) + event.kind.len() + 96
}

fn json_len(value: &serde_json::Value) -> usize {
    struct Counter(usize);
    impl std::io::Write for Counter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counter = Counter(0);
    let _ = serde_json::to_writer(&mut counter, value);
    counter.0
}

/// `payload` as served live when its JSON is larger than `max` bytes: members larger than
/// `max / 8` are cut (strings: their head, then `…[N bytes omitted]`) or left out (anything
/// else), named in `omitted`, and the payload gets `truncated: true`. Ids and small fields stay,
/// so the client knows what to re-read (`GET /api/threads/{id}`, a messages page). A payload
/// that is not an object becomes `{truncated: true}`.
pub fn slim(payload: &mut serde_json::Value, max: usize) {
    if payload.get("truncated") == Some(&serde_json::Value::Bool(true)) || json_len(payload) <= max {
        return; // already slimmed (in PostgreSQL by `read_journal`), or small
    }
    let member_max = (max / 8).max(256);
    let Some(members) = payload.as_object_mut() else {
        *payload = serde_json::json!({"truncated": true});
        return;
    };
    let mut omitted = Vec::new();
    let names: Vec<String> = members.keys().cloned().collect();
    for name in names {
        let size = json_len(&members[&name]);
        if size <= member_max {
            continue;
        }
        match &members[&name] {
            serde_json::Value::String(text) => {
                let cut = text.floor_char_boundary(member_max);
                let value = format!("{}\n…[{} bytes omitted]", &text[..cut], text.len() - cut);
                members.insert(name.clone(), serde_json::Value::String(value));
            }
            _ => {
                members.remove(&name);
            }
        }
        omitted.push(serde_json::Value::String(name));
    }
    members.insert("truncated".into(), true.into());
    members.insert("omitted".into(), omitted.into());
}

/// Reads at most `limit` events of `thread_id` after `after`, in order, whose payloads add up
/// to at most `max_bytes` (always at least one), each payload slimmed in PostgreSQL to about
/// `event_max` bytes (`agentloop_slim_event`, the rule of [`slim`]): the sizes are summed
/// there too, so neither large payloads nor rows beyond the budget reach this process.
pub async fn read_journal(
    conn: &mut diesel_async::AsyncPgConnection,
    thread_id: Uuid,
    after: i64,
    limit: i64,
    max_bytes: usize,
    event_max: usize,
) -> diesel::QueryResult<Vec<ThreadEvent>> {
    use diesel::sql_types::{BigInt, Jsonb, Text, Timestamptz};
    use diesel_async::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = BigInt)]
        sequence: i64,
        #[diesel(sql_type = Text)]
        kind: String,
        #[diesel(sql_type = Jsonb)]
        payload: serde_json::Value,
        #[diesel(sql_type = Timestamptz)]
        created_at: chrono::DateTime<chrono::Utc>,
    }
    let rows: Vec<Row> = diesel::sql_query(
        "SELECT sequence, kind, payload, created_at FROM (
             SELECT sequence, kind, payload, created_at, size,
                    sum(size) OVER (ORDER BY sequence) - size AS before
               FROM (SELECT sequence, kind, payload, created_at, octet_length(payload::text) AS size
                       FROM (SELECT sequence, kind, agentloop_slim_event(payload, $5) AS payload, created_at
                               FROM thread_events WHERE thread_id = $1 AND sequence > $2
                              ORDER BY sequence LIMIT $3) r) e) w
          WHERE before = 0 OR before + size <= $4
          ORDER BY sequence",
    )
    .bind::<diesel::sql_types::Uuid, _>(thread_id)
    .bind::<BigInt, _>(after)
    .bind::<BigInt, _>(limit)
    .bind::<BigInt, _>(max_bytes as i64)
    .bind::<diesel::sql_types::Integer, _>(i32::try_from(event_max).unwrap_or(i32::MAX))
    .load(conn)
    .await?;
    // `before + size <= max` keeps a prefix: sizes are positive, so once a row exceeds the
    // budget every later one does too.
    Ok(rows
        .into_iter()
        .map(|r| ThreadEvent { thread_id, sequence: r.sequence, kind: r.kind, payload: r.payload, created_at: r.created_at })
        .collect())
}

/// One thread's wake-up channel and shared read cache.
pub struct ThreadFeed {
    wake: watch::Sender<u64>,
    /// Highest journal sequence announced by a notification or read from the database.
    known: AtomicI64,
    /// The hub generation the last completed journal read started at (0: never read). The
    /// feed's `known` and cache are trusted only while this equals the hub's generation.
    synced: AtomicU64,
    /// Contiguous recent events (ascending sequences, already slimmed), filled by whoever read
    /// the journal, with their total size.
    cache: tokio::sync::Mutex<Cache>,
}

struct Cache {
    events: VecDeque<(ThreadEvent, usize)>,
    bytes: usize,
    /// The hub's total, kept exact: a cache gives its bytes back when cleared or dropped.
    total: Arc<AtomicUsize>,
}

impl Cache {
    fn new(total: Arc<AtomicUsize>) -> Self {
        Self { events: VecDeque::new(), bytes: 0, total }
    }

    fn push(&mut self, event: ThreadEvent) {
        let size = event_bytes(&event);
        self.events.push_back((event, size));
        self.bytes += size;
        self.total.fetch_add(size, Ordering::AcqRel);
    }

    fn pop_front(&mut self) -> bool {
        match self.events.pop_front() {
            Some((_, size)) => {
                self.bytes -= size;
                self.total.fetch_sub(size, Ordering::AcqRel);
                true
            }
            None => false,
        }
    }

    fn clear(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::AcqRel);
        self.bytes = 0;
        self.events = VecDeque::new();
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// The hub generation a journal read started at; see [`Hub::next_batch`].
#[derive(Debug, Clone, Copy)]
struct ReadTicket(u64);

/// Per-thread feeds and the resync generation.
pub struct Hub {
    threads: Mutex<HashMap<Uuid, Arc<ThreadFeed>>>,
    /// Advanced by every resync; starts at 1 so a new feed (synced 0) is read first.
    generation: AtomicU64,
    bounds: HubBounds,
    /// Bytes of every feed's cache together.
    cached: Arc<AtomicUsize>,
}

impl Default for Hub {
    fn default() -> Self {
        Self::new(HubBounds::default())
    }
}

impl Hub {
    /// A hub with these memory bounds.
    pub fn new(bounds: HubBounds) -> Self {
        Self { threads: Mutex::new(HashMap::new()), generation: AtomicU64::new(1), bounds, cached: Arc::new(AtomicUsize::new(0)) }
    }

    fn feed(&self, thread_id: Uuid) -> Arc<ThreadFeed> {
        let mut threads = self.threads.lock().expect("hub lock");
        threads
            .entry(thread_id)
            .or_insert_with(|| {
                Arc::new(ThreadFeed {
                    wake: watch::channel(0).0,
                    known: AtomicI64::new(0),
                    synced: AtomicU64::new(0),
                    cache: tokio::sync::Mutex::new(Cache::new(self.cached.clone())),
                })
            })
            .clone()
    }

    /// Largest payload served whole (`LIVE_EVENT_MAX_BYTES`).
    pub fn event_bound(&self) -> usize {
        self.bounds.event_bytes
    }

    /// Bytes cached by all feeds.
    pub fn cached_bytes(&self) -> usize {
        self.cached.load(Ordering::Acquire)
    }

    /// Number of feeds (threads with a cache or a subscriber).
    pub fn feeds(&self) -> usize {
        self.threads.lock().expect("hub lock").len()
    }

    /// Frees feeds nobody subscribes to (their caches too). Returns how many were freed.
    /// A feed's cache is freed with the feed's last reference (a reader still holding it
    /// frees it when it finishes).
    pub fn free_idle(&self) -> usize {
        let mut threads = self.threads.lock().expect("hub lock");
        let before = threads.len();
        threads.retain(|_, f| f.wake.receiver_count() > 0);
        if threads.capacity() > 64 && threads.capacity() > threads.len() * 4 {
            threads.shrink_to_fit();
        }
        before - threads.len()
    }

    /// Frees idle feeds every [`SWEEP_INTERVAL`] until `shutdown`.
    pub async fn sweep(self: Arc<Self>, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(SWEEP_INTERVAL);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            self.free_idle();
            metrics::gauge!("agentloop_hub_cached_bytes").set(self.cached_bytes() as f64);
        }
    }

    /// Adds `events` (slimmed, contiguous after the cache's last) to `cache`, then enforces the
    /// per-thread and total bounds.
    fn fill(&self, own: &ThreadFeed, cache: &mut Cache, events: &[ThreadEvent]) {
        let Some(first) = events.first() else { return };
        let contiguous = cache.events.back().is_some_and(|(b, _)| b.sequence + 1 == first.sequence);
        let covered = cache.events.back().is_some_and(|(b, _)| b.sequence >= first.sequence);
        if !contiguous && !covered {
            cache.clear();
        }
        for e in events {
            if cache.events.back().is_none_or(|(b, _)| e.sequence == b.sequence + 1) {
                cache.push(e.clone());
            }
        }
        while cache.bytes > self.bounds.thread_bytes && cache.pop_front() {}
        if self.cached_bytes() > self.bounds.total_bytes {
            self.evict(own);
        }
    }

    /// Drops other feeds' caches until the total is within bounds: unwatched threads first.
    fn evict(&self, own: &ThreadFeed) {
        let feeds: Vec<Arc<ThreadFeed>> = self.threads.lock().expect("hub lock").values().cloned().collect();
        let (idle, watched): (Vec<_>, Vec<_>) = feeds.into_iter().partition(|f| f.wake.receiver_count() == 0);
        for feed in idle.into_iter().chain(watched) {
            if self.cached_bytes() <= self.bounds.total_bytes {
                return;
            }
            if std::ptr::eq(Arc::as_ptr(&feed), own) {
                continue;
            }
            if let Ok(mut cache) = feed.cache.try_lock() {
                cache.clear();
            }
        }
    }

    /// Subscribes to wake-ups of `thread_id`. Only the receiver's changes matter.
    pub fn subscribe(&self, thread_id: Uuid) -> watch::Receiver<u64> {
        self.feed(thread_id).wake.subscribe()
    }

    /// The next batch for a client of `thread_id` at `cursor`: served from the shared cache when
    /// the feed is synced with the current generation and the cache covers everything known,
    /// else read from the journal (once for all waiting clients). Errors are database errors,
    /// as text.
    pub async fn next_batch(&self, pool: &PgPool, thread_id: Uuid, cursor: i64) -> Result<Batch, String> {
        let feed = self.feed(thread_id);
        let mut cache = feed.cache.lock().await;
        let known = feed.known.load(Ordering::Acquire);
        if self.is_synced(&feed) && cursor <= known {
            let first = cache.events.front().map(|(e, _)| e.sequence);
            let last = cache.events.back().map(|(e, _)| e.sequence);
            if cursor == known {
                return Ok(Batch::Events(Vec::new()));
            }
            if let (Some(first), Some(last)) = (first, last)
                && first <= cursor + 1
                && last >= known
            {
                let mut budget = 0usize;
                let events = cache
                    .events
                    .iter()
                    .filter(|(e, _)| e.sequence > cursor)
                    .take(BATCH as usize)
                    .take_while(|(_, size)| {
                        let fits = budget == 0 || budget + size <= BATCH_BYTES;
                        budget += size;
                        fits
                    })
                    .map(|(e, _)| e.clone())
                    .collect();
                return Ok(Batch::Events(events));
            }
        }
        // A client behind everything the cache holds (a slow reader catching up) reads on its
        // own, without the lock: its read serves nobody else, and holding the lock through it
        // made every reader of the thread wait behind each laggard (acceptance probe: 100
        // clients that never read delayed a healthy reader's events by 39 s).
        if self.is_synced(&feed) && cursor < known && cache.events.front().is_some_and(|(e, _)| e.sequence > cursor.saturating_add(1)) {
            drop(cache);
            return self.read_batch(pool, thread_id, cursor).await.map(|(_, batch)| batch);
        }
        // The ticket is taken before the first statement: whatever a resync after this point
        // stands for may be missing from what is read, so it must not count as seen.
        let ticket = self.begin_read();
        let (current, batch) = self.read_batch(pool, thread_id, cursor).await?;
        feed.known.fetch_max(current, Ordering::AcqRel);
        self.finish_read(&feed, ticket);
        if let Batch::Events(events) = &batch {
            self.fill(&feed, &mut cache, events);
        }
        Ok(batch)
    }

    /// Reads the journal of `thread_id` after `cursor`: (the thread's event position, the batch
    /// with payloads slimmed). Errors are database errors, as text.
    async fn read_batch(&self, pool: &PgPool, thread_id: Uuid, cursor: i64) -> Result<(i64, Batch), String> {
        let mut conn = pool.get().await.map_err(|e| e.to_string())?;
        let current = agentloop_shared::threads::event_position(&mut conn, thread_id).await.map_err(|e| e.to_string())?;
        let mut batch = next_batch(&mut conn, thread_id, cursor, current, self.bounds.event_bytes).await.map_err(|e| e.to_string())?;
        if let Batch::Events(events) = &mut batch {
            for e in events.iter_mut() {
                slim(&mut e.payload, self.bounds.event_bytes);
            }
        }
        Ok((current, batch))
    }

    /// Records the generation a journal read starts at.
    fn begin_read(&self) -> ReadTicket {
        ReadTicket(self.generation.load(Ordering::Acquire))
    }

    /// Marks `feed` synced up to the generation its finished read started at (never backwards:
    /// an older read finishing after a newer one changes nothing).
    fn finish_read(&self, feed: &ThreadFeed, ticket: ReadTicket) {
        feed.synced.fetch_max(ticket.0, Ordering::AcqRel);
    }

    /// Whether `feed`'s cache and `known` reflect every resync so far.
    fn is_synced(&self, feed: &ThreadFeed) -> bool {
        feed.synced.load(Ordering::Acquire) == self.generation.load(Ordering::Acquire)
    }

    fn wake(&self, thread_id: Uuid, sequence: i64) {
        let feed = self.threads.lock().expect("hub lock").get(&thread_id).cloned();
        if let Some(feed) = feed {
            feed.known.fetch_max(sequence, Ordering::AcqRel);
            feed.wake.send_modify(|n| *n += 1);
        }
    }

    /// A resync: advances the generation (first, so a woken reader sees it), then wakes every
    /// feed's clients.
    fn wake_all(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        let feeds: Vec<Arc<ThreadFeed>> = self.threads.lock().expect("hub lock").values().cloned().collect();
        for feed in feeds {
            feed.wake.send_modify(|n| *n += 1);
        }
    }

    /// Number of threads with at least one subscriber.
    pub fn watched_threads(&self) -> usize {
        self.threads.lock().expect("hub lock").values().filter(|f| f.wake.receiver_count() > 0).count()
    }

    /// Applies one notification payload of `agentloop_threads`; an unparseable one is a resync.
    fn apply(&self, payload: &str) {
        match parse_payload(payload) {
            Some(entries) => {
                for (thread_id, sequence) in entries {
                    self.wake(thread_id, sequence);
                }
            }
            None => {
                tracing::warn!(payload_bytes = payload.len(), "unparseable journal notification; resyncing every feed");
                self.wake_all();
            }
        }
    }

    /// Runs the listener loop until `shutdown` fires. `database_url` is the listener's own
    /// connection URL.
    pub async fn run(self: Arc<Self>, database_url: String, shutdown: CancellationToken) {
        let mut rx = listener::spawn(database_url, "agentloop-api-listener", vec![THREADS_CHANNEL], Duration::from_secs(5), shutdown.clone());
        while let Some(event) = rx.recv().await {
            match event {
                ListenerEvent::Notification { payload, .. } => self.apply(&payload),
                ListenerEvent::Resync => self.wake_all(),
            }
        }
    }
}

/// Parses a notification payload of `agentloop_threads`: one or more `<thread_id>:<sequence>`
/// entries separated by commas (`uuid1:17,uuid2:4`; whitespace around an entry is ignored; the
/// single-entry form is the one-element case). `None` when any entry is malformed (the caller
/// then resyncs, since it cannot tell which thread moved).
pub fn parse_payload(payload: &str) -> Option<Vec<(Uuid, i64)>> {
    payload
        .split(',')
        .map(|entry| {
            let (id, sequence) = entry.trim().split_once(':')?;
            Some((Uuid::parse_str(id.trim()).ok()?, sequence.trim().parse::<i64>().ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_with_one_or_several_entries_parse() {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        assert_eq!(parse_payload(&format!("{a}:17")), Some(vec![(a, 17)]));
        assert_eq!(parse_payload(&format!("{a}:17,{b}:4")), Some(vec![(a, 17), (b, 4)]));
        assert_eq!(parse_payload(&format!(" {a}:1 , {b}:2 ,{a}:3")), Some(vec![(a, 1), (b, 2), (a, 3)]));
        assert_eq!(parse_payload(&a.to_string()), None, "no sequence");
        for bad in ["", ",", "x:1", &format!("{a}:"), &format!("{a}:x"), &format!("{a}:1,"), &format!("{a}:1,{b}"), &format!("{a}:1:2")] {
            assert_eq!(parse_payload(bad), None, "{bad:?}");
        }
    }

    /// Every entry of a batched notification wakes its own thread and raises its `known`; a
    /// malformed payload resyncs every feed.
    #[test]
    fn a_batched_notification_wakes_each_thread_it_names() {
        let hub = Hub::default();
        let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let (mut wa, mut wb, wc) = (hub.subscribe(a), hub.subscribe(b), hub.subscribe(c));
        let ticket = hub.begin_read();
        for id in [a, b, c] {
            hub.finish_read(&hub.feed(id), ticket);
        }
        hub.apply(&format!("{a}:17,{b}:4"));
        assert!(wa.has_changed().unwrap() && wb.has_changed().unwrap());
        assert!(!wc.has_changed().unwrap(), "an unnamed thread is not woken");
        assert_eq!(hub.feed(a).known.load(Ordering::Acquire), 17);
        assert_eq!(hub.feed(b).known.load(Ordering::Acquire), 4);
        assert!(hub.is_synced(&hub.feed(a)), "a notification is not a resync");
        wa.borrow_and_update();
        wb.borrow_and_update();
        hub.apply("garbage");
        assert!(wa.has_changed().unwrap() && wb.has_changed().unwrap() && wc.has_changed().unwrap());
        assert!(!hub.is_synced(&hub.feed(c)));
    }

    /// A resync that lands between the start and the end of a journal read must leave the feed
    /// needing another read: the read may have missed what the resync announces.
    #[test]
    fn a_resync_during_a_read_is_not_swallowed() {
        let hub = Hub::default();
        let id = Uuid::new_v4();
        let mut wake = hub.subscribe(id);
        let feed = hub.feed(id);
        assert!(!hub.is_synced(&feed), "a new feed must be read first");

        let ticket = hub.begin_read();
        hub.wake_all();
        hub.finish_read(&feed, ticket);
        assert!(!hub.is_synced(&feed), "the resync during the read was swallowed");
        assert!(wake.has_changed().unwrap(), "subscribers are woken to re-read");
        wake.borrow_and_update();

        // A read that starts after the resync syncs the feed, until the next resync.
        let ticket = hub.begin_read();
        hub.finish_read(&feed, ticket);
        assert!(hub.is_synced(&feed));
        hub.wake_all();
        assert!(!hub.is_synced(&feed));
        assert!(wake.has_changed().unwrap());

        // Two overlapping reads: the older one finishing last cannot mark a newer resync seen.
        let older = hub.begin_read();
        hub.wake_all();
        let newer = hub.begin_read();
        hub.finish_read(&feed, newer);
        assert!(hub.is_synced(&feed));
        hub.finish_read(&feed, older);
        assert!(hub.is_synced(&feed), "an older read finishing late does not un-sync the feed");
        hub.wake_all();
        hub.finish_read(&feed, older);
        assert!(!hub.is_synced(&feed));
    }
}
