//! agentloop worker: claims runs under expiring leases and executes slices (SPEC §5-§6).
//!
//! [`runner`] is the claim loop (concurrency, wake-ups, shutdown); [`control`] the per-slice
//! abort signal and the one lease keeper; [`slice`] is one slice, [`tool_calls`] its tool
//! calls, [`compact`] compaction, [`streaming`] the one stream flusher of the process.

pub mod client_tools;
pub mod compact;
pub mod control;
pub mod fleet;
pub mod hidden_threads;
pub mod maintenance;
pub mod runner;
pub mod slice;
pub mod slot_yield;
pub mod streaming;
pub mod test_tools;
pub mod title;
pub mod tool_calls;
pub mod webhooks;

use std::time::Duration;

use agentloop_shared::config::{DbArgs, parse_millis};
use agentloop_shared::provider::catalog::ModelArgs;

/// Options of `agentloop-worker run` (defaults from SPEC §12).
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerConfig {
    #[command(flatten)]
    pub db: DbArgs,

    #[command(flatten)]
    pub models: ModelArgs,

    /// Slices this process runs at once (>= 1).
    #[arg(long, env = "WORKER_CONCURRENCY", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub concurrency: u32,

    /// Prefix of this worker's identity (default: the hostname); the pid and a random suffix are
    /// always appended, so a restarted process never reuses an identity.
    #[arg(long, env = "WORKER_ID")]
    pub worker_id: Option<String>,

    /// How often in ms this process may ask, between two steps of a slice, whether its slot is
    /// wanted by another principal with fewer runs running (only while every slot is busy and
    /// a run was queued since; `worker::slot_yield`, migration 000042); the run whose slot is
    /// wanted goes back to the queue with its progress. 0: never give a slot back before its
    /// slice ends.
    #[arg(long, env = "WORKER_YIELD_CHECK_MS", default_value = "1000", value_parser = parse_millis)]
    pub yield_check: Duration,

    /// Lease duration in ms; a run whose lease is not renewed within it is claimable by others.
    #[arg(long, env = "WORKER_LEASE_MS", default_value = "15000", value_parser = agentloop_shared::config::millis_at_least("WORKER_LEASE_MS", 500))]
    pub lease: Duration,

    /// Lease renewal interval in ms (must be below half the lease).
    #[arg(long, env = "WORKER_RENEW_MS", default_value = "5000", value_parser = agentloop_shared::config::millis_at_least("WORKER_RENEW_MS", 100))]
    pub renew: Duration,

    /// Tool calls per slice; reaching it ends the slice and requeues the same run
    /// (seed 000's ChatLimits.MaxIterations).
    #[arg(long, env = "WORKER_TOOL_CALL_LIMIT", default_value_t = 25, value_parser = clap::value_parser!(u32).range(1..))]
    pub tool_call_limit: u32,

    /// Consecutive attempts of a run that ended by a fault without progress (a lease that
    /// expired, a hand-back after a transient database fault) after which it fails `abandoned`.
    #[arg(long, env = "WORKER_MAX_RECOVERIES", default_value_t = 5, value_parser = clap::value_parser!(i32).range(0..))]
    pub max_recoveries: i32,

    /// Runs a claim pass may also start (their first slice's start written in the claim's
    /// transaction: one transaction and one round trip less per run), asked only while the
    /// claim loop is under half busy; 0 starts none (each slice then starts itself). At most 32
    /// (each is a subtransaction).
    #[arg(long, env = "WORKER_CLAIM_STARTS", default_value_t = 16, value_parser = clap::value_parser!(u32).range(0..=32))]
    pub claim_starts: u32,

    /// How long in ms a slice keeps a paid model answer it could not checkpoint because the
    /// database was away (an outage: connections refused or lost, shutdown, disk full), trying
    /// the same fenced commit every second; 0 keeps it only as long as the lease. Memory: at
    /// most one answer per slot (`WORKER_CONCURRENCY`).
    #[arg(long, env = "WORKER_OUTAGE_HOLD_MS", default_value = "300000", value_parser = parse_millis)]
    pub outage_hold: Duration,

    /// Longest time in ms a model's response may go without anything that carries part of the
    /// answer (no byte at all, the wait for its headers included, or only keep-alives and
    /// empty deltas) before the call is given up as `model_stream_stalled` (a stream stuck with
    /// its connection open would otherwise hold its slot forever).
    #[arg(long, env = "MODEL_STREAM_IDLE_MS", default_value = "300000", value_parser = agentloop_shared::config::millis_at_least("MODEL_STREAM_IDLE_MS", 1000))]
    pub model_stream_idle: Duration,

    /// How long in ms a slice goes on calling the model again after a call failed transiently
    /// (rate limited, 5xx, connection refused or cut, a stream cut short or stalled — each call
    /// already retried 3 times by the client), with a pause doubling from 1 s to 30 s, before
    /// the run fails with the error's code; the run keeps its slot and lease meanwhile, and a
    /// cancel or shutdown ends the wait. 0: fail after the client's retries. Runs of
    /// `/v1/chat/completions` (whose caller waits and retries itself) never wait.
    #[arg(long, env = "MODEL_RETRY_MS", default_value = "120000", value_parser = parse_millis)]
    pub model_retry: Duration,

    /// Largest model answer in bytes (text + reasoning + tool calls) a slice assembles; a
    /// longer one is cut and the run fails `model_answer_too_large`. Bounds a slice's memory.
    #[arg(long, env = "MODEL_MAX_ANSWER_BYTES", default_value_t = agentloop_shared::provider::client::DEFAULT_MAX_ANSWER_BYTES,
          value_parser = agentloop_shared::config::count_at_least("MODEL_MAX_ANSWER_BYTES", 1024))]
    pub model_max_answer_bytes: usize,

    /// Idle safety poll in ms (covers a missed notification; no other periodic queue query).
    #[arg(long, env = "WORKER_SAFETY_POLL_MS", default_value = "60000", value_parser = agentloop_shared::config::millis_at_least("WORKER_SAFETY_POLL_MS", 100))]
    pub safety_poll: Duration,

    /// Grace period in ms for in-flight slices to hand their runs back on SIGTERM/SIGINT.
    #[arg(long, env = "WORKER_SHUTDOWN_GRACE_MS", default_value = "10000", value_parser = parse_millis)]
    pub shutdown_grace: Duration,

    /// On SIGTERM/SIGINT, how long in ms a call with external effects already sent is waited for,
    /// counted from when it was sent, even past `WORKER_SHUTDOWN_GRACE_MS`: its outcome is then
    /// known and committed instead of left `uncertain` (a blocked run a human must resolve).
    /// Default above the default HTTP tool and MCP call timeouts (60 s); keep the supervisor's
    /// stop timeout (systemd `TimeoutStopSec`, Kubernetes `terminationGracePeriodSeconds`) above
    /// both (acceptance probe E: a 20 s call cut at the 10 s grace blocked its run).
    #[arg(long, env = "WORKER_EFFECT_DRAIN_MS", default_value = "65000", value_parser = parse_millis)]
    pub effect_drain: Duration,

    /// Interval in ms between flushes of the streaming partial answers (one transaction for all
    /// of the process's streams).
    #[arg(long, env = "WORKER_STREAM_THROTTLE_MS", default_value = "250", value_parser = agentloop_shared::config::millis_at_least("WORKER_STREAM_THROTTLE_MS", 10))]
    pub stream_throttle: Duration,

    /// Address of the health/metrics endpoint (Prometheus text at any path, e.g.
    /// `127.0.0.1:9101`); none when unset.
    #[arg(long, env = "WORKER_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,

    /// Interval in ms between maintenance passes (retention of receipts, journal, steps and
    /// deleted threads, in bounded batches).
    #[arg(long, env = "MAINTENANCE_INTERVAL_MS", default_value = "600000", value_parser = agentloop_shared::config::millis_at_least("MAINTENANCE_INTERVAL_MS", 100))]
    pub maintenance_interval: Duration,

    /// Hours command receipts are kept (at least 24, SPEC §11).
    #[arg(long, env = "RECEIPT_RETENTION_HOURS", default_value_t = 24, value_parser = clap::value_parser!(i64).range(24..))]
    pub receipt_retention_hours: i64,

    /// Journal events kept per thread; a resume below them gets a `reset` (SPEC §10).
    #[arg(long, env = "JOURNAL_RETENTION_EVENTS", default_value_t = 2000, value_parser = clap::value_parser!(i64).range(1..))]
    pub journal_retention_events: i64,

    /// Hours the step rows (`run_steps`) of a run that ended are kept; the run row, its usage
    /// and its messages stay.
    #[arg(long, env = "RUN_STEP_RETENTION_HOURS", default_value_t = 720, value_parser = clap::value_parser!(i64).range(0..))]
    pub run_step_retention_hours: i64,

    /// Hours a soft-deleted thread is kept before it is deleted with everything under it.
    #[arg(long, env = "DELETED_THREAD_RETENTION_HOURS", default_value_t = 168, value_parser = clap::value_parser!(i64).range(0..))]
    pub deleted_thread_retention_hours: i64,

    /// Upper bound of the built-in `sleep` tool, in seconds.
    #[arg(long, env = "TOOL_MAX_SLEEP_SECONDS", default_value_t = 30)]
    pub max_sleep_seconds: u64,

    /// JSON file with tool policies (auto|ask|deny), idempotency overrides, MCP servers and HTTP
    /// tools (see `agentloop_shared::tools::config`); none: built-in tools, all `auto`.
    #[arg(long, env = "TOOLS_FILE")]
    pub tools_file: Option<std::path::PathBuf>,

    /// Deadline in ms of a tool approval; undecided calls are then rejected with reason
    /// `expired` and the run continues (default 24 h).
    #[arg(long, env = "APPROVAL_TIMEOUT_MS", default_value = "86400000", value_parser = agentloop_shared::config::millis_at_least("APPROVAL_TIMEOUT_MS", 1000))]
    pub approval_timeout: Duration,

    /// Interval in ms of the sweep of hidden threads whose OpenAI-endpoint request was abandoned
    /// (its api process died): their runs are cancelled and the threads deleted.
    #[arg(long, env = "HIDDEN_THREAD_SWEEP_MS", default_value = "10000", value_parser = agentloop_shared::config::millis_at_least("HIDDEN_THREAD_SWEEP_MS", 100))]
    pub hidden_thread_sweep: Duration,

    /// Interval in ms at which the worker publishes its tool policies and reads the other live
    /// workers' (rows not seen for 4 intervals are of workers gone): each worker applies the
    /// strictest policy of the live fleet for every tool (`worker/src/fleet.rs`).
    #[arg(long, env = "FLEET_POLICY_REFRESH_MS", default_value = "5000", value_parser = agentloop_shared::config::millis_at_least("FLEET_POLICY_REFRESH_MS", 100))]
    pub fleet_policy_refresh: Duration,

    /// The apis' lease of an OpenAI-endpoint request in ms (set it as on the apis): after a
    /// database outage the sweep spares leases that expired since it began plus this long.
    #[arg(long, env = "OPENAI_REQUEST_LEASE_MS", default_value = "30000", value_parser = agentloop_shared::config::millis_at_least("OPENAI_REQUEST_LEASE_MS", 1000))]
    pub openai_request_lease: Duration,

    #[command(flatten)]
    pub webhooks: agentloop_shared::webhooks::WebhookArgs,

    /// MCP sign-in (`OAUTH_TOKENS_KEY`, `OAUTH_REDIRECT_URL`, `OAUTH_SIGNIN_TTL_MS`).
    #[command(flatten)]
    pub oauth: agentloop_shared::mcp_auth::OAuthArgs,

    /// Webhook deliveries this worker sends at once.
    #[arg(long, env = "WEBHOOK_CONCURRENCY", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub webhook_concurrency: u32,

    /// Webhook delivery attempts of one principal in flight at once across all workers: one
    /// tenant's endpoints that never answer cannot hold every delivery slot (migration 000040).
    #[arg(long, env = "WEBHOOK_CONCURRENCY_PER_PRINCIPAL", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub webhook_concurrency_per_principal: u32,

    /// Attempts of a webhook delivery before it is marked `failed`.
    #[arg(long, env = "WEBHOOK_MAX_ATTEMPTS", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    pub webhook_max_attempts: u32,

    /// Delay in ms before the first retry of a webhook delivery; doubled after each failed
    /// attempt (with jitter: a random point in the upper half), up to `WEBHOOK_RETRY_MAX_MS`.
    #[arg(long, env = "WEBHOOK_RETRY_BASE_MS", default_value = "10000", value_parser = agentloop_shared::config::millis_at_least("WEBHOOK_RETRY_BASE_MS", 10))]
    pub webhook_retry_base: Duration,

    /// Longest delay in ms between two attempts of a webhook delivery.
    #[arg(long, env = "WEBHOOK_RETRY_MAX_MS", default_value = "3600000", value_parser = agentloop_shared::config::millis_at_least("WEBHOOK_RETRY_MAX_MS", 10))]
    pub webhook_retry_max: Duration,

    /// Bound in ms of one webhook attempt (connect, send, answer); a delivery is leased for this
    /// plus 5 s, after which another worker sends it again.
    #[arg(long, env = "WEBHOOK_TIMEOUT_MS", default_value = "10000", value_parser = agentloop_shared::config::millis_at_least("WEBHOOK_TIMEOUT_MS", 100))]
    pub webhook_timeout: Duration,

    /// Hours a delivered or failed webhook delivery (and its attempts) is kept.
    #[arg(long, env = "WEBHOOK_DELIVERY_RETENTION_HOURS", default_value_t = 168, value_parser = clap::value_parser!(i64).range(0..))]
    pub webhook_delivery_retention_hours: i64,

    /// TESTS ONLY: also register the non-idempotent `record_effect` tool, which counts its
    /// executions in the table `agentloop_test_effects` of this database.
    #[arg(long, env = "AGENTLOOP_TEST_TOOLS", default_value_t = false, action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub test_tools: bool,
}

impl WorkerConfig {
    /// Checks cross-option bounds (SPEC §12: renew < lease/2).
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.renew * 2 < self.lease, "renew interval must be below half the lease");
        Ok(())
    }
}

/// This process's worker identity: `<prefix>-<pid>-<6 hex>`.
pub fn worker_identity(prefix: Option<&str>) -> String {
    let prefix = prefix
        .map(str::to_owned)
        .unwrap_or_else(|| gethostname::gethostname().to_string_lossy().into_owned());
    format!("{prefix}-{}-{:06x}", std::process::id(), rand_suffix())
}

fn rand_suffix() -> u32 {
    (uuid::Uuid::new_v4().as_u128() & 0xff_ffff) as u32
}
