//! The server side of the web UI as a product (issue 11): branches, automatic titles, delete
//! with undo, full-text search, export, model and input limits, generation settings, honest
//! liveness and the run inspector, a stopped answer as the model reads it. Real processes, real
//! PostgreSQL, the scripted mock model.

use std::time::{Duration, Instant};

use agentloop_tests::{Stack, StackOptions, script};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(30);

async fn untitled(c: &agentloop_tests::Client) -> String {
    let r = c.post("/api/threads", json!({})).await.unwrap();
    assert_eq!(r.status, 201, "{r:?}");
    r.body["id"].as_str().unwrap().to_owned()
}

async fn say(c: &agentloop_tests::Client, thread: &str, text: &str) -> Value {
    let r = c.chat(thread, text).await.unwrap();
    c.wait_terminal(r["run"]["id"].as_str().unwrap(), T).await.unwrap()
}

async fn window(c: &agentloop_tests::Client, thread: &str) -> Value {
    let r = c.get(&format!("/api/threads/{thread}")).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    r.body
}

fn texts(w: &Value) -> Vec<(i64, String)> {
    w["messages"].as_array().unwrap().iter().map(|m| (m["sequence"].as_i64().unwrap(), m["content"].as_str().unwrap_or("").to_owned())).collect()
}

