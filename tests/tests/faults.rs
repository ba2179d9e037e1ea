//! Whole-system faults (issue 3): a PostgreSQL restart under load, and a soak with a worker
//! SIGKILLed every 2 s. The soak's size is `SOAK_RUNS` (default 120 here; the full size
//! is `SOAK_RUNS=1000 ./deploy/test.sh soak -- --nocapture`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use agentloop_tests::{PgCluster, Sig, Stack, StackOptions, script};
use serde_json::json;

#[tokio::test]
async fn postgres_restart_under_load_recovers_without_restarting_processes() {
    survive_a_server_fault("pg_restart", DbFault::Restart).await;
}

/// One backend killed with SIGKILL — what the kernel's OOM killer does to the largest process —
/// makes the postmaster end every other session and run crash recovery: all connections of
/// every api and worker process drop at once (`57P02`, resets), connects fail with `57P03`
/// while recovery runs, and whatever was not committed is gone. Same promise as a restart.
#[tokio::test]
async fn a_backend_killed_like_the_oom_killer_does_is_crash_recovery_and_loses_nothing() {
    survive_a_server_fault("pg_backend_sigkill", DbFault::BackendSigkill).await;
}

enum DbFault {
    /// `pg_ctl restart -m fast`.
    Restart,
    /// SIGKILL to one worker backend that is running a statement (or the first one found).
    BackendSigkill,
}

