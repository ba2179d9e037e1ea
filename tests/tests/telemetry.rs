//! OpenTelemetry (issue 12 part 6): with `OTEL_EXPORTER_OTLP_ENDPOINT` set, the api and the
//! worker export spans by OTLP/HTTP protobuf to an in-process receiver, and one chat turn is
//! one trace: the api's request span, the worker's slice span under it (the `traceparent`
//! stored on the run), the model calls with GenAI attributes and the tool call — and no message
//! text anywhere. Without the variable nothing is exported and the stack works as before.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentloop_tests::{Stack, StackOptions};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, any_value};
use prost::Message;
use serde_json::{Map, Value, json};

const T: Duration = Duration::from_secs(30);

/// One span as received, flattened for assertions.
#[derive(Debug, Clone)]
struct Received {
    service: String,
    trace: String,
    id: String,
    parent: String,
    name: String,
    kind: i32,
    attributes: Map<String, Value>,
    /// Span events (tracing events inside the span) with their attributes.
    events: Vec<Value>,
}

impl Received {
    fn attr(&self, key: &str) -> &Value {
        self.attributes.get(key).unwrap_or(&Value::Null)
    }
}

fn any(value: Option<&AnyValue>) -> Value {
    match value.and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => json!(s),
        Some(any_value::Value::BoolValue(b)) => json!(b),
        Some(any_value::Value::IntValue(i)) => json!(i),
        Some(any_value::Value::DoubleValue(d)) => json!(d),
        Some(any_value::Value::ArrayValue(a)) => Value::Array(a.values.iter().map(|v| any(Some(v))).collect()),
        Some(any_value::Value::KvlistValue(kv)) => Value::Object(kv.values.iter().map(|kv| (kv.key.clone(), any(kv.value.as_ref()))).collect()),
        Some(any_value::Value::BytesValue(b)) => json!(hex(b)),
        _ => Value::Null,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An OTLP/HTTP receiver: `POST /v1/traces` with an `ExportTraceServiceRequest` in protobuf.
struct Receiver {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<Received>>>,
    posts: Arc<Mutex<usize>>,
    _task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    async fn start(addr: &str) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let spans: Arc<Mutex<Vec<Received>>> = Arc::default();
        let posts: Arc<Mutex<usize>> = Arc::default();
        let (s, p) = (spans.clone(), posts.clone());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (spans, posts) = (s.clone(), p.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let (spans, posts) = (spans.clone(), posts.clone());
                        async move {
                            let path = req.uri().path().to_owned();
                            let body = req.into_body().collect().await?.to_bytes();
                            *posts.lock().unwrap() += 1;
                            if path == "/v1/traces"
                                && let Ok(export) = ExportTraceServiceRequest::decode(body)
                            {
                                spans.lock().unwrap().extend(flatten(&export));
                            }
                            Ok::<_, hyper::Error>(
                                Response::builder()
                                    .header("content-type", "application/x-protobuf")
                                    .body(Full::new(Bytes::new()))
                                    .expect("response"),
                            )
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
                });
            }
        });
        Ok(Self { addr, spans, posts, _task: task })
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn spans(&self) -> Vec<Received> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits until `pred` holds for the spans received so far.
    async fn wait_for(&self, what: &str, pred: impl Fn(&[Received]) -> bool) -> Vec<Received> {
        let deadline = Instant::now() + T;
        loop {
            let spans = self.spans();
            if pred(&spans) {
                return spans;
            }
            assert!(Instant::now() < deadline, "{what}: not received within {T:?}; got {:#?}", names(&spans));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn flatten(export: &ExportTraceServiceRequest) -> Vec<Received> {
    let mut out = Vec::new();
    for rs in &export.resource_spans {
        let service = rs
            .resource
            .as_ref()
            .and_then(|r| r.attributes.iter().find(|kv| kv.key == "service.name"))
            .and_then(|kv| any(kv.value.as_ref()).as_str().map(str::to_owned))
            .unwrap_or_default();
        for ss in &rs.scope_spans {
            for span in &ss.spans {
                out.push(Received {
                    service: service.clone(),
                    trace: hex(&span.trace_id),
                    id: hex(&span.span_id),
                    parent: hex(&span.parent_span_id),
                    name: span.name.clone(),
                    kind: span.kind,
                    attributes: span.attributes.iter().map(|kv| (kv.key.clone(), any(kv.value.as_ref()))).collect(),
                    events: span
                        .events
                        .iter()
                        .map(|e| json!({"name": e.name, "attributes": e.attributes.iter().map(|kv| (kv.key.clone(), any(kv.value.as_ref()))).collect::<Map<_, _>>()}))
                        .collect(),
                });
            }
        }
    }
    out
}

fn names(spans: &[Received]) -> Vec<String> {
    spans.iter().map(|s| format!("{} {} {} parent={} trace={}", s.service, s.name, s.id, s.parent, s.trace)).collect()
}

fn otel_env(receiver: &Receiver) -> Vec<(String, String)> {
    vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), receiver.url()),
        ("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into()),
    ]
}

