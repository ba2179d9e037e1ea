//! A scaled-out test stack: several `agentloop-api` processes behind a real HAProxy (Debian's
//! `haproxy`, running `deploy/haproxy/agentloop.cfg` unchanged) and several workers on one
//! PostgreSQL database, with the mock model. Processes are restarted and killed with real
//! signals; clients talk to the load balancer only.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::sys::signal::Signal;

use crate::{Client, MockModel, Proc, TestDb, bin, create_key, free_port, install_crypto, spawn_logged};

/// The HAProxy binary (`AGENTLOOP_HAPROXY`, else `haproxy` on `PATH` or `/usr/sbin/haproxy`).
pub fn haproxy_binary() -> Option<PathBuf> {
    if let Ok(path) = std::env::var("AGENTLOOP_HAPROXY") {
        return Some(PathBuf::from(path));
    }
    let candidates = std::env::var("PATH").unwrap_or_default();
    std::env::split_paths(&candidates)
        .chain([PathBuf::from("/usr/sbin")])
        .map(|d| d.join("haproxy"))
        .find(|p| p.is_file())
}

/// Options of a [`Cluster`].
#[derive(Clone, Default)]
pub struct ClusterOptions {
    /// Number of api processes (the HAProxy config has two server lines: 1 or 2).
    pub apis: usize,
    pub workers: usize,
    pub api_env: Vec<(String, String)>,
    pub worker_env: Vec<(String, String)>,
}

/// The running cluster.
pub struct Cluster {
    pub test: String,
    pub db: TestDb,
    pub mock: MockModel,
    /// api processes by index (None while stopped); each keeps its port across restarts.
    pub apis: Vec<Option<Proc>>,
    pub api_ports: Vec<u16>,
    pub workers: Vec<Option<Proc>>,
    /// Metrics port of each worker slot.
    pub worker_metrics: Vec<u16>,
    pub lb: Proc,
    /// `http://127.0.0.1:<port>` of the load balancer.
    pub lb_url: String,
    /// `http://127.0.0.1:<port>` of HAProxy's stats frontend.
    pub stats_url: String,
    pub key: String,
    options: ClusterOptions,
    starts: usize,
}

impl Cluster {
    /// Starts database, mock model, apis, workers and HAProxy; waits until HAProxy sees every
    /// api up.
    pub async fn start(test: &str, options: ClusterOptions) -> Result<Self> {
        install_crypto();
        let haproxy = haproxy_binary().context("haproxy is not installed (Debian package `haproxy`; .ci/run installs it)")?;
        anyhow::ensure!((1..=2).contains(&options.apis), "deploy/haproxy/agentloop.cfg has two server lines");
        let db = TestDb::create().await?;
        let mock = MockModel::start()?;
        let key = create_key(&db.url, "tester")?;
        let api_ports: Vec<u16> = (0..2).map(|_| free_port()).collect();
        let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/haproxy/agentloop.cfg");
        // A port found free can be taken by a parallel test before HAProxy binds it (CI saw
        // "cannot bind socket (Address already in use)"): HAProxy then exits at once, and is
        // started again on other ports.
        let mut attempt = 0;
        let (lb, lb_port, stats_port) = loop {
            attempt += 1;
            let (lb_port, stats_port) = (free_port(), free_port());
            let mut cmd = Command::new(&haproxy);
            cmd.args(["-W", "-db", "-f"])
                .arg(&config)
                .env("AGENTLOOP_LB_LISTEN", format!("127.0.0.1:{lb_port}"))
                .env("AGENTLOOP_LB_STATS", format!("127.0.0.1:{stats_port}"))
                .env("AGENTLOOP_API_1", format!("127.0.0.1:{}", api_ports[0]))
                .env("AGENTLOOP_API_2", format!("127.0.0.1:{}", api_ports[1]));
            let mut lb = spawn_logged(test, "haproxy", cmd)?;
            let deadline = std::time::Instant::now() + Duration::from_secs(3);
            let bound = loop {
                if lb.child.try_wait()?.is_some() {
                    break false;
                }
                let up = |port: u16| std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
                if up(lb_port) && up(stats_port) {
                    break true;
                }
                anyhow::ensure!(std::time::Instant::now() < deadline, "haproxy neither listened nor exited within 3 s");
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            if bound {
                break (lb, lb_port, stats_port);
            }
            anyhow::ensure!(attempt < 5, "haproxy could not bind its ports in 5 attempts (see haproxy.log)");
        };
        let mut cluster = Self {
            test: test.to_owned(),
            db,
            mock,
            apis: (0..options.apis).map(|_| None).collect(),
            api_ports,
            workers: Vec::new(),
            worker_metrics: Vec::new(),
            lb,
            lb_url: format!("http://127.0.0.1:{lb_port}"),
            stats_url: format!("http://127.0.0.1:{stats_port}"),
            key,
            options: options.clone(),
            starts: 0,
        };
        for i in 0..options.apis {
            cluster.start_api(i)?;
        }
        for _ in 0..options.workers {
            cluster.workers.push(None);
            cluster.worker_metrics.push(free_port());
            let slot = cluster.workers.len() - 1;
            cluster.start_worker(slot)?;
        }
        for i in 0..options.apis {
            cluster.wait_lb_up(i, Duration::from_secs(30)).await?;
        }
        for i in 0..options.workers {
            cluster.wait_worker_ready(i, Duration::from_secs(30)).await?;
        }
        Ok(cluster)
    }

    /// A client of the load balancer with the cluster's key.
    pub fn client(&self) -> Client {
        Client { base: self.lb_url.clone(), key: Some(self.key.clone()), http: reqwest::Client::new() }
    }

    /// `http://127.0.0.1:<port>` of api `i` (bypassing the load balancer).
    pub fn api_url(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.api_ports[i])
    }

