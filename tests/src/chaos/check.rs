//! The invariants, evaluated at the end from the database (read directly, not through the
//! proxy), the effects receiver, and what the clients recorded.

use std::collections::{BTreeMap, HashMap, HashSet};

use anyhow::Result;
use serde_json::Value;
use tokio_postgres::Client;

use super::receiver::Effect;
use super::report::{Line, Report, info, inv, inv_grouped};
use super::stack::{ASK_TOOL, EFFECT_TOOL};
use super::workload::{PostOutcome, SseLog, Turn, Workload};

struct RunRow {
    status: String,
    error_code: Option<String>,
    error_message: Option<String>,
    recoveries: i32,
    lease_owner: Option<String>,
}

struct Msg {
    thread: String,
    sequence: i64,
    role: String,
    text: String,
    tool_calls: Option<Value>,
    tool_call_id: Option<String>,
    run_id: Option<String>,
}

struct ApprovalRow {
    run: String,
    tool_call_id: String,
    arguments: Value,
    status: String,
    approved_arguments: Option<Value>,
    edited: bool,
}

struct OpRow {
    status: String,
    resolution: Option<String>,
}

/// The database rows the checks need.
pub struct Snapshot {
    runs: HashMap<String, RunRow>,
    messages: Vec<Msg>,
    approvals: Vec<ApprovalRow>,
    operations: HashMap<String, OpRow>,
    receipts: HashMap<String, String>,
    /// Journal per followed thread: sequence -> (kind, payload, created_at as Unix seconds).
    journal: HashMap<String, BTreeMap<i64, (String, Value, f64)>>,
    /// Last journal sequence per thread.
    pub journal_end: HashMap<String, i64>,
    /// Why a run failed, from the worker logs (`run id -> error`), when found.
    pub log_reasons: HashMap<String, String>,
}

/// Starts of the system prompts of the worker's own model requests that are not agent steps:
/// titles (`agentloop_worker::title::TITLE_PROMPT`) and compaction summaries
/// (`agentloop_shared::compaction::SUMMARY_PROMPT`).
const NOT_AGENT_STEPS: [&str; 2] = ["You write conversation titles", "You compress the earlier part"];

/// Agent-step requests the mock model received, counted per (turn token, step index: the number
/// of assistant messages after the turn's user message) — the mock plays that step for it. A
/// step answered once is requested once: a second request for it means its answer was paid and
/// not kept. Legitimately so when its worker died or stalled past the lease (a recovery), or the
/// client stopped the run (cancel, interrupt); any other repeat in a run that completed is a
/// paid answer thrown away (the promise). Returns (steps requested again in any run, those
/// violations).
fn paid_again(turns: &[Turn], snap: &Snapshot, requests: &[Value]) -> (u64, Vec<String>) {
    let mut counts: HashMap<(String, usize), usize> = HashMap::new();
    for r in requests {
        let Some(messages) = r["messages"].as_array() else { continue };
        let own = messages.iter().any(|m| {
            m["role"] == "system" && NOT_AGENT_STEPS.iter().any(|p| text_of(&m["content"]).starts_with(p))
        });
        let Some(last_user) = messages.iter().rposition(|m| m["role"] == "user") else { continue };
        let text = text_of(&messages[last_user]["content"]);
        let Some(token) = text.find("turn ").and_then(|at| text[at + 5..].split_whitespace().next()) else { continue };
        if own {
            continue;
        }
        let step = messages[last_user..].iter().filter(|m| m["role"] == "assistant").count();
        *counts.entry((token.to_owned(), step)).or_default() += 1;
    }
    let repeated = counts.values().filter(|n| **n > 1).count() as u64;
    let mut thrown = Vec::new();
    for t in turns {
        let PostOutcome::Accepted(run) = &t.outcome else { continue };
        let Some(row) = snap.runs.get(run) else { continue };
        if t.cancel_requested || row.status != "completed" || row.recoveries > 0 {
            continue;
        }
        let mut steps: Vec<(usize, usize)> =
            counts.iter().filter(|((token, _), n)| *token == t.token && **n > 1).map(|((_, step), n)| (*step, *n)).collect();
        steps.sort();
        for (step, n) in steps {
            thrown.push(format!("turn {} (run {run}): step {step} sent to the model {n} times; recoveries 0, not stopped by the client", t.token));
        }
    }
    (repeated, thrown)
}

fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

