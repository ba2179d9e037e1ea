//! The claim statement (SPEC §5 "Claim").

use std::time::Duration;

use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::runs::Run;

/// Claims at most `limit` eligible runs for `worker_id` under a lease of `lease` (ms precision)
/// in ONE statement. Eligible: `queued`, or `running` with `lease_expires_at < now()` (a crashed
/// or stalled owner). Rows locked by a concurrent claimer are skipped, never waited for. Each
/// claimed row gets `lease_epoch + 1` (the new fencing token), `attempts + 1`, and for a
/// recovered row `recoveries + 1`. Order: `seq` (creation order), via the partial index
/// `runs_claimable`, so terminal runs cost nothing.
pub async fn claim(
    conn: &mut AsyncPgConnection,
    worker_id: &str,
    limit: i64,
    lease: Duration,
) -> diesel::QueryResult<Vec<Run>> {
    diesel::sql_query(
        "WITH candidates AS (
             SELECT id FROM runs
             WHERE status IN ('queued', 'running')
               AND (status = 'queued' OR lease_expires_at < now())
             ORDER BY seq
             LIMIT $2
             FOR UPDATE SKIP LOCKED
         )
         UPDATE runs r SET
             status = 'running',
             lease_owner = $1,
             lease_epoch = r.lease_epoch + 1,
             attempts = r.attempts + 1,
             recoveries = r.recoveries + CASE WHEN r.status = 'running' THEN 1 ELSE 0 END,
             lease_expires_at = now() + make_interval(secs => $3::bigint / 1000.0),
             started_at = COALESCE(r.started_at, now()),
             updated_at = now()
         FROM candidates c
         WHERE r.id = c.id
         RETURNING r.*",
    )
    .bind::<Text, _>(worker_id)
    .bind::<BigInt, _>(limit)
    .bind::<BigInt, _>(lease.as_millis() as i64)
    .load::<Run>(conn)
    .await
}

/// The earliest `lease_expires_at` among running runs that `worker_id` does not hold (the
/// worker's recovery timer), in ms from now (negative when already expired), or `None`.
pub async fn next_lease_expiry_ms(conn: &mut AsyncPgConnection, worker_id: &str) -> diesel::QueryResult<Option<i64>> {
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
        ms: Option<i64>,
    }
    let row: Row = diesel::sql_query(
        "SELECT (extract(epoch from (min(lease_expires_at) - now())) * 1000)::bigint AS ms
         FROM runs WHERE status = 'running' AND lease_owner IS DISTINCT FROM $1",
    )
    .bind::<Text, _>(worker_id)
    .get_result(conn)
    .await?;
    Ok(row.ms)
}

/// Whether any run is still `queued` (an index probe on `runs_claimable`, no lock). After a claim
/// pass that took fewer runs than it had slots for, a `true` means some queued row was skipped
/// because another transaction held its lock (e.g. an api command reading it `FOR UPDATE`):
/// the caller retries shortly instead of waiting for a notification that will not come.
pub async fn any_queued(conn: &mut AsyncPgConnection) -> diesel::QueryResult<bool> {
    use crate::db::schema::runs;
    use diesel::{ExpressionMethods, QueryDsl};
    diesel::select(diesel::dsl::exists(runs::table.filter(runs::status.eq("queued"))))
        .get_result(conn)
        .await
}
