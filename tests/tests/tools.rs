//! Tools (issue 6): approvals that resume the same run, the operations ledger with uncertain
//! effects after a SIGKILL, MCP tools from a real rmcp server (streamable HTTP and stdio), HTTP
//! tools, and an MCP server that is down. Real api/worker processes, real PostgreSQL, the
//! scripted mock model. Every test name starts with `tools_`: `./deploy/test.sh tools` runs them.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agentloop_tests::{Client, Proc, Sig, Stack, StackOptions, bin_dir, free_port, script};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(30);

/// Writes `tools` as the test's `TOOLS_FILE` and returns the worker environment using it.
fn tools_env(test: &str, tools: Value, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../test-output").join(test);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tools.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&tools).unwrap()).unwrap();
    let mut env = vec![("TOOLS_FILE".to_owned(), path.display().to_string())];
    env.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    env
}

async fn start(test: &str, tools: Value, extra: &[(&str, &str)]) -> Stack {
    let options = StackOptions { worker_env: tools_env(test, tools, extra), ..Default::default() };
    Stack::start(test, options).await.unwrap()
}

async fn messages(c: &Client, thread: &str) -> Vec<Value> {
    let r = c.get(&format!("/api/threads/{thread}")).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    r.body["messages"].as_array().unwrap().clone()
}

async fn wait_status(c: &Client, run: &str, status: &str) -> Value {
    c.wait_run(run, T, |r| r["status"] == status).await.unwrap()
}

async fn pending(c: &Client, thread: &str) -> Vec<Value> {
    let r = c.get(&format!("/api/threads/{thread}/approvals?status=pending")).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    r.body["approvals"].as_array().unwrap().clone()
}