impl Snapshot {
    /// Reads everything (followed threads' journals included).
    pub async fn load(db: &Client, followed: &[String]) -> Result<Self> {
        let mut runs = HashMap::new();
        for r in db
            .query("SELECT id, status, error_code, error_message, recoveries, lease_owner FROM runs", &[])
            .await?
        {
            runs.insert(
                r.get::<_, uuid::Uuid>(0).to_string(),
                RunRow {
                    status: r.get(1),
                    error_code: r.get(2),
                    error_message: r.get(3),
                    recoveries: r.get(4),
                    lease_owner: r.get(5),
                },
            );
        }
        let mut messages = Vec::new();
        for r in db
            .query(
                "SELECT thread_id, sequence, role, content, tool_calls, tool_call_id, run_id FROM messages WHERE active
                 ORDER BY thread_id, sequence",
                &[],
            )
            .await?
        {
            messages.push(Msg {
                thread: r.get::<_, uuid::Uuid>(0).to_string(),
                sequence: r.get(1),
                role: r.get(2),
                text: text_of(&r.get::<_, Value>(3)),
                tool_calls: r.get(4),
                tool_call_id: r.get(5),
                run_id: r.get::<_, Option<uuid::Uuid>>(6).map(|u| u.to_string()),
            });
        }
        let mut approvals = Vec::new();
        for r in db
            .query("SELECT run_id, tool_call_id, arguments, status, approved_arguments, arguments_edited FROM tool_approvals", &[])
            .await?
        {
            approvals.push(ApprovalRow {
                run: r.get::<_, uuid::Uuid>(0).to_string(),
                tool_call_id: r.get(1),
                arguments: r.get(2),
                status: r.get(3),
                approved_arguments: r.get(4),
                edited: r.get(5),
            });
        }
        let mut operations = HashMap::new();
        for r in db.query("SELECT key, status, resolution FROM operations", &[]).await? {
            operations.insert(r.get::<_, String>(0), OpRow { status: r.get(1), resolution: r.get(2) });
        }
        let mut receipts = HashMap::new();
        for r in db.query("SELECT command_id, run_id FROM command_receipts WHERE run_id IS NOT NULL", &[]).await? {
            receipts.insert(r.get::<_, String>(0), r.get::<_, uuid::Uuid>(1).to_string());
        }
        let mut journal_end = HashMap::new();
        for r in db.query("SELECT id, last_event_sequence FROM threads", &[]).await? {
            journal_end.insert(r.get::<_, uuid::Uuid>(0).to_string(), r.get::<_, i64>(1));
        }
        let mut journal: HashMap<String, BTreeMap<i64, (String, Value, f64)>> = HashMap::new();
        let ids: Vec<uuid::Uuid> = followed.iter().filter_map(|t| t.parse().ok()).collect();
        for r in db
            .query("SELECT thread_id, sequence, kind, payload, extract(epoch from created_at)::float8 FROM thread_events
                 WHERE thread_id = ANY($1) ORDER BY thread_id, sequence", &[&ids])
            .await?
        {
            journal
                .entry(r.get::<_, uuid::Uuid>(0).to_string())
                .or_default()
                .insert(r.get(1), (r.get(2), r.get(3), r.get(4)));
        }
        Ok(Self { runs, messages, approvals, operations, receipts, journal, journal_end, log_reasons: HashMap::new() })
    }

    /// Last journal sequence of every thread.
    pub async fn journal_ends(db: &Client) -> Result<HashMap<String, i64>> {
        let mut ends = HashMap::new();
        for r in db.query("SELECT id, last_event_sequence FROM threads", &[]).await? {
            ends.insert(r.get::<_, uuid::Uuid>(0).to_string(), r.get::<_, i64>(1));
        }
        Ok(ends)
    }
}

/// An event reaching an open SSE connection later than this after its commit is late: longer
/// than the api's heartbeat (15 s, after which an idle client re-reads the journal) plus the
/// longest fault (a 6 s freeze) and the listener's liveness probe (5 s).
const LATE_SECS: f64 = 30.0;

/// The tool result's shape.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    /// `done <token> via <tool>`: the effect is reported performed for `token`.
    Done(String),
    Declined,
    Cancelled,
    Failed(String),
    Other(String),
    Missing,
}

fn outcome_of(result: Option<&str>) -> Outcome {
    let Some(text) = result else { return Outcome::Missing };
    if let Some(at) = text.find("done ") {
        let token = text[at + 5..].split_whitespace().next().unwrap_or("").to_owned();
        return Outcome::Done(token);
    }
    if text.starts_with("Tool call declined by the user") {
        return Outcome::Declined;
    }
    if text.starts_with("[cancelled") {
        return Outcome::Cancelled;
    }
    if text.contains("request failed") || text.contains("HTTP ") || text.starts_with("failed") {
        return Outcome::Failed(text.chars().take(160).collect());
    }
    Outcome::Other(text.chars().take(160).collect())
}

