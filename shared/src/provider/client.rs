//! Streaming client for OpenAI-compatible Chat Completions endpoints
//! (`POST {base_url}/chat/completions` with `stream: true`, server-sent events).

use std::sync::Arc;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use eventsource_stream::{EventStreamError, Eventsource};
use futures_util::StreamExt;
use reqwest::{StatusCode, header};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::catalog::ModelConfig;

/// Longest provider error message kept in a [`ProviderError`], in characters.
const MAX_ERROR_MESSAGE_CHARS: usize = 500;
/// Longest `Retry-After` honoured between retries.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(30);

/// One chat completion request. The caller has already projected the context for the
/// provider (SPEC §9); this client adds only transport fields.
#[derive(Debug, Clone, Default)]
pub struct ChatRequest {
    /// OpenAI-format messages (`{"role", "content", "tool_calls"?, "tool_call_id"?}`).
    pub messages: Vec<Value>,
    /// OpenAI tool specs (`{"type":"function","function":{...}}`); not sent when empty or
    /// when the model does not support tools.
    pub tools: Vec<Value>,
    /// `"auto"`, `"required"`, `"none"` or `{"type":"function","function":{"name"}}`; sent
    /// only together with tools.
    pub tool_choice: Option<Value>,
    /// Upper bound of generated tokens (`max_tokens`).
    pub max_tokens: Option<u32>,
    /// Sampling temperature.
    pub temperature: Option<f32>,
}

/// A piece of streamed output, reported as soon as it arrives (for the UI's partial message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamDelta {
    /// Answer text (`delta.content`).
    Text(String),
    /// Reasoning text (`delta.reasoning_content`, `delta.reasoning` or `delta.thinking`).
    Reasoning(String),
}

/// A tool call requested by the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Provider-assigned id, or `call_<32 hex>` generated here when the provider sent none.
    pub id: String,
    /// Function name as sent (may name an unknown tool).
    pub name: String,
    /// Arguments exactly as the model sent them (normally a JSON object, possibly invalid).
    pub arguments: String,
}

/// Token usage reported by the provider (`stream_options.include_usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens (reasoning included, as providers count it).
    pub completion_tokens: u64,
    /// Total tokens.
    pub total_tokens: u64,
}

/// The assembled assistant turn of one streamed completion.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct AssistantTurn {
    /// Concatenated answer text (empty when the model only called tools).
    pub content: String,
    /// Concatenated reasoning text, if the provider streamed any.
    pub reasoning: Option<String>,
    /// Tool calls in the order of their first delta.
    pub tool_calls: Vec<ToolCall>,
    /// Last `finish_reason` seen (`stop`, `length`, `tool_calls`, ...); `None` if the stream
    /// ended with `[DONE]` but never gave one.
    pub finish_reason: Option<String>,
    /// Usage from the last chunk that carried it.
    pub usage: Option<Usage>,
    /// The model name the provider reported (`model` of the chunks), if any.
    #[serde(default)]
    pub response_model: Option<String>,
    /// Number of stream chunks skipped because they were not valid JSON of the chunk shape.
    pub malformed_chunks: u32,
}

impl AssistantTurn {
    /// The `finish_reason` when the provider ended the answer early: anything but a finished
    /// answer (`stop`, `eos`, none) or a request for tools (`tool_calls`, `function_call`) —
    /// `length` (it reached `max_tokens` or the context's end), `content_filter`, ...
    pub fn cut_reason(&self) -> Option<&str> {
        self.finish_reason
            .as_deref()
            .map(str::trim)
            .filter(|r| !r.is_empty() && !matches!(*r, "stop" | "eos" | "end_turn" | "stop_sequence" | "tool_calls" | "function_call"))
    }
}

/// Provider call failures; [`ProviderError::code`] gives the stable code stored on runs/steps.
/// Messages carry the provider's own error text (at most 500 characters), never the API key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    /// A non-retryable HTTP error (4xx other than 408/425/429, or 5xx other than those of
    /// [`ProviderError::Unavailable`]), or an
    /// `{"error":{...}}` object inside the stream (status = its `code` if that is an HTTP
    /// error status, else 502).
    #[error("model returned HTTP {status}: {message}")]
    Http { status: u16, message: String },
    /// HTTP 429 on the last allowed attempt.
    #[error("model rate limited (HTTP 429) after retries: {message}")]
    RateLimited { message: String },
    /// HTTP 408, 425, 500, 502, 503, 504, 520-524 or 529 on the last allowed attempt.
    #[error("model unavailable (HTTP {status}) after retries: {message}")]
    Unavailable { status: u16, message: String },
    /// Connect failure or timeout (after retries), or the body failing mid-stream (not retried).
    #[error("model transport error: {0}")]
    Transport(String),
    /// The stream ended without `[DONE]` and without any `finish_reason`.
    #[error("model stream ended before the response was complete")]
    Truncated,
    /// The body is not a readable event stream (bad UTF-8 or SSE framing), or a response with
    /// tool calls had chunks that could not be read (the calls' arguments cannot be trusted).
    #[error("malformed model response: {0}")]
    Malformed(String),
    /// Nothing that carries part of the answer (text, reasoning, a tool-call piece, usage, a
    /// finish reason) arrived for `MODEL_STREAM_IDLE_MS` — no byte at all (reqwest's read
    /// timeout, the wait for the headers included), or only keep-alive comments and empty
    /// deltas: a stream stuck with its connection open.
    #[error("the model sent nothing for {0:?} (MODEL_STREAM_IDLE_MS); the stream was given up")]
    Stalled(Duration),
    /// The answer (text, reasoning and tool calls) grew past `MODEL_MAX_ANSWER_BYTES`.
    #[error("the model's answer exceeded {0} bytes (MODEL_MAX_ANSWER_BYTES); the stream was cut")]
    TooLarge(usize),
    /// One stream event grew past [`EVENT_BYTES_PER_ANSWER_BYTE`] times `MODEL_MAX_ANSWER_BYTES`
    /// without its end (the blank line that ends an SSE event).
    #[error("one event of the model's stream exceeded {0} bytes ({EVENT_BYTES_PER_ANSWER_BYTE} x MODEL_MAX_ANSWER_BYTES) without ending; it was cut")]
    EventTooLarge(usize),
    /// The stream as read (every byte off the socket: envelopes and empty deltas included) grew past
    /// [`WIRE_BYTES_PER_ANSWER_BYTE`] times `MODEL_MAX_ANSWER_BYTES`.
    #[error("the model's stream exceeded {0} bytes ({WIRE_BYTES_PER_ANSWER_BYTE} x MODEL_MAX_ANSWER_BYTES) before it ended; it was cut")]
    StreamTooLarge(usize),
    /// One answer started more than [`MAX_TOOL_CALLS_PER_ANSWER`] tool calls.
    #[error("the model's answer has more than {MAX_TOOL_CALLS_PER_ANSWER} tool calls; the stream was cut")]
    TooManyToolCalls,
}

/// Bytes of stream read per byte of answer allowed (`MODEL_MAX_ANSWER_BYTES`): the stream is
/// cut past this many times the answer's cap. A provider sends one chunk per token with an
/// envelope of ~250-320 bytes (id, object, model, fingerprint, `obfuscation` padding, ...), so
/// the 4 x of before cut a 4 MiB cap at ~53,000 tokens of answer, ~200 KB of text — and threw
/// that paid answer away (acceptance probe N, N-2); at 64 x the answer's own cap binds first.
/// What this bounds is the parsing of a stream that carries nothing (empty deltas), not memory:
/// events are not kept.
pub const WIRE_BYTES_PER_ANSWER_BYTE: usize = 64;

/// One SSE event of a model stream is cut past this many times `MODEL_MAX_ANSWER_BYTES` of
/// bytes read since the previous event ended: the decoder holds an event whole until its end,
/// so this bounds a worker's memory per stream (verifier P, P-2: `data:` lines without the
/// blank line that ends an event grew a worker to 2 GB). The decoder also scans the event it
/// holds again for each read, so one endless line costs time quadratic in its length (40 MB:
/// minutes of CPU; P-10): the bound is kept low. An answer sent as one event is JSON of at most
/// the cap with its envelope; text that JSON escapes heavily is cut sooner.
pub const EVENT_BYTES_PER_ANSWER_BYTE: usize = 2;

