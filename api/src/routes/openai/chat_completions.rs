//! `POST /v1/chat/completions` — OpenAI-compatible, through the same durable loop (SPEC §13,
//! issue 12 part 1).
//!
//! The request's messages (validated and repaired by the import rules,
//! `agentloop_shared::import::messages`) become the canonical history of a hidden thread with one
//! run, enqueued like a chat post and executed by a worker (the api never calls a model); see
//! [`super::hidden`] for the thread's lifetime (deleted when the request ends; cancelled and
//! deleted when the client goes away or this process dies). There is no durable checkpoint to
//! resume from on the caller's side, so a run that would need a second slice (the per-slice
//! tool-call limit) fails with `max_iterations` (seed 000), and a tool that needs approval
//! fails closed.
//!
//! The answer's `content` is the text of every assistant message of the run, joined by a blank
//! line (the text a model says before a server-side tool call, then the final answer); the
//! server's own tool calls are never exposed. Client-side `tools` (OpenAI function specs) are
//! offered to the model next to the server's; a call of one ends the run and is returned as
//! `tool_calls` with `finish_reason: "tool_calls"` (see `agentloop_worker::client_tools` for
//! name clashes — the client's tool wins — and mixed turns); when earlier server calls of the run
//! took effect, the returned calls are noted first and the client's next request carrying them
//! gets those server calls back in the model's context (migration 000038, [`ended`]).
//! `stream: true` answers with
//! `chat.completion.chunk` server-sent events ([`super::stream`]). An `Idempotency-Key` makes a
//! resend attach to the request's run or get its recorded outcome ([`super::hidden`], migration
//! 000036).

use std::time::Duration;

use actix_web::{HttpResponse, Responder, ResponseError, web};
use actix_web_lab::sse;
use agentloop_shared::import::{self, Limits};
use agentloop_shared::messages::{self, role};
use agentloop_shared::runs::{self, Run, status};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use utoipa::ToSchema;
use uuid::Uuid;

use super::hidden::{HiddenRequests, Started};
use super::V1Error;
use crate::AppState;
use crate::hub::Hub;
use agentloop_shared::db::PgPool;
use agentloop_shared::store::Store;
use crate::extract::Authenticated;

/// The error of a request whose credential stopped authenticating while it waited.
const REVOKED: &str = "the API key of this request was revoked or expired (or its session ended) while it ran; \
     the request ended as if its client had gone (a keyed request's run goes on for a resend with a valid key)";

/// Longest wait for the run.
pub const MAX_WAIT: Duration = Duration::from_secs(600);
/// Most client tools per request (OpenAI's own bound).
const MAX_TOOLS: usize = 128;

/// `stream_options`.
#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and `choices: []`) before `[DONE]`.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The request (OpenAI Chat Completions). `max_completion_tokens` (or the older `max_tokens`)
/// and `temperature` are the run's generation settings (the hidden thread's `maxTokens` and
/// `temperature`). `stop`, `response_format`, `tool_choice`, `logprobs` / `top_logprobs`,
/// `modalities`, `audio` and the deprecated `functions` / `function_call` other than their
/// defaults would change the answer's contract and are refused (400 `unsupported_parameter`);
/// other fields (`top_p`, `seed`, penalties, `user`, ...) are accepted and ignored.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ChatCompletionRequest {
    /// A configured model id (`GET /v1/models`); the server's default when absent.
    #[serde(default)]
    pub model: Option<String>,
    /// OpenAI chat messages (system, developer, user, assistant with `tool_calls`, tool).
    #[schema(value_type = Vec<Object>)]
    pub messages: Vec<Value>,
    /// Answer with `chat.completion.chunk` server-sent events ending with `data: [DONE]`.
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Client-side tools: `[{"type":"function","function":{"name","description"?,"parameters"?}}]`.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
    /// Choices per request; only 1 is supported.
    #[serde(default)]
    pub n: Option<u32>,
    /// Most tokens each model call of the run may generate (a positive integer).
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// The older name of `max_completion_tokens`.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Sampling temperature, 0 to 2.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Only absent, `null` or empty.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub stop: Option<Value>,
    /// Only `{"type": "text"}`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub response_format: Option<Value>,
    /// Only `"auto"`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// Only `false`.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// Only absent or `null`.
    #[serde(default)]
    pub top_logprobs: Option<Value>,
    /// The deprecated form of `tools`: only absent or empty (send `tools`).
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub functions: Option<Value>,
    /// The deprecated form of `tool_choice`: only `"auto"`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub function_call: Option<Value>,
    /// Only `["text"]`.
    #[serde(default)]
    #[schema(value_type = Option<Vec<String>>)]
    pub modalities: Option<Value>,
    /// Only absent or `null` (no audio output).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub audio: Option<Value>,
}