fn id(v: &Value) -> String {
    v["id"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn tools_approve_resumes_the_same_run_and_chat_is_409_meanwhile() {
    let stack = start("approve", json!({"tools": {"calculator": {"policy": "ask"}}}), &[]).await;
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let steps = json!([
        {"toolCalls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]},
        {"text": "Result: {{tool_result}}"}
    ]);
    let posted = c.chat(&thread, &script(steps)).await.unwrap();
    let run_id = posted["run"]["id"].as_str().unwrap().to_owned();
    let waiting = wait_status(&c, &run_id, "waiting_approval").await;
    assert_eq!(waiting["leaseOwner"], Value::Null, "the lease is released while waiting");
    assert_eq!(waiting["approvals"].as_array().unwrap().len(), 1, "{waiting}");
    let approvals = pending(&c, &thread).await;
    assert_eq!(approvals.len(), 1);
    let approval = &approvals[0];
    assert_eq!(approval["toolName"], "calculator");
    assert_eq!(approval["arguments"], json!({"expression": "6*7"}));
    assert_eq!(approval["runId"], run_id.as_str());
    // The call is durable, unanswered, and nothing ran.
    let msgs = messages(&c, &thread).await;
    assert_eq!(msgs.len(), 2, "{msgs:?}");
    assert_eq!(msgs[1]["toolCalls"][0]["id"], approval["toolCallId"]);

    let r = c.post(&format!("/api/threads/{thread}/chat"), json!({"content": "another"})).await.unwrap();
    assert_eq!(r.status, 409, "{r:?}");
    assert_eq!(r.body["error"]["code"], "approval_required");
    // Another principal cannot see or decide it.
    let other = stack.client_for("intruder").unwrap();
    assert_eq!(other.post(&format!("/api/approvals/{}/approve", id(approval)), json!({})).await.unwrap().status, 404);
    assert_eq!(other.get(&format!("/api/threads/{thread}/approvals")).await.unwrap().status, 404);

    let r = c.post(&format!("/api/approvals/{}/approve", id(approval)), json!({})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body["approval"]["status"], "approved");
    assert_eq!(r.body["approval"]["argumentsEdited"], false);
    assert_eq!(r.body["run"]["status"], "queued", "the same run is requeued");
    assert_eq!(r.body["run"]["id"], run_id.as_str());
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let steps: Vec<&str> = run["steps"].as_array().unwrap().iter().map(|s| s["status"].as_str().unwrap()).collect();
    assert_eq!(steps, ["waiting_approval", "completed"]);
    let msgs = messages(&c, &thread).await;
    let roles: Vec<&str> = msgs.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"], "no user message was invented");
    assert_eq!(msgs[2]["content"], "42");
    assert_eq!(msgs[3]["content"], "Result: 42");
    assert!(msgs.iter().skip(1).all(|m| m["runId"] == run_id.as_str()));
    // A second decision is refused.
    let again = c.post(&format!("/api/approvals/{}/reject", id(approval)), json!({})).await.unwrap();
    assert_eq!(again.status, 409, "{again:?}");
    assert_eq!(again.body["error"]["code"], "approval_decided");
}

#[tokio::test]
async fn tools_approve_with_edited_arguments_is_validated_and_recorded() {
    let stack = start("approve_edited", json!({"tools": {"calculator": {"policy": "ask"}}}), &[]).await;
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let steps = json!([
        {"toolCalls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]},
        {"text": "Result: {{tool_result}}"}
    ]);
    let run_id = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    wait_status(&c, &run_id, "waiting_approval").await;
    let approval = pending(&c, &thread).await.remove(0);
    let url = format!("/api/approvals/{}/approve", id(&approval));
    // Held to the whole stored schema: the calculator's says `additionalProperties: false`.
    for bad in [
        json!({"arguments": {"expression": 5}}),
        json!({"arguments": {}}),
        json!({"arguments": "{not json"}),
        json!({"arguments": {"expression": "1+1", "extra": "x"}}),
    ] {
        let r = c.post(&url, bad.clone()).await.unwrap();
        assert_eq!(r.status, 400, "{bad}: {r:?}");
        assert_eq!(r.body["error"]["code"], "invalid_arguments");
    }
    // A number the tool would receive rounded, in arguments sent as JSON text (as a JSON
    // number in the body it is refused before any route: 400 `invalid_number`).
    let r = c.post(&url, json!({"arguments": "{\"expression\": 12345678901234567.89}"})).await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (400, Some("invalid_arguments")), "{r:?}");
    assert!(r.body["error"]["message"].as_str().unwrap().contains("12345678901234567.89"), "{r:?}");
    assert_eq!(pending(&c, &thread).await.len(), 1, "an invalid edit decides nothing");
    let r = c.post(&url, json!({"arguments": "{\"expression\": \"2*3\"}"})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body["approval"]["argumentsEdited"], true);
    assert_eq!(r.body["approval"]["approvedArguments"], json!({"expression": "2*3"}));
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let msgs = messages(&c, &thread).await;
    let result = msgs[2]["content"].as_str().unwrap();
    assert!(result.contains("edited the arguments") && result.ends_with("\n6"), "{result}");
    assert!(msgs[3]["content"].as_str().unwrap().ends_with("\n6"), "{}", msgs[3]);
}

#[tokio::test]
async fn tools_reject_gives_a_declined_result_and_a_batch_mixes_auto_and_ask_calls() {
    let tools = json!({"tools": {"sleep": {"policy": "ask"}, "current_time": {"policy": "deny"}}});
    let stack = start("reject_mixed", tools, &[]).await;
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let steps = json!([
        {"toolCalls": [
            {"name": "sleep", "arguments": {"seconds": 0}},
            {"name": "calculator", "arguments": {"expression": "1+1"}},
            {"name": "current_time", "arguments": {}},
            {"name": "sleep", "arguments": {"seconds": 0.1}}
        ]},
        {"text": "Results: {{tool_results}}"}
    ]);
    let run_id = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    wait_status(&c, &run_id, "waiting_approval").await;
    // The auto call ran and the denied one was answered before the run parked.
    let msgs = messages(&c, &thread).await;
    let calls = msgs[1]["toolCalls"].as_array().unwrap().clone();
    let results: Vec<&Value> = msgs.iter().filter(|m| m["role"] == "tool").collect();
    assert_eq!(results.len(), 2, "{msgs:?}");
    assert_eq!(results[0]["toolCallId"], calls[1]["id"]);
    assert_eq!(results[0]["content"], "2");
    assert_eq!(results[1]["toolCallId"], calls[2]["id"]);
    assert!(results[1]["content"].as_str().unwrap().contains("not allowed"), "{}", results[1]);
    let mock_tools: Vec<String> = stack.mock.requests().await.unwrap()[0]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap().to_owned())
        .collect();
    assert!(!mock_tools.contains(&"current_time".to_owned()), "deny tools are not offered: {mock_tools:?}");

    let approvals = pending(&c, &thread).await;
    assert_eq!(approvals.len(), 2);
    let first = approvals.iter().find(|a| a["toolCallId"] == calls[0]["id"]).unwrap();
    let second = approvals.iter().find(|a| a["toolCallId"] == calls[3]["id"]).unwrap();
    let r = c.post(&format!("/api/approvals/{}/reject", id(first)), json!({"reason": "not now"})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body["run"]["status"], "waiting_approval", "one call of the batch is still undecided");
    let r = c.post(&format!("/api/approvals/{}/approve", id(second)), json!({})).await.unwrap();
    assert_eq!(r.body["run"]["status"], "queued");
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let msgs = messages(&c, &thread).await;
    let result_of = |call: &Value| msgs.iter().find(|m| m["toolCallId"] == call["id"]).unwrap()["content"].as_str().unwrap().to_owned();
    assert_eq!(result_of(&calls[0]), "Tool call declined by the user. Reason: not now");
    assert_eq!(result_of(&calls[3]), "slept 0.1 seconds");
    let tool_rows = msgs.iter().filter(|m| m["role"] == "tool").count();
    assert_eq!(tool_rows, 4, "every call answered exactly once");
    let last = msgs.last().unwrap();
    assert!(last["content"].as_str().unwrap().contains("declined by the user"), "the model saw the rejection: {last}");
}

#[tokio::test]
async fn tools_double_approval_from_two_clients_runs_the_tool_once() {
    let tools = json!({"tools": {"record_effect": {"policy": "ask"}}});
    let stack = start("double_approve", tools, &[("AGENTLOOP_TEST_TOOLS", "1")]).await;
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": "once"}}]}, {"text": "ok"}]);
    let run_id = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    wait_status(&c, &run_id, "waiting_approval").await;
    let approval = pending(&c, &thread).await.remove(0);
    let url = format!("/api/approvals/{}/approve", id(&approval));
    let (a, b) = (stack.client(), stack.client());
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let (ra, rb) = tokio::join!(a.post(&url, json!({})), b.post(&url, json!({})));
        statuses.push(ra.unwrap().status);
        statuses.push(rb.unwrap().status);
    }
    statuses.sort();
    assert_eq!(statuses, [200, 409, 409, 409, 409, 409]);
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let db = stack.db.client().await.unwrap();
    let effects: i64 = db.query_one("SELECT count(*) FROM agentloop_test_effects", &[]).await.unwrap().get(0);
    assert_eq!(effects, 1, "the tool ran exactly once");
    let results = messages(&c, &thread).await.into_iter().filter(|m| m["role"] == "tool").count();
    assert_eq!(results, 1);
    // A non-idempotent call goes through the ledger under the call's stable key.
    let ops = c.get(&format!("/api/runs/{run_id}/operations")).await.unwrap().body;
    let op = &ops["operations"][0];
    assert_eq!(op["status"], "completed", "{ops}");
    assert_eq!(op["key"], format!("run:{run_id}:call:{}", approval["toolCallId"].as_str().unwrap()));
    let key: String = db.query_one("SELECT key FROM agentloop_test_effects", &[]).await.unwrap().get(0);
    assert_eq!(key, op["key"].as_str().unwrap(), "the tool got the key as its idempotency key");
}

/// SIGTERM while a call with external effects runs longer than the shutdown grace: the worker
/// waits for it (`WORKER_EFFECT_DRAIN_MS`), commits its outcome and hands the run back; the next
/// worker completes the run — the operation `completed`, the effect performed once, nothing
/// `uncertain`. Before, the worker exited at the grace and the run was left `blocked` for a
/// human to resolve (acceptance probe E: a 20 s call, the default 10 s grace).
#[tokio::test]
async fn tools_a_shutdown_waits_for_an_effect_in_flight_past_the_grace() {
    let grace = [("AGENTLOOP_TEST_TOOLS", "1"), ("WORKER_SHUTDOWN_GRACE_MS", "1000")];
    let mut stack = start("shutdown_effect_drain", json!({}), &grace).await;
    let c = stack.client();
    let db = stack.db.client().await.unwrap();
    let thread = c.create_thread().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": "slow", "seconds": 4}}]}, {"text": "after: {{tool_result}}"}]);
    let run_id = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    let deadline = Instant::now() + T;
    while db.query_one("SELECT count(*) FROM agentloop_test_effects", &[]).await.unwrap().get::<_, i64>(0) == 0 {
        assert!(Instant::now() < deadline, "the effect did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stopping = Instant::now();
    stack.workers[0].signal(Sig::SIGTERM);
    assert!(stack.workers[0].wait_exit(Duration::from_secs(20)), "the worker exited");
    let took = stopping.elapsed();
    assert!(took >= Duration::from_secs(2), "the worker waited for the call in flight ({took:?})");
    stack.add_worker(&[]).unwrap();
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let ops = c.get(&format!("/api/runs/{run_id}/operations")).await.unwrap().body;
    assert_eq!(ops["operations"][0]["status"], "completed", "{ops}");
    let effects: i64 = db.query_one("SELECT count(*) FROM agentloop_test_effects", &[]).await.unwrap().get(0);
    assert_eq!(effects, 1);
    let answer = messages(&c, &thread).await.into_iter().filter(|m| m["role"] == "assistant").last().unwrap();
    assert_eq!(answer["content"], "after: recorded slow", "{answer}");
}

/// `deny` is the operator's kill switch: a call approved after its tool was set to `deny` (a
/// new tools file, the workers restarted) is not run; its result says the policy denied it.
/// Before, the approved call ran (acceptance probe E: the receiver saw the payment).
#[tokio::test]
async fn tools_an_approved_call_is_not_run_once_its_tool_is_denied() {
    let ask = json!({"tools": {"record_effect": {"policy": "ask"}}});
    let mut stack = start("approve_then_deny", ask, &[("AGENTLOOP_TEST_TOOLS", "1")]).await;
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": "pay"}}]}, {"text": "after: {{tool_result}}"}]);
    let run_id = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    wait_status(&c, &run_id, "waiting_approval").await;
    // The operator denies the tool: a new tools file, the worker replaced.
    stack.workers[0].signal(Sig::SIGTERM);
    assert!(stack.workers[0].wait_exit(Duration::from_secs(20)), "the worker stopped");
    let deny = tools_env("approve_then_deny_denied", json!({"tools": {"record_effect": {"policy": "deny"}}}), &[]);
    let file = deny[0].1.clone();
    stack.add_worker(&[("TOOLS_FILE", file.as_str())]).unwrap();
    let approval = pending(&c, &thread).await.remove(0);
    assert_eq!(c.post(&format!("/api/approvals/{}/approve", id(&approval)), json!({})).await.unwrap().status, 200);
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let db = stack.db.client().await.unwrap();
    let effects: i64 = db.query_one("SELECT count(*) FROM agentloop_test_effects", &[]).await.unwrap().get(0);
    assert_eq!(effects, 0, "the denied tool did not run");
    let result = messages(&c, &thread).await.into_iter().find(|m| m["role"] == "tool").unwrap();
    assert!(result["content"].as_str().unwrap().contains("deny"), "{result}");
}

#[tokio::test]
async fn tools_an_undecided_approval_expires_and_the_run_continues() {
    let tools = json!({"tools": {"calculator": {"policy": "ask"}}});
    let stack = start("approval_expiry", tools, &[("APPROVAL_TIMEOUT_MS", "1500")]).await;
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "calculator", "arguments": {"expression": "1+2"}}]}, {"text": "after: {{tool_result}}"}]);
    let run_id = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    wait_status(&c, &run_id, "waiting_approval").await;
    let started = Instant::now();
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    assert!(started.elapsed() < Duration::from_secs(15), "expired promptly ({:?})", started.elapsed());
    let all = c.get(&format!("/api/threads/{thread}/approvals")).await.unwrap().body;
    assert_eq!(all["approvals"][0]["status"], "expired", "{all}");
    assert_eq!(all["approvals"][0]["reason"], "expired");
    let msgs = messages(&c, &thread).await;
    // An expiry is not the user's decline: the model reads what happened.
    assert_eq!(msgs[2]["content"], "Tool call not run: nobody approved it before its approval expired.");
    assert_eq!(msgs[3]["content"], "after: Tool call not run: nobody approved it before its approval expired.");
}

