//! The durable core (issue 9): one lock order for every command against a slice end, transient
//! database faults that never fail a run, connection pools as back-pressure, tool-call ids that
//! are ours, panics that end a run, compaction that cannot reduce a context that still fits, and
//! the `lease_lost` counter. Real api/worker processes, real PostgreSQL, real backend kills.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentloop_tests::{Client, Sig, Stack, StackOptions, free_port, script};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

fn id(v: &Value) -> String {
    v["id"].as_str().unwrap().to_owned()
}

async fn all_messages(c: &Client, thread: &str) -> Vec<Value> {
    let r = c.get(&format!("/api/threads/{thread}/messages?after=0&take=200")).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    r.body["messages"].as_array().unwrap().clone()
}

/// Posts with an idempotency key, retrying 503s and connection errors with the same key (what
/// a robust client does). Returns the final status and body.
async fn post_retrying(c: &Client, path: &str, body: Value, key: &str) -> (u16, Value) {
    let deadline = Instant::now() + T;
    loop {
        match c.send(reqwest::Method::POST, path, Some(body.clone()), &[("Idempotency-Key", key)]).await {
            Ok(r) if r.status != 503 && r.status != 502 => return (r.status, r.body),
            other => {
                assert!(Instant::now() < deadline, "no answer for {path}: {other:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// After a delete: every run of the thread ends (cancelled, or completed if it finished first)
/// without failing.
async fn deleted_runs_ok(db: &Arc<tokio_postgres::Client>, runs: &[&str]) -> Option<String> {
    let deadline = Instant::now() + T;
    loop {
        let mut open = 0;
        for run in runs {
            let id: uuid::Uuid = run.parse().unwrap();
            let row = db.query_one("SELECT status, coalesce(error_code, '') FROM runs WHERE id = $1", &[&id]).await.unwrap();
            let (status, code): (String, String) = (row.get(0), row.get(1));
            if status == "failed" {
                return Some(format!("DeleteThread: run {run} failed: {code}"));
            }
            if !matches!(status.as_str(), "completed" | "cancelled") {
                open += 1;
            }
        }
        if open == 0 {
            return None;
        }
        if Instant::now() > deadline {
            return Some(format!("DeleteThread: {open} run(s) still open"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[derive(Clone, Copy, Debug)]
enum Command {
    CancelPending,
    CancelActive,
    CancelThread,
    Enqueue,
    Interrupt,
    DeleteThread,
    Edit,
    Regenerate,
    DeleteMessage,
}

/// One round: an active run whose final answer is committed right about now, a FIFO-pending
/// turn behind it, and `command` sent at that moment. Returns a violation, if any.
async fn race_round(c: &Client, db: &Arc<tokio_postgres::Client>, command: Command, jitter_ms: u64) -> Option<String> {
    let thread = c.create_thread().await.unwrap();
    let a = c.post(&format!("/api/threads/{thread}/chat"), json!({"content": script(json!([{"text": "answer A", "delayMs": 200}]))})).await.unwrap();
    assert_eq!(a.status, 202, "{a:?}");
    let a_run = id(&a.body["run"]);
    let b = c
        .post(&format!("/api/threads/{thread}/chat"), json!({"content": script(json!([{"text": "answer B"}])), "multitask": "enqueue"}))
        .await
        .unwrap();
    assert_eq!(b.status, 202, "{b:?}");
    let b_run = id(&b.body["run"]);
    c.wait_run(&a_run, T, |r| r["status"] != "queued").await.unwrap();
    tokio::time::sleep(Duration::from_millis(jitter_ms)).await;
    let reply = match command {
        Command::CancelPending => c.post(&format!("/api/runs/{b_run}/cancel"), json!({})).await,
        Command::CancelActive => c.post(&format!("/api/runs/{a_run}/cancel"), json!({})).await,
        Command::CancelThread => c.post(&format!("/api/threads/{thread}/cancel"), json!({})).await,
        Command::Enqueue => {
            c.post(&format!("/api/threads/{thread}/chat"), json!({"content": script(json!([{"text": "answer C"}])), "multitask": "enqueue"})).await
        }
        Command::Interrupt => {
            c.post(&format!("/api/threads/{thread}/chat"), json!({"content": script(json!([{"text": "answer C"}])), "multitask": "interrupt"})).await
        }
        Command::DeleteThread => c.send(reqwest::Method::DELETE, &format!("/api/threads/{thread}"), None, &[]).await,
        Command::Edit => c.post(&format!("/api/threads/{thread}/messages/1/edit"), json!({"content": script(json!([{"text": "edited"}]))})).await,
        Command::Regenerate => c.post(&format!("/api/threads/{thread}/messages/1/regenerate"), json!({})).await,
        Command::DeleteMessage => c.send(reqwest::Method::DELETE, &format!("/api/threads/{thread}/messages/1"), None, &[]).await,
    }
    .unwrap();
    if reply.status >= 500 {
        return Some(format!("{command:?}: HTTP {} {}", reply.status, reply.body));
    }
    if matches!(command, Command::DeleteThread) {
        // The thread (and its runs) are gone for the API; the database tells how they ended.
        return deleted_runs_ok(db, &[&a_run, &b_run]).await;
    }
    let a_end = c.wait_terminal(&a_run, T).await.unwrap();
    let b_end = c.wait_terminal(&b_run, T).await.unwrap();
    for run in [&a_end, &b_end] {
        if run["status"] == "failed" {
            return Some(format!("{command:?}: run failed: {}", run["error"]));
        }
    }
    // A completed run's answer is in history exactly once (no paid answer thrown away).
    let messages = all_messages(c, &thread).await;
    for (run, text) in [(&a_end, "answer A"), (&b_end, "answer B")] {
        let answers = messages.iter().filter(|m| m["runId"] == run["id"] && m["role"] == "assistant" && m["content"] == text).count();
        let expected = usize::from(run["status"] == "completed");
        // edit/regenerate/delete may deactivate an answer: count inactive rows too via the run.
        if answers != expected && !matches!(command, Command::Edit | Command::Regenerate | Command::DeleteMessage) {
            return Some(format!("{command:?}: run {} is {} with {answers} answer(s)", run["id"], run["status"]));
        }
    }
    None
}

/// Issue 9 defect 1: every command that touches a thread's runs, sent at the moment the active
/// run's final answer is committed (which ends the run and promotes the pending one), never
/// deadlocks with it: no 5xx, no failed run, no lost answer.
#[tokio::test]
async fn durable_commands_racing_a_slice_end_never_deadlock_or_lose_an_answer() {
    let options = StackOptions { workers: 2, worker_env: env(&[("WORKER_CONCURRENCY", "8")]), ..Default::default() };
    let stack = Stack::start("durable_race", options).await.unwrap();
    let c = stack.client();
    let commands = [
        Command::CancelPending,
        Command::CancelActive,
        Command::CancelThread,
        Command::Enqueue,
        Command::Interrupt,
        Command::DeleteThread,
        Command::Edit,
        Command::Regenerate,
        Command::DeleteMessage,
    ];
    let mut rounds = Vec::new();
    let shared_db = Arc::new(stack.db.client().await.unwrap());
    for (n, command) in commands.iter().cycle().take(commands.len() * 8).enumerate() {
        let c = c.clone();
        let command = *command;
        let db = shared_db.clone();
        rounds.push(tokio::spawn(async move { race_round(&c, &db, command, 150 + (n as u64 * 37) % 150).await }));
    }
    let mut violations = Vec::new();
    for round in rounds {
        if let Some(v) = round.await.unwrap() {
            violations.push(v);
        }
    }
    assert!(violations.is_empty(), "{} violation(s): {violations:#?}", violations.len());
    // And PostgreSQL saw no deadlock.
    let db = stack.db.client().await.unwrap();
    let deadlocks: i64 = db.query_one("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()", &[]).await.unwrap().get(0);
    assert_eq!(deadlocks, 0, "deadlocks detected in the test database");
}

/// Issue 9 defect 2: killing the busy backends of the workers (pooled connections, the
/// listener and the lease keeper) every 10 ms, and of the api every ~150 ms, for 3 s fails no run and loses no
/// turn: transient faults are retried or hand the run back.
#[tokio::test]
async fn durable_killed_database_backends_never_fail_a_run() {
    let options = StackOptions { workers: 2, worker_env: env(&[("WORKER_CONCURRENCY", "6")]), ..Default::default() };
    let stack = Stack::start("durable_kills", options).await.unwrap();
    let c = stack.client();
    let db = stack.db.client().await.unwrap();
    let mut threads = Vec::new();
    for _ in 0..20 {
        threads.push(c.create_thread().await.unwrap());
    }
    // For a fixed 3 s from the first post, the killer terminates every busy worker backend every
    // 10 ms, and every busy api backend every 10th round (~150 ms): an api command on a fresh
    // connection (whose first call compiles the step function) cannot finish between kills 10 ms
    // apart, and starved posts would leave the workers nothing to do while they are killed.
    // On a loaded machine the api may not be caught busy within 3 s: the killer then goes on
    // (up to 20 s) until it has terminated at least one api backend.
    let kill_for = Duration::from_secs(3);
    let killing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let killer = {
        let url = stack.db.url.clone();
        let killing = killing.clone();
        tokio::spawn(async move {
            let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
            tokio::spawn(conn);
            let (mut workers, mut apis) = (0i64, 0i64);
            let started = Instant::now();
            let mut round = 0u32;
            while started.elapsed() < kill_for || (apis == 0 && started.elapsed() < Duration::from_secs(20)) {
                round += 1;
                if let Ok(row) = client
                    .query_one(
                        "SELECT count(*) FILTER (WHERE application_name LIKE 'agentloop-worker%' AND pg_terminate_backend(pid)),
                                count(*) FILTER (WHERE $1 AND application_name LIKE 'agentloop-api%' AND pg_terminate_backend(pid))
                           FROM pg_stat_activity
                          WHERE datname = current_database() AND pid <> pg_backend_pid() AND state <> 'idle'",
                        &[&round.is_multiple_of(10)],
                    )
                    .await
                {
                    workers += row.get::<_, i64>(0);
                    apis += row.get::<_, i64>(1);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            killing.store(false, std::sync::atomic::Ordering::Relaxed);
            (workers, apis)
        })
    };
    // Runs long enough (two tool steps of 150 ms, a streamed answer) to be executing while the
    // killer runs; the posts go concurrently, each retried with its idempotency key.
    let mut posts = Vec::new();
    for (i, thread) in threads.into_iter().enumerate() {
        let c = c.clone();
        posts.push(tokio::spawn(async move {
            let steps = json!([
                {"toolCalls": [{"name": "calculator", "arguments": {"expression": format!("{i}+1")}}], "delayMs": 150},
                {"toolCalls": [{"name": "calculator", "arguments": {"expression": format!("{i}*2")}}], "delayMs": 150},
                {"text": format!("final {i}: {{{{tool_results}}}}"), "chunkDelayMs": 20}
            ]);
            let (status, body) =
                post_retrying(&c, &format!("/api/threads/{thread}/chat"), json!({"content": script(steps)}), &format!("turn-{i}")).await;
            assert_eq!(status, 202, "{body}");
            (thread, id(&body["run"]), i)
        }));
    }
    // A reader keeps the api's read connections busy while the killer runs (503s expected).
    let reader = {
        let c = c.clone();
        let killing = killing.clone();
        tokio::spawn(async move {
            while killing.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = c.get("/api/threads?limit=50").await;
            }
        })
    };
    let mut turns = Vec::new();
    for post in posts {
        turns.push(post.await.unwrap());
    }
    reader.await.unwrap();
    let (killed_workers, killed_apis) = killer.await.unwrap();
    assert!(killed_workers > 0 && killed_apis > 0, "the killer terminated {killed_workers} worker and {killed_apis} api backends");
    let killed = killed_workers + killed_apis;
    let mut failed = Vec::new();
    for (thread, run, i) in &turns {
        let end = c.wait_terminal(run, T).await.unwrap();
        if end["status"] != "completed" {
            failed.push(format!("{run}: {} {}", end["status"], end["error"]));
            continue;
        }
        let answers: Vec<Value> = all_messages(&c, thread)
            .await
            .into_iter()
            .filter(|m| m["role"] == "assistant" && m["content"].as_str().is_some_and(|t| t.starts_with("final")))
            .collect();
        assert_eq!(answers.len(), 1, "turn {i}: {answers:?}");
        assert_eq!(answers[0]["content"], format!("final {i}: {}, {}", i + 1, i * 2), "turn {i}");
    }
    assert!(failed.is_empty(), "{} of 20 runs did not complete after {killed} backend kills: {failed:#?}", failed.len());
    // Lifecycle timestamps come from the database clock.
    let bad: Vec<String> = db
        .query(
            "SELECT format('%s created %s started %s finished %s attempts %s', id, created_at, started_at, finished_at, attempts)
               FROM runs WHERE finished_at < started_at OR started_at < created_at",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(bad.is_empty(), "lifecycle timestamps out of order: {bad:#?}");
}

/// Issue 9 (concurrency): a worker whose pool holds ONE connection runs 30 concurrent streaming
/// runs to completion: waiting for a connection is back-pressure, never a failed run.
#[tokio::test]
async fn durable_a_one_connection_pool_is_back_pressure_not_failure() {
    let options = StackOptions { workers: 1, worker_env: env(&[("WORKER_CONCURRENCY", "30"), ("DB_POOL_SIZE", "1")]), ..Default::default() };
    let stack = Stack::start("durable_pool", options).await.unwrap();
    let c = stack.client();
    let mut runs = Vec::new();
    for i in 0..30 {
        let thread = c.create_thread().await.unwrap();
        let text = format!("streamed answer number {i} with several words in it");
        let body = c.chat(&thread, &script(json!([{"text": text, "chunkDelayMs": 30}]))).await.unwrap();
        runs.push(id(&body["run"]));
    }
    for run in &runs {
        let end = c.wait_terminal(run, T).await.unwrap();
        assert_eq!(end["status"], "completed", "{end}");
    }
}

/// Issue 9 defect 3: provider tool-call ids are not trusted. A server that numbers ids per
/// response (`call_0` every time), an id reused for a different call after an approval with
/// edited arguments, two calls sharing one id in one message, and a non-idempotent call reusing
/// an id: every call gets its own approval, runs with its own arguments, and is executed.
#[tokio::test]
async fn durable_tool_call_ids_are_made_unique_per_run() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../test-output/durable_ids");
    std::fs::create_dir_all(&dir).unwrap();
    let tools = dir.join("tools.json");
    std::fs::write(&tools, json!({"tools": {"calculator": {"policy": "ask"}}}).to_string()).unwrap();
    let options = StackOptions {
        worker_env: env(&[("TOOLS_FILE", tools.to_str().unwrap()), ("AGENTLOOP_TEST_TOOLS", "1")]),
        ..Default::default()
    };
    let stack = Stack::start("durable_ids", options).await.unwrap();
    let c = stack.client();

    // (a) `call_0` asked 7*7, approved edited to 10+10; the next turn's `call_0` asks 2+3.
    let thread = c.create_thread().await.unwrap();
    let steps = json!([
        {"toolCalls": [{"id": "call_0", "name": "calculator", "arguments": {"expression": "7*7"}}]},
        {"toolCalls": [{"id": "call_0", "name": "calculator", "arguments": {"expression": "2+3"}}]},
        {"text": "results: {{tool_results}}"}
    ]);
    let run = id(&c.chat(&thread, &script(steps)).await.unwrap()["run"]);
    let first = wait_pending(&c, &thread, 1).await;
    assert_eq!(first[0]["arguments"]["expression"], "7*7");
    let r = c.post(&format!("/api/approvals/{}/approve", id(&first[0])), json!({"arguments": {"expression": "10+10"}})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    let second = wait_pending(&c, &thread, 1).await;
    assert_ne!(second[0]["toolCallId"], first[0]["toolCallId"], "the reused provider id got its own approval");
    assert_eq!(second[0]["arguments"]["expression"], "2+3", "the second call keeps its own arguments");
    let r = c.post(&format!("/api/approvals/{}/approve", id(&second[0])), json!({})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    let end = c.wait_terminal(&run, T).await.unwrap();
    assert_eq!(end["status"], "completed", "{end}");
    let messages = all_messages(&c, &thread).await;
    let results: Vec<String> = messages.iter().filter(|m| m["role"] == "tool").map(|m| m["content"].as_str().unwrap().to_owned()).collect();
    assert!(results[0].ends_with("20"), "{results:?}");
    assert_eq!(results[1], "5", "ran 2+3, not the earlier call's edited arguments: {results:?}");
    let calls: Vec<&Value> = messages.iter().filter_map(|m| m["toolCalls"].as_array()).flatten().collect();
    assert!(calls.iter().all(|c| c["providerId"] == "call_0"), "provider ids are kept: {calls:?}");

    // (b) Two calls sharing one id in one message (auto policy via record_effect, a
    // non-idempotent tool) and the same id again in the next message: three effects, three keys.
    let thread = c.create_thread().await.unwrap();
    let steps = json!([
        {"toolCalls": [{"id": "dup", "name": "record_effect", "arguments": {"label": "one"}},
                       {"id": "dup", "name": "record_effect", "arguments": {"label": "two"}}]},
        {"toolCalls": [{"id": "dup", "name": "record_effect", "arguments": {"label": "three"}}]},
        {"text": "results: {{tool_results}}"}
    ]);
    let run = id(&c.chat(&thread, &script(steps)).await.unwrap()["run"]);
    let end = c.wait_terminal(&run, T).await.unwrap();
    assert_eq!(end["status"], "completed", "{end}");
    let db = stack.db.client().await.unwrap();
    let rows = db.query("SELECT key, label FROM agentloop_test_effects ORDER BY id", &[]).await.unwrap();
    let labels: Vec<String> = rows.iter().map(|r| r.get(1)).collect();
    assert_eq!(labels, ["one", "two", "three"], "each call executed once with its own arguments");
    let keys: std::collections::HashSet<String> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(keys.len(), 3, "three distinct idempotency keys");
    let results: Vec<String> =
        all_messages(&c, &thread).await.iter().filter(|m| m["role"] == "tool").map(|m| m["content"].as_str().unwrap().to_owned()).collect();
    assert_eq!(results, ["recorded one", "recorded two", "recorded three"]);
}

async fn wait_pending(c: &Client, thread: &str, n: usize) -> Vec<Value> {
    let deadline = Instant::now() + T;
    loop {
        let r = c.get(&format!("/api/threads/{thread}/approvals?status=pending")).await.unwrap();
        let pending = r.body["approvals"].as_array().cloned().unwrap_or_default();
        if pending.len() == n {
            return pending;
        }
        assert!(Instant::now() < deadline, "expected {n} pending approvals: {}", r.body);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Issue 9 defect 7: a panic inside a slice fails its run with `internal_error` at once (the
/// lease keeper does not keep it `running`), and the worker goes on serving.
#[tokio::test]
async fn durable_a_panic_in_a_slice_fails_the_run_and_the_worker_goes_on() {
    let options = StackOptions { worker_env: env(&[("AGENTLOOP_TEST_TOOLS", "1")]), ..Default::default() };
    let stack = Stack::start("durable_panic", options).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let run = id(&c.chat(&thread, &script(json!([{"toolCalls": [{"name": "crash_slice"}]}, {"text": "never"}]))).await.unwrap()["run"]);
    let end = c.wait_terminal(&run, Duration::from_secs(10)).await.unwrap();
    assert_eq!((end["status"].as_str(), end["error"]["code"].as_str()), (Some("failed"), Some("internal_error")), "{end}");
    let thread = c.create_thread().await.unwrap();
    let next = id(&c.chat(&thread, "What is 2+2?").await.unwrap()["run"]);
    assert_eq!(c.wait_terminal(&next, T).await.unwrap()["status"], "completed");
}

/// Issue 9 defect 7: an automatic compaction that cannot reduce the context (nothing before the
/// verbatim tail) does not fail a run whose context still fits the model.
#[tokio::test]
async fn durable_compaction_that_cannot_reduce_a_fitting_context_does_not_fail_the_run() {
    let stack = Stack::start("durable_compaction", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let r = c.post("/api/threads", json!({"title": "t", "metadata": {"compactThreshold": 5}})).await.unwrap();
    assert_eq!(r.status, 201, "{r:?}");
    let thread = id(&r.body);
    let run = id(&c.chat(&thread, "hello there, a message long enough to pass the tiny threshold").await.unwrap()["run"]);
    let end = c.wait_terminal(&run, T).await.unwrap();
    assert_eq!(end["status"], "completed", "{end}");
}

async fn metric(port: u16, name: &str) -> f64 {
    let text = reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Issue 9 defect 7: `agentloop_lease_lost_total` counts lost leases, not successful slices.
#[tokio::test]
async fn durable_the_lease_lost_counter_counts_only_lost_leases() {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let options = StackOptions {
        workers: 0,
        worker_env: env(&[("WORKER_LEASE_MS", "3000"), ("WORKER_RENEW_MS", "1000")]),
        ..Default::default()
    };
    let mut stack = Stack::start("durable_lease_lost", options).await.unwrap();
    let w = stack.add_worker(&[("WORKER_METRICS_LISTEN", &listen)]).unwrap();
    let c = stack.client();
    for _ in 0..3 {
        let thread = c.create_thread().await.unwrap();
        let run = id(&c.chat(&thread, "What is 3*3?").await.unwrap()["run"]);
        assert_eq!(c.wait_terminal(&run, T).await.unwrap()["status"], "completed");
    }
    assert_eq!(metric(port, "agentloop_lease_lost_total").await, 0.0, "successful slices are not lost leases");
    // A worker paused past its lease loses it; another worker finishes the run.
    let thread = c.create_thread().await.unwrap();
    let run = id(&c.chat(&thread, &script(json!([{"text": "slow", "delayMs": 2500}]))).await.unwrap()["run"]);
    c.wait_run(&run, T, |r| r["status"] == "running").await.unwrap();
    stack.workers[w].signal(Sig::SIGSTOP);
    stack.add_worker(&[]).unwrap();
    tokio::time::sleep(Duration::from_secs(6)).await;
    stack.workers[w].signal(Sig::SIGCONT);
    assert_eq!(c.wait_terminal(&run, T).await.unwrap()["status"], "completed");
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(port, "agentloop_lease_lost_total").await < 1.0 {
        assert!(Instant::now() < deadline, "the paused worker did not count its lost lease");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// SPEC §4: cancelling a streaming run commits the partial answer as an assistant message
/// marked `stopped`, in the transaction that ends the run; the window showed the partial while
/// it streamed (rebuilt from the flusher's snapshot and deltas).
#[tokio::test]
async fn durable_cancelling_a_stream_keeps_the_partial_answer_marked_stopped() {
    let stack = Stack::start("durable_stop", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    // 100 chunks of 3 words, 60 ms apart: the cancel lands mid-stream even on a loaded machine.
    let full: String = (0..300).map(|i| format!("word{i} ")).collect();
    let run = id(&c.chat(&thread, &script(json!([{"text": full, "chunkDelayMs": 60}]))).await.unwrap()["run"]);
    let deadline = Instant::now() + T;
    let partial = loop {
        let w = c.get(&format!("/api/threads/{thread}")).await.unwrap().body;
        let text = w["streamingMessage"]["content"].as_str().unwrap_or_default().to_owned();
        if text.len() > 20 {
            break text;
        }
        assert!(Instant::now() < deadline, "no streaming partial in the window: {w}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(full.starts_with(&partial), "the rebuilt partial is a prefix of the answer: {partial:?}");
    assert_eq!(c.post(&format!("/api/runs/{run}/cancel"), json!({})).await.unwrap().status, 200);
    let end = c.wait_terminal(&run, T).await.unwrap();
    assert_eq!(end["status"], "cancelled", "{end}");
    let messages = all_messages(&c, &thread).await;
    let stopped: Vec<&Value> = messages.iter().filter(|m| m["role"] == "assistant").collect();
    assert_eq!(stopped.len(), 1, "{messages:?}");
    assert_eq!(stopped[0]["stopped"], true);
    let text = stopped[0]["content"].as_str().unwrap();
    assert!(text.len() >= partial.len() && text.len() < full.len() && full.starts_with(text), "{text:?}");
    let w = c.get(&format!("/api/threads/{thread}")).await.unwrap().body;
    assert!(w["streamingMessage"].is_null(), "the partial is cleared with the run's end: {}", w["streamingMessage"]);
}

/// Issue 9 defect 4: a non-idempotent HTTP tool whose receiver takes the request and never
/// answers (a timeout after the request left) is `uncertain` and its run `blocked` — not
/// `failed` — so the model cannot call it again under a new key; the effect happened once. A
/// resolve `completed` then lets the run finish without a second dispatch.
#[tokio::test]
async fn durable_a_timed_out_effect_is_uncertain_and_never_repeated() {
    use tokio::io::AsyncReadExt;
    let receiver = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = receiver.local_addr().unwrap().port();
    let hits = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    {
        let hits = hits.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                let (mut socket, _) = receiver.accept().await.unwrap();
                let mut buf = vec![0u8; 16 * 1024];
                let n = socket.read(&mut buf).await.unwrap_or(0);
                let request = String::from_utf8_lossy(&buf[..n]).to_string();
                let key = request
                    .lines()
                    .find_map(|l| l.to_ascii_lowercase().strip_prefix("idempotency-key:").map(|v| v.trim().to_owned()))
                    .unwrap_or_default();
                hits.lock().unwrap().push(key);
                held.push(socket); // performed the payment; never answers
            }
        });
    }
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../test-output/durable_uncertain");
    std::fs::create_dir_all(&dir).unwrap();
    let tools = dir.join("tools.json");
    let config = json!({"httpTools": [{"name": "pay", "url": format!("http://127.0.0.1:{port}/pay"),
                                       "readTimeoutMs": 500, "timeoutMs": 1000,
                                       "parameters": {"type": "object", "properties": {"amount": {"type": "number"}}}}]});
    std::fs::write(&tools, config.to_string()).unwrap();
    let options = StackOptions { worker_env: env(&[("TOOLS_FILE", tools.to_str().unwrap())]), ..Default::default() };
    let stack = Stack::start("durable_uncertain", options).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    // A model that calls the tool again after an error result (as real models do).
    let steps = json!([
        {"toolCalls": [{"name": "pay", "arguments": {"amount": 10}}]},
        {"toolCalls": [{"name": "pay", "arguments": {"amount": 10}}]},
        {"text": "paid: {{tool_results}}"}
    ]);
    let run = id(&c.chat(&thread, &script(steps)).await.unwrap()["run"]);
    let blocked = c.wait_run(&run, T, |r| matches!(r["status"].as_str(), Some("blocked" | "completed" | "failed"))).await.unwrap();
    assert_eq!(blocked["status"], "blocked", "a timed-out effect blocks the run: {blocked}");
    assert_eq!(blocked["blocker"]["operations"][0]["status"], "uncertain", "{blocked}");
    assert_eq!(hits.lock().unwrap().len(), 1, "the receiver was called once");
    let key = blocked["blocker"]["operations"][0]["key"].as_str().unwrap().to_owned();
    assert_eq!(hits.lock().unwrap()[0], key, "under the operation's key");
    let r = c.post(&format!("/api/runs/{run}/operations/{key}/resolve"), json!({"outcome": "completed", "result": "paid 10"})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    // The scripted model calls once more (step 1): that is a NEW call with its own key, which
    // times out too and blocks again; the first effect is never re-dispatched.
    let again = c.wait_run(&run, T, |r| matches!(r["status"].as_str(), Some("blocked" | "completed" | "failed"))).await.unwrap();
    assert_eq!(again["status"], "blocked", "{again}");
    let keys = hits.lock().unwrap().clone();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert_ne!(keys[0], keys[1], "a second call, not a repeat of the first");
    let ops = c.get(&format!("/api/runs/{run}/operations")).await.unwrap().body;
    let statuses: Vec<&str> = ops["operations"].as_array().unwrap().iter().map(|o| o["status"].as_str().unwrap()).collect();
    assert_eq!(statuses, ["completed", "uncertain"], "{ops}");
}

/// Issue 9 defect 1, the other pairs: approve, reject, resolve, cancel (run, pending turn,
/// thread), enqueue, interrupt and delete racing each other on a run waiting for approvals and
/// on a blocked run, and against the batch's own resumption: no 5xx, no deadlock, no failed run.
#[tokio::test]
async fn durable_commands_racing_each_other_on_approvals_and_blocked_runs_never_deadlock() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../test-output/durable_race2");
    std::fs::create_dir_all(&dir).unwrap();
    let tools = dir.join("tools.json");
    // `pay` reaches a receiver that never answers: after its 300 ms read timeout the outcome is
    // unknown and the run `blocked` (a cancelled call would end the run `cancelled`).
    let (port, _hits) = receiver(Duration::ZERO, true).await;
    let config = json!({"tools": {"calculator": {"policy": "ask"}},
                        "httpTools": [{"name": "pay", "url": format!("http://127.0.0.1:{port}/pay"), "readTimeoutMs": 300, "timeoutMs": 600}]});
    std::fs::write(&tools, config.to_string()).unwrap();
    let options = StackOptions {
        workers: 2,
        worker_env: env(&[("TOOLS_FILE", tools.to_str().unwrap()), ("AGENTLOOP_TEST_TOOLS", "1"), ("WORKER_CONCURRENCY", "8")]),
        ..Default::default()
    };
    let stack = Stack::start("durable_race2", options).await.unwrap();
    let c = stack.client();
    let mut rounds = Vec::new();
    for n in 0..16u64 {
        let c = c.clone();
        rounds.push(tokio::spawn(async move {
            let thread = c.create_thread().await.unwrap();
            let mut sent: Vec<(&str, reqwest::Method, String, Option<Value>)> = Vec::new();
            let run;
            if n % 2 == 0 {
                // Waiting for two approvals, with a FIFO turn behind.
                let steps = json!([{"toolCalls": [{"name": "calculator", "arguments": {"expression": "1+1"}},
                                                 {"name": "calculator", "arguments": {"expression": "2+2"}}], "delayMs": 4000},
                                   {"text": "done"}]);
                run = id(&c.chat(&thread, &script(steps)).await.unwrap()["run"]);
                // Enqueued while the run is still queued or running (a parked run refuses turns):
                // the model's 4 s delay covers 16 rounds starting at once on a loaded 2-core CI
                // machine (1.5 s did not: a CI run got 409 approval_required here).
                let queued = c
                    .post(&format!("/api/threads/{thread}/chat"), json!({"content": script(json!([{"text": "later"}])), "multitask": "enqueue"}))
                    .await
                    .unwrap();
                assert_eq!(queued.status, 202, "{queued:?}");
                let pending = wait_pending(&c, &thread, 2).await;
                sent.push(("approve", reqwest::Method::POST, format!("/api/approvals/{}/approve", id(&pending[0])), Some(json!({}))));
                sent.push(("reject", reqwest::Method::POST, format!("/api/approvals/{}/reject", id(&pending[1])), Some(json!({"reason": "no"}))));
                sent.push(("approve again", reqwest::Method::POST, format!("/api/approvals/{}/approve", id(&pending[1])), Some(json!({}))));
                sent.push(("cancel pending", reqwest::Method::POST, format!("/api/runs/{}/cancel", id(&queued.body["run"])), Some(json!({}))));
            } else {
                // Blocked on an uncertain effect (the call timed out reading its answer).
                let steps = json!([{"toolCalls": [{"name": "pay"}]}, {"text": "done"}]);
                run = id(&c.chat(&thread, &script(steps)).await.unwrap()["run"]);
                let blocked = c.wait_run(&run, T, |r| r["status"] == "blocked").await.unwrap();
                let key = blocked["blocker"]["operations"][0]["key"].as_str().unwrap().to_owned();
                sent.push(("resolve", reqwest::Method::POST, format!("/api/runs/{run}/operations/{key}/resolve"), Some(json!({"outcome": "completed"}))));
                sent.push(("enqueue", reqwest::Method::POST, format!("/api/threads/{thread}/chat"),
                           Some(json!({"content": script(json!([{"text": "after"}])), "multitask": "enqueue"}))));
            }
            match n % 4 {
                0 | 1 => sent.push(("cancel thread", reqwest::Method::POST, format!("/api/threads/{thread}/cancel"), Some(json!({})))),
                2 => sent.push(("interrupt", reqwest::Method::POST, format!("/api/threads/{thread}/chat"),
                                Some(json!({"content": script(json!([{"text": "now"}])), "multitask": "interrupt"})))),
                _ => sent.push(("delete", reqwest::Method::DELETE, format!("/api/threads/{thread}"), None)),
            }
            let replies = futures_util::future::join_all(sent.iter().map(|(_, m, path, body)| c.send(m.clone(), path, body.clone(), &[]))).await;
            let mut violations = Vec::new();
            for ((what, ..), reply) in sent.iter().zip(replies) {
                let reply = reply.unwrap();
                if reply.status >= 500 {
                    violations.push(format!("{what}: HTTP {} {}", reply.status, reply.body));
                }
            }
            let _ = run;
            violations
        }));
    }
    let mut violations = Vec::new();
    for round in rounds {
        violations.extend(round.await.unwrap());
    }
    assert!(violations.is_empty(), "{violations:#?}");
    // Let everything settle; then no run failed and none is stuck.
    let db = stack.db.client().await.unwrap();
    let deadline = Instant::now() + T;
    loop {
        let open: i64 = db.query_one("SELECT count(*) FROM runs WHERE status IN ('queued', 'running', 'pending')", &[]).await.unwrap().get(0);
        if open == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{open} runs still open");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let failed = db.query("SELECT id::text, error_code FROM runs WHERE status = 'failed'", &[]).await.unwrap();
    assert!(failed.is_empty(), "failed runs: {:?}", failed.iter().map(|r| (r.get::<_, String>(0), r.get::<_, Option<String>>(1))).collect::<Vec<_>>());
    let deadlocks: i64 = db.query_one("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()", &[]).await.unwrap().get(0);
    assert_eq!(deadlocks, 0);
}

/// Issue 9 defect 7: a claim whose answer was lost does not drop its runs (the next pass
/// re-adopts them, same fencing token, no `recoveries + 1`), and a lease renewal never waits on
/// a row lock (its own slice's checkpoint, or anyone's): it answers `busy` at once.
#[tokio::test]
async fn durable_lost_claim_answers_are_readopted_and_renewals_never_wait() {
    use agentloop_shared::store::{PoolSettings, Replay, Store, Timing};
    let stack = Stack::start("durable_claim", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let run = id(&c.chat(&thread, "hello").await.unwrap()["run"]);
    let store = Store::new(
        &PoolSettings { database_url: stack.db.url.clone(), application_name: "test".into(), statement_timeout: Duration::from_secs(10), max_size: 2, wait_timeout: Duration::from_secs(5) },
        Timing { call_timeout: Duration::from_secs(10), retry_for: Duration::from_secs(5) },
    )
    .unwrap();
    let claim = |adopt: bool| json!({"owner": "w-test", "limit": 4, "leaseMs": 60000, "inflight": [], "adopt": adopt});
    let first = store.call("agentloop_claim", &claim(false), Replay::Safe, None).await.unwrap();
    assert_eq!(first["runs"][0]["id"], run.as_str(), "{first}");
    let epoch = first["runs"][0]["leaseEpoch"].clone();
    // The answer is "lost": the worker never started a slice. Its next pass re-adopts.
    let again = store.call("agentloop_claim", &claim(true), Replay::Safe, None).await.unwrap();
    assert_eq!(again["runs"].as_array().unwrap().len(), 1, "{again}");
    assert_eq!(again["runs"][0]["id"], run.as_str());
    assert_eq!(again["runs"][0]["leaseEpoch"], epoch, "same fencing token");
    assert_eq!(again["runs"][0]["recoveries"], 0);
    // A session holding the run's row lock does not make the renewal wait.
    let db = stack.db.client().await.unwrap();
    db.batch_execute(&format!("BEGIN; SELECT 1 FROM runs WHERE id = '{run}' FOR UPDATE")).await.unwrap();
    let started = Instant::now();
    let renewed = store
        .call("agentloop_renew", &json!({"owner": "w-test", "leaseMs": 60000, "runs": [{"runId": run, "epoch": epoch}]}), Replay::Safe, None)
        .await
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(1), "the renewal waited {:?}", started.elapsed());
    assert_eq!(renewed[&run], "busy", "{renewed}");
    db.batch_execute("COMMIT").await.unwrap();
    let renewed = store
        .call("agentloop_renew", &json!({"owner": "w-test", "leaseMs": 60000, "runs": [{"runId": run, "epoch": epoch}]}), Replay::Safe, None)
        .await
        .unwrap();
    assert_eq!(renewed[&run], "ok", "{renewed}");
}

/// Issue 9 ("a step whose commit outcome is unknown is re-read, not guessed"), for the claim:
/// when a claim's answer is lost after PostgreSQL committed it, the store must not send the same
/// claim again (it would find nothing to claim and the runs the lost attempt took would wait for
/// their lease to expire, counting a fault). It reports the unknown outcome, and the next pass,
/// sent with `adopt`, gets the run back with the same fencing token.
#[tokio::test]
async fn durable_a_claim_whose_answer_is_lost_is_not_replayed_but_readopted() {
    use agentloop_shared::scheduler;
    use agentloop_shared::store::{PoolSettings, Store, StoreError, Timing};
    let stack = Stack::start("durable_claim_lost", StackOptions { workers: 0, workers_through_proxy: true, ..Default::default() }).await.unwrap();
    let proxy = stack.proxy.as_ref().unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let run = id(&c.chat(&thread, "hello").await.unwrap()["run"]);
    let db = stack.db.client().await.unwrap();
    // The claim of this owner takes a second on the server: time to withhold its answer.
    db.batch_execute(
        "CREATE FUNCTION test_slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
             IF NEW.lease_owner = 'w-lost' AND OLD.status = 'queued' THEN PERFORM pg_sleep(1); END IF; RETURN NEW; END $$;
         CREATE TRIGGER test_slow_claim BEFORE UPDATE ON runs FOR EACH ROW EXECUTE FUNCTION test_slow_claim();",
    )
    .await
    .unwrap();
    let store = Store::new(
        &PoolSettings { database_url: proxy.url(&stack.db.url), application_name: "test".into(), statement_timeout: Duration::from_secs(10), max_size: 2, wait_timeout: Duration::from_secs(5) },
        Timing { call_timeout: Duration::from_secs(2), retry_for: Duration::from_secs(8) },
    )
    .unwrap();
    let lease = Duration::from_secs(60);
    let claim = tokio::spawn({
        let store = store.clone();
        async move { scheduler::claim(&store, &scheduler::Pass { owner: "w-lost", limit: 4, lease, inflight: &[], released: &[], adopt: false, start: None, spare: None, models: None }).await }
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    proxy.freeze_all();
    let outcome = claim.await.unwrap();
    assert!(matches!(outcome, Err(StoreError::OutcomeUnknown(_))), "the lost claim must report an unknown outcome, got {outcome:?}");
    // PostgreSQL did commit it.
    let owner: Option<String> = db.query_one("SELECT lease_owner FROM runs WHERE id = $1::text::uuid", &[&run]).await.unwrap().get(0);
    assert_eq!(owner.as_deref(), Some("w-lost"));
    proxy.pass();
    let again = scheduler::claim(&store, &scheduler::Pass { owner: "w-lost", limit: 4, lease, inflight: &[], released: &[], adopt: true, start: None, spare: None, models: None }).await.unwrap();
    assert_eq!(again.runs.len(), 1, "{again:?}");
    assert_eq!(again.runs[0].id.to_string(), run);
    assert_eq!(again.runs[0].lease_epoch, 1, "the same fencing token");
    assert_eq!(again.runs[0].recoveries, 0);
}

/// Issue 9 throughput: the claim starts the slices of the runs it claimed from `queued` in its
/// own transaction (migration 000020) — but never waits for a thread lock (every other command
/// takes the thread before the run, so waiting would invert the lock order), never lets one
/// run's failing start fail the claim of the others, and never starts a re-adopted run.
#[tokio::test]
async fn durable_the_claim_starts_fresh_runs_but_never_waits_and_never_fails_for_one() {
    use agentloop_shared::store::{PoolSettings, Replay, Store, Timing};
    let stack = Stack::start("durable_claimstart", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let mut runs = Vec::new();
    let mut threads = Vec::new();
    for text in ["locked", "fine", "poison", "recovered"] {
        let thread = c.create_thread().await.unwrap();
        runs.push(id(&c.chat(&thread, text).await.unwrap()["run"]));
        threads.push(thread);
    }
    let db = stack.db.client().await.unwrap();
    let model: String = db.query_one("SELECT model FROM runs WHERE id = $1::text::uuid", &[&runs[1]]).await.unwrap().get(0);
    // The third run's start raises (a context limit that is not a number).
    db.execute("UPDATE runs SET model = 'poison' WHERE id = $1::text::uuid", &[&runs[2]]).await.unwrap();
    // The fourth was held by a worker that died: its lease expired. The claim recovers it but
    // leaves its start to its slice.
    db.execute(
        "UPDATE runs SET status = 'running', lease_owner = 'dead', lease_epoch = 1, attempts = 1, lease_expires_at = now() - interval '1 second' WHERE id = $1::text::uuid",
        &[&runs[3]],
    )
    .await
    .unwrap();
    let locker = stack.db.client().await.unwrap();
    locker.batch_execute(&format!("BEGIN; SELECT 1 FROM threads WHERE id = '{}' FOR UPDATE", threads[0])).await.unwrap();
    let store = Store::new(
        &PoolSettings { database_url: stack.db.url.clone(), application_name: "test".into(), statement_timeout: Duration::from_secs(10), max_size: 2, wait_timeout: Duration::from_secs(5) },
        Timing { call_timeout: Duration::from_secs(10), retry_for: Duration::from_secs(5) },
    )
    .unwrap();
    let start = json!({"limit": 16, "maxRecoveries": 5, "models": {
        model.clone(): {"model": model, "toolTokens": 7, "contextLimit": 1000},
        "poison": {"model": "poison", "toolTokens": 7, "contextLimit": "not a number"}}});
    let claim = |adopt: bool| json!({"owner": "w-test", "limit": 8, "leaseMs": 60000, "inflight": [], "adopt": adopt, "start": start});
    let began = Instant::now();
    let first = store.call("agentloop_claim", &claim(false), Replay::Safe, None).await.unwrap();
    assert!(began.elapsed() < Duration::from_secs(2), "the claim waited {:?} for a thread lock", began.elapsed());
    assert_eq!(first["runs"].as_array().unwrap().len(), 4, "every run is claimed: {first}");
    let starts = first["starts"].as_object().unwrap();
    assert_eq!(starts.keys().collect::<Vec<_>>(), vec![&runs[1]], "only the queued run on a free thread with a good start: {first}");
    let started = &starts[&runs[1]];
    assert_eq!(started["step"]["sequence"], 1, "{started}");
    assert_eq!(started["run"]["contextLimit"], 1000, "{started}");
    assert!(started["context"]["messages"].as_array().is_some_and(|m| !m.is_empty()), "{started}");
    let steps: Vec<String> = db
        .query("SELECT run_id::text FROM run_steps ORDER BY run_id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(steps, vec![runs[1].clone()], "the failed start left nothing behind");
    let run_events: i64 = db
        .query_one("SELECT count(*) FROM thread_events WHERE thread_id = $1::text::uuid AND kind = 'run' AND payload ->> 'contextTokens' IS NOT NULL AND (payload ->> 'contextTokens')::int > 7", &[&threads[1]])
        .await
        .unwrap()
        .get(0);
    assert!(run_events >= 1, "the start journaled the run with its context size");
    locker.batch_execute("COMMIT").await.unwrap();
    // A re-adopting pass (after a lost answer) starts nothing: the slices start their runs.
    let again = store.call("agentloop_claim", &claim(true), Replay::Safe, None).await.unwrap();
    assert_eq!(again["runs"].as_array().unwrap().len(), 4, "{again}");
    assert_eq!(again["starts"], json!({}), "{again}");
}

/// Issue 9 defect 1, made deterministic: while the active run's final checkpoint is held up on
/// the thread row (a session holds its lock), a cancel of the FIFO-pending turn behind it is
/// sent; then the lock is released. With one lock order (thread first) the two commands
/// serialise; with the old order (pending run, then thread vs. active run, thread, pending run)
/// they deadlock and PostgreSQL kills one: a paid answer or the cancel.
#[tokio::test]
async fn durable_cancelling_a_pending_turn_while_the_run_ends_is_not_a_deadlock() {
    let stack = Stack::start("durable_lockorder", StackOptions::default()).await.unwrap();
    let c = stack.client();
    for round in 0..3 {
        let thread = c.create_thread().await.unwrap();
        let a = id(&c.chat(&thread, &script(json!([{"text": "the paid answer", "delayMs": 800}]))).await.unwrap()["run"]);
        let b = c
            .post(&format!("/api/threads/{thread}/chat"), json!({"content": script(json!([{"text": "later"}])), "multitask": "enqueue"}))
            .await
            .unwrap();
        assert_eq!(b.status, 202, "{b:?}");
        let b = id(&b.body["run"]);
        c.wait_run(&a, T, |r| r["status"] == "running").await.unwrap();
        let holder = stack.db.client().await.unwrap();
        holder.batch_execute(&format!("BEGIN; SELECT 1 FROM threads WHERE id = '{thread}' FOR UPDATE")).await.unwrap();
        // The answer arrives and the worker's final checkpoint waits on the thread row.
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let cancel = {
            let c = c.clone();
            let b = b.clone();
            tokio::spawn(async move { c.post(&format!("/api/runs/{b}/cancel"), json!({})).await.unwrap() })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        holder.batch_execute("COMMIT").await.unwrap();
        let reply = cancel.await.unwrap();
        assert_eq!(reply.status, 200, "round {round}: {reply:?}");
        let a_end = c.wait_terminal(&a, T).await.unwrap();
        assert_eq!(a_end["status"], "completed", "round {round}: the paid answer was thrown away: {a_end}");
        // The cancel waits behind the slice end (lock order: active run, thread, pending run):
        // when the worker wins, B is promoted, and on a loaded machine it may be claimed and
        // answered (its script is instant) before the cancel reaches it — a cancel that comes
        // after the end changes nothing. Either outcome is legal; nothing may fail or deadlock.
        let b_end = c.wait_terminal(&b, T).await.unwrap();
        assert!(matches!(b_end["status"].as_str(), Some("cancelled" | "completed")), "round {round}: {b_end}");
        let answers = all_messages(&c, &thread).await.into_iter().filter(|m| m["content"] == "the paid answer").count();
        assert_eq!(answers, 1, "round {round}");
    }
    let db = stack.db.client().await.unwrap();
    let deadlocks: i64 = db.query_one("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()", &[]).await.unwrap().get(0);
    assert_eq!(deadlocks, 0);
}

/// A receiver for non-idempotent HTTP tools: records each request's `Idempotency-Key`, waits
/// `delay`, answers 200 `ok` (or never answers when `hang`).
async fn receiver(delay: Duration, hang: bool) -> (u16, Arc<std::sync::Mutex<Vec<String>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let hits = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let recorded = hits.clone();
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let hits = recorded.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 * 1024];
                let n = socket.read(&mut buf).await.unwrap_or(0);
                let request = String::from_utf8_lossy(&buf[..n]).to_string();
                let key = request
                    .lines()
                    .find_map(|l| l.to_ascii_lowercase().strip_prefix("idempotency-key:").map(|v| v.trim().to_owned()))
                    .unwrap_or_default();
                hits.lock().unwrap().push(key);
                tokio::time::sleep(delay).await;
                if hang {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                }
                let _ = socket.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok").await;
            });
        }
    });
    (port, hits)
}

fn pay_tools(test: &str, port: u16) -> String {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../test-output").join(test);
    std::fs::create_dir_all(&dir).unwrap();
    let tools = dir.join("tools.json");
    let config = json!({"httpTools": [{"name": "pay", "url": format!("http://127.0.0.1:{port}/pay"),
                                       "readTimeoutMs": 30000, "timeoutMs": 30000,
                                       "parameters": {"type": "object", "properties": {"amount": {"type": "number"}}}}]});
    std::fs::write(&tools, config.to_string()).unwrap();
    tools.to_str().unwrap().to_owned()
}

/// SIGTERM while a non-idempotent call is in flight lets the call finish, commits its outcome
/// and hands the run back (`queued`), which another worker completes: the run is not blocked
/// and the effect happened once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_sigterm_lets_an_effect_in_flight_finish_and_hands_the_run_back() {
    let (port, hits) = receiver(Duration::from_millis(1500), false).await;
    let tools = pay_tools("durable_sigterm_effect", port);
    let options = StackOptions { workers: 0, worker_env: env(&[("TOOLS_FILE", &tools)]), ..Default::default() };
    let mut stack = Stack::start("durable_sigterm_effect", options).await.unwrap();
    let first = stack.add_worker(&[]).unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "pay", "arguments": {"amount": 5}}]}, {"text": "paid: {{tool_result}}"}]);
    let run = id(&c.chat(&thread, &script(steps)).await.unwrap()["run"]);
    let deadline = Instant::now() + T;
    while hits.lock().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "the call never reached the receiver");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stack.workers[first].signal(Sig::SIGTERM);
    assert!(stack.workers[first].wait_exit(Duration::from_secs(15)), "the worker did not exit within its grace");
    stack.add_worker(&[]).unwrap();
    let end = c.wait_terminal(&run, T).await.unwrap();
    assert_eq!(end["status"], "completed", "{end}");
    assert_eq!(hits.lock().unwrap().len(), 1, "the effect happened once");
    let ops = c.get(&format!("/api/runs/{run}/operations")).await.unwrap().body;
    assert_eq!(ops["operations"][0]["status"], "completed", "{ops}");
    let answer = all_messages(&c, &thread).await.into_iter().rev().find(|m| m["role"] == "assistant").unwrap();
    assert_eq!(answer["content"], "paid: ok");
}

/// Cancelling a blocked run ends it, the call's history says its outcome was unknown (never
/// "cancelled", since it may have happened), and the operation can still be resolved for the
/// record afterwards.
#[tokio::test]
async fn durable_cancelling_a_blocked_run_keeps_the_effect_honest_and_resolvable() {
    let (port, hits) = receiver(Duration::ZERO, true).await;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../test-output/durable_cancel_blocked");
    std::fs::create_dir_all(&dir).unwrap();
    let tools = dir.join("tools.json");
    std::fs::write(&tools, json!({"httpTools": [{"name": "pay", "url": format!("http://127.0.0.1:{port}/pay"), "readTimeoutMs": 300, "timeoutMs": 600}]}).to_string()).unwrap();
    let options = StackOptions { worker_env: env(&[("TOOLS_FILE", tools.to_str().unwrap())]), ..Default::default() };
    let stack = Stack::start("durable_cancel_blocked", options).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let run = id(&c.chat(&thread, &script(json!([{"toolCalls": [{"name": "pay"}]}, {"text": "never"}]))).await.unwrap()["run"]);
    let blocked = c.wait_run(&run, T, |r| r["status"] == "blocked").await.unwrap();
    let key = blocked["blocker"]["operations"][0]["key"].as_str().unwrap().to_owned();
    let r = c.post(&format!("/api/runs/{run}/cancel"), json!({})).await.unwrap();
    assert_eq!(r.body["status"], "cancelled", "{r:?}");
    let results: Vec<String> =
        all_messages(&c, &thread).await.iter().filter(|m| m["role"] == "tool").map(|m| m["content"].as_str().unwrap().to_owned()).collect();
    assert_eq!(results.len(), 1);
    assert!(results[0].starts_with("[outcome unknown"), "{results:?}");
    let r = c.post(&format!("/api/runs/{run}/operations/{key}/resolve"), json!({"outcome": "completed", "result": "paid"})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body["operation"]["status"], "completed");
    assert_eq!(r.body["run"]["status"], "cancelled", "a resolve after the end records, never resumes");
    let r = c.post(&format!("/api/runs/{run}/operations/{key}/resolve"), json!({"outcome": "retry"})).await.unwrap();
    assert_eq!(r.status, 409, "{r:?}");
    assert_eq!(hits.lock().unwrap().len(), 1);

    // `retry`, then a cancel before any worker sends the call again (the worker is stopped):
    // the call was sent once, so its result says the outcome is unknown and the operation is
    // `uncertain` again, resolvable for the record (it used to stay `prepared` for good, with
    // a "cancelled" result).
    let thread = c.create_thread().await.unwrap();
    let run = id(&c.chat(&thread, &script(json!([{"toolCalls": [{"name": "pay"}]}, {"text": "never"}]))).await.unwrap()["run"]);
    let blocked = c.wait_run(&run, T, |r| r["status"] == "blocked").await.unwrap();
    let key = blocked["blocker"]["operations"][0]["key"].as_str().unwrap().to_owned();
    stack.workers[0].signal(Sig::SIGSTOP);
    let r = c.post(&format!("/api/runs/{run}/operations/{key}/resolve"), json!({"outcome": "retry"})).await.unwrap();
    assert_eq!((r.status, r.body["run"]["status"].as_str()), (200, Some("queued")), "{r:?}");
    let r = c.post(&format!("/api/runs/{run}/cancel"), json!({})).await.unwrap();
    stack.workers[0].signal(Sig::SIGCONT);
    assert_eq!(r.body["status"], "cancelled", "{r:?}");
    let results: Vec<String> =
        all_messages(&c, &thread).await.iter().filter(|m| m["role"] == "tool").map(|m| m["content"].as_str().unwrap().to_owned()).collect();
    assert_eq!(results.len(), 1);
    assert!(results[0].starts_with("[outcome unknown"), "{results:?}");
    let ops = c.get(&format!("/api/runs/{run}/operations")).await.unwrap().body;
    assert_eq!(ops["operations"][0]["status"], "uncertain", "{ops}");
    let r = c.post(&format!("/api/runs/{run}/operations/{key}/resolve"), json!({"outcome": "failed", "reason": "checked"})).await.unwrap();
    assert_eq!((r.status, r.body["operation"]["status"].as_str()), (200, Some("failed")), "{r:?}");
    assert_eq!(hits.lock().unwrap().len(), 2, "the retried call was never sent again");
}

/// A known outcome survives a database outage longer than the lease: the call returned, its
/// checkpoint could not be committed (every worker connection frozen past the lease), the
/// worker records the outcome on the operation once the database answers again, and the run
/// completes with that result — not blocked on an "unknown" outcome, not called twice.
#[tokio::test]
async fn durable_a_known_outcome_survives_a_database_outage_longer_than_the_lease() {
    let (port, hits) = receiver(Duration::from_millis(800), false).await;
    let tools = pay_tools("durable_outage_outcome", port);
    let options = StackOptions {
        workers_through_proxy: true,
        worker_env: env(&[("TOOLS_FILE", &tools), ("WORKER_LEASE_MS", "3000"), ("WORKER_RENEW_MS", "1000")]),
        ..Default::default()
    };
    let stack = Stack::start("durable_outage_outcome", options).await.unwrap();
    let proxy = stack.proxy.as_ref().unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "pay", "arguments": {"amount": 7}}]}, {"text": "paid: {{tool_result}}"}]);
    let run = id(&c.chat(&thread, &script(steps)).await.unwrap()["run"]);
    let deadline = Instant::now() + T;
    while hits.lock().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "the call never reached the receiver");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The database goes away for the workers while the call is answered, for longer than the lease.
    proxy.freeze_all();
    proxy.freeze_new(agentloop_tests::proxy::FreezeAt::Start);
    tokio::time::sleep(Duration::from_secs(5)).await;
    proxy.pass();
    let end = c.wait_terminal(&run, T).await.unwrap();
    assert_eq!(end["status"], "completed", "{end}");
    assert!(end["attempts"].as_i64().unwrap() >= 2, "the slice lost its lease during the outage: {end}");
    let ops = c.get(&format!("/api/runs/{run}/operations")).await.unwrap().body;
    assert_eq!(ops["operations"][0]["status"], "completed", "recorded, not uncertain: {ops}");
    assert!(ops["operations"][0]["resolution"].is_null(), "no human had to resolve it: {ops}");
    assert_eq!(hits.lock().unwrap().len(), 1, "the effect happened once");
    let answer = all_messages(&c, &thread).await.into_iter().rev().find(|m| m["role"] == "assistant").unwrap();
    assert_eq!(answer["content"], "paid: ok");
}

/// SPEC §4 with a dead worker: the run's worker is killed mid-stream, the user cancels, and the
/// recovery that ends the run keeps what had been streamed (from the database's snapshot and
/// deltas) as an assistant message marked stopped.
#[tokio::test]
async fn durable_a_cancel_completed_by_recovery_keeps_the_streamed_partial() {
    let options = StackOptions { workers: 0, worker_env: env(&[("WORKER_LEASE_MS", "3000"), ("WORKER_RENEW_MS", "1000")]), ..Default::default() };
    let mut stack = Stack::start("durable_recovered_stop", options).await.unwrap();
    let w = stack.add_worker(&[]).unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let full: String = (0..300).map(|i| format!("w{i} ")).collect();
    let run = id(&c.chat(&thread, &script(json!([{"text": full, "chunkDelayMs": 40}]))).await.unwrap()["run"]);
    let deadline = Instant::now() + T;
    let shown = loop {
        let w = c.get(&format!("/api/threads/{thread}")).await.unwrap().body;
        let text = w["streamingMessage"]["content"].as_str().unwrap_or_default().to_owned();
        if text.len() > 100 {
            break text;
        }
        assert!(Instant::now() < deadline, "nothing streamed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    stack.workers[w].signal(Sig::SIGKILL);
    assert_eq!(c.post(&format!("/api/runs/{run}/cancel"), json!({})).await.unwrap().status, 200);
    stack.add_worker(&[]).unwrap();
    let end = c.wait_terminal(&run, T).await.unwrap();
    assert_eq!(end["status"], "cancelled", "{end}");
    let stopped: Vec<Value> = all_messages(&c, &thread).await.into_iter().filter(|m| m["role"] == "assistant").collect();
    assert_eq!(stopped.len(), 1, "{stopped:?}");
    assert_eq!(stopped[0]["stopped"], true);
    let text = stopped[0]["content"].as_str().unwrap();
    assert!(text.starts_with(&shown) && full.starts_with(text), "kept {} chars, had shown {}", text.len(), shown.len());
}

/// Deferred notifications (issue 9, `migrations/…000018_deferred_notify`): a worker step's
/// notifications are not sent by its own transaction (which would hold PostgreSQL's
/// database-wide notify lock through its WAL flush) but by `agentloop_flush_notify()` right
/// after it; a step that rolls back leaves nothing to send; and through the workers' store the
/// pipelined flush delivers every step's notification with nothing left pending in the session.
#[tokio::test]
async fn deferred_notifications_are_sent_after_the_commit_and_never_for_a_rolled_back_step() {
    use agentloop_shared::scheduler::listener::{self, ListenerEvent};
    use agentloop_shared::store::{PoolSettings, Replay, Store, Timing};

    let db = agentloop_tests::TestDb::create().await.unwrap();
    let setup = db.client().await.unwrap();
    let thread = uuid::Uuid::new_v4();
    setup
        .batch_execute(&format!(
            "INSERT INTO principals (id, name) VALUES ('00000000-0000-0000-0000-000000000001', 'p');
             INSERT INTO threads (id, owner_id, last_event_sequence) VALUES ('{thread}', '00000000-0000-0000-0000-000000000001', 7);"
        ))
        .await
        .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let mut events = listener::spawn(db.url.clone(), "deferred-test-listener", vec!["agentloop_threads"], Duration::from_secs(5), stop.clone());
    assert_eq!(tokio::time::timeout(T, events.recv()).await.unwrap(), Some(ListenerEvent::Resync));
    let expected = ListenerEvent::Notification { channel: "agentloop_threads".into(), payload: format!("{thread}:7") };
    let quiet = |events: &mut tokio::sync::mpsc::Receiver<ListenerEvent>| {
        let got = events.try_recv();
        assert!(got.is_err(), "a notification nobody flushed: {got:?}");
    };
    let arg = json!({"threadId": thread});

    // 1. The step commits; its notification waits for the flush.
    let step = db.client().await.unwrap();
    step.query_one("SELECT agentloop_renotify(agentloop_defer($1))", &[&arg]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    quiet(&mut events);
    let flushed: i32 = step.query_one("SELECT agentloop_flush_notify()", &[]).await.unwrap().get(0);
    assert_eq!(flushed, 1);
    assert_eq!(tokio::time::timeout(Duration::from_secs(5), events.recv()).await.unwrap(), Some(expected.clone()));

    // 2. A step that rolls back leaves nothing pending.
    step.batch_execute("BEGIN").await.unwrap();
    step.query_one("SELECT agentloop_renotify(agentloop_defer($1))", &[&arg]).await.unwrap();
    step.batch_execute("ROLLBACK").await.unwrap();
    let flushed: i32 = step.query_one("SELECT agentloop_flush_notify()", &[]).await.unwrap().get(0);
    assert_eq!(flushed, 0, "a rolled-back step's notification was kept");
    tokio::time::sleep(Duration::from_millis(700)).await;
    quiet(&mut events);

    // 3. The workers' store: one call, one round trip, the notification arrives.
    let settings = PoolSettings {
        database_url: db.url.clone(),
        application_name: "deferred-test-store".into(),
        statement_timeout: Duration::from_secs(10),
        max_size: 1,
        wait_timeout: Duration::from_secs(5),
    };
    let store = Store::with_deferred_notifications(&settings, Timing { call_timeout: Duration::from_secs(5), retry_for: Duration::from_secs(5) }).unwrap();
    for _ in 0..3 {
        store.call("agentloop_renotify", &arg, Replay::Safe, None).await.unwrap();
        assert_eq!(tokio::time::timeout(Duration::from_secs(5), events.recv()).await.unwrap(), Some(expected.clone()));
    }
    let conn = store.conn().await.unwrap();
    let pending: Option<String> = conn.client().query_one("SELECT current_setting('agentloop.deferred', true)", &[]).await.unwrap().get(0);
    assert_eq!(pending.as_deref().unwrap_or(""), "", "the flush left notifications pending in the session");
    stop.cancel();
}

/// Makes the test database `db` read-only for new sessions (`on`) or writable again, then
/// terminates every session of it (the admin session is on another database), twice: pooled
/// connections reconnect and take the setting, and a session that was starting during the first
/// pass (it may have read the old setting) is caught by the second. Returns the sessions ended.
async fn set_read_only(admin: &tokio_postgres::Client, db: &str, on: bool) -> i64 {
    let setting = if on { "SET default_transaction_read_only = on" } else { "RESET default_transaction_read_only" };
    admin.batch_execute(&format!("ALTER DATABASE {db} {setting}")).await.unwrap();
    let mut ended = 0;
    for _ in 0..2 {
        let row = admin
            .query_one(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
                &[&db],
            )
            .await
            .unwrap();
        ended += row.get::<_, i64>(0);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    ended
}

/// SQLSTATE 25006 (`read_only_sql_transaction`): the database turns read-only for a while — a
/// failover to a standby not yet promoted, or an operator's `default_transaction_read_only` —
/// while one run waits for a slow answer, one streams, one checkpoints a chain of tool steps,
/// three turns on other threads are queued behind them (every worker slot busy) and one is
/// FIFO-pending behind the slow run. Injected for real: `ALTER DATABASE … SET
/// default_transaction_read_only = on` and every session of the test database terminated (the
/// api's and worker's pools reconnect read-only), held for 9 s — longer than the lease (3 s)
/// and the step retry window, so a step commit is retried until its deadline and the slices in
/// flight lose their leases — then reset, and every session terminated again. While read-only,
/// reads still answer and a new turn is refused with a clean 503 `database_unavailable` (25006
/// is transient, not a 500) and stored nowhere. Once writable, that turn retried with its
/// idempotency key is accepted, the slow answer that arrived meanwhile is written (held, not
/// paid again), the interrupted runs are handed back and taken again without a recovery or a
/// fault, and every accepted run completes with its answer exactly once: no turn lost, no run
/// failed, no tool step repeated.
#[tokio::test]
async fn durable_a_read_only_database_pauses_runs_and_fails_none() {
    let options = StackOptions {
        workers: 1,
        worker_env: env(&[("WORKER_LEASE_MS", "3000"), ("WORKER_RENEW_MS", "1000"), ("WORKER_CONCURRENCY", "3")]),
        ..Default::default()
    };
    let mut stack = Stack::start("durable_read_only", options).await.unwrap();
    let c = stack.client();
    let (admin, conn) = tokio_postgres::connect(&agentloop_tests::admin_url(), tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);

    // (thread, run, the answer it must end with)
    let mut turns: Vec<(String, String, String)> = Vec::new();
    let slow = c.create_thread().await.unwrap();
    let a = id(&c.chat(&slow, &script(json!([{"text": "slow answer", "delayMs": 5000}]))).await.unwrap()["run"]);
    turns.push((slow.clone(), a.clone(), "slow answer".into()));
    let streamed = c.create_thread().await.unwrap();
    let long = (0..150).map(|i| format!("s{i}")).collect::<Vec<_>>().join(" ");
    let b = id(&c.chat(&streamed, &script(json!([{"text": long, "chunkDelayMs": 100}]))).await.unwrap()["run"]);
    turns.push((streamed.clone(), b.clone(), long.clone()));
    // A chain of tool steps: a checkpoint every ~0.4 s, so a step commit meets the read-only
    // database, is retried while the lease lasts, and the slice then tries to hand the run back.
    let chained = c.create_thread().await.unwrap();
    let mut steps: Vec<Value> =
        (0..12).map(|i| json!({"toolCalls": [{"name": "calculator", "arguments": {"expression": format!("{i}+1")}}], "delayMs": 400})).collect();
    steps.push(json!({"text": "chain: {{tool_results}}"}));
    let chain = id(&c.chat(&chained, &script(Value::Array(steps))).await.unwrap()["run"]);
    let chain_answer = format!("chain: {}", (1..=12).map(|n| n.to_string()).collect::<Vec<_>>().join(", "));
    turns.push((chained.clone(), chain.clone(), chain_answer));
    c.wait_run(&a, T, |r| r["status"] == "running").await.unwrap();
    c.wait_run(&chain, T, |r| r["status"] == "running").await.unwrap();
    let deadline = Instant::now() + T;
    loop {
        let w = c.get(&format!("/api/threads/{streamed}")).await.unwrap().body;
        if !w["streamingMessage"]["content"].as_str().unwrap_or_default().is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "nothing streamed: {w}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for i in 0..3 {
        let thread = c.create_thread().await.unwrap();
        let text = format!("queued answer {i}");
        let run = id(&c.chat(&thread, &script(json!([{"text": text}]))).await.unwrap()["run"]);
        turns.push((thread, run, text));
    }
    let pending = c
        .post(&format!("/api/threads/{slow}/chat"), json!({"content": script(json!([{"text": "pending answer"}])), "multitask": "enqueue"}))
        .await
        .unwrap();
    assert_eq!((pending.status, pending.body["run"]["status"].as_str()), (202, Some("pending")), "{pending:?}");
    turns.push((slow.clone(), id(&pending.body["run"]), "pending answer".into()));
    let refused = c.create_thread().await.unwrap();
    let mut before = Vec::new();
    for (_, run, _) in &turns {
        before.push(c.get(&format!("/api/runs/{run}")).await.unwrap().body["status"].as_str().unwrap_or("?").to_owned());
    }

    // The key's last use is due to be recorded (once a minute): a read while read-only must
    // still answer (it was a 500 for every bearer request once the minute had passed).
    stack.db.client().await.unwrap().batch_execute("UPDATE api_keys SET last_used_at = now() - interval '1 hour'").await.unwrap();
    // Read-only, for longer than the lease.
    let started = Instant::now();
    let ended = set_read_only(&admin, &stack.db.name, true).await;
    eprintln!("read-only from now: {ended} sessions ended; run statuses {before:?}");
    let probe = stack.db.client().await.unwrap();
    let err = probe.batch_execute("CREATE TABLE read_only_probe (x int)").await.unwrap_err();
    assert_eq!(err.code(), Some(&tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION), "{err}");
    drop(probe);
    // Reads still answer (a broken pooled connection may cost one 503 first).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = c.get(&format!("/api/runs/{a}")).await.unwrap();
        if r.status == 200 {
            assert!(r.body["status"] != "failed", "{r:?}");
            break;
        }
        assert!(r.status == 503 && Instant::now() < deadline, "a read while read-only: {r:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Readiness says so: a load balancer and the UI see a database that takes no writes.
    // (A pooled connection the termination broke may answer `database_unavailable` first.)
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let ready = c.get("/readyz").await.unwrap();
        let code = ready.body["error"]["code"].as_str().map(str::to_owned);
        if code.as_deref() == Some("database_read_only") {
            break;
        }
        assert!(code.as_deref() == Some("database_unavailable") && Instant::now() < deadline, "/readyz while read-only: {ready:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A new turn: a clean 503 `database_unavailable` within the api's retry window, not a hang
    // and not a 500.
    let turn = json!({"content": script(json!([{"text": "refused, then accepted"}]))});
    let path = format!("/api/threads/{refused}/chat");
    let sent = Instant::now();
    let r = c.send(reqwest::Method::POST, &path, Some(turn.clone()), &[("Idempotency-Key", "read-only-turn")]).await.unwrap();
    let took = sent.elapsed();
    eprintln!("POST /chat while read-only: {} in {took:?}: {}", r.status, r.body);
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (503, Some("database_unavailable")), "{r:?}");
    // 5xx bodies are generic: the server's error text goes to the log, not to the client.
    let message = r.body["error"]["message"].as_str().unwrap_or_default();
    assert!(!message.contains("25006") && !message.contains("read-only transaction"), "the 503 leaks the SQL error: {message}");
    assert!(took < Duration::from_secs(15), "the refusal took {took:?}");
    let hold = Duration::from_secs(9);
    if let Some(rest) = hold.checked_sub(started.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    let mut during = Vec::new();
    for (_, run, _) in &turns {
        during.push(c.get(&format!("/api/runs/{run}")).await.unwrap().body["status"].as_str().unwrap_or("?").to_owned());
    }
    set_read_only(&admin, &stack.db.name, false).await;
    let read_only_for = started.elapsed();
    eprintln!("writable again after {read_only_for:?}; run statuses at the end of it {during:?}");

    // Writable again: ready again (a pooled session may still be the read-only one's, at most
    // once per connection), and the refused turn, retried with its key, is accepted once.
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.get("/readyz").await.unwrap().status != 200 {
        assert!(Instant::now() < deadline, "/readyz still not ready once writable");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, body) = post_retrying(&c, &path, turn, "read-only-turn").await;
    assert_eq!(status, 202, "{body}");
    turns.push((refused.clone(), id(&body["run"]), "refused, then accepted".into()));
    let mut failed = Vec::new();
    for (_, run, _) in &turns {
        let end = c.wait_terminal(run, T).await.unwrap();
        if end["status"] != "completed" {
            failed.push(format!("{run}: {} {}", end["status"], end["error"]));
        }
    }
    let db = stack.db.client().await.unwrap();
    let not_completed: Vec<String> = db
        .query("SELECT format('%s %s %s: %s', id, status, error_code, error_message) FROM runs WHERE status <> 'completed'", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(failed.is_empty() && not_completed.is_empty(), "runs that did not complete: {failed:#?} {not_completed:#?}");
    let runs: i64 = db.query_one("SELECT count(*) FROM runs", &[]).await.unwrap().get(0);
    assert_eq!(runs, turns.len() as i64, "one run per accepted turn (the refused attempt stored nothing)");
    // The slices in flight could not confirm their leases (the fault was felt): the slow
    // answer that arrived meanwhile was held and written once writable, the others were handed
    // back by their live worker — none recovered like a crashed worker's, none charged a fault.
    for run in [&a, &b, &chain] {
        let end = c.get(&format!("/api/runs/{run}")).await.unwrap().body;
        eprintln!("run {run}: attempts {} recoveries {} faults {}", end["attempts"], end["recoveries"], end["faults"]);
        assert_eq!((end["recoveries"].as_i64(), end["faults"].as_i64()), (Some(0), Some(0)), "an outage is no crash and not the run's fault: {end}");
    }
    let log = std::fs::read_to_string(agentloop_tests::log_dir("durable_read_only").join("worker-0.log")).unwrap();
    assert!(log.contains("holding the paid answer"), "the slow answer arrived while read-only and was held");
    assert!(log.contains("watchdog: lease not confirmed"), "the slices outlived their leases");
    // Every thread holds each accepted turn's answer exactly once, in order, none stopped.
    let mut threads: Vec<&String> = turns.iter().map(|(t, ..)| t).collect();
    threads.sort();
    threads.dedup();
    for thread in threads {
        let expected: Vec<&str> = turns.iter().filter(|(t, ..)| t == thread).map(|(.., text)| text.as_str()).collect();
        let messages = all_messages(&c, thread).await;
        let answers: Vec<&str> = messages
            .iter()
            .filter(|m| m["role"] == "assistant" && m["toolCalls"].as_array().is_none_or(Vec::is_empty))
            .map(|m| m["content"].as_str().unwrap_or(""))
            .collect();
        let users = messages.iter().filter(|m| m["role"] == "user").count();
        assert_eq!(answers, expected, "thread {thread}");
        assert_eq!(users, expected.len(), "thread {thread}: one user message per accepted turn");
        let tools = messages.iter().filter(|m| m["role"] == "tool").count();
        assert_eq!(tools, if *thread == chained { 12 } else { 0 }, "thread {thread}: each tool step once");
        assert!(messages.iter().all(|m| m["stopped"] != true), "thread {thread}: {messages:?}");
    }
    for p in std::iter::once(&mut stack.api).chain(stack.workers.iter_mut()) {
        assert!(p.child.try_wait().unwrap().is_none(), "{} exited", p.name);
    }
    eprintln!("all {} runs completed {:?} after the database became writable", turns.len(), started.elapsed() - read_only_for);
}
