//! Principals and API keys (SPEC §11).
//!
//! A key is `al_` + 40 hex characters (160 random bits). Only its SHA-256 digest is stored;
//! the clear key is returned once by [`create_key`].

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use rand::RngCore;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::db::schema::{api_keys, principals};

/// Who is calling: resolved from a bearer key or, in development, the loopback principal.
#[derive(Debug, Clone, Queryable, Selectable, serde::Serialize)]
#[diesel(table_name = principals)]
pub struct Principal {
    pub id: Uuid,
    pub name: String,
}

/// Name of the principal that loopback requests act as when `DEV_LOOPBACK_PRINCIPAL` is on.
pub const LOOPBACK_PRINCIPAL: &str = "local";

/// SHA-256 digest of a clear API key.
pub fn hash_key(key: &str) -> Vec<u8> {
    Sha256::digest(key.as_bytes()).to_vec()
}

/// Returns the principal named `name`, creating it if absent (idempotent under concurrency).
pub async fn ensure_principal(conn: &mut AsyncPgConnection, name: &str) -> QueryResult<Principal> {
    diesel::insert_into(principals::table)
        .values((principals::id.eq(Uuid::new_v4()), principals::name.eq(name)))
        .on_conflict(principals::name)
        .do_nothing()
        .execute(conn)
        .await?;
    principals::table
        .filter(principals::name.eq(name))
        .select(Principal::as_select())
        .get_result(conn)
        .await
}

/// Creates a new API key for the principal `name` (created if absent). Returns the clear key,
/// which is not stored and cannot be shown again.
pub async fn create_key(conn: &mut AsyncPgConnection, name: &str) -> QueryResult<String> {
    let principal = ensure_principal(conn, name).await?;
    let mut secret = [0u8; 20];
    rand::rng().fill_bytes(&mut secret);
    let key = format!("al_{}", hex::encode(secret));
    diesel::insert_into(api_keys::table)
        .values((
            api_keys::id.eq(Uuid::new_v4()),
            api_keys::principal_id.eq(principal.id),
            api_keys::key_hash.eq(hash_key(&key)),
            api_keys::key_prefix.eq(&key[..10]),
        ))
        .execute(conn)
        .await?;
    Ok(key)
}

/// Revokes keys by the whole clear key, or by a prefix of at least 8 characters of it (the first
/// 10 characters are stored in clear as `key_prefix`; `al_` + 5 hex = 8). Returns how many keys
/// were revoked (0 when nothing matched).
pub async fn revoke_key(conn: &mut AsyncPgConnection, prefix_or_key: &str) -> QueryResult<usize> {
    let hash = hash_key(prefix_or_key);
    let prefix: String = prefix_or_key.chars().take(10).collect();
    let mut query = diesel::update(api_keys::table).filter(api_keys::revoked_at.is_null()).into_boxed();
    query = if prefix_or_key.len() > 10 {
        query.filter(api_keys::key_hash.eq(hash))
    } else if prefix.len() >= 8 {
        query.filter(api_keys::key_prefix.like(format!("{}%", prefix.replace('\\', "").replace('%', "\\%").replace('_', "\\_"))))
    } else {
        return Ok(0);
    };
    query.set(api_keys::revoked_at.eq(diesel::dsl::now)).execute(conn).await
}

/// Resolves a clear bearer key to its principal; `None` for unknown or revoked keys.
pub async fn principal_for_key(conn: &mut AsyncPgConnection, key: &str) -> QueryResult<Option<Principal>> {
    api_keys::table
        .inner_join(principals::table)
        .filter(api_keys::key_hash.eq(hash_key(key)))
        .filter(api_keys::revoked_at.is_null())
        .select(Principal::as_select())
        .first(conn)
        .await
        .optional()
}
