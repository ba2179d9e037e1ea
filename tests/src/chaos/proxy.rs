//! A small fault-injecting TCP proxy (tokio) between the processes and PostgreSQL.
//!
//! Every accepted client connection gets its own upstream connection; bytes are copied in both
//! directions by two small loops. Each connection is in one of three modes, set per connection
//! or for all of them at once:
//!
//! - **pass**: bytes flow;
//! - **freeze**: nothing is forwarded in either direction, but both sockets stay open — a
//!   half-open connection as a hung host or a network partition produces it (the peers see
//!   neither data nor a close until the freeze ends);
//! - **cut**: both sockets are closed at once (the peers see a reset/EOF).
//!
//! While the global freeze is on, new connections are accepted but frozen too. The upstream
//! local port of each connection is recorded: it is `pg_stat_activity.client_port` of the
//! backend serving it, so a fault can target the connections of one process.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Result;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// One proxied connection.
struct Conn {
    /// Local port of the upstream socket (= the backend's `client_port`).
    upstream_port: u16,
    freeze: watch::Sender<bool>,
    cut: CancellationToken,
}

struct Inner {
    upstream: SocketAddr,
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    next: AtomicU64,
    frozen_all: watch::Sender<bool>,
    accepted: AtomicU64,
    upstream_failures: AtomicU64,
    stop: CancellationToken,
}

/// The proxy; stops accepting (and closes every connection) when dropped.
pub struct Proxy {
    /// Address clients connect to.
    pub addr: SocketAddr,
    inner: Arc<Inner>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let inner = Arc::new(Inner {
            upstream,
            conns: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            frozen_all: watch::channel(false).0,
            accepted: AtomicU64::new(0),
            upstream_failures: AtomicU64::new(0),
            stop: CancellationToken::new(),
        });
        let accept_inner = inner.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = accept_inner.stop.cancelled() => return,
                    accepted = listener.accept() => accepted,
                };
                let Ok((client, _)) = accepted else { continue };
                accept_inner.accepted.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(serve(accept_inner.clone(), client));
            }
        });
        Ok(Self { addr, inner })
    }

    /// Ids and upstream local ports of the open connections.
    pub fn connections(&self) -> Vec<(u64, u16)> {
        let conns = self.inner.conns.lock().expect("proxy lock");
        let mut list: Vec<(u64, u16)> = conns.iter().map(|(id, c)| (*id, c.upstream_port)).collect();
        list.sort_unstable();
        list
    }

    /// Freezes (`true`) or thaws every connection, present and future.
    pub fn freeze_all(&self, frozen: bool) {
        self.inner.frozen_all.send_replace(frozen);
    }

    /// Freezes or thaws connection `id`; false when it is gone.
    pub fn freeze(&self, id: u64, frozen: bool) -> bool {
        let conn = self.inner.conns.lock().expect("proxy lock").get(&id).cloned();
        conn.map(|c| c.freeze.send_replace(frozen)).is_some()
    }

    /// Thaws everything (global and per-connection freezes).
    pub fn thaw_everything(&self) {
        self.freeze_all(false);
        for conn in self.inner.conns.lock().expect("proxy lock").values() {
            conn.freeze.send_replace(false);
        }
    }

    /// Closes connection `id`; false when it is gone.
    pub fn cut(&self, id: u64) -> bool {
        let conn = self.inner.conns.lock().expect("proxy lock").get(&id).cloned();
        conn.map(|c| c.cut.cancel()).is_some()
    }

    /// Closes every open connection; returns how many.
    pub fn cut_all(&self) -> usize {
        let conns: Vec<Arc<Conn>> = self.inner.conns.lock().expect("proxy lock").values().cloned().collect();
        for c in &conns {
            c.cut.cancel();
        }
        conns.len()
    }

    /// Connections accepted so far and upstream connects that failed.
    pub fn totals(&self) -> (u64, u64) {
        (self.inner.accepted.load(Ordering::Relaxed), self.inner.upstream_failures.load(Ordering::Relaxed))
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.inner.stop.cancel();
        self.cut_all();
    }
}

async fn serve(inner: Arc<Inner>, client: TcpStream) {
    let upstream = match TcpStream::connect(inner.upstream).await {
        Ok(s) => s,
        Err(_) => {
            inner.upstream_failures.fetch_add(1, Ordering::Relaxed);
            return; // dropping `client` closes it: the peer sees the server as unreachable
        }
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let upstream_port = upstream.local_addr().map(|a| a.port()).unwrap_or(0);
    let id = inner.next.fetch_add(1, Ordering::Relaxed);
    let conn = Arc::new(Conn { upstream_port, freeze: watch::channel(false).0, cut: inner.stop.child_token() });
    inner.conns.lock().expect("proxy lock").insert(id, conn.clone());
    let (client_read, client_write) = client.into_split();
    let (upstream_read, upstream_write) = upstream.into_split();
    let done = conn.cut.clone();
    let up = pump(client_read, upstream_write, inner.frozen_all.subscribe(), conn.freeze.subscribe(), done.clone());
    let down = pump(upstream_read, client_write, inner.frozen_all.subscribe(), conn.freeze.subscribe(), done.clone());
    // Either direction ending (EOF, error, cut) closes both sockets.
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = done.cancelled() => {}
    }
    inner.conns.lock().expect("proxy lock").remove(&id);
}

/// Copies `from` to `to` until EOF, an error or `cut`, holding bytes while frozen.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut all: watch::Receiver<bool>,
    mut one: watch::Receiver<bool>,
    cut: CancellationToken,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if !gate(&mut all, &mut one, &cut).await {
            return;
        }
        let n = tokio::select! {
            _ = cut.cancelled() => return,
            n = from.read(&mut buf) => match n { Ok(0) | Err(_) => return, Ok(n) => n },
        };
        // Bytes read just before a freeze are held until it ends.
        if !gate(&mut all, &mut one, &cut).await {
            return;
        }
        tokio::select! {
            _ = cut.cancelled() => return,
            r = to.write_all(&buf[..n]) => if r.is_err() { return },
        }
    }
}

/// Waits until neither the global nor the connection's freeze is on; false when cut.
async fn gate(all: &mut watch::Receiver<bool>, one: &mut watch::Receiver<bool>, cut: &CancellationToken) -> bool {
    loop {
        if cut.is_cancelled() {
            return false;
        }
        if !*all.borrow_and_update() && !*one.borrow_and_update() {
            return true;
        }
        tokio::select! {
            _ = cut.cancelled() => return false,
            r = all.changed() => if r.is_err() { return true },
            r = one.changed() => if r.is_err() { return true },
        }
    }
}
