//! Browser tests of the web UI (issue 5): starts a stack (api with `DEV_LOOPBACK_PRINCIPAL=true`,
//! one worker, the mock model), seeds a 10,000-message thread with SQL, then runs
//! `node tests/browser/run.mjs` (playwright-core driving Debian's Chromium at
//! `/usr/bin/chromium`), then `node tests/browser/branches.spec.mjs` (edit/regenerate/delete,
//! compaction, queued turns), and requires exit status 0 of each; then `tests/browser/ui.spec.mjs`
//! (issue 11: the UI as a product) on a second stack built for it — no loopback principal (the
//! page signs in), the api's database connections through a TCP proxy, short leases, a 4,096-token
//! model context — with a small control server the spec calls to cut the database, stop or
//! continue the worker, and make or revoke keys. Screenshots: `test-output/browser/`.
//!
//! Without `node`/`npm` or `/usr/bin/chromium` the test prints why and passes — unless `CI` is
//! set, where missing tools are a failure (`.ci/run` installs them). A missing
//! `tests/browser/node_modules` is installed with `npm ci` (never a browser download).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use std::sync::Arc;

use agentloop_tests::proxy::FreezeAt;
use agentloop_tests::{Stack, StackOptions};
use nix::sys::signal::Signal;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Mutex;
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
    let env = [("API_URL", stack.api_url.clone()), ("DATABASE_URL", stack.db.url.clone()), ("BIG_THREAD_ID", big.to_string())];
    let mut failed = Vec::new();
    for (script, log) in [("run.mjs", "run.log"), ("branches.spec.mjs", "branches-run.log")] {
        if !run_node(&dir, &out_dir, script, log, &env).await {
            failed.push(script);
        }
    }
    drop(stack);

    // The UI as a product (issue 11), on a stack of its own.
    let lease = vec![("WORKER_LEASE_MS".to_owned(), "6000".to_owned()), ("WORKER_RENEW_MS".to_owned(), "1000".to_owned()), ("MODEL_CONTEXT_TOKENS".to_owned(), "4096".to_owned())];
    let mut api_env = lease.clone();
    api_env.push(("UNCLAIMED_AFTER_MS".into(), "2000".into()));
    let options = StackOptions { workers: 1, api_env, worker_env: lease, api_through_proxy: true, ..Default::default() };
    let stack = Arc::new(Mutex::new(Stack::start("browser_ui", options).await.unwrap()));
    let (api_url, control_url) = {
        let s = stack.lock().await;
        (s.api_url.clone(), control_server(stack.clone()).await)
    };
    if !run_node(&dir, &out_dir, "ui.spec.mjs", "ui-run.log", &[("API_URL", api_url), ("CONTROL_URL", control_url)]).await {
        failed.push("ui.spec.mjs");
    }
    assert!(failed.is_empty(), "browser tests failed: {failed:?} (logs in test-output/browser/)");
}

/// Runs `node script` in `dir` with `env`, its output also written to `out_dir/log`; whether it
/// passed (panics when it takes longer than 240 s).
async fn run_node(dir: &Path, out_dir: &Path, script: &str, log: &str, env: &[(&str, String)]) -> bool {
    let started = Instant::now();
    let mut cmd = tokio::process::Command::new("node");
    cmd.arg(script).current_dir(dir).env("OUT_DIR", out_dir).env("CHROMIUM", CHROMIUM);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true).spawn().expect("spawning node");
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
    if !output.status.success() {
        println!("browser tests ({script}) failed ({}); see test-output/browser/{log}", output.status);
    }
    output.status.success()
}

/// A loopback HTTP server the UI spec drives faults with (`POST <path>`, answer: text):
/// `/db/down` (the api's database connections are cut and new ones hang), `/db/up`,
/// `/worker/stop` (SIGSTOP), `/worker/cont` (SIGCONT), `/key/new?principal=NAME` (a new key),
/// `/key/revoke?principal=NAME`, `/thread/retire-model?id=THREAD` (pins the thread to a model
/// the server does not configure). Returns its base URL; it lives as long as the test.
async fn control_server(stack: Arc<Mutex<Stack>>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else { return };
            let stack = stack.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let n = sock.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let target = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
                let (path, query) = target.split_once('?').unwrap_or((&target, ""));
                let arg = |name: &str| query.split('&').find_map(|kv| kv.strip_prefix(&format!("{name}="))).unwrap_or("").to_owned();
                let s = stack.lock().await;
                let result: Result<String, String> = match path {
                    "/db/down" => {
                        let proxy = s.proxy.as_ref().unwrap();
                        proxy.cut_all();
                        proxy.freeze_new(FreezeAt::Start);
                        Ok("down".into())
                    }
                    "/db/up" => {
                        s.proxy.as_ref().unwrap().pass();
                        Ok("up".into())
                    }
                    "/worker/stop" => {
                        s.workers[0].signal(Signal::SIGSTOP);
                        Ok("stopped".into())
                    }
                    "/worker/cont" => {
                        s.workers[0].signal(Signal::SIGCONT);
                        Ok("continued".into())
                    }
                    "/key/new" => s.client_for(&arg("principal")).map(|c| c.key.unwrap_or_default()).map_err(|e| e.to_string()),
                    "/key/revoke" => {
                        let db = s.db.client().await.map_err(|e| e.to_string());
                        match db {
                            Ok(db) => db
                                .execute("UPDATE api_keys SET revoked_at = now() WHERE principal_id = (SELECT id FROM principals WHERE name = $1)", &[&arg("principal")])
                                .await
                                .map(|n| format!("revoked {n}"))
                                .map_err(|e| e.to_string()),
                            Err(e) => Err(e),
                        }
                    }
                    "/thread/retire-model" => match (s.db.client().await, Uuid::parse_str(&arg("id"))) {
                        (Ok(db), Ok(id)) => db
                            .execute("UPDATE threads SET model = 'retired-model' WHERE id = $1", &[&id])
                            .await
                            .map(|n| format!("updated {n}"))
                            .map_err(|e| e.to_string()),
                        _ => Err("bad thread id or database".into()),
                    },
                    other => Err(format!("unknown control {other}")),
                };
                let (status, body) = match result {
                    Ok(b) => ("200 OK", b),
                    Err(e) => ("500 Internal Server Error", e),
                };
                let reply = format!("HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len());
                let _ = sock.write_all(reply.as_bytes()).await;
            });
        }
    });
    url
}