/// Most tool calls one answer may start; a stream that starts more is cut
/// ([`ProviderError::TooManyToolCalls`]). Parallel calls of real models number a few to a few
/// dozen; 40,000 calls in one answer (a prompt injection is enough) took a worker 17 s to
/// assemble (quadratic), 650 MiB, then minutes of database time and a thread no model could read
/// again (acceptance probe N, N-5).
pub const MAX_TOOL_CALLS_PER_ANSWER: usize = 256;

impl ProviderError {
    /// Whether the same request may well succeed later: a rate limit, a 5xx, a connection
    /// refused or cut (before or during the stream), a stream cut short or stalled. Not: a 4xx
    /// other than 429 (the request itself), a malformed response, an answer over the cap.
    pub fn transient(&self) -> bool {
        matches!(self, Self::RateLimited { .. } | Self::Unavailable { .. } | Self::Transport(_) | Self::Truncated | Self::Stalled(_))
    }

    /// Stable snake_case code: `model_http_error`, `model_rate_limited`, `model_unavailable`,
    /// `model_transport_error`, `model_stream_truncated`, `model_malformed_response`,
    /// `model_stream_stalled`, `model_answer_too_large`, `model_stream_too_large`,
    /// `model_too_many_tool_calls`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Http { .. } => "model_http_error",
            Self::RateLimited { .. } => "model_rate_limited",
            Self::Unavailable { .. } => "model_unavailable",
            Self::Transport(_) => "model_transport_error",
            Self::Truncated => "model_stream_truncated",
            Self::Malformed(_) => "model_malformed_response",
            Self::Stalled(_) => "model_stream_stalled",
            Self::TooLarge(_) => "model_answer_too_large",
            Self::StreamTooLarge(_) | Self::EventTooLarge(_) => "model_stream_too_large",
            Self::TooManyToolCalls => "model_too_many_tool_calls",
        }
    }
}

/// HTTP client for all configured models; cheap to clone (one shared connection pool).
#[derive(Debug, Clone)]
pub struct ProviderClient {
    http: reqwest::Client,
    max_retries: usize,
    /// Longest silence of a response, between any two reads (headers included).
    read_timeout: Duration,
    /// Largest answer assembled from a stream: text + reasoning + tool-call names and
    /// arguments, in bytes.
    max_answer_bytes: usize,
}

/// Default of `MODEL_STREAM_IDLE_MS`: 300 s of silence ends a stream (OpenAI's SDKs wait 600 s
/// between reads; a reasoning model can think for minutes before its first token).
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(300);

/// Default of `MODEL_MAX_ANSWER_BYTES`: 4 MiB, far above any model's output limit (128k tokens
/// are about 0.5 MB) and bounding what one slice holds in memory.
pub const DEFAULT_MAX_ANSWER_BYTES: usize = 4 * 1024 * 1024;

impl Default for ProviderClient {
    fn default() -> Self {
        Self::new()
    }
}

impl ProviderClient {
    /// A client with a 10 s connect timeout, TCP keep-alive (a dead peer is detected in about
    /// 90 s), no overall timeout (streams are long) but a read timeout (a live peer that stops
    /// sending: [`DEFAULT_READ_TIMEOUT`]), a cap on the answer ([`DEFAULT_MAX_ANSWER_BYTES`]),
    /// retrying at most 3 times.
    ///
    /// Installs rustls's `ring` crypto provider as the process default first (a no-op if one is
    /// installed). Panics only if the TLS backend cannot be initialised, like
    /// `reqwest::Client::new`.
    pub fn new() -> Self {
        Self::with_limits(DEFAULT_READ_TIMEOUT, DEFAULT_MAX_ANSWER_BYTES)
    }

    /// [`Self::new`] with the read timeout (`MODEL_STREAM_IDLE_MS`) and the answer cap
    /// (`MODEL_MAX_ANSWER_BYTES`) given.
    pub fn with_limits(read_timeout: Duration, max_answer_bytes: usize) -> Self {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(read_timeout)
            .tcp_keepalive(Duration::from_secs(30))
            .tcp_keepalive_interval(Duration::from_secs(15))
            .tcp_keepalive_retries(4)
            .build()
            .expect("HTTP client with the rustls ring provider");
        Self {
            http,
            max_retries: 3,
            read_timeout,
            max_answer_bytes,
        }
    }

    /// Sets how many times a retryable failure is retried (0 disables retries).
    pub fn with_max_retries(mut self, max_retries: usize) -> Self {
        self.max_retries = max_retries;
        self
    }

    /// Streams one chat completion from `model`, reporting text and reasoning pieces to
    /// `on_delta` as they arrive, and returns the assembled turn.
    ///
    /// Sends `model: upstream_name`, `stream: true`, `stream_options: {include_usage: true}`,
    /// the bearer key if any. Before the body is read, HTTP 429, the statuses of
    /// [`ProviderError::Unavailable`], connect errors and timeouts are retried with exponential backoff and jitter (500 ms, x2, at
    /// most 8 s, or the `Retry-After` seconds capped at 30 s); once streaming has begun nothing
    /// is retried. Chunks that are not valid JSON are skipped and counted — unless the answer
    /// has tool calls: a skipped piece could have changed their arguments (a malformed chunk
    /// between two argument pieces joined them into other valid JSON, and an effect ran with
    /// it: acceptance probe), so such a response is `Malformed` and no call of it runs. A
    /// delta for an `index` that brings a different id starts a new call (two calls at one
    /// index were merged). A stream silent for the read timeout is `Stalled`; an answer past
    /// the cap is `TooLarge` (both acceptance probe: a silent stream held its slot forever, a
    /// 40 MB answer was paid again and again).
    ///
    /// Cancel-safe: dropping the future aborts the HTTP request.
    ///
    /// Errors: see [`ProviderError`].
    ///
    /// Traced as the span `chat {upstream model}` (client kind) with the OpenTelemetry GenAI
    /// semantic-convention attributes `gen_ai.operation.name` (`chat`), `gen_ai.provider.name`
    /// and `gen_ai.system` (`openai`: the API this client speaks, whatever serves it),
    /// `gen_ai.request.model`, `gen_ai.request.max_tokens`, `gen_ai.request.temperature`,
    /// `server.address`, `server.port`, `gen_ai.response.model`, `gen_ai.usage.input_tokens`,
    /// `gen_ai.usage.output_tokens`, `gen_ai.response.finish_reasons`, and `error.type` (the
    /// [`ProviderError::code`]) on failure; plus `model.name` (the catalog id). Never message
    /// bodies, tool arguments or output.
    pub async fn stream_chat(
        &self,
        model: &ModelConfig,
        request: &ChatRequest,
        on_delta: &mut (dyn FnMut(StreamDelta) + Send),
    ) -> Result<AssistantTurn, ProviderError> {
        use tracing::Instrument;
        use tracing::field::Empty;
        // Numbers as i64: tracing-opentelemetry exports u64 fields as strings.
        let url = reqwest::Url::parse(&model.base_url).ok();
        let span = tracing::info_span!(
            "chat",
            otel.name = %format_args!("chat {}", model.upstream_name),
            otel.kind = "client",
            otel.status_code = Empty,
            model.name = %model.id,
            gen_ai.operation.name = "chat",
            gen_ai.provider.name = "openai",
            gen_ai.system = "openai",
            gen_ai.request.model = %model.upstream_name,
            gen_ai.request.max_tokens = request.max_tokens.map(i64::from),
            gen_ai.request.temperature = request.temperature.map(f64::from),
            server.address = url.as_ref().and_then(|u| u.host_str()),
            server.port = url.as_ref().and_then(reqwest::Url::port_or_known_default).map(i64::from),
            gen_ai.response.model = Empty,
            gen_ai.usage.input_tokens = Empty,
            gen_ai.usage.output_tokens = Empty,
            error.type = Empty,
        );
        let result = self.stream_chat_inner(model, request, on_delta).instrument(span.clone()).await;
        match &result {
            Ok(turn) => {
                if let Some(name) = &turn.response_model {
                    span.record("gen_ai.response.model", name.as_str());
                }
                if let Some(usage) = &turn.usage {
                    span.record("gen_ai.usage.input_tokens", usage.prompt_tokens as i64);
                    span.record("gen_ai.usage.output_tokens", usage.completion_tokens as i64);
                }
                if let Some(reason) = &turn.finish_reason {
                    crate::telemetry::set_string_array(&span, "gen_ai.response.finish_reasons", vec![reason.clone()]);
                }
            }
            Err(error) => {
                span.record("error.type", error.code());
                span.record("otel.status_code", "ERROR");
            }
        }
        result
    }

