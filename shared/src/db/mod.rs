//! Connection pool and embedded migrations.
//!
//! One pool builder for both binaries: every pooled connection gets `application_name` and a
//! `statement_timeout` (short for the api, longer for the worker) in a set-up hook. Listeners are
//! NOT pooled; see [`crate::scheduler::listener`].

pub mod schema;

use std::time::Duration;

use diesel::ConnectionError;
use diesel_async::pooled_connection::deadpool::{Object, Pool};
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
use diesel_async::{AsyncConnection, AsyncMigrationHarness, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

/// A deadpool pool of diesel-async PostgreSQL connections.
pub type PgPool = Pool<AsyncPgConnection>;
/// A connection checked out of [`PgPool`].
pub type PgConn = Object<AsyncPgConnection>;

/// Migrations of `migrations/`, embedded at build time (additive only; see migrations/README.md).
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("../migrations");

/// Planner setting of every connection the api and the worker open (both pools): every query
/// agentloop runs is a point or range lookup that an index serves, so plans must not depend on
/// fresh statistics. Without autovacuum (or before it first runs) a table analysed while empty
/// keeps `reltuples = 0`: the planner then prices a sequential scan at nothing, a session's
/// cached generic plans freeze on it, and `POST /chat`'s active-run check scanned every run row
/// (45,101 scans reading 756 million rows in one load; admission fell from 806 to 486
/// requests/s). With sequential scans priced out, an index path always wins where one exists;
/// a table without a usable index is still scanned. Proven by the test
/// `plans_hold_with_stale_statistics` (tests/tests/operations.rs).
///
/// `jit = off` goes with it: a plan that must still scan (a table without a usable index, such
/// as the MCP sign-in sweep's) carries the disabled scan's cost of 10^10, far above
/// `jit_above_cost`, so PostgreSQL JIT-compiled it on every execution — about 450 ms of CPU for a
/// query that reads an empty table. On a loaded machine those sweeps outlived their 1 s call
/// timeout, piled up server-side and starved the slices (a soak in CI failed two runs). No query
/// of agentloop's is long enough to gain from JIT. Proven by `no_query_is_jit_compiled`
/// (tests/tests/operations.rs). Pairs of (setting, value).
pub const PLANNER_SETTINGS: &[(&str, &str)] = &[("enable_seqscan", "off"), ("jit", "off")];

/// `client_connection_check_interval` of every api and worker connection, ms (PostgreSQL 14+):
/// while a statement runs, its backend checks this often whether the client is still there and
/// stops the statement when it is not. A call that timed out drops its connection; without the
/// check its statement ran on until `statement_timeout` (30 s), and calls retried on a slow
/// server piled up there (`a_statement_whose_caller_gave_up_stops`, tests/tests/operations.rs).
pub const CLIENT_CHECK_MS: u64 = 1000;

/// [`PLANNER_SETTINGS`] as `-c name=value ...` for a startup packet's `options`.
pub fn planner_options() -> String {
    PLANNER_SETTINGS.iter().map(|(k, v)| format!("-c {k}={v}")).collect::<Vec<_>>().join(" ")
}

/// `pg_advisory_lock` key serialising concurrent migration runs (any constant unique to agentloop).
const MIGRATION_LOCK_KEY: i64 = 0x6167_656e_746c_6f6f; // "agentloo"

/// Errors of pool construction and migrations.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("cannot build the connection pool: {0}")]
    Pool(String),
    #[error("cannot connect to PostgreSQL: {0}")]
    Connect(#[from] ConnectionError),
    #[error("query failed: {0}")]
    Query(#[from] diesel::result::Error),
    #[error("migration failed: {0}")]
    Migration(String),
}

/// Builds a pool of at most `max_size` connections to `database_url`.
///
/// Each new connection runs `SET application_name = <application_name>`,
/// `SET statement_timeout = <statement_timeout>` (milliseconds) and
/// `SET idle_in_transaction_session_timeout = 5000` before first use: a process stalled inside a
/// transaction (SIGSTOP, a hung host) loses its session after 5 s, releasing the row locks that
/// would otherwise hide its run from `SKIP LOCKED` recovery claims. It also runs
/// [`PLANNER_SETTINGS`].
pub fn build_pool(
    database_url: &str,
    max_size: usize,
    application_name: &str,
    statement_timeout: Duration,
) -> Result<PgPool, DbError> {
    let setup_sql = format!(
        "SET application_name = '{}'; SET statement_timeout = {}; SET idle_in_transaction_session_timeout = 5000; SET client_connection_check_interval = {CLIENT_CHECK_MS}; {}",
        application_name.replace('\'', ""),
        statement_timeout.as_millis(),
        PLANNER_SETTINGS.iter().map(|(k, v)| format!("SET {k} = {v};")).collect::<String>()
    );
    let mut config = ManagerConfig::default();
    config.custom_setup = Box::new(move |url| {
        let setup_sql = setup_sql.clone();
        let url = url.to_owned();
        Box::pin(async move {
            let mut conn = AsyncPgConnection::establish(&url).await?;
            conn.batch_execute(&setup_sql)
                .await
                .map_err(|e| ConnectionError::BadConnection(e.to_string()))?;
            Ok(conn)
        })
    });
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(database_url, config);
    Pool::builder(manager)
        .max_size(max_size)
        .wait_timeout(Some(Duration::from_secs(10)))
        .create_timeout(Some(Duration::from_secs(10)))
        .runtime(deadpool::Runtime::Tokio1)
        .build()
        .map_err(|e| DbError::Pool(e.to_string()))
}

/// Closes the connections of `pool` unused for `idle` (checked every `idle / 4`, at least every
/// second), from a task that ends with the pool; `idle` zero does nothing. Needs a tokio runtime.
///
/// Why: tokio-postgres grows a connection's read and write buffers to the largest message it
/// has carried and never shrinks them, so after a burst of large rows (1 MiB thread metadata,
/// a 1 MB turn) every pooled connection keeps megabytes. Reconnecting after an idle period
/// bounds that to the connections in use (bench-hostile, issue 10).
pub fn reap_idle<M>(pool: &deadpool::managed::Pool<M>, idle: Duration)
where
    M: deadpool::managed::Manager + 'static,
    M::Type: Send + 'static,
{
    if idle.is_zero() {
        return;
    }
    let weak = pool.weak();
    let every = (idle / 4).max(Duration::from_secs(1));
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            let Some(pool) = weak.upgrade() else { return };
            let closed = pool.retain(|_, metrics| metrics.last_used() < idle).removed.len();
            if closed > 0 {
                tracing::debug!(closed, "closed idle pooled connections");
            }
        }
    });
}