impl ChatCompletionRequest {
    /// The run's generation settings (`{maxTokens?, temperature?}`, merged into the hidden
    /// thread's metadata), or 400 `invalid_request` / `unsupported_parameter` naming the field.
    fn settings(&self) -> Result<Value, V1Error> {
        let unsupported = |param: &str, what: &str| {
            Err(V1Error::bad_request("unsupported_parameter", param, format!("{param} is not supported by this server: {what}")))
        };
        if self.stop.as_ref().is_some_and(|s| !(s.is_null() || s.as_str() == Some("") || s.as_array().is_some_and(Vec::is_empty))) {
            return unsupported("stop", "the model's answer is not cut at stop sequences");
        }
        if self.response_format.as_ref().is_some_and(|f| !f.is_null() && f["type"] != "text") {
            return unsupported("response_format", "answers are text; structured outputs are not enforced");
        }
        if self.tool_choice.as_ref().is_some_and(|c| !c.is_null() && c != "auto") {
            return unsupported("tool_choice", "the model always chooses (\"auto\")");
        }
        if self.logprobs == Some(true) || self.top_logprobs.as_ref().is_some_and(|v| !v.is_null()) {
            let param = if self.logprobs == Some(true) { "logprobs" } else { "top_logprobs" };
            return unsupported(param, "log probabilities are not returned");
        }
        // The deprecated function-calling fields and the output modalities: the same rule.
        if self.functions.as_ref().is_some_and(|f| !(f.is_null() || f.as_array().is_some_and(Vec::is_empty))) {
            return unsupported("functions", "send client functions as `tools`");
        }
        if self.function_call.as_ref().is_some_and(|c| !c.is_null() && c != "auto") {
            return unsupported("function_call", "the model always chooses (\"auto\")");
        }
        if self.modalities.as_ref().is_some_and(|m| !m.is_null() && m != &json!(["text"])) {
            return unsupported("modalities", "answers are text");
        }
        if self.audio.as_ref().is_some_and(|a| !a.is_null()) {
            return unsupported("audio", "answers are text");
        }
        let mut settings = serde_json::Map::new();
        let (param, max) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(n), _) => ("max_completion_tokens", Some(n)),
            (None, n) => ("max_tokens", n),
        };
        if let Some(n) = max {
            if n == 0 || n > u64::from(u32::MAX) {
                return Err(V1Error::bad_request("invalid_request", param, format!("{param} must be a positive integer")));
            }
            settings.insert("maxTokens".into(), json!(n));
        }
        if let Some(t) = self.temperature {
            if !(0.0..=2.0).contains(&t) {
                return Err(V1Error::bad_request("invalid_request", "temperature", "temperature must be a number from 0 to 2"));
            }
            settings.insert("temperature".into(), json!(t));
        }
        Ok(Value::Object(settings))
    }
}

/// What the run left for the caller.
pub struct Answer {
    pub content: String,
    /// Client-side calls (`{id, type, function: {name, arguments}}`).
    pub tool_calls: Vec<Value>,
    /// The provider's `finish_reason` when it cut the last answer (`length`, ...).
    pub cut: Option<String>,
}

