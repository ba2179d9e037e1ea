//! Zero-downtime migrations (issue 13, migrations/README.md): every migration that exists is
//! applied, one at a time with the product's own runner (`agentloop_shared::db`), to a database
//! under load — chat posts and claims in the shape the product writes them, plus a reader that
//! holds `ACCESS SHARE` on the hot tables for 1.5 s out of every 2 s the way `pg_dump` does.
//! A migration that needs a stronger lock queues behind that reader; without a `lock_timeout`
//! every statement of the load would queue behind the migration for the reader's whole
//! transaction. The assertion: no statement of the load waited 1 s or more on a lock (sampled
//! from `pg_stat_activity` every 20 ms), and the load never failed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentloop_tests::admin_url;
use tokio_postgres::NoTls;
use uuid::Uuid;

/// An empty database of its own (not from the migrated template), dropped at the end.
struct EmptyDb {
    name: String,
    url: String,
}

impl EmptyDb {
    async fn create() -> Self {
        let admin = admin_url();
        let (client, conn) = tokio_postgres::connect(&admin, NoTls).await.unwrap();
        tokio::spawn(conn);
        let name = format!("t_mig_{}", Uuid::new_v4().simple());
        client.batch_execute(&format!("CREATE DATABASE {name}")).await.unwrap();
        let (base, _) = admin.rsplit_once('/').unwrap();
        Self { url: format!("{base}/{name}"), name }
    }
}

impl Drop for EmptyDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                if let Ok((admin, conn)) = tokio_postgres::connect(&admin_url(), NoTls).await {
                    tokio::spawn(conn);
                    let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
                }
            });
        })
        .join();
    }
}

async fn connect(url: &str, app: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(conn);
    client.batch_execute(&format!("SET application_name = '{app}'; SET statement_timeout = '20s'")).await.unwrap();
    client
}

/// A chat post as every schema version stores it, in the product's lock order (thread, then
/// its runs — the active-run check — then messages and the journal): a thread, the user
/// message, a queued run and a journal event, in one transaction.
async fn chat(c: &mut tokio_postgres::Client, principal: Uuid) -> Result<(), tokio_postgres::Error> {
    let tx = c.transaction().await?;
    let thread = Uuid::new_v4();
    tx.execute("INSERT INTO threads (id, owner_id, message_count, last_sequence, last_event_sequence) VALUES ($1, $2, 1, 1, 1)", &[&thread, &principal]).await?;
    tx.execute("SELECT 1 FROM runs WHERE thread_id = $1 AND status IN ('queued', 'running') FOR UPDATE", &[&thread]).await?;
    tx.execute(
        "INSERT INTO messages (thread_id, sequence, timestamp_ms, role, content) VALUES ($1, 1, 1, 'user', '\"hi\"')",
        &[&thread],
    )
    .await?;
    tx.execute("INSERT INTO runs (id, thread_id, principal_id, status, model, queued_at) VALUES ($1, $2, $3, 'queued', 'mock', now())", &[&Uuid::new_v4(), &thread, &principal]).await?;
    tx.execute("INSERT INTO thread_events (thread_id, sequence, kind, payload) VALUES ($1, 1, 'message', '{}')", &[&thread]).await?;
    tx.commit().await
}

