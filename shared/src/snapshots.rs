//! Context snapshots: versioned, non-destructive summaries (SPEC §3, §8).

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::Serialize;
use uuid::Uuid;

use crate::db::schema::context_snapshots;

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

