//! Webhooks on run state (issue 12, part 2): a real api, real workers, real PostgreSQL, and a
//! receiver in the test (hyper) that verifies every Standard Webhooks signature and timestamp on
//! its own (ring's HMAC, not the product's signer), counts every request per `webhook-id`, and
//! can fail the first attempts of each message or hold a request open while its worker is
//! SIGKILLed. Every name starts with `webhooks_`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentloop_tests::{Client, Sig, Stack, StackOptions, script};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);
/// A fixed key for the tests' stacks: secrets are stored encrypted with it.
const SECRETS_KEY: [u8; 32] = [42; 32];

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

fn secrets_key() -> String {
    B64.encode(SECRETS_KEY)
}

/// One request the receiver got.
#[derive(Debug, Clone)]
struct Received {
    id: String,
    timestamp: i64,
    /// The signature header verified against the secret, and the timestamp within 5 minutes.
    verified: bool,
    body: Value,
    /// The raw body and the signature header, for the README's verification snippet.
    raw: String,
    signature: String,
    /// What the receiver answered (0: held open, never answered).
    answered: u16,
    at: Instant,
}

/// What the receiver does with a request.
#[derive(Debug, Clone, Copy)]
enum Mode {
    /// 500 to the first `n` requests of each `webhook-id`, then 200.
    FailFirst(usize),
    /// Hold the first request of each `webhook-id` open (never answer), then 200.
    HoldFirst,
}

struct ReceiverState {
    key: Mutex<Option<Vec<u8>>>,
    mode: Mode,
    requests: Mutex<Vec<Received>>,
    held: AtomicUsize,
    verify_failures: AtomicUsize,
    stop_holding: AtomicBool,
}

/// A webhook receiver on 127.0.0.1.
struct Receiver {
    addr: SocketAddr,
    state: Arc<ReceiverState>,
}

