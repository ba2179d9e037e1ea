//! Issue 12 (parts 1, 3, 4): the OpenAI-compatible endpoints driven by the official SDKs
//! (`openai` on PyPI and npm), the hidden threads' cleanup (client disconnect, api killed
//! mid-stream), thread import, and the northbound MCP server with the rmcp client and the
//! official MCP Python SDK. All against real processes and PostgreSQL.
//!
//! The SDK tests run `tests/sdk/*.py` with `.stack/sdk-venv/bin/python` and `tests/sdk/*.mjs`
//! with `node`; a missing venv or `node_modules` is installed first (`pip install -r
//! tests/sdk/requirements.txt`, `npm ci`). Without `python3` or `node` they print why and pass,
//! except under `CI`, where that fails (`.ci/run` installs them). Transcripts go to
//! `test-output/ecosystem/`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use agentloop_tests::{Sig, Stack, StackOptions, create_key, script};
use futures_util::StreamExt;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn out_dir() -> PathBuf {
    let dir = root().join("test-output/ecosystem");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn works(cmd: &str) -> bool {
    std::process::Command::new(cmd).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// Skips (`None`) when `tool` is missing, outside CI.
fn need(tool: &str) -> Option<()> {
    if works(tool) {
        return Some(());
    }
    assert!(std::env::var_os("CI").is_none(), "{tool} is missing (CI installs it: .ci/run)");
    eprintln!("skipped: {tool} is not installed");
    None
}

/// The SDK venv's python, created and filled from `tests/sdk/requirements.txt` if missing.
fn python() -> Option<PathBuf> {
    need("python3")?;
    let venv = root().join(".stack/sdk-venv");
    let py = venv.join("bin/python");
    let ready = std::process::Command::new(&py)
        .args(["-c", "import openai, mcp"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ready {
        let _lock = std::fs::File::create(root().join(".stack/sdk-venv.lock")).ok();
        let status = std::process::Command::new("python3").args(["-m", "venv"]).arg(&venv).status().unwrap();
        assert!(status.success(), "python3 -m venv failed");
        let status = std::process::Command::new(&py)
            .args(["-m", "pip", "install", "-q", "-r"])
            .arg(root().join("tests/sdk/requirements.txt"))
            .status()
            .unwrap();
        assert!(status.success(), "pip install -r tests/sdk/requirements.txt failed");
    }
    Some(py)
}

fn node() -> Option<()> {
    need("node")?;
    let dir = root().join("tests/sdk");
    if !dir.join("node_modules/openai/package.json").exists() {
        let status = std::process::Command::new("npm").args(["ci", "--no-audit", "--no-fund"]).current_dir(&dir).status().unwrap();
        assert!(status.success(), "npm ci in tests/sdk failed");
    }
    Some(())
}

/// Runs a script, asserting exit status 0; returns its stdout.
async fn run_script(program: &Path, script: &str, env: &[(&str, String)]) -> String {
    let mut cmd = tokio::process::Command::new(program);
    cmd.arg(root().join("tests/sdk").join(script)).current_dir(root().join("tests/sdk"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = tokio::time::timeout(Duration::from_secs(240), cmd.output()).await.expect("script timed out").unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{script} failed\nstdout:\n{stdout}\nstderr:\n{stderr}");
    stdout
}

/// Waits until no hidden thread and no request lease is left.
async fn wait_no_hidden(stack: &Stack, within: Duration) -> Duration {
    let db = stack.db.client().await.unwrap();
    let started = Instant::now();
    loop {
        let row = db
            .query_one(
                "SELECT (SELECT count(*) FROM threads WHERE metadata ->> 'stateless' = 'true'),
                        (SELECT count(*) FROM openai_requests), (SELECT count(*) FROM runs)",
                &[],
            )
            .await
            .unwrap();
        let (threads, leases, runs): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        if threads == 0 && leases == 0 {
            return started.elapsed();
        }
        assert!(started.elapsed() < within, "hidden threads left: {threads} threads, {leases} leases, {runs} runs");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn openai_official_python_and_node_sdks() {
    let Some(py) = python() else { return };
    let Some(()) = node() else { return };
    let stack = Stack::start("ecosystem_openai_sdks", StackOptions::default()).await.unwrap();
    let env = [("AGENTLOOP_BASE", format!("{}/v1", stack.api_url)), ("AGENTLOOP_KEY", stack.key.clone()),
               ("TRANSCRIPT", out_dir().join("openai-python-stream.jsonl").display().to_string())];
    let out = run_script(&py, "openai_sdk.py", &env).await;
    assert!(out.contains("passed, 0 failed"), "{out}");
    let out = run_script(Path::new("node"), "openai_sdk.mjs", &env).await;
    assert!(out.contains("passed, 0 failed"), "{out}");
    // Every request's hidden thread is gone: nothing of a stateless conversation is kept.
    wait_no_hidden(&stack, Duration::from_secs(10)).await;
    let db = stack.db.client().await.unwrap();
    let messages: i64 = db.query_one("SELECT count(*) FROM messages", &[]).await.unwrap().get(0);
    assert_eq!(messages, 0, "no message of a stateless request is kept");
}

/// Posts a streaming request whose answer takes `chunks * delay_ms`; returns the response after
/// its first content chunk was read.
async fn slow_stream(stack: &Stack, chunks: usize, delay_ms: u64) -> String {
    let words: Vec<String> = (0..chunks).map(|i| format!("w{i}")).collect();
    let body = json!({"model": "mock", "stream": true,
                      "messages": [{"role": "user", "content": script(json!([{"text": words.join(" "), "chunkDelayMs": delay_ms}]))}]});
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", stack.api_url))
        .bearer_auth(&stack.key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut stream = resp.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("\"content\":\"w0") {
        let chunk = tokio::time::timeout(T, stream.next()).await.expect("a first content chunk").unwrap().unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(stream); // the connection closes: the client is gone
    seen
}

/// The mock's streams in flight, once they reach 0 (the model call was aborted: the mock
/// notices its client gone at its next write) or after 3 s.
async fn mock_in_flight(stack: &Stack) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let stats: Value = reqwest::get(format!("{}/_mock/stats", stack.mock.url)).await.unwrap().json().await.unwrap();
        let n = stats["inFlight"].as_i64().unwrap();
        if n == 0 || Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A client that disconnects mid-stream: the run is cancelled (its model stream aborted long
/// before it would have finished) and the hidden thread deleted.
#[tokio::test]
async fn openai_client_disconnect_cancels_the_run_and_deletes_the_hidden_thread() {
    let stack = Stack::start("ecosystem_disconnect", StackOptions::default()).await.unwrap();
    let seen = slow_stream(&stack, 40, 250).await; // a 10 s answer
    assert!(seen.starts_with("data: {"), "{seen}");
    let disconnected = Instant::now();
    let took = wait_no_hidden(&stack, Duration::from_secs(8)).await;
    assert_eq!(mock_in_flight(&stack).await, 0, "the model call was not aborted");
    // The answer alone would have taken 10 s.
    assert!(disconnected.elapsed() < Duration::from_secs(8), "cleanup took {took:?}");
    eprintln!("hidden thread deleted {took:?} after the client disconnected");
    let db = stack.db.client().await.unwrap();
    let runs: i64 = db.query_one("SELECT count(*) FROM runs", &[]).await.unwrap().get(0);
    assert_eq!(runs, 0);
}

/// A non-streaming client that gives up while the run is still answering: actix would keep the
/// handler waiting for the whole answer; the api notices the closed socket, cancels the run and
/// deletes the hidden thread.
#[tokio::test]
async fn openai_non_streaming_client_disconnect_cancels_the_run() {
    let stack = Stack::start("ecosystem_disconnect_plain", StackOptions::default()).await.unwrap();
    let words: Vec<String> = (0..40).map(|i| format!("w{i}")).collect();
    let body = json!({"model": "mock",
                      "messages": [{"role": "user", "content": script(json!([{"text": words.join(" "), "chunkDelayMs": 250}]))}]});
    let request = reqwest::Client::new().post(format!("{}/v1/chat/completions", stack.api_url)).bearer_auth(&stack.key).json(&body).send();
    // While it answers, its hidden thread belongs to the request alone: no list shows it, no
    // thread route reads or writes it (a turn posted into it was accepted, then deleted with it).
    let probed = std::sync::atomic::AtomicBool::new(false);
    let probe = async {
        let db = stack.db.client().await.unwrap();
        let hidden: uuid::Uuid = loop {
            if let Some(row) = db.query_opt("SELECT thread_id FROM openai_requests", &[]).await.unwrap() {
                break row.get(0);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let c = stack.client();
        let list = c.get("/api/threads").await.unwrap();
        assert!(!list.body.to_string().contains(&hidden.to_string()), "listed: {list:?}");
        for path in [format!("/api/threads/{hidden}"), format!("/api/threads/{hidden}/messages"), format!("/api/threads/{hidden}/export")] {
            assert_eq!(c.get(&path).await.unwrap().status, 404, "{path}");
        }
        // Nor do the run routes and the thread commands (acceptance probe: the run was readable,
        // PATCH renamed the thread, compact copied the hidden conversation into a listed thread,
        // DELETE and restore went through).
        let run: uuid::Uuid = db.query_one("SELECT id FROM runs WHERE thread_id = $1", &[&hidden]).await.unwrap().get(0);
        for path in [format!("/api/runs/{run}"), format!("/api/runs/{run}/operations")] {
            assert_eq!(c.get(&path).await.unwrap().status, 404, "{path}");
        }
        use reqwest::Method;
        for (method, path, body) in [
            (Method::PATCH, format!("/api/threads/{hidden}"), json!({"title": "mine now"})),
            (Method::POST, format!("/api/threads/{hidden}/compact"), json!({})),
            (Method::POST, format!("/api/threads/{hidden}/chat"), json!({"content": "hello"})),
            (Method::POST, format!("/api/runs/{run}/cancel"), json!({})),
            (Method::DELETE, format!("/api/threads/{hidden}"), json!({})),
        ] {
            let r = c.send(method.clone(), &path, Some(body), &[]).await.unwrap();
            assert_eq!(r.status, 404, "{method} {path}: {r:?}");
        }
        let title: String = db.query_one("SELECT title FROM threads WHERE id = $1", &[&hidden]).await.unwrap().get(0);
        assert_eq!(title, "stateless", "nothing was written");
        probed.store(true, std::sync::atomic::Ordering::SeqCst);
        std::future::pending::<()>().await
    };
    // The client gives up after 1.5 s of a 10 s answer.
    let outcome = tokio::time::timeout(Duration::from_millis(1500), async {
        tokio::select! { r = request => Some(r), _ = probe => None }
    })
    .await;
    assert!(outcome.is_err(), "answered too early");
    assert!(probed.load(std::sync::atomic::Ordering::SeqCst), "the hidden thread was probed while the request ran");
    let disconnected = Instant::now();
    let took = wait_no_hidden(&stack, Duration::from_secs(6)).await;
    assert_eq!(mock_in_flight(&stack).await, 0, "the model call was not aborted");
    assert!(disconnected.elapsed() < Duration::from_secs(6), "cleanup took {took:?}");
    eprintln!("non-streaming: hidden thread deleted {took:?} after the client disconnected");
}

/// A `/v1` request whose run performed an external effect never has it repeated behind the
/// caller's back, and an effect of unknown outcome is never forgotten (acceptance probe: the
/// official SDK resent a request whose model failed after a payment tool ran — three payments
/// under three keys — and a client that went away mid-payment left no record of it).
/// - the model fails after the effect: 502 `model_unavailable` with `x-should-retry: false`
///   (OpenAI's SDKs resend every 5xx without it), the effect ran once, and the thread is kept
///   (the error does not tell what the tool did); a failed request without effects keeps nothing;
/// - the client goes away while the effect runs: the run is cancelled, its operation stays
///   `uncertain`, and the thread is kept as an ordinary thread of the principal where the
///   operation can be resolved, instead of being deleted with the request;
/// - the client goes away after an effect completed, before the answer: the thread is kept too.
#[tokio::test]
async fn openai_an_effect_is_never_resent_nor_forgotten() {
    let options = StackOptions { worker_env: vec![("AGENTLOOP_TEST_TOOLS".into(), "1".into())], ..Default::default() };
    let stack = Stack::start("ecosystem_effects", options).await.unwrap();
    let db = stack.db.client().await.unwrap();
    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", stack.api_url);
    let effects = |label: &'static str| {
        let db = &db;
        async move { db.query_one("SELECT count(*) FROM agentloop_test_effects WHERE label = $1", &[&label]).await.unwrap().get::<_, i64>(0) }
    };

    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": "paid"}}]}, {"status": 500}]);
    let body = json!({"model": "mock", "messages": [{"role": "user", "content": script(steps)}]});
    let r = http.post(&url).bearer_auth(&stack.key).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 502);
    assert_eq!(r.headers().get("x-should-retry").map(|v| v.to_str().unwrap()), Some("false"), "{:?}", r.headers());
    let error: Value = r.json().await.unwrap();
    assert_eq!(error["error"]["code"], "model_unavailable", "{error}");
    assert_eq!(effects("paid").await, 1);
    // The error does not tell the client that the payment happened: its thread is kept.
    wait_no_hidden(&stack, Duration::from_secs(10)).await;
    let paid: uuid::Uuid = db.query_one("SELECT id FROM threads WHERE metadata ->> 'openaiRequest' = 'true'", &[]).await.unwrap().get(0);
    let status: String = db.query_one("SELECT status FROM operations WHERE thread_id = $1", &[&paid]).await.unwrap().get(0);
    assert_eq!(status, "completed");
    // A failed request without effects keeps nothing.
    let body = json!({"model": "mock", "messages": [{"role": "user", "content": script(json!([{"status": 500}]))}]});
    let r = http.post(&url).bearer_auth(&stack.key).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 502);
    wait_no_hidden(&stack, Duration::from_secs(10)).await;
    let threads: i64 = db.query_one("SELECT count(*) FROM threads", &[]).await.unwrap().get(0);
    assert_eq!(threads, 1, "only the thread with the effect is kept");

    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": "slow", "seconds": 30}}]}, {"text": "never"}]);
    let body = json!({"model": "mock", "messages": [{"role": "user", "content": script(steps)}]});
    let request = http.post(&url).bearer_auth(&stack.key).json(&body).send();
    let started = async {
        while effects("slow").await == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::select! {
        r = request => panic!("answered while the effect ran: {r:?}"),
        () = started => {}
    }
    // The request future is dropped: the client is gone mid-effect.
    let deadline = Instant::now() + T;
    let thread: uuid::Uuid = loop {
        let row = db
            .query_opt("SELECT id FROM threads WHERE metadata ->> 'openaiRequest' = 'true' AND id <> $1 AND NOT EXISTS (SELECT 1 FROM openai_requests)", &[&paid])
            .await
            .unwrap();
        if let Some(row) = row {
            break row.get(0);
        }
        assert!(Instant::now() < deadline, "the thread of the uncertain effect was not kept");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let c = stack.client();
    let list = c.get("/api/threads").await.unwrap();
    assert!(list.body.to_string().contains(&thread.to_string()), "the kept thread is listed: {list:?}");
    let run: uuid::Uuid = db.query_one("SELECT id FROM runs WHERE thread_id = $1", &[&thread]).await.unwrap().get(0);
    let ops = c.get(&format!("/api/runs/{run}/operations")).await.unwrap();
    assert_eq!(ops.status, 200, "{ops:?}");
    assert_eq!(ops.body["run"]["status"], "cancelled", "{ops:?}");
    let op = &ops.body["operations"][0];
    assert_eq!(op["status"], "uncertain", "{ops:?}");
    let key = op["key"].as_str().unwrap().replace(':', "%3A");
    let resolved = c.post(&format!("/api/runs/{run}/operations/{key}/resolve"), json!({"outcome": "completed", "result": "checked by hand", "runUpdatedAt": ops.body["run"]["updatedAt"]})).await.unwrap();
    assert_eq!(resolved.status, 200, "{resolved:?}");
    assert_eq!(effects("slow").await, 1, "never performed again");
    // Nothing sweeps it later.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(c.get(&format!("/api/threads/{thread}")).await.unwrap().status, 200);

    // The client goes away after an effect completed, while the answer streams: it never learns
    // of the effect, so its thread is kept too (with the operation `completed`).
    let words: Vec<String> = (0..40).map(|i| format!("w{i}")).collect();
    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": "done"}}]}, {"text": words.join(" "), "chunkDelayMs": 250}]);
    let body = json!({"model": "mock", "messages": [{"role": "user", "content": script(steps)}]});
    let request = http.post(&url).bearer_auth(&stack.key).json(&body).send();
    let answering = async {
        while effects("done").await == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The answer after the effect takes 10 s: it is streaming by now.
        tokio::time::sleep(Duration::from_millis(1500)).await;
    };
    tokio::select! {
        r = request => panic!("answered too early: {r:?}"),
        () = answering => {}
    }
    let deadline = Instant::now() + T;
    let kept: uuid::Uuid = loop {
        let row = db
            .query_opt("SELECT id FROM threads WHERE metadata ->> 'openaiRequest' = 'true' AND id <> $1 AND id <> $2", &[&thread, &paid])
            .await
            .unwrap();
        if let Some(row) = row {
            break row.get(0);
        }
        assert!(Instant::now() < deadline, "the thread of the unanswered effect was not kept");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let status: String = db.query_one("SELECT status FROM operations WHERE thread_id = $1", &[&kept]).await.unwrap().get(0);
    assert_eq!(status, "completed");
    assert_eq!(effects("done").await, 1);
    wait_no_hidden(&stack, Duration::from_secs(10)).await;

    // A request answered after its effect is kept too: the api cannot know that the client got
    // the answer (acceptance probe F: clients that closed just before it was written lost
    // the answer and the record of their payment with it).
    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": "answered"}}]}, {"text": "paid once"}]);
    let body = json!({"model": "mock", "messages": [{"role": "user", "content": script(steps)}]});
    let r = http.post(&url).bearer_auth(&stack.key).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["choices"][0]["message"]["content"], "paid once");
    wait_no_hidden(&stack, Duration::from_secs(10)).await;
    let row = db
        .query_opt(
            "SELECT t.title FROM threads t JOIN operations o ON o.thread_id = t.id
              WHERE o.arguments ->> 'label' = 'answered' AND t.metadata ->> 'openaiRequest' = 'true'",
            &[],
        )
        .await
        .unwrap();
    let title: String = row.expect("the answered request's record of its effect was deleted").get(0);
    assert_eq!(title, "OpenAI request whose tool calls took effect");
}

/// A client's tool loop carries the server's own calls (migration 000038; acceptance probe G,
/// G-7): a request runs a server tool that takes effect, then the model calls a client tool; the
/// answer returns only the client's call, and the client's next request carries only what it
/// saw. The model's next context must still hold the server's call and its result — else it
/// does not know the payment happened (here the scripted model, counting its own turns, calls
/// the client tool again instead of answering). Streamed and not; another principal sending the
/// same messages gets nothing of it.
#[tokio::test]
async fn openai_a_client_tool_loop_keeps_the_server_calls_in_the_model_context() {
    let options = StackOptions { worker_env: vec![("AGENTLOOP_TEST_TOOLS".into(), "1".into())], ..Default::default() };
    let stack = Stack::start("ecosystem_client_loop", options).await.unwrap();
    let db = stack.db.client().await.unwrap();
    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", stack.api_url);
    let other = create_key(&stack.db.url, "other").unwrap();
    let tools = json!([{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]);
    for stream in [false, true] {
        let steps = json!([
            {"text": "paying", "toolCalls": [{"name": "record_effect", "arguments": {"label": "paid"}}]},
            {"text": "looking up", "toolCalls": [{"name": "lookup", "arguments": {"q": "receipt"}}]},
            {"text": "done: {{tool_result}}"}
        ]);
        let mut messages = vec![json!({"role": "user", "content": script(steps)})];
        let body = json!({"model": "mock", "messages": messages, "tools": tools, "stream": stream});
        let r = http.post(&url).bearer_auth(&stack.key).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let message = if stream {
            // The streamed answer, assembled as an SDK does.
            let text = r.text().await.unwrap();
            let mut content = String::new();
            let mut calls: Vec<Value> = Vec::new();
            for data in text.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
                let chunk: Value = serde_json::from_str(data).unwrap();
                let delta = &chunk["choices"][0]["delta"];
                content.push_str(delta["content"].as_str().unwrap_or_default());
                for call in delta["tool_calls"].as_array().into_iter().flatten() {
                    calls.push(json!({"id": call["id"], "type": "function", "function": call["function"]}));
                }
            }
            json!({"role": "assistant", "content": content, "tool_calls": calls})
        } else {
            let completion: Value = r.json().await.unwrap();
            assert_eq!(completion["choices"][0]["finish_reason"], "tool_calls", "{completion}");
            completion["choices"][0]["message"].clone()
        };
        assert_eq!(message["content"], "paying\n\nlooking up", "{message}");
        let calls = message["tool_calls"].as_array().unwrap().clone();
        assert_eq!(calls.len(), 1, "{message}");
        assert_eq!(calls[0]["function"]["name"], "lookup");
        // The client runs its tool and sends the conversation back, as it saw it.
        messages.push(message.clone());
        messages.push(json!({"role": "tool", "tool_call_id": calls[0]["id"], "content": "receipt #7"}));
        let body = json!({"model": "mock", "messages": messages, "tools": tools});
        // Another principal with the same messages: nothing of the first principal's run.
        let r = http.post(&url).bearer_auth(&other).json(&body).send().await.unwrap();
        let completion: Value = r.json().await.unwrap();
        assert_eq!(completion["choices"][0]["finish_reason"], "tool_calls", "another principal's context: {completion}");
        let r = http.post(&url).bearer_auth(&stack.key).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let completion: Value = r.json().await.unwrap();
        assert_eq!(completion["choices"][0]["finish_reason"], "stop", "the model saw its payment: {completion}");
        assert_eq!(completion["choices"][0]["message"]["content"], "done: receipt #7", "{completion}");
        // What the model was sent: the server's call and its result before the client's call,
        // whose text is its own (not the answer's joined text).
        let sent = stack.mock.requests().await.unwrap();
        let last = sent.last().unwrap()["messages"].as_array().unwrap().clone();
        let server = last
            .iter()
            .position(|m| m["tool_calls"][0]["function"]["name"] == "record_effect")
            .unwrap_or_else(|| panic!("the server call is in the context: {last:?}"));
        assert_eq!(last[server]["content"], "paying");
        assert_eq!(last[server + 1]["role"], "tool");
        assert_eq!(last[server + 2]["tool_calls"][0]["id"], calls[0]["id"]);
        assert_eq!(last[server + 2]["content"], "looking up");
        assert_eq!(last[server + 3]["content"], "receipt #7");
        assert_eq!(last.len(), server + 4, "{last:?}");
        let paid: i64 = db.query_one("SELECT count(*) FROM agentloop_test_effects WHERE label = 'paid'", &[]).await.unwrap().get(0);
        assert_eq!(paid, if stream { 2 } else { 1 }, "one payment per loop");
        if stream {
            continue;
        }
        // The conversation after the server's calls are put back is bounded like the request
        // (migration 000041; before, it was counted only before, and grew past the bound).
        let limit = 10_000;
        let mut full: Vec<Value> = (0..limit - messages.len()).map(|i| json!({"role": "user", "content": format!("filler {i}")})).collect();
        full.extend(messages.iter().cloned());
        assert_eq!(full.len(), limit);
        let body = json!({"model": "mock", "messages": full, "tools": tools});
        let r = http.post(&url).bearer_auth(&stack.key).json(&body).send().await.unwrap();
        let status = r.status();
        let error: Value = r.json().await.unwrap();
        assert_eq!(status, 400, "{error}");
        assert_eq!(error["error"]["code"], "too_many_messages", "{error}");
        let paid: i64 = db.query_one("SELECT count(*) FROM agentloop_test_effects WHERE label = 'paid'", &[]).await.unwrap().get(0);
        assert_eq!(paid, 1, "a refused request ran nothing");
    }
    // A run's messages are put back once, however many of the client's messages carry its
    // calls (migration 000041; before, a copy before each): two parallel client calls, sent
    // back as two assistant messages.
    let steps = json!([
        {"text": "paying", "toolCalls": [{"name": "record_effect", "arguments": {"label": "split"}}]},
        {"text": "looking up", "toolCalls": [{"name": "lookup", "arguments": {"q": "a"}}, {"name": "lookup", "arguments": {"q": "b"}}]},
        {"text": "done"}
    ]);
    let mut messages = vec![json!({"role": "user", "content": script(steps)})];
    let body = json!({"model": "mock", "messages": messages, "tools": tools});
    let completion: Value = http.post(&url).bearer_auth(&stack.key).json(&body).send().await.unwrap().json().await.unwrap();
    let message = &completion["choices"][0]["message"];
    let calls = message["tool_calls"].as_array().unwrap().clone();
    assert_eq!(calls.len(), 2, "{completion}");
    for (i, call) in calls.iter().enumerate() {
        messages.push(json!({"role": "assistant", "content": if i == 0 { message["content"].clone() } else { json!("") }, "tool_calls": [call]}));
        messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": format!("result {i}")}));
    }
    let body = json!({"model": "mock", "messages": messages, "tools": tools});
    let r = http.post(&url).bearer_auth(&stack.key).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let sent = stack.mock.requests().await.unwrap();
    let last = sent.last().unwrap()["messages"].as_array().unwrap().clone();
    let paying = last.iter().filter(|m| m["content"] == "paying").count();
    assert_eq!(paying, 1, "the run's messages were put back once: {last:?}");
    let server_calls = last.iter().filter(|m| m["tool_calls"][0]["function"]["name"] == "record_effect").count();
    assert_eq!(server_calls, 1, "{last:?}");
}

/// `Idempotency-Key` on `/v1/chat/completions` (migration 000036; acceptance probe F: the
/// official SDK with a short timeout resent a request whose server tool was a payment, and each
/// resend was a new run — three payments, the header accepted and ignored). A resend with the
/// key attaches to the run in flight or gets its recorded outcome, streamed or not; the client
/// going away does not cancel a keyed run; another body under the key is refused.
#[tokio::test]
async fn openai_idempotency_key_makes_resends_safe() {
    let options = StackOptions { worker_env: vec![("AGENTLOOP_TEST_TOOLS".into(), "1".into())], ..Default::default() };
    let stack = Stack::start("ecosystem_v1_key", options).await.unwrap();
    let db = stack.db.client().await.unwrap();
    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", stack.api_url);
    let effects = |label: &'static str| {
        let db = &db;
        async move { db.query_one("SELECT count(*) FROM agentloop_test_effects WHERE label = $1", &[&label]).await.unwrap().get::<_, i64>(0) }
    };
    let post = |body: &Value, key: &str| http.post(&url).bearer_auth(&stack.key).header("Idempotency-Key", key).json(body);

    // The SDK gives up after 1 s of a 3 s answer that follows a payment, and resends.
    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": "keyed"}}]}, {"text": "paid once", "delayMs": 3000}]);
    let body = json!({"model": "mock", "messages": [{"role": "user", "content": script(steps)}]});
    let first = post(&body, "pay-1").timeout(Duration::from_secs(1)).send().await;
    assert!(first.is_err(), "answered within the client's timeout: {first:?}");
    let r = post(&body, "pay-1").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let answer: Value = r.json().await.unwrap();
    assert_eq!(answer["choices"][0]["message"]["content"], "paid once", "{answer}");
    assert_eq!(effects("keyed").await, 1, "the resend ran the payment again");
    let runs: i64 = db.query_one("SELECT count(*) FROM runs", &[]).await.unwrap().get(0);
    assert_eq!(runs, 1, "the resend started another run");

    // After the end: the recorded outcome, not run again; streamed when asked so.
    let r = post(&body, "pay-1").send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers().get("idempotent-replayed").map(|v| v.to_str().unwrap()), Some("true"));
    assert_eq!(r.json::<Value>().await.unwrap(), answer, "the replay differs from the answer");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    // The body differs (`stream`) but not the request: `stream` is not part of its fingerprint.
    let text = post(&streamed, "pay-1").send().await.unwrap().text().await.unwrap();
    assert!(text.contains(r#""content":"paid once""#) && text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert_eq!(effects("keyed").await, 1);
    // Another request under the same key.
    let other = json!({"model": "mock", "messages": [{"role": "user", "content": "something else"}]});
    let r = post(&other, "pay-1").send().await.unwrap();
    assert_eq!(r.status(), 409);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "idempotency_conflict");

    // A streaming client that goes away mid-answer: the run goes on, and the resend streams the
    // whole answer from its start.
    let words: Vec<String> = (0..12).map(|i| format!("w{i}")).collect();
    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": "streamed"}}]}, {"text": words.join(" "), "chunkDelayMs": 200}]);
    let body = json!({"model": "mock", "stream": true, "messages": [{"role": "user", "content": script(steps)}]});
    let mut events = post(&body, "pay-2").send().await.unwrap().bytes_stream();
    let mut seen = String::new();
    while !seen.contains("w1") {
        seen.push_str(&String::from_utf8_lossy(&events.next().await.unwrap().unwrap()));
    }
    drop(events);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let text = post(&body, "pay-2").send().await.unwrap().text().await.unwrap();
    let content: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(content, words.join(" "), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert_eq!(effects("streamed").await, 1);
    let runs: i64 = db.query_one("SELECT count(*) FROM runs", &[]).await.unwrap().get(0);
    assert_eq!(runs, 2, "one run per key");
    // Both requests paid: their threads are the records of the payments; nothing is left hidden.
    wait_no_hidden(&stack, Duration::from_secs(10)).await;
}

/// OpenAI generation parameters on `/v1` are the run's settings or refused, never silently
/// dropped (acceptance probe F: `max_tokens`, `stop`, `response_format` and `tool_choice: "none"`
/// were accepted and ignored — a cost bound and an answer's contract lost without a word).
#[tokio::test]
async fn openai_generation_parameters_are_honoured_or_refused() {
    let stack = Stack::start("ecosystem_v1_params", StackOptions::default()).await.unwrap();
    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", stack.api_url);
    let send = |extra: Value| {
        let mut body = json!({"model": "mock", "messages": [{"role": "user", "content": script(json!([{"text": "ok"}]))}]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        http.post(&url).bearer_auth(&stack.key).json(&body).send()
    };
    let last_upstream = || async {
        let sent = stack.mock.requests().await.unwrap();
        sent.last().unwrap().clone()
    };
    let r = send(json!({"max_completion_tokens": 77, "temperature": 0.3})).await.unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let upstream = last_upstream().await;
    assert_eq!((upstream["max_tokens"].as_u64(), upstream["temperature"].as_f64()), (Some(77), Some(0.3)), "{upstream}");
    let r = send(json!({"max_tokens": 55, "stop": null, "response_format": {"type": "text"}, "tool_choice": "auto", "logprobs": false,
                        "top_p": 1, "functions": [], "function_call": "auto", "modalities": ["text"], "audio": null})).await.unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    assert_eq!(last_upstream().await["max_tokens"], 55);
    let requests_before = stack.mock.requests().await.unwrap().len();
    for (extra, code, param) in [
        (json!({"stop": ["\n"]}), "unsupported_parameter", "stop"),
        (json!({"response_format": {"type": "json_object"}}), "unsupported_parameter", "response_format"),
        (json!({"tool_choice": "none"}), "unsupported_parameter", "tool_choice"),
        (json!({"logprobs": true}), "unsupported_parameter", "logprobs"),
        (json!({"top_logprobs": 3}), "unsupported_parameter", "top_logprobs"),
        (json!({"functions": [{"name": "f", "parameters": {}}]}), "unsupported_parameter", "functions"),
        (json!({"function_call": "none"}), "unsupported_parameter", "function_call"),
        (json!({"modalities": ["text", "audio"]}), "unsupported_parameter", "modalities"),
        (json!({"audio": {"voice": "alloy", "format": "wav"}}), "unsupported_parameter", "audio"),
        (json!({"max_tokens": 0}), "invalid_request", "max_tokens"),
        (json!({"temperature": 3}), "invalid_request", "temperature"),
    ] {
        let r = send(extra.clone()).await.unwrap();
        assert_eq!(r.status(), 400, "{extra}");
        let error: Value = r.json().await.unwrap();
        assert_eq!((error["error"]["code"].as_str(), error["error"]["param"].as_str()), (Some(code), Some(param)), "{extra}: {error}");
    }
    assert_eq!(stack.mock.requests().await.unwrap().len(), requests_before, "a refused request reached the model");
}

/// A non-streaming `/v1` request whose api loses its database while the run goes on waits it
/// out and answers the run's answer, as a streaming one does (acceptance probe F: 503 "retry
/// later" for a request whose payment had happened and whose run then completed).
#[tokio::test]
async fn openai_a_database_outage_while_waiting_is_waited_out() {
    let options = StackOptions {
        worker_env: vec![("AGENTLOOP_TEST_TOOLS".into(), "1".into())],
        api_through_proxy: true,
        ..Default::default()
    };
    let stack = Stack::start("ecosystem_v1_outage", options).await.unwrap();
    let proxy = stack.proxy.as_ref().unwrap();
    // The api's database goes down (its connections cut, new ones refused) for 6 s; the worker's
    // does not, and its run completes meanwhile.
    let answer = paid_through(&stack, "outage", 1500, async {
        proxy.go_down();
        tokio::time::sleep(Duration::from_secs(6)).await;
        proxy.pass();
    })
    .await;
    assert_eq!(answer["choices"][0]["message"]["content"], "paid", "{answer}");
}

/// Sends a `/v1` request whose run pays (`record_effect` with `label`), then answers "paid"
/// after `delay_ms`; runs `fault` once the payment is recorded; returns the answer, which must
/// be a 200.
async fn paid_through(stack: &Stack, label: &str, delay_ms: u64, fault: impl std::future::Future<Output = ()>) -> Value {
    let db = stack.db.client().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": label}}]}, {"text": "paid", "delayMs": delay_ms}]);
    let body = json!({"model": "mock", "messages": [{"role": "user", "content": script(steps)}]});
    let url = format!("{}/v1/chat/completions", stack.api_url);
    let request = reqwest::Client::new().post(&url).bearer_auth(&stack.key).json(&body).send();
    let fault = async {
        while db.query_one("SELECT count(*) FROM agentloop_test_effects WHERE label = $1", &[&label]).await.unwrap().get::<_, i64>(0) == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        fault.await;
        std::future::pending::<()>().await
    };
    let r = tokio::select! {
        r = request => r.unwrap(),
        () = fault => unreachable!(),
    };
    let status = r.status();
    let answer: Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{answer}");
    answer
}

/// A database outage longer than the apis' request lease does not make the workers' sweep
/// cancel requests whose api is alive and waiting: after the outage it spares leases that
/// expired meanwhile until the apis renew them (verification probe G: a request paid, then was
/// answered 502 `cancelled`).
#[tokio::test]
async fn openai_an_outage_longer_than_the_request_lease_cancels_nothing() {
    let options = StackOptions {
        api_env: vec![("OPENAI_REQUEST_LEASE_MS".into(), "1500".into())],
        worker_env: vec![
            ("HIDDEN_THREAD_SWEEP_MS".into(), "300".into()),
            ("OPENAI_REQUEST_LEASE_MS".into(), "1500".into()),
            ("AGENTLOOP_TEST_TOOLS".into(), "1".into()),
        ],
        api_through_proxy: true,
        workers_through_proxy: true,
        ..Default::default()
    };
    let stack = Stack::start("ecosystem_v1_long_outage", options).await.unwrap();
    let proxy = stack.proxy.as_ref().unwrap();
    // Everyone's database goes away for 4 s: more than twice the request lease. When it is back,
    // the api's first renewal is held 3 s more (the sweep runs every 300 ms), so the sweep meets
    // the expired lease of a live api, as it can after any outage.
    let answer = paid_through(&stack, "long", 6000, async {
        proxy.go_down();
        tokio::time::sleep(Duration::from_secs(4)).await;
        proxy.freeze_new(agentloop_tests::proxy::FreezeAt::ClientSends(b"agentloop_openai_renew".to_vec()));
        proxy.come_up();
        tokio::time::sleep(Duration::from_secs(3)).await;
        proxy.pass();
    })
    .await;
    assert_eq!(answer["choices"][0]["message"]["content"], "paid", "{answer}");
}

/// A keyed `/v1` request whose api dies before anything took effect: the sweep leaves its run
/// going (as when its client goes away), the run pays once and completes, and a resend to the
/// restarted api gets that run's answer — not `request_interrupted` (verification probe G: the
/// sweep cut keyed runs, or every resend after it was refused although the run had completed).
#[tokio::test]
async fn openai_a_keyed_request_outlives_its_api() {
    let options = StackOptions {
        api_env: vec![("OPENAI_REQUEST_LEASE_MS".into(), "1500".into())],
        worker_env: vec![("HIDDEN_THREAD_SWEEP_MS".into(), "300".into()), ("AGENTLOOP_TEST_TOOLS".into(), "1".into())],
        ..Default::default()
    };
    let mut stack = Stack::start("ecosystem_v1_key_api_died", options).await.unwrap();
    let db = stack.db.client().await.unwrap();
    let http = reqwest::Client::new();
    // The model thinks for 4 s, then pays, then answers.
    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": "late"}}], "delayMs": 4000}, {"text": "paid late"}]);
    let body = json!({"model": "mock", "messages": [{"role": "user", "content": script(steps)}]});
    let key = stack.key.clone();
    let post = |url: String| http.post(format!("{url}/v1/chat/completions")).bearer_auth(&key).header("Idempotency-Key", "late-1").json(&body).send();
    let first = post(stack.api_url.clone());
    tokio::select! {
        r = first => panic!("answered before the api died: {r:?}"),
        () = tokio::time::sleep(Duration::from_millis(1000)) => {}
    }
    stack.restart_api().await.unwrap(); // SIGKILL, then a new process
    // The lease (1.5 s) expires long before the run ends (4 s); the run is left going.
    let deadline = Instant::now() + T;
    loop {
        let done: i64 = db.query_one("SELECT count(*) FROM runs WHERE status = 'completed'", &[]).await.unwrap().get(0);
        if done == 1 {
            break;
        }
        let cancelled: i64 = db.query_one("SELECT count(*) FROM runs WHERE status = 'cancelled'", &[]).await.unwrap().get(0);
        assert_eq!(cancelled, 0, "the sweep cancelled the keyed run");
        assert!(Instant::now() < deadline, "the run did not complete");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wait_no_hidden(&stack, Duration::from_secs(10)).await;
    let r = post(stack.api_url.clone()).await.unwrap();
    let status = r.status();
    let answer: Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["choices"][0]["message"]["content"], "paid late", "{answer}");
    let effects: i64 = db.query_one("SELECT count(*) FROM agentloop_test_effects WHERE label = 'late'", &[]).await.unwrap().get(0);
    assert_eq!(effects, 1);
}

/// The api process dies mid-stream: its request leases expire and the workers' sweep cancels the
/// run and deletes the hidden thread.
#[tokio::test]
async fn openai_api_killed_mid_stream_hidden_thread_is_swept() {
    let options = StackOptions {
        api_env: vec![("OPENAI_REQUEST_LEASE_MS".into(), "1500".into())],
        worker_env: vec![("HIDDEN_THREAD_SWEEP_MS".into(), "300".into())],
        ..Default::default()
    };
    let stack = Stack::start("ecosystem_api_killed", options).await.unwrap();
    let _ = slow_stream(&stack, 60, 250).await; // a 15 s answer
    stack.api.signal(Sig::SIGKILL);
    let took = wait_no_hidden(&stack, Duration::from_secs(10)).await;
    assert_eq!(mock_in_flight(&stack).await, 0, "the model call of the abandoned run was not aborted");
    eprintln!("hidden thread swept {took:?} after the api was killed");
}

fn llmspy_thread() -> Value {
    json!({
        "id": 1767159700000i64, "title": "Capitals", "model": "gpt-4o-mini", "systemPrompt": "Answer in one word.",
        "createdAt": "2025-12-31T05:41:40.000Z",
        "messages": [
            {"id": 1, "role": "user", "content": "Capital of France?", "timestamp": 1767159706686i64},
            {"id": 2, "role": "assistant", "content": "Paris", "reasoning": "well known", "timestamp": 1767159707000i64},
            {"id": 3, "role": "user", "content": "And 6*7?", "timestamp": 1767159710000i64},
            {"id": 4, "role": "assistant", "content": null, "timestamp": 1767159711000i64,
             "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "calculator", "arguments": "{\"expression\":\"6*7\"}"}}]},
            {"id": 5, "role": "tool", "tool_call_id": "call_a", "content": "42", "timestamp": 1767159711000i64},
            {"id": 6, "role": "assistant", "content": "42", "timestamp": 1767159712000i64},
            {"id": 7, "role": "assistant", "content": "partial", "streaming": true}
        ]
    })
}

/// The agentloop export shape of CONTRACTS.md (a fixture; the live export is compared below
/// when the route exists).
fn agentloop_export() -> Value {
    json!({
        "format": "agentloop.thread.v1",
        "thread": {"id": "9c1f7d3e-0000-4000-8000-000000000001", "title": "Exported", "model": "mock",
                   "metadata": {"multitask": "enqueue"}, "createdAt": "2026-11-01T10:00:00.000Z"},
        "messages": [
            {"role": "system", "content": "You are terse.", "createdAt": "2026-11-01T10:00:00.000Z"},
            {"role": "user", "content": [{"type": "text", "text": "What is 6*7?"}], "createdAt": "2026-11-01T10:00:01.000Z"},
            {"role": "assistant", "content": "", "toolCalls": [{"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": "{\"expression\":\"6*7\"}"}}],
             "reasoning": "use the tool", "createdAt": "2026-11-01T10:00:02.000Z"},
            {"role": "tool", "content": "42", "toolCallId": "call_1", "createdAt": "2026-11-01T10:00:02.000Z"},
            {"role": "assistant", "content": "42, stopped ear", "stopped": true, "createdAt": "2026-11-01T10:00:02.000Z"}
        ]
    })
}

async fn import(c: &agentloop_tests::Client, doc: Value, key: Option<&str>) -> agentloop_tests::Reply {
    let headers: Vec<(&str, &str)> = key.map(|k| vec![("Idempotency-Key", k)]).unwrap_or_default();
    c.send(reqwest::Method::POST, "/api/threads/import", Some(doc), &headers).await.unwrap()
}

/// Sequences 1..n without gaps and strictly increasing timestamp identities.
async fn assert_canonical(stack: &Stack, thread: &str, n: i64) -> Vec<tokio_postgres::Row> {
    let db = stack.db.client().await.unwrap();
    let id = uuid::Uuid::parse_str(thread).unwrap();
    let rows = db
        .query("SELECT sequence, timestamp_ms, role, content, tool_calls, tool_call_id, reasoning, stopped, to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') FROM messages WHERE thread_id = $1 ORDER BY sequence", &[&id])
        .await
        .unwrap();
    assert_eq!(rows.len() as i64, n);
    let seqs: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(seqs, (1..=n).collect::<Vec<_>>(), "gap-free sequences");
    let ts: Vec<i64> = rows.iter().map(|r| r.get(1)).collect();
    assert!(ts.windows(2).all(|w| w[0] < w[1]), "strictly increasing timestamps: {ts:?}");
    let t = db.query_one("SELECT message_count, last_sequence, last_timestamp_ms FROM threads WHERE id = $1", &[&id]).await.unwrap();
    assert_eq!((t.get::<_, i32>(0) as i64, t.get::<_, i64>(1), t.get::<_, i64>(2)), (n, n, *ts.last().unwrap()));
    rows
}

#[tokio::test]
async fn import_formats_idempotency_validation_and_continuing_the_thread() {
    let options = StackOptions { api_env: vec![("IMPORT_MAX_BYTES".into(), "200000".into())], ..Default::default() };
    let stack = Stack::start("ecosystem_import", options).await.unwrap();
    let c = stack.client();

    // ServiceStack llms.py thread: system prompt, reasoning, a tool exchange, times kept.
    let r = import(&c, llmspy_thread(), None).await;
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(r.body["format"], "llmspy");
    assert_eq!(r.body["messages"], 7);
    let actions: Vec<&str> = r.body["repairs"].as_array().unwrap().iter().map(|x| x["action"].as_str().unwrap()).collect();
    assert_eq!(actions, ["dropped_streaming", "model_dropped"], "{}", r.body);
    let thread = r.body["thread"]["id"].as_str().unwrap().to_owned();
    assert_eq!(r.body["thread"]["title"], "Capitals");
    let rows = assert_canonical(&stack, &thread, 7).await;
    assert_eq!(rows[0].get::<_, String>(2), "system");
    assert_eq!(rows[1].get::<_, i64>(1), 1767159706686, "the source's time is the identity");
    assert_eq!(rows[5].get::<_, i64>(1), 1767159711001, "an equal time is raised above the one before");
    assert_eq!(rows[2].get::<_, Option<String>>(6).as_deref(), Some("well known"));
    // The imported thread goes on like any other; the model sees the imported tool exchange.
    let posted = c.chat(&thread, "Thanks").await.unwrap();
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let sent = stack.mock.requests().await.unwrap().pop().unwrap();
    let roles: Vec<&str> = sent["messages"].as_array().unwrap().iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user", "assistant", "tool", "assistant", "user"]);
    assert_eq!(sent["messages"][5]["tool_call_id"], "call_a");

    // OpenAI messages: an orphan tool result becomes context; Idempotency-Key replays.
    let doc = json!({"title": "from openai", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "tool", "tool_call_id": "ghost", "content": "stray"},
        {"role": "assistant", "content": "hello"}]});
    let first = import(&c, doc.clone(), Some("import-1")).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(first.body["repairs"][0]["action"], "tool_result_to_context");
    let again = import(&c, doc.clone(), Some("import-1")).await;
    assert_eq!(again.status, 200, "{again:?}");
    assert_eq!(again.body["thread"]["id"], first.body["thread"]["id"], "a re-import returns the same thread");
    assert_eq!(again.body["replayed"], true);
    let conflict = import(&c, json!([{"role": "user", "content": "other"}]), Some("import-1")).await;
    assert_eq!((conflict.status, conflict.body["error"]["code"].as_str()), (409, Some("idempotency_conflict")));
    let rows = assert_canonical(&stack, first.body["thread"]["id"].as_str().unwrap(), 3).await;
    assert_eq!(rows[1].get::<_, Value>(3), json!("[tool result for ghost]: stray"));
    assert_eq!(rows[1].get::<_, String>(2), "user");

    // Clear 400s naming the field, 413 over IMPORT_MAX_BYTES, nothing half-written.
    let db = stack.db.client().await.unwrap();
    let before: i64 = db.query_one("SELECT count(*) FROM threads", &[]).await.unwrap().get(0);
    for (doc, code, needle) in [
        (json!({"messages": [{"role": "wizard", "content": "x"}]}), "invalid_import", "messages[0].role"),
        (json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}]},
                             {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}]}]}), "duplicate_tool_call_id", "messages[1].tool_calls[0].id"),
        (json!({"format": "agentloop.thread.v2", "messages": []}), "unsupported_format", "format"),
        (json!({"threads": [llmspy_thread(), llmspy_thread()]}), "invalid_import", "one at a time"),
        (json!({"format": "agentloop.thread.v1", "thread": {"metadata": {"multitask": "sometimes"}}, "messages": [{"role": "user", "content": "x"}]}), "invalid_metadata", "multitask"),
        (json!(42), "invalid_import", "JSON object"),
        (json!({"title": "t".repeat(501), "messages": [{"role": "user", "content": "x"}]}), "invalid_title", "500 characters"),
    ] {
        let r = import(&c, doc, None).await;
        assert_eq!((r.status, r.body["error"]["code"].as_str()), (400, Some(code)), "{r:?}");
        assert!(r.body["error"]["message"].as_str().unwrap().contains(needle), "{r:?}");
    }
    let big = json!([{"role": "user", "content": "x".repeat(250_000)}]);
    let r = import(&c, big, None).await;
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (413, Some("payload_too_large")), "{r:?}");
    let after: i64 = db.query_one("SELECT count(*) FROM threads", &[]).await.unwrap().get(0);
    assert_eq!(before, after, "a refused import writes nothing");

    // Another principal neither sees nor replays the import.
    let other = stack.client_for("other").unwrap();
    assert_eq!(other.get(&format!("/api/threads/{thread}")).await.unwrap().status, 404);
    let theirs = import(&other, doc, Some("import-1")).await;
    assert_eq!(theirs.status, 201, "keys are per principal: {theirs:?}");
    assert_ne!(theirs.body["thread"]["id"], first.body["thread"]["id"]);
}

