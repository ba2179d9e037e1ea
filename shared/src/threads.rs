//! Threads: owner-scoped conversations (SPEC §3).

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::Serialize;
use uuid::Uuid;

use crate::db::schema::threads;
use crate::events;

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

/// Fields of a new thread.
#[derive(Debug, Clone, Default)]
pub struct NewThread {
    pub title: String,
    pub model: Option<String>,
    pub metadata: serde_json::Value,
}

/// Inserts a thread owned by `owner` and journals a `thread` event.
pub async fn create(conn: &mut AsyncPgConnection, owner: Uuid, new: NewThread) -> QueryResult<Thread> {
    let thread: Thread = diesel::insert_into(threads::table)
        .values((
            threads::id.eq(Uuid::new_v4()),
            threads::owner_id.eq(owner),
            threads::title.eq(crate::text::clean(&new.title).as_ref()),
            threads::model.eq(new.model),
            threads::metadata.eq(if new.metadata.is_null() {
                serde_json::json!({})
            } else {
                crate::text::clean_json(&new.metadata).into_owned()
            }),
        ))
        .returning(Thread::as_returning())
        .get_result(conn)
        .await?;
    events::append(conn, thread.id, events::kind::THREAD, &serde_json::to_value(&thread).unwrap_or_default())
        .await?;
    Ok(thread)
}

/// The thread `id` if it exists, is not deleted and belongs to `owner`. Another principal's
/// thread is indistinguishable from a missing one (SPEC §11: 404, never 403).
pub async fn get_owned(conn: &mut AsyncPgConnection, id: Uuid, owner: Uuid) -> QueryResult<Option<Thread>> {
    threads::table
        .filter(threads::id.eq(id))
        .filter(threads::owner_id.eq(owner))
        .filter(threads::deleted_at.is_null())
        .select(Thread::as_select())
        .first(conn)
        .await
        .optional()
}

/// Like [`get_owned`] but takes the row lock (`FOR UPDATE`), serialising writers of the thread.
pub async fn lock_owned(conn: &mut AsyncPgConnection, id: Uuid, owner: Uuid) -> QueryResult<Option<Thread>> {
    threads::table
        .filter(threads::id.eq(id))
        .filter(threads::owner_id.eq(owner))
        .filter(threads::deleted_at.is_null())
        .select(Thread::as_select())
        .for_update()
        .first(conn)
        .await
        .optional()
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

/// Writes (or clears, with `None`) the thread's streaming partial message. Partial-column
/// update: touches only `streaming_message`.
pub async fn set_streaming(
    conn: &mut AsyncPgConnection,
    thread_id: Uuid,
    streaming: Option<&serde_json::Value>,
) -> QueryResult<()> {
    diesel::update(threads::table.find(thread_id))
        .set(threads::streaming_message.eq(streaming.map(|s| crate::text::clean_json(s).into_owned())))
        .execute(conn)
        .await?;
    Ok(())
}

/// Records the context size (tokens) measured for the thread's next model call.
pub async fn set_context_tokens(conn: &mut AsyncPgConnection, thread_id: Uuid, tokens: i32) -> QueryResult<()> {
    diesel::update(threads::table.find(thread_id))
        .set(threads::context_tokens.eq(tokens))
        .execute(conn)
        .await?;
    Ok(())
}

/// Links a thread to the thread it was compacted from.
pub async fn set_parent(conn: &mut AsyncPgConnection, thread_id: Uuid, parent: Uuid) -> QueryResult<()> {
    diesel::update(threads::table.find(thread_id))
        .set(threads::parent_thread_id.eq(parent))
        .execute(conn)
        .await?;
    Ok(())
}

/// Changes the given fields (others untouched); returns the thread.
pub async fn update(
    conn: &mut AsyncPgConnection,
    thread_id: Uuid,
    title: Option<String>,
    model: Option<String>,
    metadata: Option<serde_json::Value>,
) -> QueryResult<Thread> {
    let current = get(conn, thread_id).await?;
    diesel::update(threads::table.find(thread_id))
        .set((
            threads::title.eq(title.map_or(current.title, |t| crate::text::clean(&t).into_owned())),
            threads::model.eq(model.or(current.model)),
            threads::metadata.eq(metadata.map_or(current.metadata, |m| crate::text::clean_json(&m).into_owned())),
            threads::updated_at.eq(diesel::dsl::now),
        ))
        .returning(Thread::as_returning())
        .get_result(conn)
        .await
}

/// Marks the thread deleted (every owner-scoped read then treats it as missing).
pub async fn soft_delete(conn: &mut AsyncPgConnection, thread_id: Uuid) -> QueryResult<()> {
    diesel::update(threads::table.find(thread_id))
        .set((threads::deleted_at.eq(diesel::dsl::now), threads::updated_at.eq(diesel::dsl::now)))
        .execute(conn)
        .await?;
    Ok(())
}
