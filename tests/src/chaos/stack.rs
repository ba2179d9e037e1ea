//! The processes of a chaos run: a private PostgreSQL cluster (restartable), the chaos database
//! (from the migrated template, plus the audit triggers), the TCP proxy every process reaches
//! PostgreSQL through, the mock model, the effects receiver, the api process(es) and the workers.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::json;

use super::proxy::Proxy;
use super::receiver::{Delays, Receiver};
use crate::{PgCluster, Proc, TestDb, bin_dir, free_port};

/// Name of the non-idempotent HTTP tool that runs without approval.
pub const EFFECT_TOOL: &str = "effect";
/// Name of the non-idempotent HTTP tool with policy `ask`.
pub const ASK_TOOL: &str = "ask_effect";

/// How to build the stack.
#[derive(Debug, Clone)]
pub struct StackConfig {
    pub workers: usize,
    pub apis: usize,
    pub worker_concurrency: u32,
    pub lease_ms: u64,
    pub renew_ms: u64,
    /// Timeout of the HTTP tools, ms.
    pub tool_timeout_ms: u64,
    pub receiver_delays: Delays,
    pub seed: u64,
    /// Folder of the process logs (its previous process logs and report are removed first).
    pub log_dir: PathBuf,
}

/// One worker process.
pub struct WorkerSlot {
    /// Sequence number (`WORKER_ID=w<n>`, log `worker-<n>.log`).
    pub n: usize,
    pub proc: Proc,
    /// SIGSTOPped and not yet continued.
    pub stopped: bool,
}

/// Everything started for a chaos run. Dropping it kills the processes, drops the database and
/// stops the cluster (unless [`ChaosStack::keep`] was called).
pub struct ChaosStack {
    pub config: StackConfig,
    pub workers: Mutex<Vec<WorkerSlot>>,
    pub apis: Mutex<Vec<Proc>>,
    pub api_urls: Vec<String>,
    pub key: String,
    pub receiver: Receiver,
    pub mock: Mock,
    pub proxy: Proxy,
    /// The chaos database URL through the proxy (what the processes use).
    pub proxied_url: String,
    /// Direct URL of the chaos database (what the harness uses).
    pub db_url: String,
    pub db_name: String,
    db: Option<TestDb>,
    pub cluster: Option<PgCluster>,
    next_worker: AtomicUsize,
    tools_file: PathBuf,
}

impl ChaosStack {
    /// Starts everything and waits until every api is ready.
    pub async fn start(config: StackConfig) -> Result<Self> {
        crate::install_crypto();
        std::fs::create_dir_all(&config.log_dir)?;
        for entry in std::fs::read_dir(&config.log_dir)?.flatten() {
            let p = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let ours = (name.starts_with("api-") || name.starts_with("worker-")) && name.ends_with(".log")
                || ["postgres.log", "report.json", "tools.json"].contains(&name.as_str());
            if ours {
                let _ = std::fs::remove_file(p);
            }
        }
        for name in ["agentloop-api", "agentloop-worker", "mock-model"] {
            let path = bin_dir().join(name);
            if !path.exists() {
                bail!("{} is missing: build the workspace binaries of this profile first", path.display());
            }
        }
        let cluster = tokio::task::spawn_blocking(PgCluster::start).await??;
        live().cluster = Some(cluster.dir().to_path_buf());
        // Settings of the cluster: fast deadlock detection (the lock fault relies on it), room
        // for reconnect storms, and lock waits/deadlocks in the server log as evidence.
        {
            let (admin, conn) = tokio_postgres::connect(&cluster.admin_url(), tokio_postgres::NoTls).await?;
            tokio::spawn(conn);
            for sql in [
                "ALTER SYSTEM SET deadlock_timeout = '100ms'",
                "ALTER SYSTEM SET max_connections = 300",
                "ALTER SYSTEM SET log_lock_waits = on",
                "ALTER SYSTEM SET log_line_prefix = '%m [%p] %a: '",
            ] {
                admin.batch_execute(sql).await?;
            }
        }
        let cluster = tokio::task::spawn_blocking(move || cluster.restart().map(|()| cluster)).await??;
        let db = TestDb::create_on(&cluster.admin_url()).await?;
        let client = db.client().await?;
        super::audit::install(&client).await.context("installing the audit triggers")?;
        drop(client);
        let proxy = Proxy::start(format!("127.0.0.1:{}", cluster.port).parse()?).await?;
        let proxied_url = db.url.replace(&format!("127.0.0.1:{}/", cluster.port), &format!("127.0.0.1:{}/", proxy.addr.port()));
        anyhow::ensure!(proxied_url != db.url, "could not point {} at the proxy", db.url);
        let key = create_key(&db.url, "chaos")?;
        let mock = Mock::start(&config.log_dir)?;
        let receiver = Receiver::start(config.seed ^ 0x5ece_17e5, config.receiver_delays).await?;
        let tools_file = config.log_dir.join("tools.json");
        let schema = json!({"type": "object", "properties": {"token": {"type": "string"}, "note": {"type": "string"}}, "required": ["token"]});
        let tools = json!({
            "tools": {ASK_TOOL: {"policy": "ask"}},
            "httpTools": [
                {"name": EFFECT_TOOL, "description": "Perform an external effect (chaos receiver).", "url": receiver.url(EFFECT_TOOL),
                 "parameters": schema, "timeoutMs": config.tool_timeout_ms},
                {"name": ASK_TOOL, "description": "Perform an external effect after a human approval (chaos receiver).",
                 "url": receiver.url(ASK_TOOL), "parameters": schema, "timeoutMs": config.tool_timeout_ms}
            ]
        });
        std::fs::write(&tools_file, serde_json::to_vec_pretty(&tools)?)?;
        let mut apis = Vec::new();
        let mut api_urls = Vec::new();
        for i in 0..config.apis.max(1) {
            let port = free_port();
            let mut cmd = Command::new(bin_dir().join("agentloop-api"));
            cmd.arg("run")
                .env("DATABASE_URL", &proxied_url)
                .env("API_LISTEN", format!("127.0.0.1:{port}"))
                .env("MODEL_BASE_URL", format!("{}/v1", mock.url))
                .env("MODEL_NAME", "mock")
                .envs(crate::GENEROUS_LIMITS.iter().copied())
                .env("API_WORKERS", "2")
                .env("DB_POOL_SIZE", "8")
                .env("RUST_LOG", "info");
            apis.push(spawn_logged(&config.log_dir, &format!("api-{i}"), cmd)?);
            api_urls.push(format!("http://127.0.0.1:{port}"));
        }
        let stack = Self {
            config,
            workers: Mutex::new(Vec::new()),
            apis: Mutex::new(apis),
            api_urls,
            key,
            receiver,
            mock,
            proxy,
            proxied_url,
            db_url: db.url.clone(),
            db_name: db.name.clone(),
            db: Some(db),
            cluster: Some(cluster),
            next_worker: AtomicUsize::new(0),
            tools_file,
        };
        for _ in 0..stack.config.workers {
            stack.add_worker()?;
        }
        stack.wait_ready(Duration::from_secs(30)).await?;
        Ok(stack)
    }

