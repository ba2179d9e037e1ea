//! Principals, API keys and browser sessions (SPEC §11; issue 10 "Key lifecycle").
//!
//! A key is `al_` + 40 hex characters (160 random bits). Only its SHA-256 digest is stored, with
//! its first 10 characters in clear (`key_prefix`, to name it in `list-keys` and `revoke-key`),
//! an optional name and expiry, and `last_used_at` — refreshed at most once a minute per key
//! ([`LAST_USED_RESOLUTION_S`]), so authenticating is a read, not a write per request.
//!
//! A browser session (CONTRACTS.md "Browser sign-in session") is an opaque random token kept in
//! an HttpOnly cookie; the database holds only its SHA-256 and the key it was made from, so a
//! revoked or expired key ends its sessions at once.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{Array, Bytea, Nullable, Text, Timestamptz, Uuid as SqlUuid};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use rand::RngCore;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::db::schema::principals;

/// Who is calling: resolved from a bearer key, a session cookie or, in development, the
/// loopback principal.
#[derive(Debug, Clone, PartialEq, Eq, Queryable, Selectable, QueryableByName, serde::Serialize)]
#[diesel(table_name = principals)]
pub struct Principal {
    pub id: Uuid,
    pub name: String,
}

/// Name of the principal that loopback requests act as when `DEV_LOOPBACK_PRINCIPAL` is on.
pub const LOOPBACK_PRINCIPAL: &str = "local";

/// `last_used_at` is written only when it is older than this many seconds.
pub const LAST_USED_RESOLUTION_S: i64 = 60;

/// SHA-256 digest of a clear API key or session token.
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

/// Longest principal or key name, in characters.
pub const MAX_NAME_CHARS: usize = 200;

/// Checks a principal's or a key's name as an operator types it (`create-key`): not empty nor
/// blank, at most [`MAX_NAME_CHARS`] characters, no control characters (acceptance probe H: an
/// empty principal name made a key whose principal `list-keys` showed blank). Error: why.
pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    if name.trim().is_empty() {
        return Err(format!("{what} must not be empty"));
    }
    if name.chars().count() > MAX_NAME_CHARS {
        return Err(format!("{what} is limited to {MAX_NAME_CHARS} characters"));
    }
    if name.chars().any(char::is_control) {
        return Err(format!("{what} must not contain control characters"));
    }
    Ok(())
}

/// Creates a new API key for the principal `principal` (created if absent), with an optional
/// `name` (a label shown by `list-keys`) and expiry. Returns the clear key, which is not stored
/// and cannot be shown again.
pub async fn create_key(
    conn: &mut AsyncPgConnection,
    principal: &str,
    name: Option<&str>,
    expires_at: Option<DateTime<Utc>>,
) -> QueryResult<String> {
    let principal = ensure_principal(conn, principal).await?;
    let key = format!("al_{}", random_hex(20));
    diesel::sql_query(
        "INSERT INTO api_keys (id, principal_id, key_hash, key_prefix, name, expires_at) VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind::<SqlUuid, _>(Uuid::new_v4())
    .bind::<SqlUuid, _>(principal.id)
    .bind::<Bytea, _>(hash_key(&key))
    .bind::<Text, _>(&key[..10])
    .bind::<Nullable<Text>, _>(name)
    .bind::<Nullable<Timestamptz>, _>(expires_at)
    .execute(conn)
    .await?;
    Ok(key)
}

fn random_hex(bytes: usize) -> String {
    let mut secret = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut secret);
    hex::encode(secret)
}

/// Length of a clear key: `al_` + 40 hex characters.
pub const KEY_LEN: usize = 43;

/// One key as `list-keys` shows it (never the key itself).
#[derive(Debug, Clone, QueryableByName, serde::Serialize)]
pub struct KeyListing {
    #[diesel(sql_type = Text)]
    pub principal: String,
    /// The first 10 characters of the key.
    #[diesel(sql_type = Text)]
    pub prefix: String,
    #[diesel(sql_type = Nullable<Text>)]
    pub name: Option<String>,
    #[diesel(sql_type = Timestamptz)]
    pub created_at: DateTime<Utc>,
    /// Last successful authentication (minute resolution), if ever.
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub last_used_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub expires_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub revoked_at: Option<DateTime<Utc>>,
    /// `live`, `expired` or `revoked`.
    #[diesel(sql_type = Text)]
    pub status: String,
}

