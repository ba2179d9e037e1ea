//! Per-principal and per-address limits of one api process (issue 10 point 4), and the registry
//! of open live-update connections (and `/v1` requests waiting for their run) that makes a
//! revoked key's streams end within seconds (point 2).
//!
//! | limit | scope | refusal |
//! |---|---|---|
//! | requests per principal (`API_RATE_PER_SECOND`, burst `API_RATE_BURST`) | this process | 429 `rate_limited` |
//! | failed authentications per source address (`AUTH_FAILURES_PER_MINUTE`) | this process | 429 `too_many_failed_auth` |
//! | open SSE/long-poll connections per principal (`LIVE_MAX_PER_PRINCIPAL`) and in all (`LIVE_MAX_CONNECTIONS`) | this process | 429 `too_many_live_connections` |
//! | searches and exports running at once per principal (`HEAVY_READS_PER_PRINCIPAL`; the next waits up to 10 s) | this process | 429 `too_many_heavy_reads` |
//! | active runs, queued turns, threads per principal | global (counted in PostgreSQL, `migrations/…000006_hostile_clients`) | 429 `too_many_active_runs` / `too_many_queued_turns` / `too_many_threads` |
//!
//! Rate limits use `governor` (GCRA, keyed); a source address is keyed by itself for IPv4 and
//! by its /64 for IPv6 (one subscriber's block). Every refusal counts in
//! `agentloop_limit_refusals_total{limit}` and carries `Retry-After`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::error::ApiError;

/// Semaphores of `capacity` permits each, one per key, made when a key first asks and removed
/// when its last permit is given back and nobody waits for one — so the map holds only keys
/// with something in flight, however many keys clients invent. Used for the per-principal
/// shares of the body budget, the anonymous bodies per source address
/// (`crate::budget`) and the heavy reads per principal ([`Limits::heavy_read`]).
pub struct KeyedSemaphores<K: Eq + std::hash::Hash + Copy> {
    capacity: usize,
    map: std::sync::Arc<Mutex<HashMap<K, std::sync::Arc<tokio::sync::Semaphore>>>>,
}

/// Permits of one key of a [`KeyedSemaphores`]; given back (and the key forgotten when idle)
/// when dropped.
pub struct KeyedPermit<K: Eq + std::hash::Hash + Copy> {
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    map: std::sync::Arc<Mutex<HashMap<K, std::sync::Arc<tokio::sync::Semaphore>>>>,
    key: K,
}

impl<K: Eq + std::hash::Hash + Copy> KeyedSemaphores<K> {
    /// Every key gets `capacity` permits (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self { capacity: capacity.clamp(1, tokio::sync::Semaphore::MAX_PERMITS), map: std::sync::Arc::default() }
    }

    /// Permits each key has.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn semaphore(&self, key: K) -> std::sync::Arc<tokio::sync::Semaphore> {
        let capacity = self.capacity;
        self.map.lock().expect("keyed semaphores lock").entry(key).or_insert_with(|| std::sync::Arc::new(tokio::sync::Semaphore::new(capacity))).clone()
    }

    /// `n` permits of `key` (clamped to 1..=capacity), waiting until `deadline`; `None` when
    /// none came in time.
    pub async fn acquire_until(&self, key: K, n: usize, deadline: tokio::time::Instant) -> Option<KeyedPermit<K>> {
        let semaphore = self.semaphore(key);
        let n = n.clamp(1, self.capacity).min(u32::MAX as usize) as u32;
        let acquired = tokio::time::timeout_at(deadline, semaphore.clone().acquire_many_owned(n)).await;
        drop(semaphore);
        match acquired {
            Ok(Ok(permit)) => Some(KeyedPermit { permit: Some(permit), map: self.map.clone(), key }),
            // The semaphores are never closed; a timeout is the only way here.
            _ => {
                forget_idle(&self.map, key);
                None
            }
        }
    }

    /// One permit of `key` now, or `None` without waiting.
    pub fn try_acquire(&self, key: K) -> Option<KeyedPermit<K>> {
        let semaphore = self.semaphore(key);
        let acquired = semaphore.clone().try_acquire_owned();
        drop(semaphore);
        match acquired {
            Ok(permit) => Some(KeyedPermit { permit: Some(permit), map: self.map.clone(), key }),
            Err(_) => {
                forget_idle(&self.map, key);
                None
            }
        }
    }

    /// Keys with permits held or awaited now.
    pub fn keys_in_use(&self) -> usize {
        self.map.lock().expect("keyed semaphores lock").len()
    }
}

