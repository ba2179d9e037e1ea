//! Hostile clients (issue 10): revocation that bites, key lifecycle, browser sessions, limits
//! with 429 + Retry-After, one edge mechanism for bad input, HTTP hygiene, the loopback
//! principal's Host check, slimmed live events, the budget of request bodies in flight. Real api
//! processes on a real PostgreSQL; every name starts with `hostile_`.

use std::io::{Read, Write};
use std::process::Command;
use std::time::{Duration, Instant};

use agentloop_tests::{Client, Stack, StackOptions, bin_dir};
use futures_util::StreamExt;
use serde_json::{Value, json};

fn admin(stack: &Stack, args: &[&str]) -> std::process::Output {
    Command::new(bin_dir().join("agentloop-worker"))
        .args(args)
        .env("DATABASE_URL", &stack.db.url)
        .env("RUST_LOG", "warn")
        .output()
        .expect("agentloop-worker runs")
}

fn create_key(stack: &Stack, args: &[&str]) -> String {
    let out = admin(stack, &[&["create-key"], args].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

fn client(stack: &Stack, key: &str) -> Client {
    Client { base: stack.api_url.clone(), key: Some(key.to_owned()), http: reqwest::Client::new() }
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

/// Reads an SSE response until an event of `kind` arrives (or the stream ends); returns its
/// data and whether the stream ended right after.
async fn next_event<B: AsRef<[u8]>>(stream: &mut (impl futures_util::Stream<Item = reqwest::Result<B>> + Unpin), buf: &mut String, kind: &str) -> Option<Value> {
    loop {
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            let event = block.lines().find_map(|l| l.strip_prefix("event:")).map(str::trim).unwrap_or("message").to_owned();
            let data: String = block.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim).collect();
            if event == kind {
                return serde_json::from_str(&data).ok();
            }
        }
        match stream.next().await {
            Some(Ok(chunk)) => buf.push_str(&String::from_utf8_lossy(chunk.as_ref())),
            _ => return None,
        }
    }
}

#[tokio::test]
async fn hostile_revoked_or_expired_credentials_end_open_streams_and_long_polls_within_5s() {
    let stack = Stack::start("hostile_revoke", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let key = create_key(&stack, &["--principal", "victim", "--name", "laptop"]);
    let victim = client(&stack, &key);
    let thread = victim.create_thread().await.unwrap();

    // A session made from the same key, with its own stream.
    let http = reqwest::Client::new();
    let signed = http.post(format!("{}/api/session", stack.api_url)).json(&json!({"key": key})).send().await.unwrap();
    assert_eq!(signed.status(), 200);
    let cookie = signed.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_owned();

    let open = |auth: (&'static str, String)| {
        let url = format!("{}/api/threads/{thread}/updates/stream", stack.api_url);
        let http = http.clone();
        async move { http.get(url).header(auth.0, auth.1).send().await.unwrap() }
    };
    let bearer_sse = open(("Authorization", format!("Bearer {key}"))).await;
    let cookie_sse = open(("Cookie", cookie.clone())).await;
    assert_eq!((bearer_sse.status().as_u16(), cookie_sse.status().as_u16()), (200, 200));
    let mut streams = Vec::new();
    for response in [bearer_sse, cookie_sse] {
        let mut stream = response.bytes_stream();
        let mut buf = String::new();
        assert!(next_event(&mut stream, &mut buf, "thread").await.is_some(), "the stream started");
        streams.push((stream, buf));
    }
    let poll = {
        let victim = victim.clone();
        let thread = thread.clone();
        tokio::spawn(async move { victim.get(&format!("/api/threads/{thread}/updates?timeoutMs=60000")).await.unwrap() })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    let prefix = &key[..10];
    let out = admin(&stack, &["revoke-key", "--principal", "victim", "--key-prefix", prefix]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let revoked_at = Instant::now();

    for (mut stream, mut buf) in streams {
        let error = tokio::time::timeout(Duration::from_secs(5), next_event(&mut stream, &mut buf, "error"))
            .await
            .expect("the stream ended within 5 s")
            .expect("a final error event");
        assert_eq!(error["error"]["code"], "credentials_revoked");
        let rest = tokio::time::timeout(Duration::from_secs(2), stream.next()).await.expect("closed after the error");
        assert!(rest.is_none() || rest.is_some_and(|r| r.is_err()), "nothing after the final event");
    }
    let reply = tokio::time::timeout(Duration::from_secs(5), poll).await.expect("the long-poll ended within 5 s").unwrap();
    assert_eq!(reply.status, 401, "{reply:?}");
    assert_eq!(reply.body["error"]["code"], "credentials_revoked");
    assert!(revoked_at.elapsed() < Duration::from_secs(5), "{:?}", revoked_at.elapsed());

    // New requests with the key or its session are refused.
    assert_eq!(victim.get("/api/threads").await.unwrap().status, 401);
    let with_cookie = http.get(format!("{}/api/session", stack.api_url)).header("Cookie", cookie).send().await.unwrap();
    assert_eq!(with_cookie.status(), 401);

    // An expiring key works until it expires, then it and its open streams are refused.
    let short = create_key(&stack, &["--principal", "victim", "--expires", "3s"]);
    let short_client = client(&stack, &short);
    let thread = short_client.create_thread().await.unwrap();
    let response = http
        .get(format!("{}/api/threads/{thread}/updates/stream", stack.api_url))
        .bearer_auth(&short)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut stream = response.bytes_stream();
    let mut buf = String::new();
    let error = tokio::time::timeout(Duration::from_secs(9), next_event(&mut stream, &mut buf, "error")).await.expect("ended after expiry");
    assert_eq!(error.unwrap()["error"]["code"], "credentials_revoked");
    assert_eq!(short_client.get("/api/threads").await.unwrap().status, 401);

    let listing = admin(&stack, &["list-keys", "--principal", "victim", "--all", "--json"]);
    let keys: Vec<Value> = String::from_utf8_lossy(&listing.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
    let laptop = keys.iter().find(|k| k["name"] == "laptop").unwrap();
    assert_eq!(laptop["status"], "revoked");
    assert_eq!(laptop["prefix"], prefix);
    assert!(laptop["last_used_at"].is_string(), "last use recorded: {laptop}");
    assert!(keys.iter().any(|k| k["status"] == "expired"), "{keys:?}");
    let live_only = admin(&stack, &["list-keys", "--principal", "victim"]);
    assert_eq!(String::from_utf8_lossy(&live_only.stdout).lines().count(), 1, "only the header: no live key");
}

#[tokio::test]
async fn hostile_revoke_key_is_scoped_to_one_principal_and_last_used_is_written_once_a_minute() {
    let stack = Stack::start("hostile_revoke_scope", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let bob = create_key(&stack, &["--principal", "bob"]);
    // Another principal naming bob's key prefix revokes nothing.
    let out = admin(&stack, &["revoke-key", "--principal", "tester", "--key-prefix", &bob[..10]]);
    assert!(!out.status.success(), "nothing matched: exit 1");
    assert_eq!(client(&stack, &bob).get("/api/threads").await.unwrap().status, 200);
    let out = admin(&stack, &["revoke-key", "--principal", "bob", "--key-prefix", "al_"]);
    assert!(!out.status.success(), "a prefix shorter than 8 characters is refused");

    // Many requests, one write of last_used_at: the row version (xmin) stays the same.
    let db = stack.db.client().await.unwrap();
    async fn version(db: &tokio_postgres::Client, prefix: &str) -> (String, Option<String>) {
        let row = db.query_one("SELECT xmin::text, last_used_at::text FROM api_keys WHERE key_prefix = $1", &[&prefix]).await.unwrap();
        (row.get::<_, String>(0), row.get::<_, Option<String>>(1))
    }
    let c = client(&stack, &bob);
    assert_eq!(c.get("/api/threads").await.unwrap().status, 200);
    let first = version(&db, &bob[..10]).await;
    assert!(first.1.is_some(), "the first use is recorded");
    for _ in 0..30 {
        assert_eq!(c.get("/api/threads").await.unwrap().status, 200);
    }
    assert_eq!(version(&db, &bob[..10]).await, first, "30 more requests within the minute wrote nothing");
    let used = admin(&stack, &["list-keys", "--principal", "bob", "--json"]);
    let key: Value = serde_json::from_str(String::from_utf8_lossy(&used.stdout).lines().next().unwrap()).unwrap();
    assert!(key["last_used_at"].is_string(), "{key}");
}

#[tokio::test]
async fn hostile_browser_session_cookie_csrf_and_sign_out() {
    let stack = Stack::start("hostile_session", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let http = reqwest::Client::new();
    let url = |p: &str| format!("{}{p}", stack.api_url);
    let bad = http.post(url("/api/session")).json(&json!({"key": "al_0000000000000000000000000000000000000000"})).send().await.unwrap();
    assert_eq!(bad.status(), 401);
    assert_eq!(bad.json::<Value>().await.unwrap()["error"]["code"], "invalid_api_key");

    let signed = http.post(url("/api/session")).json(&json!({"key": stack.key})).send().await.unwrap();
    assert_eq!(signed.status(), 200);
    let set_cookie = signed.headers()["set-cookie"].to_str().unwrap().to_owned();
    for part in ["agentloop_session=as_", "HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(set_cookie.contains(part), "{set_cookie}");
    }
    assert!(!set_cookie.contains("Secure"), "plain http: no Secure");
    let body: Value = signed.json().await.unwrap();
    assert_eq!(body["principal"]["name"], "tester");
    let cookie = set_cookie.split(';').next().unwrap().to_owned();
    let token = cookie.split_once('=').unwrap().1.to_owned();
    let db = stack.db.client().await.unwrap();
    let stored: Vec<u8> = db.query_one("SELECT token_hash FROM sessions", &[]).await.unwrap().get(0);
    assert_eq!(stored, agentloop_shared::auth::hash_key(&token), "only the token's SHA-256 is stored");

    let secure = http.post(url("/api/session")).header("X-Forwarded-Proto", "https").json(&json!({"key": stack.key})).send().await.unwrap();
    assert!(secure.headers()["set-cookie"].to_str().unwrap().contains("Secure"));

    let who: Value = http.get(url("/api/session")).header("Cookie", &cookie).send().await.unwrap().json().await.unwrap();
    assert_eq!(who["via"], "session");
    assert_eq!(who["principal"]["name"], "tester");
    let who: Value = http.get(url("/api/session")).bearer_auth(&stack.key).send().await.unwrap().json().await.unwrap();
    assert_eq!(who["via"], "bearer");
    let none = http.get(url("/api/session")).send().await.unwrap();
    assert_eq!(none.status(), 401);
    assert_eq!(none.json::<Value>().await.unwrap()["error"]["code"], "unauthenticated");

    // Reads with the cookie work; an unsafe request needs the CSRF header.
    assert_eq!(http.get(url("/api/threads")).header("Cookie", &cookie).send().await.unwrap().status(), 200);
    let forged = http.post(url("/api/threads")).header("Cookie", &cookie).json(&json!({"title": "x"})).send().await.unwrap();
    assert_eq!(forged.status(), 403);
    assert_eq!(forged.json::<Value>().await.unwrap()["error"]["code"], "csrf_header_missing");
    let made = http
        .post(url("/api/threads"))
        .header("Cookie", &cookie)
        .header("X-Requested-With", "agentloop")
        .json(&json!({"title": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(made.status(), 201);

    // Sign-out is a cookie request too: a cross-site form cannot end the session.
    let forged = http.delete(url("/api/session")).header("Cookie", &cookie).header("Origin", "http://evil.example").send().await.unwrap();
    assert_eq!(forged.status(), 403);
    assert_eq!(http.get(url("/api/threads")).header("Cookie", &cookie).send().await.unwrap().status(), 200, "still signed in");
    let out = http.delete(url("/api/session")).header("Cookie", &cookie).header("X-Requested-With", "agentloop").send().await.unwrap();
    assert_eq!(out.status(), 204);
    assert!(out.headers()["set-cookie"].to_str().unwrap().contains("Max-Age=0"));
    assert_eq!(http.get(url("/api/threads")).header("Cookie", &cookie).send().await.unwrap().status(), 401, "signed out");
}

#[tokio::test]
async fn hostile_limits_answer_429_with_retry_after_and_are_counted() {
    let options = StackOptions {
        workers: 0,
        api_env: env(&[
            ("MAX_ACTIVE_RUNS_PER_PRINCIPAL", "2"),
            ("MAX_QUEUED_TURNS_PER_PRINCIPAL", "1"),
            ("MAX_THREADS_PER_PRINCIPAL", "4"),
            ("LIVE_MAX_PER_PRINCIPAL", "1"),
            ("AUTH_FAILURES_PER_MINUTE", "3"),
            ("API_RATE_PER_SECOND", "5"),
            ("API_RATE_BURST", "40"),
            // Far apart: a client that left must be noticed by its socket, not by a failed
            // heartbeat write.
            ("SSE_HEARTBEAT_MS", "60000"),
        ]),
        ..Default::default()
    };
    let stack = Stack::start("hostile_limits", options).await.unwrap();
    let c = stack.client();
    let mut threads = Vec::new();
    for _ in 0..4 {
        threads.push(c.create_thread().await.unwrap());
    }
    let refused = c.post("/api/threads", json!({})).await.unwrap();
    assert_eq!((refused.status, refused.body["error"]["code"].as_str()), (429, Some("too_many_threads")), "{refused:?}");
    // No worker: runs stay queued. Two active runs, then refusal; one queued turn, then refusal.
    c.chat(&threads[0], "one").await.unwrap();
    c.chat(&threads[1], "two").await.unwrap();
    let third = c.post(&format!("/api/threads/{}/chat", threads[2]), json!({"content": "three"})).await.unwrap();
    assert_eq!((third.status, third.body["error"]["code"].as_str()), (429, Some("too_many_active_runs")), "{third:?}");
    let queued = c.post(&format!("/api/threads/{}/chat", threads[0]), json!({"content": "later", "multitask": "enqueue"})).await.unwrap();
    assert_eq!(queued.status, 202, "{queued:?}");
    let again = c.post(&format!("/api/threads/{}/chat", threads[1]), json!({"content": "later", "multitask": "enqueue"})).await.unwrap();
    assert_eq!((again.status, again.body["error"]["code"].as_str()), (429, Some("too_many_queued_turns")), "{again:?}");
    let db = stack.db.client().await.unwrap();
    let runs: i64 = db.query_one("SELECT count(*) FROM runs", &[]).await.unwrap().get(0);
    assert_eq!(runs, 3, "refused commands wrote nothing");
    // A second principal has its own budget.
    let other = stack.client_for("other").unwrap();
    let t = other.create_thread().await.unwrap();
    assert_eq!(other.chat(&t, "mine").await.unwrap()["run"]["status"], "queued");

    // Live connections per principal.
    let http = reqwest::Client::new();
    let first = http.get(format!("{}/api/threads/{}/updates/stream", stack.api_url, threads[3])).bearer_auth(&stack.key).send().await.unwrap();
    assert_eq!(first.status(), 200);
    let second = c.get(&format!("/api/threads/{}/updates?timeoutMs=0", threads[3])).await.unwrap();
    assert_eq!((second.status, second.body["error"]["code"].as_str()), (429, Some("too_many_live_connections")), "{second:?}");
    drop(first);
    let freed = Instant::now();
    while c.get(&format!("/api/threads/{}/updates?timeoutMs=0", threads[3])).await.unwrap().status != 200 {
        assert!(freed.elapsed() < Duration::from_secs(3), "the SSE slot is free again soon after the client left");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A long-poll client that gives up: its slot is free long before its 30 s wait would end.
    let poll = http.get(format!("{}/api/threads/{}/updates?timeoutMs=30000", stack.api_url, threads[3])).bearer_auth(&stack.key).send();
    assert!(tokio::time::timeout(Duration::from_millis(500), poll).await.is_err(), "the long-poll waits");
    let freed = Instant::now();
    while c.get(&format!("/api/threads/{}/updates?timeoutMs=0", threads[3])).await.unwrap().status != 200 {
        assert!(freed.elapsed() < Duration::from_secs(3), "the long-poll slot is free again soon after the client left");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("long-poll slot freed {:?} after its client left", freed.elapsed());

    // Failed authentications per address: the budget, then 429 for every further failure — but
    // never for a good key from the same address (a stranger must not lock out the users who
    // share it: a NAT, a proxy), nor for a sign-in with a good key.
    let bad = Client { key: Some("al_wrong".into()), ..c.clone() };
    for _ in 0..3 {
        assert_eq!(bad.get("/api/threads").await.unwrap().status, 401);
    }
    let blocked = http.get(format!("{}/api/threads", stack.api_url)).bearer_auth("al_wrong_again").send().await.unwrap();
    assert_eq!(blocked.status(), 429);
    assert!(blocked.headers()["retry-after"].to_str().unwrap().parse::<u64>().unwrap() >= 1);
    assert_eq!(blocked.json::<Value>().await.unwrap()["error"]["code"], "too_many_failed_auth");
    let signin = http.post(format!("{}/api/session", stack.api_url)).json(&json!({"key": "al_wrong"})).send().await.unwrap();
    assert_eq!(signin.status(), 429, "a failed sign-in from the address is refused too");
    let good = http.get(format!("{}/api/threads", stack.api_url)).bearer_auth(&stack.key).send().await.unwrap();
    assert_eq!(good.status(), 200, "a valid key is served whatever its address did");
    let signin = http.post(format!("{}/api/session", stack.api_url)).json(&json!({"key": stack.key})).send().await.unwrap();
    assert_eq!(signin.status(), 200, "a sign-in with a valid key is served too");

    // The request rate of one principal.
    let mut limited = None;
    for _ in 0..100 {
        let r = http.get(format!("{}/api/models", stack.api_url)).bearer_auth(&stack.key).send().await.unwrap();
        if r.status() == 429 {
            limited = Some(r);
            break;
        }
    }
    let limited = limited.expect("the burst ran out");
    assert!(limited.headers().contains_key("retry-after"));
    assert_eq!(limited.json::<Value>().await.unwrap()["error"]["code"], "rate_limited");

    let metrics = reqwest::get(format!("{}/metrics", stack.api_url)).await.unwrap().text().await.unwrap();
    for limit in ["threads", "active_runs", "queued_turns", "live_connections", "failed_auth", "request_rate"] {
        assert!(metrics.contains(&format!("agentloop_limit_refusals_total{{limit=\"{limit}\"}}")), "{limit} counted:\n{metrics}");
    }
}

/// A raw HTTP/1.1 exchange: writes `request`, waits up to `wait` for the answer.
fn raw(addr: &str, request: &[u8], wait: Duration) -> String {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(wait)).unwrap();
    stream.write_all(request).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                out.extend_from_slice(&buf[..n]);
                if String::from_utf8_lossy(&out).contains("\r\n\r\n{") && out.ends_with(b"}}") {
                    break;
                }
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn hostile_bad_input_gets_4xx_envelopes_and_every_answer_the_hygiene_headers() {
    let options = StackOptions { workers: 0, api_env: env(&[("API_BODY_TIMEOUT_MS", "1000")]), ..Default::default() };
    let stack = Stack::start("hostile_edge", options).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let http = reqwest::Client::new();
    let url = |p: &str| format!("{}{p}", stack.api_url);
    let send = |method: reqwest::Method, path: &str, content_type: &str, body: &str| {
        http.request(method, url(path)).bearer_auth(&stack.key).header("Content-Type", content_type).body(body.to_owned()).send()
    };
    let check = |r: reqwest::Response, status: u16, code: &'static str| async move {
        assert_eq!(r.status().as_u16(), status, "{code}");
        assert!(r.headers().contains_key("x-request-id"), "{code}: x-request-id");
        assert_eq!(r.headers()["cache-control"], "no-store", "{code}");
        let headers = r.headers().clone();
        let body: Value = r.json().await.unwrap_or_else(|e| panic!("{code}: not JSON: {e}"));
        assert_eq!(body["error"]["code"], code, "{body}");
        assert!(body["error"]["message"].is_string());
        headers
    };
    let json = "application/json";
    let chat = format!("/api/threads/{thread}/chat");
    // NUL anywhere in any body (escaped in JSON), in any route: cleaned before the route, never a 5xx.
    let r = send(reqwest::Method::POST, &chat, json, r#"{"content": "a\u0000b", "commandId": "k\u0000"}"#).await.unwrap();
    assert_eq!(r.status(), 202);
    let run: Value = r.json().await.unwrap();
    assert_eq!(run["run"]["commandId"], "k\u{FFFD}");
    assert_eq!(run["message"]["content"], "a\u{FFFD}b");
    let r = send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), json, r#"{"metadata": {"k\u0000": "\u0000"}}"#).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["metadata"], json!({"k\u{FFFD}": "\u{FFFD}"}));
    let r = send(reqwest::Method::POST, "/api/approvals/00000000-0000-0000-0000-000000000000/reject", json, r#"{"reason": "\u0000"}"#).await.unwrap();
    assert_eq!(r.status(), 404);
    let r = send(reqwest::Method::POST, &format!("/api/runs/{}/operations/k%00/resolve", run["run"]["id"].as_str().unwrap()), json, r#"{"outcome": "failed", "reason": "\u0000"}"#).await.unwrap();
    assert!(r.status().is_client_error(), "{:?}", r.status());
    check(send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), json, r#"{"metadata": {"n": 1e400}}"#).await.unwrap(), 400, "invalid_number").await;
    // A number serde_json would round is refused, not stored changed (a Python client's big int).
    check(send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), json, r#"{"metadata": {"n": 123456789012345678901234567890}}"#).await.unwrap(), 400, "invalid_number").await;
    // Numbers at the edge of f64, and ones that differ from their stored form only in spelling,
    // are stored and read back.
    for edge in ["1.7976931348623157e308", "-1.7976931348623157e308", "5e-324", "1.10", "1E2", "18446744073709551615"] {
        let r = send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), json, &format!(r#"{{"metadata": {{"n": {edge}}}}}"#)).await.unwrap();
        assert_eq!(r.status(), 200, "{edge}: {:?}", r.text().await);
        assert_eq!(c.get(&format!("/api/threads/{thread}")).await.unwrap().status, 200, "{edge}");
    }
    check(send(reqwest::Method::POST, &chat, "text/plain", "hello").await.unwrap(), 415, "unsupported_media_type").await;
    check(send(reqwest::Method::POST, "/api/threads", json, &format!(r#"{{"title": "{}"}}"#, "x".repeat(2 * 1024 * 1024))).await.unwrap(), 413, "payload_too_large").await;
    check(send(reqwest::Method::POST, "/api/threads", json, "{not json").await.unwrap(), 400, "invalid_json").await;
    // serde builds a struct from a JSON array (positional fields): a body is an object or 400.
    let threads_before: i64 = stack.db.client().await.unwrap().query_one("SELECT count(*) FROM threads", &[]).await.unwrap().get(0);
    for body in [r#"["t-positional"]"#, "\"a title\"", "null", "42"] {
        check(send(reqwest::Method::POST, "/api/threads", json, body).await.unwrap(), 400, "invalid_json").await;
    }
    check(send(reqwest::Method::POST, &chat, json, r#"["positional content", null, "enqueue"]"#).await.unwrap(), 400, "invalid_json").await;
    // An optional body is optional, not unchecked: a malformed one is refused too.
    check(send(reqwest::Method::POST, &format!("/api/threads/{thread}/messages/1/regenerate"), json, "[1]").await.unwrap(), 400, "invalid_json").await;
    let threads_after: i64 = stack.db.client().await.unwrap().query_one("SELECT count(*) FROM threads", &[]).await.unwrap().get(0);
    assert_eq!(threads_after, threads_before, "an array body created a thread");
    // Idempotency keys are bounded in characters, as documented (not bytes).
    let r = http.post(url(&chat)).bearer_auth(&stack.key).header("Idempotency-Key", "é".repeat(200)).json(&json!({"content": "k", "multitask": "enqueue"})).send().await.unwrap();
    assert_eq!(r.status(), 202, "{:?}", r.text().await);
    let r = http.post(url(&chat)).bearer_auth(&stack.key).header("Idempotency-Key", "é".repeat(201)).json(&json!({"content": "k", "multitask": "enqueue"})).send().await.unwrap();
    check(r, 400, "invalid_idempotency_key").await;
    check(http.get(url("/api/threads?cursor=%00")).bearer_auth(&stack.key).send().await.unwrap(), 400, "invalid_query").await;
    // A cursor beyond what PostgreSQL's timestamps hold is malformed, not a 500.
    for at in ["-8000000000000000000", "8000000000000000000"] {
        let cursor = format!("{at}_00000000-0000-0000-0000-000000000000");
        check(http.get(url(&format!("/api/threads?cursor={cursor}"))).bearer_auth(&stack.key).send().await.unwrap(), 400, "invalid_cursor").await;
    }
    check(http.get(url("/api/threads?limit=abc")).bearer_auth(&stack.key).send().await.unwrap(), 400, "invalid_query").await;
    // Every bounded number is refused outside its range, never clamped, and a query that is not
    // UTF-8 is refused, not decoded lossily (acceptance probe).
    for path in ["/api/threads?limit=0", "/api/threads?limit=-1", "/api/threads?limit=101", "/api/search?q=word&limit=-1", "/api/search?q=word&limit=101",
                 "/api/search?q=%FF%FE", &format!("/api/threads/{thread}/updates?timeoutMs=60001"),
                 &format!("/api/threads/{thread}/updates?timeoutMs=-1")] {
        check(http.get(url(path)).bearer_auth(&stack.key).send().await.unwrap(), 400, "invalid_query").await;
    }
    // The largest cursor, once the thread's journal is cached: a reset, not an overflow that
    // closed the connection without an answer (schemathesis, after the laggard-read change).
    for after in ["0", "9223372036854775807"] {
        let r = http.get(url(&format!("/api/threads/{thread}/updates?afterSequence={after}&timeoutMs=0"))).bearer_auth(&stack.key).send().await.unwrap();
        assert_eq!(r.status(), 200, "afterSequence={after}");
    }
    check(http.get(url("/api/nothing/here")).bearer_auth(&stack.key).send().await.unwrap(), 404, "route_not_found").await;
    let headers = check(http.put(url("/api/threads")).bearer_auth(&stack.key).send().await.unwrap(), 405, "method_not_allowed").await;
    let allow = headers["allow"].to_str().unwrap().to_owned();
    assert!(allow.contains("GET") && allow.contains("POST"), "{allow}");
    let mut many = http.get(url("/api/threads")).bearer_auth(&stack.key);
    for i in 0..70 {
        many = many.header(format!("x-filler-{i}"), "1");
    }
    check(many.send().await.unwrap(), 431, "header_fields_too_large").await;
    check(http.get(url("/api/threads")).send().await.unwrap(), 401, "unauthorized").await;

    // A body that never finishes is cut at API_BODY_TIMEOUT_MS with an envelope.
    let addr = stack.api_url.trim_start_matches("http://").to_owned();
    let started = Instant::now();
    let request = format!(
        "POST /api/threads HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"ti",
        stack.key
    );
    let answer = tokio::task::spawn_blocking(move || raw(&addr, request.as_bytes(), Duration::from_secs(10))).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"body_timeout\""), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());

    // Probes by HEAD get the GET's status and headers, no body; API reads stay GET-only.
    for path in ["/healthz", "/readyz", "/", "/openapi.json"] {
        let r = http.head(url(path)).send().await.unwrap();
        assert_eq!(r.status(), 200, "HEAD {path}");
        assert!(r.bytes().await.unwrap().is_empty(), "HEAD {path} has a body");
    }
    assert_eq!(http.head(url("/api/threads")).bearer_auth(&stack.key).send().await.unwrap().status(), 405);

    // The request id: echoed when well-formed, else a new one.
    let r = http.get(url("/healthz")).header("x-request-id", "trace-123").send().await.unwrap();
    assert_eq!(r.headers()["x-request-id"], "trace-123");
    let r = http.get(url("/healthz")).header("x-request-id", "bad id\twith spaces").send().await.unwrap();
    assert_ne!(r.headers()["x-request-id"], "bad id\twith spaces");

    // The UI page: a CSP allowing only its own assets, no framing, no sniffing.
    let page = http.get(url("/")).send().await.unwrap();
    let csp = page.headers()["content-security-policy"].to_str().unwrap().to_owned();
    assert!(csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'") && csp.contains("object-src 'none'"), "{csp}");
    assert!(!csp.contains("unsafe-eval") && !csp.contains("script-src 'self' 'unsafe-inline'") && !csp.contains("http"), "{csp}");
    assert_eq!(page.headers()["x-content-type-options"], "nosniff");
    assert_eq!(page.headers()["x-frame-options"], "DENY");
    let api = c.get("/api/threads").await.unwrap();
    assert_eq!(api.status, 200);
}

#[tokio::test]
async fn hostile_loopback_principal_needs_a_loopback_host() {
    let options = StackOptions { workers: 0, api_env: env(&[("DEV_LOOPBACK_PRINCIPAL", "true")]), ..Default::default() };
    let stack = Stack::start("hostile_loopback", options).await.unwrap();
    let port = stack.api_url.rsplit(':').next().unwrap().to_owned();
    let http = reqwest::Client::new();
    for (host, status) in [(format!("localhost:{port}"), 200), (format!("127.0.0.1:{port}"), 200), (format!("evil.example:{port}"), 401), ("attacker.test".into(), 401)] {
        let r = http.get(format!("{}/api/session", stack.api_url)).header("Host", &host).send().await.unwrap();
        assert_eq!(r.status().as_u16(), status, "Host: {host}");
        if status == 200 {
            assert_eq!(r.json::<Value>().await.unwrap()["via"], "loopback");
        }
    }
    // A page of another site reaches 127.0.0.1 too: a `fetch` with `mode: "no-cors"` needs no
    // preflight, so a body-less POST (cancel, approve) went through as `local` (acceptance
    // probe). A browser's request (it sends Origin / Sec-Fetch-Site) is held to the cookie
    // rule; tools that send neither (curl, SDKs) are not.
    let thread = http.post(format!("{}/api/threads", stack.api_url)).json(&json!({})).send().await.unwrap();
    assert_eq!(thread.status(), 201);
    let cancel = format!("{}/api/threads/{}/cancel", stack.api_url, thread.json::<Value>().await.unwrap()["id"].as_str().unwrap());
    for headers in [vec![("Origin", "http://evil.example")], vec![("Sec-Fetch-Site", "cross-site")], vec![("Origin", "http://localhost:3000"), ("Sec-Fetch-Site", "same-site")]] {
        let mut r = http.post(&cancel);
        for (k, v) in &headers {
            r = r.header(*k, *v);
        }
        let r = r.send().await.unwrap();
        assert_eq!(r.status(), 403, "{headers:?}");
        assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "csrf_header_missing", "{headers:?}");
    }
    let r = http.post(&cancel).header("Origin", format!("http://127.0.0.1:{port}")).header("X-Requested-With", "agentloop").send().await.unwrap();
    assert_eq!(r.status(), 200, "the UI's own requests carry the header");
    assert_eq!(http.post(&cancel).send().await.unwrap().status(), 200, "a tool without Origin is not a browser");
}

#[tokio::test]
async fn hostile_large_events_reach_live_clients_slimmed() {
    let stack = Stack::start("hostile_slim", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let big = "y".repeat(300 * 1024);
    let patched = c.send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), Some(json!({"title": "big", "metadata": {"blob": big}})), &[]).await.unwrap();
    assert_eq!(patched.status, 200);
    let polled = c.get(&format!("/api/threads/{thread}/updates?afterSequence=0&timeoutMs=0")).await.unwrap();
    assert_eq!(polled.status, 200);
    let events = polled.body["events"].as_array().unwrap();
    let last = events.last().unwrap();
    assert_eq!(last["kind"], "thread");
    assert_eq!(last["payload"]["title"], "big", "small fields stay");
    assert_eq!(last["payload"]["truncated"], true);
    assert_eq!(last["payload"]["omitted"], json!(["metadata"]));
    assert!(last["payload"]["id"].is_string());
    assert!(serde_json::to_string(&polled.body).unwrap().len() < 70 * 1024);
    // The full row is one read away.
    let full = c.get(&format!("/api/threads/{thread}")).await.unwrap();
    assert_eq!(full.body["thread"]["metadata"]["blob"].as_str().map(str::len), Some(300 * 1024));
}

/// Reads the gauge `agentloop_body_bytes_in_flight` from the api's /metrics (0 when absent).
async fn body_bytes_in_flight(stack: &Stack) -> f64 {
    let metrics = reqwest::get(format!("{}/metrics", stack.api_url)).await.unwrap().text().await.unwrap();
    metrics.lines().find_map(|l| l.strip_prefix("agentloop_body_bytes_in_flight ")).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}

#[tokio::test]
async fn hostile_body_budget_serves_concurrent_large_bodies_in_turn_and_none_is_lost() {
    // Room for one ~1 MB body at a time; twelve arrive at once.
    let budget = 1_500_000.0;
    let options = StackOptions { workers: 0, api_env: env(&[("MAX_BODY_BYTES_IN_FLIGHT", "1500000"), ("API_BODY_TIMEOUT_MS", "60000")]), ..Default::default() };
    let stack = Stack::start("hostile_body_budget", options).await.unwrap();
    let c = stack.client();
    let mut threads = Vec::new();
    for _ in 0..12 {
        threads.push(c.create_thread().await.unwrap());
    }
    let blob = "b".repeat(1_000_000);
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (url, sampling) = (stack.api_url.clone(), sampling.clone());
        tokio::spawn(async move {
            let mut peak = 0.0f64;
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(r) = reqwest::get(format!("{url}/metrics")).await
                    && let Ok(text) = r.text().await
                {
                    let v = text.lines().find_map(|l| l.strip_prefix("agentloop_body_bytes_in_flight ")).and_then(|v| v.trim().parse::<f64>().ok());
                    peak = peak.max(v.unwrap_or(0.0));
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            peak
        })
    };
    let patches = threads.iter().enumerate().map(|(i, thread)| {
        let (c, body) = (c.clone(), json!({"metadata": {"blob": blob, "n": i}}));
        async move { c.send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), Some(body), &[]).await.unwrap() }
    });
    let replies = futures_util::future::join_all(patches).await;
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let peak = sampler.await.unwrap();
    for (i, reply) in replies.iter().enumerate() {
        assert_eq!(reply.status, 200, "PATCH {i}: {:?}", reply.body["error"]);
        assert_eq!(reply.body["metadata"]["n"], i, "PATCH {i} answered with its own thread");
    }
    // Every body was stored whole, each on its own thread.
    for (i, thread) in threads.iter().enumerate() {
        let read = c.get(&format!("/api/threads/{thread}")).await.unwrap();
        assert_eq!(read.body["thread"]["metadata"]["n"], i);
        assert_eq!(read.body["thread"]["metadata"]["blob"].as_str().map(str::len), Some(1_000_000));
    }
    // The budget held: never more than it in flight, and all of it given back.
    assert!(peak > 0.0 && peak <= budget, "bytes in flight peaked at {peak} (budget {budget})");
    assert_eq!(body_bytes_in_flight(&stack).await, 0.0);
}

#[tokio::test]
async fn hostile_body_budget_wait_ends_in_503_server_busy_and_frees_with_the_body_timeout() {
    let options = StackOptions { workers: 0, api_env: env(&[("MAX_BODY_BYTES_IN_FLIGHT", "1500000"), ("API_BODY_TIMEOUT_MS", "3000")]), ..Default::default() };
    let stack = Stack::start("hostile_body_wait", options).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let addr = stack.api_url.trim_start_matches("http://").to_owned();
    // A client that declares a 1 MB body and never sends it holds 1 MB of the budget for the
    // body timeout (then 408).
    let stall = |addr: String, thread: String, key: String| async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let head = format!(
            "PATCH /api/threads/{thread} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{{\"metadata\":"
        );
        s.write_all(head.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf)).await {
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buf[..n]);
            if String::from_utf8_lossy(&answer).contains("}}") {
                break;
            }
        }
        String::from_utf8_lossy(&answer).into_owned()
    };
    let started = Instant::now();
    // The first takes 1 MB at once; the second queues and takes it when the first times out
    // (~3 s), holding it until ~6 s.
    let first = tokio::spawn(stall(addr.clone(), thread.clone(), stack.key.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let second = tokio::spawn(stall(addr.clone(), thread.clone(), stack.key.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(body_bytes_in_flight(&stack).await, 1_000_000.0, "the first stalled body holds its Content-Length");
    // A whole body queued behind the second: its wait (3 s, to ~4 s) ends before the second
    // lets go (~6 s) — 503 server_busy with Retry-After, and nothing written.
    let blob = "x".repeat(999_000);
    let http = reqwest::Client::new();
    let busy = http.patch(format!("{}/api/threads/{thread}", stack.api_url)).bearer_auth(&stack.key).json(&json!({"metadata": {"blob": blob}})).send().await.unwrap();
    assert_eq!(busy.status(), 503);
    assert_eq!(busy.headers()["retry-after"], "1");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(3500), "it waited for the budget ({waited:?})");
    assert_eq!(busy.json::<Value>().await.unwrap()["error"]["code"], "server_busy");
    for stalled in [first.await.unwrap(), second.await.unwrap()] {
        assert!(stalled.starts_with("HTTP/1.1 408"), "{stalled}");
        assert!(stalled.contains("body_timeout"), "{stalled}");
    }
    // All of it given back: the same body now goes through.
    assert_eq!(body_bytes_in_flight(&stack).await, 0.0);
    let ok = c.send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), Some(json!({"metadata": {"blob": blob}})), &[]).await.unwrap();
    assert_eq!(ok.status, 200, "{:?}", ok.body);
    assert_eq!(ok.body["metadata"]["blob"].as_str().map(str::len), Some(999_000));
    let metrics = reqwest::get(format!("{}/metrics", stack.api_url)).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("agentloop_limit_refusals_total{limit=\"body_budget\"}"), "{metrics}");
}

/// A `/v1/chat/completions` request ends when its key is revoked, like a live-update stream
/// (acceptance probe H: a streamed completion whose key was revoked went on for a minute, to its
/// end): streamed, a final `credentials_revoked` error; not streamed, 401 (`invalid_api_key`, as
/// every `/v1` 401, saying the key was revoked).
/// The request ends as if its client had gone (its run is cancelled).
#[tokio::test]
async fn hostile_a_revoked_key_ends_its_v1_requests_within_5s() {
    let stack = Stack::start("hostile_revoke_v1", StackOptions::default()).await.unwrap();
    let key = create_key(&stack, &["--principal", "v1-victim", "--name", "sdk"]);
    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", stack.api_url);
    let slow = |stream: bool| {
        // 240 words, 3 per chunk, 500 ms apart: a 40 s answer.
        let words = vec!["word"; 240].join(" ");
        json!({"model": "mock", "stream": stream,
               "messages": [{"role": "user", "content": agentloop_tests::script(json!([{"text": words, "chunkDelayMs": 500}]))}]})
    };
    // An MCP `wait_run` on an ordinary run of the key's principal, waiting for a 40 s answer.
    let victim = client(&stack, &key);
    let thread = victim.create_thread().await.unwrap();
    let content = slow(false)["messages"][0]["content"].as_str().unwrap().to_owned();
    let run_id = victim.chat(&thread, &content).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    let mcp_wait = {
        let (http, base, key) = (http.clone(), stack.api_url.clone(), key.clone());
        let call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                          "params": {"name": "wait_run", "arguments": {"runId": run_id, "timeoutMs": 60000}}});
        tokio::spawn(async move {
            http.post(format!("{base}/mcp"))
                .bearer_auth(key)
                .header("Accept", "application/json, text/event-stream")
                .json(&call)
                .send()
                .await
                .unwrap()
        })
    };
    let streamed = http.post(&url).bearer_auth(&key).json(&slow(true)).send().await.unwrap();
    assert_eq!(streamed.status(), 200);
    let mut stream = streamed.bytes_stream();
    let waiting = {
        let (http, url, key, body) = (http.clone(), url.clone(), key.clone(), slow(false));
        tokio::spawn(async move { http.post(url).bearer_auth(key).json(&body).send().await.unwrap() })
    };
    // The streamed answer has begun.
    let mut seen = String::new();
    while !seen.contains("word") {
        let chunk = tokio::time::timeout(Duration::from_secs(10), stream.next()).await.expect("a chunk").unwrap().unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    let out = admin(&stack, &["revoke-key", "--principal", "v1-victim", "--key-prefix", &key[..10]]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let revoked_at = Instant::now();
    let rest = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(Ok(chunk)) = stream.next().await {
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
    })
    .await;
    assert!(rest.is_ok(), "the stream ended within 5 s of the revocation");
    assert!(seen.contains("credentials_revoked"), "{seen}");
    assert!(!seen.contains("[DONE]"), "{seen}");
    let reply = tokio::time::timeout(Duration::from_secs(5), waiting).await.expect("the waiting request ended within 5 s").unwrap();
    assert_eq!(reply.status(), 401);
    let body: Value = reply.json().await.unwrap();
    // OpenAI's code for every 401 (the SDKs raise AuthenticationError); the message says why.
    assert_eq!(body["error"]["code"], "invalid_api_key", "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("revoked"), "{body}");
    let mcp = tokio::time::timeout(Duration::from_secs(5), mcp_wait).await.expect("wait_run ended within 5 s").unwrap();
    assert_eq!(mcp.status(), 401);
    let body: Value = mcp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "credentials_revoked", "{body}");
    assert!(revoked_at.elapsed() < Duration::from_secs(5), "{:?}", revoked_at.elapsed());
    // Both /v1 runs were cancelled with their requests (their answers would take 40 s).
    let db = stack.db.client().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let active: i64 = db
            .query_one(
                "SELECT count(*) FROM runs WHERE status NOT IN ('completed', 'failed', 'cancelled', 'abandoned') AND id::text <> $1",
                &[&run_id],
            )
            .await
            .unwrap()
            .get(0);
        if active == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{active} runs still active");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Nobody holds the whole body budget (acceptance probe H: eight idle connections without any
/// key, each declaring a 16 MiB import and sending nothing, held all of
/// `MAX_BODY_BYTES_IN_FLIGHT`, and every tenant's writes waited 10 s and failed `server_busy`).
/// A request without a credential is weighed against a small budget of its own and may send at
/// most 16 KiB; a bad credential is refused before its body is read; another tenant's stalled
/// bodies hold at most half of the budget. Tenant A's write goes through at once meanwhile.
#[tokio::test]
async fn hostile_stalled_bodies_of_strangers_and_other_tenants_leave_a_tenant_room() {
    let options = StackOptions { workers: 0, api_env: env(&[("MAX_BODY_BYTES_IN_FLIGHT", "2000000"), ("API_BODY_TIMEOUT_MS", "8000")]), ..Default::default() };
    let stack = Stack::start("hostile_body_strangers", options).await.unwrap();
    let a = stack.client();
    let thread = a.create_thread().await.unwrap();
    let b = stack.client_for("tenant-b").unwrap();
    let b_thread = b.create_thread().await.unwrap();
    let b_key = b.key.clone().unwrap();
    let addr = stack.api_url.trim_start_matches("http://").to_owned();
    // Sends a request head declaring `length` bytes and a few of them, then waits for the answer
    // (or until the server closes); returns its status line.
    let stall = |method: &'static str, path: String, auth: Option<String>, length: usize| {
        let addr = addr.clone();
        async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let auth = auth.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
            let head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n{{\"a\":");
            s.write_all(head.as_bytes()).await.unwrap();
            let mut answer = Vec::new();
            let mut buf = [0u8; 4096];
            while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf)).await {
                answer.extend_from_slice(&buf[..n]);
                if n == 0 || answer.windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            String::from_utf8_lossy(&answer).lines().next().unwrap_or_default().to_owned()
        }
    };
    // Without a key: refused at once, and a sign-in's large declared body too.
    let started = Instant::now();
    let big = stall("POST", "/api/threads/import".into(), None, 16 * 1024 * 1024).await;
    assert!(big.starts_with("HTTP/1.1 401"), "{big}");
    let big_sign_in = stall("POST", "/api/session".into(), None, 16 * 1024 * 1024).await;
    assert!(big_sign_in.starts_with("HTTP/1.1 413"), "{big_sign_in}");
    let bad_key = stall("POST", "/api/threads/import".into(), Some("nope".into()), 1_000_000).await;
    assert!(bad_key.starts_with("HTTP/1.1 401"), "{bad_key}");
    // No key on a route that needs one: refused before the body is awaited (verification probe I).
    let keyless = stall("POST", "/api/threads".into(), None, 1_000).await;
    assert!(keyless.starts_with("HTTP/1.1 401"), "{keyless}");
    assert!(started.elapsed() < Duration::from_secs(2), "refused before the bodies were awaited: {:?}", started.elapsed());
    // Stalled sign-ins: four in flight from one address, the others refused at once (verification
    // probe I: forty of them filled the anonymous budget and every sign-in failed).
    let mut stalled = Vec::new();
    let started = Instant::now();
    let signins: Vec<String> = futures_util::future::join_all((0..20).map(|_| {
        let stall = &stall;
        async move { tokio::time::timeout(Duration::from_secs(2), stall("POST", "/api/session".into(), None, 16_000)).await.unwrap_or_default() }
    }))
    .await;
    let refused = signins.iter().filter(|l| l.starts_with("HTTP/1.1 429")).count();
    assert_eq!(refused, 16, "{signins:?}");
    assert!(started.elapsed() < Duration::from_secs(3));
    for _ in 0..4 {
        stalled.push(tokio::spawn(stall("POST", "/api/session".into(), None, 16_000)));
    }
    // Tenant B: four stalled 900 KB bodies; its half (1 MB) holds one of them.
    for _ in 0..4 {
        stalled.push(tokio::spawn(stall("PATCH", format!("/api/threads/{b_thread}"), Some(b_key.clone()), 900_000)));
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    let held = body_bytes_in_flight(&stack).await;
    assert!(held <= 1_000_000.0, "tenant B holds at most half the budget: {held}");
    let started = Instant::now();
    let blob = "x".repeat(890_000);
    let r = a.send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), Some(json!({"metadata": {"blob": blob}})), &[]).await.unwrap();
    assert_eq!(r.status, 200, "{:?}", r.body["error"]);
    assert!(started.elapsed() < Duration::from_secs(3), "tenant A waited {:?}", started.elapsed());
    for s in stalled {
        let line = s.await.unwrap();
        assert!(["408", "503", "429"].iter().any(|c| line.starts_with(&format!("HTTP/1.1 {c}"))), "{line}");
    }
    // The sign-in takes no credential: a stale session cookie does not stop it.
    let r = reqwest::Client::new()
        .post(format!("{}/api/session", stack.api_url))
        .header("Cookie", "agentloop_session=stale")
        .json(&json!({"key": stack.key}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
}

/// `agentloop_slim_event` (live reads slim payloads in PostgreSQL, issue 10): small payloads are
/// untouched; a large one keeps its small members, drops large non-string members and cuts large
/// strings at a character boundary within the member bound, noting the omitted bytes.
#[tokio::test]
async fn hostile_journal_payloads_are_slimmed_in_postgresql() {
    let db = agentloop_tests::TestDb::create().await.unwrap();
    let c = db.client().await.unwrap();
    let slim = |payload: Value, max: i32| {
        let c = &c;
        async move { c.query_one("SELECT agentloop_slim_event($1, $2)", &[&payload, &max]).await.unwrap().get::<_, Value>(0) }
    };
    let small = json!({"a": 1, "b": "x"});
    assert_eq!(slim(small.clone(), 1024).await, small);
    // Member bound: max(1024 / 8, 256) = 256 bytes of JSON text.
    let text = "é".repeat(1000); // 2,000 bytes
    let out = slim(json!({"id": 7, "content": text, "row": {"blob": "m".repeat(5000)}}), 1024).await;
    assert_eq!(out["id"], 7);
    assert_eq!(out["truncated"], true);
    assert!(out.get("row").is_none(), "{out}");
    let mut omitted: Vec<String> = serde_json::from_value(out["omitted"].clone()).unwrap();
    omitted.sort();
    assert_eq!(omitted, ["content", "row"]);
    let content = out["content"].as_str().unwrap();
    let (kept, note) = content.split_once('\n').unwrap();
    assert!(kept.len() <= 256 && kept.chars().all(|ch| ch == 'é') && !kept.is_empty(), "{kept}");
    assert_eq!(note, format!("…[{} bytes omitted]", 2000 - kept.len()));
    assert_eq!(slim(json!("x".repeat(5000)), 1024).await, json!({"truncated": true}));
}