/// Evaluates every invariant into `report`.
pub fn evaluate(report: &mut Report, w: &Workload, snap: &Snapshot, effects: &[Effect], sse: &[SseLog], model_requests: &[Value]) {
    let turns = w.turns();
    let mut finals_by_run: HashMap<&str, Vec<&Msg>> = HashMap::new();
    let mut finals_by_token_count: HashMap<String, usize> = HashMap::new();
    let mut user_by_token: HashMap<String, i64> = HashMap::new();
    let token_of = |text: &str, prefix: &str| -> Option<String> {
        let at = text.find(prefix)?;
        text[at + prefix.len()..].split_whitespace().next().map(str::to_owned)
    };
    for m in &snap.messages {
        if m.role == "assistant" && m.tool_calls.is_none() {
            if let Some(run) = &m.run_id {
                finals_by_run.entry(run.as_str()).or_default().push(m);
            }
            if let Some(t) = token_of(&m.text, "answer ") {
                *finals_by_token_count.entry(t).or_default() += 1;
            }
        }
        if m.role == "user"
            && let Some(t) = token_of(&m.text, "turn ") {
                user_by_token.entry(t).or_insert(m.sequence);
            }
    }

    // --- turns and answers ---------------------------------------------------------------
    let (mut accepted, mut accepted_late, mut refused, mut unknown) = (0u64, 0u64, 0u64, 0u64);
    let mut refused_codes: BTreeMap<String, u64> = BTreeMap::new();
    let (mut answered, mut cancelled_by_client) = (0u64, 0u64);
    let mut lost = Vec::new();
    let mut duplicates = Vec::new();
    let mut mismatched = Vec::new();
    let mut cancelled_unasked = Vec::new();
    let mut failed = Vec::new();
    let mut failed_codes: BTreeMap<String, u64> = BTreeMap::new();
    let mut failed_reused = 0u64;
    let mut stuck = Vec::new();
    let mut answered_turns: HashMap<&str, Vec<(usize, i64, i64, String)>> = HashMap::new();
    for t in &turns {
        let run_id = match &t.outcome {
            PostOutcome::Accepted(r) => Some(r.clone()),
            PostOutcome::Refused(s, c) => {
                refused += 1;
                *refused_codes.entry(format!("{s} {c}")).or_default() += 1;
                None
            }
            PostOutcome::Unknown(_) => match snap.receipts.get(&t.key) {
                Some(r) => {
                    accepted_late += 1;
                    Some(r.clone())
                }
                None => {
                    unknown += 1;
                    None
                }
            },
        };
        let Some(rid) = run_id else { continue };
        accepted += 1;
        let what = format!("turn {} ({}, {}) thread {} run {rid}", t.n, t.kind, t.policy, t.thread);
        let Some(run) = snap.runs.get(&rid) else {
            lost.push(format!("{what}: the accepted run does not exist"));
            continue;
        };
        let finals = finals_by_run.get(rid.as_str()).cloned().unwrap_or_default();
        if finals_by_token_count.get(&t.token).copied().unwrap_or(0) > 1 || finals.len() > 1 {
            duplicates.push(format!(
                "{what}: {} final answers for the run, {} with its token",
                finals.len(),
                finals_by_token_count.get(&t.token).copied().unwrap_or(0)
            ));
        }
        for f in &finals {
            if token_of(&f.text, "answer ").as_deref() != Some(t.token.as_str()) {
                mismatched.push(format!("{what}: final answer #{} is '{}'", f.sequence, f.text.chars().take(80).collect::<String>()));
            }
        }
        match run.status.as_str() {
            "completed" if finals.len() == 1 => {
                answered += 1;
                let user = user_by_token.get(&t.token).copied().unwrap_or(-1);
                answered_turns.entry(t.thread.as_str()).or_default().push((t.n, user, finals[0].sequence, rid.clone()));
            }
            "completed" if finals.is_empty() => lost.push(format!("{what}: completed without a final answer")),
            "completed" => {}
            "cancelled" if t.cancel_requested => cancelled_by_client += 1,
            "cancelled" => {
                cancelled_unasked.push(format!("{what}: cancelled although the client never asked"));
                lost.push(format!("{what}: cancelled (not asked)"));
            }
            "failed" => {
                let code = run.error_code.clone().unwrap_or_default();
                *failed_codes.entry(code.clone()).or_default() += 1;
                let logged = snap.log_reasons.get(&rid).map(|r| format!(" [worker log: {r}]")).unwrap_or_default();
                let reused = if t.reused_ids {
                    failed_reused += 1;
                    " [the script reuses tool-call ids]"
                } else {
                    ""
                };
                failed.push(format!("{what}: failed {code}: {}{logged}{reused}", run.error_message.clone().unwrap_or_default()));
                lost.push(format!("{what}: failed {code}"));
            }
            other => {
                stuck.push(format!(
                    "{what}: still '{other}' (owner {:?}, recoveries {}, error {:?})",
                    run.lease_owner, run.recoveries, run.error_code
                ));
                lost.push(format!("{what}: still {other}"));
            }
        }
    }
    // FIFO: per thread, answered turns in acceptance order have user turn < answer < next turn.
    let mut fifo = Vec::new();
    for (thread, list) in &mut answered_turns {
        list.sort();
        for (i, (n, user, answer, run)) in list.iter().enumerate() {
            if *user < 0 {
                fifo.push(format!("thread {thread}: turn {n} (run {run}) answered but its user turn is not in history"));
            } else if user > answer {
                fifo.push(format!("thread {thread}: turn {n} (run {run}) answered at #{answer} before its user turn #{user}"));
            }
            if let Some((n2, user2, answer2, run2)) = list.get(i + 1)
                && *user2 >= 0 && (user2 < answer || answer2 < answer) {
                    fifo.push(format!(
                        "thread {thread}: turn {n} (run {run}, user #{user}, answer #{answer}) and the later turn {n2} (run {run2}, user #{user2}, answer #{answer2}) are out of order"
                    ));
                }
        }
    }
    let mut runs_by_status: BTreeMap<&str, u64> = BTreeMap::new();
    let mut recoveries = 0i64;
    for r in snap.runs.values() {
        *runs_by_status.entry(r.status.as_str()).or_default() += 1;
        recoveries += i64::from(r.recoveries);
    }
    let fmt_map = |m: &BTreeMap<String, u64>| m.iter().map(|(k, v)| format!("{k}: {v}")).collect::<Vec<_>>().join(", ");
    let s = report.section("turns and runs");
    s.push(info("turns posted", turns.len() as u64, format!("{} threads", w.threads.lock().expect("threads").len())));
    s.push(info("turns accepted", accepted, format!("{accepted_late} of them found by receipt after a lost response")));
    s.push(info("turns refused", refused, fmt_map(&refused_codes)));
    s.push(info("turns never accepted (no receipt)", unknown, ""));
    s.push(info("turns answered", answered, ""));
    s.push(info("turns cancelled by the client", cancelled_by_client, ""));
    s.push(info(
        "runs",
        snap.runs.len() as u64,
        runs_by_status.iter().map(|(k, v)| format!("{k}: {v}")).collect::<Vec<_>>().join(", "),
    ));
    s.push(info("recoveries (sum of runs.recoveries)", recoveries.max(0) as u64, ""));
    let s = report.section("answers");
    s.push(inv("answers lost", lost, "accepted, not cancelled by the client, no final answer"));
    s.push(inv("duplicate answers", duplicates, "more than one final answer for a turn"));
    s.push(inv("answers of another turn", mismatched, "a run's final answer lacks its turn's token"));
    s.push(inv("answers out of FIFO order", fifo, "per thread, in acceptance order"));
    s.push(inv(
        "runs failed",
        failed,
        format!("{}; {failed_reused} of them in turns whose model reuses tool-call ids", fmt_map(&failed_codes)),
    ));
    s.push(inv("runs cancelled without a client request", cancelled_unasked, ""));
    s.push(inv("runs not terminal at the end", stuck, "after the settle wait"));
    let (repeated, thrown_away) = paid_again(&turns, snap, model_requests);
    s.push(info("model steps requested again", repeated, "same turn and step sent to the model more than once, in any run"));
    s.push(inv(
        "paid answers thrown away",
        thrown_away,
        "a step requested again in a completed run that no worker crash recovered and no client stopped",
    ));

    effects_and_approvals(report, w, snap, effects);
    sse_check(report, snap, sse);
}

