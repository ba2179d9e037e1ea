//! Browser tests of the web UI (issue 5): starts a stack (api with `DEV_LOOPBACK_PRINCIPAL=true`,
//! one worker, the mock model), seeds a 10,000-message thread with SQL, then runs
//! `node tests/browser/run.mjs` (playwright-core driving Debian's Chromium at
//! `/usr/bin/chromium`), then `node tests/browser/branches.spec.mjs` (edit/regenerate/delete,
//! compaction, queued turns), and requires exit status 0 of each. Screenshots: `test-output/browser/`.
//!
//! Without `node`/`npm` or `/usr/bin/chromium` the test prints why and passes — unless `CI` is
//! set, where missing tools are a failure (`.ci/run` installs them). A missing
//! `tests/browser/node_modules` is installed with `npm ci` (never a browser download).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use agentloop_tests::{Stack, StackOptions};
use uuid::Uuid;

const CHROMIUM: &str = "/usr/bin/chromium";
const BIG_THREAD_MESSAGES: i64 = 10_000;

fn browser_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("browser")
}

fn works(cmd: &str, arg: &str) -> bool {
    std::process::Command::new(cmd).arg(arg).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// `Err(reason)` when a tool is missing.
fn tools() -> Result<(), String> {
    let mut missing = Vec::new();
    if !works("node", "--version") {
        missing.push("node");
    }
    if !works("npm", "--version") {
        missing.push("npm");
    }
    if !Path::new(CHROMIUM).exists() {
        missing.push(CHROMIUM);
    }
    if missing.is_empty() { Ok(()) } else { Err(missing.join(", ")) }
}

fn npm_ci(dir: &Path) {
    if dir.join("node_modules/playwright-core/package.json").exists() {
        return;
    }
    eprintln!("browser tests: installing tests/browser/node_modules (npm ci)");
    let status = std::process::Command::new("npm")
        .args(["ci", "--no-audit", "--no-fund"])
        .current_dir(dir)
        .env("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
        .status()
        .expect("running npm ci");
    assert!(status.success(), "npm ci in tests/browser failed");
}

/// A thread owned by the loopback principal `local` with `n` alternating user/assistant
/// messages (every 50th pair an assistant tool call with its result), inserted with SQL.
async fn seed_big_thread(db: &tokio_postgres::Client, n: i64) -> Uuid {
    let owner: Uuid = db.query_one("SELECT id FROM principals WHERE name = 'local'", &[]).await.unwrap().get(0);
    let id = Uuid::new_v4();
    db.execute("INSERT INTO threads (id, owner_id, title) VALUES ($1, $2, '10,000 messages')", &[&id, &owner]).await.unwrap();
    db.execute(
        "INSERT INTO messages (thread_id, sequence, timestamp_ms, role, content, tool_calls, tool_call_id, byte_size)
         SELECT $1, s, 1700000000000 + s, role, content, tc, tcid, octet_length(content::text) + coalesce(octet_length(tc::text), 0)
         FROM (SELECT s,
                      CASE WHEN s % 100 = 49 THEN 'assistant' WHEN s % 100 = 50 THEN 'tool' WHEN s % 2 = 1 THEN 'user' ELSE 'assistant' END AS role,
                      CASE WHEN s % 100 = 49 THEN 'null'::jsonb WHEN s % 100 = 50 THEN to_jsonb('42'::text)
                           ELSE to_jsonb('Message ' || s || ': ' || repeat('lorem ipsum ', (1 + s % 7)::int)) END AS content,
                      CASE WHEN s % 100 = 49 THEN jsonb_build_array(jsonb_build_object('id', 'call-' || s, 'type', 'function',
                           'function', jsonb_build_object('name', 'calculator', 'arguments', '{\"expression\":\"6*7\"}'))) END AS tc,
                      CASE WHEN s % 100 = 50 THEN 'call-' || (s - 1) END AS tcid
               FROM generate_series(1, $2::bigint) s) x",
        &[&id, &n],
    )
    .await
    .unwrap();
    db.execute(
        "UPDATE threads SET last_sequence = $2::bigint, message_count = $2::bigint::int, last_timestamp_ms = 1700000000000 + $2::bigint, updated_at = now() WHERE id = $1",
        &[&id, &n],
    )
    .await
    .unwrap();
    id
}

#[tokio::test]
async fn web_ui_in_headless_chromium() {
    if let Err(missing) = tools() {
        if std::env::var_os("CI").is_some() {
            panic!("browser tests: missing {missing} (CI is set, so this is a failure; .ci/run installs them)");
        }
        println!("SKIPPED browser tests: missing {missing}. Install Debian's chromium and nodejs/npm (see .ci/run) to run them.");
        eprintln!("SKIPPED browser tests: missing {missing}");
        return;
    }
    let dir = browser_dir();
    npm_ci(&dir);

    let options = StackOptions {
        workers: 1,
        api_env: vec![("DEV_LOOPBACK_PRINCIPAL".into(), "true".into())],
        ..Default::default()
    };
    let stack = Stack::start("browser", options).await.unwrap();
    let db = stack.db.client().await.unwrap();
    let big = seed_big_thread(&db, BIG_THREAD_MESSAGES).await;

    let out_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../test-output/browser");
    std::fs::create_dir_all(&out_dir).unwrap();
    // run.mjs, then the specs of later features (same stack), each with its own log.
    for (script, log) in [("run.mjs", "run.log"), ("branches.spec.mjs", "branches-run.log")] {
        let started = Instant::now();
        let child = tokio::process::Command::new("node")
            .arg(script)
            .current_dir(&dir)
            .env("API_URL", &stack.api_url)
            .env("DATABASE_URL", &stack.db.url)
            .env("BIG_THREAD_ID", big.to_string())
            .env("OUT_DIR", &out_dir)
            .env("CHROMIUM", CHROMIUM)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawning node");
        let output = tokio::time::timeout(Duration::from_secs(240), child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("browser tests ({script}) did not finish within 240 s"))
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        let _ = std::fs::write(out_dir.join(log), format!("{stdout}\n--- stderr ---\n{stderr}"));
        println!("{stdout}");
        if !stderr.trim().is_empty() {
            println!("--- stderr ---\n{stderr}");
        }
        println!("browser tests ({script}) took {:?}", started.elapsed());
        assert!(output.status.success(), "browser tests ({script}) failed ({}); see test-output/browser/{log}:\n{stdout}\n{stderr}", output.status);
    }
}