/// Migrations that run outside a transaction (`metadata.toml`: `run_in_transaction = false`):
/// `(name, up.sql, down.sql)`, generated by `build.rs`.
const OUTSIDE_TRANSACTION: &[(&str, &str, &str)] = include!(concat!(env!("OUT_DIR"), "/outside_transaction.rs"));

/// `lock_timeout` of the migration session: no statement of a migration waits longer than this
/// for a lock, so the traffic queued behind its lock request never waits longer either — half
/// of the 1 s the zero-downtime rule allows, leaving the other half for the brief hold once the
/// lock is granted (migrations/README.md). A migration that times out is rolled back and tried
/// again.
pub const MIGRATION_LOCK_TIMEOUT: Duration = Duration::from_millis(500);

/// Attempts of one migration that fails on its `lock_timeout` (with a pause of 0.1 s growing to
/// 2 s, plus jitter, between them: about 2 minutes in all) before the run gives up.
const MIGRATION_ATTEMPTS: u32 = 80;

/// Every embedded migration's `(name, up.sql)`, generated by `build.rs`.
const ALL_MIGRATIONS: &[(&str, &str)] = include!(concat!(env!("OUT_DIR"), "/all_migrations.rs"));

/// The runner's record of what it applied: `version` (diesel's, the digits of the name's date
/// and number) and the SHA-256 of its `up.sql` (hex, carriage returns removed).
const CHECKSUMS_TABLE: &str = "CREATE TABLE IF NOT EXISTS agentloop_migration_checksums (
    version text PRIMARY KEY, name text NOT NULL, sha256 text NOT NULL, recorded_at timestamptz NOT NULL DEFAULT now())";

