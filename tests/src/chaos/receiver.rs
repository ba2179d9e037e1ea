//! The effects receiver: the "outside world" of the non-idempotent HTTP tools.
//!
//! `POST /effect/<tool>` with the tool's JSON arguments records, as soon as the whole request
//! has arrived, one effect `(tool, Idempotency-Key header, token argument, arguments, time)`,
//! then answers `done <token> via <tool>` after a random delay — usually small, sometimes longer
//! than the tool's timeout. It does NOT deduplicate by key (it counts what the product sends;
//! a repeated effect is the product's doing). The chaos client asks it, as a careful human
//! would ask the other system, whether the effect of an uncertain operation happened.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

/// One effect as the receiver saw it.
#[derive(Debug, Clone)]
pub struct Effect {
    pub tool: String,
    pub key: Option<String>,
    pub token: String,
    pub arguments: Value,
    /// Since the receiver started.
    pub at: Duration,
    /// The answer was fully produced (the caller may still have given up before).
    pub answered: bool,
    pub delay_ms: u64,
    /// The body it answers with.
    pub response: String,
}

/// Delays of the answers.
#[derive(Debug, Clone, Copy)]
pub struct Delays {
    /// Usual delay range, ms.
    pub fast: (u64, u64),
    /// Probability of a slow answer.
    pub slow_rate: f64,
    /// Slow delay range, ms (above the tools' timeout).
    pub slow: (u64, u64),
}

struct Inner {
    started: Instant,
    effects: Mutex<Vec<Effect>>,
    rng: Mutex<StdRng>,
    delays: Delays,
}

/// The running receiver; stops when dropped.
pub struct Receiver {
    pub addr: SocketAddr,
    inner: Arc<Inner>,
    stop: CancellationToken,
}

impl Receiver {
    /// Starts on a free loopback port.
    pub async fn start(seed: u64, delays: Delays) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let inner = Arc::new(Inner {
            started: Instant::now(),
            effects: Mutex::new(Vec::new()),
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
            delays,
        });
        let stop = CancellationToken::new();
        let (accept_inner, accept_stop) = (inner.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = accept_stop.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((stream, _)) = accepted else { continue };
                let inner = accept_inner.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request: Request<Incoming>| handle(inner.clone(), request));
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
                });
            }
        });
        Ok(Self { addr, inner, stop })
    }

    /// URL of tool `tool`'s endpoint.
    pub fn url(&self, tool: &str) -> String {
        format!("http://{}/effect/{tool}", self.addr)
    }

    /// Every effect so far, in arrival order.
    pub fn effects(&self) -> Vec<Effect> {
        self.inner.effects.lock().expect("receiver lock").clone()
    }

    /// The effects recorded under idempotency key `key`.
    pub fn by_key(&self, key: &str) -> Vec<Effect> {
        self.inner.effects.lock().expect("receiver lock").iter().filter(|e| e.key.as_deref() == Some(key)).cloned().collect()
    }

    /// Time since the receiver started (the clock of [`Effect::at`]).
    pub fn now(&self) -> Duration {
        self.inner.started.elapsed()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn handle(inner: Arc<Inner>, request: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = request.uri().path().to_owned();
    let Some(tool) = path.strip_prefix("/effect/").map(str::to_owned) else {
        return Ok(Response::builder().status(404).body(Full::new(Bytes::from("not found"))).expect("response"));
    };
    let key = request.headers().get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned);
    // The effect happens once the whole request has arrived; a caller that dies mid-request
    // performs nothing.
    let Ok(body) = request.into_body().collect().await.map(|b| b.to_bytes()) else {
        return Ok(Response::builder().status(400).body(Full::new(Bytes::new())).expect("response"));
    };
    let arguments: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let token = arguments.get("token").and_then(Value::as_str).unwrap_or("").to_owned();
    let delay_ms = {
        let mut rng = inner.rng.lock().expect("receiver rng");
        let d = inner.delays;
        if rng.random_bool(d.slow_rate) { rng.random_range(d.slow.0..=d.slow.1) } else { rng.random_range(d.fast.0..=d.fast.1) }
    };
    let response = format!("done {token} via {tool}");
    let index = {
        let mut effects = inner.effects.lock().expect("receiver lock");
        effects.push(Effect {
            tool,
            key,
            token,
            arguments,
            at: inner.started.elapsed(),
            answered: false,
            delay_ms,
            response: response.clone(),
        });
        effects.len() - 1
    };
    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
    inner.effects.lock().expect("receiver lock")[index].answered = true;
    Ok(Response::builder().header("content-type", "text/plain").body(Full::new(Bytes::from(response))).expect("response"))
}