    /// Starts api `i` on its port.
    pub fn start_api(&mut self, i: usize) -> Result<()> {
        self.starts += 1;
        let mut cmd = Command::new(bin("agentloop-api"));
        cmd.arg("run")
            .env("DATABASE_URL", &self.db.url)
            .env("API_LISTEN", format!("127.0.0.1:{}", self.api_ports[i]))
            .env("MODEL_BASE_URL", format!("{}/v1", self.mock.url))
            .env("MODEL_NAME", "mock")
            .env("API_WORKERS", "2")
            .env("RUST_LOG", "info");
        for (k, v) in &self.options.api_env {
            cmd.env(k, v);
        }
        self.apis[i] = Some(spawn_logged(&self.test, &format!("api-{i}-start-{}", self.starts), cmd)?);
        Ok(())
    }

    /// Starts a worker in slot `i` (a new process with a new identity).
    pub fn start_worker(&mut self, i: usize) -> Result<()> {
        self.starts += 1;
        let mut cmd = Command::new(bin("agentloop-worker"));
        cmd.arg("run")
            .env("DATABASE_URL", &self.db.url)
            .env("MODEL_BASE_URL", format!("{}/v1", self.mock.url))
            .env("MODEL_NAME", "mock")
            .env("WORKER_ID", format!("w{i}"))
            .env("WORKER_METRICS_LISTEN", format!("127.0.0.1:{}", self.worker_metrics[i]))
            .env("RUST_LOG", "info");
        for (k, v) in &self.options.worker_env {
            cmd.env(k, v);
        }
        self.workers[i] = Some(spawn_logged(&self.test, &format!("worker-{i}-start-{}", self.starts), cmd)?);
        Ok(())
    }

    /// Sends `signal` to api `i` and, for SIGTERM/SIGKILL, waits for it to exit.
    pub fn signal_api(&mut self, i: usize, signal: Signal, exit_within: Duration) -> Result<()> {
        let mut proc = self.apis[i].take().context("api not running")?;
        proc.signal(signal);
        if !proc.wait_exit(exit_within) {
            bail!("api {i} did not exit within {exit_within:?} after {signal:?}");
        }
        Ok(())
    }

    /// SIGTERM to worker `i`; waits for it to exit.
    pub fn stop_worker(&mut self, i: usize, exit_within: Duration) -> Result<()> {
        let mut proc = self.workers[i].take().context("worker not running")?;
        proc.signal(Signal::SIGTERM);
        if !proc.wait_exit(exit_within) {
            bail!("worker {i} did not exit within {exit_within:?} after SIGTERM");
        }
        Ok(())
    }

    /// HAProxy's stats CSV: one map per proxy/server row (`pxname`, `svname`, `status`,
    /// `wretr` — retries, `wredis` — redispatches, `scur`, `hrsp_5xx`, ...).
    pub async fn lb_stats(&self) -> Result<Vec<HashMap<String, String>>> {
        let text = reqwest::get(format!("{}/stats;csv", self.stats_url)).await?.text().await?;
        let mut lines = text.lines();
        let header: Vec<String> =
            lines.next().context("empty stats")?.trim_start_matches("# ").split(',').map(str::to_owned).collect();
        Ok(lines
            .filter(|l| !l.is_empty())
            .map(|l| header.iter().cloned().zip(l.split(',').map(str::to_owned)).collect())
            .collect())
    }

    /// HAProxy's status of api `i` (`UP`, `DOWN`, `UP 1/2`, ...).
    pub async fn lb_status(&self, i: usize) -> Result<String> {
        let name = format!("api{}", i + 1);
        let stats = self.lb_stats().await?;
        stats
            .iter()
            .find(|r| r.get("pxname").map(String::as_str) == Some("agentloop_api") && r.get("svname") == Some(&name))
            .and_then(|r| r.get("status").cloned())
            .context("server missing from the stats")
    }

    /// Waits until HAProxy's health checks mark api `i` up.
    pub async fn wait_lb_up(&self, i: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.lb_status(i).await.is_ok_and(|s| s == "UP") {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("api {i} not UP at the load balancer within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until worker `i` serves its metrics (it has started its claim loop).
    pub async fn wait_worker_ready(&self, i: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if reqwest::get(format!("http://127.0.0.1:{}/metrics", self.worker_metrics[i])).await.is_ok_and(|r| r.status().is_success()) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("worker {i} not serving metrics within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sum of a Prometheus sample `name` (any labels matching all of `labels`) in api `i`'s
    /// `/metrics`.
    pub async fn api_metric(&self, i: usize, name: &str, labels: &[&str]) -> Result<f64> {
        let text = reqwest::get(format!("{}/metrics", self.api_url(i))).await?.text().await?;
        Ok(sum_metric(&text, name, labels))
    }
}

/// Sum of the samples of `name` in Prometheus text `text` whose label set contains every string
/// of `labels` (e.g. `transport="sse"`).
pub fn sum_metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