/// diesel's version of migration `name`: the digits before the first `_`
/// (`2026-12-06-000044_reconcile` → `20261206000044`).
fn migration_version(name: &str) -> String {
    name.split('_').next().unwrap_or(name).chars().filter(char::is_ascii_digit).collect()
}

/// SHA-256 (hex) of a migration's `up.sql`, carriage returns removed (a checkout with CRLF line
/// ends is the same migration).
fn migration_checksum(up: &str) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(up.replace('\r', "").as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// One row of `agentloop_migration_checksums`.
#[derive(diesel::QueryableByName)]
struct Recorded {
    #[diesel(sql_type = diesel::sql_types::Text)]
    version: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    sha256: String,
}

/// One applied version.
#[derive(diesel::QueryableByName)]
struct Applied {
    #[diesel(sql_type = diesel::sql_types::Text)]
    version: String,
}

/// Versions in `__diesel_schema_migrations` (none when the table does not exist yet).
async fn applied_versions(conn: &mut AsyncPgConnection) -> Result<Vec<String>, DbError> {
    Ok(diesel::sql_query("SELECT version::text AS version FROM __diesel_schema_migrations")
    .load::<Applied>(conn)
    .await
    .or_else(|e| match e {
        // A database no migration has touched yet (diesel creates the table).
        diesel::result::Error::DatabaseError(_, ref info) if info.message().contains("does not exist") => Ok(Vec::new()),
        e => Err(e),
    })?
    .into_iter()
    .map(|a| a.version)
    .collect())
}

/// Records the checksum of applied migration `name` (kept if one is recorded already).
async fn record_checksum(conn: &mut AsyncPgConnection, name: &str, up: &str) -> Result<(), DbError> {
    diesel::sql_query("INSERT INTO agentloop_migration_checksums (version, name, sha256) VALUES ($1, $2, $3) ON CONFLICT (version) DO NOTHING")
        .bind::<diesel::sql_types::Text, _>(migration_version(name))
        .bind::<diesel::sql_types::Text, _>(name)
        .bind::<diesel::sql_types::Text, _>(migration_checksum(up))
        .execute(conn)
        .await?;
    Ok(())
}

/// Refuses a binary whose migrations differ from those this database applied: a migration
/// changed after it was applied is never applied again, so the database would keep the old SQL
/// for good while the binary expects the new (acceptance probe M, M-1: eleven migrations had
/// been edited in place, and databases first migrated in between ran, among others, an `ask`
/// tool without approval). Applied migrations without a record — applied before the runner kept
/// checksums (migration 000044 brought those databases to the fresh schema), or by a runner
/// stopped between applying and recording — are recorded as they are now.
async fn check_checksums(conn: &mut AsyncPgConnection) -> Result<(), DbError> {
    conn.batch_execute(CHECKSUMS_TABLE).await?;
    let recorded: std::collections::HashMap<String, String> =
        diesel::sql_query("SELECT version, sha256 FROM agentloop_migration_checksums").load::<Recorded>(conn).await?.into_iter().map(|r| (r.version, r.sha256)).collect();
    let applied: std::collections::HashSet<String> = applied_versions(conn).await?.into_iter().collect();
    for (name, up) in ALL_MIGRATIONS {
        let version = migration_version(name);
        match recorded.get(&version) {
            Some(sha) if *sha != migration_checksum(up) => {
                return Err(DbError::Migration(format!(
                    "migration {name} differs from the one this database applied (sha256 {sha} then, {} in this binary): a migration must never change once applied; ship the change as a new migration (migrations/README.md)",
                    migration_checksum(up)
                )));
            }
            Some(_) => {}
            None if applied.contains(&version) => record_checksum(conn, name, up).await?,
            None => {}
        }
    }
    Ok(())
}

/// What the database's schema lacks for this binary, and what it has beyond it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SchemaGap {
    /// Embedded migrations (names) the database has not applied: this binary must not serve.
    pub missing: Vec<String>,
    /// Applied versions this binary does not know (a newer release migrated it: fine, migrations
    /// are additive, during a rolling upgrade or a rollback).
    pub unknown: Vec<String>,
    /// Embedded migrations (names) whose text differs from what the database recorded when it
    /// applied them (`agentloop_migration_checksums`): this binary's SQL is not what runs there.
    pub changed: Vec<String>,
}