/// Runs the conversation in `messages` to its final answer (or its client-side tool calls).
/// 200 `chat.completion` (or an SSE stream). Errors in OpenAI's shape: 400 `invalid_messages` /
/// `invalid_tools` / `unsupported_n` (with `param`), 401 `invalid_api_key`, 404
/// `model_not_found`, 413, 502 with the failed run's code (`max_iterations`,
/// `model_unavailable`, ...), 504 `timeout`. Every error after the run was created carries
/// `x-should-retry: false` ([`final_error`]).
pub async fn chat_completions(
    state: web::Data<AppState>,
    hidden: web::Data<HiddenRequests>,
    who: Authenticated,
    req: actix_web::HttpRequest,
    body: crate::extract::Json<ChatCompletionRequest>,
) -> Result<actix_web::Either<HttpResponse, impl Responder>, V1Error> {
    let body = body.into_inner();
    if body.n.is_some_and(|n| n != 1) {
        return Err(V1Error::bad_request("unsupported_n", "n", "only n = 1 is supported"));
    }
    let limits = Limits { max_messages: agentloop_shared::commands::OPENAI_MAX_MESSAGES, max_message_bytes: 4 * 1024 * 1024 };
    let (history, _) = import::messages(&body.messages, "messages", &limits).map_err(|e| {
        let code = if e.code == "invalid_import" { "invalid_messages" } else { e.code };
        V1Error::bad_request(code, e.param, e.message)
    })?;
    let history: Vec<messages::NewMessage> = history.into_iter().map(|m| m.message).collect();
    let client_tools = client_tools(body.tools.as_deref().unwrap_or_default())?;
    let settings = body.settings()?;
    let model = match body.model.as_deref() {
        Some(m) if state.catalog.get(m).is_some() => m.to_owned(),
        Some(m) => {
            return Err(V1Error {
                status: actix_web::http::StatusCode::NOT_FOUND,
                code: "model_not_found".into(),
                message: format!("The model '{m}' does not exist on this server (GET /v1/models lists them)"),
                param: Some("model".into()),
            });
        }
        None => state
            .catalog
            .default_model()
            .map(|m| m.id.clone())
            .ok_or_else(|| V1Error::bad_request("no_model", "model", "no model is configured on this server"))?,
    };
    let include_usage = body.stream_options.as_ref().and_then(|o| o.include_usage) == Some(true);
    let stream = body.stream == Some(true);
    // A resend by an SDK (after its timeout or a dropped connection) with the same key attaches
    // to the first request's run or gets its outcome (migration 000036).
    let key = crate::extract::idempotency_key(&req)?.map(|key| {
        let fingerprint = agentloop_shared::receipts::fingerprint(&json!({
            "op": "v1.chat.completions", "model": model, "messages": body.messages, "tools": body.tools, "settings": settings,
        }));
        (format!("v1:{key}"), fingerprint)
    });
    let key_ref = key.as_ref().map(|(command_id, fingerprint)| agentloop_shared::commands::OpenAiKey { command_id, fingerprint });
    let request = match hidden.clone().into_inner().start(who.0.id, &model, &history, &client_tools, &settings, key_ref).await? {
        Started::Open(request) => request,
        Started::Replay(recorded) => return Ok(actix_web::Either::Left(replay(&req, &recorded, stream, include_usage))),
        Started::Interrupted { thread_id, run_id } => {
            return Ok(actix_web::Either::Left(interrupted(&state.pool, &state.store, &req, thread_id, run_id, stream, include_usage).await));
        }
    };
    let chunker = super::stream::Chunker::new(request.run_id, &request.model, include_usage);
    // A client that goes away ends its request at once: dropping the `HiddenRequest` cancels the
    // run and deletes the hidden thread (actix itself would wait for a failed write).
    let peer = crate::connection::PeerSocket::of(&req);
    // So does its key's revocation (or expiry, or its session's end), as for live-update
    // streams (acceptance probe H: a revoked key's stream went on for a minute).
    let watch = state.limits.watch(who.0.id, who.1);
    let revoked = watch.revoked();
    if stream {
        let (tx, rx) = mpsc::channel::<sse::Event>(64);
        let last_words = tx.clone();
        let pump = super::stream::pump(state.clone(), request, chunker, tx);
        actix_web::rt::spawn(async move {
            let _watch = watch;
            tokio::select! {
                () = pump => {}
                () = crate::connection::client_gone(peer) => {}
                () = revoked.cancelled() => {
                    let _ = last_words.send(super::stream::Chunker::error("credentials_revoked", REVOKED)).await;
                }
            }
        });
        // The keep-alive comments also reveal a client that went away while nothing else is
        // written (the write fails, the stream is dropped, the pump sees its channel closed).
        return Ok(actix_web::Either::Right(
            sse::Sse::from_infallible_receiver(rx)
                .with_keep_alive(Duration::from_secs(2))
                .customize()
                .insert_header(("Cache-Control", "no-cache, no-transform"))
                .insert_header(("X-Accel-Buffering", "no")),
        ));
    }
    let waited = tokio::select! {
        waited = wait_for_end(&state.pool, &state.store, &state.hub, request.principal, request.thread_id, request.run_id) => waited,
        () = crate::connection::client_gone(peer) => {
            drop(request);
            return Ok(actix_web::Either::Left(final_error(&V1Error {
                status: actix_web::http::StatusCode::from_u16(499).unwrap_or(actix_web::http::StatusCode::BAD_REQUEST),
                code: "client_closed_request".into(),
                message: "the client closed the connection; the run was cancelled".into(),
                param: None,
            })));
        }
        () = revoked.cancelled() => {
            drop(request);
            return Ok(actix_web::Either::Left(final_error(&V1Error {
                status: actix_web::http::StatusCode::UNAUTHORIZED,
                code: "credentials_revoked".into(),
                message: REVOKED.into(),
                param: None,
            })));
        }
    };
    drop(watch);
    let result = match waited {
        Ok(finished) => ended(&state.pool, &state.store, &chunker, request.thread_id, request.run_id, &finished).await,
        Err(e) => Err(e),
    };
    let response = request.keyed().then(|| recorded(&result));
    request.finish(result.is_ok(), response).await;
    Ok(actix_web::Either::Left(match result {
        Ok(body) => HttpResponse::Ok().json(body),
        Err(e) => final_error(&e),
    }))
}

