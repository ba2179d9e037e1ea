//! MCP sign-in blockers (issue 12 part 5; docs/architecture.md §15), black-box: real api and
//! worker processes, real PostgreSQL, the test MCP server in `--oauth` mode (an OAuth-protected
//! MCP resource plus its own authorization server: RFC 9728 + RFC 8414 metadata, `/authorize`
//! redirecting to the api's callback with code + state, `/token` verifying PKCE S256).
//!
//! A "user signing in" is this test following the sign-in URL: GET the authorize URL (adding
//! `user=NAME`, the test server's stand-in for a login form), take the `Location` (the api's
//! callback with `code` and `state`) and GET it as the principal (the redirect is followed by
//! hand because HTTP clients drop `Authorization` on a redirect to another port).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use agentloop_tests::{Client, Proc, Stack, StackOptions, bin_dir, script};
use base64::Engine;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(30);

/// The test MCP server with `--oauth`, killed on drop.
struct OAuthMcp {
    url: String,
    as_url: String,
    _proc: Proc,
}

fn start_oauth_mcp() -> OAuthMcp {
    start_oauth_mcp_with(&[])
}

/// [`start_oauth_mcp`] with more server arguments.
fn start_oauth_mcp_with(extra: &[&str]) -> OAuthMcp {
    let mut child = Command::new(bin_dir().join("mcp-test-server"))
        .args(["--listen", "127.0.0.1:0", "--oauth"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let url = line.trim().strip_prefix("MCP_TEST_URL=").unwrap().to_owned();
    line.clear();
    out.read_line(&mut line).unwrap();
    let as_url = line.trim().strip_prefix("OAUTH_AS_URL=").unwrap().to_owned();
    OAuthMcp { url, as_url, _proc: Proc { name: "mcp-test-server".into(), child } }
}

/// A stack whose worker knows the `vault` MCP server (`auth: oauth`) and the api's callback.
async fn start(test: &str, mcp: &OAuthMcp) -> Stack {
    start_with(test, mcp, &[]).await
}

/// [`start`] with more worker settings.
async fn start_with(test: &str, mcp: &OAuthMcp, worker_extra: &[(&str, &str)]) -> Stack {
    let key = base64::engine::general_purpose::STANDARD.encode([42u8; 32]);
    let tools = json!({"mcpServers": [{"name": "vault", "transport": "http", "url": format!("{}/mcp", mcp.url),
                                       "auth": {"type": "oauth", "clientId": "agentloop-test"}}]});
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../test-output").join(test);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tools.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&tools).unwrap()).unwrap();
    let options = StackOptions {
        workers: 0,
        api_env: vec![
            ("OAUTH_TOKENS_KEY".into(), key.clone()),
            ("WEBHOOK_SECRETS_KEY".into(), key.clone()),
            ("WEBHOOK_ALLOW_PRIVATE_TARGETS".into(), "true".into()),
        ],
        worker_env: vec![("TOOLS_FILE".into(), path.display().to_string()), ("OAUTH_TOKENS_KEY".into(), key)],
        ..Default::default()
    };
    let mut stack = Stack::start(test, options).await.unwrap();
    let callback = format!("{}/api/oauth/callback", stack.api_url);
    let mut worker_env = vec![("OAUTH_REDIRECT_URL", callback.as_str())];
    worker_env.extend_from_slice(worker_extra);
    stack.add_worker(&worker_env).unwrap();
    stack
}

fn note_script(text: &str) -> String {
    script(json!([
        {"toolCalls": [{"name": "vault__note", "arguments": {"text": text}}]},
        {"text": "done: {{tool_result}}"}
    ]))
}

async fn chat(c: &Client, text: &str) -> (String, String) {
    let thread = c.create_thread().await.unwrap();
    let run = c.chat(&thread, &note_script(text)).await.unwrap()["run"]["id"].as_str().unwrap().to_owned();
    (thread, run)
}

async fn waiting(c: &Client, run: &str) -> Value {
    c.wait_run(run, T, |r| r["status"] == "waiting_authorization").await.unwrap()
}

/// The user `user` opens the sign-in URL: the authorization server redirects to the api's
/// callback. Returns the callback path with its query (`/api/oauth/callback?code&state`).
async fn sign_in(url: &str, user: &str) -> String {
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let resp = http.get(format!("{url}&user={user}")).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 302, "the authorization server redirects to the callback");
    let location = reqwest::Url::parse(resp.headers()["location"].to_str().unwrap()).unwrap();
    assert_eq!(location.path(), "/api/oauth/callback");
    format!("{}?{}", location.path(), location.query().unwrap())
}

async fn get_json(url: String) -> Value {
    reqwest::get(url).await.unwrap().json().await.unwrap()
}

async fn final_text(c: &Client, thread: &str) -> String {
    let r = c.get(&format!("/api/threads/{thread}")).await.unwrap();
    r.body["messages"].as_array().unwrap().last().unwrap()["content"].as_str().unwrap().to_owned()
}

/// The first `authorization` event of the thread's SSE stream (from the start of the journal).
async fn sse_authorization_event(stack: &Stack, thread: &str) -> Value {
    let resp = reqwest::Client::new()
        .get(format!("{}/api/threads/{thread}/updates/stream?afterSequence=0", stack.api_url))
        .bearer_auth(&stack.key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut events = resp.bytes_stream().eventsource();
    let found = tokio::time::timeout(T, async {
        while let Some(Ok(e)) = events.next().await {
            if e.event == "authorization" {
                return serde_json::from_str::<Value>(&e.data).unwrap();
            }
        }
        panic!("the stream ended without an authorization event");
    })
    .await
    .expect("an authorization event on SSE");
    found
}

#[tokio::test]
async fn signin_parks_the_run_then_resumes_it_with_the_token_and_claims_the_authorization_once() {
    let mcp = start_oauth_mcp();
    let stack = start("mcp_signin_main", &mcp).await;
    let c = stack.client();
    // A webhook subscribed to run.waiting_authorization (its outbox row is the proof; nothing
    // listens at the URL).
    let hook = c.post("/api/webhooks", json!({"url": "http://127.0.0.1:9/hook", "events": ["run.waiting_authorization"]})).await.unwrap();
    assert_eq!(hook.status, 201, "{hook:?}");
    let (thread, run) = chat(&c, "hello").await;

    // The protected call parks the run: lease released, an authorization with a sign-in URL.
    let parked = waiting(&c, &run).await;
    let db = stack.db.client().await.unwrap();
    let run_uuid = uuid::Uuid::parse_str(&run).unwrap();
    let outbox: i64 = db
        .query_one("SELECT count(*) FROM webhook_deliveries WHERE run_id = $1 AND event_type = 'run.waiting_authorization'", &[&run_uuid])
        .await
        .unwrap()
        .get(0);
    assert_eq!(outbox, 1, "one run.waiting_authorization delivery in the outbox");
    assert_eq!(parked["leaseOwner"], Value::Null, "the lease is released while waiting: {parked}");
    let authorization = parked["authorization"].clone();
    assert_eq!(authorization["status"], "pending", "{parked}");
    assert_eq!(authorization["server"], "vault");
    let url = authorization["url"].as_str().unwrap().to_owned();
    assert!(url.starts_with(&format!("{}/authorize?", mcp.as_url)), "{url}");
    for param in ["code_challenge_method=S256", "client_id=agentloop-test", "response_type=code", "state=", "code_challenge="] {
        assert!(url.contains(param), "{param} in {url}");
    }
    // The journal has it: SSE and long-poll.
    let event = sse_authorization_event(&stack, &thread).await;
    assert_eq!(event["id"], authorization["id"]);
    assert_eq!(event["url"], authorization["url"]);
    let polled = c.get(&format!("/api/threads/{thread}/updates?afterSequence=0&timeoutMs=0")).await.unwrap();
    assert!(polled.body["events"].as_array().unwrap().iter().any(|e| e["kind"] == "authorization"), "{:?}", polled.body);
    // The refused call had no effect; it reached the server without a token, under its key.
    let denied = get_json(format!("{}/denied", mcp.url)).await;
    assert_eq!(denied.as_array().unwrap().len(), 1, "{denied}");
    assert_eq!(denied[0]["hadToken"], false);
    let calls = c.get(&format!("/api/threads/{thread}")).await.unwrap().body["messages"].as_array().unwrap().clone();
    let call_id = calls[1]["toolCalls"][0]["id"].as_str().unwrap().to_owned();
    let key = format!("run:{run}:call:{call_id}");
    assert_eq!(denied[0]["idempotencyKey"], key.as_str());
    // The ledger row went back to `prepared`: nothing is uncertain.
    let ops = c.get(&format!("/api/runs/{run}/operations")).await.unwrap().body;
    assert!(ops["operations"].as_array().unwrap().iter().all(|o| o["status"] == "prepared"), "{ops}");

    // The user follows the link; another principal cannot use the callback (its state is bound
    // to the first principal), and doing so does not consume it.
    let callback = sign_in(&url, "alice").await;
    let intruder = stack.client_for("intruder").unwrap();
    let r = intruder.get(&callback).await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (404, Some("not_found")), "{r:?}");
    let anonymous = Client { key: None, ..c.clone() };
    let r = anonymous.get(&callback).await.unwrap();
    assert_eq!(r.status, 401, "the callback needs the principal's session: {r:?}");
    let r = c.get(&callback).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    let signed_in = r.body.clone();
    assert_eq!(r.body["authorization"]["status"], "completed");
    assert_eq!(r.body["authorization"]["url"], Value::Null, "a used link is not shown again");
    // State replay is refused.
    let r = c.get(&callback).await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (409, Some("authorization_used")), "{r:?}");

    // The same run resumes and completes with the token; the server saw one authorized call.
    let done = c.wait_terminal(&run, T).await.unwrap();
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(final_text(&c, &thread).await, "done: note for alice: hello");
    let seen = get_json(format!("{}/calls", mcp.url)).await;
    let notes: Vec<&Value> = seen.as_array().unwrap().iter().filter(|c| c["tool"] == "note").collect();
    assert_eq!(notes.len(), 1, "exactly one authorized call: {seen}");
    assert_eq!(notes[0]["user"], "alice");
    assert_eq!(notes[0]["idempotencyKey"], key.as_str(), "the retry used the same operation key");
    let detail = c.get(&format!("/api/runs/{run}")).await.unwrap().body;
    let auths = detail["authorizations"].as_array().unwrap();
    assert_eq!(auths.len(), 1, "{detail}");
    assert_eq!(auths[0]["status"], "claimed", "the retry claimed the authorization: {detail}");
    assert!(auths[0]["claimedAt"].is_string());
    let ops = c.get(&format!("/api/runs/{run}/operations")).await.unwrap().body;
    assert_eq!(ops["operations"][0]["status"], "completed", "{ops}");
    // The round trip, for the record (the code in the callback URL is not kept).
    let redacted = callback.split('&').map(|p| if p.starts_with("code=") || p.contains("?code=") { p.split('=').next().unwrap().to_owned() + "=…" } else { p.to_owned() }).collect::<Vec<_>>().join("&");
    let record = json!([
        {"step": "run parked", "status": parked["status"], "authorization": parked["authorization"]},
        {"step": "SSE authorization event", "event": event},
        {"step": "authorization server redirects to", "location": redacted},
        {"step": "callback answered", "body": signed_in},
        {"step": "run ended", "status": done["status"], "authorizations": detail["authorizations"]},
        {"step": "tool server saw", "calls": notes},
    ]);
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../test-output/mcp_signin_main");
    std::fs::write(dir.join("signin-round-trip.json"), serde_json::to_vec_pretty(&record).unwrap()).unwrap();

    // The token is stored encrypted, once, for this principal and server only.
    let db = stack.db.client().await.unwrap();
    let rows = db.query("SELECT p.name, t.server, t.access_token FROM mcp_tokens t JOIN principals p ON p.id = t.principal_id", &[]).await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].get::<_, String>(0), rows[0].get::<_, String>(1)), ("tester".to_owned(), "vault".to_owned()));
    let stored: String = rows[0].get(2);
    assert!(stored.starts_with("v1:") && !stored.contains("tok_"), "sealed at rest: {stored}");
    let verifier: String = db.query_one("SELECT code_verifier FROM mcp_authorizations", &[]).await.unwrap().get(0);
    assert!(verifier.starts_with("v1:"), "the PKCE verifier is sealed too");

    // A second run of the same principal uses the stored token without asking.
    let (thread2, run2) = chat(&c, "again").await;
    let done = c.wait_terminal(&run2, T).await.unwrap();
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(final_text(&c, &thread2).await, "done: note for alice: again");
    assert!(done.get("authorizations").is_none(), "no sign-in needed: {done}");
}