/// Posts `content` to a new thread (with `headers`), waits for the run to complete, and
/// returns `(run id, run JSON, messages)`.
async fn turn(stack: &Stack, content: &str, headers: &[(&str, &str)]) -> (String, Value, Vec<Value>) {
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let posted = c.send(reqwest::Method::POST, &format!("/api/threads/{thread}/chat"), Some(json!({"content": content})), headers).await.unwrap();
    assert_eq!(posted.status, 202, "{posted:?}");
    let run_id = posted.body["run"]["id"].as_str().unwrap().to_owned();
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let window = c.get(&format!("/api/threads/{thread}")).await.unwrap().body;
    (run_id, run, window["messages"].as_array().unwrap().clone())
}

#[tokio::test]
async fn one_chat_turn_is_one_trace_across_api_and_worker() {
    let receiver = Receiver::start("127.0.0.1:0").await.unwrap();
    let env = otel_env(&receiver);
    let options = StackOptions { api_env: env.clone(), worker_env: env, ..StackOptions::default() };
    let stack = Stack::start("otel_one_trace", options).await.unwrap();

    let question = "What is 12*7?";
    let (run_id, run, messages) = turn(&stack, question, &[]).await;
    let roles: Vec<&str> = messages.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"]);
    let answer = messages[3]["content"].as_str().unwrap().to_owned();
    assert_eq!(answer, "The result is 84.");
    let call_id = messages[1]["toolCalls"][0]["id"].as_str().unwrap().to_owned();

    // The run carries the api request span's context.
    let db = stack.db.client().await.unwrap();
    let stored: Option<String> =
        db.query_one("SELECT traceparent FROM runs WHERE id = $1::text::uuid", &[&run_id]).await.unwrap().get(0);
    let stored = stored.expect("the run stores a traceparent");
    assert_eq!(run["traceparent"], stored.as_str(), "the run's JSON shows it");
    let parts: Vec<&str> = stored.split('-').collect();
    assert_eq!(parts.len(), 4, "{stored}");
    let (trace, api_span) = (parts[1].to_owned(), parts[2].to_owned());

    let spans = receiver
        .wait_for("the api's chat request, the slice, two model calls and the tool call", |spans| {
            let in_trace: Vec<&Received> = spans.iter().filter(|s| s.trace == trace).collect();
            let Some(slice) = in_trace.iter().find(|s| s.name == "slice") else { return false };
            in_trace.iter().any(|s| s.id == api_span)
                && in_trace.iter().filter(|s| s.name == "chat mock" && s.parent == slice.id).count() >= 2
                && in_trace.iter().any(|s| s.name == "execute_tool calculator")
        })
        .await;
    let in_trace: Vec<&Received> = spans.iter().filter(|s| s.trace == trace).collect();
    let by_id = |id: &str| in_trace.iter().find(|s| s.id == id).copied();

    // The api's request span: a server span named by the route, the root of the trace.
    let request = by_id(&api_span).unwrap();
    assert_eq!(request.service, "agentloop-api");
    assert_eq!(request.name, "POST /api/threads/{id}/chat");
    assert_eq!(request.kind, 2, "SPAN_KIND_SERVER");
    assert_eq!(request.parent, "", "no incoming traceparent: the request span is the root");
    assert_eq!(request.attr("http.response.status_code"), &json!(202));

    // The worker's slice span is a child of the api's request span.
    let slice = in_trace.iter().find(|s| s.name == "slice").unwrap();
    assert_eq!(slice.service, "agentloop-worker");
    assert_eq!(slice.parent, api_span, "the slice joins the api's trace under its request span");
    assert_eq!(slice.attr("run.id"), &json!(run_id));

    // Model calls: children of the slice (or of the title task under it), GenAI attributes.
    let calls: Vec<&&Received> = in_trace.iter().filter(|s| s.name == "chat mock" && s.parent == slice.id).collect();
    assert_eq!(calls.len(), 2, "{:#?}", names(&spans));
    let mut reasons = Vec::new();
    for call in &calls {
        assert_eq!(call.service, "agentloop-worker");
        assert_eq!(call.kind, 3, "SPAN_KIND_CLIENT");
        assert_eq!(call.attr("gen_ai.operation.name"), "chat");
        assert_eq!(call.attr("gen_ai.provider.name"), "openai");
        assert_eq!(call.attr("gen_ai.system"), "openai");
        assert_eq!(call.attr("gen_ai.request.model"), "mock");
        assert!(call.attr("gen_ai.response.model").is_string(), "{call:?}");
        assert!(call.attr("gen_ai.usage.input_tokens").as_i64().unwrap() > 0, "{call:?}");
        assert!(call.attr("gen_ai.usage.output_tokens").as_i64().unwrap() > 0, "{call:?}");
        assert_eq!(call.attr("server.address"), "127.0.0.1");
        reasons.push(call.attr("gen_ai.response.finish_reasons").clone());
    }
    reasons.sort_by_key(|r| r.to_string());
    assert_eq!(reasons, [json!(["stop"]), json!(["tool_calls"])]);
    // The recorded usage is what the run counts.
    let input: i64 = calls.iter().map(|c| c.attr("gen_ai.usage.input_tokens").as_i64().unwrap()).sum();
    let output: i64 = calls.iter().map(|c| c.attr("gen_ai.usage.output_tokens").as_i64().unwrap()).sum();
    assert_eq!(input, run["promptTokens"].as_i64().unwrap());
    assert_eq!(output, run["completionTokens"].as_i64().unwrap());

    // The tool call.
    let tool = in_trace.iter().find(|s| s.name == "execute_tool calculator").unwrap();
    assert_eq!(tool.parent, slice.id);
    assert_eq!(tool.attr("gen_ai.operation.name"), "execute_tool");
    assert_eq!(tool.attr("gen_ai.tool.name"), "calculator");
    assert_eq!(tool.attr("gen_ai.tool.call.id"), &json!(call_id));

    // Resources name both services; nothing sent anywhere holds the message text.
    let services: std::collections::HashSet<&str> = in_trace.iter().map(|s| s.service.as_str()).collect();
    assert_eq!(services, ["agentloop-api", "agentloop-worker"].into_iter().collect());
    let everything = serde_json::to_string(&spans.iter().map(|s| json!([s.name, s.attributes, s.events])).collect::<Vec<_>>()).unwrap();
    for text in [question, "12*7", &answer, "The result is"] {
        assert!(!everything.contains(text), "{text:?} was exported in a span");
    }

    // A caller's `traceparent` header: the request span is its child, the worker's spans join.
    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let header = format!("00-{caller_trace}-00f067aa0ba902b7-01");
    let (run_id, _, _) = turn(&stack, "What is 2+3?", &[("traceparent", &header)]).await;
    let stored: Option<String> =
        db.query_one("SELECT traceparent FROM runs WHERE id = $1::text::uuid", &[&run_id]).await.unwrap().get(0);
    let stored = stored.unwrap();
    assert!(stored.starts_with(&format!("00-{caller_trace}-")), "{stored}");
    let spans = receiver
        .wait_for("the caller's trace", |spans| {
            spans.iter().any(|s| s.trace == caller_trace && s.name == "slice")
                && spans.iter().any(|s| s.trace == caller_trace && s.name == "POST /api/threads/{id}/chat")
        })
        .await;
    let request = spans.iter().find(|s| s.trace == caller_trace && s.name == "POST /api/threads/{id}/chat").unwrap();
    assert_eq!(request.parent, "00f067aa0ba902b7");
    let slice = spans.iter().find(|s| s.trace == caller_trace && s.name == "slice").unwrap();
    assert_eq!(slice.parent, request.id);
}