/// The answer of a run that ended: the `chat.completion` when it completed, else its error
/// (502 with the run's code; an uncertain call's message names the kept thread).
///
/// A completed run's client calls are noted before they are returned
/// ([`agentloop_shared::commands::openai_note_client_calls`]): the client's next request gets the
/// server's own calls of this run put back before them (migration 000038).
pub async fn ended(
    pool: &PgPool,
    store: &Store,
    chunker: &super::stream::Chunker,
    thread_id: Uuid,
    run_id: Uuid,
    finished: &Run,
) -> Result<Value, V1Error> {
    if finished.status == status::COMPLETED {
        let answer = answer(pool, thread_id, run_id).await?;
        if !answer.tool_calls.is_empty() {
            agentloop_shared::commands::openai_note_client_calls(store, thread_id).await?;
        }
        return Ok(completion(chunker, &answer, finished.prompt_tokens, finished.completion_tokens));
    }
    let mut error = run_error(finished);
    if error.code == "operation_uncertain" {
        error.message = super::uncertain_message(&error.message, thread_id, run_id);
    }
    Err(error)
}

/// The answer to a resend of a keyed request that ended without its outcome recorded (its api
/// died; its thread was kept as the record of an effect): the run's answer or error read from
/// the thread, or 502 `request_interrupted` when the run was cut short (cancelled).
async fn interrupted(
    pool: &PgPool,
    store: &Store,
    req: &actix_web::HttpRequest,
    thread_id: Uuid,
    run_id: Uuid,
    stream: bool,
    include_usage: bool,
) -> HttpResponse {
    let outcome = match run_of(pool, run_id).await {
        Ok(run) if run.is_terminal() && run.status != status::CANCELLED => {
            let chunker = super::stream::Chunker::new(run_id, &run.model, include_usage);
            ended(pool, store, &chunker, thread_id, run_id, &run).await
        }
        Ok(_) => Err(V1Error {
            status: actix_web::http::StatusCode::BAD_GATEWAY,
            code: "request_interrupted".into(),
            message: format!(
                "the request first sent with this Idempotency-Key was interrupted (its server stopped) after its tool calls \
                 took effect; it is not run again. Thread {thread_id} (run {run_id}) holds what happened"
            ),
            param: None,
        }),
        Err(e) => return e.error_response(),
    };
    replay(req, &recorded(&outcome), stream, include_usage)
}

