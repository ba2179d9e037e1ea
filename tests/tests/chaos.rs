//! The chaos harness, reduced to fit the normal suite: ~100 turns of the mixed workload with every
//! fault class (including one PostgreSQL restart) on a private cluster, then every invariant.
//! Fails when any invariant is violated; the table and the evidence are printed and written to
//! `test-output/chaos_test/report.json`. The full soak is `./deploy/test.sh chaos`.
//! `CHAOS_SEED` / `CHAOS_RUNS` override the seed and the size.

use std::path::PathBuf;
use std::time::Duration;

use agentloop_tests::chaos::{self, Config};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_reduced_mixed_workload_with_every_fault_class_keeps_every_invariant() {
    let seed = std::env::var("CHAOS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(7);
    let mut config = Config::soak(seed);
    config.runs = std::env::var("CHAOS_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(100);
    config.clients = 8;
    config.restarts = 1;
    config.fault_interval_ms = 1000;
    config.settle = Duration::from_secs(60);
    config.log_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../test-output/chaos_test");
    let outcome = chaos::run(config).await.expect("the chaos harness itself failed");
    let table = outcome.report.table(5);
    println!("{table}");
    assert_eq!(outcome.violations(), 0, "chaos invariants violated (seed {seed}):\n{table}");
}

/// The lease audit itself (no processes): rows written the way a worker that holds its lease
/// writes them pass; writes by a worker that does not hold the run, under a stale epoch, after
/// the run ended, a run row changed by a non-owner, the outcome of a call recorded by a worker
/// that never held its epoch, and the claim of a live lease are caught — each exactly once; the
/// known outcome its own dispatcher records after losing the lease passes.
#[tokio::test]
async fn chaos_lease_audit_tells_fenced_writes_from_writes_after_lease_loss() {
    use agentloop_tests::TestDb;
    use agentloop_tests::chaos::audit;
    let db = TestDb::create().await.unwrap();
    let c = db.client().await.unwrap();
    audit::install(&c).await.unwrap();
    let id = |n: u8| format!("00000000-0000-0000-0000-0000000000{n:02}");
    let (p, t, t2) = (id(1), id(2), id(3));
    let (r1, r2, r3, r4, r5) = (id(11), id(12), id(13), id(14), id(15));
    c.batch_execute(&format!(
        "INSERT INTO principals (id, name) VALUES ('{p}', 'audit');
         INSERT INTO threads (id, owner_id) VALUES ('{t}', '{p}'), ('{t2}', '{p}');
         INSERT INTO runs (id, thread_id, principal_id, status, model, lease_owner, lease_epoch, lease_expires_at) VALUES
           ('{r1}', '{t}', '{p}', 'running', 'm', 'w1', 3, now() + interval '1 hour'),
           ('{r2}', '{t}', '{p}', 'pending', 'm', NULL, 0, NULL),
           ('{r3}', '{t2}', '{p}', 'running', 'm', 'w2', 1, now() - interval '1 second');
         INSERT INTO threads (id, owner_id) VALUES ('{}', '{p}'), ('{}', '{p}');
         INSERT INTO runs (id, thread_id, principal_id, status, model, lease_owner, lease_epoch, lease_expires_at) VALUES
           ('{r4}', '{}', '{p}', 'running', 'm', 'w9', 5, now() + interval '1 hour'),
           ('{r5}', '{}', '{p}', 'running', 'm', 'w2', 2, now() + interval '1 hour');",
        id(4),
        id(5),
        id(4),
        id(5)
    ))
    .await
    .unwrap();
    let mut seq = 0;
    let mut msg = |thread: &str, run: &str| {
        seq += 1;
        format!(
            "INSERT INTO messages (thread_id, sequence, timestamp_ms, role, content, run_id) VALUES ('{thread}', {seq}, {}, 'tool', '\"x\"', '{run}');",
            1_700_000_000_000i64 + seq
        )
    };
    let tx = |app: &str, body: String| format!("BEGIN; SET LOCAL application_name = '{app}'; {body} COMMIT;");
    let w = |n: &str| format!("agentloop-worker {n}");
    // Fenced writes: the owner appends; the owner ends its run, closes a dangling call and
    // promotes the next pending run with its user turn, in one transaction.
    c.batch_execute(&tx(&w("w1"), msg(&t, &r1))).await.unwrap();
    let end = format!(
        "UPDATE runs SET status = 'completed', lease_owner = NULL WHERE id = '{r1}'; {} UPDATE runs SET status = 'queued' WHERE id = '{r2}'; {}",
        msg(&t, &r1),
        msg(&t, &r2)
    );
    // Violations: another worker writes the owner's run; the old owner writes after the end.
    let stranger = msg(&t, &r1);
    c.batch_execute(&tx(&w("w2"), stranger)).await.unwrap();
    c.batch_execute(&tx(&w("w1"), end)).await.unwrap();
    c.batch_execute(&tx(&w("w1"), msg(&t, &r1))).await.unwrap();
    // Operations: the owner under its epoch passes, under a stale epoch does not.
    let op = |key: &str, epoch: i64| {
        format!(
            "INSERT INTO operations (key, run_id, thread_id, tool_call_id, tool_name, arguments, status, lease_epoch)
             VALUES ('{key}', '{r3}', '{t2}', '{key}', 'effect', '{{}}', 'prepared', {epoch});"
        )
    };
    c.batch_execute(&tx(&w("w2"), op("k-ok", 1))).await.unwrap();
    c.batch_execute(&tx(&w("w2"), op("k-stale", 0))).await.unwrap();
    // Claims: an expired lease (a recovery) passes; a live one is counted.
    c.batch_execute(&tx(&w("w3"), format!("UPDATE runs SET lease_owner = 'w3', lease_epoch = lease_epoch + 1 WHERE id = '{r3}';")))
        .await
        .unwrap();
    c.batch_execute(&tx(&w("w3"), format!("UPDATE runs SET lease_owner = 'w3', lease_epoch = lease_epoch + 1 WHERE id = '{r4}';")))
        .await
        .unwrap();
    // A worker ends a run it does not hold.
    c.batch_execute(&tx(&w("w1"), format!("UPDATE runs SET status = 'failed', lease_owner = NULL WHERE id = '{r5}';")))
        .await
        .unwrap();
    // The api is not a worker: not checked.
    c.batch_execute(&tx("agentloop-api", msg(&t, &r1))).await.unwrap();
    // A known outcome recorded after lease loss (agentloop_record_outcome): w2 claims r6 (epoch
    // 1) and dispatches two calls, w4 recovers the run (epoch 2); w2 records the outcome of the
    // call it dispatched under its epoch (a fact, allowed), w4 records one of an epoch it never
    // held (caught).
    let (t6, r6) = (id(6), id(16));
    c.batch_execute(&format!(
        "INSERT INTO threads (id, owner_id) VALUES ('{t6}', '{p}');
         INSERT INTO runs (id, thread_id, principal_id, status, model, lease_epoch) VALUES ('{r6}', '{t6}', '{p}', 'queued', 'm', 0);"
    ))
    .await
    .unwrap();
    let dispatched = |key: &str| {
        format!(
            "INSERT INTO operations (key, run_id, thread_id, tool_call_id, tool_name, arguments, status, lease_epoch)
             VALUES ('{key}', '{r6}', '{t6}', '{key}', 'effect', '{{}}', 'dispatched', 1);"
        )
    };
    c.batch_execute(&tx(
        &w("w2"),
        format!(
            "UPDATE runs SET status = 'running', lease_owner = 'w2', lease_epoch = 1, lease_expires_at = now() - interval '1 second' WHERE id = '{r6}'; {} {}",
            dispatched("k-fact"),
            dispatched("k-foreign")
        ),
    ))
    .await
    .unwrap();
    c.batch_execute(&tx(&w("w4"), format!("UPDATE runs SET lease_owner = 'w4', lease_epoch = 2 WHERE id = '{r6}';"))).await.unwrap();
    c.batch_execute(&tx(&w("w2"), "UPDATE operations SET status = 'completed' WHERE key = 'k-fact';".to_owned())).await.unwrap();
    c.batch_execute(&tx(&w("w4"), "UPDATE operations SET status = 'failed' WHERE key = 'k-foreign';".to_owned())).await.unwrap();

    let f = audit::check(&c).await.unwrap();
    assert_eq!(f.lease_violations.len(), 4, "{:#?}", f.lease_violations);
    assert!(f.lease_violations.iter().any(|v| v.contains("row k-foreign")), "{:#?}", f.lease_violations);
    assert!(!f.lease_violations.iter().any(|v| v.contains("row k-fact")), "{:#?}", f.lease_violations);
    assert!(f.lease_violations.iter().any(|v| v.contains("by 'agentloop-worker w2'") && v.contains("messages")), "{:#?}", f.lease_violations);
    assert!(f.lease_violations.iter().any(|v| v.contains("by 'agentloop-worker w1'") && v.contains("'completed'")), "{:#?}", f.lease_violations);
    assert!(f.lease_violations.iter().any(|v| v.contains("row k-stale")), "{:#?}", f.lease_violations);
    assert_eq!(f.run_violations.len(), 1, "{:#?}", f.run_violations);
    assert!(f.run_violations[0].contains(&r5), "{:#?}", f.run_violations);
    assert_eq!(f.live_claims.len(), 1, "{:#?}", f.live_claims);
    assert!(f.live_claims[0].contains(&r4), "{:#?}", f.live_claims);
    assert_eq!(f.recovery_claims, 3, "every claim of a running run is counted as a recovery");
}
