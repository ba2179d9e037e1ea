//! Durable scheduler under faults (issue 3): FIFO turns, cancellation, interrupt, pauses past
//! the lease, lost listener connections. Real processes, real signals, real PostgreSQL.

use std::time::{Duration, Instant};

use agentloop_tests::{Sig, Stack, StackOptions, script};
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(30);

fn ts(v: &Value) -> chrono::DateTime<chrono::Utc> {
    v.as_str().unwrap().parse().unwrap()
}

#[tokio::test]
async fn enqueue_runs_in_fifo_order_and_threads_run_concurrently() {
    let stack = Stack::start("fifo", StackOptions { worker_env: vec![("WORKER_CONCURRENCY".into(), "4".into())], ..Default::default() })
        .await
        .unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let mut runs = Vec::new();
    for i in 0..4 {
        let body = json!({"content": script(json!([{"text": format!("answer {i}"), "delayMs": 300}])), "multitask": "enqueue"});
        let r = c.post(&format!("/api/threads/{thread}/chat"), body).await.unwrap();
        assert_eq!(r.status, 202, "{r:?}");
        assert_eq!(r.body["run"]["status"], if i == 0 { "queued" } else { "pending" });
        runs.push(r.body["run"]["id"].as_str().unwrap().to_owned());
    }
    // Another thread is not held up by the first one's queue.
    let other = c.create_thread().await.unwrap();
    let other_run = c.chat(&other, &script(json!([{"text": "independent", "delayMs": 300}]))).await.unwrap();
    let other_run = c.wait_terminal(other_run["run"]["id"].as_str().unwrap(), T).await.unwrap();
    let mut finished = Vec::new();
    for run in &runs {
        let run = c.wait_terminal(run, T).await.unwrap();
        assert_eq!(run["status"], "completed", "{run}");
        finished.push((ts(&run["startedAt"]), ts(&run["finishedAt"])));
    }
    for w in finished.windows(2) {
        assert!(w[1].0 >= w[0].1, "run started before the previous one finished: {finished:?}");
    }
    assert!(ts(&other_run["finishedAt"]) < finished[3].0, "the other thread ran concurrently");
    let window = c.get(&format!("/api/threads/{thread}")).await.unwrap().body;
    let texts: Vec<String> = window["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "assistant")
        .map(|m| m["content"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(texts, ["answer 0", "answer 1", "answer 2", "answer 3"]);
}

#[tokio::test]
async fn cancel_queued_and_running_runs() {
    let mut stack = Stack::start("cancel", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    // Queued (no worker yet): cancelled at once.
    let queued = c.chat(&thread, "never runs").await.unwrap();
    let id = queued["run"]["id"].as_str().unwrap();
    let r = c.post(&format!("/api/runs/{id}/cancel"), json!({})).await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.body["status"], "cancelled");
    let again = c.post(&format!("/api/runs/{id}/cancel"), json!({})).await.unwrap();
    assert_eq!((again.status, &again.body["status"]), (200, &json!("cancelled")), "repeated cancel is idempotent");

    // Running: the owning worker aborts the model stream at once.
    stack.add_worker(&[]).unwrap();
    let running = c.chat(&thread, &script(json!([{"text": "too slow", "delayMs": 20000}]))).await.unwrap();
    let id = running["run"]["id"].as_str().unwrap();
    c.wait_run(id, T, |r| r["status"] == "running" && r["contextTokens"].is_i64()).await.unwrap();
    let asked = Instant::now();
    let r = c.post(&format!("/api/threads/{thread}/cancel"), json!({})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    let run = c.wait_terminal(id, Duration::from_secs(5)).await.unwrap();
    assert_eq!(run["status"], "cancelled");
    assert!(asked.elapsed() < Duration::from_secs(3), "cancel took {:?}", asked.elapsed());
    assert_eq!(run["steps"][0]["status"], "cancelled");
    let window = c.get(&format!("/api/threads/{thread}")).await.unwrap().body;
    assert_eq!(window["messageCount"], 2, "only the two user messages");
    assert_eq!(window["streamingMessage"], Value::Null);
    // The thread is usable again.
    let next = c.chat(&thread, &script(json!([{"text": "after cancel"}]))).await.unwrap();
    assert_eq!(c.wait_terminal(next["run"]["id"].as_str().unwrap(), T).await.unwrap()["status"], "completed");
}

#[tokio::test]
async fn interrupt_cancels_the_active_run_and_starts_the_new_one() {
    let stack = Stack::start("interrupt", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "sleep", "arguments": {"seconds": 20}}]}, {"text": "slept"}]);
    let first = c.chat(&thread, &script(steps)).await.unwrap();
    let first_id = first["run"]["id"].as_str().unwrap();
    c.wait_run(first_id, T, |r| r["status"] == "running" && r["contextTokens"].is_i64()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await; // inside the sleep tool
    let body = json!({"content": script(json!([{"text": "interrupting answer"}])), "multitask": "interrupt"});
    let second = c.post(&format!("/api/threads/{thread}/chat"), body).await.unwrap();
    assert_eq!(second.status, 202, "{second:?}");
    assert_eq!(second.body["run"]["status"], "pending");
    let first = c.wait_terminal(first_id, Duration::from_secs(5)).await.unwrap();
    assert_eq!(first["status"], "cancelled");
    let second = c.wait_terminal(second.body["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(second["status"], "completed");
    // The history is valid for every provider: each tool call is followed by its result.
    let msgs = c.get(&format!("/api/threads/{thread}")).await.unwrap().body["messages"].as_array().unwrap().clone();
    for (i, m) in msgs.iter().enumerate() {
        if let Some(calls) = m["toolCalls"].as_array() {
            for (j, call) in calls.iter().enumerate() {
                assert_eq!(msgs[i + 1 + j]["toolCallId"], call["id"], "{msgs:?}");
            }
        }
    }
    assert_eq!(msgs.last().unwrap()["content"], "interrupting answer");
}

/// The newest interrupt wins (migration 000025): an interrupt cancels the active run and every
/// turn waiting behind it, so of a queued turn and six interrupts sent at once while a run
/// streams, exactly one interrupt runs — one paid answer, not one per turn in turn.
#[tokio::test]
async fn concurrent_interrupts_leave_one_turn_to_answer() {
    let stack = Stack::start("interrupt_newest", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let first = c.chat(&thread, &script(json!([{"text": "a b c d e f g h i j", "chunkDelayMs": 500}]))).await.unwrap();
    let first_id = first["run"]["id"].as_str().unwrap().to_owned();
    c.wait_run(&first_id, T, |r| r["status"] == "running").await.unwrap();
    let path = format!("/api/threads/{thread}/chat");
    let queued = c.post(&path, json!({"content": script(json!([{"text": "queued answer"}])), "multitask": "enqueue"})).await.unwrap();
    assert_eq!(queued.status, 202, "{queued:?}");
    let interrupts = futures_util::future::join_all((0..6).map(|i| {
        c.post(&path, json!({"content": script(json!([{"text": format!("interrupt answer {i}"), "delayMs": 200}])), "multitask": "interrupt"}))
    }))
    .await;
    let mut runs = vec![queued.body["run"]["id"].as_str().unwrap().to_owned()];
    for r in interrupts {
        let r = r.unwrap();
        assert_eq!(r.status, 202, "{r:?}");
        runs.push(r.body["run"]["id"].as_str().unwrap().to_owned());
    }
    assert_eq!(c.wait_terminal(&first_id, T).await.unwrap()["status"], "cancelled");
    let mut completed = Vec::new();
    for run in &runs {
        let done = c.wait_terminal(run, T).await.unwrap();
        match done["status"].as_str() {
            Some("completed") => completed.push(run.clone()),
            Some("cancelled") => {}
            other => panic!("run {run} ended {other:?}: {done}"),
        }
    }
    assert_eq!(completed.len(), 1, "one turn answers: {completed:?}");
    assert_ne!(completed[0], runs[0], "the queued turn was superseded");
    // One paid answer, the last message. (A turn already promoted into the transcript when a
    // later interrupt cancelled it keeps its user message, as an interrupted run does.)
    let msgs = c.get(&format!("/api/threads/{thread}")).await.unwrap().body["messages"].as_array().unwrap().clone();
    let answers: Vec<&Value> = msgs.iter().filter(|m| m["role"] == "assistant" && m["stopped"] != true).collect();
    assert_eq!(answers.len(), 1, "{msgs:#?}");
    assert_eq!(msgs.last().unwrap(), answers[0]);
    assert!(answers[0]["content"].as_str().unwrap().starts_with("interrupt answer"), "{}", answers[0]);
}

#[tokio::test]
async fn a_worker_paused_past_its_lease_writes_nothing_after_resuming() {
    let lease = vec![("WORKER_LEASE_MS".into(), "3000".into()), ("WORKER_RENEW_MS".into(), "1000".into())];
    let mut stack = Stack::start("sigstop", StackOptions { workers: 1, worker_env: lease, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    // The stream starts at once and keeps going for ~6 s, so the paused worker resumes mid-stream.
    let words: Vec<String> = (0..60).map(|i| format!("w{i}")).collect();
    let posted = c.chat(&thread, &script(json!([{"text": words.join(" "), "chunkDelayMs": 300}]))).await.unwrap();
    let run_id = posted["run"]["id"].as_str().unwrap().to_owned();
    let running = c.wait_run(&run_id, T, |r| r["status"] == "running" && r["contextTokens"].is_i64()).await.unwrap();
    let paused_owner = running["leaseOwner"].as_str().unwrap().to_owned();
    tokio::time::sleep(Duration::from_millis(700)).await;
    stack.workers[0].signal(Sig::SIGSTOP);
    stack.add_worker(&[]).unwrap();
    let done = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(done["status"], "completed");
    assert_eq!(done["recoveries"], 1);
    let db = stack.db.client().await.unwrap();
    let before = snapshot(&db).await;
    stack.workers[0].signal(Sig::SIGCONT);
    tokio::time::sleep(Duration::from_millis(2500)).await; // > 2 renew periods
    let after = snapshot(&db).await;
    assert_eq!(before, after, "the resumed worker changed a row or a column");
    let stale: i64 = db
        .query_one("SELECT count(*) FROM run_steps WHERE worker_id = $1", &[&paused_owner])
        .await
        .unwrap()
        .get(0);
    assert_eq!(stale, 0, "the step belongs to the worker that finished the run");
    assert_eq!(before.2, 2, "user message + one answer");
}

/// Every row the slice could touch, as text.
async fn snapshot(db: &tokio_postgres::Client) -> (String, String, i64, String, i64) {
    let run = db.query_one("SELECT row_to_json(r)::text FROM runs r", &[]).await.unwrap().get::<_, String>(0);
    let thread = db.query_one("SELECT row_to_json(t)::text FROM threads t", &[]).await.unwrap().get::<_, String>(0);
    let msgs: i64 = db.query_one("SELECT count(*) FROM messages", &[]).await.unwrap().get(0);
    let steps = db.query_one("SELECT json_agg(s)::text FROM run_steps s", &[]).await.unwrap().get::<_, String>(0);
    let events: i64 = db.query_one("SELECT count(*) FROM thread_events", &[]).await.unwrap().get(0);
    (run, thread, msgs, steps, events)
}

async fn listener_pid(db: &tokio_postgres::Client, app: &str) -> Option<i32> {
    db.query_opt("SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND datname = current_database()", &[&app])
        .await
        .unwrap()
        .map(|r| r.get(0))
}

async fn wait_listener(db: &tokio_postgres::Client, app: &str, not: Option<i32>) -> i32 {
    let deadline = Instant::now() + T;
    loop {
        if let Some(pid) = listener_pid(db, app).await.filter(|p| Some(*p) != not) {
            return pid;
        }
        assert!(Instant::now() < deadline, "no {app} connection");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn terminated_listeners_reconnect_and_nothing_is_lost() {
    let stack = Stack::start("listener", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let db = stack.db.client().await.unwrap();
    let thread = c.create_thread().await.unwrap();

    // Worker listener: the next enqueue still starts within 1 s.
    let pid = wait_listener(&db, "agentloop-worker-listener", None).await;
    db.execute("SELECT pg_terminate_backend($1)", &[&pid]).await.unwrap();
    wait_listener(&db, "agentloop-worker-listener", Some(pid)).await;
    let posted = c.chat(&thread, &script(json!([{"text": "woke up"}]))).await.unwrap();
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), T).await.unwrap();
    let latency = ts(&run["startedAt"]) - ts(&run["createdAt"]);
    assert!(latency < chrono::Duration::seconds(1), "enqueue to start took {latency}");

    // Api listener: an SSE client misses no event across the reconnect.
    let resp = reqwest::Client::new()
        .get(format!("{}/api/threads/{thread}/updates/stream", stack.api_url))
        .bearer_auth(&stack.key)
        .send()
        .await
        .unwrap();
    let mut events = resp.bytes_stream().eventsource();
    let connected = events.next().await.unwrap().unwrap();
    assert_eq!(connected.event, "connected");
    let start: i64 = serde_json::from_str::<Value>(&connected.data).unwrap()["sequence"].as_i64().unwrap();
    let pid = wait_listener(&db, "agentloop-api-listener", None).await;
    db.execute("SELECT pg_terminate_backend($1)", &[&pid]).await.unwrap();
    let posted = c.chat(&thread, &script(json!([{"text": "after the api listener died"}]))).await.unwrap();
    let run_id = posted["run"]["id"].as_str().unwrap().to_owned();
    let mut ids = Vec::new();
    loop {
        let ev = tokio::time::timeout(T, events.next()).await.expect("SSE stalled").unwrap().unwrap();
        if let Ok(id) = ev.id.parse::<i64>() {
            ids.push(id);
        }
        let data: Value = serde_json::from_str(&ev.data).unwrap();
        if ev.event == "run" && data["id"] == run_id.as_str() && data["status"] == "completed" {
            break;
        }
    }
    let expected: Vec<i64> = (start + 1..=*ids.last().unwrap()).collect();
    assert_eq!(ids, expected, "no event lost or duplicated");
    wait_listener(&db, "agentloop-api-listener", Some(pid)).await;
}

#[tokio::test]
async fn model_errors_are_retried_a_bounded_number_of_times() {
    // MODEL_RETRY_MS=0: only the client's own retries (the slice's are tested below).
    let options = StackOptions { worker_env: vec![("MODEL_RETRY_MS".into(), "0".into())], ..Default::default() };
    let stack = Stack::start("model_errors", options).await.unwrap();
    let c = stack.client();
    // A transient 503 is retried and the run completes.
    let thread = c.create_thread().await.unwrap();
    let posted = c.chat(&thread, &script(json!([{"status": 503, "failTimes": 1, "text": "recovered"}]))).await.unwrap();
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    // A persistent 500 fails the run with a clear error after bounded retries (1 + 3 requests).
    let thread = c.create_thread().await.unwrap();
    let text = script(json!([{"status": 500}]));
    let posted = c.chat(&thread, &text).await.unwrap();
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), Duration::from_secs(60)).await.unwrap();
    assert_eq!(run["status"], "failed");
    assert_eq!(run["error"]["code"], "model_unavailable");
    let sent = stack.mock.requests().await.unwrap();
    let attempts = sent.iter().filter(|r| r.to_string().contains(&text[..40])).count();
    assert_eq!(attempts, 4);
    // A 400 is not retried.
    let thread = c.create_thread().await.unwrap();
    let text = script(json!([{"status": 400}]));
    let posted = c.chat(&thread, &text).await.unwrap();
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(run["error"]["code"], "model_http_error");
    let sent = stack.mock.requests().await.unwrap();
    assert_eq!(sent.iter().filter(|r| r.to_string().contains(&text[..40])).count(), 1);
}

#[tokio::test]
async fn a_run_recovered_too_often_fails_abandoned() {
    let lease = vec![
        ("WORKER_LEASE_MS".into(), "1500".into()),
        ("WORKER_RENEW_MS".into(), "500".into()),
        ("WORKER_MAX_RECOVERIES".into(), "1".into()),
    ];
    let mut stack = Stack::start("abandoned", StackOptions { workers: 1, worker_env: lease, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let posted = c.chat(&thread, &script(json!([{"text": "never", "delayMs": 30000}]))).await.unwrap();
    let run_id = posted["run"]["id"].as_str().unwrap().to_owned();
    for round in 0..2 {
        c.wait_run(&run_id, T, |r| r["status"] == "running" && r["recoveries"] == round && r["contextTokens"].is_i64())
            .await
            .unwrap();
        let last = stack.workers.len() - 1;
        stack.workers[last].signal(Sig::SIGKILL);
        stack.workers[last].wait_exit(Duration::from_secs(5));
        stack.add_worker(&[]).unwrap();
    }
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "failed");
    assert_eq!(run["error"]["code"], "abandoned");
    assert_eq!(run["recoveries"], 2);
}

#[tokio::test]
async fn maintenance_prunes_old_receipts_and_trims_journals() {
    let env = vec![("MAINTENANCE_INTERVAL_MS".into(), "300".into()), ("JOURNAL_RETENTION_EVENTS".into(), "3".into())];
    let stack = Stack::start("maintenance", StackOptions { worker_env: env, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let r = c
        .send(reqwest::Method::POST, &format!("/api/threads/{thread}/chat"), Some(json!({"content": script(json!([{"text": "x"}]))})), &[("Idempotency-Key", "fresh")])
        .await
        .unwrap();
    c.wait_terminal(r.body["run"]["id"].as_str().unwrap(), T).await.unwrap();
    let db = stack.db.client().await.unwrap();
    db.batch_execute(
        "INSERT INTO command_receipts (principal_id, command_id, fingerprint, created_at)
         SELECT id, 'ancient', 'f', now() - interval '25 hours' FROM principals LIMIT 1",
    )
    .await
    .unwrap();
    let deadline = Instant::now() + T;
    loop {
        let receipts: Vec<String> = db.query("SELECT command_id FROM command_receipts ORDER BY 1", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
        let events: i64 = db.query_one("SELECT count(*) FROM thread_events", &[]).await.unwrap().get(0);
        if receipts == ["fresh"] && events <= 3 {
            break;
        }
        assert!(Instant::now() < deadline, "not pruned: {receipts:?}, {events} events");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A client resuming below the retained range is told to reset.
    let r = c.get(&format!("/api/threads/{thread}/updates?afterSequence=1&timeoutMs=0")).await.unwrap();
    assert_eq!(r.body["reset"], true, "{r:?}");
}

#[tokio::test]
async fn thread_policy_from_metadata_and_delete_cancels_runs() {
    let stack = Stack::start("thread_patch_delete", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let r = c
        .send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), Some(json!({"title": "renamed", "metadata": {"multitask": "enqueue"}})), &[])
        .await
        .unwrap();
    assert_eq!((r.status, r.body["title"].as_str()), (200, Some("renamed")), "{r:?}");
    let r = c.send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), Some(json!({"metadata": [1]})), &[]).await.unwrap();
    assert_eq!(r.body["error"]["code"], "invalid_metadata");
    // The thread's policy now queues a second message instead of rejecting it.
    let running = c.chat(&thread, &script(json!([{"text": "slow", "delayMs": 20000}]))).await.unwrap();
    let queued = c.chat(&thread, "behind it").await.unwrap();
    assert_eq!(queued["run"]["status"], "pending");
    let running_id = running["run"]["id"].as_str().unwrap();
    c.wait_run(running_id, T, |r| r["status"] == "running").await.unwrap();
    let r = c.send(reqwest::Method::DELETE, &format!("/api/threads/{thread}"), None, &[]).await.unwrap();
    assert_eq!(r.status, 204, "{r:?}");
    assert_eq!(c.get(&format!("/api/threads/{thread}")).await.unwrap().status, 404);
    let db = stack.db.client().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let statuses: Vec<String> = db.query("SELECT status FROM runs ORDER BY seq", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
        if statuses == ["cancelled", "cancelled"] {
            break;
        }
        assert!(Instant::now() < deadline, "{statuses:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(c.get("/api/threads").await.unwrap().body["threads"].as_array().unwrap().is_empty());
    let deleted: i64 = db.query_one("SELECT count(*) FROM thread_events WHERE kind = 'thread_deleted'", &[]).await.unwrap().get(0);
    assert_eq!(deleted, 1, "open live clients are told through the journal");
}

#[tokio::test]
async fn the_claim_is_an_index_scan_however_many_terminal_runs_exist() {
    let db = agentloop_tests::TestDb::create().await.unwrap();
    let client = db.client().await.unwrap();
    client
        .batch_execute(
            "INSERT INTO principals (id, name) VALUES ('00000000-0000-0000-0000-000000000001', 'p');
             INSERT INTO threads (id, owner_id) SELECT gen_random_uuid(), '00000000-0000-0000-0000-000000000001' FROM generate_series(1, 200);
             INSERT INTO runs (id, thread_id, principal_id, status, model, finished_at)
               SELECT gen_random_uuid(), t.id, t.owner_id, 'completed', 'm', now()
               FROM threads t, generate_series(1, 250);
             ANALYZE runs;",
        )
        .await
        .unwrap();
    let plan: Value = client
        .query_one(
            "EXPLAIN (FORMAT JSON) SELECT id FROM runs
             WHERE status IN ('queued', 'running') AND (status = 'queued' OR lease_expires_at < now())
             ORDER BY seq LIMIT 8 FOR UPDATE SKIP LOCKED",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let text = plan.to_string();
    assert!(text.contains("runs_claimable"), "the claim does not use the partial index: {text}");
    assert!(!text.contains("Seq Scan"), "{text}");
}

#[tokio::test]
async fn idle_workers_do_not_poll_the_queue() {
    let stack = Stack::start("idle", StackOptions { workers: 2, ..Default::default() }).await.unwrap();
    let db = stack.db.client().await.unwrap();
    let scans = || async {
        db.batch_execute("SELECT pg_stat_clear_snapshot()").await.unwrap();
        // The queue and the webhook outbox: idle workers poll neither (the webhook dispatcher
        // once claimed every 20 ms when nothing was pending: GREATEST(NULL, 0) is 0).
        db.query_one(
            "SELECT sum(seq_scan + coalesce(idx_scan, 0))::bigint FROM pg_stat_user_tables WHERE relname IN ('runs', 'webhook_deliveries')",
            &[],
        )
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    // PostgreSQL flushes a backend's table statistics at most once a second, and for a backend
    // that then goes idle up to 10 s later (pgstat.c, PGSTAT_IDLE_INTERVAL): the start-up claim
    // passes may show up seconds after they ran (a loaded CI machine saw 9 of them land inside a
    // 4 s window). So the test looks for one quiet window of 12 s — longer than that delay —
    // within 60 s; workers polling the queue more often than every 12 s never give one.
    const QUIET: Duration = Duration::from_secs(12);
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut since, mut count) = (Instant::now(), scans().await);
    let mut changes = Vec::new();
    while since.elapsed() < QUIET {
        assert!(Instant::now() < deadline, "idle workers kept touching the runs or webhook_deliveries table: {changes:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = scans().await;
        if now != count {
            changes.push(now - count);
            (since, count) = (Instant::now(), now);
        }
    }
    // ... and still wake at once when work arrives.
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let posted = c.chat(&thread, &script(json!([{"text": "awake"}]))).await.unwrap();
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert!(ts(&run["startedAt"]) - ts(&run["createdAt"]) < chrono::Duration::seconds(1));
}

#[tokio::test]
async fn a_queued_run_skipped_while_locked_is_claimed_once_the_lock_is_gone() {
    let mut stack = Stack::start("skip_locked", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let posted = c.chat(&thread, &script(json!([{"text": "eventually"}]))).await.unwrap();
    // Another transaction (like an api command) holds the queued run's row lock while the
    // worker's claim pass runs, so SKIP LOCKED passes over it and no notification follows.
    let db = stack.db.client().await.unwrap();
    db.batch_execute("BEGIN; SELECT id FROM runs FOR UPDATE").await.unwrap();
    stack.add_worker(&[]).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    db.batch_execute("COMMIT").await.unwrap();
    let released = Instant::now();
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), Duration::from_secs(30)).await.unwrap();
    assert_eq!(run["status"], "completed");
    // Without the 100 ms retry the run would wait for the safety poll (60 s). 10 s, not less:
    // on a loaded 2-core CI machine the whole run took 3.7 s once.
    assert!(released.elapsed() < Duration::from_secs(10), "completed {:?} after the lock was released", released.elapsed());
}

/// Issue 9 latency: an idle worker's claim starts the slice of a fresh run in its own
/// transaction (migration 000020), and the slice uses that start instead of starting again (one
/// `running` run event, one step row); with `WORKER_CLAIM_STARTS=0` the slice starts itself.
#[tokio::test]
async fn an_idle_workers_claim_starts_the_slice_of_a_fresh_run() {
    for (test, starts) in [("claim_starts_on", "16"), ("claim_starts_off", "0")] {
        let stack = Stack::start(test, StackOptions { worker_env: vec![("WORKER_CLAIM_STARTS".into(), starts.into())], ..Default::default() })
            .await
            .unwrap();
        let c = stack.client();
        let thread = c.create_thread().await.unwrap();
        let db = stack.db.client().await.unwrap();
        // Idle: the worker listens, and its start-up claim pass is long over.
        wait_listener(&db, "agentloop-worker-listener", None).await;
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let run = c.chat(&thread, "hello").await.unwrap();
        let run_id = run["run"]["id"].as_str().unwrap().to_owned();
        let run = c.wait_terminal(&run_id, T).await.unwrap();
        assert_eq!(run["status"], "completed", "{run}");
        let steps: i64 = db.query_one("SELECT count(*) FROM run_steps WHERE run_id = $1::text::uuid", &[&run_id]).await.unwrap().get(0);
        assert_eq!(steps, 1);
        let running: i64 = db
            .query_one(
                "SELECT count(*) FROM thread_events WHERE thread_id = $1::text::uuid AND kind = 'run' AND payload ->> 'status' = 'running'",
                &[&thread],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(running, 1, "the run was started once ({starts})");
        let raw = std::fs::read_to_string(agentloop_tests::log_dir(test).join("worker-0.log")).unwrap();
        // Without the terminal colours (ESC [ ... m).
        let mut log = String::with_capacity(raw.len());
        let mut rest = raw.as_str();
        while let Some(at) = rest.find('\u{1b}') {
            log.push_str(&rest[..at]);
            rest = &rest[at..];
            rest = rest.find('m').map_or("", |end| &rest[end + 1..]);
        }
        log.push_str(rest);
        let claimed = log.lines().find(|l| l.contains("claimed") && l.contains(&run_id)).unwrap_or_else(|| panic!("no claim line in\n{log}"));
        let expected = if starts == "0" { "started=false" } else { "started=true" };
        assert!(claimed.contains(expected), "{claimed}");
    }
}

/// A run its worker owns but no longer executes — its slice ended and the hand-back could not
/// be written (a database outage longer than the store's retry window) — is claimable once its
/// lease expires, and the claim's timer (`nextExpiryMs`) says when, so the worker claims it
/// then (migration 000023). The timer used to count other owners' leases only, and with no
/// other event such a run waited for the safety poll (60 s). Runs the caller executes (in
/// flight, or claimed by this very pass) are not counted: their leases are renewed.
#[tokio::test]
async fn the_claim_timer_counts_the_callers_own_runs_it_no_longer_executes() {
    use agentloop_shared::store::{PoolSettings, Replay, Store, Timing};
    let stack = Stack::start("own_expiry", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let run = c.chat(&thread, "hello").await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    let store = Store::new(
        &PoolSettings { database_url: stack.db.url.clone(), application_name: "test".into(), statement_timeout: Duration::from_secs(10), max_size: 2, wait_timeout: Duration::from_secs(5) },
        Timing { call_timeout: Duration::from_secs(10), retry_for: Duration::from_secs(5) },
    )
    .unwrap();
    let claim = |inflight: Value| json!({"owner": "w-own", "limit": 4, "leaseMs": 3000, "inflight": inflight, "adopt": false});
    let first = store.call("agentloop_claim", &claim(json!([])), Replay::Safe, None).await.unwrap();
    assert_eq!(first["runs"][0]["id"], run.as_str(), "{first}");
    assert!(first["nextExpiryMs"].is_null(), "a run claimed by this pass is in flight: {first}");
    let busy = store.call("agentloop_claim", &claim(json!([run])), Replay::Safe, None).await.unwrap();
    assert_eq!(busy["runs"], json!([]), "{busy}");
    assert!(busy["nextExpiryMs"].is_null(), "the worker renews what it executes: {busy}");
    // The slice ended without handing the run back.
    let idle = store.call("agentloop_claim", &claim(json!([])), Replay::Safe, None).await.unwrap();
    assert_eq!(idle["runs"], json!([]), "the lease is live: {idle}");
    let ms = idle["nextExpiryMs"].as_i64().unwrap_or_else(|| panic!("no timer for the worker's own idle run: {idle}"));
    assert!((0..=3000).contains(&ms), "{idle}");
    tokio::time::sleep(Duration::from_millis(ms as u64 + 100)).await;
    // Expired, but still executed by the caller (a slice holding a paid answer through an
    // outage outlives its lease): never claimed by its own worker (migration 000026).
    let held = store.call("agentloop_claim", &claim(json!([run])), Replay::Safe, None).await.unwrap();
    assert_eq!(held["runs"], json!([]), "a worker does not recover the run it still executes: {held}");
    let again = store.call("agentloop_claim", &claim(json!([])), Replay::Safe, None).await.unwrap();
    assert_eq!(again["runs"][0]["id"], run.as_str(), "claimed back once its lease expired: {again}");
    assert_eq!(again["runs"][0]["recoveries"], 1);

    // Released (its slice could not write its end): taken back at once with a NEW fencing token
    // even by a pass that also adopts (a statement of the old slice may still land), no
    // recovery, and a fault only when the release says so.
    let epoch = again["runs"][0]["leaseEpoch"].as_i64().unwrap();
    let faults = again["runs"][0]["faults"].as_i64().unwrap();
    let release = |epoch: i64, fault: bool, adopt: bool| {
        json!({"owner": "w-own", "limit": 4, "leaseMs": 3000, "inflight": [], "adopt": adopt,
               "released": [{"runId": run, "epoch": epoch, "fault": fault}]})
    };
    let stale = store.call("agentloop_claim", &release(epoch - 1, false, false), Replay::Safe, None).await.unwrap();
    assert_eq!(stale["runs"], json!([]), "a stale epoch is not taken: {stale}");
    let back = store.call("agentloop_claim", &release(epoch, false, true), Replay::Safe, None).await.unwrap();
    assert_eq!(back["runs"].as_array().unwrap().len(), 1, "{back}");
    assert_eq!(back["runs"][0]["leaseEpoch"], epoch + 1, "a new fencing token, not adopted: {back}");
    assert_eq!((back["runs"][0]["recoveries"].as_i64(), back["runs"][0]["faults"].as_i64()), (Some(1), Some(faults)));
    let faulted = store.call("agentloop_claim", &release(epoch + 1, true, false), Replay::Safe, None).await.unwrap();
    assert_eq!(faulted["runs"][0]["leaseEpoch"], epoch + 2, "{faulted}");
    assert_eq!(faulted["runs"][0]["faults"], faults + 1, "a faulting release counts: {faulted}");
    // Outages count too, ten to a fault (a run whose own statements crash the server still
    // ends): the outage release above was the first; the tenth adds one fault.
    let mut epoch = epoch + 2;
    let mut seen = Vec::new();
    for _ in 0..9 {
        let back = store.call("agentloop_claim", &release(epoch, false, false), Replay::Safe, None).await.unwrap();
        epoch = back["runs"][0]["leaseEpoch"].as_i64().unwrap_or_else(|| panic!("{back}"));
        seen.push(back["runs"][0]["faults"].as_i64().unwrap());
    }
    let before = faults + 1;
    assert_eq!(seen, [vec![before; 8], vec![before + 1]].concat(), "faults after each outage release");
}

/// A worker claims only runs of the models it serves: one whose catalog lacks the run's model
/// leaves it queued (it failed it `model_not_configured` before, while a worker that had the
/// model was idle or about to start — a rolling upgrade that adds a model; acceptance probe E),
/// and the run completes as soon as a worker with the model is there.
#[tokio::test]
async fn a_worker_claims_only_runs_of_the_models_it_serves() {
    let mut stack = Stack::start("claim_by_model", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    // A worker whose only model is `other` (the same mock behind it).
    stack.add_worker(&[("MODEL_NAME", "other")]).unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let run = c.chat(&thread, &script(json!([{"text": "answered by a worker that has mock"}]))).await.unwrap();
    let run_id = run["run"]["id"].as_str().unwrap().to_owned();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let r = c.get(&format!("/api/runs/{run_id}")).await.unwrap().body;
    assert_eq!((r["status"].as_str(), r["attempts"].as_i64()), (Some("queued"), Some(0)), "left to a worker that has the model: {r}");
    stack.add_worker(&[]).unwrap();
    let done = c.wait_terminal(&run_id, Duration::from_secs(30)).await.unwrap();
    assert_eq!((done["status"].as_str(), done["attempts"].as_i64()), (Some("completed"), Some(1)), "{done}");
}

/// Slots given back between steps (migration 000042; acceptance probe H, H-3): a principal whose
/// long agent loops hold every slot gives one back at a step boundary when another principal's
/// turn waits, and the loops still complete, their steps not consumed by it. Before, the other
/// principal waited for a whole slice (here 25 tool calls of 300 ms model turns, 7.5 s).
#[tokio::test]
async fn a_principal_whose_long_loops_hold_every_slot_gives_one_back_between_steps() {
    let mut stack = Stack::start("slot_yield", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let a = stack.client();
    let b = stack.client_for("tenant-b").unwrap();
    stack.add_worker(&[("WORKER_CONCURRENCY", "2"), ("WORKER_YIELD_CHECK_MS", "300")]).unwrap();
    let steps: Vec<Value> = (0..30)
        .map(|i| json!({"delayMs": 300, "toolCalls": [{"name": "calculator", "arguments": {"expression": format!("{i}+1")}}]}))
        .chain([json!({"text": "loop done"})])
        .collect();
    let mut a_runs = Vec::new();
    for _ in 0..2 {
        let thread = a.create_thread().await.unwrap();
        let run = a.chat(&thread, &script(json!(steps))).await.unwrap();
        a_runs.push(run["run"]["id"].as_str().unwrap().to_owned());
    }
    for run in &a_runs {
        a.wait_run(run, Duration::from_secs(20), |r| r["status"] == "running").await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let thread = b.create_thread().await.unwrap();
    let b_run = b.chat(&thread, &script(json!([{"text": "b"}]))).await.unwrap();
    let b_done = b.wait_terminal(b_run["run"]["id"].as_str().unwrap(), Duration::from_secs(60)).await.unwrap();
    assert_eq!(b_done["status"], "completed", "{b_done}");
    let waited = (ts(&b_done["startedAt"]) - ts(&b_done["createdAt"])).num_milliseconds() as f64 / 1000.0;
    assert!(waited < 3.0, "B's one-line turn waited {waited:.1} s for a slot held by A's loops");
    for run in &a_runs {
        let done = a.wait_terminal(run, Duration::from_secs(60)).await.unwrap();
        assert_eq!(done["status"], "completed", "{done}");
        assert_eq!(done["error"], Value::Null, "{done}");
    }
    let db = stack.db.client().await.unwrap();
    let rows = db
        .query("SELECT steps_used, faults, attempts FROM runs r WHERE principal_id = (SELECT principal_id FROM runs WHERE id = $1::text::uuid)", &[&a_runs[0]])
        .await
        .unwrap();
    // Two claims per loop (two slices), and one more for each slot given back.
    let claims: i32 = rows.iter().map(|r| r.get::<_, i32>(2)).sum();
    assert!(claims > 4, "no slot was given back: {claims} claims");
    for row in rows {
        // 31 model turns: two slices by the tool-call limit (25), however often the slot was given back.
        assert_eq!(row.get::<_, i32>(0), 2, "steps used");
        assert_eq!(row.get::<_, i32>(1), 0, "faults");
    }
}

/// A model that stays unavailable past the client's retries, or cuts its stream mid-answer,
/// does not fail the run while `MODEL_RETRY_MS` lasts: the slice calls it again after a pause,
/// and the answer is whole and once (before: `model_unavailable` after 4 requests, and
/// `model_stream_truncated` / `model_transport_error` at the first cut). A model that stays
/// down past the patience still fails the run with the error's code, and a cancel ends the wait.
#[tokio::test]
async fn a_model_outage_within_model_retry_ms_fails_nothing() {
    let options = StackOptions { worker_env: vec![("MODEL_RETRY_MS".into(), "12000".into())], ..Default::default() };
    let stack = Stack::start("model_outage", options).await.unwrap();
    let c = stack.client();
    // Six 503s: four requests of the first call, two of the second, then the answer.
    let thread = c.create_thread().await.unwrap();
    let posted = c.chat(&thread, &script(json!([{"status": 503, "failTimes": 6, "text": "recovered"}]))).await.unwrap();
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), Duration::from_secs(60)).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    // A stream cut mid-answer twice: the third call's answer, whole, once.
    let thread = c.create_thread().await.unwrap();
    let text = "one two three four five six seven eight nine ten eleven twelve";
    let posted = c.chat(&thread, &script(json!([{"text": text, "malformed": "truncate", "failTimes": 2, "chunkDelayMs": 20}]))).await.unwrap();
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), Duration::from_secs(60)).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let w = c.get(&format!("/api/threads/{thread}")).await.unwrap().body;
    let answers: Vec<&Value> = w["messages"].as_array().unwrap().iter().filter(|m| m["role"] == "assistant").collect();
    assert_eq!(answers.len(), 1, "{w}");
    assert_eq!(answers[0]["content"], text);
    assert_eq!(w["streamingMessage"], Value::Null);
    // Down for good: fails with the code once the patience is spent.
    let thread = c.create_thread().await.unwrap();
    let started = std::time::Instant::now();
    let posted = c.chat(&thread, &script(json!([{"status": 500}]))).await.unwrap();
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), Duration::from_secs(90)).await.unwrap();
    assert_eq!((run["status"].as_str(), run["error"]["code"].as_str()), (Some("failed"), Some("model_unavailable")), "{run}");
    assert!(started.elapsed() >= Duration::from_secs(10), "failed after {:?}, before MODEL_RETRY_MS", started.elapsed());
    // A cancel ends the wait at once.
    let thread = c.create_thread().await.unwrap();
    let posted = c.chat(&thread, &script(json!([{"status": 500}]))).await.unwrap();
    let run_id = posted["run"]["id"].as_str().unwrap().to_owned();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let cancelled = std::time::Instant::now();
    let r = c.post(&format!("/api/runs/{run_id}/cancel"), json!({})).await.unwrap();
    assert!(r.status < 300, "{r:?}");
    let run = c.wait_terminal(&run_id, Duration::from_secs(30)).await.unwrap();
    assert_eq!(run["status"], "cancelled", "{run}");
    assert!(cancelled.elapsed() < Duration::from_secs(5), "the cancel waited {:?}", cancelled.elapsed());
}

/// The tool-call limit is per step, across a hand-back: a step re-opened after its slice was
/// handed back (a shutdown here; a slot given back or a recovery alike) goes on counting from
/// the calls it made (verification probe L, L-1: with `maxSteps: 1`, a run handed back after
/// 8 calls made 30 and completed; one never handed back stops at 25).
#[tokio::test]
async fn the_tool_call_limit_holds_across_a_hand_back() {
    let mut stack = Stack::start("limit_across_handback", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let db = stack.db.client().await.unwrap();
    let steps: Vec<Value> = (0..30)
        .map(|i| json!({"delayMs": 150, "toolCalls": [{"name": "calculator", "arguments": {"expression": format!("{i}+1")}}]}))
        .chain([json!({"text": "done"})])
        .collect();
    let thread = c.create_thread().await.unwrap();
    let r = c.post(&format!("/api/threads/{thread}/chat"), json!({"content": script(json!(steps)), "maxSteps": 1})).await.unwrap();
    assert_eq!(r.status, 202, "{r:?}");
    let run_id = r.body["run"]["id"].as_str().unwrap().to_owned();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let used: i32 = db.query_one("SELECT tool_calls_used FROM runs WHERE id = $1::text::uuid", &[&run_id]).await.unwrap().get(0);
        if used >= 8 {
            break;
        }
        assert!(Instant::now() < deadline, "the run made {used} tool calls");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stack.workers[0].signal(Sig::SIGTERM);
    assert!(stack.workers[0].wait_exit(Duration::from_secs(20)), "the worker stopped");
    stack.add_worker(&[]).unwrap();
    let run = c.wait_terminal(&run_id, Duration::from_secs(60)).await.unwrap();
    assert_eq!((run["status"].as_str(), run["error"]["code"].as_str()), (Some("failed"), Some("budget_exhausted")), "{run}");
    let used: i32 = db.query_one("SELECT tool_calls_used FROM runs WHERE id = $1::text::uuid", &[&run_id]).await.unwrap().get(0);
    assert!(used <= 26, "{used} tool calls in a step of at most 25");
}

/// Fair claims (migration 000034): a principal with a queue of slow runs does not hold every
/// worker slot while another principal's turn waits. Before, runs were claimed oldest first
/// whoever sent them, and B's one turn waited for all six of A's (acceptance probe E).
#[tokio::test]
async fn a_principal_with_many_queued_runs_does_not_hold_every_slot() {
    let mut stack = Stack::start("fair_claims", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let a = stack.client();
    let b = stack.client_for("tenant-b").unwrap();
    let mut a_runs = Vec::new();
    for i in 0..6 {
        let thread = a.create_thread().await.unwrap();
        let run = a.chat(&thread, &script(json!([{"text": format!("a{i}"), "delayMs": 1500}]))).await.unwrap();
        a_runs.push(run["run"]["id"].as_str().unwrap().to_owned());
    }
    let thread = b.create_thread().await.unwrap();
    let b_run = b.chat(&thread, &script(json!([{"text": "b", "delayMs": 1500}]))).await.unwrap();
    let b_run = b_run["run"]["id"].as_str().unwrap().to_owned();
    // Everything is queued before the only worker, with two slots, starts.
    stack.add_worker(&[("WORKER_CONCURRENCY", "2")]).unwrap();
    let b_done = b.wait_terminal(&b_run, Duration::from_secs(60)).await.unwrap();
    assert_eq!(b_done["status"], "completed", "{b_done}");
    let mut a_done = Vec::new();
    for run in &a_runs {
        let run = a.wait_terminal(run, Duration::from_secs(60)).await.unwrap();
        assert_eq!(run["status"], "completed", "{run}");
        a_done.push((ts(&run["startedAt"]), ts(&run["finishedAt"])));
    }
    let first_a_finish = a_done.iter().map(|r| r.1).min().unwrap();
    assert!(
        ts(&b_done["startedAt"]) < first_a_finish,
        "B's turn started {} but A's first run finished {first_a_finish}: B waited behind A's queue ({a_done:?})",
        b_done["startedAt"]
    );
    // Within one principal, still oldest first: A's oldest run took the other slot.
    assert!(a_done[0].0 < first_a_finish, "A's oldest run did not start first: {a_done:?}");
}
