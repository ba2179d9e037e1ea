//! Noticing that a client left while its request waits: a long-poll, a non-streaming
//! `POST /v1/chat/completions`, an SSE stream between two events.
//!
//! actix-web keeps a handler future, and a streaming response body, alive after the peer has
//! closed its connection, until a write to it fails (actix/actix-web#1313, #3462). Without help,
//! a departed long-poll waits out its timeout, a non-streaming OpenAI call keeps its hidden run
//! going to the end, and live-connection counts hold departed clients for up to two heartbeats
//! (the first write after a close still succeeds).
//!
//! So every accepted TCP connection records its socket in the connection data ([`on_connect`]),
//! and [`PeerSocket::closed`] peeks at it (`recv` with `MSG_PEEK`, non-blocking) every
//! [`CHECK_INTERVAL`]: 0 bytes (the peer's FIN) or a reset means the client is gone; no data or
//! unread data (a pipelined request) means it is still there.
//!
//! Validity of the descriptor number: actix's HTTP/1 dispatcher owns the connection's socket, the
//! handler future and the response body together, so the descriptor stays open while either is
//! alive. A task spawned beside a streaming body (the SSE pump) may look once more after the
//! connection is dropped; a peek never consumes or changes anything, so at worst it answers about
//! a reused descriptor number, and callers only use the answer to stop work for a client that
//! is gone by then anyway.

use std::any::Any;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use actix_web::HttpRequest;
use actix_web::dev::Extensions;

/// How often a waiting request looks at its client's socket (one `recv` syscall each).
pub const CHECK_INTERVAL: Duration = Duration::from_millis(500);

/// The client socket of a request's connection (plain TCP connections only).
#[derive(Debug, Clone, Copy)]
pub struct PeerSocket(RawFd);

/// `HttpServer::on_connect` hook: records the socket of each accepted TCP connection.
pub fn on_connect(connection: &dyn Any, data: &mut Extensions) {
    if let Some(tcp) = connection.downcast_ref::<actix_web::rt::net::TcpStream>() {
        data.insert(PeerSocket(tcp.as_raw_fd()));
    }
}

impl PeerSocket {
    /// The socket of `req`'s connection; `None` for a request not served over TCP by this
    /// process's server (e.g. `actix_web::test` requests).
    pub fn of(req: &HttpRequest) -> Option<Self> {
        req.conn_data::<Self>().copied()
    }

    /// Whether the peer has closed or reset the connection (checked now, without waiting).
    pub fn is_gone(self) -> bool {
        use nix::errno::Errno;
        use nix::sys::socket::{MsgFlags, recv};
        // See the module docs for why the descriptor is still this connection's.
        let mut byte = [0u8; 1];
        match recv(self.0, &mut byte, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT) {
            Ok(0) => true,
            Ok(_) => false,
            Err(Errno::EAGAIN | Errno::EINTR) => false,
            Err(_) => true,
        }
    }

    /// Resolves once the peer has gone (checked every [`CHECK_INTERVAL`]).
    pub async fn closed(self) {
        let mut tick = tokio::time::interval(CHECK_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if self.is_gone() {
                return;
            }
        }
    }
}

/// Resolves when `req`'s client has gone; never, when its socket is unknown.
pub async fn client_gone(peer: Option<PeerSocket>) {
    match peer {
        Some(peer) => peer.closed().await,
        None => std::future::pending().await,
    }
}