/// The export shape of CONTRACTS.md round-trips: import -> export -> import -> export are equal
/// except ids (against the live `GET /api/threads/{id}/export` when the route exists), and the
/// fixture's own fields survive import exactly (times to the millisecond).
#[tokio::test]
async fn import_round_trips_the_agentloop_export_shape() {
    let stack = Stack::start("ecosystem_import_export", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let fixture = agentloop_export();
    let r = import(&c, fixture.clone(), None).await;
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(r.body["format"], "agentloop.thread.v1");
    assert!(r.body["repairs"].as_array().unwrap().is_empty(), "{}", r.body);
    let thread = r.body["thread"]["id"].as_str().unwrap().to_owned();
    assert_eq!(r.body["thread"]["title"], "Exported");
    assert_eq!(r.body["thread"]["model"], "mock");
    assert_eq!(r.body["thread"]["metadata"], json!({"multitask": "enqueue"}));
    let created = chrono::DateTime::parse_from_rfc3339(r.body["thread"]["createdAt"].as_str().unwrap()).unwrap();
    assert_eq!(created.timestamp_millis(), chrono::DateTime::parse_from_rfc3339("2026-11-01T10:00:00Z").unwrap().timestamp_millis());
    let rows = assert_canonical(&stack, &thread, 5).await;
    // The fields the export carries, as stored (created_at exactly the source's).
    let stored: Vec<Value> = rows
        .iter()
        .map(|row| {
            let mut m = json!({"role": row.get::<_, String>(2), "content": row.get::<_, Value>(3),
                               "createdAt": row.get::<_, String>(8)});
            if let Some(calls) = row.get::<_, Option<Value>>(4) { m["toolCalls"] = calls; }
            if let Some(id) = row.get::<_, Option<String>>(5) { m["toolCallId"] = json!(id); }
            if let Some(r) = row.get::<_, Option<String>>(6) { m["reasoning"] = json!(r); }
            if row.get::<_, bool>(7) { m["stopped"] = json!(true); }
            m
        })
        .collect();
    assert_eq!(Value::Array(stored), fixture["messages"]);

    let export = c.get(&format!("/api/threads/{thread}/export?format=json")).await.unwrap();
    if export.status == 404 {
        eprintln!("GET /api/threads/{{id}}/export is not in this branch: the live round trip is skipped");
        return;
    }
    assert_eq!(export.status, 200, "{export:?}");
    let strip = |mut doc: Value| {
        doc["thread"].as_object_mut().unwrap().remove("id");
        doc
    };
    assert_eq!(strip(export.body.clone()), strip(fixture.clone()), "export of the import equals the source");
    let r2 = import(&c, export.body.clone(), None).await;
    assert_eq!(r2.status, 201, "{r2:?}");
    let export2 = c.get(&format!("/api/threads/{}/export", r2.body["thread"]["id"].as_str().unwrap())).await.unwrap();
    assert_eq!(strip(export2.body), strip(export.body), "export -> import -> export");

    // An empty thread round-trips too.
    let empty = c.create_thread().await.unwrap();
    let export = c.get(&format!("/api/threads/{empty}/export?format=json")).await.unwrap();
    assert_eq!(export.status, 200, "{export:?}");
    let r3 = import(&c, export.body.clone(), None).await;
    assert_eq!(r3.status, 201, "an empty thread's export imports: {r3:?}");
    let export3 = c.get(&format!("/api/threads/{}/export", r3.body["thread"]["id"].as_str().unwrap())).await.unwrap();
    assert_eq!(strip(export3.body), strip(export.body), "empty: export -> import -> export");
}

mod mcp {
    use super::*;
    use rmcp::ServiceExt;
    use rmcp::model::{CallToolRequestParams, ReadResourceRequestParams};
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;

    type Client = rmcp::service::RunningService<rmcp::RoleClient, ()>;

    async fn connect(stack: &Stack, key: &str) -> Client {
        let config = StreamableHttpClientTransportConfig::with_uri(format!("{}/mcp", stack.api_url)).auth_header(key.to_owned());
        let transport = StreamableHttpClientTransport::with_client(reqwest::Client::new(), config);
        ().serve(transport).await.unwrap()
    }

    /// Calls a tool; `(is_error, structured content)`.
    async fn call(client: &Client, name: &str, args: Value, log: &mut Vec<Value>) -> (bool, Value) {
        let params = CallToolRequestParams::new(name.to_owned()).with_arguments(args.as_object().cloned().unwrap_or_default());
        let result = client.call_tool(params).await.unwrap();
        let content = result.structured_content.clone().unwrap_or(Value::Null);
        let is_error = result.is_error == Some(true);
        log.push(json!({"call": name, "arguments": args, "isError": is_error, "result": content}));
        (is_error, content)
    }

    /// The rmcp client: tools, idempotent send_message, wait_run's answer, approvals through MCP,
    /// cancel, resources; a second principal gets not_found for every id of the first; no key
    /// is 401.
    #[tokio::test]
    async fn mcp_rmcp_client_session_scoped_to_the_key() {
        let tools = out_dir().join("mcp-tools.json");
        std::fs::write(&tools, json!({"tools": {"current_time": {"policy": "ask"}}}).to_string()).unwrap();
        let options = StackOptions { worker_env: vec![("TOOLS_FILE".into(), tools.display().to_string())], ..Default::default() };
        let stack = Stack::start("ecosystem_mcp_rmcp", options).await.unwrap();
        let mut log = Vec::new();
        let client = connect(&stack, &stack.key).await;
        let names: Vec<String> = client.list_all_tools().await.unwrap().into_iter().map(|t| t.name.to_string()).collect();
        assert_eq!(names.len(), 8, "{names:?}");

        let (err, thread) = call(&client, "create_thread", json!({"title": "via rmcp"}), &mut log).await;
        assert!(!err, "{thread}");
        let thread_id = thread["id"].as_str().unwrap().to_owned();
        let send = json!({"threadId": thread_id, "content": "What is 6*7?", "commandId": "rmcp-1"});
        let (_, sent) = call(&client, "send_message", send.clone(), &mut log).await;
        let (_, replay) = call(&client, "send_message", send, &mut log).await;
        let run_id = sent["run"]["id"].as_str().unwrap().to_owned();
        assert_eq!(replay["run"]["id"], sent["run"]["id"], "durable and idempotent by commandId");
        let (_, waited) = call(&client, "wait_run", json!({"runId": run_id, "timeoutMs": 60000}), &mut log).await;
        assert_eq!((waited["done"].as_bool(), waited["answer"].as_str()), (Some(true), Some("The result is 42.")), "{waited}");
        let (err, busy) = call(&client, "send_message", json!({"threadId": thread_id, "content": "x", "commandId": "rmcp-1"}), &mut log).await;
        assert!(err && busy["error"]["code"] == "idempotency_conflict", "{busy}");

        // An `ask` tool: wait_run stops at waiting_approval; approve through MCP; then reject one.
        let steps = json!([{"toolCalls": [{"name": "current_time"}]}, {"toolCalls": [{"name": "current_time"}]}, {"text": "after: {{tool_results}}"}]);
        let (_, sent) = call(&client, "send_message", json!({"threadId": thread_id, "content": script(steps), "commandId": "rmcp-2"}), &mut log).await;
        let run2 = sent["run"]["id"].as_str().unwrap().to_owned();
        let (_, waited) = call(&client, "wait_run", json!({"runId": run2}), &mut log).await;
        assert_eq!((waited["done"].as_bool(), waited["status"].as_str()), (Some(false), Some("waiting_approval")), "{waited}");
        let approval = waited["run"]["approvals"][0]["id"].as_str().unwrap().to_owned();
        let (err, decided) = call(&client, "approve_tool_call", json!({"approvalId": approval}), &mut log).await;
        assert!(!err && decided["approval"]["status"] == "approved", "{decided}");
        let (_, waited) = call(&client, "wait_run", json!({"runId": run2}), &mut log).await;
        assert_eq!(waited["status"], "waiting_approval", "{waited}");
        let second = waited["run"]["approvals"][0]["id"].as_str().unwrap().to_owned();
        let (_, decided) = call(&client, "reject_tool_call", json!({"approvalId": second, "reason": "not now"}), &mut log).await;
        assert_eq!(decided["approval"]["status"], "rejected");
        let (_, waited) = call(&client, "wait_run", json!({"runId": run2}), &mut log).await;
        let answer = waited["answer"].as_str().unwrap_or_default();
        assert!(waited["done"] == true && answer.contains("Tool call declined by the user. Reason: not now"), "{waited}");

        // Resources: the thread window.
        let resources = client.list_resources(None).await.unwrap();
        assert_eq!(resources.resources.len(), 1);
        let uri = format!("agentloop://threads/{thread_id}");
        let read = client.read_resource(ReadResourceRequestParams::new(uri.clone())).await.unwrap();
        let text = match &read.contents[0] {
            rmcp::model::ResourceContents::TextResourceContents { text, .. } => text.clone(),
            other => panic!("{other:?}"),
        };
        let window: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(window["thread"]["id"], thread_id.as_str());

        // Another principal: not found, on every call, for every id of the first.
        let other_key = stack.client_for("intruder").unwrap().key.unwrap();
        let other = connect(&stack, &other_key).await;
        let (_, listed) = call(&other, "list_threads", json!({}), &mut log).await;
        assert_eq!(listed["threads"], json!([]));
        for (name, args) in [
            ("get_run", json!({"runId": run_id})),
            ("wait_run", json!({"runId": run_id, "timeoutMs": 10})),
            ("cancel_run", json!({"runId": run_id})),
            ("approve_tool_call", json!({"approvalId": approval})),
            ("reject_tool_call", json!({"approvalId": second})),
            ("send_message", json!({"threadId": thread_id, "content": "hi", "commandId": "x"})),
        ] {
            let (err, body) = call(&other, name, args, &mut log).await;
            assert!(err && body["error"]["code"] == "not_found", "{name}: {body}");
        }
        assert!(other.read_resource(ReadResourceRequestParams::new(uri)).await.is_err());
        assert!(other.list_resources(None).await.unwrap().resources.is_empty());

        // cancel_run through MCP.
        let slow = script(json!([{"text": "a b c d e f g h", "chunkDelayMs": 1000}]));
        let (_, sent) = call(&client, "send_message", json!({"threadId": thread_id, "content": slow, "commandId": "rmcp-3"}), &mut log).await;
        let run3 = sent["run"]["id"].as_str().unwrap().to_owned();
        let (_, _) = call(&client, "cancel_run", json!({"runId": run3}), &mut log).await;
        let (_, waited) = call(&client, "wait_run", json!({"runId": run3}), &mut log).await;
        assert_eq!(waited["status"], "cancelled", "{waited}");

        // No key: 401 before MCP; a wrong key too.
        for auth in [None, Some("Bearer al_0000000000000000000000000000000000000000")] {
            let mut req = reqwest::Client::new()
                .post(format!("{}/mcp", stack.api_url))
                .header("accept", "application/json, text/event-stream")
                .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}));
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let resp = req.send().await.unwrap();
            assert_eq!(resp.status(), 401);
            assert_eq!(resp.headers()["www-authenticate"], "Bearer");
        }
        // Malformed tools/call params are -32602 Invalid params (not -32601); a batch is HTTP 400
        // `jsonrpc_batch_unsupported` (MCP 2025-06-18 has no batches).
        let raw = |body: Value| {
            reqwest::Client::new()
                .post(format!("{}/mcp", stack.api_url))
                .header("accept", "application/json, text/event-stream")
                .header("authorization", format!("Bearer {}", stack.key))
                .json(&body)
                .send()
        };
        for params in [json!({"arguments": {}}), json!({"name": 7}), json!({"name": "get_run", "arguments": [1]}), json!("x")] {
            let resp = raw(json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": params})).await.unwrap();
            assert_eq!(resp.status(), 200, "{params}");
            let body: Value = resp.json().await.unwrap();
            assert_eq!((body["id"].clone(), body["error"]["code"].clone()), (json!(9), json!(-32602)), "{params}: {body}");
        }
        let resp = raw(json!([{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}])).await.unwrap();
        assert_eq!(resp.status(), 400);
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["code"], "jsonrpc_batch_unsupported", "{body}");
        // JSON that is no JSON-RPC 2.0 message: 400 invalid_jsonrpc (not rmcp's 415).
        for bad in [json!(5), json!(null), json!({"id": 2, "method": "tools/list"}), json!({"jsonrpc": "2.0", "id": {"x": 1}, "method": "tools/list"})] {
            let resp = raw(bad.clone()).await.unwrap();
            assert_eq!(resp.status(), 400, "{bad}");
            let body: Value = resp.json().await.unwrap();
            assert_eq!(body["error"]["code"], "invalid_jsonrpc", "{bad}: {body}");
        }

        let transcript: Vec<String> = log.iter().map(Value::to_string).collect();
        std::fs::write(out_dir().join("mcp-rmcp-session.jsonl"), transcript.join("\n")).unwrap();
    }

    /// The official MCP Python SDK against the same server.
    #[tokio::test]
    async fn mcp_official_python_sdk_session() {
        let Some(py) = python() else { return };
        let stack = Stack::start("ecosystem_mcp_python", StackOptions::default()).await.unwrap();
        let other = stack.client_for("other").unwrap().key.unwrap();
        let env = [
            ("AGENTLOOP_MCP", format!("{}/mcp", stack.api_url)),
            ("AGENTLOOP_KEY", stack.key.clone()),
            ("AGENTLOOP_OTHER_KEY", other),
            ("TRANSCRIPT", out_dir().join("mcp-python-session.jsonl").display().to_string()),
        ];
        let out = run_script(&py, "mcp_sdk.py", &env).await;
        assert!(out.contains("passed, 0 failed"), "{out}");
    }
}

