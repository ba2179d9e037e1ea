//! Operations (issue 13): retention keeps every table bounded, in bounded batches, without
//! touching live data; plans do not depend on fresh statistics; the queue and retention figures
//! reach the workers' metrics.

use std::time::{Duration, Instant};

use agentloop_tests::cluster::sum_metric;
use agentloop_tests::{Stack, StackOptions, free_port, script};
use serde_json::json;
use uuid::Uuid;

const T: Duration = Duration::from_secs(30);

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

async fn count(db: &tokio_postgres::Client, sql: &str, id: &Uuid) -> i64 {
    db.query_one(sql, &[id]).await.unwrap().get(0)
}

/// Retention with every horizon at its minimum: a thread's journal is cut to its newest
/// `JOURNAL_RETENTION_EVENTS` (a resume below it gets `reset`), the steps of ended runs go (the
/// run and its messages stay), expired receipts go, and a soft-deleted thread is removed with
/// everything under it — while a live run's thread keeps its data. The worker's metrics show
/// the queue figures and the rows each task deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retention_bounds_every_table_and_spares_live_data() {
    let metrics_port = free_port();
    let options = StackOptions {
        workers: 1,
        worker_env: env(&[
            ("MAINTENANCE_INTERVAL_MS", "700"),
            ("JOURNAL_RETENTION_EVENTS", "5"),
            ("RUN_STEP_RETENTION_HOURS", "0"),
            ("DELETED_THREAD_RETENTION_HOURS", "0"),
            ("WORKER_METRICS_LISTEN", &format!("127.0.0.1:{metrics_port}")),
        ]),
        ..Default::default()
    };
    let stack = Stack::start("retention_bounds_every_table", options).await.unwrap();
    let c = stack.client();
    let db = stack.db.client().await.unwrap();

    // A thread with three answered turns (each turn journals several events).
    let kept = c.create_thread().await.unwrap();
    let mut runs = Vec::new();
    for i in 0..3 {
        let r = c
            .send(reqwest::Method::POST, &format!("/api/threads/{kept}/chat"), Some(json!({"content": format!("turn {i}")})), &[("Idempotency-Key", &format!("k-{i}"))])
            .await
            .unwrap();
        assert_eq!(r.status, 202, "{:?}", r.body);
        let run = r.body["run"]["id"].as_str().unwrap().to_owned();
        assert_eq!(c.wait_terminal(&run, T).await.unwrap()["status"], "completed");
        runs.push(run);
    }
    // A thread deleted by its owner, with a finished run under it.
    let gone = c.create_thread().await.unwrap();
    let run = c.chat(&gone, "hello").await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    c.wait_terminal(&run, T).await.unwrap();
    assert_eq!(c.send(reqwest::Method::DELETE, &format!("/api/threads/{gone}"), None, &[]).await.unwrap().status, 204);
    // A live run: its thread's steps must stay.
    let live = c.create_thread().await.unwrap();
    let slow = c.chat(&live, &script(json!([{"text": "slow", "delayMs": 25000}]))).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    c.wait_run(&slow, T, |r| r["status"] == "running").await.unwrap();
    // Receipts older than the 24 h minimum.
    db.execute("UPDATE command_receipts SET created_at = now() - interval '25 hours'", &[]).await.unwrap();

    let kept_id = Uuid::parse_str(&kept).unwrap();
    let gone_id = Uuid::parse_str(&gone).unwrap();
    let live_run = Uuid::parse_str(&slow).unwrap();
    let journaled = count(&db, "SELECT last_event_sequence FROM threads WHERE id = $1", &kept_id).await;
    assert!(journaled > 10, "the thread journaled more than 10 events ({journaled})");
    let deadline = Instant::now() + T;
    loop {
        let events = count(&db, "SELECT count(*) FROM thread_events WHERE thread_id = $1", &kept_id).await;
        let steps = count(&db, "SELECT count(*) FROM run_steps s JOIN runs r ON r.id = s.run_id WHERE r.thread_id = $1", &kept_id).await;
        let threads = count(&db, "SELECT count(*) FROM threads WHERE id = $1", &gone_id).await;
        let receipts: i64 = db.query_one("SELECT count(*) FROM command_receipts", &[]).await.unwrap().get(0);
        if events == 5 && steps == 0 && threads == 0 && receipts == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "retention did not converge: events {events}, steps {steps}, deleted thread rows {threads}, receipts {receipts}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // What stays: the runs, their messages, the live run's step, every child of the purged thread gone.
    assert_eq!(count(&db, "SELECT count(*) FROM runs WHERE thread_id = $1", &kept_id).await, 3);
    assert_eq!(count(&db, "SELECT count(*) FROM messages WHERE thread_id = $1 AND role = 'assistant'", &kept_id).await, 3);
    assert_eq!(count(&db, "SELECT count(*) FROM run_steps WHERE run_id = $1", &live_run).await, 1, "a live run keeps its step");
    for table in ["messages", "runs", "thread_events", "tool_approvals", "operations", "context_snapshots"] {
        let n = count(&db, &format!("SELECT count(*) FROM {table} WHERE thread_id = $1"), &gone_id).await;
        assert_eq!(n, 0, "{table} rows of the purged thread");
    }
    // The window still works, and a resume below the retained journal gets `reset`.
    let window = c.get(&format!("/api/threads/{kept}")).await.unwrap();
    assert_eq!(window.status, 200);
    let r = c.get(&format!("/api/threads/{kept}/updates?afterSequence=1&timeoutMs=0")).await.unwrap();
    assert_eq!(r.body["reset"], true, "{:?}", r.body);
    let run = c.get(&format!("/api/runs/{}", runs[0])).await.unwrap();
    assert_eq!(run.body["status"], "completed");

    // Progress is recorded; the worker's metrics carry the queue and retention figures.
    let passes: i64 = db.query_one("SELECT count(*) FROM agentloop_maintenance WHERE last_pass_finished_at IS NOT NULL", &[]).await.unwrap().get(0);
    assert_eq!(passes, 4, "every task finished a pass");
    // The queue figures are sampled every 15 s: the live run shows as running within 25 s.
    let deadline = Instant::now() + Duration::from_secs(25);
    loop {
        let text = reqwest::get(format!("http://127.0.0.1:{metrics_port}/metrics")).await.unwrap().text().await.unwrap();
        let running = sum_metric(&text, "agentloop_runs", &["status=\"running\""]);
        let journal = sum_metric(&text, "agentloop_maintenance_rows_deleted_total", &["task=\"journal\""]);
        let tokens = sum_metric(&text, "agentloop_model_tokens_total", &["model=\"mock\""]);
        let listener = sum_metric(&text, "agentloop_listener_connected", &[]);
        if running >= 1.0 && journal >= 1.0 && text.contains("agentloop_notification_queue_usage_ratio") && listener == 1.0 {
            assert!(tokens >= 0.0);
            assert!(text.contains("agentloop_claim_duration_seconds_bucket"), "claim latency is a histogram");
            // What the worker runs with, for AgentloopWorkersDisagree: its tools' fingerprint
            // and its models.
            let info = text.lines().find(|l| l.starts_with("agentloop_worker_config_info{")).unwrap_or_else(|| panic!("no config info:\n{text}"));
            assert!(info.contains("models=\"mock\"") && info.contains("tools=\"") && info.ends_with(" 1"), "{info}");
            // Counters the alert rules use exist before they first move (probe J).
            for zero in ["agentloop_lease_lost_total 0", "agentloop_lease_renew_failures_total 0", "agentloop_slices_total{end=\"failed\"} 0"] {
                assert!(text.lines().any(|l| l == zero), "no `{zero}` in:\n{text}");
            }
            break;
        }
        assert!(Instant::now() < deadline, "worker metrics missing figures:\n{text}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// No query is JIT-compiled (`agentloop_shared::db::PLANNER_SETTINGS`): with sequential scans
/// priced out, a query that must still scan (the MCP sign-in sweep over `mcp_authorizations`)
/// costs 10^10, far above `jit_above_cost`; PostgreSQL then JIT-compiled it on every execution
/// (~450 ms of CPU for an empty table), and on a loaded machine those sweeps outlived their call
/// timeout, piled up and starved the slices. Both kinds of pool — the store's (workers' steps,
/// api commands) and the diesel pools (api reads, maintenance) — run with `jit = off`.
#[tokio::test]
async fn no_query_is_jit_compiled() {
    use agentloop_shared::store::{PoolSettings, Store, Timing};
    use diesel_async::SimpleAsyncConnection;

    let db = agentloop_tests::TestDb::create().await.unwrap();
    let settings = PoolSettings {
        database_url: db.url.clone(),
        application_name: "jit-test".into(),
        statement_timeout: Duration::from_secs(30),
        max_size: 1,
        wait_timeout: Duration::from_secs(5),
    };
    let store = Store::new(&settings, Timing { call_timeout: Duration::from_secs(10), retry_for: Duration::from_secs(10) }).unwrap();
    let conn = store.conn().await.unwrap();
    let plan: serde_json::Value = conn
        .client()
        .query_one("EXPLAIN (ANALYZE, FORMAT JSON) SELECT min(expires_at) FROM mcp_authorizations WHERE status = 'pending'", &[])
        .await
        .unwrap()
        .get(0);
    assert!(plan.to_string().contains("Seq Scan"), "the query still scans (no index serves it): {plan}");
    assert!(plan[0].get("JIT").is_none(), "the store's connections JIT-compile: {plan}");
    drop(conn);
    let swept = store.call("agentloop_mcp_sweep", &serde_json::json!({"stuckMs": 60000, "limit": 100}), agentloop_shared::store::Replay::Safe, None).await.unwrap();
    assert_eq!(swept["ended"], 0, "{swept}");

    let pool = agentloop_shared::db::build_pool(&db.url, 1, "jit-test", Duration::from_secs(30)).unwrap();
    let mut c = pool.get().await.unwrap();
    c.batch_execute(
        "DO $$ BEGIN
           IF current_setting('jit') <> 'off' OR current_setting('enable_seqscan') <> 'off' THEN
             RAISE EXCEPTION 'the diesel pool runs without the planner settings';
           END IF;
         END $$",
    )
    .await
    .unwrap();
}

/// The workers' step statements are planned once per session (migration 000021). The plan cache
/// re-plans a statement with parameters on every execution when its generic plan looks costlier
/// than its custom plans, and the claim (`LIMIT v_n`), the slice start's answer (a `CASE` on a
/// variable) and the journal positions of agentloop_notify (`= ANY($1)`) were in that state, as
/// was the search text of every message (a SQL function with a subquery is planned on every
/// call). `log_planner_stats` reports every planning, nested ones included, as a LOG message: a
/// session running the worker's claim (with a start) and commit, with the production planner
/// settings, must report none once warm.
#[tokio::test]
async fn step_functions_are_planned_once_per_session() {
    use futures_util::StreamExt;
    let db = agentloop_tests::TestDb::create().await.unwrap();
    let admin = db.client().await.unwrap();
    let runs = 16;
    let principal = Uuid::parse_str("00000000-0000-0000-0000-0000000000aa").unwrap();
    admin.execute("INSERT INTO principals (id, name) VALUES ($1, 'planner')", &[&principal]).await.unwrap();
    admin.execute(agentloop_tests::ENQUEUE_SQL, &[&principal, &(runs as i32), &"hi"]).await.unwrap();

    let (client, mut conn) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls).await.unwrap();
    let (tx, mut logs) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(Ok(m)) = messages.next().await {
            if let tokio_postgres::AsyncMessage::Notice(n) = m {
                let _ = tx.send(n.message().to_owned());
            }
        }
    });
    for (name, value) in agentloop_shared::db::PLANNER_SETTINGS {
        client.batch_execute(&format!("SET {name} = {value}")).await.unwrap();
    }
    client.batch_execute("SET client_min_messages = log; SET log_planner_stats = on").await.unwrap();
    // The statements as the workers send them: prepared once, arguments wrapped in agentloop_defer.
    let claim = client.prepare("SELECT agentloop_claim(agentloop_defer($1::text::jsonb))::text").await.unwrap();
    let commit = client.prepare("SELECT agentloop_commit(agentloop_defer($1::text::jsonb))::text").await.unwrap();
    let flush = client.prepare("SELECT agentloop_flush_notify()").await.unwrap();
    let mut planned = Vec::new();
    for i in 0..runs {
        while logs.try_recv().is_ok() {}
        let p = json!({"owner": "w-plans", "limit": 1, "leaseMs": 60000, "inflight": [], "adopt": false,
                       "start": {"limit": 1, "models": {"mock": {"model": "mock", "toolTokens": 0, "contextLimit": 100000}}}});
        let claimed: serde_json::Value = serde_json::from_str(&client.query_one(&claim, &[&p.to_string()]).await.unwrap().get::<_, String>(0)).unwrap();
        client.query_one(&flush, &[]).await.unwrap();
        let run = &claimed["runs"][0];
        let run_id = run["id"].as_str().unwrap().to_owned();
        let started = &claimed["starts"][&run_id];
        assert!(started["step"]["id"].is_i64(), "the claim started the run: {claimed}");
        let p = json!({"commitId": format!("c{i}"), "runId": run_id, "threadId": run["threadId"], "owner": "w-plans",
                       "epoch": run["leaseEpoch"], "leaseMs": 60000, "stepId": started["step"]["id"],
                       "messages": [{"role": "assistant", "content": "hello there", "tokenEstimate": 2, "byteSize": 13}],
                       "usage": {"modelCalls": 1}, "end": {"status": "completed"}});
        let committed: serde_json::Value = serde_json::from_str(&client.query_one(&commit, &[&p.to_string()]).await.unwrap().get::<_, String>(0)).unwrap();
        assert_eq!(committed["status"], "completed", "{committed}");
        client.query_one(&flush, &[]).await.unwrap();
        // A round trip, so every LOG message of the cycle has arrived.
        client.batch_execute("SELECT 1").await.unwrap();
        let mut n = 0;
        while let Ok(m) = logs.try_recv() {
            n += usize::from(m.contains("PLANNER STATISTICS"));
        }
        planned.push(n);
    }
    println!("plannings per claim + commit cycle: {planned:?}");
    assert!(planned[0] > 0, "log_planner_stats reports nothing: the test cannot see planning");
    // The last cycles: the simple `SELECT 1` above is planned each time, nothing else.
    assert!(planned[runs - 4..].iter().all(|n| *n <= 1), "statements re-planned on every run: {planned:?}");
}

