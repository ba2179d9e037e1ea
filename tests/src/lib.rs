//! Black-box test harness: every test gets its own PostgreSQL database (cloned from a migrated
//! template), the real `agentloop-api` / `agentloop-worker` binaries as child processes, and a
//! scripted OpenAI-compatible mock model (`mock-model`). Assertions are made on HTTP responses
//! and database rows, never on log text.
//!
//! Environment: `TEST_DATABASE_URL` — a superuser URL that may `CREATE DATABASE` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`). Binaries are taken from the cargo target
//! directory of the running test (build with `cargo build --workspace` first).

pub mod proxy;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};
use tokio_postgres::NoTls;

/// The admin URL used to create and drop per-test databases.
pub fn admin_url() -> String {
    std::env::var("TEST_DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

fn url_on(admin: &str, db: &str) -> String {
    let admin = admin.to_owned();
    let (base, _) = admin.rsplit_once('/').expect("TEST_DATABASE_URL has a database path");
    let query = admin.split_once('?').map(|(_, q)| format!("?{q}")).unwrap_or_default();
    format!("{base}/{db}{query}")
}

/// The cargo target profile directory holding the binaries (`target/debug`).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// The path of the workspace binary `name` (built by `cargo build --workspace`).
pub fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(path.exists(), "{} is missing: run `cargo build --workspace` first", path.display());
    path
}

/// Folder for this test's process logs: `test-output/<test name>/`.
pub fn log_dir(test: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../test-output").join(test);
    std::fs::create_dir_all(&root).expect("create test-output dir");
    root
}

/// A database of its own for one test, dropped (with `FORCE`) when the value is dropped.
pub struct TestDb {
    pub name: String,
    pub url: String,
    admin: String,
}

/// Prefix of the migrated template databases: one per migrations fingerprint
/// (`agentloop_test_template_<fingerprint>`), so checkouts with different migrations on one
/// server (a branch beside main) do not rebuild each other's template on every test.
const TEMPLATE_PREFIX: &str = "agentloop_test_template";

impl TestDb {
    /// Creates `t_<uuid>` from the migrated template (creating the template first if needed,
    /// under an advisory lock so parallel test processes build it once).
    pub async fn create() -> Result<Self> {
        Self::create_on(&admin_url()).await
    }

    /// Like [`TestDb::create`] on the server of `admin_url` (e.g. a [`PgCluster`]).
    pub async fn create_on(admin_url: &str) -> Result<Self> {
        let admin_url = admin_url.to_owned();
        let (admin, conn) = tokio_postgres::connect(&admin_url, NoTls).await.context("connecting to TEST_DATABASE_URL")?;
        tokio::spawn(conn);
        admin.execute("SELECT pg_advisory_lock(727272)", &[]).await?;
        let fingerprint = migrations_fingerprint();
        let template = format!("{TEMPLATE_PREFIX}_{}", &fingerprint[..fingerprint.len().min(16)]);
        let template = template.as_str();
        let exists = admin
            .query_opt(
                "SELECT 1 FROM pg_database d JOIN pg_shdescription s ON s.objoid = d.oid WHERE d.datname = $1 AND s.description = $2",
                &[&template, &fingerprint],
            )
            .await?
            .is_some();
        if !exists {
            admin.batch_execute(&format!("DROP DATABASE IF EXISTS {template} WITH (FORCE)")).await?;
            admin.batch_execute(&format!("CREATE DATABASE {template}")).await?;
            let status = Command::new(bin("agentloop-worker"))
                .arg("migrate")
                .env("DATABASE_URL", url_on(&admin_url, template))
                .env("RUST_LOG", "warn")
                .status()?;
            if !status.success() {
                bail!("migrating the template failed");
            }
            // The binary must hold every migration on disk as it is there (one built before a
            // migration was added or changed would leave a template that looks current but
            // lacks it, or ran other SQL).
            let gap = agentloop_shared::db::schema_gap(&url_on(&admin_url, template)).await?;
            if !gap.missing.is_empty() || !gap.changed.is_empty() {
                admin.batch_execute(&format!("DROP DATABASE IF EXISTS {template} WITH (FORCE)")).await?;
                bail!(
                    "{} migrated the template with other migrations than those on disk (missing {:?}, changed {:?}): rebuild it (cargo build --workspace)",
                    bin("agentloop-worker").display(),
                    gap.missing,
                    gap.changed
                );
            }
            admin.batch_execute(&format!("COMMENT ON DATABASE {template} IS '{fingerprint}'")).await?;
        }
        let name = format!("t_{}", uuid::Uuid::new_v4().simple());
        let created = admin.batch_execute(&format!("CREATE DATABASE {name} TEMPLATE {template}")).await;
        admin.execute("SELECT pg_advisory_unlock(727272)", &[]).await?;
        created?;
        Ok(Self { url: url_on(&admin_url, &name), name, admin: admin_url })
    }

    /// A plain client for assertions on rows.
    pub async fn client(&self) -> Result<tokio_postgres::Client> {
        let (client, conn) = tokio_postgres::connect(&self.url, NoTls).await?;
        tokio::spawn(conn);
        Ok(client)
    }
}

fn migrations_fingerprint() -> String {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations");
    let mut entries: Vec<_> = std::fs::read_dir(&dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    entries.sort();
    let mut acc = String::new();
    for e in entries {
        if let Ok(up) = std::fs::read_to_string(e.join("up.sql")) {
            // The directory's name, not its path: checkouts of the same migrations share a template.
            acc.push_str(&e.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default());
            acc.push_str(&up);
        }
    }
    format!("{:x}", md5_like(acc.as_bytes()))
}

fn md5_like(bytes: &[u8]) -> u64 {
    // FNV-1a: a fingerprint, not security.
    bytes.iter().fold(0xcbf29ce484222325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100000001b3))
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let (name, admin_url) = (self.name.clone(), self.admin.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async move {
                if let Ok((admin, conn)) = tokio_postgres::connect(&admin_url, NoTls).await {
                    tokio::spawn(conn);
                    let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
                }
            });
        })
        .join();
    }
}