/// Keys of `principal` (every principal when `None`), newest first; revoked and expired keys
/// only with `all`.
pub async fn list_keys(conn: &mut AsyncPgConnection, principal: Option<&str>, all: bool) -> QueryResult<Vec<KeyListing>> {
    diesel::sql_query(
        "SELECT p.name AS principal, k.key_prefix AS prefix, k.name, k.created_at, k.last_used_at, k.expires_at, k.revoked_at,
                CASE WHEN k.revoked_at IS NOT NULL THEN 'revoked'
                     WHEN k.expires_at IS NOT NULL AND k.expires_at <= now() THEN 'expired'
                     ELSE 'live' END AS status
           FROM api_keys k JOIN principals p ON p.id = k.principal_id
          WHERE ($1::text IS NULL OR p.name = $1)
            AND ($2 OR (k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > now())))
          ORDER BY p.name, k.created_at DESC",
    )
    .bind::<Nullable<Text>, _>(principal)
    .bind::<diesel::sql_types::Bool, _>(all)
    .load(conn)
    .await
}

/// Why [`revoke_key`] refused.
#[derive(Debug, thiserror::Error)]
pub enum RevokeError {
    /// Neither a whole key nor a prefix of 8 to 10 characters (only the first 10 are stored).
    #[error("give the whole key ({KEY_LEN} characters) or its first 8 to 10 characters")]
    BadPrefix,
    #[error(transparent)]
    Query(#[from] diesel::result::Error),
}

/// Revokes the live keys of principal `principal` matching the whole clear key, or a prefix of
/// 8 to 10 characters of it (the first 10 characters are stored in clear as `key_prefix`;
/// `al_` + 5 hex = 8). Keys of other principals never match. Anything else is refused rather
/// than silently matching nothing. Returns how many keys were revoked; their sessions end with
/// them (they are checked against the key on every request).
pub async fn revoke_key(conn: &mut AsyncPgConnection, principal: &str, prefix_or_key: &str) -> Result<usize, RevokeError> {
    let n = prefix_or_key.chars().count();
    let (hash, pattern) = if n == KEY_LEN {
        (Some(hash_key(prefix_or_key)), None)
    } else if (8..=10).contains(&n) {
        let escaped = prefix_or_key.replace('\\', "\\\\").replace('%', "\\%").replace('_', "\\_");
        (None, Some(format!("{escaped}%")))
    } else {
        return Err(RevokeError::BadPrefix);
    };
    let revoked = diesel::sql_query(
        "UPDATE api_keys k SET revoked_at = now()
           FROM principals p
          WHERE p.id = k.principal_id AND p.name = $1 AND k.revoked_at IS NULL
            AND (($2::bytea IS NOT NULL AND k.key_hash = $2) OR ($3::text IS NOT NULL AND k.key_prefix LIKE $3))",
    )
    .bind::<Text, _>(principal)
    .bind::<Nullable<Bytea>, _>(hash)
    .bind::<Nullable<Text>, _>(pattern)
    .execute(conn)
    .await?;
    Ok(revoked)
}

/// A live key's identity after authentication.
#[derive(Debug, Clone, QueryableByName)]
pub struct KeyAuth {
    #[diesel(sql_type = SqlUuid)]
    pub key_id: Uuid,
    #[diesel(embed)]
    pub principal: Principal,
    /// Whether `last_used_at` is older than [`LAST_USED_RESOLUTION_S`] (the caller then
    /// refreshes it with [`touch_key`]).
    #[diesel(sql_type = diesel::sql_types::Bool)]
    pub stale: bool,
}

/// Resolves a clear bearer key to its principal; `None` for unknown, revoked or expired keys.
pub async fn authenticate_key(conn: &mut AsyncPgConnection, key: &str) -> QueryResult<Option<KeyAuth>> {
    diesel::sql_query(
        "SELECT k.id AS key_id, p.id, p.name,
                (k.last_used_at IS NULL OR k.last_used_at < now() - make_interval(secs => $2)) AS stale
           FROM api_keys k JOIN principals p ON p.id = k.principal_id
          WHERE k.key_hash = $1 AND k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > now())",
    )
    .bind::<Bytea, _>(hash_key(key))
    .bind::<diesel::sql_types::Double, _>(LAST_USED_RESOLUTION_S as f64)
    .get_result(conn)
    .await
    .optional()
}