    async fn stream_chat_inner(
        &self,
        model: &ModelConfig,
        request: &ChatRequest,
        on_delta: &mut (dyn FnMut(StreamDelta) + Send),
    ) -> Result<AssistantTurn, ProviderError> {
        let with_tools = model.supports_tools && !request.tools.is_empty();
        let body = serde_json::to_vec(&WireRequest {
            model: &model.upstream_name,
            messages: &request.messages,
            stream: true,
            stream_options: StreamOptions {
                include_usage: true,
            },
            tools: with_tools.then_some(request.tools.as_slice()),
            tool_choice: request.tool_choice.as_ref().filter(|_| with_tools),
            max_tokens: request.max_tokens,
            temperature: request.temperature,
        })
        .map_err(|e| ProviderError::Malformed(format!("cannot encode request: {e}")))?;
        let url = format!("{}/chat/completions", model.base_url.trim_end_matches('/'));

        let backoff = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(500))
            .with_factor(2.0)
            .with_max_delay(Duration::from_secs(8))
            .with_max_times(self.max_retries)
            .with_jitter();
        let response = (|| self.send_once(model, &url, &body))
            .retry(backoff)
            .when(|e| e.retryable)
            .adjust(|e, delay| delay.map(|d| e.retry_after.unwrap_or(d)))
            .notify(|e, delay| {
                tracing::warn!(model.name = %model.id, error = %e.error, delay_ms = delay.as_millis() as u64, "retrying model request");
            })
            .await
            .map_err(|e| e.error)?;

        read_stream(response, model, self.read_timeout, self.max_answer_bytes, on_delta).await
    }

    /// One attempt: sends the request and checks the status without touching the body of a
    /// successful response.
    async fn send_once(
        &self,
        model: &ModelConfig,
        url: &str,
        body: &[u8],
    ) -> Result<reqwest::Response, AttemptError> {
        let mut request = self
            .http
            .post(url)
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "text/event-stream")
            .body(body.to_vec());
        if let Some(key) = &model.api_key {
            request = request.bearer_auth(key);
        }
        let response = request.send().await.map_err(|e| AttemptError {
            retryable: e.is_connect() || e.is_timeout(),
            retry_after: None,
            error: if e.is_timeout() && !e.is_connect() {
                ProviderError::Stalled(self.read_timeout)
            } else {
                ProviderError::Transport(error_chain(&e))
            },
        })?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let retry_after = response
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok()?.trim().parse::<f64>().ok())
            .filter(|secs| secs.is_finite() && *secs >= 0.0)
            .map(|secs| Duration::from_secs_f64(secs).min(MAX_RETRY_AFTER));
        let body = response.text().await.unwrap_or_default();
        let message = provider_message(
            serde_json::from_str::<Value>(&body).ok().as_ref(),
            &body,
            status,
            model.api_key.as_deref(),
        );
        let (error, retryable) = match status {
            StatusCode::TOO_MANY_REQUESTS => (ProviderError::RateLimited { message }, true),
            // The server or a proxy in front of it failed or gave up on this attempt, not on the
            // request: 408 Request Timeout (acceptance probe M, M-5: it failed the run at once),
            // 425 Too Early, 500, 502, 503, 504, Cloudflare's 520-524 and 529 (overloaded).
            status if matches!(status.as_u16(), 408 | 425 | 500 | 502 | 503 | 504 | 520..=524 | 529) => (
                ProviderError::Unavailable {
                    status: status.as_u16(),
                    message,
                },
                true,
            ),
            _ => (
                ProviderError::Http {
                    status: status.as_u16(),
                    message,
                },
                false,
            ),
        };
        Err(AttemptError {
            error,
            retryable,
            retry_after,
        })
    }
}

/// A failed attempt and whether (and when) it may be retried.
struct AttemptError {
    error: ProviderError,
    retryable: bool,
    retry_after: Option<Duration>,
}

#[derive(Serialize)]
struct WireRequest<'a> {
    model: &'a str,
    messages: &'a [Value],
    stream: bool,
    stream_options: StreamOptions,
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<&'a [Value]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// One `chat.completion.chunk`, reduced to what is assembled.
#[derive(Deserialize)]
struct Chunk {
    model: Option<String>,
    choices: Option<Vec<ChunkChoice>>,
    usage: Option<Usage>,
    error: Option<Value>,
}

#[derive(Deserialize)]
struct ChunkChoice {
    /// `message` in a whole (non-streamed) `chat.completion`.
    #[serde(alias = "message")]
    delta: Option<ChunkDelta>,
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct ChunkDelta {
    content: Option<String>,
    refusal: Option<String>,
    reasoning_content: Option<String>,
    reasoning: Option<String>,
    thinking: Option<String>,
    tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Deserialize)]
struct ToolCallDelta {
    index: Option<usize>,
    id: Option<String>,
    function: Option<FunctionDelta>,
}

#[derive(Deserialize)]
struct FunctionDelta {
    name: Option<String>,
    arguments: Option<String>,
}

/// A tool call being assembled; `index` is the provider's `tool_calls[].index`.
#[derive(Default)]
struct PartialCall {
    index: Option<usize>,
    id: Option<String>,
    name: String,
    arguments: String,
}

/// Reads a successful response and assembles the turn: the event stream asked for, or a whole
/// `chat.completion` object when the server answered `application/json` (some
/// OpenAI-compatible servers ignore `stream: true`; its `choices[0].message` is read as one
/// delta, under the same bounds).
async fn read_stream(
    response: reqwest::Response,
    model: &ModelConfig,
    read_timeout: Duration,
    max_answer_bytes: usize,
    on_delta: &mut (dyn FnMut(StreamDelta) + Send),
) -> Result<AssistantTurn, ProviderError> {
    let mut assembly = Assembly { max_answer_bytes, ..Assembly::default() };
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().to_ascii_lowercase().starts_with("application/json"));
    if is_json {
        let body = read_body(response, read_timeout, max_answer_bytes.saturating_mul(4)).await?;
        let data = String::from_utf8_lossy(&body);
        let mut chunk = serde_json::from_str::<Chunk>(data.trim())
            .map_err(|e| ProviderError::Malformed(format!("the JSON answer is not a chat completion ({e})")))?;
        // A whole message lists its calls without `index`: each is its own call.
        let choice = chunk.choices.iter_mut().flatten().next();
        for (i, call) in choice.and_then(|c| c.delta.as_mut()).and_then(|d| d.tool_calls.as_mut()).into_iter().flatten().enumerate() {
            call.index.get_or_insert(i);
        }
        assembly.apply(chunk, &data, model, on_delta)?;
        return assembly.finish(true);
    }
    // Everything read counts, as it comes off the socket and before the SSE decoder buffers it,
    // at WIRE_BYTES_PER_ANSWER_BYTE times the answer's cap: a stream of empty deltas is no answer
    // but is read all the same (verification probe: 300 MB of empty chunks). And one event may
    // not grow past EVENT_BYTES_PER_ANSWER_BYTE times the cap: the decoder holds an event until
    // its blank line, so lines of `data:` that never end one grew a worker to 2 GB, under a
    // bound counted on the events the decoder gave out (verifier P, P-2). Past either bound the
    // body stream ends and the answer is cut.
    let max_read_bytes = max_answer_bytes.saturating_mul(WIRE_BYTES_PER_ANSWER_BYTE);
    let max_event_bytes = max_answer_bytes.saturating_mul(EVENT_BYTES_PER_ANSWER_BYTE);
    let cut = Arc::new(std::sync::Mutex::new(None::<ProviderError>));
    let cutting = cut.clone();
    let invalid = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counting = invalid.clone();
    let (mut read, mut event) = (0usize, EventLength::default());
    let mut pending = Vec::new();
    let mut events = Box::pin(
        response
            .bytes_stream()
            .take_while(move |chunk| {
                let over = chunk.as_ref().ok().and_then(|bytes| {
                    read += bytes.len();
                    if read > max_read_bytes {
                        Some(ProviderError::StreamTooLarge(max_read_bytes))
                    } else if event.feed(bytes) > max_event_bytes {
                        Some(ProviderError::EventTooLarge(max_event_bytes))
                    } else {
                        None
                    }
                });
                let keep = over.is_none();
                if let Some(error) = over {
                    *cutting.lock().expect("not poisoned") = Some(error);
                }
                std::future::ready(keep)
            })
            // A stream read faster than it is decoded never waits on the socket, so without this the
            // task would not yield while it decodes: one endless line held a runtime thread for
            // minutes — its cancel was seen after 6 min 47 s, two such streams froze the worker and
            // its lease renewals (verifier P, P-10).
            .then(|chunk| async move {
                tokio::task::coop::consume_budget().await;
                chunk
            })
            .map(move |chunk| {
                chunk.map(|bytes| {
                    let mut replaced = 0;
                    let text = lossy_utf8(&mut pending, &bytes, &mut replaced);
                    counting.fetch_add(replaced, std::sync::atomic::Ordering::Relaxed);
                    text
                })
            })
            .eventsource(),
    );
    let mut done = false;
    // Silence is measured between chunks that carry something (text, reasoning, a tool-call
    // piece, usage, a finish reason): keep-alive comments or empty deltas alone kept a stuck
    // stream going for as long as they came (verification probe).
    let mut progress_deadline = tokio::time::Instant::now() + read_timeout;
    loop {
        let next = match tokio::time::timeout_at(progress_deadline, events.next()).await {
            Ok(next) => next,
            Err(_) => return Err(ProviderError::Stalled(read_timeout)),
        };
        let Some(event) = next else { break };
        let event = event.map_err(|e| match e {
            EventStreamError::Transport(e) if e.is_timeout() => ProviderError::Stalled(read_timeout),
            EventStreamError::Transport(e) => ProviderError::Transport(error_chain(&e)),
            other => ProviderError::Malformed(other.to_string()),
        })?;
        let data = event.data.trim();
        if data == "[DONE]" {
            done = true;
            break;
        }
        if data.is_empty() {
            continue;
        }
        let chunk = match serde_json::from_str::<Chunk>(data) {
            Ok(chunk) => chunk,
            Err(e) => {
                tracing::warn!(model.name = %model.id, error = %e, chunk_bytes = data.len(), "skipping malformed stream chunk");
                assembly.turn.malformed_chunks += 1;
                continue;
            }
        };
        if assembly.apply(chunk, data, model, on_delta)? {
            progress_deadline = tokio::time::Instant::now() + read_timeout;
        }
    }
    if let Some(error) = cut.lock().expect("not poisoned").take() {
        return Err(error);
    }
    assembly.invalid_utf8 = invalid.load(std::sync::atomic::Ordering::Relaxed);
    assembly.finish(done)
}