async fn wait_for<F: std::future::Future<Output = Option<Value>>>(what: &str, mut f: impl FnMut() -> F) -> Value {
    let deadline = Instant::now() + T;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every message row of the thread: (sequence, content, timestamp identity, created_at).
async fn rows(db: &tokio_postgres::Client, thread: &str) -> Vec<(i64, String, i64, String)> {
    db.query("SELECT sequence, content::text, timestamp_ms, created_at::text FROM messages WHERE thread_id::text = $1 ORDER BY sequence", &[&thread])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect()
}

#[tokio::test]
async fn branches_are_listed_switched_and_never_rewrite_history() {
    let stack = Stack::start("ui_branches", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    say(&c, &thread, &script(json!([{"text": "answer one"}]))).await;
    let q2 = script(json!([{"text": "answer two"}]));
    say(&c, &thread, &q2).await;
    // Edit the second question: [1,2,3,4] -> [1,2,5,6]; the old [3,4] is a branch.
    let q2b = script(json!([{"text": "answer two, edited"}]));
    let r = c.post(&format!("/api/threads/{thread}/messages/3/edit"), json!({"content": q2b})).await.unwrap();
    assert_eq!(r.status, 202, "{r:?}");
    c.wait_terminal(r.body["run"]["id"].as_str().unwrap(), T).await.unwrap();
    // Regenerate the new answer: [1,2,5,7]; [6] is a branch of the fork after 5.
    let r = c.post(&format!("/api/threads/{thread}/messages/6/regenerate"), json!({})).await.unwrap();
    assert_eq!(r.status, 202, "{r:?}");
    c.wait_terminal(r.body["run"]["id"].as_str().unwrap(), T).await.unwrap();
    let w = window(&c, &thread).await;
    assert_eq!(texts(&w).iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2, 5, 7]);
    assert_eq!(w["messages"][2]["branch"], json!({"index": 2, "count": 2}), "the edited question shows 2/2");
    assert_eq!(w["messages"][3]["branch"], json!({"index": 2, "count": 2}), "the regenerated answer shows 2/2");
    assert!(w["messages"][0].get("branch").is_none() && w["messages"][1].get("branch").is_none());

    let list = c.get(&format!("/api/threads/{thread}/messages/5/branches")).await.unwrap();
    assert_eq!(list.status, 200, "{list:?}");
    assert_eq!(list.body["parentSequence"], 2);
    assert_eq!((list.body["index"].as_i64(), list.body["count"].as_i64()), (Some(2), Some(2)));
    assert_eq!(list.body["branches"][0]["firstSequence"], 3);
    assert_eq!(list.body["branches"][0]["messages"], 2);
    assert_eq!(list.body["branches"][1]["active"], true);
    assert_eq!(c.get(&format!("/api/threads/{thread}/messages/1/branches")).await.unwrap().status, 404, "no fork at message 1");

    // Rows before the switch, to prove nothing but `active` changes.
    let db = stack.db.client().await.unwrap();
    let before = rows(&db, &thread).await;

    // Show the original question again: [1,2,3,4]; then back to the edited one with its newest answer.
    let r = c.post(&format!("/api/threads/{thread}/messages/5/branches/activate"), json!({"firstSequence": 3})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body["activated"], json!([3, 4]));
    assert_eq!(r.body["deactivated"], json!([5, 7]));
    let w = window(&c, &thread).await;
    assert_eq!(texts(&w).iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert_eq!(w["messageCount"], 4);
    assert_eq!(w["messages"][2]["branch"], json!({"index": 1, "count": 2}));
    assert_eq!(texts(&w)[3].1, "answer two");
    // The model sees the shown branch only.
    say(&c, &thread, "what now?").await;
    let sent = stack.mock.requests().await.unwrap();
    let last: Vec<String> = sent.last().unwrap()["messages"].as_array().unwrap().iter().map(|m| m["content"].as_str().unwrap_or("").to_owned()).collect();
    assert!(last.contains(&"answer two".to_owned()) && !last.iter().any(|t| t.contains("edited")), "{last:?}");

    // A branch switch is refused while a run is active, and for a branch that does not exist.
    let r = c.post(&format!("/api/threads/{thread}/messages/3/branches/activate"), json!({"firstSequence": 99})).await.unwrap();
    assert_eq!(r.status, 404, "{r:?}");
    let slow = c.chat(&thread, &script(json!([{"text": "slow", "delayMs": 1500}]))).await.unwrap();
    let r = c.post(&format!("/api/threads/{thread}/messages/3/branches/activate"), json!({"firstSequence": 5})).await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (409, Some("run_active")), "{r:?}");
    c.wait_terminal(slow["run"]["id"].as_str().unwrap(), T).await.unwrap();

    let r = c.post(&format!("/api/threads/{thread}/messages/3/branches/activate"), json!({"firstSequence": 5})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    let w = window(&c, &thread).await;
    assert_eq!(texts(&w).iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2, 5, 7], "the edited branch comes back with its newest answer");
    assert_eq!(w["messages"][3]["branch"], json!({"index": 2, "count": 2}), "the nested fork is intact");
    let after = rows(&db, &thread).await;
    assert_eq!(&after[..before.len()], &before[..], "no history row was rewritten (content, identity, time)");
}

/// A regenerate, then an edit of the question before it: the edit's fork (at the start) offers
/// the original turn — question and current answer — and the regenerate's fork (after the
/// question) comes back with it. Before (migration 000027), the edited turn's list offered the
/// replaced answer instead: activating it showed a history starting with an assistant message,
/// and the original question could no longer be reached.
#[tokio::test]
async fn a_regenerate_then_an_edit_of_its_question_keeps_both_turns_as_branches() {
    let stack = Stack::start("ui_branches_nested", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    say(&c, &thread, "hello").await;
    let r = c.post(&format!("/api/threads/{thread}/messages/2/regenerate"), json!({})).await.unwrap();
    assert_eq!(r.status, 202, "{r:?}");
    c.wait_terminal(r.body["run"]["id"].as_str().unwrap(), T).await.unwrap();
    let r = c.post(&format!("/api/threads/{thread}/messages/1/edit"), json!({"content": "edited"})).await.unwrap();
    assert_eq!(r.status, 202, "{r:?}");
    c.wait_terminal(r.body["run"]["id"].as_str().unwrap(), T).await.unwrap();
    let w = window(&c, &thread).await;
    assert_eq!(texts(&w).iter().map(|t| t.0).collect::<Vec<_>>(), [4, 5]);
    assert_eq!(w["messages"][0]["branch"], json!({"index": 2, "count": 2}), "{w}");
    assert!(w["messages"][1].get("branch").is_none(), "one switcher per fork: {w}");

    let list = c.get(&format!("/api/threads/{thread}/messages/4/branches")).await.unwrap();
    assert_eq!(list.status, 200, "{list:?}");
    assert_eq!(list.body["parentSequence"], 0, "{list:?}");
    let firsts: Vec<i64> = list.body["branches"].as_array().unwrap().iter().map(|b| b["firstSequence"].as_i64().unwrap()).collect();
    assert_eq!(firsts, [1, 4], "the original turn, not the replaced answer: {list:?}");
    assert_eq!(list.body["branches"][0]["messages"], 2, "{list:?}");

    let r = c.post(&format!("/api/threads/{thread}/messages/4/branches/activate"), json!({"firstSequence": 1})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    let w = window(&c, &thread).await;
    assert_eq!(texts(&w).iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3], "the original question with its current answer");
    assert_eq!(texts(&w)[0].1, "hello");
    assert_eq!(w["messages"][0]["branch"], json!({"index": 1, "count": 2}), "{w}");
    assert_eq!(w["messages"][1]["branch"], json!({"index": 2, "count": 2}), "the regenerate's fork is back: {w}");
    let list = c.get(&format!("/api/threads/{thread}/messages/3/branches")).await.unwrap();
    assert_eq!(list.body["parentSequence"], 1, "{list:?}");
    let r = c.post(&format!("/api/threads/{thread}/messages/3/branches/activate"), json!({"firstSequence": 2})).await.unwrap();
    assert_eq!((r.status, r.body["activated"].clone()), (200, json!([2])), "{r:?}");
    let r = c.post(&format!("/api/threads/{thread}/messages/1/branches/activate"), json!({"firstSequence": 4})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(texts(&window(&c, &thread).await).iter().map(|t| t.0).collect::<Vec<_>>(), [4, 5]);
}

#[tokio::test]
async fn titles_rename_delete_undo_search_and_export() {
    let stack = Stack::start("ui_threads", StackOptions::default()).await.unwrap();
    let c = stack.client();
    // An automatic title from the model after the first answer; the run is not delayed by it.
    let t1 = untitled(&c).await;
    let run = say(&c, &t1, "Plan a weekend in Lisbon with museums").await;
    assert_eq!(run["status"], "completed");
    let titled = wait_for("the automatic title", || async {
        let w = window(&c, &t1).await;
        (w["thread"]["title"] != "").then_some(w)
    })
    .await;
    assert_eq!(titled["thread"]["title"], "Chat: Plan a weekend in");
    // The model failing: the first words.
    let t2 = untitled(&c).await;
    say(&c, &t2, "MOCK_TITLE_FAIL tell me about quantum tunnelling in diodes please").await;
    let w = wait_for("the fallback title", || async {
        let w = window(&c, &t2).await;
        (w["thread"]["title"] != "").then_some(w)
    })
    .await;
    assert_eq!(w["thread"]["title"], "MOCK_TITLE_FAIL tell me about quantum tunnelling…");
    // A rename wins and is never overwritten; a titled thread gets no title call.
    let r = c.send(reqwest::Method::PATCH, &format!("/api/threads/{t2}"), Some(json!({"title": "Diodes"})), &[]).await.unwrap();
    assert_eq!(r.status, 200);
    let calls_before = stack.mock.requests().await.unwrap().len();
    say(&c, &t2, "and tunnel diodes in oscillators?").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(window(&c, &t2).await["thread"]["title"], "Diodes");
    assert_eq!(stack.mock.requests().await.unwrap().len(), calls_before + 1, "no title request for a titled thread");

    // Search: a title word, a message word (prefix), nothing of another principal.
    let other = stack.client_for("someone-else").unwrap();
    let t3 = untitled(&other).await;
    say(&other, &t3, "Lisbon secrets nobody else may find").await;
    let found = c.get("/api/search?q=lisb").await.unwrap();
    assert_eq!(found.status, 200, "{found:?}");
    let hits: Vec<&str> = found.body["messages"].as_array().unwrap().iter().map(|m| m["threadId"].as_str().unwrap()).collect();
    assert!(hits.contains(&t1.as_str()), "{found:?}");
    assert!(!hits.contains(&t3.as_str()), "another principal's thread is never found");
    assert!(found.body["messages"][0]["snippet"].as_str().unwrap().contains("\u{2}Lisbon\u{3}"), "{found:?}");
    // The hit markers cannot be forged by a message that contains them.
    let marked = untitled(&c).await;
    say(&c, &marked, "zebraword and \u{2}bold\u{3} text").await;
    let forged = c.get("/api/search?q=zebraword").await.unwrap();
    let snippet = forged.body["messages"][0]["snippet"].as_str().unwrap_or_default().to_owned();
    assert!(snippet.contains("\u{2}zebraword\u{3}") && snippet.contains(" bold ") && snippet.matches('\u{2}').count() == 1, "{forged:?}");
    let by_title = c.get("/api/search?q=diodes").await.unwrap();
    assert_eq!(by_title.body["threads"][0]["id"], t2.as_str(), "{by_title:?}");
    assert_eq!(c.get("/api/search?q=%20%20").await.unwrap().status, 400);
    assert_eq!(c.get("/api/search?q=%27%3A*%26%7C").await.unwrap().body["messages"], json!([]), "operators are not syntax");

    // Export: JSON (the contract's shape) and Markdown, as attachments.
    let resp = c.http.get(format!("{}/api/threads/{t1}/export", c.base)).bearer_auth(c.key.as_ref().unwrap()).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let disposition = resp.headers()["content-disposition"].to_str().unwrap().to_owned();
    assert_eq!(disposition, "attachment; filename=\"chat-plan-a-weekend-in.json\"; filename*=UTF-8''chat%2Dplan%2Da%2Dweekend%2Din.json");
    let doc: Value = resp.json().await.unwrap();
    assert_eq!(doc["format"], "agentloop.thread.v1");
    assert_eq!(doc["thread"]["id"], t1.as_str());
    assert_eq!(doc["messages"].as_array().unwrap().len(), 2);
    assert_eq!(doc["messages"][0]["role"], "user");
    assert!(doc["messages"][0].get("stopped").is_none(), "stopped appears only when true");
    assert!(doc["messages"][0].get("toolCalls").is_none() && doc["messages"][0]["createdAt"].is_string());
    let tool = untitled(&c).await;
    say(&c, &tool, "What is 12*7?").await;
    let doc = c.get(&format!("/api/threads/{tool}/export?format=json")).await.unwrap().body;
    let call = &doc["messages"][1]["toolCalls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "calculator");
    assert!(call["function"]["arguments"].is_string() && call.get("providerId").is_none(), "{call}");
    assert_eq!(doc["messages"][2]["toolCallId"], call["id"]);
    let md = c.http.get(format!("{}/api/threads/{tool}/export?format=markdown", c.base)).bearer_auth(c.key.as_ref().unwrap()).send().await.unwrap();
    assert!(md.headers()["content-type"].to_str().unwrap().starts_with("text/markdown"));
    let md = md.text().await.unwrap();
    assert!(md.contains("## User") && md.contains("**Tool call** `calculator`") && md.contains("The result is 84."), "{md}");
    assert_eq!(c.get(&format!("/api/threads/{tool}/export?format=pdf")).await.unwrap().status, 400);

    // Delete, then undo within the window; a second restore finds nothing to restore.
    let r = c.send(reqwest::Method::DELETE, &format!("/api/threads/{t1}"), None, &[]).await.unwrap();
    assert_eq!(r.status, 204);
    assert_eq!(c.get(&format!("/api/threads/{t1}")).await.unwrap().status, 404);
    assert_eq!(other.post(&format!("/api/threads/{t1}/restore"), json!({})).await.unwrap().status, 404, "not someone else's to restore");
    let r = c.post(&format!("/api/threads/{t1}/restore"), json!({})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(texts(&window(&c, &t1).await).len(), 2, "the history is back");
    assert_eq!(c.post(&format!("/api/threads/{t1}/restore"), json!({})).await.unwrap().status, 404);
    // Past the window: no undo.
    c.send(reqwest::Method::DELETE, &format!("/api/threads/{t1}"), None, &[]).await.unwrap();
    let db = stack.db.client().await.unwrap();
    db.execute("UPDATE threads SET deleted_at = now() - interval '11 minutes' WHERE id::text = $1", &[&t1]).await.unwrap();
    assert_eq!(c.post(&format!("/api/threads/{t1}/restore"), json!({})).await.unwrap().status, 404);
}

#[tokio::test]
async fn models_input_limits_and_generation_settings() {
    let options = StackOptions {
        api_env: vec![("MODEL_CONTEXT_TOKENS".into(), "4096".into())],
        worker_env: vec![("MODEL_CONTEXT_TOKENS".into(), "4096".into())],
        ..Default::default()
    };
    let stack = Stack::start("ui_models", options).await.unwrap();
    let c = stack.client();
    let models = c.get("/api/models").await.unwrap();
    let m = &models.body["models"][0];
    assert_eq!((m["maxInputTokens"].as_u64(), m["defaultMaxTokens"].as_u64()), (Some(4096 - 1024 - 512), Some(1024)), "{models:?}");

    // A turn over the limit is refused at once, and nothing is stored.
    let thread = c.create_thread().await.unwrap();
    let big = "word ".repeat(4000);
    let r = c.post(&format!("/api/threads/{thread}/chat"), json!({"content": big})).await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (413, Some("turn_too_large")), "{r:?}");
    assert!(r.body["error"]["message"].as_str().unwrap().contains("2560"), "{r:?}");
    let w = window(&c, &thread).await;
    assert_eq!((w["messageCount"].as_i64(), w["run"].is_null()), (Some(0), true), "nothing persisted");
    // The same message in an import is refused too: a thread holding it could never be
    // continued (acceptance probe: an imported 15 MiB message made every later turn fail).
    let threads_before = c.get("/api/threads").await.unwrap().body["threads"].as_array().unwrap().len();
    let doc = json!({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": big}]});
    let r = c.post("/api/threads/import", doc).await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (413, Some("turn_too_large")), "{r:?}");
    assert!(r.body["error"]["message"].as_str().unwrap().contains("messages[1]"), "{r:?}");
    assert_eq!(c.get("/api/threads").await.unwrap().body["threads"].as_array().unwrap().len(), threads_before, "no thread was created");

    // Default max_tokens from the limit; the thread's settings when it has some.
    say(&c, &thread, "hello").await;
    let sent = stack.mock.requests().await.unwrap();
    let last = sent.iter().rev().find(|r| r["messages"][0]["role"] != "system").unwrap();
    assert_eq!(last["max_tokens"], 1024, "{last}");
    assert!(last.get("temperature").is_none_or(Value::is_null));
    let r = c.send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), Some(json!({"metadata": {"maxTokens": 300, "temperature": 0.3}})), &[]).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    say(&c, &thread, "again").await;
    let sent = stack.mock.requests().await.unwrap();
    let last = sent.last().unwrap();
    assert_eq!(last["max_tokens"], 300);
    assert!((last["temperature"].as_f64().unwrap() - 0.3).abs() < 1e-6, "{last}");
    for bad in [json!({"maxTokens": 0}), json!({"maxTokens": "many"}), json!({"temperature": 2.5})] {
        let r = c.send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), Some(json!({"metadata": bad})), &[]).await.unwrap();
        assert_eq!((r.status, r.body["error"]["code"].as_str()), (400, Some("invalid_metadata")), "{r:?}");
    }

    // A thread pinned to a model that is gone: refused at once, naming the configured models.
    let db = stack.db.client().await.unwrap();
    db.execute("UPDATE threads SET model = 'retired-model' WHERE id::text = $1", &[&thread]).await.unwrap();
    let r = c.post(&format!("/api/threads/{thread}/chat"), json!({"content": "still there?"})).await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (409, Some("model_not_configured")), "{r:?}");
    assert!(r.body["error"]["message"].as_str().unwrap().contains("configured: mock"), "{r:?}");
    let r = c.send(reqwest::Method::PATCH, &format!("/api/threads/{thread}"), Some(json!({"model": "mock"})), &[]).await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(say(&c, &thread, "now?").await["status"], "completed");
}

