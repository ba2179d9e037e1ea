//! The connection pool of the durable write path: deadpool over plain tokio-postgres clients,
//! each with its own prepared-statement cache (a step function is prepared once per
//! connection, then every call is one round trip: Bind/Execute/Sync).
//!
//! Session settings travel in the startup packet (`options`), so a new connection costs no extra
//! round trip: `application_name`, `statement_timeout`, `idle_in_transaction_session_timeout`
//! (5 s: a process stalled inside a transaction releases its row locks),
//! `client_connection_check_interval` ([`crate::db::CLIENT_CHECK_MS`]: a statement whose caller
//! gave up — its call timed out and the connection was dropped — stops within a second instead
//! of running on to `statement_timeout`) and `TimeZone=UTC`
//! (timestamps in JSON are `...+00:00`), and `crate::db::PLANNER_SETTINGS` (plans that do not
//! depend on fresh statistics). TCP keepalives and `tcp_user_timeout` make a dead or
//! half-open peer surface as an error instead of a hang; the caller's per-call timeout covers
//! the rest. Recycling is a local `is_closed()` check (no `SELECT 1` per checkout).

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use deadpool::managed::{self, Metrics, RecycleError, RecycleResult};
use tokio_postgres::types::Type;
use tokio_postgres::{Client, Config, NoTls, Statement};
use tokio_util::task::AbortOnDropHandle;

/// Connection settings of a [`StorePool`].
#[derive(Debug, Clone)]
pub struct PoolSettings {
    /// PostgreSQL URL.
    pub database_url: String,
    /// `application_name` of every connection (`pg_stat_activity`).
    pub application_name: String,
    /// Server-side `statement_timeout`.
    pub statement_timeout: Duration,
    /// Most connections the pool opens.
    pub max_size: usize,
    /// Longest wait for a free connection (back-pressure) or a new one.
    pub wait_timeout: Duration,
}

/// One pooled connection: the client, its prepared statements, and the task driving the socket
/// (aborted with the connection, so a frozen socket cannot leak its driver).
pub struct StoreConn {
    client: Client,
    statements: HashMap<String, Statement>,
    /// Whether step calls defer their notifications to a pipelined second statement
    /// ([`StoreConn::call_json`]).
    defer_notify: bool,
    _driver: AbortOnDropHandle<()>,
}

/// The answer of one step call ([`StoreConn::call_json`]).
#[derive(Debug)]
pub struct CallOutcome {
    /// The function's jsonb result (`null` for SQL NULL).
    pub value: serde_json::Value,
    /// Deferred notifications (`[[channel, payload], ...]`) that the pipelined flush did not send
    /// because its statement failed after the step committed: send them on another connection
    /// (`agentloop_send_deferred`). `None` when there were none or they were sent.
    pub unsent: Option<serde_json::Value>,
}

impl StoreConn {
    /// Calls `SELECT <function>($1::jsonb)` with `arg`; returns the jsonb result. When `arg`
    /// has a `traceparent` member (an api command that may insert a run, see
    /// `crate::commands`) the argument is wrapped in `agentloop_trace(...)`: it puts it into the
    /// transaction-local `agentloop.traceparent` that `agentloop_insert_run` stores on the run
    /// (`migrations/…000012_trace_context`).
    ///
    /// On a connection that defers notifications (the workers' steps,
    /// `migrations/…000018_deferred_notify`) the argument is also wrapped in
    /// `agentloop_defer(...)`: the function's `pg_notify`s are kept in the session and sent by
    /// `SELECT agentloop_flush_notify()`, pipelined right behind the call in the same round trip,
    /// in a transaction of its own that waits for no WAL flush. The step's commit then does not
    /// hold PostgreSQL's database-wide notify lock through its flush, so concurrent steps share
    /// flushes (group commit). The step statement returns the deferred pairs too: when the flush
    /// failed they come back in [`CallOutcome::unsent`]. `defer = false` turns this off for one
    /// call, for a step that is known to notify nothing (a claim that starts no slice): no flush
    /// statement follows it, and a notification it did send would go out in its own transaction.
    pub async fn call_json(&mut self, function: &str, arg: &serde_json::Value, defer: bool) -> Result<CallOutcome, tokio_postgres::Error> {
        let traced = arg.get("traceparent").is_some_and(serde_json::Value::is_string);
        let defer = self.defer_notify && defer;
        let key = match (traced, defer || !self.defer_notify) {
            (false, true) => function.to_owned(),
            (true, true) => format!("{function}+trace"),
            (false, false) => format!("{function}+now"),
            (true, false) => format!("{function}+trace+now"),
        };
        let statement = self
            .prepared(key, &[Type::JSONB], || {
                let argument = if traced { "agentloop_trace($1::jsonb)".to_owned() } else { "$1::jsonb".to_owned() };
                if defer {
                    // OFFSET 0 keeps the call in its own plan node: it runs before the outer
                    // projection reads the setting it filled.
                    format!("SELECT r, current_setting('agentloop.deferred', true) FROM (SELECT {function}(agentloop_defer({argument})) AS r OFFSET 0) s")
                } else {
                    format!("SELECT {function}({argument})")
                }
            })
            .await?;
        if !defer {
            let row = self.client.query_one(&statement, &[arg]).await?;
            let value = row.try_get::<_, Option<serde_json::Value>>(0)?.unwrap_or(serde_json::Value::Null);
            return Ok(CallOutcome { value, unsent: None });
        }
        let flush = self.prepared(FLUSH_KEY.to_owned(), &[], || "SELECT agentloop_flush_notify()".to_owned()).await?;
        // Both requests are written before either answer is awaited (tokio-postgres pipelines
        // the requests of one client in the order they are first polled).
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [arg];
        let (step, flushed) = tokio::join!(self.client.query_one(&statement, &params), self.client.query_one(&flush, &[]));
        let row = step?;
        let value = row.try_get::<_, Option<serde_json::Value>>(0)?.unwrap_or(serde_json::Value::Null);
        let unsent = match flushed {
            Ok(_) => None,
            Err(error) => {
                let pending = row.try_get::<_, Option<String>>(1)?.filter(|p| !p.is_empty());
                let unsent = pending.and_then(|p| serde_json::from_str::<serde_json::Value>(&p).ok());
                if unsent.is_some() {
                    tracing::warn!(db.function = function, %error, "deferred notifications not flushed; sending them on another connection");
                }
                unsent
            }
        };
        Ok(CallOutcome { value, unsent })
    }