/// Records a use of key `key_id` unless one was recorded within [`LAST_USED_RESOLUTION_S`] (the
/// condition is in the statement, so concurrent requests write at most once).
pub async fn touch_key(conn: &mut AsyncPgConnection, key_id: Uuid) -> QueryResult<usize> {
    diesel::sql_query(
        "UPDATE api_keys SET last_used_at = now()
          WHERE id = $1 AND (last_used_at IS NULL OR last_used_at < now() - make_interval(secs => $2))",
    )
    .bind::<SqlUuid, _>(key_id)
    .bind::<diesel::sql_types::Double, _>(LAST_USED_RESOLUTION_S as f64)
    .execute(conn)
    .await
}

/// Resolves a clear bearer key to its principal; `None` for unknown, revoked or expired keys.
pub async fn principal_for_key(conn: &mut AsyncPgConnection, key: &str) -> QueryResult<Option<Principal>> {
    Ok(authenticate_key(conn, key).await?.map(|k| k.principal))
}

/// Live sessions kept per key; creating one more deletes the oldest.
pub const MAX_SESSIONS_PER_KEY: i64 = 50;

/// A live session's identity after authentication.
#[derive(Debug, Clone, QueryableByName)]
pub struct SessionAuth {
    #[diesel(sql_type = SqlUuid)]
    pub session_id: Uuid,
    #[diesel(sql_type = SqlUuid)]
    pub key_id: Uuid,
    #[diesel(embed)]
    pub principal: Principal,
}

/// Creates a session for live key `key_id` lasting `ttl`; returns the clear token (`as_` + 64
/// hex characters, 256 random bits). Deletes expired sessions (a bounded batch) and this key's
/// oldest sessions beyond [`MAX_SESSIONS_PER_KEY`].
pub async fn create_session(conn: &mut AsyncPgConnection, key_id: Uuid, ttl: std::time::Duration) -> QueryResult<String> {
    let token = format!("as_{}", random_hex(32));
    diesel::sql_query("INSERT INTO sessions (id, token_hash, key_id, expires_at) VALUES ($1, $2, $3, now() + make_interval(secs => $4))")
        .bind::<SqlUuid, _>(Uuid::new_v4())
        .bind::<Bytea, _>(hash_key(&token))
        .bind::<SqlUuid, _>(key_id)
        .bind::<diesel::sql_types::Double, _>(ttl.as_secs_f64())
        .execute(conn)
        .await?;
    diesel::sql_query(
        "DELETE FROM sessions WHERE id IN (
             (SELECT id FROM sessions WHERE expires_at <= now() LIMIT 1000)
             UNION ALL
             (SELECT id FROM sessions WHERE key_id = $1 ORDER BY created_at DESC OFFSET $2))",
    )
    .bind::<SqlUuid, _>(key_id)
    .bind::<diesel::sql_types::BigInt, _>(MAX_SESSIONS_PER_KEY)
    .execute(conn)
    .await?;
    Ok(token)
}

/// Resolves a session token; `None` when unknown, expired, or its key is revoked or expired.
pub async fn authenticate_session(conn: &mut AsyncPgConnection, token: &str) -> QueryResult<Option<SessionAuth>> {
    diesel::sql_query(
        "SELECT s.id AS session_id, k.id AS key_id, p.id, p.name
           FROM sessions s JOIN api_keys k ON k.id = s.key_id JOIN principals p ON p.id = k.principal_id
          WHERE s.token_hash = $1 AND s.expires_at > now()
            AND k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > now())",
    )
    .bind::<Bytea, _>(hash_key(token))
    .get_result(conn)
    .await
    .optional()
}