/// Compares the migrations applied to `database_url` with the embedded ones (one short
/// connection).
pub async fn schema_gap(database_url: &str) -> Result<SchemaGap, DbError> {
    let mut conn = AsyncPgConnection::establish(database_url).await?;
    let applied = applied_versions(&mut conn).await?;
    let known: std::collections::HashSet<String> = ALL_MIGRATIONS.iter().map(|(name, _)| migration_version(name)).collect();
    let applied_set: std::collections::HashSet<&String> = applied.iter().collect();
    #[derive(diesel::QueryableByName)]
    struct Exists {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        present: bool,
    }
    let has_checksums = diesel::sql_query("SELECT to_regclass('agentloop_migration_checksums') IS NOT NULL AS present")
        .get_result::<Exists>(&mut conn)
        .await?
        .present;
    let recorded: std::collections::HashMap<String, String> = if has_checksums {
        diesel::sql_query("SELECT version, sha256 FROM agentloop_migration_checksums")
            .load::<Recorded>(&mut conn)
            .await?
            .into_iter()
            .map(|r| (r.version, r.sha256))
            .collect()
    } else {
        Default::default()
    };
    let mut gap = SchemaGap {
        missing: ALL_MIGRATIONS.iter().filter(|(name, _)| !applied_set.contains(&migration_version(name))).map(|(name, _)| (*name).to_owned()).collect(),
        unknown: applied.iter().filter(|v| !known.contains(*v)).cloned().collect(),
        changed: ALL_MIGRATIONS
            .iter()
            .filter(|(name, up)| recorded.get(&migration_version(name)).is_some_and(|sha| *sha != migration_checksum(up)))
            .map(|(name, _)| (*name).to_owned())
            .collect(),
    };
    gap.unknown.sort();
    Ok(gap)
}

/// Start-up check of `run` (api and worker): a database that lacks migrations this binary needs,
/// or applied one whose text differs from this binary's, stops the process, naming them (acceptance probe M, M-2: a new api started before
/// `migrate` said ready and failed requests after the model was paid, `function ... does not
/// exist`; a new worker ran without the fleet's tool policies). Versions beyond this binary are
/// logged. An unreachable database is not an error here: the check runs again in the
/// background until it answers, and a gap found then exits the process
/// ([`crate::tasks::EXIT_TASK_ENDED`]).
pub async fn require_schema(database_url: &str) -> anyhow::Result<()> {
    let check = |gap: SchemaGap| -> anyhow::Result<()> {
        if !gap.missing.is_empty() {
            anyhow::bail!(
                "the database lacks {} migration(s) this binary needs ({}); run `agentloop-worker migrate` first (docs/operations.md §4)",
                gap.missing.len(),
                gap.missing.join(", ")
            );
        }
        if !gap.changed.is_empty() {
            // Verifier P, P-4: `migrate` refused such a database, `run` served on it.
            anyhow::bail!(
                "{} migration(s) of this binary differ from what the database applied ({}): this binary's SQL is not what runs there; a migration must never change once applied (migrations/README.md)",
                gap.changed.len(),
                gap.changed.join(", ")
            );
        }
        if !gap.unknown.is_empty() {
            tracing::info!(versions = ?gap.unknown, "the database has migrations newer than this binary (additive: fine during a rolling upgrade or a rollback)");
        }
        Ok(())
    };
    match tokio::time::timeout(Duration::from_secs(10), schema_gap(database_url)).await {
        Ok(Ok(gap)) => check(gap),
        outcome => {
            let error = match outcome {
                Ok(Err(e)) => e.to_string(),
                _ => "no answer within 10 s".to_owned(),
            };
            tracing::warn!(%error, "cannot compare the schema with this binary's migrations yet; checking again in the background");
            let url = database_url.to_owned();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    if let Ok(Ok(gap)) = tokio::time::timeout(Duration::from_secs(10), schema_gap(&url)).await {
                        if let Err(error) = check(gap) {
                            tracing::error!(%error, "exiting");
                            std::process::exit(crate::tasks::EXIT_TASK_ENDED);
                        }
                        return;
                    }
                }
            });
            Ok(())
        }
    }
}