/// The run `run_id` (504 `request_expired` when the sweep removed it).
pub async fn run_of(pool: &PgPool, run_id: Uuid) -> Result<Run, V1Error> {
    let mut conn = pool.get().await?;
    Ok(runs::get(&mut conn, run_id).await?)
}

/// A request's outcome as kept on its receipt for resends of its key: `{status, body}`.
pub fn recorded(result: &Result<Value, V1Error>) -> Value {
    match result {
        Ok(body) => json!({"status": 200, "body": body}),
        Err(e) => json!({"status": e.status.as_u16(), "body": e.body()}),
    }
}

/// The answer to a resend of a keyed request that ended: its recorded outcome, as JSON or (for
/// `stream: true`) as the chunks of that completion, with `Idempotent-Replayed: true`.
fn replay(req: &actix_web::HttpRequest, recorded: &Value, stream: bool, include_usage: bool) -> HttpResponse {
    let status = recorded["status"].as_u64().and_then(|s| actix_web::http::StatusCode::from_u16(s as u16).ok());
    let status = status.unwrap_or(actix_web::http::StatusCode::BAD_GATEWAY);
    let body = &recorded["body"];
    if !stream {
        let mut response = HttpResponse::build(status);
        if !status.is_success() {
            response.insert_header(("x-should-retry", "false"));
        }
        response.insert_header(("Idempotent-Replayed", "true")).json(body)
    } else {
        let mut events = Vec::new();
        if status.is_success() {
            let chunker = super::stream::Chunker {
                id: body["id"].as_str().unwrap_or_default().to_owned(),
                created: body["created"].as_i64().unwrap_or_default(),
                model: body["model"].as_str().unwrap_or_default().to_owned(),
                include_usage,
            };
            let message = &body["choices"][0]["message"];
            events.push(chunker.chunk(json!({"role": "assistant", "content": ""}), None));
            if let Some(text) = message["content"].as_str().filter(|t| !t.is_empty()) {
                events.push(chunker.chunk(json!({"content": text}), None));
            }
            if let Some(calls) = message["tool_calls"].as_array() {
                events.push(chunker.tool_calls(calls));
            }
            events.push(chunker.chunk(json!({}), body["choices"][0]["finish_reason"].as_str()));
            if include_usage {
                let usage = &body["usage"];
                events.push(chunker.usage(usage["prompt_tokens"].as_i64().unwrap_or(0), usage["completion_tokens"].as_i64().unwrap_or(0)));
            }
            events.push(sse::Event::Data(sse::Data::new("[DONE]")));
        } else {
            let error = &body["error"];
            events.push(super::stream::Chunker::error(
                error["code"].as_str().unwrap_or("server_error"),
                error["message"].as_str().unwrap_or_default(),
            ));
        }
        let (tx, rx) = mpsc::channel::<sse::Event>(events.len().max(1));
        for event in events {
            let _ = tx.try_send(event);
        }
        drop(tx);
        sse::Sse::from_infallible_receiver(rx)
            .customize()
            .insert_header(("Cache-Control", "no-cache, no-transform"))
            .insert_header(("Idempotent-Replayed", "true"))
            .respond_to(req)
            .map_into_boxed_body()
    }
}