/// The length of the SSE event being read, from the bytes as they come: an event ends at an
/// empty line, and a line at CR, LF or CRLF (the SSE grammar).
#[derive(Debug, Default)]
struct EventLength {
    /// Bytes since the last event ended.
    event: usize,
    /// Bytes of the current line so far.
    line: usize,
    /// The previous byte was a CR (a following LF ends the same line).
    after_cr: bool,
}

impl EventLength {
    /// Reads `bytes`; returns the longest the current event was while they were read.
    fn feed(&mut self, bytes: &[u8]) -> usize {
        let mut longest = self.event;
        for &b in bytes {
            match b {
                b'\n' if self.after_cr => self.after_cr = false,
                b'\r' | b'\n' => {
                    self.after_cr = b == b'\r';
                    if self.line == 0 {
                        self.event = 0;
                    } else {
                        self.event += 1;
                    }
                    self.line = 0;
                }
                _ => {
                    self.after_cr = false;
                    self.line += 1;
                    self.event += 1;
                    longest = longest.max(self.event);
                }
            }
        }
        longest
    }
}

/// `bytes` (the next read of a stream; `pending` holds what the previous read left) as UTF-8:
/// every invalid sequence becomes U+FFFD (counted in `replaced`), and a sequence cut at the end
/// of the read is kept in `pending` for the next. The SSE decoder failed the whole stream on one invalid byte — the
/// run failed `model_malformed_response` and the answer, paid for, was lost (acceptance probe
/// N, N-3; local servers stream byte-fallback tokens as partial UTF-8).
fn lossy_utf8(pending: &mut Vec<u8>, bytes: &[u8], replaced: &mut usize) -> Vec<u8> {
    pending.extend_from_slice(bytes);
    let mut out = Vec::with_capacity(pending.len());
    let mut rest: &[u8] = pending;
    loop {
        match std::str::from_utf8(rest) {
            Ok(valid) => {
                out.extend_from_slice(valid.as_bytes());
                rest = &[];
                break;
            }
            Err(e) => {
                let (valid, after) = rest.split_at(e.valid_up_to());
                out.extend_from_slice(valid);
                match e.error_len() {
                    Some(bad) => {
                        *replaced += 1;
                        out.extend_from_slice(char::REPLACEMENT_CHARACTER.to_string().as_bytes());
                        rest = &after[bad..];
                    }
                    None => {
                        rest = after;
                        break;
                    }
                }
            }
        }
    }
    *pending = rest.to_vec();
    out
}

/// The body of a non-streamed answer, at most `max_bytes` (else
/// [`ProviderError::TooLarge`]); each read waits at most `read_timeout`.
async fn read_body(mut response: reqwest::Response, read_timeout: Duration, max_bytes: usize) -> Result<Vec<u8>, ProviderError> {
    let mut body = Vec::new();
    loop {
        let chunk = match tokio::time::timeout(read_timeout, response.chunk()).await {
            Err(_) => return Err(ProviderError::Stalled(read_timeout)),
            Ok(Err(e)) if e.is_timeout() => return Err(ProviderError::Stalled(read_timeout)),
            Ok(Err(e)) => return Err(ProviderError::Transport(error_chain(&e))),
            Ok(Ok(None)) => return Ok(body),
            Ok(Ok(Some(chunk))) => chunk,
        };
        if body.len() + chunk.len() > max_bytes {
            return Err(ProviderError::TooLarge(max_bytes / 4));
        }
        body.extend_from_slice(&chunk);
    }
}

/// A turn being assembled from chunks, bounded by `MODEL_MAX_ANSWER_BYTES`.
#[derive(Default)]
struct Assembly {
    turn: AssistantTurn,
    calls: Vec<PartialCall>,
    answer_bytes: usize,
    max_answer_bytes: usize,
    /// Invalid UTF-8 sequences of the stream, each read as U+FFFD.
    invalid_utf8: usize,
}

impl Assembly {
    fn grow(&mut self, bytes: usize) -> Result<(), ProviderError> {
        self.answer_bytes += bytes;
        if self.answer_bytes > self.max_answer_bytes { Err(ProviderError::TooLarge(self.max_answer_bytes)) } else { Ok(()) }
    }

