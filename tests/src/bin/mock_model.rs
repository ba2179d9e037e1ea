//! `mock-model`: a scripted OpenAI-compatible model server for black-box tests.
//!
//! ```text
//! mock-model --listen 127.0.0.1:0        # env MOCK_MODEL_LISTEN, default 127.0.0.1:0
//! ```
//!
//! After binding it prints exactly one line to stdout, `MOCK_MODEL_URL=http://127.0.0.1:PORT`,
//! then serves until killed. Logs (only with `--verbose`) go to stderr.
//!
//! Endpoints:
//!
//! - `POST /v1/chat/completions` (also `/chat/completions`): OpenAI Chat Completions, streamed
//!   as server-sent events when `stream: true`, else one `chat.completion` object. The answer
//!   is chosen per request from the request's own messages (see [`script`]): a `MOCK:`
//!   directive in the last user message scripts it step by step, otherwise a tiny calculator
//!   agent answers. Invalid JSON (or a bad directive) is a 400 with the OpenAI error shape.
//! - `GET /v1/models`: `{"object":"list","data":[{"id":"mock","object":"model"}]}`.
//! - `GET /health`: `{"status":"ok"}`.
//! - `GET /_mock/requests`: every chat-completions request body received so far (parsed JSON,
//!   arrival order); `DELETE /_mock/requests` clears that list.
//! - `GET /_mock/stats`: `{"requests": N, "inFlight": M}`, N counting every chat-completions
//!   request received (even invalid ones), M those whose response is not finished yet.

#[path = "mock_model/script.rs"]
mod script;
#[path = "mock_model/wire.rs"]
mod wire;

use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::http::header::{CACHE_CONTROL, RETRY_AFTER};
use actix_web::web::{self, Bytes};
use actix_web::{App, HttpResponse, HttpServer};
use anyhow::Context;
use clap::Parser;
use futures_util::Stream;
use serde_json::{Value, json};

use crate::script::{BadRequest, Failure, FailureCounts, Malformed};
use crate::wire::{Envelope, Frame, Usage};

/// Largest accepted request body, in bytes.
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// Pause before dropping a truncated response, so the bytes before the cut reach the client.
const ABORT_FLUSH_GRACE: Duration = Duration::from_millis(50);

/// A scripted OpenAI-compatible model server for black-box tests.
#[derive(Debug, Parser)]
#[command(name = "mock-model", version)]
struct Args {
    /// Address to listen on, host:port (port 0 picks a free port).
    #[arg(long, env = "MOCK_MODEL_LISTEN", default_value = "127.0.0.1:0")]
    listen: String,

    /// Number of worker threads.
    #[arg(long, env = "MOCK_MODEL_WORKERS", default_value_t = 2)]
    workers: usize,

    /// Log one line per chat-completions request to stderr.
    #[arg(long, env = "MOCK_MODEL_VERBOSE")]
    verbose: bool,
}

/// State shared by all workers.
#[derive(Debug, Default)]
struct MockState {
    /// Every parsed chat-completions request body, in arrival order.
    requests: Mutex<Vec<Value>>,
    /// Chat-completions requests received, including invalid ones.
    received: AtomicU64,
    /// Chat-completions responses not finished yet (a stream counts until its last byte is
    /// sent or its client goes away).
    in_flight: AtomicU64,
    /// Counters behind `failTimes`.
    failures: FailureCounts,
    /// Whether to log each request to stderr.
    verbose: bool,
}

impl MockState {
    fn requests(&self) -> MutexGuard<'_, Vec<Value>> {
        self.requests
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Counts one response as in flight for as long as it lives.
struct InFlight(Arc<MockState>);

impl InFlight {
    fn enter(state: Arc<MockState>) -> Self {
        state.in_flight.fetch_add(1, Ordering::SeqCst);
        Self(state)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

#[actix_web::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let state = web::Data::new(MockState {
        verbose: args.verbose,
        ..MockState::default()
    });

    let server = HttpServer::new({
        let state = state.clone();
        move || {
            App::new()
                .app_data(state.clone())
                .app_data(web::PayloadConfig::new(MAX_BODY_BYTES))
                .configure(routes)
        }
    })
    .workers(args.workers)
    .shutdown_timeout(1)
    .bind(&args.listen)
    .with_context(|| format!("binding {}", args.listen))?;

    let address = *server
        .addrs()
        .first()
        .context("the server bound no address")?;
    let mut stdout = io::stdout().lock();
    writeln!(stdout, "MOCK_MODEL_URL=http://{address}").context("writing the URL")?;
    stdout.flush().context("flushing stdout")?;
    drop(stdout);

    server.run().await.context("serving")
}

/// The route table.
fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/v1/chat/completions", web::post().to(chat_completions))
        .route("/chat/completions", web::post().to(chat_completions))
        .route("/v1/models", web::get().to(models))
        .route("/health", web::get().to(health))
        .route("/_mock/requests", web::get().to(list_requests))
        .route("/_mock/requests", web::delete().to(clear_requests))
        .route("/_mock/stats", web::get().to(stats));
}