/// A statement whose caller gave up stops, and the caller knows it did not commit: a store call
/// that times out cancels its statement and waits for the answer (`CANCEL_GRACE`), so the
/// outcome is a definite "not committed" (57014, retried until the deadline, then
/// `Unavailable`), not "unknown" — a 12 MB import whose encoding and sending took part of the
/// api's 12 s while PostgreSQL's 10 s had not run out answered "may or may not have taken
/// effect". Before the cancel, the server stopped such a statement only once it noticed the
/// dropped connection (`agentloop_shared::db::CLIENT_CHECK_MS`), instead of running it on to
/// `statement_timeout` — calls retried against a slow server used to pile up there.
#[tokio::test]
async fn a_statement_whose_caller_gave_up_stops() {
    use agentloop_shared::store::{PoolSettings, Replay, Store, StoreError, Timing};

    let db = agentloop_tests::TestDb::create().await.unwrap();
    let admin = db.client().await.unwrap();
    admin
        .batch_execute("CREATE FUNCTION test_slow_step(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT pg_sleep(20); SELECT p $$")
        .await
        .unwrap();
    let settings = PoolSettings {
        database_url: db.url.clone(),
        application_name: "gave-up-test".into(),
        statement_timeout: Duration::from_secs(60),
        max_size: 1,
        wait_timeout: Duration::from_secs(5),
    };
    let store = Store::new(&settings, Timing { call_timeout: Duration::from_millis(500), retry_for: Duration::from_millis(400) }).unwrap();
    let called = Instant::now();
    let err = store.call("test_slow_step", &json!({}), Replay::Unsafe, None).await.unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "a cancelled statement is a known outcome: {err:?}");
    assert!(called.elapsed() < Duration::from_secs(3), "answered {:?} after the call", called.elapsed());
    let gave_up = Instant::now();
    loop {
        let running: i64 = admin
            .query_one("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'gave-up-test' AND state = 'active'", &[])
            .await
            .unwrap()
            .get(0);
        if running == 0 {
            break;
        }
        assert!(gave_up.elapsed() < Duration::from_secs(10), "the abandoned statement still runs {:?} after its caller gave up", gave_up.elapsed());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("the abandoned statement stopped {:?} after its caller gave up", gave_up.elapsed());
}