impl Receiver {
    async fn start(mode: Mode) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(ReceiverState {
            key: Mutex::new(None),
            mode,
            requests: Mutex::default(),
            held: AtomicUsize::new(0),
            verify_failures: AtomicUsize::new(0),
            stop_holding: AtomicBool::new(false),
        });
        let shared = state.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                let state = shared.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| handle(state.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(hyper_util::rt::TokioIo::new(stream), service).await;
                });
            }
        });
        Self { addr, state }
    }

    fn url(&self) -> String {
        format!("http://{}/hooks/agentloop", self.addr)
    }

    /// Sets the signing secret (`whsec_...`) the receiver verifies with.
    fn set_secret(&self, secret: &str) {
        let key = B64.decode(secret.strip_prefix("whsec_").expect("whsec_ prefix")).expect("base64 secret");
        *self.state.key.lock().unwrap() = Some(key);
    }

    fn requests(&self) -> Vec<Received> {
        self.state.requests.lock().unwrap().clone()
    }

    /// Requests per `webhook-id`.
    fn by_id(&self) -> HashMap<String, Vec<Received>> {
        let mut map: HashMap<String, Vec<Received>> = HashMap::new();
        for r in self.requests() {
            map.entry(r.id.clone()).or_default().push(r);
        }
        map
    }

    /// Waits until `n` distinct messages were answered 200.
    async fn wait_delivered(&self, n: usize, timeout: Duration) -> HashMap<String, Vec<Received>> {
        let deadline = Instant::now() + timeout;
        loop {
            let by_id = self.by_id();
            if by_id.values().filter(|rs| rs.iter().any(|r| r.answered == 200)).count() >= n {
                return by_id;
            }
            assert!(Instant::now() < deadline, "{n} deliveries not received within {timeout:?}: {:?}", self.requests());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The receiver's own verification (Standard Webhooks): `v1,` + base64(HMAC-SHA256(key,
/// "{id}.{timestamp}.{body}")), among space-separated signatures; timestamp within 5 minutes.
fn verify(key: &[u8], id: &str, timestamp: &str, signatures: &str, body: &[u8]) -> bool {
    let Ok(ts) = timestamp.parse::<i64>() else { return false };
    if (chrono::Utc::now().timestamp() - ts).abs() > 300 {
        return false;
    }
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    let mut signed = format!("{id}.{timestamp}.").into_bytes();
    signed.extend_from_slice(body);
    signatures.split(' ').filter_map(|s| s.strip_prefix("v1,")).any(|sig| {
        B64.decode(sig).is_ok_and(|sig| ring::hmac::verify(&key, &signed, &sig).is_ok())
    })
}

async fn handle(
    state: Arc<ReceiverState>,
    req: hyper::Request<hyper::body::Incoming>,
) -> Result<hyper::Response<Full<Bytes>>, std::convert::Infallible> {
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let (id, timestamp, signature) = (header("webhook-id"), header("webhook-timestamp"), header("webhook-signature"));
    let content_type = header("content-type");
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let key = state.key.lock().unwrap().clone();
    let verified = content_type == "application/json" && key.is_some_and(|k| verify(&k, &id, &timestamp, &signature, &body));
    if !verified {
        state.verify_failures.fetch_add(1, Ordering::SeqCst);
    }
    let seen = state.requests.lock().unwrap().iter().filter(|r| r.id == id).count();
    let answer = match state.mode {
        Mode::FailFirst(n) if seen < n => 500,
        Mode::HoldFirst if seen == 0 && !state.stop_holding.load(Ordering::SeqCst) => 0,
        _ => 200,
    };
    state.requests.lock().unwrap().push(Received {
        id,
        timestamp: timestamp.parse().unwrap_or(0),
        verified,
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
        raw: String::from_utf8_lossy(&body).into_owned(),
        signature,
        answered: answer,
        at: Instant::now(),
    });
    if answer == 0 {
        state.held.fetch_add(1, Ordering::SeqCst);
        // Held open until the client goes away (its worker is killed).
        std::future::pending::<()>().await;
    }
    let text = if answer == 500 { "try again later" } else { "ok" };
    Ok(hyper::Response::builder().status(answer).body(Full::new(Bytes::from(text))).unwrap())
}

/// Creates a webhook; returns the 201 body.
async fn create_webhook(c: &Client, url: &str, events: &[&str]) -> Value {
    let r = c.post("/api/webhooks", json!({"url": url, "events": events, "description": "test receiver"})).await.unwrap();
    assert_eq!(r.status, 201, "{r:?}");
    r.body
}

async fn deliveries(c: &Client, webhook: &str) -> Vec<Value> {
    let r = c.get(&format!("/api/webhooks/{webhook}/deliveries")).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    r.body["deliveries"].as_array().unwrap().clone()
}

/// Polls the deliveries until `pred` holds for the list.
async fn wait_deliveries(c: &Client, webhook: &str, timeout: Duration, pred: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = Instant::now() + timeout;
    loop {
        let list = deliveries(c, webhook).await;
        if pred(&list) {
            return list;
        }
        assert!(Instant::now() < deadline, "deliveries did not reach the expected state: {list:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn ts(v: &Value) -> chrono::DateTime<chrono::Utc> {
    v.as_str().unwrap().parse().unwrap()
}

fn output_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../test-output/webhooks");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Completed, failed and waiting-for-approval runs each produce one delivery, retried through
/// the receiver's first two 500s with backoff, signed and verified, delivered exactly once per
/// `webhook-id` as far as the receiver's 2xx go; a cancellation (not subscribed) produces none.
#[tokio::test]
async fn webhooks_deliver_run_events_signed_and_retried_with_backoff() {
    let dir = output_dir();
    let tools = dir.join("tools-ask.json");
    std::fs::write(&tools, json!({"tools": {"calculator": {"policy": "ask"}}}).to_string()).unwrap();
    let key = secrets_key();
    let options = StackOptions {
        worker_env: env(&[
            ("TOOLS_FILE", tools.to_str().unwrap()),
            ("WEBHOOK_ALLOW_PRIVATE_TARGETS", "true"),
            ("WEBHOOK_SECRETS_KEY", &key),
            ("WEBHOOK_RETRY_BASE_MS", "300"),
            ("WEBHOOK_RETRY_MAX_MS", "2000"),
        ]),
        api_env: env(&[("WEBHOOK_ALLOW_PRIVATE_TARGETS", "true"), ("WEBHOOK_SECRETS_KEY", &key)]),
        ..Default::default()
    };
    let stack = Stack::start("webhooks_deliver", options).await.unwrap();
    let c = stack.client();
    let receiver = Receiver::start(Mode::FailFirst(2)).await;
    let created = create_webhook(&c, &receiver.url(), &["run.completed", "run.failed", "run.waiting_approval"]).await;
    let secret = created["secret"].as_str().unwrap();
    assert!(secret.starts_with("whsec_") && B64.decode(&secret[6..]).unwrap().len() == 32, "{created}");
    receiver.set_secret(secret);
    let webhook = created["id"].as_str().unwrap().to_owned();

    // The secret is shown once: never in reads, and stored encrypted.
    let listed = c.get("/api/webhooks").await.unwrap();
    assert_eq!(listed.status, 200);
    assert_eq!(listed.body["webhooks"].as_array().unwrap().len(), 1);
    assert!(!listed.body.to_string().contains(&secret[6..]) && listed.body["webhooks"][0].get("secret").is_none());
    let one = c.get(&format!("/api/webhooks/{webhook}")).await.unwrap();
    assert_eq!((one.status, &one.body["url"], &one.body["events"][2]), (200, &json!(receiver.url()), &json!("run.waiting_approval")));
    assert!(one.body.get("secret").is_none());
    let db = stack.db.client().await.unwrap();
    let stored: String = db.query_one("SELECT secret FROM webhooks", &[]).await.unwrap().get(0);
    assert!(stored.starts_with("v1:") && !stored.contains(&secret[6..]), "stored in the clear: {stored}");

    // Three runs: completed, failed (the model refuses the request: 400), waiting for approval.
    let thread_a = c.create_thread().await.unwrap();
    let completed = c.chat(&thread_a, &script(json!([{"text": "done"}]))).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    assert_eq!(c.wait_terminal(&completed, T).await.unwrap()["status"], "completed");
    let failed = c.chat(&thread_a, &script(json!([{"status": 400}]))).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    let failed_run = c.wait_terminal(&failed, T).await.unwrap();
    assert_eq!(failed_run["status"], "failed");
    let thread_b = c.create_thread().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]}, {"text": "It is {{tool_result}}."}]);
    let parked = c.chat(&thread_b, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    c.wait_run(&parked, T, |r| r["status"] == "waiting_approval").await.unwrap();

    let by_id = receiver.wait_delivered(3, T).await;
    // Cancel the parked run: `run.cancelled` is not subscribed, so no fourth delivery.
    let r = c.post(&format!("/api/runs/{parked}/cancel"), json!({})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    c.wait_terminal(&parked, T).await.unwrap();

    assert_eq!(receiver.state.verify_failures.load(Ordering::SeqCst), 0, "a request failed verification: {:?}", receiver.requests());
    let mut seen_runs = HashMap::new();
    for (id, requests) in &by_id {
        assert!(id.starts_with("msg_"), "{id}");
        assert_eq!(requests.len(), 3, "two 500s then one 200 for {id}: {requests:?}");
        assert_eq!(requests.iter().filter(|r| r.answered == 200).count(), 1, "a duplicate delivery of {id} after its 2xx");
        assert!(requests.iter().all(|r| r.verified && r.body == requests[0].body), "{requests:?}");
        assert!(requests.windows(2).all(|w| w[1].at - w[0].at >= Duration::from_millis(100)), "retried without backoff: {requests:?}");
        assert!(requests.windows(2).all(|w| w[1].timestamp >= w[0].timestamp));
        let event = &requests[0].body;
        seen_runs.insert(event["data"]["runId"].as_str().unwrap().to_owned(), event.clone());
    }
    let event = |run: &str| seen_runs.get(run).unwrap_or_else(|| panic!("no event for run {run}: {seen_runs:?}")).clone();
    let e = event(&completed);
    assert_eq!((&e["type"], &e["data"]["status"], &e["data"]["threadId"]), (&json!("run.completed"), &json!("completed"), &json!(thread_a)));
    assert!(e["timestamp"].as_str().is_some_and(|t| t.parse::<chrono::DateTime<chrono::Utc>>().is_ok()), "{e}");
    let e = event(&failed);
    assert_eq!((&e["type"], &e["data"]["errorCode"]), (&json!("run.failed"), &failed_run["error"]["code"]), "{e} / {failed_run}");
    assert_eq!(event(&parked)["type"], "run.waiting_approval");

    // The delivery log: three delivered, each with its three attempts and the receiver's answers.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let list = wait_deliveries(&c, &webhook, T, |l| l.iter().all(|d| d["status"] == "delivered")).await;
    assert_eq!(list.len(), 3, "{list:#?}");
    for d in &list {
        let msg = d["messageId"].as_str().unwrap();
        assert!(by_id.contains_key(msg), "{msg}");
        assert_eq!(d["attempts"], 3);
        let log = d["attemptLog"].as_array().unwrap();
        assert_eq!(log.len(), 3, "{d:#}");
        for (i, a) in log.iter().enumerate() {
            assert_eq!(a["attempt"], i + 1);
            let (code, body) = if i < 2 { (500, "try again later") } else { (200, "ok") };
            assert_eq!((&a["statusCode"], &a["responseBody"]), (&json!(code), &json!(body)), "{a}");
            assert_eq!(a["error"].is_null(), i == 2, "{a}");
        }
        for w in log.windows(2) {
            assert!(ts(&w[1]["startedAt"]) - ts(&w[0]["finishedAt"]) >= chrono::Duration::milliseconds(100), "no backoff: {log:#?}");
        }
        assert_eq!(d["payload"], by_id[msg][0].body);
    }
    std::fs::write(dir.join("delivery-log.json"), serde_json::to_string_pretty(&json!({"webhook": one.body, "deliveries": list})).unwrap()).unwrap();

    // The README's copy-pasteable Python verification accepts a real delivery and refuses a
    // tampered one.
    let sample = &by_id.values().next().unwrap()[2];
    readme_snippet_verifies(secret, sample);
}

/// Runs the README's Python `verify` on `request` (and on a tampered copy) when python3 exists.
fn readme_snippet_verifies(secret: &str, request: &Received) {
    let readme = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../README.md")).unwrap();
    let start = readme.find("```python\nimport base64, hashlib, hmac, time").expect("the README's verification snippet") + "```python\n".len();
    let snippet = &readme[start..start + readme[start..].find("```").unwrap()];
    let program = format!(
        "{snippet}\nimport json, sys\nd = json.load(sys.stdin)\nprint(verify(d['secret'], d['headers'], d['body'].encode()), \
         verify(d['secret'], d['headers'], d['body'].encode() + b' '))\n"
    );
    let input = json!({"secret": secret, "body": request.raw, "headers": {
        "webhook-id": request.id, "webhook-timestamp": request.timestamp.to_string(), "webhook-signature": request.signature}});
    let child = std::process::Command::new("python3")
        .args(["-c", &program])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        eprintln!("python3 not found: the README snippet was not run");
        return;
    };
    use std::io::Write;
    child.stdin.take().unwrap().write_all(input.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "True False", "the README snippet disagrees: {out:?}");
}

/// At-least-once: the receiver holds the first request open, its worker is SIGKILLed, another
/// worker sends the delivery again after the lease with the same `webhook-id`; the log shows the
/// lost attempt.
#[tokio::test]
async fn webhooks_a_worker_killed_mid_delivery_loses_no_delivery() {
    let key = secrets_key();
    let options = StackOptions {
        worker_env: env(&[
            ("WEBHOOK_ALLOW_PRIVATE_TARGETS", "true"),
            ("WEBHOOK_SECRETS_KEY", &key),
            ("WEBHOOK_TIMEOUT_MS", "3000"),
            ("WEBHOOK_RETRY_BASE_MS", "200"),
        ]),
        api_env: env(&[("WEBHOOK_ALLOW_PRIVATE_TARGETS", "true"), ("WEBHOOK_SECRETS_KEY", &key)]),
        ..Default::default()
    };
    let mut stack = Stack::start("webhooks_kill", options).await.unwrap();
    let c = stack.client();
    let receiver = Receiver::start(Mode::HoldFirst).await;
    let created = create_webhook(&c, &receiver.url(), &["run.completed"]).await;
    receiver.set_secret(created["secret"].as_str().unwrap());
    let webhook = created["id"].as_str().unwrap().to_owned();

    let thread = c.create_thread().await.unwrap();
    let run = c.chat(&thread, &script(json!([{"text": "done"}]))).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    c.wait_terminal(&run, T).await.unwrap();
    let deadline = Instant::now() + T;
    while receiver.state.held.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the first attempt never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The worker is in the middle of the request: kill it.
    stack.workers[0].signal(Sig::SIGKILL);
    assert!(stack.workers[0].wait_exit(Duration::from_secs(5)));
    let pending = deliveries(&c, &webhook).await;
    assert_eq!((pending.len(), &pending[0]["status"], &pending[0]["attempts"]), (1, &json!("pending"), &json!(1)), "{pending:#?}");
    stack.add_worker(&[]).unwrap();

    let by_id = receiver.wait_delivered(1, T).await;
    assert_eq!(by_id.len(), 1, "one message: {by_id:?}");
    let requests = by_id.values().next().unwrap();
    assert_eq!(requests.len(), 2, "the held attempt, then the redelivery: {requests:?}");
    assert_eq!((requests[0].answered, requests[1].answered), (0, 200));
    assert!(requests.iter().all(|r| r.verified), "{requests:?}");
    assert_eq!(requests[0].body, requests[1].body);
    assert_eq!(receiver.state.verify_failures.load(Ordering::SeqCst), 0);

    let list = wait_deliveries(&c, &webhook, T, |l| l.len() == 1 && l[0]["status"] == "delivered").await;
    let d = &list[0];
    assert_eq!((&d["messageId"], &d["attempts"]), (&json!(requests[0].id), &json!(2)), "{d:#}");
    let log = d["attemptLog"].as_array().unwrap();
    assert!(log[0]["statusCode"].is_null() && log[0]["error"].as_str().unwrap().contains("stopped"), "{d:#}");
    assert_eq!(log[1]["statusCode"], 200);
    std::fs::write(output_dir().join("delivery-log-worker-killed.json"), serde_json::to_string_pretty(&list).unwrap()).unwrap();
}

/// Private-network targets: refused at creation by default (IP literals, localhost), and refused
/// by a worker without the flag even when the row exists (created while allowed, or by a name
/// that resolves to a private address): nothing reaches the receiver, the attempts say why.
#[tokio::test]
async fn webhooks_private_targets_are_refused_unless_allowed() {
    let options = StackOptions { worker_env: env(&[("WEBHOOK_MAX_ATTEMPTS", "2"), ("WEBHOOK_RETRY_BASE_MS", "100")]), ..Default::default() };
    let stack = Stack::start("webhooks_private", options).await.unwrap();
    let c = stack.client();
    let receiver = Receiver::start(Mode::FailFirst(0)).await;
    for url in [receiver.url(), "http://localhost:9/x".into(), "http://[::1]:9/x".into(), "http://169.254.169.254/latest".into(), "http://10.0.0.1/x".into()] {
        let r = c.post("/api/webhooks", json!({"url": url, "events": ["run.completed"]})).await.unwrap();
        assert_eq!((r.status, &r.body["error"]["code"]), (400, &json!("webhook_target_private")), "{url}: {r:?}");
    }
    // A row the api would refuse today (e.g. created while private targets were allowed).
    let db = stack.db.client().await.unwrap();
    let principal: uuid::Uuid = db.query_one("SELECT id FROM principals WHERE name = 'tester'", &[]).await.unwrap().get(0);
    let webhook = uuid::Uuid::new_v4();
    db.execute(
        "INSERT INTO webhooks (id, principal_id, url, events, secret) VALUES ($1, $2, $3, '{run.completed}', 'plain:whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw')",
        &[&webhook, &principal, &receiver.url()],
    )
    .await
    .unwrap();
    let thread = c.create_thread().await.unwrap();
    let run = c.chat(&thread, &script(json!([{"text": "done"}]))).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    c.wait_terminal(&run, T).await.unwrap();
    let list = wait_deliveries(&c, &webhook.to_string(), T, |l| l.len() == 1 && l[0]["status"] == "failed").await;
    let log = list[0]["attemptLog"].as_array().unwrap();
    assert_eq!(log.len(), 2, "{list:#?}");
    assert!(log.iter().all(|a| a["statusCode"].is_null() && a["error"].as_str().unwrap().contains("refused target")), "{log:#?}");
    assert!(receiver.requests().is_empty(), "a private target was called: {:?}", receiver.requests());
}

/// Validation (stable 4xx codes), the per-principal bound, and isolation: another principal's
/// webhook is a 404 everywhere, and its runs never reach it.
#[tokio::test]
async fn webhooks_are_validated_bounded_and_isolated_per_principal() {
    let options = StackOptions {
        api_env: env(&[("WEBHOOK_ALLOW_PRIVATE_TARGETS", "true"), ("WEBHOOK_MAX_PER_PRINCIPAL", "3")]),
        worker_env: env(&[("WEBHOOK_ALLOW_PRIVATE_TARGETS", "true")]),
        ..Default::default()
    };
    let stack = Stack::start("webhooks_isolation", options).await.unwrap();
    let a = stack.client();
    let b = stack.client_for("other").unwrap();
    let receiver = Receiver::start(Mode::FailFirst(0)).await;
    let url = receiver.url();
    for (body, code) in [
        (json!({"events": ["run.completed"]}), "missing_field"),
        (json!({"url": "ftp://example.com/x", "events": ["run.completed"]}), "invalid_webhook_url"),
        (json!({"url": "example.com/hook", "events": ["run.completed"]}), "invalid_webhook_url"),
        (json!({"url": url, "events": []}), "invalid_webhook_events"),
        (json!({"url": url, "events": ["run.exploded"]}), "invalid_webhook_events"),
        (json!({"url": url, "events": ["run.completed"], "description": "x".repeat(501)}), "invalid_description"),
        (json!({"url": url, "events": ["run.completed"], "secret": "mine"}), "invalid_field"),
    ] {
        let r = a.post("/api/webhooks", body.clone()).await.unwrap();
        assert_eq!((r.status, r.body["error"]["code"].as_str()), (400, Some(code)), "{body}: {r:?}");
    }
    let first = create_webhook(&a, &url, &["run.completed", "run.completed"]).await;
    assert_eq!(first["events"], json!(["run.completed"]), "duplicates are folded");
    receiver.set_secret(first["secret"].as_str().unwrap());
    let id = first["id"].as_str().unwrap().to_owned();
    create_webhook(&a, &url, &["run.failed"]).await;
    create_webhook(&a, &url, &["run.blocked"]).await;
    let r = a.post("/api/webhooks", json!({"url": url, "events": ["run.cancelled"]})).await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (429, Some("too_many_webhooks")), "{r:?}");

    // Another principal sees nothing of A's and cannot touch it.
    for path in [format!("/api/webhooks/{id}"), format!("/api/webhooks/{id}/deliveries")] {
        let r = b.get(&path).await.unwrap();
        assert_eq!((r.status, r.body["error"]["code"].as_str()), (404, Some("not_found")), "{path}: {r:?}");
    }
    let r = b.send(reqwest::Method::DELETE, &format!("/api/webhooks/{id}"), None, &[]).await.unwrap();
    assert_eq!(r.status, 404);
    assert_eq!(b.get("/api/webhooks").await.unwrap().body, json!({"webhooks": []}));
    // B's own webhook does not count against A's bound, and B's runs never reach A's webhook.
    let b_hook = create_webhook(&b, &format!("{url}?b"), &["run.completed"]).await;
    let thread = b.create_thread().await.unwrap();
    let run = b.chat(&thread, &script(json!([{"text": "b's run"}]))).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    b.wait_terminal(&run, T).await.unwrap();
    wait_deliveries(&b, b_hook["id"].as_str().unwrap(), T, |l| l.len() == 1).await;
    assert!(deliveries(&a, &id).await.is_empty(), "B's run reached A's webhook");
    // A's run reaches A's webhook (and not B's).
    let thread = a.create_thread().await.unwrap();
    let run = a.chat(&thread, &script(json!([{"text": "a's run"}]))).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    a.wait_terminal(&run, T).await.unwrap();
    let list = wait_deliveries(&a, &id, T, |l| l.len() == 1 && l[0]["status"] == "delivered").await;
    assert_eq!(list[0]["runId"], json!(run));
    assert_eq!(deliveries(&b, b_hook["id"].as_str().unwrap()).await.len(), 1);

    // Deleting: 204, then 404; its deliveries go with it.
    let r = a.send(reqwest::Method::DELETE, &format!("/api/webhooks/{id}"), None, &[]).await.unwrap();
    assert_eq!(r.status, 204, "{r:?}");
    assert_eq!(a.get(&format!("/api/webhooks/{id}")).await.unwrap().status, 404);
    assert_eq!(a.get(&format!("/api/webhooks/{id}/deliveries")).await.unwrap().status, 404);
    let db = stack.db.client().await.unwrap();
    let left: i64 = db.query_one("SELECT count(*) FROM webhook_deliveries WHERE webhook_id = $1", &[&uuid::Uuid::parse_str(&id).unwrap()]).await.unwrap().get(0);
    assert_eq!(left, 0);
    assert_eq!(a.get("/api/webhooks/not-a-uuid").await.unwrap().status, 404);
    for query in ["status=lost", "limit=0", "limit=201"] {
        let r = b.get(&format!("/api/webhooks/{}/deliveries?{query}", b_hook["id"].as_str().unwrap())).await.unwrap();
        assert_eq!((r.status, r.body["error"]["code"].as_str()), (400, Some("invalid_query")), "{query}: {r:?}");
    }

    // Paging: every delivery once, in order, across pages — four of them created in the same
    // microsecond, so the cursor must order by id within one instant — and with a filter.
    let b_id = b_hook["id"].as_str().unwrap().to_owned();
    db.execute(
        "INSERT INTO webhook_deliveries (id, webhook_id, principal_id, event_type, run_id, thread_id, payload, status, finished_at, created_at)
         SELECT gen_random_uuid(), d.webhook_id, d.principal_id, 'run.failed', d.run_id, d.thread_id, d.payload, 'failed', now(),
                CASE WHEN i <= 4 THEN timestamptz '2026-01-01 00:00:00.000001+00' ELSE now() - i * interval '1 hour' END
           FROM webhook_deliveries d, generate_series(1, 7) i WHERE d.webhook_id = $1",
        &[&uuid::Uuid::parse_str(&b_id).unwrap()],
    )
    .await
    .unwrap();
    let expected: Vec<String> = db
        .query("SELECT id::text FROM webhook_deliveries WHERE webhook_id = $1 ORDER BY created_at DESC, id", &[&uuid::Uuid::parse_str(&b_id).unwrap()])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(expected.len(), 8);
    for (filter, want) in [("", expected.clone()), ("&status=failed", expected[1..].to_vec())] {
        let (mut seen, mut cursor) = (Vec::new(), None::<String>);
        loop {
            let after = cursor.as_ref().map(|c| format!("&cursor={c}")).unwrap_or_default();
            let r = b.get(&format!("/api/webhooks/{b_id}/deliveries?limit=3{filter}{after}")).await.unwrap();
            assert_eq!(r.status, 200, "{r:?}");
            seen.extend(r.body["deliveries"].as_array().unwrap().iter().map(|d| d["id"].as_str().unwrap().to_owned()));
            match r.body["nextCursor"].as_str() {
                Some(next) => cursor = Some(next.to_owned()),
                None => break,
            }
            assert!(seen.len() <= want.len(), "paging does not end: {seen:?}");
        }
        assert_eq!(seen, want, "pages of {filter:?}");
    }
    for cursor in ["garbage", "12_not-a-uuid", "_"] {
        let r = b.get(&format!("/api/webhooks/{b_id}/deliveries?cursor={cursor}")).await.unwrap();
        assert_eq!((r.status, r.body["error"]["code"].as_str()), (400, Some("invalid_cursor")), "{cursor}: {r:?}");
    }
}