impl<K: Eq + std::hash::Hash + Copy> Drop for KeyedPermit<K> {
    fn drop(&mut self) {
        drop(self.permit.take());
        forget_idle(&self.map, self.key);
    }
}

/// Removes `key`'s semaphore when nobody holds or waits for it (only the map refers to it).
fn forget_idle<K: Eq + std::hash::Hash>(map: &Mutex<HashMap<K, std::sync::Arc<tokio::sync::Semaphore>>>, key: K) {
    let mut map = map.lock().expect("keyed semaphores lock");
    if map.get(&key).is_some_and(|s| std::sync::Arc::strong_count(s) == 1) {
        map.remove(&key);
    }
}

/// Configured bounds (see `ApiConfig`).
#[derive(Debug, Clone)]
pub struct LimitSettings {
    /// Sustained requests per second per principal.
    pub rate_per_second: u32,
    /// Requests a principal may send at once above the sustained rate.
    pub rate_burst: u32,
    /// Failed authentications per minute per source address before it is refused.
    pub auth_failures_per_minute: u32,
    /// Open live-update connections per principal.
    pub live_per_principal: usize,
    /// Open live-update connections of this process in all.
    pub live_total: usize,
    /// Heavy reads (search, export) of one principal running at once.
    pub heavy_reads_per_principal: usize,
}

/// Longest wait of a heavy read for its principal's turn before 429 `too_many_heavy_reads`.
pub const HEAVY_READ_WAIT: Duration = Duration::from_secs(10);

/// The limiters of one process.
pub struct Limits {
    settings: LimitSettings,
    requests: DefaultKeyedRateLimiter<Uuid>,
    failures: DefaultKeyedRateLimiter<IpAddr>,
    /// Addresses over their failed-authentication budget, until when.
    blocked: Mutex<HashMap<IpAddr, Instant>>,
    live: Mutex<LiveTable>,
    next_live: AtomicU64,
    /// Each principal's heavy-read permits while it has heavy reads running or waiting.
    heavy: KeyedSemaphores<Uuid>,
}

#[derive(Default)]
struct LiveTable {
    per_principal: HashMap<Uuid, usize>,
    connections: HashMap<u64, LiveEntry>,
    /// Other long requests ended on revocation, not counted against the live bounds
    /// ([`Limits::watch`]).
    watched: HashMap<u64, LiveEntry>,
}

struct LiveEntry {
    credential: Option<Credential>,
    cancel: CancellationToken,
}

/// What authenticated a request: a key, a session (made from a key), or nothing (the
/// development loopback principal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Credential {
    Key(Uuid),
    Session(Uuid),
}

fn nonzero(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n.max(1)).expect("max(1) is non-zero")
}

/// The key of a source address: IPv4 as is, IPv6 by its /64.
fn address_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
        v4 => v4,
    }
}

/// Counts a refusal of `limit` in `agentloop_limit_refusals_total`.
pub fn count_refusal(limit: &'static str) {
    metrics::counter!("agentloop_limit_refusals_total", "limit" => limit).increment(1);
}

fn too_many(code: &'static str, limit: &'static str, retry_after: Duration, message: String) -> ApiError {
    count_refusal(limit);
    ApiError::TooManyRequests { code, message, retry_after_s: retry_after.as_secs_f64().ceil().max(1.0) as u64 }
}

impl Limits {
    /// Limiters for `settings`.
    pub fn new(settings: LimitSettings) -> Self {
        let requests = governor::RateLimiter::keyed(
            Quota::per_second(nonzero(settings.rate_per_second)).allow_burst(nonzero(settings.rate_burst)),
        );
        // The failure that finds the budget empty blocks the address, so a burst of N - 1 cells
        // answers exactly N failures with 401 before the address gets 429.
        let per_minute = nonzero(settings.auth_failures_per_minute);
        let burst = nonzero(settings.auth_failures_per_minute.saturating_sub(1));
        let failures = governor::RateLimiter::keyed(Quota::per_minute(per_minute).allow_burst(burst));
        let heavy = KeyedSemaphores::new(settings.heavy_reads_per_principal);
        Self {
            settings,
            requests,
            failures,
            blocked: Mutex::default(),
            live: Mutex::default(),
            next_live: AtomicU64::new(1),
            heavy,
        }
    }