#[tokio::test]
async fn liveness_and_the_run_inspector() {
    // Short leases, known to the api too, and a low "unclaimed" bound.
    let lease = [("WORKER_LEASE_MS".to_owned(), "3000".to_owned()), ("WORKER_RENEW_MS".to_owned(), "1000".to_owned())];
    let mut api_env = lease.to_vec();
    api_env.push(("UNCLAIMED_AFTER_MS".into(), "500".into()));
    let options = StackOptions { workers: 0, api_env, worker_env: lease.to_vec(), ..Default::default() };
    let mut stack = Stack::start("ui_liveness", options).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    // No worker: the queued run is reported unclaimed once it waited longer than the bound.
    let r = c.chat(&thread, &script(json!([{"toolCalls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]},
                                            {"text": "slow answer after the tool", "chunkDelayMs": 400}]))).await.unwrap();
    let run_id = r["run"]["id"].as_str().unwrap().to_owned();
    let run = c.get(&format!("/api/runs/{run_id}")).await.unwrap().body;
    assert_eq!(run["liveness"]["state"], "ok", "{run}");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let run = c.get(&format!("/api/runs/{run_id}")).await.unwrap().body;
    assert_eq!(run["liveness"]["state"], "unclaimed", "{run}");
    assert!(run["liveness"]["sinceMs"].as_i64().unwrap() >= 500);

    // A worker claims it: ok again. Stop it mid-stream: stale, then expired; a new worker recovers.
    let w = stack.add_worker(&[]).unwrap();
    c.wait_run(&run_id, T, |r| r["status"] == "running" && r["toolCallsTotal"] == 1 && !r["toolCalls"][0]["finishedAt"].is_null()).await.unwrap();
    let run = c.get(&format!("/api/runs/{run_id}")).await.unwrap().body;
    assert_eq!(run["liveness"]["state"], "ok", "{run}");
    stack.workers[w].signal(Signal::SIGSTOP);
    let stale = c.wait_run(&run_id, T, |r| r["liveness"]["state"] == "lease_stale").await.unwrap();
    assert!(stale["liveness"]["expiresInMs"].as_i64().unwrap() <= 3000, "{stale}");
    c.wait_run(&run_id, T, |r| r["liveness"]["state"] == "lease_expired").await.unwrap();
    stack.add_worker(&[]).unwrap();
    let done = c.wait_terminal(&run_id, T).await.unwrap();
    stack.workers[w].signal(Signal::SIGKILL);
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["liveness"]["state"], "ok");
    assert!(done["recoveries"].as_i64().unwrap() >= 1, "{done}");

    // The inspector's data: steps, the tool call with timing and result.
    assert!(!done["steps"].as_array().unwrap().is_empty() && done["attempts"].as_i64().unwrap() >= 2, "{done}");
    let call = &done["toolCalls"][0];
    assert_eq!(call["name"], "calculator");
    assert_eq!(call["result"], "42");
    assert!(call["durationMs"].as_i64().unwrap() >= 0 && call["stepId"].is_i64(), "{call}");
    assert_eq!(done["toolCallsTotal"], 1);
    assert_eq!(done["compactions"], json!([]));
}