/// The embedded migrations, with those marked `run_in_transaction = false` run group by group.
struct Source;

impl diesel::migration::MigrationSource<diesel::pg::Pg> for Source {
    fn migrations(&self) -> diesel::migration::Result<Vec<Box<dyn diesel::migration::Migration<diesel::pg::Pg>>>> {
        let embedded = diesel::migration::MigrationSource::<diesel::pg::Pg>::migrations(&MIGRATIONS)?;
        Ok(embedded
            .into_iter()
            .map(|inner| {
                let name = inner.name().to_string();
                match OUTSIDE_TRANSACTION.iter().find(|(n, ..)| *n == name) {
                    Some(&(_, up, down)) => Box::new(Grouped { inner, up, down }) as Box<dyn diesel::migration::Migration<diesel::pg::Pg>>,
                    None => inner,
                }
            })
            .collect())
    }
}

/// A migration run outside a transaction: its SQL is split at lines reading exactly
/// `-- commit`, and each group is sent as one simple query — its own implicit transaction — so
/// `CREATE INDEX CONCURRENTLY` (alone in its group) can run. Every group must be idempotent: a
/// failed attempt may have committed the groups before it.
struct Grouped {
    inner: Box<dyn diesel::migration::Migration<diesel::pg::Pg>>,
    up: &'static str,
    down: &'static str,
}

/// The statement groups of a `run_in_transaction = false` migration (see [`Grouped`]).
pub fn statement_groups(sql: &str) -> Vec<String> {
    let mut groups = vec![String::new()];
    for line in sql.lines() {
        if line.trim() == "-- commit" {
            groups.push(String::new());
        } else {
            let last = groups.last_mut().expect("one group");
            last.push_str(line);
            last.push('\n');
        }
    }
    groups
        .into_iter()
        .filter(|g| g.lines().any(|l| !l.trim().is_empty() && !l.trim_start().starts_with("--")))
        .collect()
}

impl Grouped {
    /// Runs the groups; `lock_timeout` is [`MIGRATION_LOCK_TIMEOUT`] at the start of every
    /// attempt and again at the end, whatever a group set in between (e.g. `SET lock_timeout = 0`
    /// before `CREATE INDEX CONCURRENTLY`, whose waits for older transactions block nobody).
    fn execute(sql: &str, conn: &mut dyn diesel::connection::BoxableConnection<diesel::pg::Pg>) -> diesel::migration::Result<()> {
        let reset = format!("SET lock_timeout = {}", MIGRATION_LOCK_TIMEOUT.as_millis());
        conn.batch_execute(&reset)?;
        for group in statement_groups(sql) {
            conn.batch_execute(&group)?;
        }
        conn.batch_execute(&reset)?;
        Ok(())
    }
}

impl diesel::migration::Migration<diesel::pg::Pg> for Grouped {
    fn run(&self, conn: &mut dyn diesel::connection::BoxableConnection<diesel::pg::Pg>) -> diesel::migration::Result<()> {
        Self::execute(self.up, conn)
    }