/// Deletes the session of `token` (sign-out); returns whether one existed.
pub async fn delete_session(conn: &mut AsyncPgConnection, token: &str) -> QueryResult<bool> {
    Ok(diesel::sql_query("DELETE FROM sessions WHERE token_hash = $1").bind::<Bytea, _>(hash_key(token)).execute(conn).await? > 0)
}

#[derive(QueryableByName)]
struct Dead {
    #[diesel(sql_type = SqlUuid)]
    id: Uuid,
}

/// Of `keys` and `sessions` (ids), those that no longer authenticate: keys revoked, expired or
/// deleted; sessions expired, deleted, or whose key no longer authenticates. One statement, for
/// the api's periodic check of open live-update connections.
pub async fn dead_credentials(conn: &mut AsyncPgConnection, keys: &[Uuid], sessions: &[Uuid]) -> QueryResult<Vec<Uuid>> {
    let rows: Vec<Dead> = diesel::sql_query(
        "SELECT id FROM unnest($1::uuid[]) AS q(id)
          WHERE NOT EXISTS (SELECT 1 FROM api_keys k WHERE k.id = q.id AND k.revoked_at IS NULL
                                                      AND (k.expires_at IS NULL OR k.expires_at > now()))
         UNION ALL
         SELECT id FROM unnest($2::uuid[]) AS q(id)
          WHERE NOT EXISTS (SELECT 1 FROM sessions s JOIN api_keys k ON k.id = s.key_id
                             WHERE s.id = q.id AND s.expires_at > now() AND k.revoked_at IS NULL
                               AND (k.expires_at IS NULL OR k.expires_at > now()))",
    )
    .bind::<Array<SqlUuid>, _>(keys)
    .bind::<Array<SqlUuid>, _>(sessions)
    .load(conn)
    .await?;
    Ok(rows.into_iter().map(|d| d.id).collect())
}

/// Parses a key expiry: an RFC 3339 timestamp (`2027-01-31T00:00:00Z`) or a duration from now
/// (`90d`, `12h`, `30min`; humantime syntax). Errors name what was expected.
pub fn parse_expiry(text: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
    if let Ok(at) = DateTime::parse_from_rfc3339(text.trim()) {
        let at = at.with_timezone(&Utc);
        return if at > now { Ok(at) } else { Err(format!("{text} is in the past")) };
    }
    let duration = humantime::parse_duration(text.trim())
        .map_err(|e| format!("expected an RFC 3339 time (2027-01-31T00:00:00Z) or a duration (90d, 12h): {e}"))?;
    if duration.is_zero() {
        return Err("the duration must be positive".into());
    }
    chrono::Duration::from_std(duration).ok().and_then(|d| now.checked_add_signed(d)).ok_or_else(|| "the duration is too long".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_must_be_printable_and_bounded() {
        assert!(check_name("--principal", "tenant-a").is_ok());
        assert!(check_name("--principal", "Équipe données").is_ok());
        for bad in ["", "   ", "a\tb", "line\nbreak"] {
            assert!(check_name("--principal", bad).is_err(), "{bad:?}");
        }
        assert!(check_name("--principal", &"x".repeat(MAX_NAME_CHARS)).is_ok());
        assert!(check_name("--principal", &"x".repeat(MAX_NAME_CHARS + 1)).is_err());
    }

    #[test]
    fn expiry_accepts_timestamps_and_durations() {
        let now = DateTime::parse_from_rfc3339("2026-12-02T00:00:00Z").unwrap().with_timezone(&Utc);
        assert_eq!(parse_expiry("2027-01-01T00:00:00Z", now).unwrap().to_rfc3339(), "2027-01-01T00:00:00+00:00");
        assert_eq!(parse_expiry("90d", now).unwrap(), now + chrono::Duration::days(90));
        assert_eq!(parse_expiry("12h", now).unwrap(), now + chrono::Duration::hours(12));
        assert!(parse_expiry("2026-01-01T00:00:00Z", now).is_err(), "past");
        assert!(parse_expiry("0s", now).is_err());
        assert!(parse_expiry("tomorrow", now).is_err());
    }
}
