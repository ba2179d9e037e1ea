//! Idempotent commands (SPEC §11): `(principal, command id) -> original response`.
//!
//! The receipt is claimed with `INSERT ... ON CONFLICT DO NOTHING` inside the command's
//! transaction, never by check-then-insert: of N concurrent identical requests exactly one
//! inserts; the others block on the unique index until it commits, then replay its response
//! (or, if it rolled back, one of them claims the key anew).

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::db::schema::command_receipts;

/// Result of claiming a command id.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// First use: perform the command, then [`store_response`].
    New,
    /// An identical earlier request: return this response unchanged.
    Replay(serde_json::Value),
    /// The id was used with a different request body (409 `idempotency_conflict`).
    Conflict,
}

/// Hex SHA-256 of a request's canonical JSON (the request fingerprint).
pub fn fingerprint(request: &serde_json::Value) -> String {
    hex::encode(Sha256::digest(request.to_string().as_bytes()))
}

/// Claims `command_id` for `principal` inside the caller's transaction.
pub async fn claim(
    conn: &mut AsyncPgConnection,
    principal: Uuid,
    command_id: &str,
    fingerprint: &str,
) -> QueryResult<Claim> {
    let inserted = diesel::insert_into(command_receipts::table)
        .values((
            command_receipts::principal_id.eq(principal),
            command_receipts::command_id.eq(command_id),
            command_receipts::fingerprint.eq(fingerprint),
        ))
        .on_conflict_do_nothing()
        .execute(conn)
        .await?;
    if inserted == 1 {
        return Ok(Claim::New);
    }
    let (stored_fingerprint, response): (String, Option<serde_json::Value>) = command_receipts::table
        .find((principal, command_id))
        .select((command_receipts::fingerprint, command_receipts::response))
        .first(conn)
        .await?;
    Ok(match response {
        Some(response) if stored_fingerprint == fingerprint => Claim::Replay(response),
        _ => Claim::Conflict,
    })
}

/// Stores the response of a newly claimed command (same transaction as the command).
pub async fn store_response(
    conn: &mut AsyncPgConnection,
    principal: Uuid,
    command_id: &str,
    thread_id: Option<Uuid>,
    run_id: Option<Uuid>,
    response: &serde_json::Value,
) -> QueryResult<()> {
    diesel::update(command_receipts::table.find((principal, command_id)))
        .set((
            command_receipts::response.eq(response),
            command_receipts::thread_id.eq(thread_id),
            command_receipts::run_id.eq(run_id),
        ))
        .execute(conn)
        .await?;
    Ok(())
}

/// Deletes receipts older than `keep_hours` (SPEC §11: kept at least 24 hours).
pub async fn prune(conn: &mut AsyncPgConnection, keep_hours: i64) -> QueryResult<usize> {
    diesel::sql_query("DELETE FROM command_receipts WHERE created_at < now() - make_interval(hours => $1::int)")
        .bind::<diesel::sql_types::BigInt, _>(keep_hours)
        .execute(conn)
        .await
}