    fn revert(&self, conn: &mut dyn diesel::connection::BoxableConnection<diesel::pg::Pg>) -> diesel::migration::Result<()> {
        Self::execute(self.down, conn)
    }

    fn metadata(&self) -> &dyn diesel::migration::MigrationMetadata {
        self.inner.metadata()
    }

    fn name(&self) -> &dyn diesel::migration::MigrationName {
        self.inner.name()
    }
}

/// Whether a migration failed on its `lock_timeout` (SQLSTATE 55P03; diesel exposes only the
/// message).
fn is_lock_timeout(error: &(dyn std::error::Error + Send + Sync)) -> bool {
    error.to_string().contains("lock timeout")
}

/// Applies every pending embedded migration to `database_url` under a session
/// `pg_advisory_lock`, so concurrent callers (several api/worker replicas with migrate-on-start)
/// apply each migration exactly once. Returns the versions applied by this call.
///
/// Every statement runs with `lock_timeout` [`MIGRATION_LOCK_TIMEOUT`]; a migration that fails on
/// it is tried again (up to [`MIGRATION_ATTEMPTS`] times) instead of blocking the traffic queued
/// behind its lock request (migrations/README.md). The advisory lock itself is waited for
/// without a timeout, by polling `pg_try_advisory_lock`: a second migrator waits for the
/// first, then finds nothing pending (acceptance probe E: with `lock_timeout` already set, 2
/// of 3 concurrent migrators failed).
///
/// Runs on any tokio runtime: diesel-async's harness blocks (`block_in_place`, which only a
/// multi-threaded runtime allows), so the work runs on a runtime of its own on a blocking
/// thread (the api's actix runtime is single-threaded: `agentloop-api migrate` panicked).
pub async fn run_migrations(database_url: &str) -> Result<Vec<String>, DbError> {
    run_migrations_up_to(database_url, usize::MAX).await
}

/// Like [`run_migrations`], applying at most `limit` pending migrations (the migration tests
/// apply them one at a time under load).
pub async fn run_migrations_up_to(database_url: &str, limit: usize) -> Result<Vec<String>, DbError> {
    let url = database_url.to_owned();
    tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| DbError::Migration(format!("cannot start the migration runtime: {e}")))?;
        runtime.block_on(migrate(&url, limit))
    })
    .await
    .map_err(|e| DbError::Migration(format!("the migration task failed: {e}")))?
}

/// `pg_try_advisory_lock`'s answer.
#[derive(diesel::QueryableByName)]
struct Locked {
    #[diesel(sql_type = diesel::sql_types::Bool)]
    locked: bool,
}