fn effects_and_approvals(report: &mut Report, w: &Workload, snap: &Snapshot, effects: &[Effect]) {
    let mut by_key: HashMap<&str, Vec<&Effect>> = HashMap::new();
    let mut by_token: HashMap<&str, Vec<&Effect>> = HashMap::new();
    for e in effects {
        if let Some(k) = &e.key {
            by_key.entry(k.as_str()).or_default().push(e);
        }
        by_token.entry(e.token.as_str()).or_default().push(e);
    }
    let mut known_keys: HashSet<String> = HashSet::new();
    let mut calls_by_tool: BTreeMap<String, u64> = BTreeMap::new();
    let mut without_approval = Vec::new();
    let mut other_args = Vec::new();
    let mut claimed_not_performed = Vec::new();
    let mut recorded_failed = Vec::new();
    let mut unanswered = Vec::new();
    let mut timeouts_seen = 0u64;
    let mut seen_calls: HashSet<(String, String)> = HashSet::new();
    let (mut replays, mut replay_runs) = (0u64, HashSet::new());
    // Messages per thread, in order.
    let mut by_thread: HashMap<&str, Vec<&Msg>> = HashMap::new();
    for m in &snap.messages {
        by_thread.entry(m.thread.as_str()).or_default().push(m);
    }
    for msgs in by_thread.values() {
        for (i, m) in msgs.iter().enumerate() {
            let Some(Value::Array(calls)) = &m.tool_calls else { continue };
            let run = m.run_id.clone().unwrap_or_default();
            for c in calls {
                let id = c["id"].as_str().unwrap_or_default();
                let name = c["function"]["name"].as_str().unwrap_or_default();
                *calls_by_tool.entry(name.to_owned()).or_default() += 1;
                if name != EFFECT_TOOL && name != ASK_TOOL {
                    continue;
                }
                let args: Value = c["function"]["arguments"].as_str().and_then(|a| serde_json::from_str(a).ok()).unwrap_or(Value::Null);
                let call_token = args["token"].as_str().unwrap_or_default().to_owned();
                let key = format!("run:{run}:call:{id}");
                known_keys.insert(key.clone());
                // The same call again (same id, same arguments): a model replaying an exchange
                // it cannot see. Checked once.
                if !seen_calls.insert((key.clone(), c["function"]["arguments"].to_string())) {
                    replays += 1;
                    replay_runs.insert(run.clone());
                    continue;
                }
                let result = msgs[i + 1..]
                    .iter()
                    .take_while(|x| x.role != "assistant")
                    .find(|x| x.role == "tool" && x.tool_call_id.as_deref() == Some(id))
                    .map(|x| x.text.as_str());
                let outcome = outcome_of(result);
                let arrivals = by_key.get(key.as_str()).cloned().unwrap_or_default();
                let what = format!("run {run} call {id} {name}({call_token}) at #{}", m.sequence);
                let mut expected_token = call_token.clone();
                if name == ASK_TOOL {
                    let approval = snap.approvals.iter().find(|a| a.run == run && a.tool_call_id == id && a.arguments == args);
                    let ran = matches!(outcome, Outcome::Done(_)) || !arrivals.is_empty();
                    match approval {
                        Some(a) if a.status == "approved" => {
                            let approved = a.approved_arguments.clone().unwrap_or_else(|| a.arguments.clone());
                            expected_token = approved["token"].as_str().unwrap_or_default().to_owned();
                            for e in &arrivals {
                                if e.arguments != approved {
                                    other_args.push((run.clone(), format!("{what}: approved {approved} (edited: {}) but the receiver got {}", a.edited, e.arguments)));
                                }
                            }
                        }
                        Some(a) if ran => without_approval.push((run.clone(), format!(
                            "{what}: ran (result {outcome:?}, {} arrivals) although its approval is '{}'",
                            arrivals.len(),
                            a.status
                        ))),
                        None if ran => without_approval.push((run.clone(), format!(
                            "{what}: ran (result {outcome:?}, {} arrivals) without an approval of these arguments",
                            arrivals.len()
                        ))),
                        _ => {}
                    }
                }
                let performed = by_token.get(expected_token.as_str()).map_or(0, |v| v.len());
                match &outcome {
                    Outcome::Done(t) if *t != expected_token => {
                        other_args.push((run.clone(), format!("{what}: expected an effect for '{expected_token}' but the result says done {t}")));
                    }
                    Outcome::Done(_) if performed == 0 => {
                        claimed_not_performed.push((run.clone(), format!("{what}: the result says done but the receiver never saw '{expected_token}'")));
                    }
                    Outcome::Failed(text) => {
                        if text.contains("request failed") {
                            timeouts_seen += 1;
                        }
                        if !arrivals.is_empty() {
                            let op = snap.operations.get(&key).map(|o| o.status.as_str()).unwrap_or("none");
                            recorded_failed.push((run.clone(), format!(
                                "{what}: the effect happened ({} arrival(s), answered after {} ms) but the call was recorded failed (operation '{op}'): {text}",
                                arrivals.len(),
                                arrivals[0].delay_ms
                            )));
                        }
                    }
                    Outcome::Missing
                        if snap.runs.get(&run).is_some_and(|r| r.status == "completed") => {
                            unanswered.push(format!("{what}: no result although the run completed"));
                        }
                    _ => {}
                }
            }
        }
    }
    let mut repeated = Vec::new();
    let mut repeated_keys = 0u64;
    for (token, list) in &by_token {
        if list.len() > 1 {
            let keys: HashSet<&str> = list.iter().filter_map(|e| e.key.as_deref()).collect();
            if keys.len() > 1 {
                repeated_keys += 1;
            }
            let timeline = list
                .iter()
                .map(|e| format!("{:.1}s key {} (delay {} ms)", e.at.as_secs_f64(), e.key.as_deref().unwrap_or("-"), e.delay_ms))
                .collect::<Vec<_>>()
                .join("; ");
            repeated.push(format!("token {token}: performed {} times under {} key(s): {timeline}", list.len(), keys.len()));
        }
    }
    repeated.sort();
    let mut without_call: Vec<String> = effects
        .iter()
        .filter(|e| !e.key.as_deref().is_some_and(|k| known_keys.contains(k)))
        .map(|e| format!("{} {} key {:?} at {:.1}s", e.tool, e.token, e.key, e.at.as_secs_f64()))
        .collect();
    without_call.sort();
    // Edited approvals: the product must have stored exactly what was sent.
    let decisions = w.decisions.lock().expect("decisions").clone();
    for d in decisions.iter().filter(|d| d.action == "edit" && d.status == 200) {
        let row = snap.approvals.iter().find(|a| a.run == d.run && a.tool_call_id == d.tool_call_id && a.arguments == d.proposed);
        if let (Some(row), Some(sent)) = (row, &d.sent)
            && row.approved_arguments.as_ref() != Some(sent) {
                other_args.push((d.run.clone(), format!("approval {} of run {}: edited to {sent} but stored {:?}", d.approval, d.run, row.approved_arguments)));
            }
    }
    let mut approvals: BTreeMap<String, u64> = BTreeMap::new();
    for a in &snap.approvals {
        let label = if a.status == "approved" && a.edited { "approved (edited)".to_owned() } else { a.status.clone() };
        *approvals.entry(label).or_default() += 1;
    }
    let resolves = w.resolves.lock().expect("resolves").clone();
    let ok_resolves: Vec<_> = resolves.iter().filter(|r| r.status == 200).collect();
    let resolved_runs: HashSet<&str> = ok_resolves.iter().map(|r| r.run.as_str()).collect();
    let completed = ok_resolves.iter().filter(|r| r.outcome == "completed").count();
    let uncertain_left = snap.operations.values().filter(|o| o.status == "uncertain").count();
    let human_resolved = snap.operations.values().filter(|o| o.resolution.is_some()).count();
    let fmt = |m: &BTreeMap<String, u64>| m.iter().map(|(k, v)| format!("{k}: {v}")).collect::<Vec<_>>().join(", ");

    let s = report.section("tools, approvals, effects");
    s.push(info("tool calls", calls_by_tool.values().sum(), fmt(&calls_by_tool)));
    s.push(info(
        "identical calls repeated by the model",
        replays,
        format!("{} runs (same call id and arguments again: the model did not see its earlier exchange)", replay_runs.len()),
    ));
    s.push(info("approvals", snap.approvals.len() as u64, fmt(&approvals)));
    s.push(info("effects at the receiver", effects.len() as u64, format!("{} distinct tokens", by_token.len())));
    s.push(info("calls answered 'request failed'", timeouts_seen, "the tool timed out (or its request failed)"));
    s.push(info(
        "blocked runs resolved by the client",
        resolved_runs.len() as u64,
        format!("{} resolves: {completed} completed, {} retry; {human_resolved} operations carry a resolution", ok_resolves.len(), ok_resolves.len() - completed),
    ));
    s.push(info("operations still uncertain", uncertain_left as u64, ""));
    let repeated_count = repeated.len();
    s.push(inv("effects repeated at the receiver", repeated, format!("{repeated_count} tokens, {repeated_keys} of them under several keys")));
    s.push(inv_grouped("effects performed but recorded failed", recorded_failed, "the call's result says it failed"));
    s.push(inv_grouped("effects reported done but never performed", claimed_not_performed, ""));
    s.push(inv("effects without a recorded call", without_call, "idempotency key matches no tool call in history"));
    s.push(inv_grouped("calls run without their approval", without_approval, ""));
    s.push(inv_grouped("calls run with another call's arguments", other_args, "receiver/result vs approved arguments"));
    s.push(inv("tool calls without a result in completed runs", unanswered, ""));
}