/// The response of an error that happened after the request's run was created: the run may have
/// executed tools with external effects, so the caller's SDK must not send the request again by
/// itself. OpenAI's SDKs resend every 5xx (and 408, 409, 429) unless the response says
/// `x-should-retry: false` (acceptance probe: one non-streaming request whose model failed after
/// a payment tool ran performed the payment three times under three keys).
fn final_error(error: &V1Error) -> HttpResponse {
    let mut response = error.error_response();
    response.headers_mut().insert(
        actix_web::http::header::HeaderName::from_static("x-should-retry"),
        actix_web::http::header::HeaderValue::from_static("false"),
    );
    response
}

/// Validates client tools: `type: "function"`, a name `^[a-zA-Z0-9_-]{1,64}$` used once,
/// `parameters` an object when given. Returns the specs as offered to the model.
pub fn client_tools(tools: &[Value]) -> Result<Vec<Value>, V1Error> {
    if tools.len() > MAX_TOOLS {
        return Err(V1Error::bad_request("invalid_tools", "tools", format!("at most {MAX_TOOLS} tools")));
    }
    let mut names = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(V1Error::bad_request("invalid_tools", format!("tools[{i}].type"), "only tools of type \"function\" are supported"));
        }
        let function = tool.get("function").and_then(Value::as_object);
        let name = function.and_then(|f| f.get("name")).and_then(Value::as_str).unwrap_or_default();
        let valid = (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !valid {
            return Err(V1Error::bad_request(
                "invalid_tools",
                format!("tools[{i}].function.name"),
                "a function name must match ^[a-zA-Z0-9_-]{1,64}$",
            ));
        }
        if !names.insert(name.to_owned()) {
            return Err(V1Error::bad_request("invalid_tools", format!("tools[{i}].function.name"), format!("function '{name}' is declared twice")));
        }
        let parameters = function.and_then(|f| f.get("parameters"));
        if parameters.is_some_and(|p| !p.is_object() && !p.is_null()) {
            return Err(V1Error::bad_request("invalid_tools", format!("tools[{i}].function.parameters"), "parameters must be a JSON Schema object"));
        }
        let mut spec = json!({"name": name, "parameters": parameters.filter(|p| p.is_object()).cloned().unwrap_or_else(|| json!({"type": "object", "properties": {}}))});
        if let Some(d) = function.and_then(|f| f.get("description")).and_then(Value::as_str) {
            spec["description"] = json!(d);
        }
        if let Some(s) = function.and_then(|f| f.get("strict")).and_then(Value::as_bool) {
            spec["strict"] = json!(s);
        }
        out.push(json!({"type": "function", "function": spec}));
    }
    Ok(out)
}

/// Waits until the run ends. A run that waits for a human (an approval, an uncertain effect)
/// cannot be resolved by a stateless caller: it is cancelled and reported with its error. A
/// database that fails meanwhile is waited out like the streaming pump does, up to
/// [`MAX_WAIT`] (504 `timeout`): the run goes on, and answering 503 "retry later" for a request
/// whose tool calls may have taken effect invited a resend (acceptance probe F: a payment made,
/// 503 answered, the run completed afterwards).
pub async fn wait_for_end(pool: &PgPool, store: &Store, hub: &Hub, principal: Uuid, thread_id: Uuid, run_id: Uuid) -> Result<Run, V1Error> {
    let mut wake = hub.subscribe(thread_id);
    let deadline = tokio::time::Instant::now() + MAX_WAIT;
    loop {
        wake.borrow_and_update();
        match settled(pool, store, principal, thread_id, run_id).await {
            Ok(Some(run)) => return Ok(run),
            Ok(None) => {}
            // The request's run is gone (the sweep removed it): nothing to wait for.
            Err(e) if e.code == "request_expired" => return Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "reading an OpenAI request's run failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => continue,
                    _ = tokio::time::sleep_until(deadline) => {}
                }
            }
        }
        tokio::select! {
            _ = wake.changed() => {}
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            _ = tokio::time::sleep_until(deadline) => {
                return Err(V1Error { status: actix_web::http::StatusCode::GATEWAY_TIMEOUT, code: "timeout".into(),
                                     message: "the run did not finish in time".into(), param: None });
            }
        }
    }
}

