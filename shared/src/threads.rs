//! Threads: owner-scoped conversations (SPEC §3).

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::Serialize;
use uuid::Uuid;

use crate::db::schema::threads;

/// A thread row as clients see it (the streaming column is served separately).
#[derive(Debug, Clone, Queryable, Selectable, Serialize)]
#[diesel(table_name = threads)]
#[serde(rename_all = "camelCase")]
pub struct Thread {
    pub id: Uuid,
    #[serde(skip)]
    pub owner_id: Uuid,
    pub title: String,
    pub model: Option<String>,
    pub metadata: serde_json::Value,
    pub parent_thread_id: Option<Uuid>,
    pub message_count: i32,
    pub last_sequence: i64,
    #[serde(skip)]
    pub last_timestamp_ms: i64,
    pub last_event_sequence: i64,
    pub context_tokens: Option<i32>,
    #[serde(skip)]
    pub streaming_message: Option<serde_json::Value>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// Not a hidden thread of a `POST /v1/chat/completions` request in flight (a row of
/// `openai_requests`, primary key lookup): such a thread belongs to that request alone — listed,
/// read or written through the thread routes, a turn posted into it was accepted and then
/// deleted with the thread when the request ended (acceptance probe). Hidden threads are found
/// by no list, read or search; their ids are never shown. The filter names `threads.id`: use it
/// in queries that select or join `threads`.
pub fn not_hidden() -> diesel::expression::SqlLiteral<diesel::sql_types::Bool> {
    diesel::dsl::sql::<diesel::sql_types::Bool>("NOT EXISTS (SELECT 1 FROM openai_requests o WHERE o.thread_id = threads.id)")
}

/// The thread `id` if it exists, is not deleted and belongs to `owner`. Another principal's
/// thread is indistinguishable from a missing one (SPEC §11: 404, never 403); so is a hidden
/// thread of the OpenAI endpoint ([`not_hidden`]).
pub async fn get_owned(conn: &mut AsyncPgConnection, id: Uuid, owner: Uuid) -> QueryResult<Option<Thread>> {
    threads::table
        .filter(threads::id.eq(id))
        .filter(threads::owner_id.eq(owner))
        .filter(threads::deleted_at.is_null())
        .filter(not_hidden())
        .select(Thread::as_select())
        .first(conn)
        .await
        .optional()
}

/// The journal position (`last_event_sequence`) of thread `id` if it exists, is not deleted and
/// belongs to `owner`: one column, for live reads that must not load the row (its `metadata`
/// may be MiB).
pub async fn event_position_owned(conn: &mut AsyncPgConnection, id: Uuid, owner: Uuid) -> QueryResult<Option<i64>> {
    threads::table
        .filter(threads::id.eq(id))
        .filter(threads::owner_id.eq(owner))
        .filter(threads::deleted_at.is_null())
        .filter(not_hidden())
        .select(threads::last_event_sequence)
        .first(conn)
        .await
        .optional()
}

/// The journal position of thread `id`, whoever owns it (see [`event_position_owned`]).
pub async fn event_position(conn: &mut AsyncPgConnection, id: Uuid) -> QueryResult<i64> {
    threads::table.find(id).select(threads::last_event_sequence).first(conn).await
}

/// Loads a thread by id regardless of owner (worker side).
pub async fn get(conn: &mut AsyncPgConnection, id: Uuid) -> QueryResult<Thread> {
    threads::table.find(id).select(Thread::as_select()).first(conn).await
}

/// Keyset page of `owner`'s threads, most recently updated first. `before` is the
/// `(updated_at, id)` of the last item of the previous page.
pub async fn list(
    conn: &mut AsyncPgConnection,
    owner: Uuid,
    limit: i64,
    before: Option<(DateTime<Utc>, Uuid)>,
) -> QueryResult<Vec<Thread>> {
    let mut query = threads::table
        .filter(threads::owner_id.eq(owner))
        .filter(threads::deleted_at.is_null())
        .filter(not_hidden())
        .select(Thread::as_select())
        .order((threads::updated_at.desc(), threads::id.desc()))
        .limit(limit)
        .into_boxed();
    if let Some((at, id)) = before {
        query = query.filter(
            threads::updated_at.lt(at).or(threads::updated_at.eq(at).and(threads::id.lt(id))),
        );
    }
    query.load(conn).await
}