#[tokio::test]
async fn a_stopped_answer_reads_as_interrupted_to_the_model() {
    let stack = Stack::start("ui_stopped", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let words: Vec<String> = (1..=60).map(|i| format!("w{i}")).collect();
    let r = c.chat(&thread, &script(json!([{"text": words.join(" "), "chunkDelayMs": 100}]))).await.unwrap();
    let run_id = r["run"]["id"].as_str().unwrap().to_owned();
    wait_for("some streamed text", || async {
        let w = window(&c, &thread).await;
        w["streamingMessage"]["content"].as_str().is_some_and(|s| s.len() > 20).then_some(w)
    })
    .await;
    c.post(&format!("/api/runs/{run_id}/cancel"), json!({})).await.unwrap();
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "cancelled");
    let w = window(&c, &thread).await;
    let stopped = w["messages"].as_array().unwrap().last().unwrap().clone();
    assert_eq!((stopped["role"].as_str(), stopped["stopped"].as_bool()), (Some("assistant"), Some(true)), "{w}");
    say(&c, &thread, "go on").await;
    let sent = stack.mock.requests().await.unwrap();
    let msgs = sent.last().unwrap()["messages"].as_array().unwrap().clone();
    let partial = msgs.iter().find(|m| m["role"] == "assistant").unwrap()["content"].as_str().unwrap().to_owned();
    assert!(partial.starts_with("w1 w2") && partial.ends_with("[interrupted: the user stopped this answer before it was finished]"), "{partial}");
}