#[tokio::test]
async fn without_an_endpoint_nothing_is_exported() {
    // The SDK's default endpoint is http://localhost:4318: a receiver there would see anything
    // exported without configuration.
    let default_port = Receiver::start("127.0.0.1:4318").await.ok();
    if default_port.is_none() {
        eprintln!("127.0.0.1:4318 is in use: the check that nothing reaches the SDK's default endpoint is skipped");
    }
    let options = StackOptions {
        api_env: vec![("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into())],
        worker_env: vec![("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into())],
        ..StackOptions::default()
    };
    let stack = Stack::start("otel_off", options).await.unwrap();
    let (run_id, run, messages) = turn(&stack, "What is 12*7?", &[]).await;
    assert_eq!(messages.last().unwrap()["content"], "The result is 84.");
    let db = stack.db.client().await.unwrap();
    let stored: Option<String> =
        db.query_one("SELECT traceparent FROM runs WHERE id = $1::text::uuid", &[&run_id]).await.unwrap().get(0);
    assert_eq!(stored, None, "no trace context, none stored");
    assert!(run.get("traceparent").is_none(), "{run}");

    // A caller's valid traceparent is still stored (a worker that exports would join it); an
    // invalid one is ignored.
    let header = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let (run_id, run, _) = turn(&stack, "What is 2+3?", &[("traceparent", header)]).await;
    let stored: Option<String> =
        db.query_one("SELECT traceparent FROM runs WHERE id = $1::text::uuid", &[&run_id]).await.unwrap().get(0);
    assert_eq!(stored.as_deref(), Some(header));
    assert_eq!(run["traceparent"], header);
    let (run_id, _, _) = turn(&stack, "What is 3+4?", &[("traceparent", "00-zz-00f067aa0ba902b7-01")]).await;
    let stored: Option<String> =
        db.query_one("SELECT traceparent FROM runs WHERE id = $1::text::uuid", &[&run_id]).await.unwrap().get(0);
    assert_eq!(stored, None);

    tokio::time::sleep(Duration::from_millis(500)).await;
    if let Some(receiver) = default_port {
        assert_eq!(*receiver.posts.lock().unwrap(), 0, "nothing is exported without OTEL_EXPORTER_OTLP_ENDPOINT");
    }
}