fn sse_check(report: &mut Report, snap: &Snapshot, logs: &[SseLog]) {
    let (mut connections, mut events, mut errors) = (0u64, 0u64, 0u64);
    let mut gaps = Vec::new();
    let mut dups = Vec::new();
    let mut mismatch = Vec::new();
    let mut resets = Vec::new();
    let mut stalled = Vec::new();
    let mut late = Vec::new();
    let mut max_latency = 0f64;
    for log in logs {
        errors += log.connect_errors;
        let empty = BTreeMap::new();
        let journal = snap.journal.get(&log.thread).unwrap_or(&empty);
        let mut last = 0i64;
        for (ci, conn) in log.connections.iter().enumerate() {
            connections += 1;
            let mut expected = conn.after + 1;
            for r in &conn.resets {
                resets.push(format!("thread {}: connection {ci} (after {}) got reset to {r}", log.thread, conn.after));
            }
            for (seq, kind, payload, received) in &conn.events {
                events += 1;
                if let Some((_, _, created)) = journal.get(seq) {
                    let latency = received - created.max(conn.opened_at);
                    max_latency = max_latency.max(latency);
                    if latency > LATE_SECS {
                        late.push((
                            log.thread.clone(),
                            format!("thread {}: #{seq} ({kind}) delivered {latency:.1}s after it was committed (connection {ci} open since before)", log.thread),
                        ));
                    }
                }
                if *seq > expected {
                    gaps.push(format!(
                        "thread {}: connection {ci} (Last-Event-ID {}) skipped {}..={} ({} events)",
                        log.thread,
                        conn.after,
                        expected,
                        seq - 1,
                        seq - expected
                    ));
                } else if *seq < expected {
                    dups.push(format!("thread {}: connection {ci} (after {}) got #{seq} after #{}", log.thread, conn.after, expected - 1));
                }
                match journal.get(seq) {
                    Some((k, p, _)) if k == kind && p == payload => {}
                    Some((k, _, _)) => mismatch.push(format!("thread {}: #{seq} received as {kind}, journal has {k} (or another payload)", log.thread)),
                    None => mismatch.push(format!("thread {}: #{seq} ({kind}) is not in the journal", log.thread)),
                }
                expected = expected.max(seq + 1);
                last = last.max(*seq);
            }
            if let Some(r) = conn.resets.last() {
                last = last.max(*r);
            }
        }
        let end = snap.journal_end.get(&log.thread).copied().unwrap_or(0);
        if last < end {
            stalled.push(format!(
                "thread {}: the follower ended at #{last}, the journal at #{end} ({} events never delivered; last connection ended: {})",
                log.thread,
                end - last,
                log.connections.last().map(|c| c.end.as_str()).unwrap_or("never connected")
            ));
        }
    }
    let s = report.section("SSE followers");
    s.push(info("followers", logs.len() as u64, format!("{connections} connections, {errors} failed connects, {events} journal events received")));
    s.push(inv("SSE events skipped (gap)", gaps, "within one connection"));
    s.push(inv("SSE events duplicated or out of order", dups, ""));
    s.push(inv("SSE events differing from the journal", mismatch, ""));
    s.push(inv("SSE resets (journal retention is unlimited)", resets, ""));
    s.push(inv("SSE followers left behind the journal", stalled, "not caught up within the final wait"));
    s.push(inv_grouped(
        "SSE events delivered late",
        late,
        format!("> {LATE_SECS:.0} s after commit on an open connection (the api heartbeat is 15 s); max {max_latency:.1} s"),
    ));
}

