//! Conversation model (issue 4): checkpoints by identity, branches, provider repairs in the
//! loop, aborted streams, context accounting, automatic and manual compaction.

use std::time::Duration;

use agentloop_shared::messages::{self, NewMessage, role};
use agentloop_tests::{Stack, StackOptions, TestDb, script};
use diesel_async::{AsyncConnection, AsyncPgConnection};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

async fn window(stack: &Stack, thread: &str) -> Value {
    stack.client().get(&format!("/api/threads/{thread}")).await.unwrap().body
}

fn seqs(window: &Value) -> Vec<i64> {
    window["messages"].as_array().unwrap().iter().map(|m| m["sequence"].as_i64().unwrap()).collect()
}

#[tokio::test]
async fn double_delivery_of_a_checkpoint_adds_nothing() {
    use agentloop_shared::store::{PoolSettings, Replay, Store, Timing};
    let db = TestDb::create().await.unwrap();
    let mut conn = AsyncPgConnection::establish(&db.url).await.unwrap();
    let owner = agentloop_shared::auth::ensure_principal(&mut conn, "p").await.unwrap();
    let client = db.client().await.unwrap();
    let store = Store::new(
        &PoolSettings { database_url: db.url.clone(), application_name: "test".into(), statement_timeout: Duration::from_secs(10), max_size: 2, wait_timeout: Duration::from_secs(5) },
        Timing { call_timeout: Duration::from_secs(10), retry_for: Duration::from_secs(5) },
    )
    .unwrap();
    let created = agentloop_shared::commands::create_thread(&store, owner.id, String::new(), None, json!({})).await.unwrap();
    let thread = agentloop_shared::threads::get(&mut conn, created["id"].as_str().unwrap().parse().unwrap()).await.unwrap();
    let run: uuid::Uuid = client
        .query_one(
            "INSERT INTO runs (id, thread_id, principal_id, status, model, lease_owner, lease_epoch, lease_expires_at)
             VALUES (gen_random_uuid(), $1, $2, 'running', 'mock', 'w', 3, now() + interval '1 minute') RETURNING id",
            &[&thread.id, &owner.id],
        )
        .await
        .unwrap()
        .get(0);
    let batch = vec![NewMessage::text(role::USER, "hi"), NewMessage::text(role::ASSISTANT, "hello")];
    let commit = |id: &str, epoch: i64, messages: &[NewMessage]| {
        json!({"commitId": id, "runId": run, "threadId": thread.id, "owner": "w", "epoch": epoch, "leaseMs": 60000, "messages": messages})
    };
    let first = store.call("agentloop_commit", &commit("c1", 3, &batch), Replay::Safe, None).await.unwrap();
    assert_eq!(first["messages"].as_array().unwrap().len(), 2);
    // Re-delivering the same commit (its answer was lost) appends nothing and returns the first
    // result.
    let again = store.call("agentloop_commit", &commit("c1", 3, &batch), Replay::Safe, None).await.unwrap();
    assert_eq!(again["replayed"], true);
    assert_eq!(again["messages"], first["messages"]);
    // Another commit appends; a commit under a stale fencing token writes nothing.
    let third = store.call("agentloop_commit", &commit("c2", 3, &[NewMessage::text(role::USER, "more")]), Replay::Safe, None).await.unwrap();
    assert_eq!(third["messages"][0]["sequence"], 3);
    let stale = store.call("agentloop_commit", &commit("c3", 2, &[NewMessage::text(role::USER, "stale")]), Replay::Safe, None).await.unwrap();
    assert_eq!(stale["lost"], true);
    let rows = messages::active_after(&mut conn, thread.id, 0).await.unwrap();
    assert_eq!(rows.iter().map(|m| m.sequence).collect::<Vec<_>>(), [1, 2, 3]);
    assert!(rows.windows(2).all(|w| w[1].timestamp_ms > w[0].timestamp_ms), "monotonic identities");
    let t = agentloop_shared::threads::get(&mut conn, thread.id).await.unwrap();
    assert_eq!((t.message_count, t.last_sequence), (3, 3));
}

