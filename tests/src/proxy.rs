//! A small TCP proxy for network-fault tests: put it between a process and PostgreSQL (or any
//! TCP server) and, per connection, pass bytes through, freeze them or cut the connection.
//!
//! *Freezing* stops forwarding in both directions while both sockets stay open — to either peer
//! the connection is half-open: writes are accepted until the kernel buffers fill, nothing is
//! answered, nothing is closed. Already-forwarded bytes may still sit in kernel buffers, so a
//! freeze takes effect within a buffer's worth of data, never retroactively. *Cutting* closes
//! both sockets (each peer reads end-of-file).
//!
//! Which connections: every open one ([`Proxy::freeze_all`], [`Proxy::cut_all`]), one by id
//! ([`Proxy::freeze`], ids from [`Proxy::connections`]), or connections accepted later
//! ([`Proxy::freeze_new`] every one, [`Proxy::freeze_nth_new`] only the n-th), each frozen at a
//! [`FreezeAt`] point: at once, or when its client first sends a byte pattern (e.g. `LISTEN`,
//! to freeze a PostgreSQL listener right at its `LISTEN` statement, before the server sees it).
//! [`Proxy::pass`] unfreezes everything and drops pending rules.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use agentloop_tests::proxy::{FreezeAt, Proxy};
//! let proxy = Proxy::start("127.0.0.1:5432").await?;
//! let url = proxy.url("postgres://postgres@127.0.0.1:5432/db"); // same URL via the proxy
//! proxy.freeze_nth_new(1, FreezeAt::ClientSends(b"LISTEN ".to_vec()));
//! // ... the first new connection to send `LISTEN ` hangs half-open from then on ...
//! proxy.pass();
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// When a connection selected by a rule freezes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FreezeAt {
    /// As soon as it is accepted (before any byte is forwarded).
    Start,
    /// When its client first sends this byte sequence (matched across read boundaries); the
    /// bytes that contain it are held back, so the server never receives them.
    ClientSends(Vec<u8>),
}

/// What [`Proxy::connections`] reports about one connection.
#[derive(Debug, Clone)]
pub struct ConnStats {
    /// 1-based, in accept order.
    pub id: usize,
    /// When the proxy accepted it.
    pub accepted_at: Instant,
    /// Bytes forwarded client → server and server → client.
    pub up_bytes: u64,
    pub down_bytes: u64,
    /// Currently frozen (by a rule, [`Proxy::freeze`] or [`Proxy::freeze_all`]).
    pub frozen: bool,
    /// False once either side closed or the connection was cut.
    pub open: bool,
}

/// A rule for connections accepted after it was made.
#[derive(Debug, Clone)]
struct Rule {
    /// `None`: every new connection; `Some(n)`: only the n-th to reach the freeze point.
    nth: Option<usize>,
    /// How many connections reached the freeze point under this rule so far.
    reached: usize,
    at: FreezeAt,
    /// Connections accepted before the rule was made are not subject to it.
    after_id: usize,
}

struct Conn {
    id: usize,
    accepted_at: Instant,
    up: AtomicU64,
    down: AtomicU64,
    open: AtomicBool,
    frozen: watch::Sender<bool>,
    cut: CancellationToken,
    /// Index into `Shared::rules` of the rule waiting for this connection's client pattern.
    pending: Mutex<Option<usize>>,
}

#[derive(Default)]
struct Shared {
    conns: Mutex<HashMap<usize, Arc<Conn>>>,
    rules: Mutex<Vec<Rule>>,
    accepted: AtomicUsize,
    /// New connections are closed as soon as they are accepted (a server that is down).
    refusing: AtomicBool,
}

/// A listening proxy to one upstream address; stops (closing every connection) when dropped.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