/// Eight tool-using streaming runs are under way when `fault` hits; four more are posted
/// through the same processes afterwards. All complete with one final answer each, and no
/// process exited.
async fn survive_a_server_fault(name: &str, fault: DbFault) {
    let cluster = PgCluster::start().unwrap();
    let lease = vec![("WORKER_LEASE_MS".into(), "3000".into()), ("WORKER_RENEW_MS".into(), "1000".into())];
    let mut stack = Stack::start(
        name,
        StackOptions { workers: 2, server: Some(cluster.admin_url()), worker_env: lease, ..Default::default() },
    )
    .await
    .unwrap();
    let c = stack.client();
    let steps = json!([
        {"toolCalls": [{"name": "calculator", "arguments": {"expression": "2*21"}}], "chunkDelayMs": 50},
        {"text": "a b c d e f g h i j k l m n o p", "chunkDelayMs": 150}
    ]);
    let mut runs = Vec::new();
    for _ in 0..8 {
        let thread = c.create_thread().await.unwrap();
        runs.push(c.chat(&thread, &script(steps.clone())).await.unwrap()["run"]["id"].as_str().unwrap().to_owned());
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    match fault {
        DbFault::Restart => cluster.restart().unwrap(),
        DbFault::BackendSigkill => {
            let admin = stack.db.client().await.unwrap();
            let pid: i32 = admin
                .query_one(
                    "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'agentloop-worker%'
                      ORDER BY (state = 'active') DESC, pid LIMIT 1",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            drop(admin);
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Sig::SIGKILL).unwrap();
            // The postmaster saw it and reinitialised: this is crash recovery, not one lost session.
            let log = cluster.dir().join("log");
            let deadline = Instant::now() + Duration::from_secs(20);
            while !std::fs::read_to_string(&log).unwrap_or_default().contains("terminating any other active server processes") {
                assert!(Instant::now() < deadline, "no crash recovery in the server log");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    // New work after the restart, through the same api and workers.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut after = Vec::new();
    while after.len() < 4 {
        let thread = match c.create_thread().await {
            Ok(t) => t,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            Err(e) => panic!("api did not recover: {e}"),
        };
        after.push(c.chat(&thread, &script(steps.clone())).await.unwrap()["run"]["id"].as_str().unwrap().to_owned());
    }
    for run in runs.iter().chain(&after) {
        let run = c.wait_terminal(run, Duration::from_secs(60)).await.unwrap();
        assert_eq!(run["status"], "completed", "{run}");
    }
    for p in std::iter::once(&mut stack.api).chain(stack.workers.iter_mut()) {
        assert!(p.child.try_wait().unwrap().is_none(), "{} exited", p.name);
    }
    let db = stack.db.client().await.unwrap();
    let finals: i64 = db
        .query_one("SELECT count(*) FROM messages WHERE role = 'assistant' AND tool_calls IS NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(finals, 12, "exactly one final answer per run");
}

#[tokio::test]
async fn soak_with_a_worker_sigkilled_every_two_seconds() {
    let total: usize = std::env::var("SOAK_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(120);
    let env = vec![
        ("WORKER_LEASE_MS".into(), "2000".into()),
        ("WORKER_RENEW_MS".into(), "600".into()),
        ("WORKER_CONCURRENCY".into(), "4".into()),
        ("WORKER_MAX_RECOVERIES".into(), "50".into()),
    ];
    let mut stack = Stack::start("soak", StackOptions { workers: 4, worker_env: env, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let mut runs = Vec::with_capacity(total);
    for i in 0..total {
        let thread = c.create_thread().await.unwrap();
        let steps = json!([
            {"toolCalls": [{"name": "calculator", "arguments": {"expression": format!("{i}*2")}}], "chunkDelayMs": 20},
            {"text": format!("final answer {{{{tool_result}}}} {}", "word ".repeat(30)), "chunkDelayMs": 100}
        ]);
        runs.push(c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned());
    }
    let started = Instant::now();
    let db = stack.db.client().await.unwrap();
    let mut kills = 0usize;
    let mut rng_state = 0x2545F4914F6CDD1Du64;
    loop {
        let open: i64 = db
            .query_one("SELECT count(*) FROM runs WHERE status NOT IN ('completed', 'failed', 'cancelled')", &[])
            .await
            .unwrap()
            .get(0);
        if open == 0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(600), "{open} runs still open after 10 minutes");
        tokio::time::sleep(Duration::from_secs(2)).await;
        rng_state ^= rng_state << 13;
        rng_state ^= rng_state >> 7;
        rng_state ^= rng_state << 17;
        let victim = (rng_state as usize) % stack.workers.len();
        stack.workers[victim].signal(Sig::SIGKILL);
        stack.workers[victim].wait_exit(Duration::from_secs(5));
        kills += 1;
        let replacement = stack.add_worker(&[]).unwrap();
        stack.workers.swap(victim, replacement);
        stack.workers.pop();
    }
    let statuses: HashMap<String, i64> = db
        .query("SELECT status, count(*) FROM runs GROUP BY status", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let recoveries: i64 = db.query_one("SELECT coalesce(sum(recoveries), 0)::bigint FROM runs", &[]).await.unwrap().get(0);
    // Exactly one final answer and one tool-call message per completed run.
    let bad_runs: i64 = db
        .query_one(
            "SELECT count(*) FROM runs r WHERE r.status = 'completed' AND (
                 (SELECT count(*) FROM messages m WHERE m.run_id = r.id AND m.role = 'assistant' AND m.tool_calls IS NULL) <> 1
              OR (SELECT count(*) FROM messages m WHERE m.run_id = r.id AND m.role = 'assistant' AND m.tool_calls IS NOT NULL) <> 1
              OR (SELECT count(*) FROM messages m WHERE m.run_id = r.id AND m.role = 'tool') <> 1)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let dup_keys: i64 = db
        .query_one("SELECT count(*) - count(DISTINCT idempotency_key) FROM run_steps", &[])
        .await
        .unwrap()
        .get(0);
    // A worker that lost its lease and kept writing would add rows after the run ended (or
    // extra rows, caught above).
    let stale: i64 = db
        .query_one(
            "SELECT count(*) FROM messages m JOIN runs r ON r.id = m.run_id
             WHERE m.created_at > r.finished_at",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let summary = json!({
        "runs": total, "statuses": statuses, "kills": kills, "recoveries": recoveries,
        "runsWithWrongMessages": bad_runs, "duplicateStepKeys": dup_keys, "staleWrites": stale,
        "seconds": started.elapsed().as_secs_f64(),
    });
    println!("SOAK {summary}");
    let _ = std::fs::write(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../test-output/soak/summary.json"),
        summary.to_string(),
    );
    assert_eq!(statuses.get("completed").copied().unwrap_or(0), total as i64, "{summary}");
    assert_eq!((bad_runs, dup_keys, stale), (0, 0, 0), "{summary}");
    assert!(kills > 0, "the soak killed no worker: {summary}");
}