#[tokio::test]
async fn edit_regenerate_and_delete_produce_the_right_branch_and_context() {
    let stack = Stack::start("branches", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let first = c.chat(&thread, &script(json!([{"text": "answer A"}]))).await.unwrap();
    c.wait_terminal(first["run"]["id"].as_str().unwrap(), T).await.unwrap();
    let second = c.chat(&thread, &script(json!([{"toolCalls": [{"name": "calculator", "arguments": {"expression": "1+1"}}]}, {"text": "answer B"}]))).await.unwrap();
    c.wait_terminal(second["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(seqs(&window(&stack, &thread).await), [1, 2, 3, 4, 5, 6]);

    // Delete the tool result: its whole group (call + result) goes.
    let r = c.send(reqwest::Method::DELETE, &format!("/api/threads/{thread}/messages/5"), None, &[]).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body["deactivated"], json!([4, 5]));
    assert_eq!(seqs(&window(&stack, &thread).await), [1, 2, 3, 6]);

    // Edit the first user message: everything from it is replaced by a new branch.
    let r = c.post(&format!("/api/threads/{thread}/messages/1/edit"), json!({"content": script(json!([{"text": "answer C"}]))})).await.unwrap();
    assert_eq!(r.status, 202, "{r:?}");
    assert_eq!(r.body["deactivated"], json!([1, 2, 3, 6]));
    assert_eq!(r.body["message"]["sequence"], 7);
    c.wait_terminal(r.body["run"]["id"].as_str().unwrap(), T).await.unwrap();
    let w = window(&stack, &thread).await;
    assert_eq!(seqs(&w), [7, 8]);
    assert_eq!(w["messageCount"], 2);
    assert_eq!(w["messages"][1]["content"], "answer C");
    let sent = stack.mock.requests().await.unwrap();
    let last = sent.last().unwrap()["messages"].as_array().unwrap();
    assert_eq!(last.iter().filter(|m| m["role"] == "user").count(), 1, "the old branch is not in the model context");

    // Regenerate the answer: a new active answer, no new user message.
    let r = c.post(&format!("/api/threads/{thread}/messages/8/regenerate"), json!({})).await.unwrap();
    assert_eq!(r.status, 202, "{r:?}");
    assert_eq!(r.body["deactivated"], json!([8]));
    c.wait_terminal(r.body["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(seqs(&window(&stack, &thread).await), [7, 9]);

    // Rows are never deleted; bad targets are refused.
    let db = stack.db.client().await.unwrap();
    let total: i64 = db.query_one("SELECT count(*) FROM messages", &[]).await.unwrap().get(0);
    assert_eq!(total, 9);
    let r = c.post(&format!("/api/threads/{thread}/messages/9/edit"), json!({"content": "x"})).await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (400, Some("not_a_user_message")));
    let r = c.post(&format!("/api/threads/{thread}/messages/1/edit"), json!({"content": "x"})).await.unwrap();
    assert_eq!(r.status, 404, "inactive rows cannot be edited");
}

#[tokio::test]
async fn an_aborted_stream_leaves_history_untouched() {
    // The run fails at the first cut (no slice-level retry; see scheduler.rs for those).
    let options = StackOptions { worker_env: vec![("MODEL_RETRY_MS".into(), "0".into())], ..Default::default() };
    let stack = Stack::start("aborted_stream", options).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let text = "one two three four five six seven eight nine ten eleven twelve";
    let posted = c.chat(&thread, &script(json!([{"text": text, "malformed": "truncate", "chunkDelayMs": 50}]))).await.unwrap();
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(run["status"], "failed");
    // The mock drops the connection mid-body: a truncated stream or a transport error.
    let code = run["error"]["code"].as_str().unwrap();
    assert!(["model_stream_truncated", "model_transport_error"].contains(&code), "{run}");
    let w = window(&stack, &thread).await;
    assert_eq!(seqs(&w), [1]);
    assert_eq!(w["streamingMessage"], Value::Null);
}

#[tokio::test]
async fn automatic_compaction_keeps_one_summary_and_the_run_completes() {
    let stack = Stack::start("auto_compaction", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let r = c
        .post("/api/threads", json!({"title": "long", "metadata": {"compactThreshold": 4000, "compactRecentMessages": 4}}))
        .await
        .unwrap();
    let thread = r.body["id"].as_str().unwrap().to_owned();
    let big = "lorem ipsum dolor sit amet ".repeat(150); // ~750 tokens per assistant message
    let body = json!({"content": format!("count to 60. MOCK: {}", json!({"loop": {"until": 60, "text": big}}))});
    let r = c.post(&format!("/api/threads/{thread}/chat"), body).await.unwrap();
    assert_eq!(r.status, 202, "{r:?}");
    let run = c.wait_terminal(r.body["run"]["id"].as_str().unwrap(), Duration::from_secs(180)).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let w = window(&stack, &thread).await;
    assert_eq!(w["messages"].as_array().unwrap().last().unwrap()["content"], "finished at 60");
    let db = stack.db.client().await.unwrap();
    let snapshots: i64 = db.query_one("SELECT count(*) FROM context_snapshots", &[]).await.unwrap().get(0);
    assert!(snapshots >= 20, "{snapshots} compactions");
    println!("AUTO-COMPACTION snapshots={snapshots} run={}", run["id"]);
    // The context stayed under the threshold (+ one message of slack) at every model call, and
    // every request carried at most one summary.
    for req in stack.mock.requests().await.unwrap() {
        let msgs = req["messages"].as_array().unwrap();
        if msgs.first().is_some_and(|m| m["content"].as_str().is_some_and(|t| t.starts_with("You compress"))) {
            continue;
        }
        let summaries = msgs.iter().filter(|m| m["content"].as_str().is_some_and(|t| t.contains("Summary of the earlier conversation"))).count();
        assert!(summaries <= 1, "{summaries} summaries in one request");
        assert!(!req.to_string().contains("agentloop:summary"), "the internal marker reached the provider");
    }
    let steps = db.query("SELECT context_tokens FROM run_steps", &[]).await.unwrap();
    assert!(steps.iter().all(|r| r.get::<_, Option<i32>>(0).unwrap_or(0) < 4000 + 1500), "context over the threshold");
    let ctx = c.get(&format!("/api/threads/{thread}/context")).await.unwrap().body;
    assert_eq!(ctx["threshold"], 4000);
    assert!(ctx["snapshot"]["version"].as_i64().unwrap() >= 20, "{ctx}");
    assert!(ctx["total"].as_i64().unwrap() < 4000 + 1500, "{ctx}");
    // History is intact: every message is still there and active.
    let active: i64 = db.query_one("SELECT count(*) FROM messages WHERE active", &[]).await.unwrap().get(0);
    assert_eq!(active, 1 + 60 * 2 + 1);
}

#[tokio::test]
async fn manual_compaction_creates_a_child_thread_and_leaves_the_original_intact() {
    let stack = Stack::start("manual_compaction", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    for i in 0..5 {
        let steps = json!([{"toolCalls": [{"name": "calculator", "arguments": {"expression": format!("{i}+1")}}]}, {"text": format!("turn {i} {}", "filler ".repeat(100))}]);
        let posted = c.chat(&thread, &script(steps)).await.unwrap();
        c.wait_terminal(posted["run"]["id"].as_str().unwrap(), T).await.unwrap();
    }
    let before = window(&stack, &thread).await;
    let r = c.post(&format!("/api/threads/{thread}/compact"), json!({})).await.unwrap();
    assert_eq!(r.status, 201, "{r:?}");
    let child = r.body["thread"]["id"].as_str().unwrap().to_owned();
    assert_eq!(r.body["thread"]["parentThreadId"], thread.as_str());
    let run = c.wait_terminal(r.body["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let after = window(&stack, &thread).await;
    assert_eq!(before["messages"], after["messages"], "the original is untouched");
    let cw = window(&stack, &child).await;
    let msgs = cw["messages"].as_array().unwrap();
    assert_eq!(msgs[0]["role"], "system");
    assert!(msgs[0]["content"].as_str().unwrap().starts_with("Summary of the earlier conversation"));
    assert!(!cw.to_string().contains("agentloop:summary"), "no internal marker in a child thread");
    // The verbatim tail: the last 12 messages of the original (a tool group is never split).
    let tail: Vec<&Value> = before["messages"].as_array().unwrap().iter().rev().take(msgs.len() - 1).collect();
    assert_eq!(msgs.len() - 1, 12);
    assert_eq!(msgs.last().unwrap()["content"], tail[0]["content"]);
    assert_ne!(msgs[1]["role"], "tool");
}

/// Issue 4's figure: a 2,000-message synthetic conversation before and after automatic
/// compaction (default settings: no model limit, so the 80,000-token fallback threshold).
#[tokio::test]
async fn a_two_thousand_message_conversation_is_compacted_below_the_threshold() {
    let stack = Stack::start("compaction_2000", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let db = stack.db.client().await.unwrap();
    let id = uuid::Uuid::parse_str(&thread).unwrap();
    // 2,000 alternating user/assistant messages of ~100 words (~130 tokens) each.
    db.execute(
        "INSERT INTO messages (thread_id, sequence, timestamp_ms, role, content, token_estimate, byte_size)
         SELECT $1, g, 1000 + g, CASE WHEN g % 2 = 1 THEN 'user' ELSE 'assistant' END,
                to_jsonb('message ' || g || ': ' || repeat('several words of synthetic history ', 20)), 130, 700
         FROM generate_series(1, 2000) g",
        &[&id],
    )
    .await
    .unwrap();
    db.execute("UPDATE threads SET message_count = 2000, last_sequence = 2000, last_timestamp_ms = 3000 WHERE id = $1", &[&id])
        .await
        .unwrap();
    let posted = c.chat(&thread, &script(json!([{"text": "caught up"}]))).await.unwrap();
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), Duration::from_secs(120)).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let events = db
        .query("SELECT payload FROM thread_events WHERE kind = 'compaction' AND payload ? 'done'", &[])
        .await
        .unwrap();
    assert_eq!(events.len(), 1);
    let done: Value = events[0].get(0);
    let after = run["contextTokens"].as_i64().unwrap();
    println!(
        "COMPACTION-2000 before={} (messages) summary={} after={} calls={} passes={}",
        done["inputTokens"], done["summaryTokens"], after, done["calls"], done["passes"]
    );
    assert!(after < 80_000, "{after}");
    assert!(done["calls"].as_i64().unwrap() >= 4, "batches of at most 60,000 tokens");
}

#[tokio::test]
async fn a_provider_projection_that_merges_messages_does_not_break_checkpointing() {
    // A GLM-family model: adjacent user turns are merged in the payload (SPEC §9).
    let glm = vec![("MODEL_NAME".to_owned(), "glm-4-mock".to_owned())];
    let stack = Stack::start("glm_merge", StackOptions { worker_env: glm.clone(), api_env: glm, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let db = stack.db.client().await.unwrap();
    let id = uuid::Uuid::parse_str(&thread).unwrap();
    db.execute(
        "INSERT INTO messages (thread_id, sequence, timestamp_ms, role, content, token_estimate, byte_size)
         VALUES ($1, 1, 1001, 'user', '\"first\"', 5, 7), ($1, 2, 1002, 'user', '\"second\"', 5, 8)",
        &[&id],
    )
    .await
    .unwrap();
    db.execute("UPDATE threads SET message_count = 2, last_sequence = 2, last_timestamp_ms = 1002 WHERE id = $1", &[&id])
        .await
        .unwrap();
    let steps = json!([{"toolCalls": [{"name": "calculator", "arguments": {"expression": "3*3"}}]}, {"text": "nine"}]);
    let posted = c.chat(&thread, &script(steps)).await.unwrap();
    let run = c.wait_terminal(posted["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let sent = stack.mock.requests().await.unwrap();
    let first_payload = sent[0]["messages"].as_array().unwrap();
    assert_eq!(first_payload.iter().filter(|m| m["role"] == "user").count(), 1, "GLM merged the three user turns: {first_payload:?}");
    // Canonical history is untouched by the merge and the checkpoints added each message once.
    let w = window(&stack, &thread).await;
    let roles: Vec<&str> = w["messages"].as_array().unwrap().iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "user", "user", "assistant", "tool", "assistant"]);
    assert_eq!(seqs(&w), [1, 2, 3, 4, 5, 6]);
    assert_eq!(w["messages"][0]["content"], "first");
}

/// An answer the provider cut (`finish_reason: length`) says so everywhere: `finishReason` on
/// the message (window and export), the next model call reads it with a note that it was cut,
/// and `/v1/chat/completions` answers `length` instead of `stop` (streamed and not). A normal
/// answer carries none. Before, a cut answer looked finished to everyone.
#[tokio::test]
async fn an_answer_cut_by_the_provider_is_marked_cut() {
    let stack = Stack::start("cut_answer", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let first = c.chat(&thread, &script(json!([{"text": "The list: one, two, thr", "finishReason": "length"}]))).await.unwrap();
    c.wait_terminal(first["run"]["id"].as_str().unwrap(), T).await.unwrap();
    let second = c.chat(&thread, &script(json!([{"text": "all good"}]))).await.unwrap();
    c.wait_terminal(second["run"]["id"].as_str().unwrap(), T).await.unwrap();
    let w = window(&stack, &thread).await;
    let answers: Vec<_> = w["messages"].as_array().unwrap().iter().filter(|m| m["role"] == "assistant").collect();
    assert_eq!(answers.len(), 2, "{w}");
    assert_eq!((answers[0]["finishReason"].as_str(), answers[0]["content"].as_str()), (Some("length"), Some("The list: one, two, thr")));
    assert!(answers[1].get("finishReason").is_none(), "a finished answer carries no reason: {}", answers[1]);
    let sent = stack.mock.requests().await.unwrap();
    let last = sent.last().unwrap()["messages"].as_array().unwrap();
    let cut = last.iter().find(|m| m["role"] == "assistant").unwrap()["content"].as_str().unwrap();
    assert!(cut.starts_with("The list: one, two, thr") && cut.contains("[cut off:") && cut.contains("length"), "{cut}");
    let export = c.get(&format!("/api/threads/{thread}/export?format=json")).await.unwrap();
    assert_eq!(export.status, 200, "{export:?}");
    let exported = export.body["messages"].as_array().unwrap();
    assert_eq!(exported.iter().filter(|m| m["finishReason"] == "length").count(), 1, "{}", export.body);
    // The export imports with the mark kept.
    let imported = c.post("/api/threads/import", export.body.clone()).await.unwrap();
    assert_eq!(imported.status, 201, "{imported:?}");
    let copy = window(&stack, imported.body["thread"]["id"].as_str().unwrap()).await;
    let marks: Vec<_> = copy["messages"].as_array().unwrap().iter().filter_map(|m| m["finishReason"].as_str()).collect();
    assert_eq!(marks, ["length"], "{copy}");

    let http = reqwest::Client::new();
    for stream in [false, true] {
        let body = json!({"model": "mock", "stream": stream,
                          "messages": [{"role": "user", "content": script(json!([{"text": "cut short", "finishReason": "length"}]))}]});
        let resp = http.post(format!("{}/v1/chat/completions", stack.api_url)).bearer_auth(&stack.key).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        let text = resp.text().await.unwrap();
        let reasons: Vec<String> = if stream {
            text.lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter_map(|d| serde_json::from_str::<Value>(d).ok())
                .filter_map(|v| v["choices"][0]["finish_reason"].as_str().map(str::to_owned))
                .collect()
        } else {
            let v: Value = serde_json::from_str(&text).unwrap();
            vec![v["choices"][0]["finish_reason"].as_str().unwrap_or_default().to_owned()]
        };
        assert_eq!(reasons, ["length"], "stream {stream}: {text}");
    }
}

/// A model's own tool call larger than a turn of the model (a 200 KB file write on a model of
/// 8,000 tokens) is cut in the context it reads next, so the run goes on and later turns of the
/// thread work; the stored call keeps every byte. Before, the run and every later turn of the
/// thread failed `compaction_nothing_to_compact` before calling the model.
#[tokio::test]
async fn a_tool_call_larger_than_a_turn_does_not_break_the_thread() {
    let env = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
    let limit = env(&[("MODEL_CONTEXT_TOKENS", "8000")]);
    let options = StackOptions { worker_env: limit.clone(), api_env: limit, ..Default::default() };
    let stack = Stack::start("huge_tool_call", options).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "calculator", "arguments": {"expression": "1+1"}, "padBytes": 200000}]}, {"text": "after the big call"}]);
    let first = c.chat(&thread, &script(steps)).await.unwrap();
    let end = c.wait_terminal(first["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(end["status"], "completed", "{end}");
    let second = c.chat(&thread, &script(json!([{"text": "second answer"}]))).await.unwrap();
    let end = c.wait_terminal(second["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(end["status"], "completed", "{end}");
    let sent = stack.mock.requests().await.unwrap();
    let last = sent.last().unwrap();
    assert!(last.to_string().len() < 60_000, "the model read the call cut: {} bytes", last.to_string().len());
    let call = last["messages"].as_array().unwrap().iter().find(|m| m["tool_calls"].is_array()).expect("the call is in the context");
    assert!(call["tool_calls"][0]["function"]["arguments"].as_str().unwrap().contains("omitted_from_context"), "{call}");
    let db = stack.db.client().await.unwrap();
    let stored: i64 = db
        .query_one("SELECT max(octet_length(tool_calls::text))::int8 FROM messages WHERE tool_calls IS NOT NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert!(stored > 200_000, "the history keeps the call whole: {stored} bytes");
}