#[tokio::test]
async fn signin_is_per_principal_and_expired_or_revoked_tokens_ask_again() {
    let mcp = start_oauth_mcp();
    let stack = start("mcp_signin_scope", &mcp).await;
    let alice = stack.client();
    let bob = stack.client_for("bob").unwrap();
    let http = reqwest::Client::new();

    // Alice signs in.
    let (thread, run) = chat(&alice, "a1").await;
    let url = waiting(&alice, &run).await["authorization"]["url"].as_str().unwrap().to_owned();
    let r = alice.get(&sign_in(&url, "alice").await).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(alice.wait_terminal(&run, T).await.unwrap()["status"], "completed");
    assert_eq!(final_text(&alice, &thread).await, "done: note for alice: a1");

    // Bob's run gets its own authorization: Alice's token is never used for him.
    let (bthread, brun) = chat(&bob, "b1").await;
    let bwait = waiting(&bob, &brun).await;
    let burl = bwait["authorization"]["url"].as_str().unwrap().to_owned();
    // Bob's state is refused to Alice (and stays usable by Bob).
    let bcallback = sign_in(&burl, "bob").await;
    let r = alice.get(&bcallback).await.unwrap();
    assert_eq!(r.status, 404, "{r:?}");
    let r = bob.get(&bcallback).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(bob.wait_terminal(&brun, T).await.unwrap()["status"], "completed");
    assert_eq!(final_text(&bob, &bthread).await, "done: note for bob: b1");

    // A waiting_authorization run is cancelled at once, like a waiting_approval one; its
    // sign-in is cancelled with it, and the thread takes a new turn.
    let carol = stack.client_for("carol").unwrap();
    let (cthread, crun) = chat(&carol, "c1").await;
    let cwait = waiting(&carol, &crun).await;
    let curl = cwait["authorization"]["url"].as_str().unwrap().to_owned();
    let r = carol.post(&format!("/api/runs/{crun}/cancel"), json!({})).await.unwrap();
    assert_eq!((r.status, r.body["status"].as_str()), (200, Some("cancelled")), "{r:?}");
    let detail = carol.get(&format!("/api/runs/{crun}")).await.unwrap().body;
    assert_eq!(detail["authorizations"][0]["status"], "cancelled", "{detail}");
    let r = carol.get(&sign_in(&curl, "carol").await).await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (409, Some("authorization_used")), "a cancelled sign-in cannot complete: {r:?}");
    let next = carol.post(&format!("/api/threads/{cthread}/chat"), json!({"content": "hi"})).await.unwrap();
    assert_eq!(next.status, 202, "{next:?}");

    // Revocation: the server no longer accepts Alice's token. Her next call is refused WITH a
    // token: the token is discarded and a new sign-in asked for.
    http.post(format!("{}/admin/revoke", mcp.as_url)).send().await.unwrap().error_for_status().unwrap();
    let (thread, run) = chat(&alice, "a2").await;
    let url = waiting(&alice, &run).await["authorization"]["url"].as_str().unwrap().to_owned();
    let denied = get_json(format!("{}/denied", mcp.url)).await;
    assert_eq!(denied.as_array().unwrap().last().unwrap()["hadToken"], true, "{denied}");
    let db = stack.db.client().await.unwrap();
    let alice_tokens = "SELECT count(*) FROM mcp_tokens t JOIN principals p ON p.id = t.principal_id WHERE p.name = 'tester'";
    assert_eq!(db.query_one(alice_tokens, &[]).await.unwrap().get::<_, i64>(0), 0, "the refused token was discarded");
    let bob_tokens = "SELECT count(*) FROM mcp_tokens t JOIN principals p ON p.id = t.principal_id WHERE p.name = 'bob'";
    assert_eq!(db.query_one(bob_tokens, &[]).await.unwrap().get::<_, i64>(0), 1, "only Alice's token went");
    // She signs in again; tokens issued now live 3 s.
    http.post(format!("{}/admin/ttl?secs=3", mcp.as_url)).send().await.unwrap().error_for_status().unwrap();
    let r = alice.get(&sign_in(&url, "alice").await).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(alice.wait_terminal(&run, T).await.unwrap()["status"], "completed");
    assert_eq!(final_text(&alice, &thread).await, "done: note for alice: a2");
    let detail = alice.get(&format!("/api/runs/{run}")).await.unwrap().body;
    assert_eq!(detail["authorizations"][0]["status"], "claimed", "{detail}");

    // Expiry: once the token's lifetime has passed, agentloop drops it and asks again (the call
    // goes without a token: nothing expired is ever sent).
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let denied_before = get_json(format!("{}/denied", mcp.url)).await.as_array().unwrap().len();
    let (_, run) = chat(&alice, "a3").await;
    let parked = waiting(&alice, &run).await;
    assert_eq!(parked["authorization"]["status"], "pending", "{parked}");
    let denied = get_json(format!("{}/denied", mcp.url)).await;
    assert_eq!(denied.as_array().unwrap().len(), denied_before + 1, "{denied}");
    assert_eq!(denied.as_array().unwrap().last().unwrap()["hadToken"], false, "the expired token was not sent: {denied}");
    assert_eq!(db.query_one(alice_tokens, &[]).await.unwrap().get::<_, i64>(0), 0, "the expired token was deleted");
    let r = alice.post(&format!("/api/runs/{run}/cancel"), json!({})).await.unwrap();
    assert_eq!(r.body["status"], "cancelled", "{r:?}");

    // Every note the server executed was made with its caller's own token.
    let seen = get_json(format!("{}/calls", mcp.url)).await;
    let users: Vec<(&str, &str)> = seen
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["tool"] == "note")
        .map(|c| (c["arguments"]["text"].as_str().unwrap(), c["user"].as_str().unwrap()))
        .collect();
    assert_eq!(users, [("a1", "alice"), ("b1", "bob"), ("a2", "alice")], "{seen}");
}


