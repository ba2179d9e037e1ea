//! A test-only tool, registered only with `AGENTLOOP_TEST_TOOLS=1`: `record_effect`, a
//! non-idempotent tool whose executions are counted in the database, so black-box tests can
//! prove an effect ran exactly once across worker crashes (SPEC §7).

use std::time::Duration;

use agentloop_shared::db::PgPool;
use agentloop_shared::tools::{Tool, ToolContext, ToolError};
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use futures_util::future::BoxFuture;
use serde_json::{Value, json};

/// Table the tool writes (created by [`RecordEffect::install`]).
pub const TABLE: &str = "agentloop_test_effects";

/// `record_effect {"label"?: string, "seconds"?: number}`: inserts one row
/// `(key = the call's idempotency key, label)` into [`TABLE`] as soon as it starts (the effect),
/// then — only the first time this key runs — waits `seconds` (at most 60), and answers
/// `recorded <label>`. Not idempotent. (A retried call is quick, so a test can SIGKILL a worker
/// during the first execution and watch the retry finish.)
#[derive(Clone)]
pub struct RecordEffect {
    pub pool: PgPool,
}

impl RecordEffect {
    /// Creates [`TABLE`] if needed (errors of concurrent creators are ignored).
    pub async fn install(pool: &PgPool) {
        let sql = format!(
            "CREATE TABLE IF NOT EXISTS {TABLE} (id bigserial PRIMARY KEY, key text NOT NULL, label text NOT NULL,
             created_at timestamptz NOT NULL DEFAULT now())"
        );
        match pool.get().await {
            Ok(mut conn) => {
                if let Err(error) = conn.batch_execute(&sql).await {
                    tracing::debug!(%error, "creating the test effects table");
                }
            }
            Err(error) => tracing::warn!(%error, "cannot create the test effects table"),
        }
    }
}

impl Tool for RecordEffect {
    fn name(&self) -> &str {
        "record_effect"
    }

    fn description(&self) -> &str {
        "Record an external effect (test tool): inserts a row, then waits `seconds`."
    }

    fn parameters(&self) -> Value {
        json!({
            "type": "object",
            "properties": {
                "label": {"type": "string", "description": "What to record."},
                "seconds": {"type": "number", "description": "Seconds to wait after recording (at most 60)."}
            }
        })
    }

    fn idempotent(&self) -> bool {
        false
    }

    fn call(&self, args: Value, ctx: ToolContext) -> BoxFuture<'static, Result<String, ToolError>> {
        let pool = self.pool.clone();
        let label = args["label"].as_str().unwrap_or("effect").to_owned();
        let seconds = args["seconds"].as_f64().unwrap_or(0.0).clamp(0.0, 60.0);
        Box::pin(async move {
            let mut conn = pool.get().await.map_err(|e| ToolError::Failed(e.to_string()))?;
            diesel::sql_query(format!("INSERT INTO {TABLE} (key, label) VALUES ($1, $2)"))
                .bind::<diesel::sql_types::Text, _>(&ctx.idempotency_key)
                .bind::<diesel::sql_types::Text, _>(&label)
                .execute(&mut conn)
                .await
                .map_err(|e| ToolError::Failed(e.to_string()))?;
            #[derive(diesel::QueryableByName)]
            struct Count {
                #[diesel(sql_type = diesel::sql_types::BigInt)]
                n: i64,
            }
            let runs: Count = diesel::sql_query(format!("SELECT count(*) AS n FROM {TABLE} WHERE key = $1"))
                .bind::<diesel::sql_types::Text, _>(&ctx.idempotency_key)
                .get_result(&mut conn)
                .await
                .map_err(|e| ToolError::Failed(e.to_string()))?;
            drop(conn);
            let seconds = if runs.n > 1 { 0.0 } else { seconds };
            tokio::select! {
                () = ctx.cancel.cancelled() => return Err(ToolError::Cancelled),
                () = tokio::time::sleep(Duration::from_secs_f64(seconds)) => {}
            }
            Ok(format!("recorded {label}"))
        })
    }
}

/// `crash_slice {}`: panics inside the slice task (test tool, idempotent so it is not
/// ledgered). Proves that a panic fails the run instead of leaving it `running` with a lease
/// keeper renewing it forever.
#[derive(Clone, Copy)]
pub struct CrashSlice;

impl Tool for CrashSlice {
    fn name(&self) -> &str {
        "crash_slice"
    }

    fn description(&self) -> &str {
        "Panic inside the worker (test tool)."
    }

    fn parameters(&self) -> Value {
        json!({"type": "object", "properties": {}})
    }

    fn idempotent(&self) -> bool {
        true
    }

    fn call(&self, _args: Value, _ctx: ToolContext) -> BoxFuture<'static, Result<String, ToolError>> {
        Box::pin(async move { panic!("crash_slice: a deliberate panic in a tool") })
    }
}