/// `POST /v1/chat/completions`: records the request, plans the reply, sleeps `delayMs`, then
/// answers with the scripted error, a `chat.completion` object, or an SSE stream.
async fn chat_completions(state: web::Data<MockState>, body: Bytes) -> HttpResponse {
    let number = state.received.fetch_add(1, Ordering::SeqCst) + 1;
    let in_flight = InFlight::enter(state.clone().into_inner());

    let request: Value = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(err) => return invalid_request(&format!("invalid JSON body: {err}")),
    };
    state.requests().push(request.clone());
    let reply = match script::plan(&request, &state.failures) {
        Ok(reply) => reply,
        Err(BadRequest(message)) => return invalid_request(&message),
    };
    let streaming = request.get("stream").and_then(Value::as_bool) == Some(true);
    if state.verbose {
        eprintln!(
            "mock-model: request #{number} stream={streaming} failure={:?} text={:?} tool_calls={}",
            reply.failure.map(|failure| failure.status),
            reply.text,
            reply.tool_calls.len(),
        );
    }

    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }
    if let Some(failure) = reply.failure {
        return scripted_error(failure);
    }

    let envelope = Envelope::for_request(&request);
    let usage = Usage::compute(&request, &reply);
    if streaming {
        let include_usage = request
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            == Some(true);
        let frames = wire::stream(&envelope, &reply, include_usage.then_some(usage));
        return HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header((CACHE_CONTROL, "no-cache"))
            .streaming(body_stream(frames, reply.chunk_delay, in_flight));
    }

    let completion = wire::completion(&envelope, &reply, usage);
    match reply.malformed {
        None => HttpResponse::Ok().json(completion),
        Some(Malformed::Chunk) => HttpResponse::Ok()
            .content_type("application/json")
            .body("{not json"),
        Some(Malformed::Truncate) => {
            let text = completion.to_string();
            let half = Bytes::copy_from_slice(wire::first_half(&text).as_bytes());
            HttpResponse::Ok()
                .content_type("application/json")
                .streaming(body_stream(
                    vec![Frame::Data(half), Frame::Abort],
                    Duration::ZERO,
                    in_flight,
                ))
        }
    }
}

/// A response body yielding `frames` one by one, sleeping `chunk_delay` between two of them;
/// [`Frame::Abort`] ends it with an error, which makes actix drop the connection (no final
/// empty chunk). Holding `in_flight` keeps the response counted until the body is finished or
/// dropped (a client that disconnects drops it).
fn body_stream(
    frames: Vec<Frame>,
    chunk_delay: Duration,
    in_flight: InFlight,
) -> impl Stream<Item = Result<Bytes, io::Error>> + 'static {
    let state = (frames.into_iter(), true, in_flight);
    futures_util::stream::unfold(state, move |(mut frames, first, in_flight)| async move {
        let frame = frames.next()?;
        if !first && !chunk_delay.is_zero() {
            tokio::time::sleep(chunk_delay).await;
        }
        let item = match frame {
            Frame::Data(bytes) => Ok(bytes),
            Frame::Abort => {
                tokio::time::sleep(ABORT_FLUSH_GRACE).await;
                Err(io::Error::other(
                    "mock-model: response truncated on purpose",
                ))
            }
        };
        Some((item, (frames, false, in_flight)))
    })
}

/// The scripted error: `status`, optional `Retry-After`, and
/// `{"error":{"message":"mock error","type":"mock","code":<status>}}`.
fn scripted_error(failure: Failure) -> HttpResponse {
    let Ok(status) = StatusCode::from_u16(failure.status) else {
        return invalid_request(&format!("invalid MOCK status {}", failure.status));
    };
    let mut response = HttpResponse::build(status);
    if let Some(seconds) = failure.retry_after_secs {
        response.insert_header((RETRY_AFTER, seconds.to_string()));
    }
    response.json(json!({
        "error": { "message": "mock error", "type": "mock", "code": failure.status },
    }))
}

/// 400 with OpenAI's error shape.
fn invalid_request(message: &str) -> HttpResponse {
    HttpResponse::BadRequest().json(json!({
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": null,
            "code": null,
        },
    }))
}

/// `GET /v1/models`.
async fn models() -> HttpResponse {
    HttpResponse::Ok().json(json!({
        "object": "list",
        "data": [{ "id": "mock", "object": "model" }],
    }))
}

/// `GET /health`.
async fn health() -> HttpResponse {
    HttpResponse::Ok().json(json!({ "status": "ok" }))
}

/// `GET /_mock/requests`: the recorded request bodies, oldest first.
async fn list_requests(state: web::Data<MockState>) -> HttpResponse {
    let requests = state.requests().clone();
    HttpResponse::Ok().json(requests)
}

/// `DELETE /_mock/requests`: forgets the recorded request bodies (not the `failTimes`
/// counters, nor the `requests` count of `/_mock/stats`).
async fn clear_requests(state: web::Data<MockState>) -> HttpResponse {
    state.requests().clear();
    HttpResponse::NoContent().finish()
}

/// `GET /_mock/stats`.
async fn stats(state: web::Data<MockState>) -> HttpResponse {
    HttpResponse::Ok().json(json!({
        "requests": state.received.load(Ordering::SeqCst),
        "inFlight": state.in_flight.load(Ordering::SeqCst),
    }))
}