    /// Starts one more worker process (a new identity); returns its number.
    pub fn add_worker(&self) -> Result<usize> {
        let n = self.next_worker.fetch_add(1, Ordering::Relaxed);
        let c = &self.config;
        let mut cmd = Command::new(bin_dir().join("agentloop-worker"));
        cmd.arg("run")
            .env("DATABASE_URL", &self.proxied_url)
            .env("MODEL_BASE_URL", format!("{}/v1", self.mock.url))
            .env("MODEL_NAME", "mock")
            .env("WORKER_ID", format!("w{n}"))
            .env("WORKER_CONCURRENCY", c.worker_concurrency.to_string())
            .env("WORKER_LEASE_MS", c.lease_ms.to_string())
            .env("WORKER_RENEW_MS", c.renew_ms.to_string())
            // Recoveries are what the faults cause on purpose; the abandon limit is a policy,
            // not a fault, so it is set out of reach.
            .env("WORKER_MAX_RECOVERIES", "1000")
            .env("JOURNAL_RETENTION_EVENTS", "100000000")
            .env("TOOLS_FILE", &self.tools_file)
            .env("RUST_LOG", "info");
        let proc = spawn_logged(&c.log_dir, &format!("worker-{n}"), cmd)?;
        self.workers.lock().expect("workers lock").push(WorkerSlot { n, proc, stopped: false });
        Ok(n)
    }