/// Plans do not depend on fresh statistics (issue 13): the tables are analysed while empty —
/// what a fresh install keeps when autovacuum is off — so the planner believes `runs` and
/// `threads` hold nothing. A session's cached plans then froze on sequential scans (the
/// active-run check of `POST /chat` scanned every run row). With the api's and workers'
/// planner settings (`agentloop_shared::db::PLANNER_SETTINGS`) 120 chats, each on its own
/// thread and answered, cost (almost) no sequential scan of `runs` or `threads`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plans_hold_with_stale_statistics() {
    let mut stack = Stack::start("plans_hold_with_stale_statistics", StackOptions { workers: 1, ..Default::default() }).await.unwrap();
    let db = stack.db.client().await.unwrap();
    db.batch_execute("ANALYZE").await.unwrap();
    let scans = |db: tokio_postgres::Client| async move {
        let rows = db
            .query("SELECT relname::text, seq_scan, coalesce(idx_scan, 0) FROM pg_stat_user_tables WHERE relname IN ('runs', 'threads') ORDER BY 1", &[])
            .await
            .unwrap();
        rows.iter().map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1), r.get::<_, i64>(2))).collect::<Vec<_>>()
    };
    let before = scans(db).await;
    let c = stack.client();
    let mut runs = Vec::new();
    for _ in 0..120 {
        let thread = c.create_thread().await.unwrap();
        runs.push(c.chat(&thread, "hi").await.unwrap()["run"]["id"].as_str().unwrap().to_owned());
    }
    for run in &runs {
        assert_eq!(c.wait_terminal(run, T).await.unwrap()["status"], "completed");
    }
    // Backends report their counters when they exit: stop the processes first.
    stack.api.signal(agentloop_tests::Sig::SIGTERM);
    for w in &stack.workers {
        w.signal(agentloop_tests::Sig::SIGTERM);
    }
    assert!(stack.api.wait_exit(Duration::from_secs(20)));
    for w in &mut stack.workers {
        assert!(w.wait_exit(Duration::from_secs(20)));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = scans(stack.db.client().await.unwrap()).await;
    println!("(table, sequential scans, index scans) before {before:?}, after 120 chats {after:?}");
    for ((table, seq_before, idx_before), (_, seq_after, idx_after)) in before.iter().zip(&after) {
        // The counters were reported: the index scans of the 120 chats are there.
        assert!(idx_after - idx_before >= 120, "{table}: statistics not reported ({idx_before} -> {idx_after} index scans)");
        let seq = seq_after - seq_before;
        assert!(seq < 20, "{table}: {seq} sequential scans for 120 chats (stale statistics froze the plans)");
    }
}