/// A streamed answer longer than the live event bound (`LIVE_EVENT_MAX_BYTES`, 64 KiB) ends
/// with its last chunk and `[DONE]`, its text whole: every such answer ended `stream_restarted`
/// after almost all of its text, because the committed message came slimmed and was taken for
/// a restarted answer (acceptance probe N, N-10) — the paid answer out of the caller's reach.
#[tokio::test]
async fn openai_a_streamed_answer_longer_than_a_live_event_ends_whole() {
    let stack = Stack::start("ecosystem_long_stream", StackOptions::default()).await.unwrap();
    for (text, repeat, delay) in [("abc ", 17_500, 1), ("x", 100_000, 0)] {
        let body = json!({"model": "mock", "stream": true,
                          "messages": [{"role": "user", "content": script(json!([{"text": text, "repeat": repeat, "chunkDelayMs": delay}]))}]});
        let resp = reqwest::Client::new().post(format!("{}/v1/chat/completions", stack.api_url)).bearer_auth(&stack.key).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        let raw = tokio::time::timeout(Duration::from_secs(60), resp.text()).await.expect("the stream ended").unwrap();
        let mut content = String::new();
        let mut done = false;
        for data in raw.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let chunk: Value = serde_json::from_str(data).unwrap();
            assert!(chunk.get("error").is_none(), "{chunk}");
            if let Some(piece) = chunk.pointer("/choices/0/delta/content").and_then(Value::as_str) {
                content.push_str(piece);
            }
        }
        assert!(done, "[DONE] at the end");
        assert_eq!(content, text.repeat(repeat), "the whole answer, once");
    }
}