    async fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for url in &self.api_urls {
            loop {
                if let Ok(r) = reqwest::get(format!("{url}/readyz")).await
                    && r.status().is_success() {
                        break;
                    }
                if Instant::now() > deadline {
                    bail!("api {url} not ready within {timeout:?} (see {})", self.config.log_dir.display());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    /// A direct client of the chaos database (bypasses the proxy).
    pub async fn db(&self) -> Result<tokio_postgres::Client> {
        let (client, conn) = tokio_postgres::connect(&self.db_url, tokio_postgres::NoTls).await?;
        tokio::spawn(conn);
        Ok(client)
    }

    /// Restarts PostgreSQL (fast shutdown; every connection is terminated). Blocking.
    pub fn restart_postgres(&self) -> Result<()> {
        self.cluster.as_ref().context("no cluster")?.restart()
    }

    /// Path of the PostgreSQL server log.
    pub fn postgres_log(&self) -> Option<PathBuf> {
        self.cluster.as_ref().map(|c| c.dir().join("log"))
    }

    /// Leaves the cluster and the database running after the harness exits; returns how to
    /// reach them.
    pub fn keep(&mut self) -> String {
        let cluster = self.cluster.take();
        let db = self.db.take();
        let dir = cluster.as_ref().map(|c| c.dir().display().to_string()).unwrap_or_default();
        let url = self.db_url.clone();
        std::mem::forget(db);
        std::mem::forget(cluster);
        live().cluster = None;
        format!(
            "kept: psql {url}   (cluster in {dir}; stop it with: runuser -u postgres -- /usr/lib/postgresql/*/bin/pg_ctl -D {dir}/data stop)"
        )
    }
}

impl Drop for ChaosStack {
    fn drop(&mut self) {
        // Continue stopped workers so that killing them works promptly.
        if let Ok(workers) = self.workers.get_mut() {
            for w in workers.iter() {
                w.proc.signal(nix::sys::signal::Signal::SIGCONT);
            }
            workers.clear();
        }
        if let Ok(apis) = self.apis.get_mut() {
            apis.clear();
        }
        // Then the database (TestDb's drop), then the cluster.
        self.db.take();
        self.cluster.take();
    }
}

fn spawn_logged(dir: &Path, name: &str, mut cmd: Command) -> Result<Proc> {
    let log = std::fs::File::create(dir.join(format!("{name}.log")))?;
    cmd.stdout(Stdio::from(log.try_clone()?)).stderr(Stdio::from(log)).stdin(Stdio::null());
    let child = cmd.spawn().with_context(|| format!("spawning {name}"))?;
    live().pids.push(child.id() as i32);
    Ok(Proc { name: name.to_owned(), child })
}

/// The scripted mock model (`mock-model`), started here rather than with
/// [`crate::MockModel`] so that its pid is known to [`emergency_cleanup`].
pub struct Mock {
    pub url: String,
    _proc: Proc,
}

impl Mock {
    fn start(log_dir: &Path) -> Result<Self> {
        use std::io::{BufRead, BufReader};
        let log = std::fs::File::create(log_dir.join("mock-model.log"))?;
        let mut child = Command::new(bin_dir().join("mock-model"))
            .args(["--listen", "127.0.0.1:0", "--workers", "4"])
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .stdin(Stdio::null())
            .spawn()?;
        live().pids.push(child.id() as i32);
        let stdout = child.stdout.take().context("mock stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let url = line.trim().strip_prefix("MOCK_MODEL_URL=").context("mock-model did not print its URL")?.to_owned();
        Ok(Self { url, _proc: Proc { name: "mock-model".into(), child } })
    }
}

/// What a harness killed by a signal must not leave behind.
#[derive(Default)]
struct Live {
    pids: Vec<i32>,
    cluster: Option<std::path::PathBuf>,
}

fn live() -> std::sync::MutexGuard<'static, Live> {
    static LIVE: Mutex<Live> = Mutex::new(Live { pids: Vec::new(), cluster: None });
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Forgets a process that has exited (its pid may be reused).
pub fn forget_pid(pid: i32) {
    live().pids.retain(|p| *p != pid);
}

/// For a harness interrupted by SIGINT/SIGTERM (no destructor runs then): SIGKILLs every
/// process it started and stops and removes its PostgreSQL cluster. Blocking.
pub fn emergency_cleanup() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let (pids, cluster) = {
        let mut l = live();
        (std::mem::take(&mut l.pids), l.cluster.take())
    };
    for pid in pids {
        let _ = kill(Pid::from_raw(pid), Signal::SIGCONT);
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
    let Some(dir) = cluster else { return };
    let mut bindirs: Vec<std::path::PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.flatten().map(|e| e.path().join("bin")).filter(|p| p.join("pg_ctl").exists()).collect())
        .unwrap_or_default();
    bindirs.sort();
    if let Some(bindir) = bindirs.pop() {
        let pg_ctl = bindir.join("pg_ctl").display().to_string();
        let data = dir.join("data").display().to_string();
        let args = [pg_ctl.as_str(), "-D", &data, "stop", "-m", "immediate"];
        let status = if nix::unistd::geteuid().is_root() {
            Command::new("runuser").args(["-u", "postgres", "--"]).args(args).stdout(Stdio::null()).stderr(Stdio::null()).status()
        } else {
            Command::new(args[0]).args(&args[1..]).stdout(Stdio::null()).stderr(Stdio::null()).status()
        };
        let _ = status;
    }
    let _ = std::fs::remove_dir_all(dir);
}

fn create_key(url: &str, principal: &str) -> Result<String> {
    let out = Command::new(bin_dir().join("agentloop-worker"))
        .args(["create-key", "--principal", principal])
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "warn")
        .output()?;
    if !out.status.success() {
        bail!("create-key failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}