async fn migrate(database_url: &str, limit: usize) -> Result<Vec<String>, DbError> {
    let mut conn = AsyncPgConnection::establish(database_url).await?;
    // The advisory lock is waited for as long as another migrator holds it, between short
    // tries: a session blocked inside `pg_advisory_lock` holds a snapshot, which a `CREATE
    // INDEX CONCURRENTLY` of the migrator holding the lock waits for — a deadlock (acceptance
    // probe E's concurrent migrators). Every statement after it runs under
    // MIGRATION_LOCK_TIMEOUT.
    let mut waited_since: Option<std::time::Instant> = None;
    let mut next_note = Duration::from_secs(1);
    loop {
        let Locked { locked } = diesel::sql_query("SELECT pg_try_advisory_lock($1) AS locked")
            .bind::<diesel::sql_types::BigInt, _>(MIGRATION_LOCK_KEY)
            .get_result(&mut conn)
            .await?;
        if locked {
            break;
        }
        if waited_since.get_or_insert_with(std::time::Instant::now).elapsed() >= next_note {
            tracing::info!(waited_ms = next_note.as_millis() as u64, "waiting for another process's migrations to finish (advisory lock)");
            next_note *= 2;
        }
        tokio::time::sleep(Duration::from_millis(200 + rand::random_range(0..100))).await;
    }
    conn.batch_execute(&format!("SET lock_timeout = {}", MIGRATION_LOCK_TIMEOUT.as_millis())).await?;
    if let Err(error) = check_checksums(&mut conn).await {
        let _ = diesel::sql_query("SELECT pg_advisory_unlock($1)").bind::<diesel::sql_types::BigInt, _>(MIGRATION_LOCK_KEY).execute(&mut conn).await;
        return Err(error);
    }
    let mut harness = AsyncMigrationHarness::new(conn);
    let mut applied = Vec::new();
    let mut pending_records: Vec<(String, &'static str)> = Vec::new();
    let result = async {
        while applied.len() < limit {
            let pending = harness.pending_migrations(Source).map_err(|e| DbError::Migration(e.to_string()))?;
            let Some(next) = pending.into_iter().next() else { break };
            let mut pause = Duration::from_millis(100);
            let mut attempt = 1;
            loop {
                match harness.run_migration(next.as_ref()) {
                    Ok(version) => {
                        let name = next.name().to_string();
                        if let Some((name, up)) = ALL_MIGRATIONS.iter().find(|(n, _)| *n == name) {
                            pending_records.push(((*name).to_owned(), *up));
                        }
                        applied.push(version.to_string());
                        break;
                    }
                    Err(error) if is_lock_timeout(error.as_ref()) && attempt < MIGRATION_ATTEMPTS => {
                        tracing::warn!(migration = %next.name(), attempt, "migration waited too long for a lock; trying again");
                        let jitter = Duration::from_millis(rand::random_range(0..100));
                        tokio::time::sleep(pause + jitter).await;
                        pause = (pause * 3 / 2).min(Duration::from_secs(2));
                        attempt += 1;
                    }
                    Err(error) => return Err(DbError::Migration(format!("{}: {error}", next.name()))),
                }
            }
        }
        Ok(())
    }
    .await;
    let mut conn = harness.into_inner();
    for (name, up) in &pending_records {
        record_checksum(&mut conn, name, up).await?;
    }
    diesel::sql_query("SELECT pg_advisory_unlock($1)")
        .bind::<diesel::sql_types::BigInt, _>(MIGRATION_LOCK_KEY)
        .execute(&mut conn)
        .await?;
    result.map(|()| applied)
}

/// Connects once at start-up to tell a `DATABASE_URL` that can never work from a database that
/// is away for now: a refusal PostgreSQL gives for the URL itself — the database does not exist
/// (`3D000`), the role or its password is refused (`28000`, `28P01`), the URL cannot be parsed
/// — is an error (the process exits naming it: acceptance probe J, F10, such a URL was retried
/// forever as an outage); anything else (refused or lost connections, a starting or
/// overloaded server, a timeout after 10 s) is logged and left to the retries of the pools.
pub async fn check_url(database_url: &str) -> anyhow::Result<()> {
    let config: tokio_postgres::Config = database_url.parse().map_err(|e| anyhow::anyhow!("DATABASE_URL cannot be parsed: {e}"))?;
    match tokio::time::timeout(Duration::from_secs(10), config.connect(tokio_postgres::NoTls)).await {
        Ok(Ok((client, connection))) => {
            drop(client);
            drop(connection);
            Ok(())
        }
        Ok(Err(error)) => match error.code().map(|c| c.code()) {
            Some(code @ ("3D000" | "28000" | "28P01")) => {
                Err(anyhow::anyhow!("DATABASE_URL is refused by PostgreSQL ({code}): {}", error.as_db_error().map_or_else(|| error.to_string(), |e| e.message().to_owned())))
            }
            _ => {
                tracing::warn!(%error, "PostgreSQL is not reachable yet; waiting for it");
                Ok(())
            }
        },
        Err(_) => {
            tracing::warn!("PostgreSQL did not answer within 10 s; waiting for it");
            Ok(())
        }
    }
}