    /// Adds one chunk (`data` is its text, for error messages). Returns whether it carried
    /// part of the answer (text, reasoning, a refusal, a tool-call piece, usage or a finish
    /// reason), which resets the idle deadline. Errors: an `error` object in the chunk
    /// ([`ProviderError::Http`]), or the answer growing past its cap.
    fn apply(
        &mut self,
        chunk: Chunk,
        data: &str,
        model: &ModelConfig,
        on_delta: &mut (dyn FnMut(StreamDelta) + Send),
    ) -> Result<bool, ProviderError> {
        if let Some(error) = chunk.error.filter(|e| !e.is_null()) {
            let status = error
                .get("code")
                .and_then(Value::as_u64)
                .and_then(|c| u16::try_from(c).ok())
                .filter(|c| (400..600).contains(c))
                .unwrap_or(502);
            let message = provider_message(
                Some(&serde_json::json!({ "error": error })),
                data,
                StatusCode::BAD_GATEWAY,
                model.api_key.as_deref(),
            );
            return Err(ProviderError::Http { status, message });
        }
        let mut carries = false;
        if chunk.usage.is_some() {
            self.turn.usage = chunk.usage;
            carries = true;
        }
        if self.turn.response_model.is_none() {
            self.turn.response_model = chunk.model.filter(|m| !m.is_empty());
        }
        let Some(choice) = chunk.choices.and_then(|c| c.into_iter().next()) else {
            return Ok(carries);
        };
        if choice.finish_reason.is_some() {
            self.turn.finish_reason = choice.finish_reason;
            carries = true;
        }
        let Some(delta) = choice.delta else { return Ok(carries) };
        // A refusal (OpenAI's `refusal`, sent instead of content) is the answer the user sees.
        for text in [delta.content, delta.refusal].into_iter().flatten().filter(|t| !t.is_empty()) {
            carries = true;
            self.grow(text.len())?;
            self.turn.content.push_str(&text);
            on_delta(StreamDelta::Text(text));
        }
        let reasoning = [delta.reasoning_content, delta.reasoning, delta.thinking]
            .into_iter()
            .flatten()
            .find(|t| !t.is_empty());
        if let Some(text) = reasoning {
            carries = true;
            self.grow(text.len())?;
            self.turn.reasoning.get_or_insert_default().push_str(&text);
            on_delta(StreamDelta::Reasoning(text));
        }
        for part in delta.tool_calls.into_iter().flatten() {
            carries = true;
            let named = part.function.as_ref().and_then(|f| f.name.as_deref()).is_some_and(|n| !n.is_empty());
            let position = call_slot(&mut self.calls, part.index, part.id.as_deref(), named);
            if self.calls.len() > MAX_TOOL_CALLS_PER_ANSWER {
                return Err(ProviderError::TooManyToolCalls);
            }
            let slot = &mut self.calls[position];
            if slot.id.is_none() {
                slot.id = part.id.filter(|id| !id.is_empty());
            }
            let Some(function) = part.function else { continue };
            // The name comes whole in one delta (OpenAI), again in every delta (some servers),
            // or in pieces (others): a piece that differs is appended.
            let name = function.name.filter(|n| !n.is_empty() && *n != slot.name);
            let arguments = function.arguments.unwrap_or_default();
            self.grow(name.as_ref().map_or(0, String::len) + arguments.len())?;
            let slot = &mut self.calls[position];
            if let Some(name) = name {
                slot.name.push_str(&name);
            }
            slot.arguments.push_str(&arguments);
        }
        Ok(carries)
    }

    /// The assembled turn; `done` is whether the stream ended with `[DONE]` (or was a whole
    /// JSON answer). Errors: [`ProviderError::Truncated`] (neither `[DONE]` nor a finish
    /// reason), [`ProviderError::Malformed`] (unreadable chunks in an answer with tool calls, or
    /// in an answer of which nothing else could be read).
    fn finish(mut self, done: bool) -> Result<AssistantTurn, ProviderError> {
        if !done && self.turn.finish_reason.is_none() {
            return Err(ProviderError::Truncated);
        }
        if self.turn.malformed_chunks > 0 && !self.calls.is_empty() {
            return Err(ProviderError::Malformed(format!(
                "{} stream chunk(s) could not be read in a response with tool calls: their arguments cannot be trusted, so none runs",
                self.turn.malformed_chunks
            )));
        }
        // An invalid byte in a call's name or arguments changed them as a skipped chunk would
        // (verifier P: `calculator` ran `1+1\u{FFFD}`): none of the calls runs. Text keeps its U+FFFD.
        if self.invalid_utf8 > 0 && self.calls.iter().any(|c| c.name.contains('\u{FFFD}') || c.arguments.contains('\u{FFFD}')) {
            return Err(ProviderError::Malformed(format!(
                "{} invalid UTF-8 sequence(s) in a response with tool calls changed a call's name or arguments: none runs",
                self.invalid_utf8
            )));
        }
        if self.turn.malformed_chunks > 0 && self.calls.is_empty() && self.turn.content.is_empty() && self.turn.reasoning.as_deref().is_none_or(str::is_empty) {
            // Nothing of the answer could be read: "completed" with an empty answer would hide
            // that the provider's answer was lost (acceptance probe N, N-4).
            return Err(ProviderError::Malformed(format!(
                "none of the answer could be read: {} stream chunk(s) were not chat-completion JSON",
                self.turn.malformed_chunks
            )));
        }
        self.turn.tool_calls = self
            .calls
            .into_iter()
            .map(|c| ToolCall {
                id: c.id.unwrap_or_else(|| format!("call_{}", uuid::Uuid::new_v4().simple())),
                name: c.name,
                arguments: c.arguments,
            })
            .collect();
        Ok(self.turn)
    }
}

/// The position in `calls` of the call a tool-call delta continues: the latest with the same
/// `index` whose id is not another one — a delta that brings a different id and a function
/// name at a used index starts a new call (two calls at one index, probe D), while a different
/// id without a name continues the call (servers that mint an id per delta); without an
/// index, the one with the same `id`; without either, the latest call. A new call is started
/// when none matches. `named`: the delta carries a non-empty `function.name`.
fn call_slot(calls: &mut Vec<PartialCall>, index: Option<usize>, id: Option<&str>, named: bool) -> usize {
    let found = match (index, id.filter(|id| !id.is_empty())) {
        (Some(index), Some(id)) => calls
            .iter()
            .rposition(|c| c.index == Some(index) && (!named || c.id.as_deref().is_none_or(|known| known == id))),
        (Some(index), None) => calls.iter().rposition(|c| c.index == Some(index)),
        (None, Some(id)) => calls.iter().rposition(|c| c.id.as_deref() == Some(id)),
        (None, None) => calls.len().checked_sub(1),
    };
    found.unwrap_or_else(|| {
        calls.push(PartialCall {
            index,
            ..PartialCall::default()
        });
        calls.len() - 1
    })
}

/// The provider's error text: `error.message`, a string `error`, or `message` from a JSON
/// body, else the raw body, else the status reason; the key redacted, cut to 500 characters.
fn provider_message(
    json: Option<&Value>,
    raw: &str,
    status: StatusCode,
    api_key: Option<&str>,
) -> String {
    let from_json = json.and_then(|v| {
        let error = v.get("error");
        error
            .and_then(|e| e.get("message"))
            .or(error)
            .or_else(|| v.get("message"))
            .and_then(Value::as_str)
    });
    let mut message = from_json.unwrap_or(raw).trim().to_owned();
    if message.is_empty() {
        message = status.canonical_reason().unwrap_or("no message").to_owned();
    }
    if let Some(key) = api_key.filter(|k| !k.is_empty()) {
        message = message.replace(key, "[redacted]");
    }
    if message.chars().count() > MAX_ERROR_MESSAGE_CHARS {
        message = message
            .chars()
            .take(MAX_ERROR_MESSAGE_CHARS)
            .collect::<String>()
            + "…";
    }
    message
}

