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

/// A small filesystem of its own (tmpfs) for a tablespace; unmounted on drop.
struct SmallDisk {
    dir: std::path::PathBuf,
}

impl SmallDisk {
    /// Mounts a `megabytes` tmpfs owned by `postgres`; `None` when this machine does not let the
    /// test mount one (not root, or no mount permission in a container).
    fn mount(megabytes: u32) -> Option<Self> {
        if !nix::unistd::geteuid().is_root() {
            return None;
        }
        let dir = std::env::temp_dir().join(format!("agentloop-disk-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).ok()?;
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={megabytes}m,mode=0700"), "tmpfs"])
            .arg(&dir)
            .status()
            .ok()?;
        if !status.success() {
            let _ = std::fs::remove_dir(&dir);
            return None;
        }
        let owned = std::process::Command::new("chown").args(["postgres:postgres"]).arg(&dir).status().ok()?.success();
        let disk = Self { dir };
        owned.then_some(disk)
    }

    /// Fills what is free with a file; returns its size in bytes.
    fn fill(&self) -> u64 {
        use std::io::Write;
        let mut file = std::fs::File::create(self.dir.join("filler")).unwrap();
        let block = vec![0u8; 64 * 1024];
        let mut written = 0u64;
        // Large blocks, then small ones, until the filesystem refuses.
        for size in [block.len(), 4096, 512] {
            while file.write_all(&block[..size]).is_ok() {
                written += size as u64;
            }
        }
        let _ = file.sync_all();
        written
    }

    fn free(&self) {
        std::fs::remove_file(self.dir.join("filler")).unwrap();
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.dir).status();
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// PostgreSQL stopped for several leases (connects refused, every session gone) while one run's
/// model answer arrives and another run streams through the whole outage. Model calls need no
/// database: the stream goes on although the lease watchdog stopped the slice's effects, and
/// both answers — paid for — are kept and written, fenced, once the server is back
/// (`WORKER_OUTAGE_HOLD_MS`), then the runs complete. Each model call is paid once; neither run
/// counts a recovery or a fault. Before: the answer was dropped and paid again, the stream was
/// cut by the watchdog and recovered after its lease like a crashed worker's (`recoveries` 1,
/// `faults` 1).
#[tokio::test]
async fn a_database_outage_longer_than_the_lease_keeps_the_paid_answer_and_counts_no_fault() {
    survive_an_outage("db_outage_hold", 1).await;
}

/// The same with two workers, each executing two of the runs: when the server is back, every
/// lease has expired, and the worker whose calls succeed first must not take the other's runs as
/// recoveries (it did: a fault, and the held answer refused by the fence and paid again). For one
/// lease after its own outage, a worker's claims spare the runs whose lease expired meanwhile.
#[tokio::test]
async fn after_a_database_outage_no_worker_takes_the_runs_another_still_holds() {
    survive_an_outage("db_outage_two_workers", 2).await;
}

/// Workers with 3 s leases renewed every second, reaching PostgreSQL through the test proxy
/// when `through_proxy`: a fault of a few seconds outlasts a lease.
fn short_leases(through_proxy: bool) -> StackOptions {
    StackOptions {
        workers_through_proxy: through_proxy,
        worker_env: vec![("WORKER_LEASE_MS".into(), "3000".into()), ("WORKER_RENEW_MS".into(), "1000".into())],
        ..Default::default()
    }
}

/// Waits (15 s at most) until the mock model has received a request that `wanted` accepts.
async fn wait_model_request(stack: &Stack, wanted: impl Fn(&serde_json::Value) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !stack.mock.requests().await.unwrap().iter().any(&wanted) {
        assert!(Instant::now() < deadline, "the model call did not start");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The run completes on its first attempt without a recovery (`done` is its end) and its
/// answer, which contains `text`, is stored once.
async fn assert_answered_once(stack: &Stack, done: &serde_json::Value, text: &str) {
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!((done["attempts"].as_i64(), done["recoveries"].as_i64()), (Some(1), Some(0)), "{done}");
    let db = stack.db.client().await.unwrap();
    let answers: i64 = db
        .query_one("SELECT count(*) FROM messages WHERE role = 'assistant' AND content::text LIKE '%' || $1 || '%'", &[&text])
        .await
        .unwrap()
        .get(0);
    assert_eq!(answers, 1, "{text}");
}

/// Another session holds the thread's row (`SELECT ... FOR UPDATE`: an operator's transaction, a
/// long maintenance statement) for more than two leases while the run's answer arrives. The
/// database answers everything else — the lease renewals go on — so the checkpoint waits and is
/// written when the lock goes: one model call, no recovery, no fault. Before: the commit gave up
/// at the lease's first deadline, the run was handed back and the answer paid again (acceptance
/// probe: a 20 s lock with the default 15 s lease).
#[tokio::test]
async fn a_thread_row_locked_past_the_lease_keeps_the_paid_answer() {
    let stack = Stack::start("thread_row_locked", short_leases(false)).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let text = "the answer that waited for a lock one two three four";
    let turn = script(json!([{"text": text, "chunkDelayMs": 200}]));
    let run = c.chat(&thread, &turn).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    wait_model_request(&stack, |_| true).await;
    // The answer streams for ~2 s; the row stays locked for 9 s (three leases).
    let mut locker = stack.db.client().await.unwrap();
    let tx = locker.transaction().await.unwrap();
    tx.execute("SELECT 1 FROM threads WHERE id = $1::text::uuid FOR UPDATE", &[&thread]).await.unwrap();
    tokio::time::sleep(Duration::from_secs(9)).await;
    let db = stack.db.client().await.unwrap();
    let status: String = db.query_one("SELECT status FROM runs WHERE id = $1::text::uuid", &[&run]).await.unwrap().get(0);
    assert_eq!(status, "running", "nothing could be written while the row was locked");
    tx.commit().await.unwrap();

    let done = c.wait_terminal(&run, Duration::from_secs(30)).await.unwrap();
    assert_answered_once(&stack, &done, text).await;
    assert_eq!(done["faults"].as_i64(), Some(0), "{done}");
    assert_eq!(stack.mock.requests().await.unwrap().len(), 1, "the answer was paid once");
}

/// Every connection between the worker and PostgreSQL freezes (a half-open network path, a
/// stalled proxy: nothing is refused, nothing answers) for two leases while the run's model
/// answer arrives. The worker sees only timeouts — its renewals too — and cannot tell a frozen
/// path from a lock wait or an outage; the answer is paid for, so its fenced checkpoint is held
/// and written once the path thaws: one model call, one attempt, no recovery. Before: the
/// checkpoint gave up at the lease's deadline, the hand-back could not be written either, the
/// worker's next claim took the run again and the answer was paid twice (chaos soak, seed 23:
/// a 2 s freeze of one worker).
#[tokio::test]
async fn a_frozen_network_path_past_the_lease_keeps_the_paid_answer() {
    let stack = Stack::start("frozen_path_hold", short_leases(true)).await.unwrap();
    let proxy = stack.proxy.as_ref().unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let text = "the answer that arrived while the network path was frozen";
    let run = c.chat(&thread, &script(json!([{"text": text, "delayMs": 1200}]))).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    wait_model_request(&stack, |_| true).await;
    proxy.freeze_all();
    proxy.freeze_new(agentloop_tests::proxy::FreezeAt::Start);
    tokio::time::sleep(Duration::from_secs(6)).await;
    proxy.pass();

    let done = c.wait_terminal(&run, Duration::from_secs(30)).await.unwrap();
    assert_answered_once(&stack, &done, text).await;
    assert_eq!(stack.mock.requests().await.unwrap().len(), 1, "the answer was paid once: {done}");
}

/// A thread of four answers (each starting `answer <i> <marker>`) whose next turn compacts:
/// `compactThreshold` tokens, the last two messages kept.
async fn thread_to_compact(c: &agentloop_tests::Client, marker: &str, threshold: u32) -> String {
    let thread = c.create_thread().await.unwrap();
    for i in 0..4 {
        let run = c.chat(&thread, &script(json!([{"text": format!("answer {i} {marker}{}", "filler ".repeat(60))}]))).await.unwrap();
        c.wait_terminal(run["run"]["id"].as_str().unwrap(), Duration::from_secs(30)).await.unwrap();
    }
    let metadata = json!({"metadata": {"compactThreshold": threshold, "compactRecentMessages": 2}});
    let r = c.send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), Some(metadata), &[]).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    thread
}

/// A summarisation request to the mock model (its system prompt is agentloop's summary prompt).
fn is_summary(request: &serde_json::Value) -> bool {
    request["messages"][0]["content"].as_str().is_some_and(|t| t.starts_with("You compress the earlier part"))
}

/// Summarisation requests among `requests`.
fn summaries(requests: Vec<serde_json::Value>) -> usize {
    requests.iter().filter(|r| is_summary(r)).count()
}

/// A compaction summary is paid work too (one or more model calls): its checkpoint, which
/// carries no message, is held like an answer's. Every connection that sends the summary's
/// checkpoint freezes for two leases while the renewals go through; once the path thaws the
/// summary is written and the turn answered, with one summary request and one attempt. Before:
/// only commits with messages were held, so the checkpoint gave up at the lease's deadline, the
/// run was handed back and the summary paid again.
#[tokio::test]
async fn a_compaction_summary_whose_checkpoint_freezes_past_the_lease_is_kept() {
    use agentloop_tests::proxy::FreezeAt;
    let stack = Stack::start("frozen_summary_hold", short_leases(true)).await.unwrap();
    let proxy = stack.proxy.as_ref().unwrap();
    let c = stack.client();
    let thread = thread_to_compact(&c, "", 200).await;
    // Pooled connections are replaced; every new one freezes when it sends a summary checkpoint.
    proxy.cut_all();
    proxy.freeze_new(FreezeAt::ClientSends(b"\"snapshot\":{".to_vec()));
    let run = c.chat(&thread, &script(json!([{"text": "the turn after the summary"}]))).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    wait_model_request(&stack, is_summary).await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    proxy.pass();

    let done = c.wait_terminal(&run, Duration::from_secs(30)).await.unwrap();
    assert_answered_once(&stack, &done, "the turn after the summary").await;
    assert_eq!(summaries(stack.mock.requests().await.unwrap()), 1, "the summary was paid once: {done}");
    let db = stack.db.client().await.unwrap();
    let snapshots: i64 = db
        .query_one("SELECT count(*) FROM context_snapshots WHERE thread_id = $1::text::uuid", &[&thread])
        .await
        .unwrap()
        .get(0);
    assert_eq!(snapshots, 1);
}

/// The database goes away (every worker connection frozen) while a compaction summary is being
/// written by the model, for two leases: the summary arrives during the outage and is kept
/// through it with its progress events, written once the path thaws — one summary request, one
/// attempt. Before: the progress events were committed on their own first; that commit carried
/// no paid work, was not held, and its failure handed the run back, so the summary was paid
/// again (acceptance probe E: PostgreSQL stopped or read-only for 20-30 s during a summary).
#[tokio::test]
async fn a_summary_that_arrives_during_an_outage_is_kept() {
    use agentloop_tests::proxy::FreezeAt;
    let stack = Stack::start("outage_during_summary", short_leases(true)).await.unwrap();
    let proxy = stack.proxy.as_ref().unwrap();
    let c = stack.client();
    let thread = thread_to_compact(&c, "MOCK_SUMMARY_SLOW ", 800).await;
    let run = c.chat(&thread, &script(json!([{"text": "the turn after the summary"}]))).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    wait_model_request(&stack, is_summary).await;
    // The summary takes 2 s: the path freezes under it, for two leases.
    proxy.freeze_all();
    proxy.freeze_new(FreezeAt::Start);
    tokio::time::sleep(Duration::from_secs(7)).await;
    proxy.pass();

    let done = c.wait_terminal(&run, Duration::from_secs(30)).await.unwrap();
    assert_eq!(summaries(stack.mock.requests().await.unwrap()), 1, "the summary was paid once: {done}");
    // The slice whose lease went unconfirmed hands the run back after writing the summary; the
    // next attempt starts from it (no second compaction) and answers.
    assert_eq!((done["status"].as_str(), done["recoveries"].as_i64(), done["faults"].as_i64()), (Some("completed"), Some(0), Some(0)), "{done}");
    assert_eq!(done["compactions"].as_array().map(Vec::len), Some(1), "{done}");
}

/// SIGTERM during a compaction of several parts (each summary 2 s): the worker starts no new
/// summary call after it, keeps the parts already summarised as a partial snapshot, and hands
/// the run back; the next worker summarises only what is left. No part is summarised twice.
/// Before: the summariser went on after the SIGTERM, then was dropped with the grace, and the
/// next worker started over — 11 summary requests for 7 parts (verification of probe E).
#[tokio::test]
async fn a_shutdown_during_a_long_compaction_keeps_the_parts_already_summarised() {
    let mut stack = Stack::start("shutdown_mid_compaction", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let messages: Vec<serde_json::Value> = (0..40)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("MOCK_SUMMARY_SLOW part {i} {}", "word ".repeat(1500))}))
        .collect();
    let r = c.post("/api/threads/import", json!({"messages": messages, "metadata": {"compactThreshold": 1000, "compactChunkTokens": 8000, "compactRecentMessages": 4}})).await.unwrap();
    assert_eq!(r.status, 201, "{r:?}");
    let thread = r.body["thread"]["id"].as_str().unwrap().to_owned();
    let run = c.chat(&thread, &script(json!([{"text": "answered after the compaction"}]))).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    // The second summary is being written: SIGTERM.
    let deadline = Instant::now() + Duration::from_secs(30);
    while summaries(stack.mock.requests().await.unwrap()) < 2 {
        assert!(Instant::now() < deadline, "the compaction did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stack.workers[0].signal(Sig::SIGTERM);
    assert!(stack.workers[0].wait_exit(Duration::from_secs(30)), "the worker exited");
    let at_exit = summaries(stack.mock.requests().await.unwrap());
    assert_eq!(at_exit, 2, "no summary call was started after the SIGTERM");
    stack.add_worker(&[]).unwrap();
    let done = c.wait_terminal(&run, Duration::from_secs(90)).await.unwrap();
    assert_eq!(done["status"], "completed", "{done}");
    let transcripts: Vec<String> = stack
        .mock
        .requests()
        .await
        .unwrap()
        .iter()
        .filter(|r| is_summary(r))
        .map(|r| r["messages"][1]["content"].as_str().unwrap_or_default().to_owned())
        .collect();
    let distinct: std::collections::HashSet<&String> = transcripts.iter().collect();
    assert_eq!(distinct.len(), transcripts.len(), "a part was summarised twice ({} requests)", transcripts.len());
    let db = stack.db.client().await.unwrap();
    let snapshots: i64 = db.query_one("SELECT count(*) FROM context_snapshots WHERE thread_id = $1::text::uuid", &[&thread]).await.unwrap().get(0);
    assert!(snapshots >= 2, "the partial compaction was kept, then completed: {snapshots} snapshots");
}

/// Another session holds one thread's row while two runs stream on the same worker: the other
/// run's live answer keeps flowing (its `streaming` events keep arriving while the row is held),
/// and both runs complete with one model call each. Before: the one flush of all the worker's
/// streams waited for the held row, freezing every stream of the worker (and the checkpoints
/// that wait for the flush) until it timed out (acceptance probe; migration 000030).
#[tokio::test]
async fn a_locked_thread_does_not_freeze_the_other_streams_of_its_worker() {
    let stack = Stack::start("locked_thread_streams", StackOptions::default()).await.unwrap();
    let c = stack.client();
    // 150 words in chunks of ~3, 200 ms apart: ~10 s of streaming each.
    let words: Vec<String> = (0..150).map(|i| format!("w{i}")).collect();
    let mut runs = Vec::new();
    let mut threads = Vec::new();
    for _ in 0..2 {
        let thread = c.create_thread().await.unwrap();
        let turn = script(json!([{"text": words.join(" "), "chunkDelayMs": 200}]));
        runs.push(c.chat(&thread, &turn).await.unwrap()["run"]["id"].as_str().unwrap().to_owned());
        threads.push(thread);
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while stack.mock.requests().await.unwrap().len() < 2 {
        assert!(Instant::now() < deadline, "the model calls did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let db = stack.db.client().await.unwrap();
    let streamed = |thread: String| {
        let db = &db;
        async move {
            db.query_one("SELECT count(*) FROM thread_events WHERE thread_id = $1::text::uuid AND kind = 'streaming'", &[&thread])
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    let mut locker = stack.db.client().await.unwrap();
    let tx = locker.transaction().await.unwrap();
    tx.execute("SELECT 1 FROM threads WHERE id = $1::text::uuid FOR UPDATE", &[&threads[0]]).await.unwrap();
    let before = streamed(threads[1].clone()).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = streamed(threads[1].clone()).await - before;
    assert!(during >= 5, "the other stream kept flowing while one thread was held: {during} events in 3 s");
    tx.commit().await.unwrap();
    for run in &runs {
        let done = c.wait_terminal(run, Duration::from_secs(30)).await.unwrap();
        assert_eq!(done["status"], "completed", "{done}");
    }
    assert_eq!(stack.mock.requests().await.unwrap().len(), 2, "one model call each");
    let held = streamed(threads[0].clone()).await;
    assert!(held >= 1, "the held thread's text was sent once its row was free: {held} events");
}

/// Per worker: one run whose answer arrives ~1 s into an 8 s outage, one that streams through it.
async fn survive_an_outage(name: &str, workers: usize) {
    let cluster = PgCluster::start().unwrap();
    let options = StackOptions {
        workers,
        server: Some(cluster.admin_url()),
        worker_env: vec![
            ("WORKER_LEASE_MS".into(), "3000".into()),
            ("WORKER_RENEW_MS".into(), "1000".into()),
            ("WORKER_CONCURRENCY".into(), "2".into()),
        ],
        ..Default::default()
    };
    let mut stack = Stack::start(name, options).await.unwrap();
    let c = stack.client();
    // (run id, marker of its turn, the answer it must end with)
    let mut runs = Vec::new();
    for i in 0..workers {
        for (text, step) in [
            (format!("answer {i} that arrived while the database was down"), json!({"delayMs": 1200})),
            (format!("stream {i} one two three four five six seven eight"), json!({"chunkDelayMs": 1000})),
        ] {
            let mut step = step;
            step["text"] = json!(text);
            let turn = script(json!([step]));
            let marker = turn.split_whitespace().nth(1).unwrap().to_owned();
            let thread = c.create_thread().await.unwrap();
            let run = c.chat(&thread, &turn).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
            runs.push((run, marker, text));
        }
    }
    // Every slice under way (its model call sent), then the server goes away for 8 s: beyond
    // the 3 s lease; the first answers arrive ~1 s into it.
    let deadline = Instant::now() + Duration::from_secs(15);
    while stack.mock.requests().await.unwrap().len() < runs.len() {
        assert!(Instant::now() < deadline, "the model calls did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cluster.stop().unwrap();
    tokio::time::sleep(Duration::from_secs(8)).await;
    cluster.start_again().unwrap();

    for (run, ..) in &runs {
        let run = c.wait_terminal(run, Duration::from_secs(60)).await.unwrap();
        assert_eq!(run["status"], "completed", "{run}");
    }
    for w in stack.workers.iter_mut() {
        assert!(w.child.try_wait().unwrap().is_none(), "{} exited", w.name);
    }
    let requests = stack.mock.requests().await.unwrap();
    let db = stack.db.client().await.unwrap();
    for (run, marker, text) in &runs {
        let calls = requests.iter().filter(|r| r.to_string().contains(marker.as_str())).count();
        assert_eq!(calls, 1, "{text}: paid once, not dropped and paid again");
        let answers: i64 = db
            .query_one("SELECT count(*) FROM messages WHERE role = 'assistant' AND content::text LIKE '%' || $1 || '%'", &[text])
            .await
            .unwrap()
            .get(0);
        assert_eq!(answers, 1, "{text}: written exactly once");
        let row = db.query_one("SELECT recoveries, faults FROM runs WHERE id = $1::text::uuid", &[run]).await.unwrap();
        let (recoveries, faults): (i32, i32) = (row.get(0), row.get(1));
        assert_eq!((recoveries, faults), (0, 0), "{text}: an outage is no crash and not the run's fault");
    }
}

/// SQLSTATE 53100 (`disk_full`): the filesystem of the database's tables fills up for longer
/// than the lease while runs stream, checkpoint tool steps and wait in the queue. Injected for
/// real: every table and index of the test database lives in a tablespace on a 64 MB tmpfs (the
/// WAL stays on the cluster's own disk, so PostgreSQL itself keeps running), and a file fills
/// that tmpfs until it refuses a byte. While full, a write that needs a new page fails; a new
/// turn is either accepted or refused with a clean 503 `database_unavailable` (never a 500) and
/// stored nowhere. Once space is freed, every accepted turn completes with its answer exactly
/// once, none failed. Skipped (with a message) where the test cannot mount a tmpfs.
#[tokio::test]
async fn a_full_disk_pauses_runs_and_fails_none() {
    let Some(disk) = SmallDisk::mount(64) else {
        eprintln!("SKIPPED: this machine does not let the test mount a tmpfs (needs root)");
        return;
    };
    let cluster = PgCluster::start().unwrap();
    let options = StackOptions {
        workers: 1,
        server: Some(cluster.admin_url()),
        worker_env: vec![
            ("WORKER_LEASE_MS".into(), "3000".into()),
            ("WORKER_RENEW_MS".into(), "1000".into()),
            ("WORKER_CONCURRENCY".into(), "3".into()),
            // Two faults fail a run: the outage lasts several leases, and a run whose slice only
            // could not write is not at fault (its worker takes it back without counting one).
            ("WORKER_MAX_RECOVERIES".into(), "1".into()),
        ],
        ..Default::default()
    };
    let stack = Stack::start("disk_full", options).await.unwrap();
    let c = stack.client();
    let db = stack.db.client().await.unwrap();
    // Everything of the test database onto the small disk, before any load.
    db.batch_execute(&format!("CREATE TABLESPACE small LOCATION '{}'", disk.dir.display())).await.unwrap();
    db.batch_execute("ALTER TABLE ALL IN TABLESPACE pg_default SET TABLESPACE small; ALTER INDEX ALL IN TABLESPACE pg_default SET TABLESPACE small")
        .await
        .unwrap();
    let moved: i64 = db
        .query_one(
            "SELECT count(*) FROM pg_class c JOIN pg_tablespace t ON t.oid = c.reltablespace
              WHERE t.spcname = 'small' AND c.relname IN ('runs', 'messages', 'thread_events', 'run_steps', 'threads')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(moved, 5);

    // (run, the answer it must end with)
    let mut turns: Vec<(String, String)> = Vec::new();
    let streamed = (0..120).map(|i| format!("word{i}")).collect::<Vec<_>>().join(" ");
    let thread = c.create_thread().await.unwrap();
    turns.push((c.chat(&thread, &script(json!([{"text": streamed, "chunkDelayMs": 80}]))).await.unwrap()["run"]["id"].as_str().unwrap().to_owned(), streamed.clone()));
    let mut steps: Vec<serde_json::Value> =
        (0..10).map(|i| json!({"toolCalls": [{"name": "calculator", "arguments": {"expression": format!("{i}+1")}}], "delayMs": 400})).collect();
    steps.push(json!({"text": "chain: {{tool_results}}"}));
    let thread = c.create_thread().await.unwrap();
    let chain = format!("chain: {}", (1..=10).map(|n| n.to_string()).collect::<Vec<_>>().join(", "));
    turns.push((c.chat(&thread, &script(serde_json::Value::Array(steps))).await.unwrap()["run"]["id"].as_str().unwrap().to_owned(), chain));
    for i in 0..4 {
        let thread = c.create_thread().await.unwrap();
        let text = format!("queued answer {i} {}", "x".repeat(2000));
        turns.push((c.chat(&thread, &script(json!([{"text": text, "delayMs": 300}]))).await.unwrap()["run"]["id"].as_str().unwrap().to_owned(), text));
    }
    let refused_thread = c.create_thread().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // Full, for longer than the lease.
    let filled = disk.fill();
    let probe = db.batch_execute("CREATE TABLE disk_probe (x text) TABLESPACE small; INSERT INTO disk_probe SELECT repeat('x', 1000) FROM generate_series(1, 10000)").await;
    let err = probe.expect_err("the small disk still took 10 MB");
    assert_eq!(err.code(), Some(&tokio_postgres::error::SqlState::DISK_FULL), "{err}");
    eprintln!("disk full ({filled} bytes of filler)");
    let mut refused: Option<(String, String)> = None;
    let held = Instant::now();
    let mut posts = 0;
    while held.elapsed() < Duration::from_secs(10) {
        if let Ok(thread) = &refused_thread {
            let text = format!("posted while full {posts} {}", "y".repeat(4000));
            let key = format!("full-{posts}");
            let r = c
                .send(reqwest::Method::POST, &format!("/api/threads/{thread}/chat"), Some(json!({"content": script(json!([{"text": text}])), "multitask": "enqueue"})), &[("Idempotency-Key", &key)])
                .await
                .unwrap();
            match r.status {
                202 => turns.push((r.body["run"]["id"].as_str().unwrap().to_owned(), text)),
                503 => {
                    assert_eq!(r.body["error"]["code"], "database_unavailable", "{r:?}");
                    assert!(!r.body.to_string().contains("No space"), "the SQL error reached the client: {r:?}");
                    refused.get_or_insert((key, text));
                }
                _ => panic!("a turn posted while the disk is full: {r:?}"),
            }
            posts += 1;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    disk.free();
    eprintln!("space freed after {:?}", held.elapsed());

    // A refused turn, retried with its key, is accepted now.
    if let (Some((key, text)), Ok(thread)) = (refused, &refused_thread) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let r = c
                .send(reqwest::Method::POST, &format!("/api/threads/{thread}/chat"), Some(json!({"content": script(json!([{"text": text}])), "multitask": "enqueue"})), &[("Idempotency-Key", &key)])
                .await
                .unwrap();
            if r.status == 202 {
                turns.push((r.body["run"]["id"].as_str().unwrap().to_owned(), text));
                break;
            }
            assert!(r.status == 503 && Instant::now() < deadline, "{r:?}");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    for (run, answer) in &turns {
        let done = c.wait_terminal(run, Duration::from_secs(90)).await.unwrap();
        assert_eq!(done["status"], "completed", "{done}");
        let finals: Vec<String> = db
            .query(
                "SELECT content #>> '{}' FROM messages WHERE run_id = $1::text::uuid AND role = 'assistant' AND tool_calls IS NULL",
                &[run],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(finals, vec![answer.clone()], "run {run}: one final answer");
    }
    let failed: i64 = db.query_one("SELECT count(*) FROM runs WHERE status = 'failed'", &[]).await.unwrap().get(0);
    assert_eq!(failed, 0);
    let recoveries: Vec<i32> = db.query("SELECT recoveries FROM runs ORDER BY seq", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    eprintln!("{} turns answered; {posts} posted while full; recoveries per run {recoveries:?}", turns.len());
    drop(stack);
    drop(cluster);
}
