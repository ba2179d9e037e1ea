//! Walking skeleton (issue 2): one agent turn end to end on real PostgreSQL with real api and
//! worker processes and the scripted mock model.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use agentloop_tests::{Sig, Stack, StackOptions, script};
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(30);

async fn messages(stack: &Stack, thread: &str) -> Vec<Value> {
    let r = stack.client().get(&format!("/api/threads/{thread}")).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    r.body["messages"].as_array().unwrap().clone()
}

#[tokio::test]
async fn a_posted_message_gets_a_final_answer() {
    let stack = Stack::start("final_answer", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let posted = c.chat(&thread, &script(json!([{"text": "Hello from the model"}]))).await.unwrap();
    assert_eq!(posted["run"]["status"], "queued");
    assert_eq!(posted["message"]["role"], "user");
    let run_id = posted["run"]["id"].as_str().unwrap();
    let run = c.wait_terminal(run_id, T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let steps = run["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 1);
    assert_eq!(steps[0]["idempotencyKey"], format!("run:{run_id}:step:1"));
    assert_eq!(steps[0]["status"], "completed");

    let window = c.get(&format!("/api/threads/{thread}")).await.unwrap().body;
    assert_eq!(window["streamingMessage"], Value::Null);
    assert_eq!(window["messageCount"], 2);
    let msgs = window["messages"].as_array().unwrap();
    assert_eq!(msgs[1]["role"], "assistant");
    assert_eq!(msgs[1]["content"], "Hello from the model");
    assert_eq!(msgs[1]["runId"], run_id);

    // Database: streaming column empty, keys unique, and the payload sent was stripped.
    let db = stack.db.client().await.unwrap();
    let row = db.query_one("SELECT streaming_message IS NULL FROM threads", &[]).await.unwrap();
    assert!(row.get::<_, bool>(0));
    let sent = stack.mock.requests().await.unwrap();
    let body = &sent[0];
    assert_eq!(body["stream"], true);
    for m in body["messages"].as_array().unwrap() {
        for key in ["sequence", "timestamp", "runId", "tokenEstimate", "createdAt", "active"] {
            assert!(m.get(key).is_none(), "{key} was sent to the provider: {m}");
        }
    }
}

#[tokio::test]
async fn tool_loop_with_parallel_calls_keeps_order() {
    let stack = Stack::start("tool_loop", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let steps = json!([
        {"toolCalls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]},
        {"toolCalls": [
            {"name": "calculator", "arguments": {"expression": "1+1"}},
            {"name": "calculator", "arguments": {"expression": "10/4"}},
            {"name": "calculator", "argumentsRaw": "{not json"}
        ]},
        {"text": "Results: {{tool_results}}"}
    ]);
    let posted = c.chat(&thread, &script(steps)).await.unwrap();
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["toolCallsUsed"], 4);
    let msgs = messages(&stack, &thread).await;
    let roles: Vec<&str> = msgs.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant", "tool", "tool", "tool", "assistant"]);
    assert_eq!(msgs[2]["content"], "42");
    assert_eq!(msgs[2]["toolCallId"], msgs[1]["toolCalls"][0]["id"]);
    // Parallel calls: results follow their calls in order.
    for i in 0..3 {
        assert_eq!(msgs[4 + i]["toolCallId"], msgs[3]["toolCalls"][i]["id"]);
    }
    assert_eq!(msgs[4]["content"], "2");
    assert_eq!(msgs[5]["content"], "2.5");
    let bad = msgs[6]["content"].as_str().unwrap();
    assert!(bad.to_lowercase().contains("json"), "unparseable arguments become an error result: {bad}");
    assert_eq!(msgs[7]["content"], "Results: 42, 2, 2.5, ".to_owned() + bad);
    // Sequences are gap-free and every produced row carries run/step provenance.
    let seqs: Vec<i64> = msgs.iter().map(|m| m["sequence"].as_i64().unwrap()).collect();
    assert_eq!(seqs, (1..=8).collect::<Vec<_>>());
    assert!(msgs[1..].iter().all(|m| m["runId"] == run["id"] && m["stepId"].is_i64()));
}

#[tokio::test]
async fn tool_limit_requeues_and_max_steps_fails() {
    let options = StackOptions { worker_env: vec![("WORKER_TOOL_CALL_LIMIT".into(), "1".into())], ..Default::default() };
    let stack = Stack::start("tool_limit", options).await.unwrap();
    let c = stack.client();
    let steps = json!([
        {"toolCalls": [{"name": "calculator", "arguments": {"expression": "1+2"}}]},
        {"toolCalls": [{"name": "calculator", "arguments": {"expression": "3+4"}}]},
        {"text": "finished"}
    ]);
    let thread = c.create_thread().await.unwrap();
    let posted = c.chat(&thread, &script(steps.clone())).await.unwrap();
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let step_status: Vec<&str> = run["steps"].as_array().unwrap().iter().map(|s| s["status"].as_str().unwrap()).collect();
    assert_eq!(step_status, ["requeued", "requeued", "completed"]);
    assert_eq!(run["stepsUsed"], 3);
    assert_eq!(run["attempts"], 3, "the same run was claimed once per slice");

    let thread = c.create_thread().await.unwrap();
    let r = c.post(&format!("/api/threads/{thread}/chat"), json!({"content": script(steps), "maxSteps": 2})).await.unwrap();
    assert_eq!(r.status, 202);
    let run = c.wait_terminal(r.body["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(run["status"], "failed");
    assert_eq!(run["error"]["code"], "budget_exhausted");
    assert_eq!(run["stepsUsed"], 2);
}

#[tokio::test]
async fn second_message_during_active_run_is_rejected() {
    let stack = Stack::start("run_active", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let posted = c.chat(&thread, &script(json!([{"text": "slow", "delayMs": 2000}]))).await.unwrap();
    let r = c.post(&format!("/api/threads/{thread}/chat"), json!({"content": "again"})).await.unwrap();
    assert_eq!(r.status, 409);
    assert_eq!(r.body["error"]["code"], "run_active");
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(run["status"], "completed");
    // Nothing of the rejected request was written.
    assert_eq!(messages(&stack, &thread).await.len(), 2);
    let again = c.post(&format!("/api/threads/{thread}/chat"), json!({"content": "now it works"})).await.unwrap();
    assert_eq!(again.status, 202);
}

async fn read_sse(stack: &Stack, thread: &str, last_event_id: Option<i64>, until_run_done: bool, max: usize) -> Vec<(String, Option<i64>, Value)> {
    let mut req = reqwest::Client::new()
        .get(format!("{}/api/threads/{thread}/updates/stream?afterSequence=0", stack.api_url))
        .bearer_auth(&stack.key);
    if let Some(id) = last_event_id {
        req = req.header("Last-Event-ID", id.to_string());
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    assert_eq!(resp.headers()["cache-control"], "no-cache, no-transform");
    let mut events = resp.bytes_stream().eventsource();
    let mut out = Vec::new();
    while let Ok(Some(Ok(ev))) = tokio::time::timeout(T, events.next()).await {
        let data: Value = serde_json::from_str(&ev.data).unwrap();
        let id = ev.id.parse::<i64>().ok();
        let done = ev.event == "run" && data["status"] == "completed";
        out.push((ev.event, id, data));
        if (until_run_done && done) || out.len() >= max {
            break;
        }
    }
    out
}

#[tokio::test]
async fn sse_delivers_events_through_completion_and_resumes_without_gaps() {
    let stack = Stack::start("sse", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let reader = {
        let (url, key, thread) = (stack.api_url.clone(), stack.key.clone(), thread.clone());
        tokio::spawn(async move {
            let resp = reqwest::Client::new()
                .get(format!("{url}/api/threads/{thread}/updates/stream"))
                .bearer_auth(&key)
                .send()
                .await
                .unwrap();
            let mut events = resp.bytes_stream().eventsource();
            let mut out = Vec::new();
            while let Ok(Some(Ok(ev))) = tokio::time::timeout(T, events.next()).await {
                let data: Value = serde_json::from_str(&ev.data).unwrap();
                let done = ev.event == "run" && data["status"] == "completed";
                out.push((ev.event, ev.id, data));
                if done {
                    break;
                }
            }
            out
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let steps = json!([
        {"toolCalls": [{"name": "calculator", "arguments": {"expression": "2+2"}}]},
        {"text": "one two three four five six seven eight nine ten", "chunkDelayMs": 120}
    ]);
    c.chat(&thread, &script(steps)).await.unwrap();
    let live = reader.await.unwrap();
    assert_eq!(live[0].0, "connected");
    assert_eq!(live[1].0, "thread");
    let kinds: Vec<&str> = live.iter().map(|e| e.0.as_str()).collect();
    assert!(kinds.contains(&"message") && kinds.contains(&"run") && kinds.contains(&"streaming"), "{kinds:?}");
    let ids: Vec<i64> = live.iter().filter_map(|e| e.1.parse().ok()).collect();
    assert!(ids.windows(2).all(|w| w[1] == w[0] + 1), "journal ids are gap-free: {ids:?}");
    let final_text = live.iter().rev().find(|e| e.0 == "message").unwrap();
    assert_eq!(final_text.2["content"], "one two three four five six seven eight nine ten");

    // Resume from the middle with Last-Event-ID: exactly the following events, no gap.
    let middle = ids[ids.len() / 2];
    let resumed = read_sse(&stack, &thread, Some(middle), true, 1000).await;
    let resumed_ids: Vec<i64> = resumed.iter().filter_map(|e| e.1).collect();
    let expected: Vec<i64> = ids.iter().copied().filter(|i| *i > middle).collect();
    assert_eq!(resumed_ids, expected);
}

#[tokio::test]
async fn two_workers_fifty_runs_each_claimed_once() {
    let stack = Stack::start("fifty_runs", StackOptions { workers: 2, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let mut runs = Vec::new();
    for i in 0..50 {
        let thread = c.create_thread().await.unwrap();
        let steps = json!([{"toolCalls": [{"name": "calculator", "arguments": {"expression": format!("{i}+1")}}]}, {"text": "ok {{tool_result}}"}]);
        runs.push(c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned());
    }
    for run in &runs {
        let run = c.wait_terminal(run, Duration::from_secs(60)).await.unwrap();
        assert_eq!(run["status"], "completed", "{run}");
        assert_eq!(run["attempts"], 1, "claimed exactly once: {run}");
    }
    let db = stack.db.client().await.unwrap();
    let dup = db
        .query_one("SELECT count(*) FROM (SELECT thread_id, role, count(*) FROM messages WHERE role = 'assistant' AND tool_calls IS NULL GROUP BY thread_id, role HAVING count(*) > 1) d", &[])
        .await
        .unwrap();
    assert_eq!(dup.get::<_, i64>(0), 0, "one final answer per thread");
    let owners: HashSet<String> = db
        .query("SELECT DISTINCT worker_id FROM run_steps", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect();
    assert_eq!(owners.len(), 2, "both workers took part: {owners:?}");
}

#[tokio::test]
async fn sigkill_during_slow_model_call_is_recovered_by_another_worker() {
    let lease = vec![("WORKER_LEASE_MS".into(), "3000".into()), ("WORKER_RENEW_MS".into(), "1000".into())];
    let mut stack = Stack::start("sigkill", StackOptions { workers: 1, worker_env: lease, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    // First answer is slow: the worker is killed while waiting for it.
    let posted = c.chat(&thread, &script(json!([{"text": "survived", "delayMs": 4000}]))).await.unwrap();
    let run_id = posted["run"]["id"].as_str().unwrap().to_owned();
    let running = c.wait_run(&run_id, T, |r| r["status"] == "running" && r["stepsUsed"] == 0 && r["contextTokens"].is_i64()).await.unwrap();
    let first_owner = running["leaseOwner"].as_str().unwrap().to_owned();
    stack.workers[0].signal(Sig::SIGKILL);
    assert!(stack.workers[0].wait_exit(Duration::from_secs(5)));
    stack.add_worker(&[]).unwrap();
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["recoveries"], 1);
    assert_ne!(run["leaseOwner"], first_owner);
    let msgs = messages(&stack, &thread).await;
    assert_eq!(msgs.len(), 2, "no duplicated message: {msgs:?}");
    assert_eq!(msgs[1]["content"], "survived");
    let steps = run["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 1, "the step row is reused under its idempotency key");
    assert_eq!(steps[0]["attempt"], 2);
}

#[tokio::test]
async fn auth_scoping_and_bad_input() {
    let stack = Stack::start("auth", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();

    let anonymous = agentloop_tests::Client { key: None, ..c.clone() };
    let r = anonymous.get("/api/threads").await.unwrap();
    assert_eq!(r.status, 401);
    assert_eq!(r.body["error"]["code"], "unauthorized");
    let wrong = agentloop_tests::Client { key: Some("al_nope".into()), ..c.clone() };
    assert_eq!(wrong.get("/api/threads").await.unwrap().status, 401);

    let other = stack.client_for("mallory").unwrap();
    let r = other.get(&format!("/api/threads/{thread}")).await.unwrap();
    assert_eq!(r.status, 404);
    assert_eq!(r.body["error"]["code"], "not_found");
    let r = other.post(&format!("/api/threads/{thread}/chat"), json!({"content": "hi"})).await.unwrap();
    assert_eq!(r.status, 404);
    assert_eq!(other.get("/api/threads").await.unwrap().body["threads"].as_array().unwrap().len(), 0);

    let r = c
        .send(reqwest::Method::POST, &format!("/api/threads/{thread}/chat"), None, &[("content-type", "application/json")])
        .await
        .unwrap();
    assert_eq!(r.status, 400, "{r:?}");
    let raw = reqwest::Client::new()
        .post(format!("{}/api/threads/{thread}/chat", stack.api_url))
        .bearer_auth(&stack.key)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), 400);
    let body: Value = raw.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_json");
    let r = c.post(&format!("/api/threads/{thread}/chat"), json!({"commandId": "x"})).await.unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(r.body["error"]["code"], "missing_field");
    let r = c.post(&format!("/api/threads/{thread}/chat"), json!({"content": "   "})).await.unwrap();
    assert_eq!(r.body["error"]["code"], "invalid_content");
    let r = c.get("/api/threads/not-a-uuid").await.unwrap();
    assert_eq!(r.status, 404);
    for bad in [json!([{"type": "bogus"}]), json!([{"type": "text"}]), json!([{"type": "image_url", "image_url": {"url": "javascript:x"}}])] {
        let r = c.post(&format!("/api/threads/{thread}/chat"), json!({"content": bad})).await.unwrap();
        assert_eq!((r.status, r.body["error"]["code"].as_str()), (400, Some("invalid_content")), "{r:?}");
    }
    let r = c.post("/api/threads", json!({"metadata": {"multitask": "bogus"}})).await.unwrap();
    assert_eq!(r.body["error"]["code"], "invalid_metadata");
    let r = c
        .send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), Some(json!({"metadata": {"compactThreshold": -5}})), &[])
        .await
        .unwrap();
    assert_eq!(r.body["error"]["code"], "invalid_metadata");
    let r = c
        .send(reqwest::Method::POST, &format!("/api/threads/{thread}/chat"), Some(json!({"content": "x", "commandId": "a"})), &[("Idempotency-Key", "b")])
        .await
        .unwrap();
    assert_eq!(r.body["error"]["code"], "idempotency_key_mismatch");
    let r = c.get("/nope").await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (404, Some("route_not_found")));
    // Nothing was half-written by the bad requests.
    assert_eq!(messages(&stack, &thread).await.len(), 0);
}

/// SIGTERM mid-stream: the model call in flight is paid for, so it is let finish and its answer
/// committed while the grace period (`WORKER_SHUTDOWN_GRACE_MS`, 3 s here) leaves time for it;
/// a stream that would outlast it is dropped when a third of the grace is left, and the run is
/// handed back (`queued`, not recovered by lease expiry) for another worker to finish.
#[tokio::test]
async fn sigterm_lets_a_model_call_finish_or_hands_the_run_back() {
    let grace = vec![("WORKER_SHUTDOWN_GRACE_MS".into(), "3000".into())];
    let mut stack = Stack::start("sigterm", StackOptions { worker_env: grace, ..Default::default() }).await.unwrap();
    let c = stack.client();

    // About 1.6 s of stream left at SIGTERM: it finishes, by this worker, with one model call.
    let thread = c.create_thread().await.unwrap();
    let text = "short one two three four five";
    let posted = c.chat(&thread, &script(json!([{"text": text, "chunkDelayMs": 300}]))).await.unwrap();
    let run_id = posted["run"]["id"].as_str().unwrap().to_owned();
    c.wait_run(&run_id, T, |r| r["status"] == "running").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stack.workers[0].signal(Sig::SIGTERM);
    assert!(stack.workers[0].wait_exit(Duration::from_secs(5)), "worker exits within its grace period");
    let run = c.get(&format!("/api/runs/{run_id}")).await.unwrap().body;
    assert_eq!(run["status"], "completed", "the answer in flight was kept: {run}");
    assert_eq!(run["attempts"], 1, "{run}");
    let msgs = messages(&stack, &thread).await;
    assert_eq!(msgs.len(), 2);
    assert_eq!(msgs[1]["content"], text);

    // About 8 s of stream: dropped at 2 s (a third of the grace left), the run handed back.
    stack.add_worker(&[("WORKER_SHUTDOWN_GRACE_MS", "3000")]).unwrap();
    let thread = c.create_thread().await.unwrap();
    let long = (0..20).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ");
    let posted = c.chat(&thread, &script(json!([{"text": long, "chunkDelayMs": 400}]))).await.unwrap();
    let run_id = posted["run"]["id"].as_str().unwrap().to_owned();
    c.wait_run(&run_id, T, |r| r["status"] == "running").await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let signalled = Instant::now();
    stack.workers[1].signal(Sig::SIGTERM);
    let requeued = c.wait_run(&run_id, Duration::from_secs(4), |r| r["status"] == "queued").await.unwrap();
    assert_eq!(requeued["leaseOwner"], Value::Null);
    assert!(signalled.elapsed() >= Duration::from_millis(1500), "the stream was let run until the grace ran short: {:?}", signalled.elapsed());
    assert!(stack.workers[1].wait_exit(Duration::from_secs(5)), "worker exits within its grace period");
    let window = c.get(&format!("/api/threads/{thread}")).await.unwrap().body;
    assert_eq!(window["messageCount"], 1, "the dropped stream left history untouched");
    assert_eq!(window["streamingMessage"], Value::Null);
    stack.add_worker(&[]).unwrap();
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "completed");
    assert_eq!(run["recoveries"], 0, "handed back, not recovered by lease expiry");
    assert_eq!(run["steps"][0]["attempt"], 2);
    assert_eq!(messages(&stack, &thread).await.len(), 2);
}

#[tokio::test]
async fn idempotent_chat_commands() {
    let stack = Stack::start("idempotency", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let path = format!("/api/threads/{thread}/chat");
    let body = json!({"content": script(json!([{"text": "once"}]))});
    let first = c.send(reqwest::Method::POST, &path, Some(body.clone()), &[("Idempotency-Key", "k1")]).await.unwrap();
    assert_eq!(first.status, 202);
    let again = c.send(reqwest::Method::POST, &path, Some(body.clone()), &[("Idempotency-Key", "k1")]).await.unwrap();
    assert_eq!(again.status, 202);
    assert_eq!(again.body, first.body, "an identical retry returns the original response");
    let conflict = c
        .send(reqwest::Method::POST, &path, Some(json!({"content": "different"})), &[("Idempotency-Key", "k1")])
        .await
        .unwrap();
    assert_eq!(conflict.status, 409);
    assert_eq!(conflict.body["error"]["code"], "idempotency_conflict");
    c.wait_terminal(first.body["run"]["id"].as_str().unwrap(), T).await.unwrap();

    // 100 concurrent identical requests on a fresh thread create exactly one run.
    let thread = c.create_thread().await.unwrap();
    let path = format!("/api/threads/{thread}/chat");
    let body = json!({"content": script(json!([{"text": "concurrent"}])), "commandId": "same-command"});
    let replies = futures_util::future::join_all((0..100).map(|_| c.post(&path, body.clone()))).await;
    let run_ids: HashSet<String> = replies
        .into_iter()
        .map(|r| r.unwrap())
        .inspect(|r| assert_eq!(r.status, 202, "{r:?}"))
        .map(|r| r.body["run"]["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(run_ids.len(), 1);
    let db = stack.db.client().await.unwrap();
    let thread_uuid = uuid::Uuid::parse_str(&thread).unwrap();
    let runs: i64 = db.query_one("SELECT count(*) FROM runs WHERE thread_id = $1", &[&thread_uuid]).await.unwrap().get(0);
    let msgs: i64 = db.query_one("SELECT count(*) FROM messages WHERE thread_id = $1 AND role = 'user'", &[&thread_uuid]).await.unwrap().get(0);
    assert_eq!((runs, msgs), (1, 1));
}

#[tokio::test]
async fn stateless_chat_completions_run_through_the_durable_loop() {
    let stack = Stack::start("stateless", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let r = c.post("/v1/chat/completions", json!({"model": "mock", "messages": [{"role": "user", "content": "What is 6*7?"}]})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body["object"], "chat.completion");
    assert_eq!(r.body["choices"][0]["message"]["content"], "The result is 42.");
    // The hidden thread is gone: a stateless request keeps no conversation (issue 12; its run
    // was durable like any other while it ran: tests/tests/ecosystem.rs).
    assert!(c.get("/api/threads").await.unwrap().body["threads"].as_array().unwrap().is_empty());
    let db = stack.db.client().await.unwrap();
    let (threads, runs, messages): (i64, i64, i64) = {
        let row = db
            .query_one("SELECT (SELECT count(*) FROM threads), (SELECT count(*) FROM runs), (SELECT count(*) FROM messages)", &[])
            .await
            .unwrap();
        (row.get(0), row.get(1), row.get(2))
    };
    assert_eq!((threads, runs, messages), (0, 0, 0));
    let sent = stack.mock.requests().await.unwrap();
    assert_eq!(sent.iter().filter(|r| r["messages"].as_array().unwrap().iter().any(|m| m["role"] == "tool")).count(), 1, "the tool ran in the worker");
    let r = c.post("/v1/chat/completions", json!({"messages": []})).await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (400, Some("invalid_messages")));
    let r = c.post("/v1/chat/completions", json!({"messages": [{"role": "wizard", "content": "x"}]})).await.unwrap();
    assert_eq!(r.status, 400);
}

#[tokio::test]
async fn nul_characters_from_models_tools_and_clients_never_break_a_write() {
    let stack = Stack::start("nul", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let r = c.post("/api/threads", json!({"title": "a\u{0}b", "metadata": {"note": "x\u{0}"}})).await.unwrap();
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(r.body["title"], "a\u{FFFD}b");
    let thread = r.body["id"].as_str().unwrap().to_owned();
    let steps = json!([
        {"toolCalls": [{"name": "calculator", "argumentsRaw": "{\"expression\":\"1+1\u{0}\"}"}], "reasoning": "think\u{0}ing"},
        {"text": "before\u{0}after"}
    ]);
    let posted = c.chat(&thread, &format!("{}\u{0}", script(steps))).await.unwrap();
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["attempts"], 1, "no retry loop");
    let msgs = messages(&stack, &thread).await;
    assert_eq!(msgs.last().unwrap()["content"], "before\u{FFFD}after");
    assert!(msgs[1]["reasoning"].as_str().unwrap().contains('\u{FFFD}'));
}

#[tokio::test]
async fn openapi_document_lists_every_route() {
    let stack = Stack::start("openapi", StackOptions::default()).await.unwrap();
    let r = stack.client().get("/openapi.json").await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.body["openapi"].as_str().unwrap().starts_with("3."), "{}", r.body["openapi"]);
    assert_eq!(r.body["components"]["securitySchemes"]["bearer"]["scheme"], "bearer");
    let routes = [
        ("get", "/healthz"),
        ("get", "/readyz"),
        ("get", "/metrics"),
        ("get", "/"),
        ("get", "/openapi.json"),
        ("post", "/v1/chat/completions"),
        ("get", "/api/models"),
        ("post", "/api/threads"),
        ("get", "/api/threads"),
        ("get", "/api/threads/{id}"),
        ("patch", "/api/threads/{id}"),
        ("delete", "/api/threads/{id}"),
        ("get", "/api/threads/{id}/messages"),
        ("post", "/api/threads/{id}/chat"),
        ("post", "/api/threads/{id}/cancel"),
        ("post", "/api/threads/{id}/compact"),
        ("get", "/api/threads/{id}/context"),
        ("post", "/api/threads/{id}/messages/{sequence}/edit"),
        ("post", "/api/threads/{id}/messages/{sequence}/regenerate"),
        ("delete", "/api/threads/{id}/messages/{sequence}"),
        ("get", "/api/threads/{id}/updates/stream"),
        ("get", "/api/threads/{id}/updates"),
        ("get", "/api/runs/{id}"),
        ("post", "/api/runs/{id}/cancel"),
        ("get", "/api/threads/{id}/approvals"),
        ("post", "/api/approvals/{id}/approve"),
        ("post", "/api/approvals/{id}/reject"),
        ("get", "/api/runs/{id}/operations"),
        ("post", "/api/runs/{id}/operations/{key}/resolve"),
        ("post", "/api/session"),
        ("get", "/api/session"),
        ("delete", "/api/session"),
    ];
    for (method, path) in routes {
        assert!(r.body["paths"][path][method].is_object(), "missing {method} {path}");
    }
    let chat = &r.body["paths"]["/api/threads/{id}/chat"]["post"];
    assert_eq!(chat["parameters"][0]["name"], "id");
    let body = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].as_str().unwrap();
    let body = &r.body["components"]["schemas"][body.rsplit('/').next().unwrap()];
    assert!(body["properties"]["content"].is_object(), "{body}");
    assert_eq!(body["required"], json!(["content"]));
    let accepted = chat["responses"]["202"]["content"]["application/json"]["schema"]["$ref"].as_str().unwrap();
    assert!(r.body["components"]["schemas"][accepted.rsplit('/').next().unwrap()]["properties"]["run"].is_object(), "typed 2xx body");
    assert_eq!(chat["responses"]["409"]["content"]["application/json"]["schema"]["$ref"], "#/components/schemas/Error");
    assert_eq!(chat["security"][0]["bearer"], json!([]));
}

/// A present but empty idempotency key is refused, never dropped (a retry would post the turn
/// twice), on chat (header and `commandId`) and import; a refused request writes nothing. The
/// server's own metadata keys (`stateless`, `clientTools`) cannot be set by a client.
#[tokio::test]
async fn empty_idempotency_keys_and_reserved_metadata_are_refused() {
    let stack = Stack::start("skeleton_key_rules", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let chat = format!("/api/threads/{thread}/chat");
    for (headers, body) in [
        (vec![("Idempotency-Key", "")], json!({"content": "hi"})),
        (vec![("Idempotency-Key", "   ")], json!({"content": "hi"})),
        (vec![], json!({"content": "hi", "commandId": ""})),
    ] {
        let r = c.send(reqwest::Method::POST, &chat, Some(body.clone()), &headers).await.unwrap();
        assert_eq!((r.status, r.body["error"]["code"].as_str()), (400, Some("invalid_idempotency_key")), "{headers:?} {body}: {r:?}");
    }
    let r = c.send(reqwest::Method::POST, "/api/threads/import", Some(json!([{"role": "user", "content": "x"}])), &[("Idempotency-Key", "")]).await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (400, Some("invalid_idempotency_key")), "{r:?}");
    let db = stack.db.client().await.unwrap();
    let runs: i64 = db.query_one("SELECT count(*) FROM runs", &[]).await.unwrap().get(0);
    assert_eq!(runs, 0, "nothing was written");
    for key in ["stateless", "clientTools"] {
        let r = c.post("/api/threads", json!({"metadata": {key: true}})).await.unwrap();
        assert_eq!((r.status, r.body["error"]["code"].as_str()), (400, Some("invalid_metadata")), "{key}: {r:?}");
        let r = c.send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), Some(json!({"metadata": {key: []}})), &[]).await.unwrap();
        assert_eq!((r.status, r.body["error"]["code"].as_str()), (400, Some("invalid_metadata")), "{key}: {r:?}");
    }
    let r = c.post(&chat, json!({"content": "hi", "commandId": "k1"})).await.unwrap();
    assert_eq!(r.status, 202, "a real key still works: {r:?}");
}