/// An error with its source chain (`reqwest`'s own message omits the cause).
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use serde_json::json;
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::{TcpListener, TcpStream},
    };

    use super::*;
    use crate::provider::ModelCatalog;

    fn http(status: &str, headers: &str, body: &str) -> String {
        format!("HTTP/1.1 {status}\r\nConnection: close\r\n{headers}\r\n{body}")
    }

    fn sse(events: &[&str]) -> String {
        let body: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
        http("200 OK", "Content-Type: text/event-stream\r\n", &body)
    }

    fn model(base_url: &str) -> ModelConfig {
        ModelCatalog::from_env_vars(base_url, Some("sk-test"), "m", None)
            .unwrap()
            .models
            .remove(0)
    }

    /// Reads one HTTP/1.1 request (headers and `Content-Length` body) as text.
    async fn read_request(socket: &mut TcpStream) -> String {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let text = String::from_utf8_lossy(&buf);
            if let Some(end) = text.find("\r\n\r\n") {
                let length = text[..end]
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")?
                            .trim()
                            .parse()
                            .ok()
                    })
                    .unwrap_or(0usize);
                if buf.len() >= end + 4 + length {
                    return text.into_owned();
                }
            }
            let n = socket.read(&mut chunk).await.unwrap();
            assert!(n > 0, "client closed before sending a full request");
            buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Serves one canned response per connection, in order; returns the model pointing at it
    /// and the requests seen.
    async fn serve(responses: Vec<String>) -> (ModelConfig, Arc<Mutex<Vec<String>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base_url = format!("http://{}/v1", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            for response in responses {
                let (mut socket, _) = listener.accept().await.unwrap();
                let request = read_request(&mut socket).await;
                log.lock().unwrap().push(request);
                socket.write_all(response.as_bytes()).await.unwrap();
                let _ = socket.shutdown().await;
            }
        });
        (model(&base_url), seen)
    }

    /// A server that writes each `(pause, bytes)` piece after its pause, on every connection,
    /// then keeps the connection open for 30 s (a stream that stalls).
    async fn serve_paced(pieces: Vec<(Duration, String)>) -> ModelConfig {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base_url = format!("http://{}/v1", listener.local_addr().unwrap());
        let pieces = Arc::new(pieces);
        tokio::spawn(async move {
            loop {
                let Ok((mut socket, _)) = listener.accept().await else { return };
                let pieces = pieces.clone();
                tokio::spawn(async move {
                    read_request(&mut socket).await;
                    for (pause, bytes) in pieces.iter() {
                        tokio::time::sleep(*pause).await;
                        if socket.write_all(bytes.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                    tokio::time::sleep(Duration::from_secs(30)).await;
                });
            }
        });
        model(&base_url)
    }

    async fn chat(
        client: &ProviderClient,
        model: &ModelConfig,
        request: &ChatRequest,
    ) -> (Result<AssistantTurn, ProviderError>, Vec<StreamDelta>) {
        let mut deltas = Vec::new();
        let result = client
            .stream_chat(model, request, &mut |d| deltas.push(d))
            .await;
        (result, deltas)
    }

    fn request_json(raw: &str) -> Value {
        serde_json::from_str(raw.split_once("\r\n\r\n").unwrap().1).unwrap()
    }

    #[tokio::test]
    async fn assembles_text_reasoning_and_usage() {
        let (mut model, seen) = serve(vec![sse(&[
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","reasoning_content":"Let me"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"reasoning":" think"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"Hel"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"stop"}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}"#,
            "[DONE]",
        ])])
        .await;
        model.supports_tools = false;
        let request = ChatRequest {
            messages: vec![json!({"role": "user", "content": "hi"})],
            tools: vec![json!({"type": "function", "function": {"name": "x"}})],
            tool_choice: Some(json!("auto")),
            max_tokens: Some(64),
            ..ChatRequest::default()
        };
        let (result, deltas) = chat(&ProviderClient::new(), &model, &request).await;
        let turn = result.unwrap();
        assert_eq!(turn.content, "Hello");
        assert_eq!(turn.reasoning.as_deref(), Some("Let me think"));
        assert_eq!(turn.finish_reason.as_deref(), Some("stop"));
        assert_eq!(
            turn.usage,
            Some(Usage {
                prompt_tokens: 7,
                completion_tokens: 3,
                total_tokens: 10
            })
        );
        assert_eq!(
            deltas,
            [
                StreamDelta::Reasoning("Let me".into()),
                StreamDelta::Reasoning(" think".into()),
                StreamDelta::Text("Hel".into()),
                StreamDelta::Text("lo".into()),
            ]
        );
        let raw = seen.lock().unwrap()[0].clone();
        assert!(raw.starts_with("POST /v1/chat/completions "));
        assert!(
            raw.to_ascii_lowercase()
                .contains("authorization: bearer sk-test")
        );
        let body = request_json(&raw);
        assert_eq!(body["model"], "m");
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["max_tokens"], 64);
        assert!(body.get("tools").is_none() && body.get("tool_choice").is_none());
    }

    /// A server that ignores `stream: true` and answers one `chat.completion` object is read
    /// as one delta (it was `model_stream_truncated`); a refusal is the answer's text; the same
    /// bounds hold.
    #[tokio::test]
    async fn a_whole_json_answer_and_a_refusal_are_read() {
        let json_answer = |body: &str| http("200 OK", "Content-Type: application/json; charset=utf-8\r\n", body);
        let (model, _) = serve(vec![
            json_answer(
                r#"{"id":"x","object":"chat.completion","model":"m-1","choices":[{"index":0,"message":{"role":"assistant","content":"Hi","reasoning_content":"think","tool_calls":[{"id":"c1","type":"function","function":{"name":"calculator","arguments":"{\"expression\":\"1+1\"}"}},{"type":"function","function":{"name":"sleep","arguments":"{}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#,
            ),
            sse(&[r#"{"choices":[{"delta":{"refusal":"I can't help with that."},"finish_reason":"stop"}]}"#, "[DONE]"]),
            json_answer(r#"{"error":{"message":"overloaded","code":503}}"#),
            json_answer(r#"{"not":"a completion"#),
            json_answer(&format!(r#"{{"choices":[{{"message":{{"content":"{}"}},"finish_reason":"stop"}}]}}"#, "x".repeat(5000))),
        ])
        .await;
        let client = ProviderClient::with_limits(Duration::from_secs(5), 1000);
        let (result, deltas) = chat(&client, &model, &ChatRequest::default()).await;
        let turn = result.unwrap();
        assert_eq!((turn.content.as_str(), turn.reasoning.as_deref(), turn.finish_reason.as_deref()), ("Hi", Some("think"), Some("tool_calls")));
        assert_eq!(deltas, [StreamDelta::Text("Hi".into()), StreamDelta::Reasoning("think".into())]);
        let calls: Vec<_> = turn.tool_calls.iter().map(|c| (c.name.as_str(), c.arguments.as_str())).collect();
        assert_eq!(calls, [("calculator", r#"{"expression":"1+1"}"#), ("sleep", "{}")], "two calls, the second without an id");
        assert_eq!(turn.tool_calls[0].id, "c1");
        assert_eq!((turn.usage.unwrap().total_tokens, turn.response_model.as_deref()), (7, Some("m-1")));

        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        assert_eq!(result.unwrap().content, "I can't help with that.");
        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        assert!(matches!(result, Err(ProviderError::Http { status: 503, ref message }) if message.contains("overloaded")), "{result:?}");
        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        assert_eq!(result.unwrap_err().code(), "model_malformed_response");
        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        assert_eq!(result.unwrap_err().code(), "model_answer_too_large");
    }

    #[tokio::test]
    async fn assembles_parallel_tool_calls() {
        let (model, seen) = serve(vec![sse(&[
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"calculator","arguments":"{\"expr"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":1,"id":"call_b","function":{"name":"current_time","arguments":""}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"ession\":\"1+1\"}"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":1,"function":{"arguments":"{}"}},{"index":2,"function":{"name":"sleep","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":3,"id":"call_d","function":{"name":"cur","arguments":""}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":3,"id":"call_d","function":{"name":"rent_time","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":4,"id":"call_e","function":{"name":"sleep","arguments":"{\"s\":"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":4,"id":"call_e","function":{"name":"sleep","arguments":"1}"}}]}}]}"#,
            r#"{"choices":[{"delta":{},"finish_reason":"tool_calls"}]}"#,
            "[DONE]",
        ])])
        .await;
        let request = ChatRequest {
            tools: vec![json!({"type": "function", "function": {"name": "calculator"}})],
            tool_choice: Some(json!("required")),
            ..ChatRequest::default()
        };
        let (result, deltas) = chat(&ProviderClient::new(), &model, &request).await;
        let turn = result.unwrap();
        assert!(deltas.is_empty() && turn.content.is_empty());
        assert_eq!(turn.malformed_chunks, 0);
        assert_eq!(turn.finish_reason.as_deref(), Some("tool_calls"));
        let calls: Vec<_> = turn
            .tool_calls
            .iter()
            .map(|c| (c.name.as_str(), c.arguments.as_str()))
            .collect();
        // A name in pieces is joined; a name repeated in every delta is kept once.
        assert_eq!(
            calls,
            [
                ("calculator", r#"{"expression":"1+1"}"#),
                ("current_time", "{}"),
                ("sleep", "{}"),
                ("current_time", "{}"),
                ("sleep", r#"{"s":1}"#)
            ]
        );
        assert_eq!(
            (
                turn.tool_calls[0].id.as_str(),
                turn.tool_calls[1].id.as_str()
            ),
            ("call_a", "call_b")
        );
        assert!(turn.tool_calls[2].id.starts_with("call_") && turn.tool_calls[2].id.len() > 10);
        let body = request_json(&seen.lock().unwrap()[0]);
        assert_eq!(body["tools"][0]["function"]["name"], "calculator");
        assert_eq!(body["tool_choice"], "required");
    }

    /// Acceptance probe: a malformed chunk between two argument pieces was skipped and the
    /// pieces joined into other valid JSON (`{"amount":1` + `,"to":"x"}`: the effect ran with
    /// amount 1, not 1000000); two calls at one index with different ids were merged into one.
    #[tokio::test]
    async fn a_malformed_chunk_voids_the_tool_calls_and_a_new_id_at_an_index_is_a_new_call() {
        let (model, _) = serve(vec![
            sse(&[
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"call_a","function":{"name":"pay","arguments":"{\"amount\":1"}}]}}]}"#,
                "{\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"000000",
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":",\"to\":\"x\"}"}}]}}]}"#,
                r#"{"choices":[{"delta":{},"finish_reason":"tool_calls"}]}"#,
                "[DONE]",
            ]),
            sse(&[
                r#"{"choices":[{"delta":{"content":"Hel"}}]}"#,
                "{not json",
                r#"{"choices":[{"delta":{"content":"lo"},"finish_reason":"stop"}]}"#,
                "[DONE]",
            ]),
            sse(&[
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"call_x","function":{"name":"fx_any","arguments":"{}"}}]}}]}"#,
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"call_y","function":{"name":"fx_ok","arguments":"{\"amount\":"}}]}}]}"#,
                // A server that mints an id for every delta: no name, so the same call.
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"call_z","function":{"arguments":"15}"}}]}}]}"#,
                r#"{"choices":[{"delta":{},"finish_reason":"tool_calls"}]}"#,
                "[DONE]",
            ]),
            // Every piece of text unreadable: no answer, not an empty one (N-4).
            sse(&["{\"choices\":[{\"delta\":{\"content\":\"Hel", "{not json", r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#, "[DONE]"]),
        ])
        .await;
        let client = ProviderClient::new().with_max_retries(0);
        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        let error = result.unwrap_err();
        assert_eq!(error.code(), "model_malformed_response", "{error}");
        // A text answer with a skipped chunk is still an answer (nothing runs from it).
        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        let turn = result.unwrap();
        assert_eq!((turn.content.as_str(), turn.malformed_chunks), ("Hello", 1));
        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        let calls: Vec<_> = result.unwrap().tool_calls.into_iter().map(|c| (c.id, c.name, c.arguments)).collect();
        assert_eq!(
            calls,
            [
                ("call_x".to_owned(), "fx_any".to_owned(), "{}".to_owned()),
                ("call_y".to_owned(), "fx_ok".to_owned(), r#"{"amount":15}"#.to_owned())
            ]
        );
        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        let error = result.unwrap_err();
        assert_eq!(error.code(), "model_malformed_response", "{error}");
    }

    /// Acceptance probe: a stream that sent a few chunks and then nothing, its connection open,
    /// held its slot forever; an answer of 40 MB was assembled in memory.
    #[tokio::test]
    async fn a_silent_stream_is_stalled_and_a_huge_answer_is_cut() {
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n";
        let chunk = r#"data: {"choices":[{"delta":{"content":"0123456789"}}]}"#;
        // Then silence, with the connection open.
        let model = serve_paced(vec![(Duration::ZERO, format!("{head}{chunk}\n\n"))]).await;
        let client = ProviderClient::with_limits(Duration::from_millis(300), DEFAULT_MAX_ANSWER_BYTES).with_max_retries(0);
        let started = std::time::Instant::now();
        let (result, deltas) = chat(&client, &model, &ChatRequest::default()).await;
        assert_eq!(result.unwrap_err().code(), "model_stream_stalled");
        assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
        assert_eq!(deltas.len(), 1, "what came before the silence was streamed");

        let words: Vec<String> = (0..40).map(|i| format!(r#"{{"choices":[{{"delta":{{"content":"{}"}}}}]}}"#, "x".repeat(100 + i))).collect();
        let mut events: Vec<&str> = words.iter().map(String::as_str).collect();
        events.push("[DONE]");
        let (model, _) = serve(vec![sse(&events)]).await;
        let client = ProviderClient::with_limits(DEFAULT_READ_TIMEOUT, 1000).with_max_retries(0);
        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        assert_eq!(result.unwrap_err().code(), "model_answer_too_large");

        // Empty deltas are read too: a flood of them is cut at WIRE_BYTES_PER_ANSWER_BYTE times
        // the cap.
        let empty: Vec<&str> = std::iter::repeat_n(r#"{"choices":[{"delta":{}}]}"#, 3000).chain(["[DONE]"]).collect();
        let (model, _) = serve(vec![sse(&empty)]).await;
        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        assert_eq!(result.unwrap_err().code(), "model_stream_too_large");

        // A token per chunk in a provider's envelope: 17 times the answer on the wire (and four
        // times the cap) for an answer within the cap (acceptance probe N, N-2: cut at four times, the paid answer lost).
        let envelope = format!(r#"{{"id":"chatcmpl-1","object":"chat.completion.chunk","model":"m","obfuscation":"{}","choices":[{{"index":0,"delta":{{"content":"xxxxxxxxxx"}},"finish_reason":null}}]}}"#, "p".repeat(60));
        let tokens: Vec<&str> = std::iter::repeat_n(envelope.as_str(), 90).chain([r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#, "[DONE]"]).collect();
        let (model, _) = serve(vec![sse(&tokens)]).await;
        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        assert_eq!(result.unwrap().content, "x".repeat(900));

        // `data:` lines that never end their event (no blank line): the decoder would hold them
        // all; cut at EVENT_BYTES_PER_ANSWER_BYTE times the cap of what was read (verifier P,
        // P-2: a worker grew to 2 GB; before, this ended only when the stream stalled).
        let line = format!("data: {}\n", "y".repeat(100));
        let model = serve_paced(vec![(Duration::ZERO, format!("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n{}", line.repeat(500)))]).await;
        let client = ProviderClient::with_limits(Duration::from_secs(3), 1000).with_max_retries(0);
        let started = std::time::Instant::now();
        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        let error = result.unwrap_err();
        assert!(matches!(error, ProviderError::EventTooLarge(2000)), "{error:?} after {:?}", started.elapsed());
        assert_eq!(error.code(), "model_stream_too_large");
    }

    #[test]
    fn an_event_ends_at_an_empty_line_of_any_line_ending() {
        let mut e = EventLength::default();
        assert_eq!(e.feed(b"data: 12345\r\n"), 11);
        assert_eq!(e.feed(b"data: 12\r\n\r\ndata: 1"), 20, "the second line counts to the first event");
        assert_eq!(e.event, 7, "a new event after the empty line (CRLF)");
        assert_eq!(e.feed(b"\n\ndata: x\r\rdata: yy\n"), 8);
        assert_eq!(e.event, 9, "CR alone ends lines and events too");
    }

    /// Acceptance probe N, N-3: invalid UTF-8 in a stream is replaced, not fatal; a character
    /// cut between two reads is whole.
    #[tokio::test]
    async fn invalid_utf8_in_a_stream_is_replaced_and_a_cut_character_joined() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let model = model(&format!("http://{}/v1", listener.local_addr().unwrap()));
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            read_request(&mut socket).await;
            let mut body = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: text/event-stream\r\n\r\n".to_vec();
            body.extend_from_slice(b"data: {\"choices\":[{\"delta\":{\"content\":\"bad \xff\xfe, \xe2\x82");
            let cut = body.len();
            body.extend_from_slice(b"\xac ok\"}}]}\n\ndata: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n");
            socket.write_all(&body[..cut]).await.unwrap();
            socket.flush().await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            socket.write_all(&body[cut..]).await.unwrap();
            let _ = socket.shutdown().await;
        });
        let (result, _) = chat(&ProviderClient::new().with_max_retries(0), &model, &ChatRequest::default()).await;
        assert_eq!(result.unwrap().content, "bad \u{FFFD}\u{FFFD}, \u{20AC} ok");
    }

    /// Verifier P: an invalid byte in a tool call's arguments ran the call with U+FFFD in them
    /// (`calculator` got `1+1\u{FFFD}`); like a skipped chunk, it voids the calls.
    #[tokio::test]
    async fn an_invalid_byte_in_tool_call_arguments_voids_the_calls() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let model = model(&format!("http://{}/v1", listener.local_addr().unwrap()));
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            read_request(&mut socket).await;
            let mut body = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: text/event-stream\r\n\r\n".to_vec();
            body.extend_from_slice(b"data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c1\",\"function\":{\"name\":\"pay\",\"arguments\":\"{\\\"to\\\":\\\"a\xff\\\"}\"}}]}}]}\n\n");
            body.extend_from_slice(b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\ndata: [DONE]\n\n");
            socket.write_all(&body).await.unwrap();
            let _ = socket.shutdown().await;
        });
        let (result, _) = chat(&ProviderClient::new().with_max_retries(0), &model, &ChatRequest::default()).await;
        let error = result.unwrap_err();
        assert_eq!(error.code(), "model_malformed_response", "{error}");
    }

    #[test]
    fn lossy_utf8_keeps_a_cut_sequence_for_the_next_read() {
        let (mut pending, mut replaced) = (Vec::new(), 0);
        assert_eq!(lossy_utf8(&mut pending, b"a\xe2\x82", &mut replaced), b"a");
        assert_eq!(lossy_utf8(&mut pending, b"\xacb\xff", &mut replaced), "\u{20AC}b\u{FFFD}".as_bytes());
        assert!(pending.is_empty());
        assert_eq!(replaced, 1);
    }

    /// Acceptance probe N, N-5: one answer with 40,000 tool calls took 17 s to assemble
    /// (quadratic) and 650 MiB; calls past MAX_TOOL_CALLS_PER_ANSWER cut the stream.
    #[tokio::test]
    async fn an_answer_with_too_many_tool_calls_is_cut() {
        let calls: Vec<String> = (0..=MAX_TOOL_CALLS_PER_ANSWER)
            .map(|i| format!(r#"{{"choices":[{{"delta":{{"tool_calls":[{{"index":{i},"id":"c{i}","function":{{"name":"calculator","arguments":"{{}}"}}}}]}}}}]}}"#))
            .collect();
        let mut events: Vec<&str> = calls.iter().map(String::as_str).collect();
        events.extend([r#"{"choices":[{"delta":{},"finish_reason":"tool_calls"}]}"#, "[DONE]"]);
        let (model, _) = serve(vec![sse(&events)]).await;
        let client = ProviderClient::new().with_max_retries(0);
        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        assert_eq!(result.unwrap_err().code(), "model_too_many_tool_calls");
        // One fewer is an answer.
        events.remove(MAX_TOOL_CALLS_PER_ANSWER);
        let (model, _) = serve(vec![sse(&events)]).await;
        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        assert_eq!(result.unwrap().tool_calls.len(), MAX_TOOL_CALLS_PER_ANSWER);
    }

    /// Verification probe: keep-alive comments (or empty deltas) every second kept a stuck
    /// stream going for as long as they came; silence is measured between chunks that carry
    /// part of the answer.
    #[tokio::test]
    async fn keep_alives_alone_do_not_keep_a_stream_going() {
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n";
        let mut pieces = vec![(Duration::ZERO, format!("{head}data: {{\"choices\":[{{\"delta\":{{\"content\":\"hi\"}}}}]}}\n\n"))];
        for i in 0..100 {
            let beat = if i % 2 == 0 { ": keep-alive\n\n" } else { "data: {\"choices\":[{\"delta\":{}}]}\n\n" };
            pieces.push((Duration::from_millis(100), beat.to_owned()));
        }
        let model = serve_paced(pieces).await;
        let client = ProviderClient::with_limits(Duration::from_millis(700), DEFAULT_MAX_ANSWER_BYTES).with_max_retries(0);
        let started = std::time::Instant::now();
        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        assert_eq!(result.unwrap_err().code(), "model_stream_stalled");
        assert!(started.elapsed() < Duration::from_secs(4), "{:?}", started.elapsed());
    }

    #[tokio::test]
    async fn stream_end_without_done_or_finish_is_truncated() {
        let (model, _) = serve(vec![
            sse(&[r#"{"choices":[{"delta":{"content":"partial"}}]}"#]),
            sse(&[r#"{"choices":[{"delta":{"content":"whole"},"finish_reason":"stop"}]}"#]),
        ])
        .await;
        let client = ProviderClient::new();
        let (result, deltas) = chat(&client, &model, &ChatRequest::default()).await;
        assert_eq!(result, Err(ProviderError::Truncated));
        assert_eq!(result.unwrap_err().code(), "model_stream_truncated");
        assert_eq!(deltas, [StreamDelta::Text("partial".into())]);
        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        assert_eq!(result.unwrap().content, "whole");
    }

    #[tokio::test]
    async fn error_object_in_stream_is_an_http_error() {
        let (model, _) = serve(vec![sse(&[
            r#"{"choices":[{"delta":{"content":"a"}}]}"#,
            r#"{"error":{"code":500,"message":"context overflow"}}"#,
        ])])
        .await;
        let (result, _) = chat(&ProviderClient::new(), &model, &ChatRequest::default()).await;
        assert_eq!(
            result,
            Err(ProviderError::Http {
                status: 500,
                message: "context overflow".into()
            })
        );
    }

    #[tokio::test]
    async fn retries_503_then_succeeds() {
        let (model, seen) = serve(vec![
            http(
                "503 Service Unavailable",
                "Content-Type: application/json\r\nRetry-After: 0\r\n",
                r#"{"error":{"message":"overloaded"}}"#,
            ),
            sse(&[
                r#"{"choices":[{"delta":{"content":"ok"},"finish_reason":"stop"}]}"#,
                "[DONE]",
            ]),
        ])
        .await;
        let (result, _) = chat(&ProviderClient::new(), &model, &ChatRequest::default()).await;
        assert_eq!(result.unwrap().content, "ok");
        assert_eq!(seen.lock().unwrap().len(), 2);
    }

    #[tokio::test]
    async fn retries_408_then_succeeds() {
        let (model, seen) = serve(vec![
            http("408 Request Timeout", "Content-Type: application/json\r\n", r#"{"error":{"message":"timed out"}}"#),
            sse(&[r#"{"choices":[{"delta":{"content":"ok"},"finish_reason":"stop"}]}"#, "[DONE]"]),
        ])
        .await;
        let (result, _) = chat(&ProviderClient::new(), &model, &ChatRequest::default()).await;
        assert_eq!(result.unwrap().content, "ok");
        assert_eq!(seen.lock().unwrap().len(), 2);
    }

    #[tokio::test]
    async fn rate_limit_after_retries() {
        let limited = http(
            "429 Too Many Requests",
            "Retry-After: 0\r\n",
            r#"{"error":{"message":"slow down"}}"#,
        );
        let (model, seen) = serve(vec![limited.clone(), limited]).await;
        let client = ProviderClient::new().with_max_retries(1);
        let (result, _) = chat(&client, &model, &ChatRequest::default()).await;
        let error = result.unwrap_err();
        assert_eq!(
            error,
            ProviderError::RateLimited {
                message: "slow down".into()
            }
        );
        assert_eq!(error.code(), "model_rate_limited");
        assert_eq!(seen.lock().unwrap().len(), 2);
    }

    #[tokio::test]
    async fn bad_request_is_not_retried_and_hides_the_key() {
        let long = "x".repeat(600);
        let body = json!({"error": {"message": format!("bad key sk-test {long}")}}).to_string();
        let (model, seen) = serve(vec![
            http(
                "400 Bad Request",
                "Content-Type: application/json\r\n",
                &body,
            ),
            sse(&["[DONE]"]),
        ])
        .await;
        let (result, _) = chat(&ProviderClient::new(), &model, &ChatRequest::default()).await;
        let Err(ProviderError::Http {
            status: 400,
            message,
        }) = result
        else {
            panic!("expected HTTP 400, got {result:?}");
        };
        assert!(message.starts_with("bad key [redacted] xxx") && !message.contains("sk-test"));
        assert_eq!(message.chars().count(), 501);
        assert_eq!(seen.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn connect_failure_is_a_transport_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base_url = format!("http://{}/v1", listener.local_addr().unwrap());
        drop(listener);
        let client = ProviderClient::new().with_max_retries(0);
        let (result, _) = chat(&client, &model(&base_url), &ChatRequest::default()).await;
        assert_eq!(result.unwrap_err().code(), "model_transport_error");
    }

    #[tokio::test]
    async fn dropping_the_future_aborts_the_request() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let model = model(&format!("http://{}/v1", listener.local_addr().unwrap()));
        let (closed_tx, closed_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            read_request(&mut socket).await;
            let head = sse(&[r#"{"choices":[{"delta":{"content":"a"}}]}"#]);
            socket.write_all(head.as_bytes()).await.unwrap();
            let mut rest = [0u8; 64];
            while socket.read(&mut rest).await.is_ok_and(|n| n > 0) {}
            let _ = closed_tx.send(());
        });
        let client = ProviderClient::new();
        let request = ChatRequest::default();
        let call = chat(&client, &model, &request);
        assert!(
            tokio::time::timeout(Duration::from_millis(300), call)
                .await
                .is_err()
        );
        tokio::time::timeout(Duration::from_secs(5), closed_rx)
            .await
            .unwrap()
            .unwrap();
    }
}
