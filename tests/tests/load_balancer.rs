//! Scale-out (issue 13): two api processes behind a real HAProxy (`deploy/haproxy/agentloop.cfg`,
//! unchanged) and three workers on one PostgreSQL. Clients talk only to the load balancer;
//! processes get real signals.
//!
//! - `an_sse_stream_resumes_on_the_other_api_when_its_api_is_killed`: a client posts and streams
//!   SSE through the LB; the api holding the stream is SIGKILLed mid-run; the client reconnects
//!   through the LB with `Last-Event-ID`, lands on the other api, and ends with every journal
//!   event of the thread exactly once.
//! - `a_rolling_restart_under_load_loses_no_turn_and_duplicates_no_answer`: SIGTERM one process
//!   at a time — both apis, then the three workers — each replaced and healthy before the next,
//!   under a steady load of chat posts: every accepted turn is answered exactly once and the
//!   load sees no error (the LB retried what it could; the counts are printed).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentloop_tests::cluster::{Cluster, ClusterOptions, haproxy_binary};
use agentloop_tests::{Sig, script};
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

/// Without HAProxy the tests cannot run: fail under CI (where .ci/run installs it), else skip.
fn require_haproxy() -> bool {
    if haproxy_binary().is_some() {
        return true;
    }
    assert!(std::env::var("CI").is_err(), "haproxy is required under CI (.ci/run installs Debian's haproxy)");
    eprintln!("skipped: haproxy is not installed (apt-get install haproxy)");
    false
}

/// Every journal sequence of `thread`, in order.
async fn journal(cluster: &Cluster, thread: &str) -> Vec<i64> {
    let db = cluster.db.client().await.unwrap();
    let id = uuid::Uuid::parse_str(thread).unwrap();
    db.query("SELECT sequence FROM thread_events WHERE thread_id = $1 ORDER BY sequence", &[&id])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_sse_stream_resumes_on_the_other_api_when_its_api_is_killed() {
    if !require_haproxy() {
        return;
    }
    let mut cluster = Cluster::start(
        "an_sse_stream_resumes_on_the_other_api_when_its_api_is_killed",
        ClusterOptions { apis: 2, workers: 3, ..ClusterOptions::default() },
    )
    .await
    .unwrap();
    let client = cluster.client();
    let thread = client.create_thread().await.unwrap();
    // A 4-second streamed answer: 40 words, 100 ms apart.
    let words: Vec<String> = (0..40).map(|i| format!("w{i}")).collect();
    let answer = words.join(" ");
    let posted = client.chat(&thread, &script(json!([{"text": answer, "chunkDelayMs": 100}]))).await.unwrap();
    let run = posted["run"]["id"].as_str().unwrap().to_owned();

    let http = reqwest::Client::new();
    let mut received: Vec<i64> = Vec::new();
    let mut last_id: Option<String> = None;
    let mut killed: Option<usize> = None;
    let mut connections = 0;
    let deadline = Instant::now() + T;
    'outer: loop {
        assert!(Instant::now() < deadline, "the run did not complete over SSE; received {received:?}");
        let mut req = http.get(format!("{}/api/threads/{thread}/updates/stream?afterSequence=0", cluster.lb_url)).bearer_auth(&cluster.key);
        if let Some(id) = &last_id {
            req = req.header("Last-Event-ID", id);
        }
        let resp = match req.send().await {
            Ok(r) if r.status() == 200 => r,
            Ok(r) => panic!("the LB answered {} to the SSE reconnect", r.status()),
            Err(e) => panic!("the LB refused the SSE connection: {e}"),
        };
        connections += 1;
        let mut events = resp.bytes_stream().eventsource();
        while let Some(event) = events.next().await {
            let Ok(event) = event else { break }; // the stream was cut: reconnect
            assert_ne!(event.event, "reset", "no reset expected: {}", event.data);
            // `connected` and `heartbeat` are not journal events (an SSE parser carries the last
            // id over to them); the connect-time `thread` snapshot comes before any id.
            if event.event != "connected" && event.event != "heartbeat"
                && let Ok(id) = event.id.parse::<i64>()
            {
                received.push(id);
                last_id = Some(event.id.clone());
            }
            if killed.is_none() && event.event == "streaming" && received.len() >= 8 {
                // Which api holds this stream: the one whose SSE gauge counts it.
                let mut holder = None;
                for i in 0..2 {
                    if cluster.api_metric(i, "agentloop_live_clients", &["transport=\"sse\""]).await.unwrap() >= 1.0 {
                        holder = Some(i);
                    }
                }
                let holder = holder.expect("one api counts the SSE client");
                cluster.signal_api(holder, Sig::SIGKILL, Duration::from_secs(5)).unwrap();
                killed = Some(holder);
            }
            if event.event == "run" {
                let payload: Value = serde_json::from_str(&event.data).unwrap();
                if payload["id"] == run.as_str() && payload["status"] == "completed" {
                    break 'outer;
                }
            }
        }
    }
    let killed = killed.expect("the api holding the stream was killed mid-run");
    assert!(connections >= 2, "the client reconnected after the kill");
    // The surviving api served the resumed stream.
    let other = 1 - killed;
    assert!(cluster.api_metric(other, "agentloop_live_clients", &["transport=\"sse\""]).await.unwrap() <= 1.0);
    let mut sorted = received.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), received.len(), "an event arrived twice: {received:?}");
    assert_eq!(received, sorted, "events arrived out of order: {received:?}");
    let stored = journal(&cluster, &thread).await;
    assert_eq!(received, stored, "the client's events equal the journal, each exactly once");
    let done = client.wait_terminal(&run, T).await.unwrap();
    assert_eq!(done["status"], "completed");
    let window = client.get(&format!("/api/threads/{thread}")).await.unwrap();
    let answers: Vec<&Value> =
        window.body["messages"].as_array().map(|m| m.iter().filter(|m| m["role"] == "assistant").collect()).unwrap_or_default();
    assert_eq!(answers.len(), 1, "one answer: {}", window.body);
    println!("SSE failover: {} events over {connections} connections; api {killed} SIGKILLed mid-stream", received.len());
}