/// `Store::call_quiet` (a claim that starts no slice goes without the notification flush behind
/// it): the call is not deferred, so a notification it does send goes out with its own commit
/// and nothing is left pending in the session for a later flush; and a real quiet claim, on the
/// workers' store, claims and leaves nothing deferred either. Through `call` the same step's
/// notification is deferred and flushed behind it (the control: both paths deliver).
#[tokio::test]
async fn quiet_calls_notify_in_their_own_commit_and_leave_nothing_deferred() {
    use agentloop_shared::scheduler::listener::{self, ListenerEvent};
    use agentloop_shared::store::{PoolSettings, Replay, Store, Timing};

    let db = agentloop_tests::TestDb::create().await.unwrap();
    let setup = db.client().await.unwrap();
    let thread = Uuid::new_v4();
    let principal = Uuid::new_v4();
    setup
        .batch_execute(&format!(
            "INSERT INTO principals (id, name) VALUES ('{principal}', 'p');
             INSERT INTO threads (id, owner_id, last_event_sequence) VALUES ('{thread}', '{principal}', 7);"
        ))
        .await
        .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let mut events = listener::spawn(db.url.clone(), "quiet-test-listener", vec!["agentloop_threads"], Duration::from_secs(5), stop.clone());
    assert_eq!(tokio::time::timeout(T, events.recv()).await.unwrap(), Some(ListenerEvent::Resync));
    let expected = ListenerEvent::Notification { channel: "agentloop_threads".into(), payload: format!("{thread}:7") };
    let settings = PoolSettings {
        database_url: db.url.clone(),
        application_name: "quiet-test-store".into(),
        statement_timeout: Duration::from_secs(10),
        max_size: 1,
        wait_timeout: Duration::from_secs(5),
    };
    let store = Store::with_deferred_notifications(&settings, Timing { call_timeout: Duration::from_secs(5), retry_for: Duration::from_secs(5) }).unwrap();
    let pending = |store: Store| async move {
        let conn = store.conn().await.unwrap();
        let p: Option<String> = conn.client().query_one("SELECT current_setting('agentloop.deferred', true)", &[]).await.unwrap().get(0);
        p.unwrap_or_default()
    };
    let arg = json!({"threadId": thread});
    for quiet in [true, false, true] {
        if quiet {
            store.call_quiet("agentloop_renotify", &arg, Replay::Safe, None).await.unwrap();
        } else {
            store.call("agentloop_renotify", &arg, Replay::Safe, None).await.unwrap();
        }
        assert_eq!(tokio::time::timeout(Duration::from_secs(5), events.recv()).await.unwrap(), Some(expected.clone()), "quiet: {quiet}");
        assert_eq!(pending(store.clone()).await, "", "quiet: {quiet}: notifications left pending in the session");
    }

    // A real claim without slice starts, as the worker sends it under load.
    let run = Uuid::new_v4();
    setup
        .batch_execute(&format!(
            "INSERT INTO runs (id, thread_id, principal_id, status, model, queued_at) VALUES ('{run}', '{thread}', '{principal}', 'queued', 'mock', now())"
        ))
        .await
        .unwrap();
    let claimed = agentloop_shared::scheduler::claim(&store, &agentloop_shared::scheduler::Pass { owner: "quiet-worker", limit: 4, lease: Duration::from_secs(15), inflight: &[], released: &[], adopt: false, start: None, spare: None, models: None }).await.unwrap();
    assert_eq!(claimed.runs.iter().map(|r| r.id).collect::<Vec<_>>(), vec![run]);
    assert_eq!(pending(store.clone()).await, "", "a quiet claim left notifications pending");
    let status: String = setup.query_one("SELECT status FROM runs WHERE id = $1", &[&run]).await.unwrap().get(0);
    assert_eq!(status, "running");
    stop.cancel();
}