impl Proxy {
    /// Listens on a free loopback port and forwards each accepted connection to `upstream`
    /// (`host:port`). Errors: the port cannot be bound.
    pub async fn start(upstream: &str) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await.context("binding the proxy")?;
        let addr = listener.local_addr()?;
        let (shared, stop) = (Arc::new(Shared::default()), CancellationToken::new());
        let (upstream, accept_shared, accept_stop) = (upstream.to_owned(), shared.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let client = tokio::select! {
                    _ = accept_stop.cancelled() => return,
                    accepted = listener.accept() => match accepted { Ok((s, _)) => s, Err(_) => continue },
                };
                if accept_shared.refusing.load(Ordering::Acquire) {
                    drop(client);
                    continue;
                }
                let id = accept_shared.accepted.fetch_add(1, Ordering::AcqRel) + 1;
                let conn = Arc::new(Conn {
                    id,
                    accepted_at: Instant::now(),
                    up: AtomicU64::new(0),
                    down: AtomicU64::new(0),
                    open: AtomicBool::new(true),
                    frozen: watch::channel(false).0,
                    cut: accept_stop.child_token(),
                    pending: Mutex::new(None),
                });
                accept_shared.conns.lock().unwrap().insert(id, conn.clone());
                accept_shared.on_accept(&conn);
                tokio::spawn(serve(accept_shared.clone(), conn, client, upstream.clone()));
            }
        });
        Ok(Self { addr, shared, stop })
    }

    /// The proxy's listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `url` (`scheme://[user@]host:port/...`) with its host and port replaced by the proxy's.
    pub fn url(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").expect("a URL with a scheme");
        let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
        let user = authority.rsplit_once('@').map(|(u, _)| format!("{u}@")).unwrap_or_default();
        format!("{scheme}://{user}{}/{path}", self.addr)
    }

    /// The server is down: every open connection is cut and new ones are closed at once, until
    /// [`Self::pass`].
    pub fn go_down(&self) {
        self.shared.refusing.store(true, Ordering::Release);
        self.cut_all();
    }

    /// The server is back after [`Self::go_down`]: new connections are accepted again (freezes
    /// and rules stay).
    pub fn come_up(&self) {
        self.shared.refusing.store(false, Ordering::Release);
    }

    /// Forward everything again: accepts new connections, unfreezes every connection and drops
    /// every pending rule.
    pub fn pass(&self) {
        self.shared.refusing.store(false, Ordering::Release);
        self.shared.rules.lock().unwrap().clear();
        for conn in self.shared.conns.lock().unwrap().values() {
            *conn.pending.lock().unwrap() = None;
            conn.frozen.send_replace(false);
        }
    }

    /// Freezes every open connection now (new ones still pass unless a rule says otherwise).
    pub fn freeze_all(&self) {
        for conn in self.shared.conns.lock().unwrap().values() {
            conn.frozen.send_replace(true);
        }
    }

    /// Freezes the connection `id` now; false if there is no such open connection.
    pub fn freeze(&self, id: usize) -> bool {
        let conns = self.shared.conns.lock().unwrap();
        let Some(conn) = conns.get(&id).filter(|c| c.open.load(Ordering::Acquire)) else { return false };
        conn.frozen.send_replace(true);
        true
    }

    /// Closes every open connection now.
    pub fn cut_all(&self) {
        for conn in self.shared.conns.lock().unwrap().values() {
            conn.cut.cancel();
        }
    }

    /// Every connection accepted from now on freezes at `at`.
    pub fn freeze_new(&self, at: FreezeAt) {
        self.add_rule(None, at);
    }

    /// Only the `n`-th (1-based) connection accepted from now on to reach `at` freezes there:
    /// with [`FreezeAt::Start`] the n-th accepted, with [`FreezeAt::ClientSends`] the n-th to
    /// send the pattern.
    pub fn freeze_nth_new(&self, n: usize, at: FreezeAt) {
        assert!(n >= 1, "n is 1-based");
        self.add_rule(Some(n), at);
    }

    fn add_rule(&self, nth: Option<usize>, at: FreezeAt) {
        let after_id = self.shared.accepted.load(Ordering::Acquire);
        self.shared.rules.lock().unwrap().push(Rule { nth, reached: 0, at, after_id });
    }

    /// Every connection accepted so far (open or not), in accept order.
    pub fn connections(&self) -> Vec<ConnStats> {
        let mut all: Vec<ConnStats> = self
            .shared
            .conns
            .lock()
            .unwrap()
            .values()
            .map(|c| ConnStats {
                id: c.id,
                accepted_at: c.accepted_at,
                up_bytes: c.up.load(Ordering::Acquire),
                down_bytes: c.down.load(Ordering::Acquire),
                frozen: *c.frozen.borrow(),
                open: c.open.load(Ordering::Acquire),
            })
            .collect();
        all.sort_by_key(|c| c.id);
        all
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Shared {
    /// Applies the rules to a just-accepted connection: freeze at once, or arm a pattern.
    fn on_accept(&self, conn: &Conn) {
        let mut rules = self.rules.lock().unwrap();
        for (i, rule) in rules.iter_mut().enumerate() {
            if conn.id <= rule.after_id || rule.nth.is_some_and(|n| rule.reached >= n) {
                continue;
            }
            match &rule.at {
                FreezeAt::Start => {
                    rule.reached += 1;
                    if rule.nth.is_none_or(|n| rule.reached == n) {
                        conn.frozen.send_replace(true);
                    }
                }
                FreezeAt::ClientSends(_) => {
                    conn.pending.lock().unwrap().get_or_insert(i);
                }
            }
        }
    }

    /// The armed pattern of `conn`, if any.
    fn pattern(&self, conn: &Conn) -> Option<Vec<u8>> {
        let i = (*conn.pending.lock().unwrap())?;
        match &self.rules.lock().unwrap().get(i)?.at {
            FreezeAt::ClientSends(p) => Some(p.clone()),
            FreezeAt::Start => None,
        }
    }

    /// `conn`'s client sent the armed pattern: freeze it if its rule selects it.
    fn reached_pattern(&self, conn: &Conn) {
        let Some(i) = conn.pending.lock().unwrap().take() else { return };
        let mut rules = self.rules.lock().unwrap();
        let Some(rule) = rules.get_mut(i) else { return };
        if rule.nth.is_some_and(|n| rule.reached >= n) {
            return;
        }
        rule.reached += 1;
        if rule.nth.is_none_or(|n| rule.reached == n) {
            conn.frozen.send_replace(true);
        }
    }
}

async fn serve(shared: Arc<Shared>, conn: Arc<Conn>, client: TcpStream, upstream: String) {
    let _ = client.set_nodelay(true);
    let server = tokio::select! {
        _ = conn.cut.cancelled() => None,
        s = TcpStream::connect(&upstream) => s.ok(),
    };
    if let Some(server) = server {
        let _ = server.set_nodelay(true);
        let (client_read, client_write) = client.into_split();
        let (server_read, server_write) = server.into_split();
        tokio::select! {
            _ = conn.cut.cancelled() => {}
            _ = pump(&shared, &conn, client_read, server_write, true) => {}
            _ = pump(&shared, &conn, server_read, client_write, false) => {}
        }
    }
    conn.open.store(false, Ordering::Release);
}

/// Forwards one direction until end-of-file or an error, holding each chunk while frozen.
async fn pump(
    shared: &Shared,
    conn: &Conn,
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    upstream: bool,
) {
    let mut frozen = conn.frozen.subscribe();
    let mut buf = vec![0u8; 64 * 1024];
    // The tail of the previous chunk, so a pattern split across reads still matches.
    let mut tail: Vec<u8> = Vec::new();
    loop {
        // Wait while frozen before reading, so a frozen connection reads nothing more.
        if frozen.wait_for(|f| !*f).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if upstream && let Some(pattern) = shared.pattern(conn) {
            let mut window = std::mem::take(&mut tail);
            window.extend_from_slice(&buf[..n]);
            if window.windows(pattern.len()).any(|w| w == pattern.as_slice()) {
                shared.reached_pattern(conn);
            }
            let keep = pattern.len().saturating_sub(1).min(window.len());
            tail = window[window.len() - keep..].to_vec();
        }
        // Hold this chunk while frozen (a freeze between the read and here included).
        if frozen.wait_for(|f| !*f).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
        let counter = if upstream { &conn.up } else { &conn.down };
        counter.fetch_add(n as u64, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// An echo server; returns its address.
    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn roundtrip(s: &mut TcpStream, msg: &[u8], within: Duration) -> Option<Vec<u8>> {
        s.write_all(msg).await.ok()?;
        let mut got = vec![0u8; msg.len()];
        tokio::time::timeout(within, s.read_exact(&mut got)).await.ok()?.ok()?;
        Some(got)
    }

    #[tokio::test]
    async fn pass_freeze_pattern_nth_and_cut() {
        let proxy = Proxy::start(&echo().await.to_string()).await.unwrap();
        let short = Duration::from_millis(300);
        let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut a, b"hello", short).await.as_deref(), Some(&b"hello"[..]));

        // Freeze every open connection: nothing comes back, the socket stays open; pass resumes.
        proxy.freeze_all();
        assert_eq!(roundtrip(&mut a, b"held", short).await, None);
        proxy.pass();
        let mut got = [0u8; 4];
        tokio::time::timeout(short, a.read_exact(&mut got)).await.unwrap().unwrap();
        assert_eq!(&got, b"held", "held bytes are delivered after pass");

        // Only the second new connection to send the pattern freezes, and only at the pattern.
        proxy.freeze_nth_new(2, FreezeAt::ClientSends(b"LISTEN".to_vec()));
        let mut b = TcpStream::connect(proxy.addr()).await.unwrap();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(roundtrip(&mut b, b"x LISTEN y", short).await.is_some(), "first to send it passes");
        assert!(roundtrip(&mut c, b"before", short).await.is_some(), "not frozen before the pattern");
        c.write_all(b"LIS").await.unwrap();
        assert_eq!(roundtrip(&mut c, b"TEN now", short).await, None, "frozen at a pattern split across writes");
        let frozen: Vec<usize> = proxy.connections().iter().filter(|s| s.frozen).map(|s| s.id).collect();
        assert_eq!(frozen, vec![3]);
        assert!(roundtrip(&mut a, b"still", short).await.is_some(), "other connections unaffected");

        // Freeze only new connections, from the start.
        proxy.pass();
        proxy.freeze_new(FreezeAt::Start);
        let mut d = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut d, b"hi", short).await, None);
        assert!(roundtrip(&mut a, b"old", short).await.is_some());

        // Cut: every open connection reads end-of-file.
        proxy.cut_all();
        let mut buf = [0u8; 16];
        let n = tokio::time::timeout(short, a.read(&mut buf)).await.unwrap().unwrap_or(0);
        assert_eq!(n, 0, "a cut connection reads EOF");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(proxy.connections().iter().all(|c| !c.open));
        assert!(proxy.url("postgres://u@127.0.0.1:5432/db?x=1").ends_with(&format!("u@{}/db?x=1", proxy.addr())));
    }
}