/// The run once it ended (`None` while it runs); one waiting for a human is cancelled first
/// (see [`wait_for_end`]).
async fn settled(pool: &PgPool, store: &Store, principal: Uuid, thread_id: Uuid, run_id: Uuid) -> Result<Option<Run>, V1Error> {
    let mut current = run_of(pool, run_id).await?;
    if matches!(current.status.as_str(), status::BLOCKED | status::WAITING_APPROVAL) {
        let error = (current.error_code.clone(), current.error_message.clone());
        agentloop_shared::commands::openai_cancel(store, principal, thread_id).await?;
        current = run_of(pool, run_id).await?;
        (current.error_code, current.error_message) = error;
        current.error_code.get_or_insert_with(|| "operation_uncertain".into());
    }
    Ok(current.is_terminal().then_some(current))
}

/// The error of a run that did not complete (502 with its code; `budget_exhausted` reads
/// `max_iterations`, seed 000).
pub fn run_error(run: &Run) -> V1Error {
    let code = match run.error_code.as_deref() {
        Some("budget_exhausted") => "max_iterations",
        Some(other) => other,
        None => run.status.as_str(),
    };
    V1Error {
        status: actix_web::http::StatusCode::BAD_GATEWAY,
        code: code.to_owned(),
        message: run.error_message.clone().unwrap_or_else(|| format!("the run ended {}", run.status)),
        param: None,
    }
}

/// The assistant text of the run's messages (joined by a blank line) and its client calls.
pub async fn answer(pool: &PgPool, thread_id: Uuid, run_id: Uuid) -> Result<Answer, V1Error> {
    let mut conn = pool.get().await?;
    let rows = messages::active_after(&mut conn, thread_id, 0).await?;
    let mine: Vec<_> = rows.iter().filter(|m| m.run_id == Some(run_id) && m.role == role::ASSISTANT).collect();
    let content = mine.iter().map(|m| m.text()).filter(|t| !t.is_empty()).collect::<Vec<_>>().join("\n\n");
    let tool_calls = mine.last().map(|m| client_calls(m.tool_calls.as_ref())).unwrap_or_default();
    let cut = mine.last().and_then(|m| m.finish_reason.clone());
    Ok(Answer { content, tool_calls, cut })
}

/// The client-side calls of a `tool_calls` value, in OpenAI's shape.
pub fn client_calls(tool_calls: Option<&Value>) -> Vec<Value> {
    tool_calls
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|c| c.get("clientSide").and_then(Value::as_bool) == Some(true))
        .map(|c| json!({"id": c["id"], "type": "function", "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}))
        .collect()
}

/// The `usage` object of a run.
pub fn usage(run_prompt: i64, run_completion: i64) -> Value {
    json!({"prompt_tokens": run_prompt, "completion_tokens": run_completion, "total_tokens": run_prompt + run_completion})
}

fn completion(chunker: &super::stream::Chunker, answer: &Answer, prompt_tokens: i64, completion_tokens: i64) -> Value {
    let calls = !answer.tool_calls.is_empty();
    let mut message = json!({
        "role": "assistant",
        "content": if answer.content.is_empty() && calls { Value::Null } else { json!(answer.content) },
        "refusal": null,
    });
    if calls {
        message["tool_calls"] = json!(answer.tool_calls);
    }
    json!({
        "id": chunker.id,
        "object": "chat.completion",
        "created": chunker.created,
        "model": chunker.model,
        "system_fingerprint": null,
        "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": if calls { "tool_calls" } else { answer.cut.as_deref().unwrap_or("stop") }}],
        "usage": usage(prompt_tokens, completion_tokens),
    })
}