/// One accepted turn of the load.
struct Accepted {
    thread: String,
    run: String,
    answer: String,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rolling_restart_under_load_loses_no_turn_and_duplicates_no_answer() {
    if !require_haproxy() {
        return;
    }
    let mut cluster = Cluster::start(
        "a_rolling_restart_under_load_loses_no_turn_and_duplicates_no_answer",
        ClusterOptions {
            apis: 2,
            workers: 3,
            // The drain must outlast HAProxy's detection (1 s checks, 2 failures).
            api_env: env(&[("API_SHUTDOWN_DRAIN_MS", "3000")]),
            worker_env: env(&[("WORKER_SHUTDOWN_GRACE_MS", "5000")]),
        },
    )
    .await
    .unwrap();
    let client = cluster.client();
    // 12 threads with the durable FIFO policy: the load posts steadily without 409s.
    let mut threads = Vec::new();
    for _ in 0..12 {
        let id = client.create_thread().await.unwrap();
        let r = client.send(reqwest::Method::PATCH, &format!("/api/threads/{id}"), Some(json!({"metadata": {"multitask": "enqueue"}})), &[]).await.unwrap();
        assert_eq!(r.status, 200, "{:?}", r.body);
        threads.push(id);
    }

    // The load: each thread gets a post every second (12/s in all), each with an
    // Idempotency-Key, never retried by the client (a failure is counted as one); each answer
    // streams for ~0.25 s.
    let stop = Arc::new(AtomicBool::new(false));
    let accepted: Arc<Mutex<Vec<Accepted>>> = Arc::default();
    let errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut load = Vec::new();
    for (n, thread) in threads.iter().enumerate() {
        let (client, thread, stop, accepted, errors) = (client.clone(), thread.clone(), stop.clone(), accepted.clone(), errors.clone());
        load.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(80 * n as u64)).await;
            let mut tick = tokio::time::interval(Duration::from_millis(1000));
            while !stop.load(Ordering::SeqCst) {
                tick.tick().await;
                let answer = format!("answer {} a b c", uuid::Uuid::new_v4().simple());
                let key = uuid::Uuid::new_v4().to_string();
                let body = json!({"content": script(json!([{"text": answer, "chunkDelayMs": 50}]))});
                match client.send(reqwest::Method::POST, &format!("/api/threads/{thread}/chat"), Some(body), &[("Idempotency-Key", &key)]).await {
                    Ok(r) if r.status == 202 => accepted.lock().unwrap().push(Accepted {
                        thread: thread.clone(),
                        run: r.body["run"]["id"].as_str().unwrap().to_owned(),
                        answer,
                    }),
                    Ok(r) => errors.lock().unwrap().push(format!("{} {}", r.status, r.body)),
                    Err(e) => errors.lock().unwrap().push(format!("transport: {e:#}")),
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Rolling restart: each api, then each worker; the next only once the last is healthy.
    let started = Instant::now();
    for i in 0..2 {
        cluster.signal_api(i, Sig::SIGTERM, Duration::from_secs(15)).unwrap();
        cluster.start_api(i).unwrap();
        cluster.wait_lb_up(i, T).await.unwrap();
    }
    for i in 0..3 {
        cluster.stop_worker(i, Duration::from_secs(15)).unwrap();
        cluster.start_worker(i).unwrap();
        cluster.wait_worker_ready(i, T).await.unwrap();
    }
    let restart = started.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::SeqCst);
    for task in load {
        task.await.unwrap();
    }

    // Every accepted turn ends completed with exactly its answer, once.
    let accepted = std::mem::take(&mut *accepted.lock().unwrap());
    let errors = errors.lock().unwrap().clone();
    let db = cluster.db.client().await.unwrap();
    let deadline = Instant::now() + T;
    loop {
        let open: i64 = db
            .query_one("SELECT count(*) FROM runs WHERE status NOT IN ('completed', 'failed', 'cancelled')", &[])
            .await
            .unwrap()
            .get(0);
        if open == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{open} runs still open");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut statuses: BTreeMap<String, i64> = BTreeMap::new();
    for row in db.query("SELECT status, count(*) FROM runs GROUP BY status", &[]).await.unwrap() {
        statuses.insert(row.get(0), row.get(1));
    }
    let answers: HashMap<String, i64> = db
        .query("SELECT content #>> '{}', count(*) FROM messages WHERE role = 'assistant' GROUP BY 1", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
        .collect();
    let mut lost = Vec::new();
    let mut duplicated = Vec::new();
    for turn in &accepted {
        match answers.get(&turn.answer).copied().unwrap_or(0) {
            0 => lost.push(format!("{} (run {}, thread {})", turn.answer, turn.run, turn.thread)),
            1 => {}
            n => duplicated.push(format!("{} x{n}", turn.answer)),
        }
    }
    let handed_back: i64 = db.query_one("SELECT count(*) FROM runs WHERE attempts > 1", &[]).await.unwrap().get(0);
    let stats = cluster.lb_stats().await.unwrap();
    let backend = stats.iter().find(|r| r["pxname"] == "agentloop_api" && r["svname"] == "BACKEND").unwrap();
    println!(
        "rolling restart of 2 apis + 3 workers in {:.1} s under load: {} turns accepted, {} load errors, \
         {} lost, {} duplicated; runs {:?}; {} runs handed back and resumed by another worker; \
         LB retries {}, redispatches {}, 5xx {}",
        restart.as_secs_f64(),
        accepted.len(),
        errors.len(),
        lost.len(),
        duplicated.len(),
        statuses,
        handed_back,
        backend["wretr"],
        backend["wredis"],
        backend["hrsp_5xx"],
    );
    assert!(accepted.len() >= 50, "the load ran: {} turns accepted", accepted.len());
    assert!(errors.is_empty(), "the load saw errors the LB could not retry: {errors:?}");
    assert!(lost.is_empty(), "accepted turns without an answer: {lost:?}");
    assert!(duplicated.is_empty(), "answers committed twice: {duplicated:?}");
    assert_eq!(statuses.keys().cloned().collect::<Vec<_>>(), vec!["completed".to_owned()], "every run completed: {statuses:?}");
    assert_eq!(statuses["completed"], accepted.len() as i64, "a run per accepted turn, none more");
}