/// Grouped step calls (`agentloop_shared::store::group`, migration 000022): calls that arrive
/// while a group of the same function runs are sent together as ONE call of the group function,
/// items in thread id order, each caller getting its own item's result; a group that fails is
/// split and each item sent alone, so a poison item fails alone and the others succeed. A lone
/// call goes alone. Driven with a test step function that can sleep and fail on demand.
#[tokio::test]
async fn grouped_calls_share_one_statement_and_a_failing_group_is_split() {
    use agentloop_shared::store::{PoolSettings, Replay, Store, StoreError, Timing};

    let db = agentloop_tests::TestDb::create().await.unwrap();
    let setup = db.client().await.unwrap();
    setup
        .batch_execute(
            "CREATE SEQUENCE test_groups; CREATE TABLE test_group_items (n int, thread text);
             CREATE TABLE test_locks (k text PRIMARY KEY); INSERT INTO test_locks VALUES ('t-held');
             CREATE FUNCTION test_step(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
             BEGIN
                 PERFORM 1 FROM test_locks WHERE k = p ->> 'threadId' FOR UPDATE;
                 PERFORM pg_sleep(coalesce((p ->> 'sleepMs')::float8, 0) / 1000);
                 IF (p ->> 'poison')::boolean THEN RAISE EXCEPTION 'poison item'; END IF;
                 RETURN jsonb_build_object('echo', p -> 'threadId');
             END $$;
             CREATE FUNCTION test_step_group(p jsonb) RETURNS jsonb LANGUAGE plpgsql SET lock_timeout = '250ms' AS $$
             DECLARE v_item jsonb; v_out jsonb := '[]'; v_n bigint := nextval('test_groups');
             BEGIN
                 FOR v_item IN SELECT value FROM jsonb_array_elements(p -> 'items') WITH ORDINALITY ORDER BY ordinality LOOP
                     INSERT INTO test_group_items VALUES (v_n, v_item ->> 'threadId');
                     v_out := v_out || jsonb_build_array(test_step(v_item));
                 END LOOP;
                 RETURN v_out;
             END $$;",
        )
        .await
        .unwrap();
    let settings = PoolSettings {
        database_url: db.url.clone(),
        application_name: "group-test-store".into(),
        statement_timeout: Duration::from_secs(10),
        max_size: 4,
        wait_timeout: Duration::from_secs(5),
    };
    let store = Store::with_deferred_notifications(&settings, Timing { call_timeout: Duration::from_secs(5), retry_for: Duration::from_secs(5) })
        .unwrap()
        .grouping(&[agentloop_shared::store::group::GroupSpec { function: "test_step", group_function: "test_step_group", max_items: 32 }]);
    let deadline = || Some(Instant::now() + Duration::from_secs(5));
    async fn groups(setup: &tokio_postgres::Client) -> Vec<Vec<String>> {
        let rows = setup.query("SELECT n, array_agg(thread ORDER BY thread) FROM test_group_items GROUP BY n ORDER BY n", &[]).await.unwrap();
        rows.iter().map(|r| r.get::<_, Vec<String>>(1)).collect()
    }

    // A lone call goes alone (no group row), and answers.
    let alone = store.call("test_step", &json!({"threadId": "t-alone"}), Replay::Safe, deadline()).await.unwrap();
    assert_eq!(alone, json!({"echo": "t-alone"}));
    assert!(groups(&setup).await.is_empty(), "a lone call was sent as a group");

    // A slow call holds the one group slot; three calls arriving meanwhile form one group, sent
    // in thread id order, each answered with its own result.
    let slow = tokio::spawn({
        let store = store.clone();
        async move { store.call("test_step", &json!({"threadId": "t-slow", "sleepMs": 600}), Replay::Safe, deadline()).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let calls: Vec<_> = ["t-c", "t-a", "t-b"]
        .into_iter()
        .map(|t| {
            let store = store.clone();
            tokio::spawn(async move { store.call("test_step", &json!({"threadId": t}), Replay::Safe, deadline()).await })
        })
        .collect();
    for (call, t) in calls.into_iter().zip(["t-c", "t-a", "t-b"]) {
        assert_eq!(call.await.unwrap().unwrap(), json!({"echo": t}), "each caller gets its own item's result");
    }
    assert_eq!(slow.await.unwrap().unwrap(), json!({"echo": "t-slow"}));
    let seen = groups(&setup).await;
    assert_eq!(seen, vec![vec!["t-a".to_owned(), "t-b".to_owned(), "t-c".to_owned()]], "the waiting calls were not sent as one group");
    let order: Vec<String> = setup.query("SELECT thread FROM test_group_items ORDER BY ctid", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(order, vec!["t-a", "t-b", "t-c"], "a group applies its items in thread id order");

    // A group with a poison item fails as a whole (its rows roll back) and is split: the poison
    // item fails alone, deterministically; the others succeed.
    setup.batch_execute("TRUNCATE test_group_items").await.unwrap();
    let slow = tokio::spawn({
        let store = store.clone();
        async move { store.call("test_step", &json!({"threadId": "t-slow", "sleepMs": 600}), Replay::Safe, deadline()).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let calls: Vec<_> = [("t-x", false), ("t-y", true), ("t-z", false)]
        .into_iter()
        .map(|(t, poison)| {
            let store = store.clone();
            tokio::spawn(async move { store.call("test_step", &json!({"threadId": t, "poison": poison}), Replay::Safe, deadline()).await })
        })
        .collect();
    let results: Vec<_> = futures_util::future::join_all(calls).await.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(results[0].as_ref().unwrap(), &json!({"echo": "t-x"}));
    assert!(matches!(&results[1], Err(StoreError::Deterministic { message, .. }) if message.contains("poison")), "{:?}", results[1]);
    assert_eq!(results[2].as_ref().unwrap(), &json!({"echo": "t-z"}));
    slow.await.unwrap().unwrap();
    assert!(groups(&setup).await.is_empty(), "the failed group's rows were kept");
    let groups_sent: i64 = setup.query_one("SELECT last_value FROM test_groups", &[]).await.unwrap().get(0);
    assert_eq!(groups_sent, 2, "the poison round was not tried as one group first");

    // An item whose lock another session holds: the group gives up after its lock timeout and is
    // split, so the other items answer at once instead of waiting behind it; the blocked item
    // answers once the lock is gone.
    let holder = db.client().await.unwrap();
    holder.batch_execute("BEGIN; SELECT 1 FROM test_locks WHERE k = 't-held' FOR UPDATE").await.unwrap();
    let held_at = Instant::now();
    let slow = tokio::spawn({
        let store = store.clone();
        async move { store.call("test_step", &json!({"threadId": "t-slow", "sleepMs": 400}), Replay::Safe, deadline()).await }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let calls: Vec<_> = ["t-free1", "t-held", "t-free2"]
        .into_iter()
        .map(|t| {
            let store = store.clone();
            tokio::spawn(async move {
                let result = store.call("test_step", &json!({"threadId": t}), Replay::Safe, deadline()).await;
                (result, held_at.elapsed())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    holder.batch_execute("COMMIT").await.unwrap();
    let results: Vec<_> = futures_util::future::join_all(calls).await.into_iter().map(|r| r.unwrap()).collect();
    slow.await.unwrap().unwrap();
    for (i, t) in [(0, "t-free1"), (2, "t-free2")] {
        assert_eq!(results[i].0.as_ref().unwrap(), &json!({"echo": t}));
        assert!(results[i].1 < Duration::from_millis(2000), "{t} waited {:?} behind a blocked item", results[i].1);
    }
    assert_eq!(results[1].0.as_ref().unwrap(), &json!({"echo": "t-held"}));
    assert!(results[1].1 >= Duration::from_millis(2500), "the blocked item answered before its lock was free");
    let groups_sent: i64 = setup.query_one("SELECT last_value FROM test_groups", &[]).await.unwrap().get(0);
    assert_eq!(groups_sent, 3, "the blocked round was not tried as one group first");

    // The worker's group functions carry the same lock timeout.
    let configs: Vec<String> = setup
        .query("SELECT array_to_string(proconfig, ',') FROM pg_proc WHERE proname IN ('agentloop_commit_group', 'agentloop_slice_start_group')", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, Option<String>>(0).unwrap_or_default())
        .collect();
    assert_eq!(configs, vec!["lock_timeout=250ms".to_owned(); 2]);
}

/// Retention's purge never waits for a row lock (migration 000023): deleting a thread row sets
/// NULL in the rows of other threads that point at it (a child thread, a run compacted from it),
/// and the foreign key used to lock them in storage order, waiting — out of the one lock order
/// (thread ids ascending), so a group of steps holding two such threads could deadlock with it.
/// Now a held child or run leaves the thread row to the next pass, and the purge returns at once.
#[tokio::test]
async fn the_purge_never_waits_for_a_thread_or_run_another_session_holds() {
    let db = agentloop_tests::TestDb::create().await.unwrap();
    let admin = db.client().await.unwrap();
    let principal = Uuid::new_v4();
    admin.execute("INSERT INTO principals (id, name) VALUES ($1, 'purger')", &[&principal]).await.unwrap();
    // Two live threads with a run each, and a thread deleted long ago that both point at.
    admin.execute(agentloop_tests::ENQUEUE_SQL, &[&principal, &2i32, &"hi"]).await.unwrap();
    let live: Vec<(Uuid, Uuid)> =
        admin.query("SELECT thread_id, id FROM runs ORDER BY thread_id", &[]).await.unwrap().iter().map(|r| (r.get(0), r.get(1))).collect();
    let gone = Uuid::new_v4();
    admin
        .execute(
            "INSERT INTO threads (id, owner_id, title, deleted_at) VALUES ($1, $2, 'gone', now() - interval '10 hours')",
            &[&gone, &principal],
        )
        .await
        .unwrap();
    admin.execute("UPDATE threads SET parent_thread_id = $1 WHERE id = $2", &[&gone, &live[0].0]).await.unwrap();
    admin.execute("UPDATE runs SET source_thread_id = $1 WHERE id = $2", &[&gone, &live[1].1]).await.unwrap();

    let purger = db.client().await.unwrap();
    purger.batch_execute("SET statement_timeout = '5s'").await.unwrap();
    let purge = || async {
        let started = Instant::now();
        let answer: serde_json::Value = purger
            .query_one("SELECT agentloop_purge_threads('{\"rows\": 1000, \"keepHours\": 1}'::jsonb)", &[])
            .await
            .expect("the purge waited for a lock (statement timeout)")
            .get(0);
        assert!(started.elapsed() < Duration::from_secs(2), "the purge took {:?}", started.elapsed());
        answer
    };
    let exists = |id: Uuid| {
        let admin = &admin;
        async move { admin.query_one("SELECT count(*) FROM threads WHERE id = $1", &[&id]).await.unwrap().get::<_, i64>(0) == 1 }
    };
    // Another session holds the child thread, then the run: the thread row stays for later, and
    // the batch goes on with the next deleted thread (one deleted after it, pointed at by nothing).
    for held in ["SELECT 1 FROM threads WHERE id = $1 FOR NO KEY UPDATE", "SELECT 1 FROM runs WHERE id = $1 FOR NO KEY UPDATE"] {
        let next = Uuid::new_v4();
        admin
            .execute("INSERT INTO threads (id, owner_id, title, deleted_at) VALUES ($1, $2, 'next', now() - interval '9 hours')", &[&next, &principal])
            .await
            .unwrap();
        let holder = db.client().await.unwrap();
        holder.batch_execute("BEGIN").await.unwrap();
        let id = if held.contains("threads") { live[0].0 } else { live[1].1 };
        holder.execute(held, &[&id]).await.unwrap();
        let answer = purge().await;
        assert_eq!(answer["threads"], 1, "{answer}");
        assert!(exists(gone).await, "the thread row was deleted while a row pointing at it was held");
        assert!(!exists(next).await, "a held child stopped the purge of the threads after it");
        holder.batch_execute("COMMIT").await.unwrap();
    }
    // Nothing held: the row goes, and what pointed at it is NULL; the live data is untouched.
    let answer = purge().await;
    assert_eq!(answer["threads"], 1, "{answer}");
    assert!(!exists(gone).await);
    let parent: Option<Uuid> = admin.query_one("SELECT parent_thread_id FROM threads WHERE id = $1", &[&live[0].0]).await.unwrap().get(0);
    let source: Option<Uuid> = admin.query_one("SELECT source_thread_id FROM runs WHERE id = $1", &[&live[1].1]).await.unwrap().get(0);
    assert_eq!((parent, source), (None, None));
    assert!(exists(live[0].0).await && exists(live[1].0).await);
}

/// Settings a process cannot work with are refused at start, naming the setting — not accepted
/// into a process whose background task then dies while its health stays green (acceptance
/// probe J: `WORKER_RENEW_MS=0` started a worker whose lease keeper panicked at once, and its
/// runs were taken over by other workers, their paid answers asked for again;
/// `WORKER_STREAM_THROTTLE_MS=0` and `REVOCATION_CHECK_MS=0` killed the stream flusher and the
/// revocation check; `SSE_HEARTBEAT_MS=0` flooded clients; `DB_POOL_SIZE=0` made an api that
/// answered `database_unavailable` to everything; a missing `MODELS_FILE` made an api that said
/// it was ready and refused every chat; an unknown `EVENTS_TRANSPORT` served SSE).
#[tokio::test]
async fn settings_a_process_cannot_work_with_are_refused_at_start() {
    let stack = Stack::start("bad_settings", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let cases = [
        ("agentloop-worker", "WORKER_RENEW_MS", "0", "WORKER_RENEW_MS must be at least"),
        ("agentloop-worker", "WORKER_STREAM_THROTTLE_MS", "0", "WORKER_STREAM_THROTTLE_MS must be at least"),
        ("agentloop-worker", "WORKER_SAFETY_POLL_MS", "0", "WORKER_SAFETY_POLL_MS must be at least"),
        ("agentloop-worker", "DB_POOL_SIZE", "0", "must be 1 to 10000 connections"),
        ("agentloop-api", "REVOCATION_CHECK_MS", "0", "REVOCATION_CHECK_MS must be at least"),
        ("agentloop-api", "SSE_HEARTBEAT_MS", "5", "SSE_HEARTBEAT_MS must be at least"),
        ("agentloop-api", "DB_POOL_SIZE", "0", "must be 1 to 10000 connections"),
        ("agentloop-api", "MODELS_FILE", "/nonexistent/models.json", "model catalog"),
        ("agentloop-api", "LIVE_MAX_CONNECTIONS", "0", "LIVE_MAX_CONNECTIONS must be at least 1"),
        ("agentloop-api", "MAX_ACTIVE_RUNS_PER_PRINCIPAL", "0", "0 is not in 1.."),
        ("agentloop-worker", "RECEIPT_RETENTION_HOURS", "1", "1 is not in 24.."),
        ("agentloop-worker", "WORKER_LEASE_MS", "9223372036854775807", "WORKER_LEASE_MS must be at most"),
        ("agentloop-worker", "WORKER_SHUTDOWN_GRACE_MS", "18446744073709551615", "must be at most"),
        ("agentloop-api", "DB_COMMAND_POOL_SIZE", "18446744073709551615", "must be 1 to 10000 connections"),
        // It fell back to `auto` with a warning (probe J).
        ("agentloop-api", "EVENTS_TRANSPORT", "websockets", "invalid value 'websockets'"),
    ];
    let no_database = stack.db.url.rsplit_once('/').map(|(server, _)| format!("{server}/no_such_database_here")).unwrap();
    let cases = cases.into_iter().map(|(b, v, x, e)| (b, v, x.to_owned(), e)).chain([
        // A URL that can never work is not waited for as an outage (probe J, F10).
        ("agentloop-worker", "DATABASE_URL", no_database.clone(), "3D000"),
        ("agentloop-api", "DATABASE_URL", no_database, "3D000"),
    ]);
    for (binary, var, value, expected) in cases {
        let port = free_port();
        let child = tokio::process::Command::new(agentloop_tests::bin(binary))
            .arg("run")
            .env("DATABASE_URL", &stack.db.url)
            .env("API_LISTEN", format!("127.0.0.1:{port}"))
            .env("MODEL_BASE_URL", format!("{}/v1", stack.mock.url))
            .env("MODEL_NAME", "mock")
            .env("RUST_LOG", "warn")
            .env(var, &value)
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(Duration::from_secs(20), child).await.unwrap_or_else(|_| panic!("{binary} with {var}={value} started"));
        let out = out.unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stderr), String::from_utf8_lossy(&out.stdout));
        assert!(!out.status.success(), "{binary} with {var}={value} exited 0");
        assert!(text.contains(expected), "{binary} with {var}={value}: {text}");
    }
}