/// Any text is stored and searched in time linear in its length, within PostgreSQL's bounds
/// (migration 000043). PostgreSQL's text-search parser is quadratic in a run without whitespace
/// of some characters: the search index made the commit of an answer of 48,000 `_a` take about
/// five minutes, so the worker's commit timed out again and again and the paid answer was never
/// stored; and a tsvector holds at most 1 MiB, so a message of ~2 MB of distinct words failed
/// its insert (`string is too long for tsvector`). The same for the comment state (`<!--`), which
/// no run cut bounds (000046).
#[tokio::test]
async fn any_text_is_stored_and_searched_in_linear_time() {
    let stack = Stack::start("ui_search_bounds", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let thread = untitled(&c).await;
    let run = c.chat(&thread, &format!("long line please {}", script(json!([{"text": "_a", "repeat": 48_000}])))).await.unwrap();
    let run = c.wait_terminal(run["run"]["id"].as_str().unwrap(), Duration::from_secs(60)).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let answer = texts(&window(&c, &thread).await).pop().unwrap().1;
    assert_eq!(answer, "_a".repeat(48_000), "the answer is stored whole");
    // The parser's comment state scans across whitespace, so the run cut does not bound it:
    // 128 Ki characters of `<!--` took 28.7 s, every commit of such an answer timed out and the
    // run ended `abandoned` (verifier P, P-1). `<` is read as a space (migration 000046).
    let run = c.chat(&thread, &format!("comments please {}", script(json!([{"prefix": "start ", "text": "<!-- ", "repeat": 26_000, "suffix": "end"}])))).await.unwrap();
    let run = c.wait_terminal(run["run"]["id"].as_str().unwrap(), Duration::from_secs(60)).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(texts(&window(&c, &thread).await).pop().unwrap().1, format!("start {}end", "<!-- ".repeat(26_000)), "stored whole");

    // ~1 MB of distinct words (a tsvector of ~1.6 MiB): stored; the first 128 Ki characters are
    // searched.
    let run = c.chat(&thread, &format!("many words {}", script(json!([{"text": "w{{n}}q ", "repeat": 100_000}])))).await.unwrap();
    let run = c.wait_terminal(run["run"]["id"].as_str().unwrap(), Duration::from_secs(60)).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let db = stack.db.client().await.unwrap();
    let stored = rows(&db, &thread).await.pop().unwrap().1;
    assert!(stored.starts_with("\"w0q w1q ") && stored.ends_with(" w99999q \""), "the answer is stored whole");
    let found = c.get("/api/search?q=w100q").await.unwrap();
    assert_eq!(found.body["messages"][0]["threadId"], thread.as_str(), "{found:?}");
    assert!(found.body["messages"][0]["snippet"].as_str().unwrap().contains("\u{2}w100q\u{3}"), "{found:?}");
    assert_eq!(c.get("/api/search?q=w99999q").await.unwrap().body["messages"], json!([]), "only the first 128 Ki characters are indexed");

    // An import of the slow class (a path-like run) is stored at once too.
    let r = c.post("/api/threads/import", json!({"messages": [{"role": "user", "content": "firstneedle"}, {"role": "assistant", "content": "/~".repeat(40_000)}]})).await.unwrap();
    assert_eq!(r.status, 201, "{:?}", r.body);
    let found = c.get("/api/search?q=firstneedle").await.unwrap();
    assert_eq!(found.body["messages"][0]["threadId"], r.body["thread"]["id"], "{found:?}");

    // A snippet is cut from around the first match (migration 000045: the whole search text of
    // every hit was parsed again for it), so a match deep in a long message is still shown.
    let deep = format!("{}deepneedle is here {}", "x ".repeat(50_000), "y ".repeat(5_000));
    let r = c.post("/api/threads/import", json!({"messages": [{"role": "user", "content": deep}]})).await.unwrap();
    assert_eq!(r.status, 201, "{:?}", r.body);
    let found = c.get("/api/search?q=deepneedle").await.unwrap();
    let snippet = found.body["messages"][0]["snippet"].as_str().unwrap_or_default();
    assert!(snippet.contains("\u{2}deepneedle\u{3} is here") && snippet.len() < 1000, "{found:?}");
}

/// A search costs about the same whatever plan PostgreSQL picks (migration 000046; acceptance
/// probe N, N-8). The search index was on an expression, and a plan that did not use it parsed
/// every message it looked at again; the planner estimates messages per thread from the
/// average, so a principal whose one thread holds many large messages among many principals
/// with one short message each got exactly that plan (threads by owner, messages by thread,
/// the expression as a filter), fresh statistics or not: 11.8 s for 144 messages of 250 KB,
/// past the api's 10 s bound. And each hit's snippet cut its whole text again. Here: 40
/// messages of 128 Ki characters without whitespace (the costliest text to cut, 000043) —
/// writing them computes each one's vector once; a search with 40 hits must cost far less
/// than that (before: more).
#[tokio::test]
async fn a_search_costs_the_same_whatever_plan_postgresql_picks() {
    let stack = Stack::start("ui_search_any_plan", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let thread = untitled(&c).await;
    let db = stack.db.client().await.unwrap();
    db.batch_execute(
        "INSERT INTO principals (id, name) SELECT gen_random_uuid(), 'other' || g FROM generate_series(1, 3000) g;
         INSERT INTO threads (id, owner_id, title) SELECT gen_random_uuid(), id, 'other' FROM principals WHERE name LIKE 'other%';
         INSERT INTO messages (thread_id, sequence, timestamp_ms, role, content)
             SELECT id, 1, 1, 'user', to_jsonb('hello needle'::text) FROM threads WHERE title = 'other';",
    )
    .await
    .unwrap();
    let written = Instant::now();
    db.execute(
        "INSERT INTO messages (thread_id, sequence, timestamp_ms, role, content)
             SELECT $1::text::uuid, g, g, 'user', to_jsonb('needle ' || repeat('m', 131072)) FROM generate_series(1, 40) g",
        &[&thread],
    )
    .await
    .unwrap();
    let written = written.elapsed();
    db.batch_execute("ANALYZE messages; ANALYZE threads").await.unwrap();
    let searched = Instant::now();
    let found = c.get("/api/search?q=needle&limit=100").await.unwrap();
    let searched = searched.elapsed();
    println!("writing 40 messages {written:?}; searching them {searched:?}");
    assert_eq!(found.status, 200, "{:?}", found.body);
    let hits = found.body["messages"].as_array().unwrap();
    assert_eq!(hits.len(), 40, "only this principal's messages: {}", hits.len());
    assert!(hits.iter().all(|h| h["threadId"] == thread.as_str() && h["snippet"].as_str().unwrap_or_default().contains("\u{2}needle\u{3}")));
    assert!(searched * 4 < written, "a search of 40 messages took {searched:?}, writing them {written:?}");
}