/// One tenant's endpoints that never answer do not hold every delivery slot (migration 000040;
/// acceptance probe H: a tenant with 20 webhooks at a sink that never answers kept every slot
/// busy with its backlog, and another tenant's run.completed was not delivered after 240 s).
/// Tenant B's six held deliveries, due first, take at most WEBHOOK_CONCURRENCY_PER_PRINCIPAL (2)
/// of the worker's 4 slots: tenant A's delivery goes out at once.
#[tokio::test]
async fn webhooks_one_tenants_silent_endpoints_do_not_delay_anothers_deliveries() {
    let key = secrets_key();
    let options = StackOptions {
        worker_env: env(&[
            ("WEBHOOK_ALLOW_PRIVATE_TARGETS", "true"),
            ("WEBHOOK_SECRETS_KEY", &key),
            ("WEBHOOK_TIMEOUT_MS", "8000"),
            ("WEBHOOK_CONCURRENCY", "4"),
        ]),
        api_env: env(&[("WEBHOOK_ALLOW_PRIVATE_TARGETS", "true"), ("WEBHOOK_SECRETS_KEY", &key)]),
        ..Default::default()
    };
    let stack = Stack::start("webhooks_fair", options).await.unwrap();
    let a = stack.client();
    let b = stack.client_for("silent-tenant").unwrap();
    let silent = Receiver::start(Mode::HoldFirst).await;
    for _ in 0..6 {
        let created = create_webhook(&b, &silent.url(), &["run.completed"]).await;
        silent.set_secret(created["secret"].as_str().unwrap());
    }
    let prompt = Receiver::start(Mode::FailFirst(0)).await;
    let created = create_webhook(&a, &prompt.url(), &["run.completed"]).await;
    prompt.set_secret(created["secret"].as_str().unwrap());

    let thread = b.create_thread().await.unwrap();
    let run = b.chat(&thread, &script(json!([{"text": "done"}]))).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    b.wait_terminal(&run, T).await.unwrap();
    let deadline = Instant::now() + T;
    while silent.state.held.load(Ordering::SeqCst) < 2 {
        assert!(Instant::now() < deadline, "B's deliveries never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let thread = a.create_thread().await.unwrap();
    let run = a.chat(&thread, &script(json!([{"text": "done"}]))).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    a.wait_terminal(&run, T).await.unwrap();
    let finished = Instant::now();
    prompt.wait_delivered(1, Duration::from_secs(20)).await;
    let waited = finished.elapsed();
    assert!(waited < Duration::from_secs(3), "A's delivery waited {waited:?} behind B's silent endpoints");
    assert!(silent.state.held.load(Ordering::SeqCst) <= 2, "B holds at most 2 attempts in flight");
}