#[tokio::test]
async fn tools_cancelling_a_run_cancels_its_pending_approvals() {
    let stack = start("approval_cancel", json!({"tools": {"calculator": {"policy": "ask"}}}), &[]).await;
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "calculator", "arguments": {"expression": "1+2"}}]}, {"text": "never"}]);
    let run_id = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    wait_status(&c, &run_id, "waiting_approval").await;
    let approval = pending(&c, &thread).await.remove(0);
    let r = c.post(&format!("/api/runs/{run_id}/cancel"), json!({})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body["status"], "cancelled");
    assert!(pending(&c, &thread).await.is_empty());
    let all = c.get(&format!("/api/threads/{thread}/approvals")).await.unwrap().body;
    assert_eq!(all["approvals"][0]["status"], "cancelled");
    let late = c.post(&format!("/api/approvals/{}/approve", id(&approval)), json!({})).await.unwrap();
    assert_eq!(late.status, 409, "{late:?}");
    // The dangling call got a synthetic result; the thread accepts new messages.
    let msgs = messages(&c, &thread).await;
    assert_eq!(msgs.iter().filter(|m| m["role"] == "tool").count(), 1);
    let next = c.chat(&thread, &script(json!([{"text": "fresh"}]))).await.unwrap();
    let next = c.wait_terminal(next["run"]["id"].as_str().unwrap(), T).await.unwrap();
    assert_eq!(next["status"], "completed");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let run = c.get(&format!("/api/runs/{run_id}")).await.unwrap().body;
    assert_eq!(run["status"], "cancelled");

    // Deleting a thread cancels its waiting run and the run's pending approvals too.
    let thread = c.create_thread().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "calculator", "arguments": {"expression": "3+4"}}]}, {"text": "never"}]);
    let run_id = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    wait_status(&c, &run_id, "waiting_approval").await;
    let r = c.send(reqwest::Method::DELETE, &format!("/api/threads/{thread}"), None, &[]).await.unwrap();
    assert!(r.status == 204 || r.status == 200, "{r:?}");
    let db = stack.db.client().await.unwrap();
    let row = db
        .query_one(
            "SELECT r.status, a.status FROM runs r JOIN tool_approvals a ON a.run_id = r.id WHERE r.id = $1::text::uuid",
            &[&run_id],
        )
        .await
        .unwrap();
    assert_eq!((row.get::<_, String>(0), row.get::<_, String>(1)), ("cancelled".to_owned(), "cancelled".to_owned()));
}