/// A claim and the run's completion, as the scheduler does them.
async fn claim(c: &tokio_postgres::Client) -> Result<(), tokio_postgres::Error> {
    let row = c
        .query_opt(
            "UPDATE runs SET status = 'running', lease_owner = 'load', lease_epoch = lease_epoch + 1, attempts = attempts + 1,
                    lease_expires_at = now() + interval '15 seconds'
              WHERE id = (SELECT id FROM runs WHERE status IN ('queued', 'running') AND (status = 'queued' OR lease_expires_at < now())
                           ORDER BY seq LIMIT 1 FOR UPDATE SKIP LOCKED)
          RETURNING id",
            &[],
        )
        .await?;
    if let Some(row) = row {
        let id: Uuid = row.get(0);
        c.execute("UPDATE runs SET status = 'completed', finished_at = now(), lease_owner = NULL, lease_expires_at = NULL WHERE id = $1", &[&id])
            .await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_migration_applies_under_load_without_blocking_it_for_a_second() {
    let db = EmptyDb::create().await;
    let first = agentloop_shared::db::run_migrations_up_to(&db.url, 1).await.unwrap();
    assert_eq!(first.len(), 1);
    let seed = connect(&db.url, "seed").await;
    let principal = Uuid::new_v4();
    seed.execute("INSERT INTO principals (id, name) VALUES ($1, 'load')", &[&principal]).await.unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let failures: Arc<Mutex<Vec<String>>> = Arc::default();
    let statements = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for n in 0..4 {
        let (url, stop, failures, statements) = (db.url.clone(), stop.clone(), failures.clone(), statements.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = connect(&url, "migration-load").await;
            while !stop.load(Ordering::SeqCst) {
                let result = if n % 2 == 0 { chat(&mut c, principal).await } else { claim(&c).await };
                match result {
                    Ok(()) => {
                        statements.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => failures.lock().unwrap().push(format!("{e:?}")),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    // The pg_dump-like reader: ACCESS SHARE on the hot tables, 1.5 s of every 2 s.
    {
        let (url, stop) = (db.url.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = connect(&url, "migration-reader").await;
            while !stop.load(Ordering::SeqCst) {
                let tx = c.transaction().await.unwrap();
                tx.batch_execute("LOCK TABLE runs, threads, messages, thread_events IN ACCESS SHARE MODE; SELECT pg_sleep(1.5)")
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }));
    }
    // The sampler: how long each load statement has been waiting on a lock.
    // (pid, query start) -> (first seen waiting, last seen waiting, query)
    type Waits = HashMap<(i32, String), (Instant, Instant, String)>;
    let longest: Arc<Mutex<Waits>> = Arc::default();
    {
        let (url, stop, longest) = (db.url.clone(), stop.clone(), longest.clone());
        tasks.push(tokio::spawn(async move {
            let c = connect(&url, "migration-sampler").await;
            while !stop.load(Ordering::SeqCst) {
                let rows = c
                    .query(
                        "SELECT pid, query_start::text, query FROM pg_stat_activity
                          WHERE datname = current_database() AND application_name = 'migration-load' AND wait_event_type = 'Lock'",
                        &[],
                    )
                    .await
                    .unwrap();
                let now = Instant::now();
                {
                    let mut map = longest.lock().unwrap();
                    for r in rows {
                        let key = (r.get::<_, i32>(0), r.get::<_, Option<String>>(1).unwrap_or_default());
                        map.entry(key).and_modify(|e| e.1 = now).or_insert((now, now, r.get::<_, String>(2)));
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    let mut applied = Vec::new();
    loop {
        let started = Instant::now();
        let next = agentloop_shared::db::run_migrations_up_to(&db.url, 1).await.unwrap();
        if next.is_empty() {
            break;
        }
        println!("migration {} applied under load in {:.2} s", next[0], started.elapsed().as_secs_f64());
        applied.extend(next);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.unwrap();
    }

    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations");
    let on_disk = std::fs::read_dir(dir).unwrap().flatten().filter(|e| e.path().join("up.sql").exists()).count();
    assert_eq!(applied.len() + 1, on_disk, "every migration on disk was applied: {applied:?}");
    assert!(failures.lock().unwrap().is_empty(), "the load failed: {:?}", failures.lock().unwrap());
    let done = statements.load(Ordering::Relaxed);
    assert!(done > 100, "the load ran ({done} transactions)");
    let (seen, worst) = {
        let waits = longest.lock().unwrap();
        (waits.len(), waits.values().map(|(a, b, q)| (b.duration_since(*a), q.clone())).max_by_key(|(d, _)| *d))
    };
    println!(
        "{} migrations under load: {done} load transactions, {seen} lock waits seen, longest {:?}",
        applied.len(),
        worst.as_ref().map(|(d, _)| *d)
    );
    if let Some((wait, query)) = worst {
        // Sampled every 20 ms: a wait seen over this span lasted at least that long.
        assert!(wait < Duration::from_millis(1000), "a load statement waited {wait:?} on a lock: {query}");
    }
    // The migrated schema is the one the binaries expect.
    let c = connect(&db.url, "check").await;
    let invalid: i64 = c
        .query_one("SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND NOT i.indisvalid", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(invalid, 0, "no index was left invalid");
}

/// The statement groups of a `run_in_transaction = false` migration (split at `-- commit`).
#[test]
fn statement_groups_split_at_commit_lines_and_skip_empty_ones() {
    let groups = agentloop_shared::db::statement_groups("-- header\nSELECT 1;\nSELECT 2;\n-- commit\n\n-- only a comment\n-- commit\nCREATE INDEX CONCURRENTLY x ON y (z);\n");
    assert_eq!(groups.len(), 2, "{groups:?}");
    assert!(groups[0].contains("SELECT 1;") && groups[0].contains("SELECT 2;"));
    assert_eq!(groups[1].trim(), "CREATE INDEX CONCURRENTLY x ON y (z);");
}

/// Several processes migrate one empty database at once — three `agentloop-worker migrate` and
/// two `agentloop-api migrate`, as replicas with migrate-on-start do: every one exits 0 and
/// every migration is applied once. Before: a migrator waiting for another's advisory lock gave
/// up after the 0.5 s `lock_timeout` (2 of 3 failed), and the api binary panicked whenever a
/// migration was pending (its runtime is single-threaded; acceptance probe E).
#[tokio::test]
async fn concurrent_migrators_all_succeed_and_apply_each_migration_once() {
    let db = EmptyDb::create().await;
    let mut children = Vec::new();
    for (binary, n) in [("agentloop-worker", 3), ("agentloop-api", 2)] {
        for _ in 0..n {
            let child = tokio::process::Command::new(agentloop_tests::bin(binary))
                .arg("migrate")
                .env("DATABASE_URL", &db.url)
                .env("RUST_LOG", "warn")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .unwrap();
            children.push((binary, child));
        }
    }
    for (binary, child) in children {
        let out = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output()).await.expect("a migrator hung").unwrap();
        assert!(out.status.success(), "{binary} migrate: {:?}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    let c = connect(&db.url, "check").await;
    let applied: i64 = c.query_one("SELECT count(*) FROM __diesel_schema_migrations", &[]).await.unwrap().get(0);
    let dirs = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../migrations")).unwrap().filter(|e| e.as_ref().unwrap().path().is_dir()).count();
    assert_eq!(applied as usize, dirs, "every migration applied once");
}

/// A database knows which migrations it applied and what they said (acceptance probe M): the
/// runner records each migration's checksum; a binary whose migration differs from the one the
/// database applied is refused by `migrate` (before, eleven migrations had been edited in place
/// and databases first migrated in between kept the old SQL silently — among others, main's
/// workers ran an `ask` tool without approval on one); a binary whose migrations the database
/// lacks refuses to `run` (before, a new api started before `migrate` said ready and failed
/// `/v1` requests after the model was paid), and so does one whose migration differs from what
/// the database applied (verifier P, P-4); a database newer than the binary is fine.
#[tokio::test]
async fn a_changed_or_missing_migration_is_refused_and_a_newer_schema_is_not() {
    let db = EmptyDb::create().await;
    let c = connect(&db.url, "check").await;
    let dirs = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../migrations")).unwrap().filter(|e| e.as_ref().unwrap().path().is_dir()).count();
    // All but the last: each binary refuses to run, naming what is missing.
    agentloop_shared::db::run_migrations_up_to(&db.url, dirs - 1).await.unwrap();
    for binary in ["agentloop-worker", "agentloop-api"] {
        let text = refused_to_run(&db.url, binary).await;
        assert!(text.contains("lacks 1 migration"), "{binary}: {text}");
    }
    // Every applied migration's checksum is recorded.
    agentloop_shared::db::run_migrations(&db.url).await.unwrap();
    let recorded: i64 = c.query_one("SELECT count(*) FROM agentloop_migration_checksums WHERE length(sha256) = 64", &[]).await.unwrap().get(0);
    assert_eq!(recorded as usize, dirs);
    // A newer release's migration is fine for this binary.
    c.batch_execute("INSERT INTO __diesel_schema_migrations (version) VALUES ('20991231000001')").await.unwrap();
    let gap = agentloop_shared::db::schema_gap(&db.url).await.unwrap();
    assert!(gap.missing.is_empty() && gap.unknown == ["20991231000001"], "{gap:?}");
    // The database applied another text of a migration than this binary has: refused.
    c.batch_execute("UPDATE agentloop_migration_checksums SET sha256 = repeat('0', 64) WHERE version = '20261206000039'").await.unwrap();
    let error = agentloop_shared::db::run_migrations(&db.url).await.unwrap_err().to_string();
    assert!(error.contains("2026-12-06-000039_fleet_tool_policies differs from the one this database applied"), "{error}");
    // And `run` refuses it too (verifier P, P-4: it served, on SQL other than its own).
    let gap = agentloop_shared::db::schema_gap(&db.url).await.unwrap();
    assert_eq!(gap.changed, ["2026-12-06-000039_fleet_tool_policies"], "{gap:?}");
    for binary in ["agentloop-worker", "agentloop-api"] {
        let text = refused_to_run(&db.url, binary).await;
        assert!(text.contains("differ from what the database applied (2026-12-06-000039_fleet_tool_policies)"), "{binary}: {text}");
    }
}

/// Runs `binary run` against `url` and returns its output; panics unless it exits with an error
/// within 30 s.
async fn refused_to_run(url: &str, binary: &str) -> String {
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(agentloop_tests::bin(binary))
            .arg("run")
            .env("DATABASE_URL", url)
            .env("API_LISTEN", "127.0.0.1:0")
            .env("MODEL_BASE_URL", "http://127.0.0.1:9/v1")
            .env("MODEL_NAME", "m")
            .env("RUST_LOG", "warn")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .unwrap_or_else(|_| panic!("{binary} run started on a schema it should refuse"))
    .unwrap();
    let text = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{binary}: {:?}\n{text}", out.status);
    text
}