/// A child process killed (SIGKILL) when dropped.
pub struct Proc {
    pub name: String,
    pub child: Child,
}

impl Proc {
    /// The process id.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends `signal` to the process.
    pub fn signal(&self, signal: Signal) {
        let _ = kill(Pid::from_raw(self.pid()), signal);
    }

    /// Waits up to `timeout` for the process to exit; returns whether it exited.
    pub fn wait_exit(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawns `cmd` with stdout and stderr in `test-output/<test>/<name>.log`.
pub fn spawn_logged(test: &str, name: &str, mut cmd: Command) -> Result<Proc> {
    let dir = log_dir(test);
    let log = std::fs::File::create(dir.join(format!("{name}.log")))?;
    cmd.stdout(Stdio::from(log.try_clone()?)).stderr(Stdio::from(log)).stdin(Stdio::null());
    let child = cmd.spawn().with_context(|| format!("spawning {name}"))?;
    Ok(Proc { name: name.to_owned(), child })
}

/// The scripted mock model server.
pub struct MockModel {
    pub url: String,
    _proc: Proc,
}

impl MockModel {
    /// Starts `mock-model` on a free loopback port.
    pub fn start() -> Result<Self> {
        let mut child = Command::new(bin("mock-model"))
            .args(["--listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .stdin(Stdio::null())
            .spawn()?;
        let stdout = child.stdout.take().context("mock stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let url = line.trim().strip_prefix("MOCK_MODEL_URL=").context("mock-model did not print its URL")?.to_owned();
        Ok(Self { url, _proc: Proc { name: "mock-model".into(), child } })
    }

    /// Every chat-completions request body the mock received, in order.
    pub async fn requests(&self) -> Result<Vec<Value>> {
        Ok(reqwest::get(format!("{}/_mock/requests", self.url)).await?.json().await?)
    }
}

/// Installs rustls's ring provider once (reqwest is built without a default provider).
pub fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// A free loopback port for a process the test starts (bound then released), never handed out
/// twice by this process. Taken below Linux's ephemeral range (32768..=60999): a port from that
/// range, released, could be taken as the source port of any outgoing connection of a parallel
/// test before the process binds it (CI: an api of the load-balancer test failed with "Address
/// already in use"); outside it only an explicit bind can take it. Falls back to a port the
/// kernel picks.
pub fn free_port() -> u16 {
    use rand::Rng;
    static HANDED: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut handed = HANDED.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = rand::rng();
    for _ in 0..200 {
        let port = rng.random_range(20_000..32_000);
        if !handed.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            handed.push(port);
            return port;
        }
    }
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

/// Enqueues with SQL, for benchmarks and SQL-level tests: `$2` threads of principal `$1` (uuid,
/// which must exist), each with one user message `$3` (text) and one `queued` run of model
/// `mock`. One statement; no journal rows and no NOTIFY (a worker started afterwards claims at
/// start-up).
pub const ENQUEUE_SQL: &str = "
WITH t AS (
    INSERT INTO threads (id, owner_id, title, message_count, last_sequence, last_timestamp_ms)
    SELECT gen_random_uuid(), $1, 'bench', 1, 1, (extract(epoch from clock_timestamp()) * 1000)::bigint
    FROM generate_series(1, $2::int)
    RETURNING id, last_timestamp_ms
), m AS (
    INSERT INTO messages (thread_id, sequence, timestamp_ms, role, content, token_estimate, byte_size)
    SELECT id, 1, last_timestamp_ms, 'user', to_jsonb($3::text), 10, length($3::text) + 2 FROM t
)
INSERT INTO runs (id, thread_id, principal_id, status, model, queued_at)
SELECT gen_random_uuid(), id, $1, 'queued', 'mock', now() FROM t";

/// Limits of the api (issue 10) set high for tests and benchmarks that are not about limits:
/// one principal there makes far more requests, runs and live connections than the defaults
/// allow. Tests of the limits override them through `StackOptions::api_env`.
pub const GENEROUS_LIMITS: &[(&str, &str)] = &[
    ("API_RATE_PER_SECOND", "100000"),
    ("API_RATE_BURST", "100000"),
    ("AUTH_FAILURES_PER_MINUTE", "100000"),
    ("LIVE_MAX_PER_PRINCIPAL", "100000"),
    ("LIVE_MAX_CONNECTIONS", "100000"),
    ("MAX_ACTIVE_RUNS_PER_PRINCIPAL", "100000"),
    ("MAX_QUEUED_TURNS_PER_PRINCIPAL", "100000"),
    ("MAX_THREADS_PER_PRINCIPAL", "1000000"),
];

/// Options of a test stack.
#[derive(Clone)]
pub struct StackOptions {
    pub workers: usize,
    /// Admin URL of the server to create the test database on (default `TEST_DATABASE_URL`).
    pub server: Option<String>,
    /// Extra environment for every worker (e.g. `WORKER_LEASE_MS`).
    pub worker_env: Vec<(String, String)>,
    /// Extra environment for the api.
    pub api_env: Vec<(String, String)>,
    /// Connect the api (all its connections, listener included) through [`Stack::proxy`].
    pub api_through_proxy: bool,
    /// Connect every worker through [`Stack::proxy`].
    pub workers_through_proxy: bool,
}

impl Default for StackOptions {
    fn default() -> Self {
        Self { workers: 1, server: None, worker_env: Vec::new(), api_env: Vec::new(), api_through_proxy: false, workers_through_proxy: false }
    }
}

/// A whole stack for one test: database, mock model, api, workers, an API key.
pub struct Stack {
    pub test: String,
    pub db: TestDb,
    pub mock: MockModel,
    pub api: Proc,
    pub api_url: String,
    pub workers: Vec<Proc>,
    pub key: String,
    /// The TCP proxy to PostgreSQL, when [`StackOptions::api_through_proxy`] or
    /// [`StackOptions::workers_through_proxy`] is set (the test's own clients connect directly).
    pub proxy: Option<proxy::Proxy>,
    options: StackOptions,
    next_worker: usize,
}

impl Stack {
    /// Starts everything and waits until the api is ready.
    pub async fn start(test: &str, options: StackOptions) -> Result<Self> {
        install_crypto();
        let db = TestDb::create_on(&options.server.clone().unwrap_or_else(admin_url)).await?;
        let mock = MockModel::start()?;
        let key = create_key(&db.url, "tester")?;
        let proxy = if options.api_through_proxy || options.workers_through_proxy {
            Some(proxy::Proxy::start(&host_port(&db.url)).await?)
        } else {
            None
        };
        let via = |on: bool| match (&proxy, on) {
            (Some(p), true) => p.url(&db.url),
            _ => db.url.clone(),
        };
        let api_db_url = via(options.api_through_proxy);
        let port = free_port();
        let api = spawn_logged(test, "api", api_command(&api_db_url, port, &mock.url, &options.api_env))?;
        let api_url = format!("http://127.0.0.1:{port}");
        let mut stack = Self {
            test: test.to_owned(),
            db,
            mock,
            api,
            api_url,
            workers: Vec::new(),
            key,
            proxy,
            options: options.clone(),
            next_worker: 0,
        };
        for _ in 0..options.workers {
            stack.add_worker(&[])?;
        }
        stack.wait_ready(Duration::from_secs(20)).await?;
        Ok(stack)
    }

    /// Kills the api process (SIGKILL) and starts a new one with the same settings on the same
    /// port; returns when it is ready.
    pub async fn restart_api(&mut self) -> Result<()> {
        self.api.signal(Sig::SIGKILL);
        let port: u16 = self.api_url.rsplit(':').next().and_then(|p| p.parse().ok()).context("the api's port")?;
        let db_url = match (&self.proxy, self.options.api_through_proxy) {
            (Some(p), true) => p.url(&self.db.url),
            _ => self.db.url.clone(),
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        self.api = spawn_logged(&self.test, "api-restarted", api_command(&db_url, port, &self.mock.url, &self.options.api_env))?;
        self.wait_ready(Duration::from_secs(20)).await
    }

    /// Starts one more worker process with the stack's worker environment plus `extra`;
    /// returns its index in `workers`.
    pub fn add_worker(&mut self, extra: &[(&str, &str)]) -> Result<usize> {
        let n = self.next_worker;
        self.next_worker += 1;
        let url = match (&self.proxy, self.options.workers_through_proxy) {
            (Some(p), true) => p.url(&self.db.url),
            _ => self.db.url.clone(),
        };
        let mut cmd = Command::new(bin("agentloop-worker"));
        cmd.arg("run")
            .env("DATABASE_URL", &url)
            .env("MODEL_BASE_URL", format!("{}/v1", self.mock.url))
            .env("MODEL_NAME", "mock")
            .env("WORKER_ID", format!("w{n}"))
            .env("RUST_LOG", "info");
        for (k, v) in &self.options.worker_env {
            cmd.env(k, v);
        }
        for (k, v) in extra {
            cmd.env(k, v);
        }
        self.workers.push(spawn_logged(&self.test, &format!("worker-{n}"), cmd)?);
        Ok(self.workers.len() - 1)
    }

    async fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(r) = reqwest::get(format!("{}/readyz", self.api_url)).await
                && r.status().is_success()
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("api not ready within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// An API client authenticated with the stack's key.
    pub fn client(&self) -> Client {
        Client { base: self.api_url.clone(), key: Some(self.key.clone()), http: test_http() }
    }

    /// An API client of another principal `name`.
    pub fn client_for(&self, name: &str) -> Result<Client> {
        let key = create_key(&self.db.url, name)?;
        Ok(Client { base: self.api_url.clone(), key: Some(key), http: test_http() })
    }
}

/// The api's command: `run` on `127.0.0.1:port` against `db_url`, the mock model at `mock_url`,
/// generous limits, then `extra` environment.
fn api_command(db_url: &str, port: u16, mock_url: &str, extra: &[(String, String)]) -> Command {
    let mut cmd = Command::new(bin("agentloop-api"));
    cmd.arg("run")
        .env("DATABASE_URL", db_url)
        .env("API_LISTEN", format!("127.0.0.1:{port}"))
        .env("MODEL_BASE_URL", format!("{mock_url}/v1"))
        .env("MODEL_NAME", "mock")
        .env("API_WORKERS", "2")
        .env("DB_POOL_SIZE", "8")
        .env("RUST_LOG", "info")
        .envs(GENEROUS_LIMITS.iter().copied());
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd
}

/// `host:port` of a `postgres://[user@]host:port/db` URL.
fn host_port(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    authority.rsplit_once('@').map_or(authority, |(_, h)| h).to_owned()
}

/// Creates an API key of `principal` in the database at `url` (`agentloop-worker create-key`).
pub fn create_key(url: &str, principal: &str) -> Result<String> {
    let out = Command::new(bin("agentloop-worker"))
        .args(["create-key", "--principal", principal])
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "warn")
        .output()?;
    if !out.status.success() {
        bail!("create-key failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

/// The tests' HTTP client: idle pooled connections are dropped after 2 s, below the api's 5 s
/// keep-alive, so a request never goes out on a connection the server is closing at that moment
/// (which fails with "connection closed before message completed").
pub fn test_http() -> reqwest::Client {
    reqwest::Client::builder().pool_idle_timeout(Duration::from_secs(2)).build().expect("an HTTP client")
}

/// A thin JSON client of the API.
#[derive(Clone)]
pub struct Client {
    pub base: String,
    pub key: Option<String>,
    pub http: reqwest::Client,
}

/// Status and JSON body of a response.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
}

impl Client {
    /// Sends a request; `body` None means no body.
    pub async fn send(&self, method: reqwest::Method, path: &str, body: Option<Value>, headers: &[(&str, &str)]) -> Result<Reply> {
        let mut req = self.http.request(method, format!("{}{}", self.base, path));
        if let Some(key) = &self.key {
            req = req.bearer_auth(key);
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if let Some(body) = body {
            req = req.json(&body);
        }
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        let text = resp.text().await?;
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok(Reply { status, body })
    }

    pub async fn get(&self, path: &str) -> Result<Reply> {
        self.send(reqwest::Method::GET, path, None, &[]).await
    }

    pub async fn post(&self, path: &str, body: Value) -> Result<Reply> {
        self.send(reqwest::Method::POST, path, Some(body), &[]).await
    }

    /// Creates a thread and returns its id.
    pub async fn create_thread(&self) -> Result<String> {
        let r = self.post("/api/threads", json!({"title": "test"})).await?;
        anyhow::ensure!(r.status == 201, "create thread: {r:?}");
        Ok(r.body["id"].as_str().context("thread id")?.to_owned())
    }

    /// Posts a chat message; returns the 202 body.
    pub async fn chat(&self, thread: &str, content: &str) -> Result<Value> {
        let r = self.post(&format!("/api/threads/{thread}/chat"), json!({"content": content})).await?;
        anyhow::ensure!(r.status == 202, "chat: {r:?}");
        Ok(r.body)
    }

    /// Polls `GET /api/runs/{id}` until the run is terminal; returns it.
    pub async fn wait_terminal(&self, run: &str, timeout: Duration) -> Result<Value> {
        self.wait_run(run, timeout, |r| matches!(r["status"].as_str(), Some("completed" | "failed" | "cancelled"))).await
    }

    /// Polls the run until `pred` holds.
    pub async fn wait_run(&self, run: &str, timeout: Duration, pred: impl Fn(&Value) -> bool) -> Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let r = self.get(&format!("/api/runs/{run}")).await?;
            if r.status == 200 && pred(&r.body) {
                return Ok(r.body);
            }
            if Instant::now() > deadline {
                bail!("run {run} did not reach the expected state within {timeout:?}: {}", r.body);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A chat text that makes the mock follow `steps` (see the mock-model binary's docs).
pub fn script(steps: Value) -> String {
    format!("scripted {} MOCK: {}", uuid::Uuid::new_v4().simple(), json!({"steps": steps}))
}

/// A private PostgreSQL cluster (initdb + pg_ctl from the system's binaries) for tests that
/// restart the server; stopped and removed on drop. Runs as the `postgres` user when root.
pub struct PgCluster {
    dir: PathBuf,
    bindir: PathBuf,
    pub port: u16,
}

impl PgCluster {
    /// Initialises and starts a trust-auth cluster on a free loopback port (`fsync=off`).
    pub fn start() -> Result<Self> {
        let mut bindirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .context("no /usr/lib/postgresql: install Debian's postgresql package")?
            .flatten()
            .map(|e| e.path().join("bin"))
            .filter(|p| p.join("pg_ctl").exists())
            .collect();
        bindirs.sort();
        let bindir = bindirs.pop().context("no PostgreSQL server binaries")?;
        let dir = std::env::temp_dir().join(format!("agentloop-pg-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir)?;
        let port = free_port();
        let cluster = Self { dir, bindir, port };
        cluster.as_owner(&["chown", "-R", "postgres", &cluster.dir.display().to_string()], true)?;
        cluster.pg(&["initdb", "-D", &cluster.data(), "-A", "trust", "-U", "postgres", "--no-sync"])?;
        cluster.ctl(&["start"])?;
        Ok(cluster)
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    fn as_owner(&self, args: &[&str], plain: bool) -> Result<()> {
        let root = nix::unistd::geteuid().is_root();
        let status = if plain || !root {
            if plain && !root {
                return Ok(());
            }
            Command::new(args[0]).args(&args[1..]).stdout(Stdio::null()).status()?
        } else {
            Command::new("runuser").args(["-u", "postgres", "--"]).args(args).stdout(Stdio::null()).status()?
        };
        anyhow::ensure!(status.success(), "{args:?} failed");
        Ok(())
    }

    fn pg(&self, args: &[&str]) -> Result<()> {
        let program = self.bindir.join(args[0]).display().to_string();
        let mut full = vec![program.as_str()];
        full.extend(&args[1..]);
        self.as_owner(&full, false)
    }

    fn ctl(&self, action: &[&str]) -> Result<()> {
        let opts = format!("-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off", self.port, self.dir.display());
        let log = self.dir.join("log").display().to_string();
        let data = self.data();
        let mut args = vec!["pg_ctl", "-D", &data, "-o", &opts, "-l", &log, "-w", "-m", "fast"];
        args.extend(action);
        self.pg(&args)
    }

    /// The superuser URL of its `postgres` database.
    pub fn admin_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Restarts the server (fast shutdown: every connection is terminated).
    pub fn restart(&self) -> Result<()> {
        self.ctl(&["restart"])
    }

    /// Stops the server (fast shutdown: every connection is terminated; connects are refused
    /// until [`PgCluster::start_again`]).
    pub fn stop(&self) -> Result<()> {
        self.ctl(&["stop"])
    }

    /// Starts the server stopped by [`PgCluster::stop`] again, on the same port.
    pub fn start_again(&self) -> Result<()> {
        self.ctl(&["start"])
    }

    /// The cluster's directory: `data/`, the socket, and the server log `log`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let _ = self.ctl(&["stop"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Signals re-exported for fault tests.
pub use nix::sys::signal::Signal as Sig;

pub mod chaos;
pub mod cluster;