    /// Waits (at most [`HEAVY_READ_WAIT`]) for one of `principal`'s heavy-read permits
    /// (`HEAVY_READS_PER_PRINCIPAL`): a search or an export holds a database connection for as
    /// long as the caller's own data makes it last, so one principal's many at once held every
    /// connection of the api's pool and stalled the other principals' reads for seconds
    /// (acceptance probe H: 12 concurrent searches, others' reads from 11 ms to 8 s). Error: 429
    /// `too_many_heavy_reads`.
    pub async fn heavy_read(&self, principal: Uuid) -> Result<HeavyRead, ApiError> {
        self.heavy_read_within(principal, HEAVY_READ_WAIT).await
    }

    async fn heavy_read_within(&self, principal: Uuid, wait: Duration) -> Result<HeavyRead, ApiError> {
        match self.heavy.acquire_until(principal, 1, tokio::time::Instant::now() + wait).await {
            Some(permit) => Ok(HeavyRead { _permit: permit }),
            None => Err(too_many(
                "too_many_heavy_reads",
                "heavy_reads",
                Duration::from_secs(1),
                format!("at most {} searches or exports of one principal run at once; retry when one has answered", self.heavy.capacity()),
            )),
        }
    }

    /// The configured bounds.
    pub fn settings(&self) -> &LimitSettings {
        &self.settings
    }

    /// Takes one request of `principal`'s budget. Error: 429 `rate_limited`.
    pub fn check_request(&self, principal: Uuid) -> Result<(), ApiError> {
        self.requests.check_key(&principal).map_err(|not_until| {
            let wait = not_until.wait_time_from(DefaultClock::default().now());
            too_many(
                "rate_limited",
                "request_rate",
                wait,
                format!(
                    "more than {} requests per second (burst {}) for this principal; retry later",
                    self.settings.rate_per_second, self.settings.rate_burst
                ),
            )
        })
    }