/// Cancelling a run while its non-idempotent call is in flight ends it `cancelled` at once: the
/// call's result says its outcome is unknown (never "cancelled": it may have happened) and its
/// operation stays `uncertain`, resolvable for the record. Deleting the thread does the same:
/// before, both left the run `blocked` — on a deleted thread out of reach, holding one of the
/// principal's active-run slots until the purge.
#[tokio::test]
async fn tools_cancel_or_delete_during_an_effect_ends_the_run_with_its_outcome_unknown() {
    let stack = start("cancel_effect", json!({}), &[("AGENTLOOP_TEST_TOOLS", "1")]).await;
    let c = stack.client();
    let db = stack.db.client().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": "slow", "seconds": 30}}]}, {"text": "never"}]);
    for (round, how) in ["cancel run", "delete thread"].into_iter().enumerate() {
        let thread = c.create_thread().await.unwrap();
        let run_id = c.chat(&thread, &script(steps.clone())).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
        let deadline = Instant::now() + T;
        loop {
            let n: i64 = db.query_one("SELECT count(*) FROM agentloop_test_effects", &[]).await.unwrap().get(0);
            if n == round as i64 + 1 {
                break;
            }
            assert!(Instant::now() < deadline, "{how}: the effect did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if how == "cancel run" {
            assert_eq!(c.post(&format!("/api/runs/{run_id}/cancel"), json!({})).await.unwrap().status, 200);
        } else {
            let r = c.send(reqwest::Method::DELETE, &format!("/api/threads/{thread}"), None, &[]).await.unwrap();
            assert!(r.status < 300, "{r:?}");
        }
        let deadline = Instant::now() + T;
        let status = loop {
            let status: String = db.query_one("SELECT status FROM runs WHERE id = $1::text::uuid", &[&run_id]).await.unwrap().get(0);
            if !["running", "queued"].contains(&status.as_str()) || Instant::now() > deadline {
                break status;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(status, "cancelled", "{how}: one request ends the run");
        let op: String = db.query_one("SELECT status FROM operations WHERE run_id = $1::text::uuid", &[&run_id]).await.unwrap().get(0);
        assert_eq!(op, "uncertain", "{how}: the record stays");
        let result: String = db
            .query_one("SELECT content #>> '{}' FROM messages WHERE thread_id = $1::text::uuid AND role = 'tool'", &[&thread])
            .await
            .unwrap()
            .get(0);
        assert!(result.starts_with("[outcome unknown"), "{how}: {result}");
        if how == "delete thread" {
            // Deleted with its record uncertain: restorable after the undo window, never
            // purged, and not deletable again until resolved.
            db.execute("UPDATE threads SET deleted_at = now() - interval '30 days' WHERE id = $1::text::uuid", &[&thread]).await.unwrap();
            db.execute("SELECT agentloop_purge_threads('{\"rows\": 1000, \"keepHours\": 1}')", &[]).await.unwrap();
            let kept: i64 = db.query_one("SELECT count(*) FROM operations WHERE run_id = $1::text::uuid", &[&run_id]).await.unwrap().get(0);
            assert_eq!(kept, 1, "the purge kept the uncertain record");
            let r = c.post(&format!("/api/threads/{thread}/restore"), json!({})).await.unwrap();
            assert_eq!(r.status, 200, "restorable while an operation is uncertain: {r:?}");
            let r = c.send(reqwest::Method::DELETE, &format!("/api/threads/{thread}"), None, &[]).await.unwrap();
            assert_eq!((r.status, r.body["error"]["code"].as_str()), (409, Some("operations_uncertain")), "{r:?}");
            let ops = c.get(&format!("/api/runs/{run_id}/operations")).await.unwrap().body;
            let key = ops["operations"][0]["key"].as_str().unwrap().to_owned();
            let r = c.post(&format!("/api/runs/{run_id}/operations/{key}/resolve"), json!({"outcome": "completed"})).await.unwrap();
            assert_eq!(r.status, 200, "{r:?}");
            let r = c.send(reqwest::Method::DELETE, &format!("/api/threads/{thread}"), None, &[]).await.unwrap();
            assert_eq!(r.status, 204, "resolved, it can go: {r:?}");
        }
    }
    let active: i64 = db.query_one("SELECT count(*) FROM runs WHERE status NOT IN ('completed', 'failed', 'cancelled')", &[]).await.unwrap().get(0);
    assert_eq!(active, 0, "no run is left holding an active-run slot");
}

/// A blocked call the user resolves `retry` after the operator denied its tool is not sent
/// again, and its result says its outcome is unknown (the first attempt reached the tool) —
/// never "it was not run" (verification of probe E).
#[tokio::test]
async fn tools_a_retry_of_a_denied_tool_is_not_sent_and_stays_unknown() {
    let lease = [("AGENTLOOP_TEST_TOOLS", "1"), ("WORKER_LEASE_MS", "3000"), ("WORKER_RENEW_MS", "1000")];
    let mut stack = start("retry_denied", json!({}), &lease).await;
    let c = stack.client();
    let db = stack.db.client().await.unwrap();
    let thread = c.create_thread().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": "pay", "seconds": 30}}]}, {"text": "after: {{tool_result}}"}]);
    let run_id = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    let deadline = Instant::now() + T;
    while db.query_one("SELECT count(*) FROM agentloop_test_effects", &[]).await.unwrap().get::<_, i64>(0) == 0 {
        assert!(Instant::now() < deadline, "the effect did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stack.workers[0].signal(Sig::SIGKILL);
    let deny = tools_env("retry_denied_policy", json!({"tools": {"record_effect": {"policy": "deny"}}}), &[]);
    let file = deny[0].1.clone();
    stack.add_worker(&[("TOOLS_FILE", file.as_str())]).unwrap();
    wait_status(&c, &run_id, "blocked").await;
    let ops = c.get(&format!("/api/runs/{run_id}/operations")).await.unwrap().body;
    assert_eq!(ops["operations"][0]["status"], "uncertain", "{ops}");
    let key = ops["operations"][0]["key"].as_str().unwrap().to_owned();
    let r = c.post(&format!("/api/runs/{run_id}/operations/{key}/resolve"), json!({"outcome": "retry"})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let effects: i64 = db.query_one("SELECT count(*) FROM agentloop_test_effects", &[]).await.unwrap().get(0);
    assert_eq!(effects, 1, "not sent again");
    let result = messages(&c, &thread).await.into_iter().find(|m| m["role"] == "tool").unwrap();
    let text = result["content"].as_str().unwrap();
    assert!(text.starts_with("[outcome unknown") && !text.contains("it was not run"), "{text}");
}

/// SPEC §7/§12: at most 64 operation rows are kept per run (the oldest finished ones go).
#[tokio::test]
async fn tools_the_ledger_keeps_at_most_64_operations_per_run() {
    let stack = start("ledger_bound", json!({}), &[("AGENTLOOP_TEST_TOOLS", "1")]).await;
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let calls: Vec<Value> = (0..70).map(|i| json!({"name": "record_effect", "arguments": {"label": format!("e{i}")}})).collect();
    let steps = json!([{"toolCalls": calls}, {"text": "done"}]);
    let run_id = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    let run = c.wait_terminal(&run_id, Duration::from_secs(60)).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let db = stack.db.client().await.unwrap();
    let effects: i64 = db.query_one("SELECT count(*) FROM agentloop_test_effects", &[]).await.unwrap().get(0);
    assert_eq!(effects, 70);
    let ops = c.get(&format!("/api/runs/{run_id}/operations")).await.unwrap().body;
    let ops = ops["operations"].as_array().unwrap();
    assert_eq!(ops.len(), 64);
    assert!(ops.iter().all(|o| o["status"] == "completed"));
    let labels: Vec<&str> = ops.iter().map(|o| o["arguments"]["label"].as_str().unwrap()).collect();
    assert!(!labels.contains(&"e0") && labels.contains(&"e69"), "the oldest rows went: {labels:?}");
}

/// The stateless endpoint has nobody to ask: an `ask` call fails closed with an error result.
#[tokio::test]
async fn tools_an_ask_call_from_the_stateless_endpoint_fails_closed() {
    let stack = start("approval_stateless", json!({"tools": {"calculator": {"policy": "ask"}}}), &[]).await;
    let c = stack.client();
    let steps = json!([{"toolCalls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]}, {"text": "{{tool_result}}"}]);
    let body = json!({"model": "mock", "messages": [{"role": "user", "content": script(steps)}]});
    let r = tokio::time::timeout(T, c.post("/v1/chat/completions", body)).await.expect("no hang").unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    let content = r.body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(content.contains("no interactive owner"), "{content}");
    let db = stack.db.client().await.unwrap();
    let approvals: i64 = db.query_one("SELECT count(*) FROM tool_approvals", &[]).await.unwrap().get(0);
    assert_eq!(approvals, 0);
}

/// SIGKILL while three slow non-idempotent calls are executing: after recovery every run is
/// `blocked` with an `uncertain` operation and the effects ran once each; each resolve outcome
/// then leads where it should, and a stale resolve is refused.
#[tokio::test]
async fn tools_sigkill_during_an_effect_blocks_the_run_until_resolved() {
    let extra = [
        ("AGENTLOOP_TEST_TOOLS", "1"),
        ("WORKER_LEASE_MS", "2000"),
        ("WORKER_RENEW_MS", "600"),
        ("WORKER_CONCURRENCY", "3"),
    ];
    let mut stack = start("sigkill_effect", json!({}), &extra).await;
    let c = stack.client();
    let mut runs = Vec::new();
    for label in ["completed", "failed", "retry"] {
        let thread = c.create_thread().await.unwrap();
        let steps = json!([
            {"toolCalls": [{"name": "record_effect", "arguments": {"label": label, "seconds": 60}}]},
            {"text": "final: {{tool_result}}"}
        ]);
        let run = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
        runs.push((label, thread, run));
    }
    let db = stack.db.client().await.unwrap();
    let count = async |label: &str| -> i64 {
        db.query_one("SELECT count(*) FROM agentloop_test_effects WHERE label = $1", &[&label]).await.unwrap().get(0)
    };
    let deadline = Instant::now() + T;
    while count("completed").await + count("failed").await + count("retry").await < 3 {
        assert!(Instant::now() < deadline, "the effects did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stack.workers[0].signal(Sig::SIGKILL);
    assert!(stack.workers[0].wait_exit(Duration::from_secs(5)));
    stack.add_worker(&[]).unwrap();
    for (_, _, run) in &runs {
        let blocked = wait_status(&c, run, "blocked").await;
        assert_eq!(blocked["error"]["code"], "operation_uncertain", "{blocked}");
        assert_eq!(blocked["blocker"]["operations"][0]["status"], "uncertain", "{blocked}");
    }
    for label in ["completed", "failed", "retry"] {
        assert_eq!(count(label).await, 1, "no automatic retry of {label}");
    }
    // Blocked is an active state: the thread refuses a new message with the default policy.
    let r = c.post(&format!("/api/threads/{}/chat", runs[0].1), json!({"content": "hi"})).await.unwrap();
    assert_eq!(r.status, 409, "{r:?}");

    for (label, thread, run) in &runs {
        let ops = c.get(&format!("/api/runs/{run}/operations")).await.unwrap().body;
        let op = &ops["operations"][0];
        assert_eq!(op["status"], "uncertain", "{ops}");
        assert_eq!(op["dispatches"], 1);
        let key = op["key"].as_str().unwrap().to_owned();
        assert!(key.starts_with(&format!("run:{run}:call:")), "{key}");
        let url = format!("/api/runs/{run}/operations/{}/resolve", key.replace(':', "%3A"));
        let stale = c.post(&url, json!({"outcome": *label, "runUpdatedAt": "2000-01-01T00:00:00Z"})).await.unwrap();
        assert_eq!(stale.status, 409, "{stale:?}");
        assert_eq!(stale.body["error"]["code"], "stale_resolve");
        let body = match *label {
            "completed" => json!({"outcome": "completed", "result": "done by hand", "runUpdatedAt": ops["run"]["updatedAt"]}),
            other => json!({"outcome": other}),
        };
        let r = c.post(&url, body).await.unwrap();
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.body["run"]["status"], "queued", "the same run continues");
        let again = c.post(&url, json!({"outcome": "failed"})).await.unwrap();
        assert_eq!(again.status, 409, "a second resolve is stale: {again:?}");
        let done = c.wait_terminal(run, T).await.unwrap();
        assert_eq!(done["status"], "completed", "{done}");
        let msgs = messages(&c, thread).await;
        let results: Vec<&Value> = msgs.iter().filter(|m| m["role"] == "tool").collect();
        assert_eq!(results.len(), 1, "{msgs:?}");
        let result = results[0]["content"].as_str().unwrap();
        let last = msgs.last().unwrap()["content"].as_str().unwrap();
        match *label {
            "completed" => {
                assert_eq!(result, "done by hand");
                assert_eq!(count("completed").await, 1);
            }
            "failed" => {
                assert!(result.starts_with("failed"), "{result}");
                assert_eq!(count("failed").await, 1);
            }
            _ => {
                assert_eq!(result, "recorded retry", "retried under the same key");
                assert_eq!(count("retry").await, 2, "retry runs the effect again, once");
            }
        }
        assert_eq!(last, format!("final: {result}"));
        let op = &c.get(&format!("/api/runs/{run}/operations")).await.unwrap().body["operations"][0];
        assert_eq!(op["resolution"], *label);
    }
    let keys: Vec<String> = db
        .query("SELECT DISTINCT key FROM agentloop_test_effects WHERE label = 'retry'", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(keys.len(), 1, "the retry reused the operation's key: {keys:?}");
}

/// The test MCP server over streamable HTTP, killed on drop.
struct McpServer {
    url: String,
    proc: Proc,
}

fn start_mcp_server() -> McpServer {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(bin_dir().join("mcp-test-server"))
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let url = line.trim().strip_prefix("MCP_TEST_URL=").unwrap().to_owned();
    McpServer { url, proc: Proc { name: "mcp-test-server".into(), child } }
}

#[tokio::test]
async fn tools_mcp_and_http_tools_are_discovered_called_and_a_down_server_is_a_tool_error() {
    let mut mcp = start_mcp_server();
    let down = format!("http://127.0.0.1:{}/mcp", free_port());
    let tools = json!({
        "mcpServers": [
            {"name": "web", "transport": "http", "url": format!("{}/mcp", mcp.url)},
            {"name": "local", "transport": "stdio", "command": bin_dir().join("mcp-test-server").display().to_string(), "args": ["--stdio"]},
            {"name": "down", "transport": "http", "url": down, "connectTimeoutMs": 2000}
        ],
        "httpTools": [{"name": "notify", "description": "Notify someone.", "url": format!("{}/http-tool", mcp.url),
                       "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}]
    });
    let stack = start("mcp_tools", tools, &[]).await;
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let steps = json!([
        {"toolCalls": [
            {"name": "web__echo", "arguments": {"text": "hi"}},
            {"name": "local__add", "arguments": {"a": 2, "b": 3}},
            {"name": "down__echo", "arguments": {"text": "x"}},
            {"name": "web__ticket", "arguments": {"title": "T1"}},
            {"name": "notify", "arguments": {"text": "n"}},
            {"name": "web__echo", "arguments": {"text": 7}}
        ]},
        {"text": "done"}
    ]);
    let run_id = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    // Discovery: the tools were offered with their schemas.
    let sent = stack.mock.requests().await.unwrap();
    let offered: Vec<&Value> = sent[0]["tools"].as_array().unwrap().iter().collect();
    let names: Vec<&str> = offered.iter().map(|t| t["function"]["name"].as_str().unwrap()).collect();
    for name in ["calculator", "web__echo", "web__add", "web__ticket", "local__echo", "local__add", "notify"] {
        assert!(names.contains(&name), "{name} offered: {names:?}");
    }
    assert!(!names.iter().any(|n| n.starts_with("down__")));
    let echo = offered.iter().find(|t| t["function"]["name"] == "web__echo").unwrap();
    assert_eq!(echo["function"]["parameters"]["required"], json!(["text"]));
    // Results, in call order.
    let msgs = messages(&c, &thread).await;
    let calls = msgs[1]["toolCalls"].as_array().unwrap().clone();
    let result = |i: usize| msgs.iter().find(|m| m["toolCallId"] == calls[i]["id"]).unwrap()["content"].as_str().unwrap().to_owned();
    assert_eq!(result(0), "echo: hi");
    assert_eq!(result(1), "5");
    assert!(result(2).starts_with("MCP server `down` is unavailable"), "{}", result(2));
    assert_eq!(result(3), "ticket #1 created: T1");
    assert_eq!(result(4), "ok: {\"text\":\"n\"}");
    assert!(result(5).contains("must be of type string"), "arguments are validated before the call: {}", result(5));
    // Idempotency keys: MCP `_meta.idempotencyKey` and the HTTP tool's `Idempotency-Key`.
    let seen: Vec<Value> = reqwest::get(format!("{}/calls", mcp.url)).await.unwrap().json().await.unwrap();
    let key_of = |tool: &str| seen.iter().find(|c| c["tool"] == tool).unwrap()["idempotencyKey"].clone();
    assert_eq!(key_of("ticket"), format!("run:{run_id}:call:{}", calls[3]["id"].as_str().unwrap()));
    assert_eq!(key_of("http-tool"), format!("run:{run_id}:call:{}", calls[4]["id"].as_str().unwrap()));
    assert_eq!(seen.iter().filter(|c| c["tool"] == "echo").count(), 1, "the invalid call never reached the server");
    // The ledger holds the non-idempotent calls only (read-only MCP tools skip it).
    let ops = c.get(&format!("/api/runs/{run_id}/operations")).await.unwrap().body;
    let mut ledger: Vec<&str> = ops["operations"].as_array().unwrap().iter().map(|o| o["toolName"].as_str().unwrap()).collect();
    ledger.sort();
    assert_eq!(ledger, ["notify", "web__ticket"], "{ops}");
    assert!(ops["operations"].as_array().unwrap().iter().all(|o| o["status"] == "completed"));

    // The server goes away: the next call is a clear tool error, not a failed run.
    mcp.proc.signal(Sig::SIGKILL);
    mcp.proc.wait_exit(Duration::from_secs(5));
    let thread = c.create_thread().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "web__echo", "arguments": {"text": "again"}}]}, {"text": "{{tool_result}}"}]);
    let run_id = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    let msgs = messages(&c, &thread).await;
    let error = msgs[2]["content"].as_str().unwrap();
    assert!(error.contains("MCP server `web`"), "{error}");
}

/// Whether `cmd arg` runs successfully.
fn works(cmd: &str, arg: &str) -> bool {
    Command::new(cmd).arg(arg).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// A thread of the loopback principal whose run is `blocked` on an uncertain `record_effect`
/// operation (as a SIGKILL during the effect leaves it), seeded with SQL. Its user message
/// scripts the mock's answer once the run continues: `final: <the call's result>`.
async fn seed_blocked_thread(db: &tokio_postgres::Client) -> uuid::Uuid {
    let owner: uuid::Uuid = db.query_one("SELECT id FROM principals WHERE name = 'local'", &[]).await.unwrap().get(0);
    let (thread, run) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let key = format!("run:{run}:call:call_seed");
    let user = script(json!([
        {"toolCalls": [{"name": "record_effect", "arguments": {"label": "seed"}}]},
        {"text": "final: {{tool_result}}"}
    ]));
    let calls = json!([{"id": "call_seed", "type": "function", "function": {"name": "record_effect", "arguments": "{\"label\":\"seed\"}"}}]);
    let message = format!(
        "the outcome of record_effect ({key}) is unknown (the worker stopped after dispatching it); resolve it as completed, failed or retry"
    );
    db.batch_execute("BEGIN").await.unwrap();
    db.execute(
        "INSERT INTO threads (id, owner_id, title, message_count, last_sequence, last_timestamp_ms) VALUES ($1, $2, 'blocked run', 2, 2, 1700000000002)",
        &[&thread, &owner],
    )
    .await
    .unwrap();
    db.execute(
        "INSERT INTO runs (id, thread_id, principal_id, status, model, steps_used, attempts, lease_epoch, error_code, error_message, started_at)
         VALUES ($1, $2, $3, 'blocked', 'mock', 1, 1, 1, 'operation_uncertain', $4, now())",
        &[&run, &thread, &owner, &message],
    )
    .await
    .unwrap();
    db.execute(
        "INSERT INTO messages (thread_id, sequence, timestamp_ms, role, content, run_id) VALUES ($1, 1, 1700000000001, 'user', to_jsonb($2::text), NULL)",
        &[&thread, &user],
    )
    .await
    .unwrap();
    db.execute(
        "INSERT INTO messages (thread_id, sequence, timestamp_ms, role, content, tool_calls, run_id) VALUES ($1, 2, 1700000000002, 'assistant', '\"\"'::jsonb, ($2::text)::jsonb, $3)",
        &[&thread, &calls.to_string(), &run],
    )
    .await
    .unwrap();
    db.execute(
        "INSERT INTO operations (key, run_id, thread_id, tool_call_id, tool_name, arguments, status, dispatches, lease_epoch, dispatched_at)
         VALUES ($1, $2, $3, 'call_seed', 'record_effect', '{\"label\":\"seed\"}', 'uncertain', 1, 1, now())",
        &[&key, &run, &thread],
    )
    .await
    .unwrap();
    db.batch_execute("COMMIT").await.unwrap();
    thread
}

/// The web UI's approval panel (edit + approve, reject with a reason) and a blocked run's
/// resolve buttons, in headless Chromium (`tests/browser/tools.spec.mjs`). Skipped, like the
/// other browser tests, when node/npm/Chromium are missing — unless `CI` is set.
#[tokio::test]
async fn tools_web_ui_approvals_and_blocked_runs() {
    const CHROMIUM: &str = "/usr/bin/chromium";
    let missing: Vec<&str> = [("node", works("node", "--version")), ("npm", works("npm", "--version")), (CHROMIUM, std::path::Path::new(CHROMIUM).exists())]
        .into_iter()
        .filter(|(_, ok)| !ok)
        .map(|(name, _)| name)
        .collect();
    if !missing.is_empty() {
        assert!(std::env::var_os("CI").is_none(), "browser tests: missing {missing:?} (CI is set)");
        println!("SKIPPED tools browser test: missing {missing:?}");
        return;
    }
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("browser");
    if !dir.join("node_modules/playwright-core/package.json").exists() {
        let status = Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund"])
            .current_dir(&dir)
            .env("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
            .status()
            .unwrap();
        assert!(status.success(), "npm ci in tests/browser failed");
    }
    let options = StackOptions {
        api_env: vec![("DEV_LOOPBACK_PRINCIPAL".into(), "true".into())],
        worker_env: tools_env("tools_browser", json!({"tools": {"calculator": {"policy": "ask"}}}), &[("AGENTLOOP_TEST_TOOLS", "1")]),
        ..Default::default()
    };
    let stack = Stack::start("tools_browser", options).await.unwrap();
    let db = stack.db.client().await.unwrap();
    let blocked = seed_blocked_thread(&db).await;
    let out_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../test-output/browser");
    std::fs::create_dir_all(&out_dir).unwrap();
    let child = tokio::process::Command::new("node")
        .arg("tools.spec.mjs")
        .current_dir(&dir)
        .env("API_URL", &stack.api_url)
        .env("BLOCKED_THREAD_ID", blocked.to_string())
        .env("OUT_DIR", &out_dir)
        .env("CHROMIUM", CHROMIUM)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let output = tokio::time::timeout(Duration::from_secs(180), child.wait_with_output())
        .await
        .expect("the tools browser tests did not finish within 180 s")
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let _ = std::fs::write(out_dir.join("tools-run.log"), format!("{stdout}\n--- stderr ---\n{stderr}"));
    println!("{stdout}");
    assert!(output.status.success(), "tools browser tests failed; see test-output/browser/tools-run.log:\n{stdout}\n{stderr}");
    let run: String = db.query_one("SELECT status FROM runs r JOIN threads t ON t.id = r.thread_id WHERE t.id = $1", &[&blocked]).await.unwrap().get(0);
    assert_eq!(run, "completed");
}

/// An edit or a regenerate that would replace tool calls which took effect asks first (409
/// `effects_in_branch`, migration 000037), and goes ahead with `repeatEffects: true`; one that
/// replaces only later text does not ask (acceptance probe F: regenerating a `pay` call's
/// message, or fixing a typo in the turn before it, paid again without a word).
#[tokio::test]
async fn tools_replacing_calls_that_took_effect_asks_first() {
    let stack = start("effects_in_branch", json!({"tools": {}}), &[("AGENTLOOP_TEST_TOOLS", "1")]).await;
    let c = stack.client();
    let db = stack.db.client().await.unwrap();
    let thread = c.create_thread().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": "paid"}}]}, {"text": "done"}]);
    let run_id = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    assert_eq!(c.wait_terminal(&run_id, T).await.unwrap()["status"], "completed");
    let before = messages(&c, &thread).await;
    let roles: Vec<&str> = before.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"]);
    let seq = |i: usize| before[i]["sequence"].as_i64().unwrap();
    for (path, body) in [
        (format!("/api/threads/{thread}/messages/{}/regenerate", seq(1)), json!({})),
        (format!("/api/threads/{thread}/messages/{}/regenerate", seq(2)), json!({})),
        (format!("/api/threads/{thread}/messages/{}/regenerate", seq(0)), json!({})),
        (format!("/api/threads/{thread}/messages/{}/edit", seq(0)), json!({"content": "typo fixed"})),
    ] {
        let r = c.post(&path, body).await.unwrap();
        assert_eq!((r.status, r.body["error"]["code"].as_str()), (409, Some("effects_in_branch")), "{path}: {r:?}");
        assert!(r.body["error"]["message"].as_str().unwrap().contains("record_effect"), "{r:?}");
    }
    // Deleting the call's group (from its call or its result) would take it out of the model's
    // view just the same (acceptance probe G: delete, then regenerate, paid again).
    for i in [1, 2] {
        let r = c.send(reqwest::Method::DELETE, &format!("/api/threads/{thread}/messages/{}", seq(i)), None, &[]).await.unwrap();
        assert_eq!((r.status, r.body["error"]["code"].as_str()), (409, Some("effects_in_branch")), "delete {i}: {r:?}");
    }
    assert_eq!(messages(&c, &thread).await, before, "a refused command changed the thread");
    let runs: i64 = db.query_one("SELECT count(*) FROM runs", &[]).await.unwrap().get(0);
    assert_eq!(runs, 1, "a refused command enqueued a run");
    // Only the final text: nothing that took effect is replaced.
    let r = c.post(&format!("/api/threads/{thread}/messages/{}/regenerate", seq(3)), json!({})).await.unwrap();
    assert_eq!(r.status, 202, "{r:?}");
    c.wait_terminal(r.body["run"]["id"].as_str().unwrap(), T).await.unwrap();
    // Asked and confirmed: the delete goes ahead; what it took out no longer asks again.
    let r = c.send(reqwest::Method::DELETE, &format!("/api/threads/{thread}/messages/{}?repeatEffects=true", seq(1)), None, &[]).await.unwrap();
    assert_eq!((r.status, r.body["deactivated"].clone()), (200, json!([seq(1), seq(2)])), "{r:?}");
    let r = c.post(&format!("/api/threads/{thread}/messages/{}/edit", seq(0)), json!({"content": "typo fixed"})).await.unwrap();
    assert_eq!(r.status, 202, "{r:?}");
    c.wait_terminal(r.body["run"]["id"].as_str().unwrap(), T).await.unwrap();
    // And an edit confirmed with repeatEffects.
    let thread = c.create_thread().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": "again"}}]}, {"text": "done"}]);
    let run_id = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    c.wait_terminal(&run_id, T).await.unwrap();
    let first = messages(&c, &thread).await[0]["sequence"].as_i64().unwrap();
    let r = c.post(&format!("/api/threads/{thread}/messages/{first}/edit"), json!({"content": "typo fixed", "repeatEffects": true})).await.unwrap();
    assert_eq!(r.status, 202, "{r:?}");
    let edited = r.body["message"]["sequence"].as_i64().unwrap();
    c.wait_terminal(r.body["run"]["id"].as_str().unwrap(), T).await.unwrap();
    // Branch switches: back to the version with the call (nothing that took effect leaves the
    // view), then away from it again — that asks.
    let activate = |at: i64, to: i64, confirm: bool| {
        let mut body = json!({"firstSequence": to});
        if confirm {
            body["repeatEffects"] = json!(true);
        }
        let (c, path) = (&c, format!("/api/threads/{thread}/messages/{at}/branches/activate"));
        async move { c.post(&path, body).await }
    };
    let r = activate(edited, first, false).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    let r = activate(first, edited, false).await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (409, Some("effects_in_branch")), "{r:?}");
    let r = activate(first, edited, true).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
}

/// Editing or regenerating a message that does not exist is 404 even while a run is active (it
/// was 409 `run_active`: the client learnt about the wrong problem first — acceptance probe F).
#[tokio::test]
async fn tools_a_missing_message_is_not_found_before_a_busy_thread() {
    let stack = Stack::start("missing_message_busy", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    c.chat(&thread, "waits in the queue").await.unwrap();
    for (path, body) in [
        (format!("/api/threads/{thread}/messages/999/edit"), json!({"content": "x"})),
        (format!("/api/threads/{thread}/messages/999/regenerate"), json!({})),
    ] {
        let r = c.post(&path, body).await.unwrap();
        assert_eq!(r.status, 404, "{path}: {r:?}");
    }
    let r = c.post(&format!("/api/threads/{thread}/messages/1/edit"), json!({"content": "x"})).await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (409, Some("run_active")), "{r:?}");
}

/// Workers with different tools files apply the strictest policy of the live fleet (migration
/// 000039; acceptance probe E: a worker started with a laxer `TOOLS_FILE` ran a payment without
/// the approval every other worker asked for). A worker whose file says `auto` asks while a
/// worker whose file says `ask` lives (here one serving another model, so the lax one runs every
/// call), and runs without asking once that worker has gone.
#[tokio::test]
async fn tools_a_worker_with_a_laxer_tools_file_asks_while_a_stricter_one_lives() {
    // Periods differ: the strict worker publishes every 10 s, the lax one every 0.3 s (its rows
    // live 1.2 s); a live worker's row lives by its own period (verification probe I).
    let refresh = ("FLEET_POLICY_REFRESH_MS", "10000");
    let strict = tools_env(
        "fleet_strict",
        json!({"tools": {"record_effect": {"policy": "ask"}}}),
        &[("AGENTLOOP_TEST_TOOLS", "1"), ("MODEL_NAME", "elsewhere"), refresh],
    );
    let lax = tools_env("fleet_lax", json!({"tools": {"record_effect": {"policy": "auto"}}}), &[]);
    let mut stack = Stack::start("fleet_policy", StackOptions { worker_env: strict, ..Default::default() }).await.unwrap();
    let db = stack.db.client().await.unwrap();
    let published = |n: i64| {
        let db = &db;
        async move {
            let deadline = Instant::now() + T;
            loop {
                let count: i64 = db.query_one("SELECT count(*) FROM worker_tool_policies", &[]).await.unwrap().get(0);
                if count == n {
                    return;
                }
                assert!(Instant::now() < deadline, "{count} policies published, not {n}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    published(1).await;
    stack.add_worker(&[("TOOLS_FILE", lax[0].1.as_str()), ("MODEL_NAME", "mock"), ("FLEET_POLICY_REFRESH_MS", "300")]).unwrap();
    published(2).await;
    // Past the lax worker's own time to live: the strict worker's row must still count.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    published(2).await;
    let c = stack.client();
    let effects = |label: &'static str| {
        let db = &db;
        async move { db.query_one("SELECT count(*) FROM agentloop_test_effects WHERE label = $1", &[&label]).await.unwrap().get::<_, i64>(0) }
    };

    let thread = c.create_thread().await.unwrap();
    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": "strict"}}]}, {"text": "{{tool_result}}"}]);
    let run_id = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    let waiting = wait_status(&c, &run_id, "waiting_approval").await;
    assert!(waiting["approvals"].as_array().is_some_and(|a| a.len() == 1), "{waiting}");
    assert_eq!(effects("strict").await, 0, "nothing ran before the approval");
    let approval = &pending(&c, &thread).await[0];
    let r = c.post(&format!("/api/approvals/{}/approve", id(approval)), json!({})).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(effects("strict").await, 1);

    // The strict worker leaves: the fleet is the lax worker alone, whose file now decides.
    stack.workers[0].signal(Sig::SIGTERM);
    assert!(stack.workers[0].wait_exit(Duration::from_secs(30)), "the strict worker stops");
    published(1).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let steps = json!([{"toolCalls": [{"name": "record_effect", "arguments": {"label": "lax"}}]}, {"text": "{{tool_result}}"}]);
    let run_id = c.chat(&thread, &script(steps)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    let run = c.wait_terminal(&run_id, T).await.unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(effects("lax").await, 1);
}
