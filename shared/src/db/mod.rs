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
/// would otherwise hide its run from `SKIP LOCKED` recovery claims.
pub fn build_pool(
    database_url: &str,
    max_size: usize,
    application_name: &str,
    statement_timeout: Duration,
) -> Result<PgPool, DbError> {
    let setup_sql = format!(
        "SET application_name = '{}'; SET statement_timeout = {}; SET idle_in_transaction_session_timeout = 5000",
        application_name.replace('\'', ""),
        statement_timeout.as_millis()
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

/// Applies every pending embedded migration to `database_url` under a session
/// `pg_advisory_lock`, so concurrent callers (several api/worker replicas with migrate-on-start)
/// apply each migration exactly once. Returns the versions applied by this call.
///
/// Must run on a multi-threaded tokio runtime (diesel-async's harness uses `block_in_place`).
pub async fn run_migrations(database_url: &str) -> Result<Vec<String>, DbError> {
    let mut conn = AsyncPgConnection::establish(database_url).await?;
    diesel::sql_query("SELECT pg_advisory_lock($1)")
        .bind::<diesel::sql_types::BigInt, _>(MIGRATION_LOCK_KEY)
        .execute(&mut conn)
        .await?;
    let mut harness = AsyncMigrationHarness::new(conn);
    let applied = harness
        .run_pending_migrations(MIGRATIONS)
        .map(|versions| versions.iter().map(|v| v.to_string()).collect::<Vec<_>>())
        .map_err(|e| DbError::Migration(e.to_string()));
    let mut conn = harness.into_inner();
    diesel::sql_query("SELECT pg_advisory_unlock($1)")
        .bind::<diesel::sql_types::BigInt, _>(MIGRATION_LOCK_KEY)
        .execute(&mut conn)
        .await?;
    applied
}
