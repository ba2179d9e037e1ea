//! Context snapshots: versioned, non-destructive summaries (SPEC §3, §8).

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::Serialize;
use uuid::Uuid;

use crate::db::schema::{context_snapshots, messages};

/// A snapshot row: `summary` covers exactly the canonical rows `from_sequence..=to_sequence`.
#[derive(Debug, Clone, Queryable, Selectable, Serialize)]
#[diesel(table_name = context_snapshots)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    #[serde(skip)]
    pub id: i64,
    #[serde(skip)]
    pub thread_id: Uuid,
    pub version: i32,
    pub summary: String,
    pub from_sequence: i64,
    pub to_sequence: i64,
    /// Tokens of `summary`.
    pub token_estimate: i32,
    pub run_id: Option<Uuid>,
    pub superseded_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
}

/// The thread's newest snapshot that no branch operation superseded.
pub async fn latest_live(conn: &mut AsyncPgConnection, thread_id: Uuid) -> QueryResult<Option<Snapshot>> {
    context_snapshots::table
        .filter(context_snapshots::thread_id.eq(thread_id))
        .filter(context_snapshots::superseded_at.is_null())
        .order(context_snapshots::version.desc())
        .select(Snapshot::as_select())
        .first(conn)
        .await
        .optional()
}

/// Number of snapshots ever written for the thread.
pub async fn count(conn: &mut AsyncPgConnection, thread_id: Uuid) -> QueryResult<i64> {
    context_snapshots::table.filter(context_snapshots::thread_id.eq(thread_id)).count().get_result(conn).await
}

/// Writes the next snapshot version of `thread_id`, covering the canonical rows whose timestamp
/// identities are `identities` together with `previous`'s coverage (a folded earlier summary).
/// Returns `None` when none of the identities is a canonical row (nothing to cover).
pub async fn insert(
    conn: &mut AsyncPgConnection,
    thread_id: Uuid,
    summary: &str,
    token_estimate: i32,
    identities: &[i64],
    previous: Option<&Snapshot>,
    run_id: Option<Uuid>,
) -> QueryResult<Option<Snapshot>> {
    let (min, max): (Option<i64>, Option<i64>) = messages::table
        .filter(messages::thread_id.eq(thread_id))
        .filter(messages::timestamp_ms.eq_any(identities))
        .select((diesel::dsl::min(messages::sequence), diesel::dsl::max(messages::sequence)))
        .get_result(conn)
        .await?;
    let from = match (min, previous) {
        (Some(m), Some(p)) => m.min(p.from_sequence),
        (Some(m), None) => m,
        (None, Some(p)) => p.from_sequence,
        (None, None) => return Ok(None),
    };
    let to = max.into_iter().chain(previous.map(|p| p.to_sequence)).max().unwrap_or(from);
    let version: Option<i32> = context_snapshots::table
        .filter(context_snapshots::thread_id.eq(thread_id))
        .select(diesel::dsl::max(context_snapshots::version))
        .get_result(conn)
        .await?;
    diesel::insert_into(context_snapshots::table)
        .values((
            context_snapshots::thread_id.eq(thread_id),
            context_snapshots::version.eq(version.unwrap_or(0) + 1),
            context_snapshots::summary.eq(summary),
            context_snapshots::from_sequence.eq(from),
            context_snapshots::to_sequence.eq(to),
            context_snapshots::token_estimate.eq(token_estimate),
            context_snapshots::run_id.eq(run_id),
        ))
        .returning(Snapshot::as_returning())
        .get_result(conn)
        .await
        .map(Some)
}

/// Supersedes every live snapshot covering a sequence `>= from_sequence` (a branch operation
/// deactivated rows it summarised). Returns how many.
pub async fn supersede_from(conn: &mut AsyncPgConnection, thread_id: Uuid, from_sequence: i64) -> QueryResult<usize> {
    diesel::update(context_snapshots::table)
        .filter(context_snapshots::thread_id.eq(thread_id))
        .filter(context_snapshots::superseded_at.is_null())
        .filter(context_snapshots::to_sequence.ge(from_sequence))
        .set(context_snapshots::superseded_at.eq(diesel::dsl::now))
        .execute(conn)
        .await
}
