//! Reads computed by SQL functions of `migrations/2026-12-02-000007_ui_product` (branch lists,
//! branch switchers, search, run inspector), called on the api's read pool: one statement, no
//! locks, a JSON value back.

use diesel::sql_types::{BigInt, Jsonb, Nullable, Uuid as SqlUuid};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde_json::Value;
use uuid::Uuid;

#[derive(diesel::QueryableByName)]
struct Row {
    #[diesel(sql_type = Nullable<Jsonb>)]
    v: Option<Value>,
}

/// `agentloop_branches_of`: the alternatives of the fork whose shown alternative starts at
/// active message `sequence`, or `None` when it starts none.
pub async fn branches_of(conn: &mut AsyncPgConnection, thread: Uuid, sequence: i64) -> diesel::QueryResult<Option<Value>> {
    let row: Row = diesel::sql_query("SELECT agentloop_branches_of($1, $2) AS v")
        .bind::<SqlUuid, _>(thread)
        .bind::<BigInt, _>(sequence)
        .get_result(conn)
        .await?;
    Ok(row.v)
}

/// `agentloop_branch_marks`: `[{sequence, index, count}]` for the active messages in
/// `[from, to]` that start an alternative.
pub async fn branch_marks(conn: &mut AsyncPgConnection, thread: Uuid, from: i64, to: i64) -> diesel::QueryResult<Vec<Value>> {
    let row: Row = diesel::sql_query("SELECT agentloop_branch_marks($1, $2, $3) AS v")
        .bind::<SqlUuid, _>(thread)
        .bind::<BigInt, _>(from)
        .bind::<BigInt, _>(to)
        .get_result(conn)
        .await?;
    Ok(match row.v {
        Some(Value::Array(marks)) => marks,
        _ => Vec::new(),
    })
}

/// Adds `branch: {index, count}` to the messages (JSON objects with `sequence`) that start an
/// alternative of a fork (one `agentloop_branch_marks` call over their sequence range).
pub async fn annotate_branches(conn: &mut AsyncPgConnection, thread: Uuid, messages: &mut [Value]) -> diesel::QueryResult<()> {
    let seq = |m: &Value| m.get("sequence").and_then(Value::as_i64);
    let (Some(from), Some(to)) = (messages.iter().filter_map(seq).min(), messages.iter().filter_map(seq).max()) else {
        return Ok(());
    };
    for mark in branch_marks(conn, thread, from, to).await? {
        if let Some(m) = messages.iter_mut().find(|m| seq(m) == mark.get("sequence").and_then(Value::as_i64)) {
            m["branch"] = serde_json::json!({"index": mark["index"], "count": mark["count"]});
        }
    }
    Ok(())
}

/// `agentloop_search` for `principal` with the tsquery text `query` (see [`tsquery`]).
pub async fn search(conn: &mut AsyncPgConnection, principal: Uuid, query: &str, limit: i64) -> diesel::QueryResult<Value> {
    let arg = serde_json::json!({"principalId": principal, "query": query, "limit": limit});
    let row: Row = diesel::sql_query("SELECT agentloop_search($1) AS v").bind::<Jsonb, _>(arg).get_result(conn).await?;
    Ok(row.v.unwrap_or(Value::Null))
}

/// `agentloop_run_inspect`: `{liveness, toolCalls, toolCallsTotal, compactions}` of a run.
pub async fn run_inspect(conn: &mut AsyncPgConnection, run: Uuid, lease_ms: i64, renew_ms: i64, unclaimed_ms: i64) -> diesel::QueryResult<Value> {
    let row: Row = diesel::sql_query("SELECT agentloop_run_inspect($1, $2, $3, $4) AS v")
        .bind::<SqlUuid, _>(run)
        .bind::<BigInt, _>(lease_ms)
        .bind::<BigInt, _>(renew_ms)
        .bind::<BigInt, _>(unclaimed_ms)
        .get_result(conn)
        .await?;
    Ok(row.v.unwrap_or(Value::Null))
}

/// A PostgreSQL `tsquery` (configuration 'simple') for free text typed by a person: its words
/// (letters and digits only; anything else separates words), all required, the last one also as
/// a prefix (search as you type). `None` when no word is left. Never a syntax error, whatever
/// the input.
pub fn tsquery(text: &str) -> Option<String> {
    let words: Vec<String> = text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .take(16)
        .map(|w| w.chars().take(64).collect::<String>().to_lowercase())
        .collect();
    let (last, rest) = words.split_last()?;
    let mut parts: Vec<String> = rest.iter().map(|w| format!("'{w}'")).collect();
    parts.push(format!("'{last}':*"));
    Some(parts.join(" & "))
}

/// `agentloop_webhooks_read`: `{webhooks}` of `p.principalId`, or the one webhook `p.id`
/// (`None` when it is not theirs).
pub async fn webhooks(conn: &mut AsyncPgConnection, p: Value) -> diesel::QueryResult<Option<Value>> {
    let row: Row = diesel::sql_query("SELECT agentloop_webhooks_read($1) AS v").bind::<Jsonb, _>(p).get_result(conn).await?;
    Ok(row.v.filter(|v| !v.is_null()))
}

/// `agentloop_webhook_deliveries`: `{deliveries}` of webhook `p.webhookId` (`None` when it is
/// not `p.principalId`'s).
pub async fn webhook_deliveries(conn: &mut AsyncPgConnection, p: Value) -> diesel::QueryResult<Option<Value>> {
    let row: Row = diesel::sql_query("SELECT agentloop_webhook_deliveries($1) AS v").bind::<Jsonb, _>(p).get_result(conn).await?;
    Ok(row.v.filter(|v| !v.is_null()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn tsquery_is_always_well_formed() {
        assert_eq!(super::tsquery("Deploy the k8s"), Some("'deploy' & 'the' & 'k8s':*".into()));
        assert_eq!(super::tsquery("  !&|':*()  "), None);
        assert_eq!(super::tsquery("it's"), Some("'it' & 's':*".into()));
        assert_eq!(super::tsquery("größe"), Some("'größe':*".into()));
    }
}
