//! Idempotent commands (SPEC §11): `(principal, command id) -> original response`.
//!
//! The receipt is claimed by the command's step function (`agentloop_chat`) with
//! `INSERT ... ON CONFLICT DO NOTHING` inside the command's transaction, never by
//! check-then-insert: of N concurrent identical requests exactly one inserts; the others block
//! on the unique index until it commits, then replay its response (or, if it rolled back, one of
//! them claims the key anew). This module holds the fingerprint; pruning is a retention task of the worker's maintenance
//! (`agentloop_prune_receipts`, bounded batches).

use sha2::{Digest, Sha256};

/// Hex SHA-256 of a request's canonical JSON (the request fingerprint).
pub fn fingerprint(request: &serde_json::Value) -> String {
    hex::encode(Sha256::digest(request.to_string().as_bytes()))
}