    /// Refuses a source address that used up its failed-authentication budget, until the
    /// budget allows one more. Error: 429 `too_many_failed_auth`.
    pub fn check_address(&self, ip: IpAddr) -> Result<(), ApiError> {
        let key = address_key(ip);
        let mut blocked = self.blocked.lock().expect("limits lock");
        match blocked.get(&key) {
            Some(until) if *until > Instant::now() => {
                let wait = *until - Instant::now();
                Err(too_many(
                    "too_many_failed_auth",
                    "failed_auth",
                    wait,
                    format!(
                        "more than {} failed authentications per minute from this address; retry later",
                        self.settings.auth_failures_per_minute
                    ),
                ))
            }
            Some(_) => {
                blocked.remove(&key);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Records a failed authentication from `ip`; when that exhausts its budget the address is
    /// refused by [`Limits::check_address`] until the budget allows one more.
    pub fn record_failure(&self, ip: IpAddr) {
        let key = address_key(ip);
        metrics::counter!("agentloop_auth_failures_total").increment(1);
        if let Err(not_until) = self.failures.check_key(&key) {
            let wait = not_until.wait_time_from(DefaultClock::default().now());
            let mut blocked = self.blocked.lock().expect("limits lock");
            if blocked.len() > 100_000 {
                let now = Instant::now();
                blocked.retain(|_, until| *until > now);
            }
            blocked.insert(key, Instant::now() + wait.max(Duration::from_secs(1)));
        }
    }

    /// Opens a live-update connection of `principal` (authenticated by `credential`): refused
    /// beyond the per-principal or the process bound (429 `too_many_live_connections`). The
    /// guard's token is cancelled when the credential stops authenticating ([`Limits::revoke`]).
    pub fn open_live(self: &std::sync::Arc<Self>, principal: Uuid, credential: Option<Credential>) -> Result<LiveGuard, ApiError> {
        let mut table = self.live.lock().expect("limits lock");
        let mine = table.per_principal.get(&principal).copied().unwrap_or(0);
        if mine >= self.settings.live_per_principal || table.connections.len() >= self.settings.live_total {
            let message = if mine >= self.settings.live_per_principal {
                format!("at most {} open live-update connections per principal; close one first", self.settings.live_per_principal)
            } else {
                "this server holds as many live-update connections as it is configured for; retry later".to_owned()
            };
            return Err(too_many("too_many_live_connections", "live_connections", Duration::from_secs(5), message));
        }
        let id = self.next_live.fetch_add(1, Ordering::Relaxed);
        let cancel = CancellationToken::new();
        *table.per_principal.entry(principal).or_default() += 1;
        table.connections.insert(id, LiveEntry { credential, cancel: cancel.clone() });
        Ok(LiveGuard { limits: self.clone(), id, principal, cancel, counted: true })
    }

    /// Registers a long request of `principal` authenticated by `credential` that is not a
    /// live-update connection (a `/v1/chat/completions` request waiting for its run, streamed
    /// or not): not counted against the live bounds, but its token is cancelled like theirs when
    /// the credential stops authenticating (acceptance probe H: a revoked key's streamed
    /// completion went on for a minute).
    pub fn watch(self: &std::sync::Arc<Self>, principal: Uuid, credential: Option<Credential>) -> LiveGuard {
        let id = self.next_live.fetch_add(1, Ordering::Relaxed);
        let cancel = CancellationToken::new();
        self.live.lock().expect("limits lock").watched.insert(id, LiveEntry { credential, cancel: cancel.clone() });
        LiveGuard { limits: self.clone(), id, principal, cancel, counted: false }
    }

    /// Open live-update connections of this process.
    pub fn live_connections(&self) -> usize {
        self.live.lock().expect("limits lock").connections.len()
    }

    /// Distinct credentials of open live-update connections: `(keys, sessions)`.
    pub fn live_credentials(&self) -> (Vec<Uuid>, Vec<Uuid>) {
        let table = self.live.lock().expect("limits lock");
        let (mut keys, mut sessions) = (Vec::new(), Vec::new());
        for entry in table.connections.values().chain(table.watched.values()) {
            match entry.credential {
                Some(Credential::Key(id)) => keys.push(id),
                Some(Credential::Session(id)) => sessions.push(id),
                None => {}
            }
        }
        keys.sort_unstable();
        keys.dedup();
        sessions.sort_unstable();
        sessions.dedup();
        (keys, sessions)
    }

    /// Ends every open live-update connection authenticated by one of `dead` (key or session
    /// ids). Returns how many were ended.
    pub fn revoke(&self, dead: &[Uuid]) -> usize {
        let table = self.live.lock().expect("limits lock");
        let mut ended = 0;
        for entry in table.connections.values().chain(table.watched.values()) {
            if let Some(Credential::Key(id) | Credential::Session(id)) = entry.credential
                && dead.contains(&id)
            {
                entry.cancel.cancel();
                ended += 1;
            }
        }
        ended
    }

    /// Frees limiter state of keys that have not been seen recently (run periodically).
    pub fn sweep(&self) {
        self.requests.retain_recent();
        self.requests.shrink_to_fit();
        self.failures.retain_recent();
        self.failures.shrink_to_fit();
        let now = Instant::now();
        let mut blocked = self.blocked.lock().expect("limits lock");
        blocked.retain(|_, until| *until > now);
        blocked.shrink_to_fit();
    }
}

/// A running heavy read ([`Limits::heavy_read`]); dropping it gives its permit back.
pub struct HeavyRead {
    _permit: KeyedPermit<Uuid>,
}

/// One open live-update connection; dropping it closes it in the registry.
pub struct LiveGuard {
    limits: std::sync::Arc<Limits>,
    id: u64,
    principal: Uuid,
    cancel: CancellationToken,
    /// Counted against the live bounds (an SSE or long-poll connection), or only watched.
    counted: bool,
}

impl LiveGuard {
    /// Cancelled when the connection's credential stops authenticating.
    pub fn revoked(&self) -> CancellationToken {
        self.cancel.clone()
    }
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        let mut table = self.limits.live.lock().expect("limits lock");
        if !self.counted {
            table.watched.remove(&self.id);
            if table.watched.is_empty() {
                table.watched.shrink_to_fit();
            }
            return;
        }
        table.connections.remove(&self.id);
        if let Some(n) = table.per_principal.get_mut(&self.principal) {
            *n -= 1;
            if *n == 0 {
                table.per_principal.remove(&self.principal);
            }
        }
        if table.connections.is_empty() {
            table.connections.shrink_to_fit();
            table.per_principal.shrink_to_fit();
        }
    }
}

/// Every `interval`: ends live-update connections whose key or session no longer authenticates
/// (revoked, expired, signed out) — one query for all of them — and sweeps limiter state.
pub async fn revocation_loop(state: actix_web::web::Data<crate::AppState>, interval: Duration, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sweeps = 0u32;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        sweeps += 1;
        if sweeps.is_multiple_of(30) {
            state.limits.sweep();
        }
        let (keys, sessions) = state.limits.live_credentials();
        if keys.is_empty() && sessions.is_empty() {
            continue;
        }
        let dead = match state.pool.get().await {
            Ok(mut conn) => agentloop_shared::auth::dead_credentials(&mut conn, &keys, &sessions).await,
            Err(error) => {
                tracing::warn!(%error, "revocation check: no database connection");
                continue;
            }
        };
        match dead {
            Ok(dead) if !dead.is_empty() => {
                let ended = state.limits.revoke(&dead);
                tracing::info!(credentials = dead.len(), connections = ended, "live-update connections of revoked credentials ended");
            }
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "revocation check failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> std::sync::Arc<Limits> {
        std::sync::Arc::new(Limits::new(LimitSettings { rate_per_second: 1, rate_burst: 3, auth_failures_per_minute: 2, live_per_principal: 2, live_total: 3, heavy_reads_per_principal: 2 }))
    }

    /// One principal's heavy reads run at most `heavy_reads_per_principal` at once; the next
    /// waits for one of them, never for another principal's (acceptance probe H).
    #[tokio::test]
    async fn heavy_reads_are_bounded_per_principal() {
        let limits = limits();
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let wait = Duration::from_millis(100);
        let first = limits.heavy_read_within(b, wait).await.unwrap();
        let second = limits.heavy_read_within(b, wait).await.unwrap();
        // A's read does not wait behind B's.
        let mine = tokio::time::timeout(Duration::from_millis(20), limits.heavy_read_within(a, wait)).await.expect("A is not held up").unwrap();
        drop(mine);
        // B's third waits for one of B's own and gives up after its wait: 429.
        let refused = limits.heavy_read_within(b, wait).await.err().unwrap();
        assert_eq!(refused.code(), "too_many_heavy_reads");
        // ... or gets it when one ends.
        let third = limits.heavy_read_within(b, Duration::from_secs(5));
        let ender = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(first);
        };
        let (third, ()) = tokio::join!(third, ender);
        drop((third.unwrap(), second));
        assert_eq!(limits.heavy.keys_in_use(), 0, "idle principals are forgotten");
    }

    #[test]
    fn a_principal_gets_its_burst_then_429_with_retry_after() {
        let limits = limits();
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        for _ in 0..3 {
            limits.check_request(a).unwrap();
        }
        match limits.check_request(a) {
            Err(ApiError::TooManyRequests { code, retry_after_s, .. }) => {
                assert_eq!(code, "rate_limited");
                assert!(retry_after_s >= 1);
            }
            other => panic!("{other:?}"),
        }
        limits.check_request(b).expect("another principal has its own budget");
    }

    #[test]
    fn failed_authentications_block_the_address_and_ipv6_counts_per_64() {
        let limits = limits();
        let ip: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let neighbour: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        limits.check_address(ip).unwrap();
        limits.record_failure(ip);
        limits.check_address(ip).unwrap();
        limits.record_failure(neighbour);
        assert!(matches!(limits.check_address(neighbour), Err(ApiError::TooManyRequests { code: "too_many_failed_auth", .. })));
        limits.check_address(other).unwrap();
    }

    #[test]
    fn live_connections_are_bounded_and_revocation_cancels_only_the_dead_credential() {
        let limits = limits();
        let (p, q) = (Uuid::new_v4(), Uuid::new_v4());
        let (k1, k2) = (Uuid::new_v4(), Uuid::new_v4());
        let a = limits.open_live(p, Some(Credential::Key(k1))).unwrap();
        let b = limits.open_live(p, Some(Credential::Session(k2))).unwrap();
        assert!(limits.open_live(p, None).is_err(), "per principal");
        let c = limits.open_live(q, None).unwrap();
        assert!(limits.open_live(q, None).is_err(), "in all");
        assert_eq!(limits.live_credentials(), (vec![k1], vec![k2]));
        assert_eq!(limits.revoke(&[k1]), 1);
        assert!(a.revoked().is_cancelled() && !b.revoked().is_cancelled() && !c.revoked().is_cancelled());
        drop(a);
        drop(c);
        assert_eq!(limits.live_connections(), 1);
        limits.open_live(p, None).expect("a slot was freed");
    }
}