    /// The statement cached under `key`, prepared from `sql()` on first use.
    async fn prepared(&mut self, key: String, types: &[Type], sql: impl FnOnce() -> String) -> Result<Statement, tokio_postgres::Error> {
        if let Some(s) = self.statements.get(&key) {
            return Ok(s.clone());
        }
        let s = self.client.prepare_typed(&sql(), types).await?;
        self.statements.insert(key, s.clone());
        Ok(s)
    }

    /// The raw client, for ad-hoc statements (maintenance, test tools).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Whether the connection is gone (it is then discarded, never reused).
    pub fn is_closed(&self) -> bool {
        self.client.is_closed()
    }
}

/// Statement-cache key of `SELECT agentloop_flush_notify()`.
const FLUSH_KEY: &str = "\0flush";

/// deadpool manager creating [`StoreConn`]s.
pub struct StoreManager {
    config: Config,
    defer_notify: bool,
}

impl managed::Manager for StoreManager {
    type Type = StoreConn;
    type Error = tokio_postgres::Error;

    async fn create(&self) -> Result<StoreConn, tokio_postgres::Error> {
        let (client, connection) = self.config.connect(NoTls).await?;
        let driver = AbortOnDropHandle::new(tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "store connection ended");
            }
        }));
        Ok(StoreConn { client, statements: HashMap::new(), defer_notify: self.defer_notify, _driver: driver })
    }

    async fn recycle(&self, conn: &mut StoreConn, _: &Metrics) -> RecycleResult<tokio_postgres::Error> {
        if conn.is_closed() { Err(RecycleError::message("connection closed")) } else { Ok(()) }
    }
}

/// The pool type.
pub type StorePool = managed::Pool<StoreManager>;

/// The tokio-postgres configuration for `settings` (also used for dedicated connections such
/// as the worker's lease keeper).
pub fn config(settings: &PoolSettings) -> Result<Config, tokio_postgres::Error> {
    config_with(settings, "")
}

/// Like [`config`], with `extra_options` (`-c name=value ...`) appended to the session
/// settings of the startup packet (the api's per-principal limits, issue 10).
pub fn config_with(settings: &PoolSettings, extra_options: &str) -> Result<Config, tokio_postgres::Error> {
    let mut config = Config::from_str(&settings.database_url)?;
    config
        .application_name(&settings.application_name)
        .options(format!(
            "-c statement_timeout={} -c idle_in_transaction_session_timeout=5000 -c client_connection_check_interval={} -c TimeZone=UTC {} {extra_options}",
            settings.statement_timeout.as_millis(),
            crate::db::CLIENT_CHECK_MS,
            crate::db::planner_options()
        ))
        .connect_timeout(Duration::from_secs(5))
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(10))
        .keepalives_interval(Duration::from_secs(2))
        .keepalives_retries(3)
        .tcp_user_timeout(Duration::from_secs(15));
    Ok(config)
}

/// Builds a pool (no connection is opened until first use).
pub fn build(settings: &PoolSettings) -> anyhow::Result<StorePool> {
    build_with(settings, "", false)
}

/// Like [`build`], with extra session settings (see [`config_with`]) and, with
/// `defer_notify`, step calls that send their notifications after commit
/// ([`StoreConn::call_json`]).
pub fn build_with(settings: &PoolSettings, extra_options: &str, defer_notify: bool) -> anyhow::Result<StorePool> {
    let manager = StoreManager { config: config_with(settings, extra_options)?, defer_notify };
    Ok(managed::Pool::builder(manager)
        .max_size(settings.max_size.max(1))
        .wait_timeout(Some(settings.wait_timeout))
        // Creating a connection counts against the same bound as waiting for one, so an attempt
        // never outlives the caller's call timeout (a half-open network can stall a connect).
        .create_timeout(Some(settings.wait_timeout))
        .recycle_timeout(Some(Duration::from_secs(1)))
        .runtime(deadpool::Runtime::Tokio1)
        .build()?)
}