/// Lines of the audit section.
pub fn audit_lines(f: &super::audit::AuditFindings) -> Vec<Line> {
    vec![
        info("worker writes audited", f.worker_writes.max(0) as u64, "message inserts, operation inserts/updates"),
        info("  by the owner after lease expiry", f.owner_writes_after_expiry.max(0) as u64, "allowed: nobody had claimed the run yet"),
        info("claims of running runs (recoveries)", f.recovery_claims.max(0) as u64, ""),
        inv("writes after lease loss", f.lease_violations.clone(), "worker wrote a row of a run it did not hold"),
        inv("run rows changed by a non-owner worker", f.run_violations.clone(), ""),
        inv("claims of a live lease", f.live_claims.clone(), ""),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(token: &str, run: &str, cancel_requested: bool) -> Turn {
        Turn {
            n: 0,
            thread: "t".into(),
            token: token.into(),
            key: "k".into(),
            kind: "plain",
            policy: "reject",
            outcome: PostOutcome::Accepted(run.into()),
            cancel_requested,
            effects: Vec::new(),
            reused_ids: false,
            last_status: None,
        }
    }

    fn request(token: &str, assistants: usize) -> Value {
        let mut messages = vec![json!({"role": "user", "content": format!("turn {token} please. MOCK: {{}}")})];
        for _ in 0..assistants {
            messages.push(json!({"role": "assistant", "content": "x"}));
        }
        json!({"messages": messages})
    }

    #[test]
    fn a_step_requested_twice_in_a_clean_completed_run_is_a_thrown_away_answer() {
        let mut snap = snapshot("t", 0);
        for (run, status, recoveries) in [("r1", "completed", 0), ("r2", "completed", 1), ("r3", "completed", 0), ("r4", "failed", 0)] {
            snap.runs.insert(run.into(), RunRow { status: status.into(), error_code: None, error_message: None, recoveries, lease_owner: None });
        }
        let turns = [turn("a", "r1", false), turn("b", "r2", false), turn("c", "r3", true), turn("d", "r4", false)];
        let title = json!({"messages": [{"role": "system", "content": "You write conversation titles. ..."}, {"role": "user", "content": "turn a please"}]});
        let requests: Vec<Value> = vec![
            request("a", 0), request("a", 1), request("a", 1), // r1: step 1 paid twice
            request("b", 0), request("b", 0), // recovered: allowed
            request("c", 0), request("c", 0), // stopped by the client: allowed
            request("d", 0), request("d", 0), // not completed: not judged
            title.clone(), title, // the worker's own requests are not steps
        ];
        let (repeated, thrown) = paid_again(&turns, &snap, &requests);
        assert_eq!(repeated, 4);
        assert_eq!(thrown.len(), 1, "{thrown:?}");
        assert!(thrown[0].contains("turn a") && thrown[0].contains("step 1 sent to the model 2 times"), "{thrown:?}");
    }
    use crate::chaos::workload::SseConn;
    use serde_json::json;

    fn snapshot(thread: &str, events: i64) -> Snapshot {
        let journal: BTreeMap<i64, (String, Value, f64)> = (1..=events).map(|s| (s, ("message".to_owned(), json!({"n": s}), 100.0))).collect();
        Snapshot {
            runs: HashMap::new(),
            messages: Vec::new(),
            approvals: Vec::new(),
            operations: HashMap::new(),
            receipts: HashMap::new(),
            journal: HashMap::from([(thread.to_owned(), journal)]),
            journal_end: HashMap::from([(thread.to_owned(), events)]),
            log_reasons: HashMap::new(),
        }
    }

    fn conn(after: i64, seqs: &[i64]) -> SseConn {
        SseConn {
            after,
            opened_at: 100.0,
            events: seqs.iter().map(|s| (*s, "message".to_owned(), json!({"n": s}), 101.0)).collect(),
            resets: Vec::new(),
            end: "eof".into(),
        }
    }

    fn counts(report: &Report) -> HashMap<String, u64> {
        report.sections.iter().flat_map(|(_, l)| l).map(|l| (l.name.clone(), l.count)).collect()
    }

    #[test]
    fn sse_check_sees_gaps_duplicates_and_stalls() {
        let snap = snapshot("t", 10);
        let good = SseLog { thread: "t".into(), connections: vec![conn(0, &[1, 2, 3]), conn(3, &[4, 5, 6, 7, 8, 9, 10])], connect_errors: 0 };
        let mut r = Report::default();
        sse_check(&mut r, &snap, &[good]);
        assert!(r.violated().is_empty(), "{}", r.table(5));
        let bad = SseLog { thread: "t".into(), connections: vec![conn(0, &[1, 3, 3]), conn(3, &[4, 5])], connect_errors: 0 };
        let mut r = Report::default();
        sse_check(&mut r, &snap, &[bad]);
        let c = counts(&r);
        assert_eq!(c["SSE events skipped (gap)"], 1);
        assert_eq!(c["SSE events duplicated or out of order"], 1);
        assert_eq!(c["SSE followers left behind the journal"], 1);
    }

    #[test]
    fn tool_results_are_classified() {
        assert_eq!(outcome_of(Some("done ax-1 via ask_effect")), Outcome::Done("ax-1".into()));
        assert_eq!(outcome_of(Some("[The user edited the arguments before approving; the tool ran with {}]\ndone ax-1-edited via ask_effect")), Outcome::Done("ax-1-edited".into()));
        assert_eq!(outcome_of(Some("Tool call declined by the user. Reason: no")), Outcome::Declined);
        assert!(matches!(outcome_of(Some("effect: request failed: timeout")), Outcome::Failed(_)));
        assert_eq!(outcome_of(None), Outcome::Missing);
    }
}