/// The authorizations of `run`, oldest first.
async fn authorizations(c: &Client, run: &str) -> Vec<Value> {
    c.get(&format!("/api/runs/{run}")).await.unwrap().body["authorizations"].as_array().cloned().unwrap_or_default()
}

/// Waits until `run` waits again on a NEW pending sign-in (its `n`-th authorization).
async fn parked_again(c: &Client, run: &str, n: usize) -> Vec<Value> {
    let deadline = std::time::Instant::now() + T;
    loop {
        let auths = authorizations(c, run).await;
        let status = c.get(&format!("/api/runs/{run}")).await.unwrap().body["status"].clone();
        if auths.len() >= n && status == "waiting_authorization" && auths.last().unwrap()["status"] == "pending" {
            return auths;
        }
        assert!(std::time::Instant::now() < deadline, "run {run} did not ask again: {status} {auths:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sign-ins that cannot complete on their own do not hold their run (found by an attack on the
/// first version): an expired link fails and the run asks again by itself; an exchange cut off
/// mid-way (its api died after taking the state) is given up by the sweep and the run asks
/// again; a sign-in of one run resumes the principal's other runs waiting on the same server.
#[tokio::test]
async fn signin_expired_or_interrupted_asks_again_and_one_signin_resumes_every_waiting_run() {
    let mcp = start_oauth_mcp();
    let stack = start_with("mcp_signin_sweep", &mcp, &[("OAUTH_SIGNIN_TTL_MS", "1500")]).await;
    let c = stack.client();

    // Expiry: the 1.5 s link lapses; the worker's sweep fails it and requeues the run, whose
    // retry parks it again with a fresh link.
    let (_, run) = chat(&c, "late").await;
    waiting(&c, &run).await;
    let auths = parked_again(&c, &run, 2).await;
    assert_eq!(auths[0]["status"], "failed", "{auths:?}");
    assert!(auths[0]["error"].as_str().unwrap().contains("expired"), "{auths:?}");

    // An interrupted exchange (state taken, the api gone before it finished) is given up.
    let db = stack.db.client().await.unwrap();
    let run_uuid = uuid::Uuid::parse_str(&run).unwrap();
    db.execute(
        "UPDATE mcp_authorizations SET status = 'exchanging', taken_at = now() - interval '2 minutes', expires_at = now() + interval '1 hour'
          WHERE run_id = $1 AND status = 'pending'",
        &[&run_uuid],
    )
    .await
    .unwrap();
    let swept: Value = db.query_one("SELECT agentloop_mcp_sweep('{}')", &[]).await.unwrap().get(0);
    assert_eq!(swept["ended"], 1, "{swept}");
    let auths = parked_again(&c, &run, 3).await;
    assert_eq!(auths[1]["status"], "failed", "{auths:?}");
    assert!(auths[1]["error"].as_str().unwrap().contains("interrupted"), "{auths:?}");
    drop(db);

    // Two runs wait on the same server; signing in for one resumes both (the link of the
    // second is completed by the first's token). A stack with the default 10 min links. The
    // server answers session opens and calls 300 ms late, so the two resumed calls (same
    // principal, same token) open their sessions concurrently: the second must not close the
    // first's session under its call (which then ended "answer stream closed": uncertain).
    drop(stack);
    let mcp = start_oauth_mcp_with(&["--slow-ms", "300"]);
    let stack = start("mcp_signin_siblings", &mcp).await;
    let c = stack.client();
    let (_, run) = chat(&c, "ay").await;
    let url = waiting(&c, &run).await["authorization"]["url"].as_str().unwrap().to_owned();
    let (thread_b, run_b) = chat(&c, "bee").await;
    waiting(&c, &run_b).await;
    let callback = sign_in(&url, "alice").await;
    let r = c.get(&callback).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(c.wait_terminal(&run, T).await.unwrap()["status"], "completed");
    let done_b = c.wait_terminal(&run_b, T).await.unwrap();
    assert_eq!(done_b["status"], "completed", "the other waiting run resumed with the token: {done_b}");
    let auths_b = authorizations(&c, &run_b).await;
    assert_eq!(auths_b.len(), 1, "no second sign-in: {auths_b:?}");
    assert_eq!(auths_b[0]["status"], "claimed", "{auths_b:?}");
    assert_eq!(final_text(&c, &thread_b).await, "done: note for alice: bee");
}
