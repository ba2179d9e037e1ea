//! The mixed workload: concurrent scripted clients, each a careful human with a robust HTTP
//! client, posting turns on its threads and driving them to the end.
//!
//! Scenarios (each picks a new thread or reuses the client's current one):
//!
//! - `plain`: one turn answered with text `answer <token> ...` (streamed in chunks);
//! - `tool`: the model calls `calculator` and the non-idempotent HTTP tool `effect` (sometimes a
//!   second `effect` in a later step; in 8% of them with the call id reused across steps, as
//!   some providers do); a step whose result says `request failed` is retried by the model, as
//!   a real model retries a failed call;
//! - `approval`: the model calls `ask_effect` (policy `ask`; sometimes two calls, a second step,
//!   in 12% of them reused ids); the client approves, approves with edited arguments, or
//!   rejects;
//! - `fifo`: a slow turn, then 1-3 turns posted with `multitask: enqueue`; some of the queued
//!   turns are cancelled at about the moment the slow turn ends;
//! - `interrupt`: a slow turn, then a turn with `multitask: interrupt`.
//!
//! While driving a run the client approves/rejects pending approvals, and resolves a `blocked`
//! run's uncertain operations by asking the effects receiver whether the effect with that
//! idempotency key happened: `completed` (with the receiver's answer as the result) if it did,
//! `retry` if not. Every turn, decision and resolve is recorded for the checks.

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures_util::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::http::Api;
use super::stack::{ASK_TOOL, ChaosStack, EFFECT_TOOL};
use super::tally::Tally;

/// `maxSteps` of every turn (the scripts need at most ~6 slices, even with recoveries and
/// resolves; a lease-lost or interrupted slice uses none).
pub const MAX_STEPS: u32 = 10;

/// Patience of one HTTP call (retried within it).
const CALL_PATIENCE: Duration = Duration::from_secs(45);

/// How a post ended, as the client saw it.
#[derive(Debug, Clone, PartialEq)]
pub enum PostOutcome {
    /// 202 with this run id.
    Accepted(String),
    /// A 4xx answer (status, error code).
    Refused(u16, String),
    /// No answer within the patience (maybe accepted: the checks look for its receipt).
    Unknown(String),
}

/// One posted turn.
#[derive(Debug, Clone)]
pub struct Turn {
    /// Global index; per thread, posts are sequential, so this is the acceptance order.
    pub n: usize,
    pub thread: String,
    pub token: String,
    pub key: String,
    pub kind: &'static str,
    pub policy: &'static str,
    pub outcome: PostOutcome,
    /// The client asked for this run to end (cancel, or a later `interrupt` turn).
    pub cancel_requested: bool,
    /// Effect tokens the script asks for, with the tool.
    pub effects: Vec<(String, String)>,
    /// The script reuses tool-call ids across steps.
    pub reused_ids: bool,
    /// Status of the run when the client stopped driving it.
    pub last_status: Option<String>,
}

/// An approval decision the client sent.
#[derive(Debug, Clone)]
pub struct Decision {
    pub approval: String,
    pub run: String,
    pub tool_call_id: String,
    /// `approve`, `edit` or `reject`.
    pub action: &'static str,
    pub proposed: Value,
    /// Arguments sent with an `edit`.
    pub sent: Option<Value>,
    pub status: u16,
}

/// A resolve the client sent for an uncertain operation.
#[derive(Debug, Clone)]
pub struct Resolve {
    pub run: String,
    pub key: String,
    pub happened: bool,
    pub outcome: &'static str,
    pub status: u16,
    pub code: String,
}

/// What an SSE follower received on one connection.
#[derive(Debug, Clone, Default)]
pub struct SseConn {
    /// Resume position sent (`Last-Event-ID`).
    pub after: i64,
    /// When the connection was established (seconds since the Unix epoch).
    pub opened_at: f64,
    /// Journal events received: (sequence, kind, payload, received at — seconds since the
    /// Unix epoch).
    pub events: Vec<(i64, String, Value, f64)>,
    /// `reset` events received (their sequence).
    pub resets: Vec<i64>,
    /// Why the connection ended.
    pub end: String,
}

/// Everything one SSE follower saw.
#[derive(Debug, Clone, Default)]
pub struct SseLog {
    pub thread: String,
    pub connections: Vec<SseConn>,
    pub connect_errors: u64,
}

struct Follower {
    thread: String,
    cursor: Arc<AtomicI64>,
    handle: JoinHandle<SseLog>,
}

/// Workload settings.
#[derive(Debug, Clone)]
pub struct WorkloadConfig {
    pub clients: usize,
    /// Turns to post in all.
    pub runs: usize,
    /// Stop posting after this long (if set).
    pub duration: Option<Duration>,
    /// Share of new threads that get an SSE follower.
    pub sse_fraction: f64,
    /// Patience for driving one run to its end.
    pub run_patience: Duration,
    pub seed: u64,
}

/// State shared by the clients and read by the checks.
pub struct Workload {
    pub config: WorkloadConfig,
    pub api: Api,
    pub stack: Arc<ChaosStack>,
    pub tally: Tally,
    pub turns: Mutex<Vec<Turn>>,
    pub decisions: Mutex<Vec<Decision>>,
    pub resolves: Mutex<Vec<Resolve>>,
    followers: Mutex<Vec<Follower>>,
    /// Turns still to post.
    budget: AtomicUsize,
    /// Turns accepted so far (202).
    pub accepted: Arc<AtomicUsize>,
    /// Clients still posting.
    pub posting: AtomicUsize,
    started: Instant,
    /// Fired when faults have stopped: followers stop disconnecting on purpose.
    pub settled: CancellationToken,
    /// Fired to close the followers.
    pub close: CancellationToken,
    /// Threads created.
    pub threads: Mutex<Vec<String>>,
}

impl Workload {
    pub fn new(config: WorkloadConfig, stack: Arc<ChaosStack>, tally: Tally) -> Arc<Self> {
        let api = Api::new(stack.api_urls.clone(), stack.key.clone(), tally.clone());
        Arc::new(Self {
            budget: AtomicUsize::new(config.runs),
            posting: AtomicUsize::new(config.clients),
            config,
            api,
            stack,
            tally,
            turns: Mutex::new(Vec::new()),
            decisions: Mutex::new(Vec::new()),
            resolves: Mutex::new(Vec::new()),
            followers: Mutex::new(Vec::new()),
            accepted: Arc::new(AtomicUsize::new(0)),
            started: Instant::now(),
            settled: CancellationToken::new(),
            close: CancellationToken::new(),
            threads: Mutex::new(Vec::new()),
        })
    }

    /// Starts the clients; each ends when the budget (or the duration) is used up and its last
    /// runs are driven to their end.
    pub fn spawn_clients(self: &Arc<Self>) -> Vec<JoinHandle<()>> {
        (0..self.config.clients)
            .map(|i| {
                let w = self.clone();
                tokio::spawn(async move {
                    let seed = w.config.seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    let mut client = Client { w: w.clone(), rng: StdRng::seed_from_u64(seed), thread: None, id: i };
                    client.run().await;
                })
            })
            .collect()
    }

    /// Reserves up to `want` turns of the budget; 0 when it is used up.
    fn reserve(&self, want: usize) -> usize {
        if self.config.duration.is_some_and(|d| self.started.elapsed() >= d) {
            return 0;
        }
        let mut got = 0;
        let _ = self.budget.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| {
            got = b.min(want);
            Some(b - got)
        });
        got
    }

    fn push_turn(&self, mut turn: Turn) -> usize {
        let mut turns = self.turns.lock().expect("turns lock");
        turn.n = turns.len();
        turns.push(turn);
        turns.len() - 1
    }

    fn update_turn(&self, n: usize, f: impl FnOnce(&mut Turn)) {
        f(&mut self.turns.lock().expect("turns lock")[n]);
    }

    /// Turns posted so far.
    pub fn turns(&self) -> Vec<Turn> {
        self.turns.lock().expect("turns lock").clone()
    }

    /// Smallest cursor of the followers whose thread's journal ends at `ends(thread)`, and how
    /// many are behind.
    pub fn followers_behind(&self, ends: &std::collections::HashMap<String, i64>) -> usize {
        self.followers
            .lock()
            .expect("followers lock")
            .iter()
            .filter(|f| f.cursor.load(Ordering::Relaxed) < ends.get(&f.thread).copied().unwrap_or(0))
            .count()
    }

    /// Threads with a follower.
    pub fn followed_threads(&self) -> Vec<String> {
        self.followers.lock().expect("followers lock").iter().map(|f| f.thread.clone()).collect()
    }

    /// Closes the followers and collects what they saw.
    pub async fn finish_followers(&self) -> Vec<SseLog> {
        self.close.cancel();
        let followers: Vec<Follower> = std::mem::take(&mut *self.followers.lock().expect("followers lock"));
        let mut logs = Vec::new();
        for f in followers {
            match tokio::time::timeout(Duration::from_secs(10), f.handle).await {
                Ok(Ok(log)) => logs.push(log),
                _ => logs.push(SseLog { thread: f.thread, ..Default::default() }),
            }
        }
        logs
    }
}

/// Words of the scripted answers.
const WORDS: &[&str] = &[
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima", "mike",
    "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey", "xray",
];

/// The text the tool result of a timed-out (or otherwise failed) HTTP call contains; the model
/// retries such a step.
const FAILED_MARK: &str = "request failed";

struct Client {
    w: Arc<Workload>,
    rng: StdRng,
    thread: Option<String>,
    id: usize,
}

/// A turn to post.
struct Plan {
    kind: &'static str,
    token: String,
    text: String,
    effects: Vec<(String, String)>,
    reused_ids: bool,
    /// Expected streaming time of the answer, ms (slow turns).
    stream_ms: u64,
}

impl Client {
    async fn run(&mut self) {
        loop {
            let scenario = self.rng.random_range(0..100);
            let (name, want) = match scenario {
                0..30 => ("plain", 1),
                30..55 => ("tool", 1),
                55..70 => ("approval", 1),
                70..90 => ("fifo", self.rng.random_range(2..=4)),
                _ => ("interrupt", 2),
            };
            let got = self.w.reserve(want);
            if got == 0 {
                break;
            }
            if self.thread.is_none() || self.rng.random_bool(0.4) {
                match self.new_thread().await {
                    Ok(t) => self.thread = Some(t),
                    Err(e) => {
                        self.w.tally.note(format!("client {}: creating a thread failed: {e:#}", self.id));
                        self.w.tally.add("workload.thread_create_failed", 1);
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue;
                    }
                }
            }
            let thread = self.thread.clone().expect("thread");
            let result = match name {
                "tool" => self.single(&thread, "tool").await,
                "approval" => self.single(&thread, "approval").await,
                "fifo" if got >= 2 => self.fifo(&thread, got).await,
                "interrupt" if got >= 2 => self.interrupt(&thread).await,
                _ => self.single(&thread, "plain").await,
            };
            self.w.tally.add(&format!("workload.scenario.{name}"), 1);
            if let Err(e) = result {
                self.w.tally.note(format!("client {}: scenario {name} on {thread}: {e:#}", self.id));
                self.w.tally.add("workload.scenario_errors", 1);
                self.thread = None; // a thread left in an unknown state is not reused
            }
        }
        self.w.posting.fetch_sub(1, Ordering::SeqCst);
    }

    async fn new_thread(&mut self) -> Result<String> {
        let key = format!("thread-{:x}-{}-{}", self.w.config.seed, self.id, self.rng.random::<u32>());
        let r = self.w.api.post("/api/threads", json!({"title": format!("chaos {}", self.id)}), &key, CALL_PATIENCE).await?;
        anyhow::ensure!(r.status == 201, "create thread: {} {}", r.status, r.body);
        let id = r.body["id"].as_str().context("thread id")?.to_owned();
        self.w.threads.lock().expect("threads lock").push(id.clone());
        if self.rng.random_bool(self.w.config.sse_fraction) {
            self.spawn_follower(&id);
        }
        Ok(id)
    }

    fn spawn_follower(&mut self, thread: &str) {
        let cursor = Arc::new(AtomicI64::new(0));
        let seed = self.rng.random::<u64>();
        let handle = tokio::spawn(follow(self.w.clone(), thread.to_owned(), cursor.clone(), seed));
        self.w.followers.lock().expect("followers lock").push(Follower { thread: thread.to_owned(), cursor, handle });
    }

    fn token(&mut self) -> String {
        format!("k{:x}x{:08x}", self.w.config.seed & 0xffff, self.rng.random::<u32>())
    }

    fn words(&mut self, k: usize) -> String {
        (0..k).map(|_| WORDS[self.rng.random_range(0..WORDS.len())]).collect::<Vec<_>>().join(" ")
    }

    /// A turn of `kind` (`plain`, `tool`, `approval`, `slow`).
    fn plan(&mut self, kind: &'static str) -> Plan {
        let token = self.token();
        let mut effects = Vec::new();
        let mut reused_ids = false;
        let mut stream_ms = 0;
        let final_text = |words: String| format!("answer {token} {words} results: {{{{tool_results}}}}");
        let steps = match kind {
            "plain" => {
                let (k, d) = (self.rng.random_range(3..15), self.rng.random_range(5..60));
                let words = self.words(k);
                json!([{"text": format!("answer {token} {words}"), "chunkDelayMs": d}])
            }
            "slow" => {
                let (k, d) = (self.rng.random_range(15..30), self.rng.random_range(100..250u64));
                // The mock streams 3 words per chunk and sleeps `d` between frames (role frame,
                // the chunks, finish and [DONE]).
                stream_ms = ((k as u64 + 2).div_ceil(3) + 2) * d;
                let words = self.words(k);
                json!([{"text": format!("answer {token} {words}"), "chunkDelayMs": d}])
            }
            "tool" => {
                reused_ids = self.rng.random_bool(0.08);
                let mut steps = Vec::new();
                let first = format!("fx{}-0", &token[1..]);
                effects.push((EFFECT_TOOL.to_owned(), first.clone()));
                let (a, b) = (self.rng.random_range(1..100), self.rng.random_range(1..100));
                let mut effect = json!({"name": EFFECT_TOOL, "arguments": {"token": first, "note": "first"}});
                if reused_ids {
                    effect["id"] = json!("call_1");
                }
                steps.push(json!({"toolCalls": [{"name": "calculator", "arguments": {"expression": format!("{a}*{b}")}}, effect],
                                  "retryIfResultContains": FAILED_MARK, "chunkDelayMs": self.rng.random_range(0..20)}));
                if reused_ids || self.rng.random_bool(0.3) {
                    let second = format!("fx{}-1", &token[1..]);
                    effects.push((EFFECT_TOOL.to_owned(), second.clone()));
                    let mut effect = json!({"name": EFFECT_TOOL, "arguments": {"token": second, "note": "second"}});
                    if reused_ids {
                        effect["id"] = json!("call_1");
                    }
                    steps.push(json!({"toolCalls": [effect], "retryIfResultContains": FAILED_MARK}));
                }
                let k = self.rng.random_range(2..8);
                let words = self.words(k);
                steps.push(json!({"text": final_text(words), "chunkDelayMs": self.rng.random_range(0..40)}));
                Value::Array(steps)
            }
            _ => {
                // approval
                reused_ids = self.rng.random_bool(0.12);
                let mut steps = Vec::new();
                let parallel = if reused_ids { 1 } else { self.rng.random_range(1..=2) };
                let mut calls = Vec::new();
                for i in 0..parallel {
                    let t = format!("ax{}-{i}", &token[1..]);
                    effects.push((ASK_TOOL.to_owned(), t.clone()));
                    let mut call = json!({"name": ASK_TOOL, "arguments": {"token": t, "note": format!("proposal {i}")}});
                    if reused_ids {
                        call["id"] = json!("call_1");
                    }
                    calls.push(call);
                }
                steps.push(json!({"toolCalls": calls}));
                if reused_ids || self.rng.random_bool(0.3) {
                    let t = format!("ax{}-9", &token[1..]);
                    effects.push((ASK_TOOL.to_owned(), t.clone()));
                    let mut call = json!({"name": ASK_TOOL, "arguments": {"token": t, "note": "second step"}});
                    if reused_ids {
                        call["id"] = json!("call_1");
                    }
                    steps.push(json!({"toolCalls": [call]}));
                }
                let k = self.rng.random_range(2..8);
                let words = self.words(k);
                steps.push(json!({"text": final_text(words)}));
                Value::Array(steps)
            }
        };
        let kind = if kind == "slow" { "plain" } else { kind };
        let text = format!("turn {token} please. MOCK: {}", json!({"steps": steps}));
        Plan { kind, token, text, effects, reused_ids, stream_ms }
    }

    /// Posts `plan` with `policy`; returns the turn index and its run id when accepted.
    async fn post(&mut self, thread: &str, plan: &Plan, policy: &'static str) -> (usize, Option<String>) {
        let key = format!("chat-{}-{}", plan.token, self.rng.random::<u32>());
        let n = self.w.push_turn(Turn {
            n: 0,
            thread: thread.to_owned(),
            token: plan.token.clone(),
            key: key.clone(),
            kind: plan.kind,
            policy,
            outcome: PostOutcome::Unknown("not sent".into()),
            cancel_requested: false,
            effects: plan.effects.clone(),
            reused_ids: plan.reused_ids,
            last_status: None,
        });
        // A bounded budget: a run that loops (e.g. a model that never sees one of its own
        // exchanges) fails `budget_exhausted` instead of burning the whole soak.
        let mut body = json!({"content": plan.text, "maxSteps": MAX_STEPS});
        if policy != "reject" {
            body["multitask"] = json!(policy);
        }
        let outcome = match self.w.api.post(&format!("/api/threads/{thread}/chat"), body, &key, CALL_PATIENCE).await {
            Ok(r) if r.status == 202 => match r.body["run"]["id"].as_str() {
                Some(id) => PostOutcome::Accepted(id.to_owned()),
                None => PostOutcome::Unknown(format!("202 without a run: {}", r.body)),
            },
            Ok(r) => PostOutcome::Refused(r.status, r.body["error"]["code"].as_str().unwrap_or("").to_owned()),
            Err(e) => PostOutcome::Unknown(format!("{e:#}")),
        };
        let run = match &outcome {
            PostOutcome::Accepted(id) => {
                self.w.accepted.fetch_add(1, Ordering::SeqCst);
                self.w.tally.add("workload.accepted", 1);
                Some(id.clone())
            }
            PostOutcome::Refused(s, code) => {
                self.w.tally.add(&format!("workload.refused.{s}_{code}"), 1);
                None
            }
            PostOutcome::Unknown(_) => {
                self.w.tally.add("workload.post_unknown", 1);
                None
            }
        };
        self.w.update_turn(n, |t| t.outcome = outcome);
        self.w.tally.add("workload.posted", 1);
        (n, run)
    }

    async fn single(&mut self, thread: &str, kind: &'static str) -> Result<()> {
        let plan = self.plan(kind);
        let (n, run) = self.post(thread, &plan, "reject").await;
        match run {
            Some(run) => self.drive(n, thread, &run).await,
            None => anyhow::bail!("turn {n} not accepted"),
        }
    }

    /// A slow turn, then `n - 1` enqueued turns; some queued ones are cancelled at about the
    /// moment the slow one ends (the cancel races with the end of the active run).
    async fn fifo(&mut self, thread: &str, n: usize) -> Result<()> {
        let head = self.plan("slow");
        let (head_n, head_run) = self.post(thread, &head, "reject").await;
        let head_run = head_run.with_context(|| format!("fifo head turn {head_n} not accepted"))?;
        let mut queued = Vec::new();
        for _ in 1..n {
            let kind = if self.rng.random_bool(0.3) { "tool" } else { "plain" };
            let plan = self.plan(kind);
            let (tn, run) = self.post(thread, &plan, "enqueue").await;
            queued.push((tn, run));
        }
        // Cancel times, relative to when the head is seen running.
        let mut cancels: Vec<(i64, usize, String)> = Vec::new();
        for (tn, run) in &queued {
            if let Some(run) = run
                && self.rng.random_bool(0.5) {
                    // The head ends about `stream_ms` after its model call starts, which is a
                    // little after its claim.
                    let offset = head.stream_ms as i64 + self.rng.random_range(-100..=200);
                    cancels.push((offset, *tn, run.clone()));
                }
        }
        cancels.sort();
        if !cancels.is_empty() {
            // Aim at the head's end: its start (claim time, database clock = this machine's) plus
            // its streaming time.
            let started = self.wait_running(&head_run, Duration::from_secs(20)).await;
            for (offset, tn, run) in &cancels {
                let at = started + *offset as f64 / 1000.0;
                let wait = at - epoch_now();
                if wait > 0.0 {
                    tokio::time::sleep(Duration::from_secs_f64(wait.min(30.0))).await;
                }
                self.cancel(*tn, run).await;
            }
        }
        self.drive(head_n, thread, &head_run).await?;
        for (tn, run) in queued {
            if let Some(run) = run {
                self.drive(tn, thread, &run).await?;
            }
        }
        Ok(())
    }

    /// A slow turn, then a turn posted with `multitask: interrupt`.
    async fn interrupt(&mut self, thread: &str) -> Result<()> {
        let head = self.plan("slow");
        let (head_n, head_run) = self.post(thread, &head, "reject").await;
        let head_run = head_run.with_context(|| format!("interrupt head turn {head_n} not accepted"))?;
        if self.rng.random_bool(0.7) {
            self.wait_running(&head_run, Duration::from_secs(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(self.rng.random_range(0..=head.stream_ms.max(1)))).await;
        let kind = if self.rng.random_bool(0.3) { "tool" } else { "plain" };
        let plan = self.plan(kind);
        // The interrupt asks the active run to end: recorded before posting.
        self.w.update_turn(head_n, |t| t.cancel_requested = true);
        let (tn, run) = self.post(thread, &plan, "interrupt").await;
        self.drive(head_n, thread, &head_run).await?;
        if let Some(run) = run {
            self.drive(tn, thread, &run).await?;
        }
        Ok(())
    }

    /// Polls until the run has started (or is terminal, or `limit` passed); returns its
    /// `startedAt` in Unix seconds (now, when unknown).
    async fn wait_running(&self, run: &str, limit: Duration) -> f64 {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(r) = self.w.api.get(&format!("/api/runs/{run}"), Duration::from_secs(5)).await
                && r.status == 200 && r.body["status"] != "queued" && r.body["status"] != "pending" {
                    let started = r.body["startedAt"]
                        .as_str()
                        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
                        .map(|t| t.timestamp_micros() as f64 / 1e6);
                    return started.unwrap_or_else(epoch_now);
                }
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
        epoch_now()
    }

    async fn cancel(&mut self, n: usize, run: &str) {
        self.w.update_turn(n, |t| t.cancel_requested = true);
        let key = format!("cancel-{run}");
        match self.w.api.post(&format!("/api/runs/{run}/cancel"), json!({}), &key, CALL_PATIENCE).await {
            Ok(r) => {
                let status = r.body["status"].as_str().unwrap_or("?").to_owned();
                self.w.tally.add(&format!("workload.cancel.{}_{status}", r.status), 1);
            }
            Err(e) => {
                self.w.tally.add("workload.cancel.failed", 1);
                self.w.tally.note(format!("cancel of run {run} failed: {e:#}"));
            }
        }
    }

    /// Drives run `run` of turn `n` to a terminal status: decides its approvals and resolves its
    /// uncertain operations on the way.
    async fn drive(&mut self, n: usize, thread: &str, run: &str) -> Result<()> {
        let deadline = Instant::now() + self.w.config.run_patience;
        let mut last = String::new();
        loop {
            if Instant::now() > deadline {
                self.w.tally.add("workload.drive_gave_up", 1);
                self.w.update_turn(n, |t| t.last_status = Some(last.clone()));
                anyhow::bail!("run {run} still '{last}' after {:?}", self.w.config.run_patience);
            }
            let r = match self.w.api.get(&format!("/api/runs/{run}"), CALL_PATIENCE).await {
                Ok(r) if r.status == 200 => r,
                Ok(r) => anyhow::bail!("GET run {run}: {} {}", r.status, r.body),
                Err(_) => continue,
            };
            last = r.body["status"].as_str().unwrap_or("").to_owned();
            match last.as_str() {
                "completed" | "failed" | "cancelled" => {
                    self.w.update_turn(n, |t| t.last_status = Some(last.clone()));
                    return Ok(());
                }
                "waiting_approval" => self.decide(thread, run).await,
                "blocked" => self.resolve(run).await,
                _ => {}
            }
            tokio::time::sleep(Duration::from_millis(self.rng.random_range(80..200))).await;
        }
    }

    /// Decides the pending approvals of `run`: approve, approve with edited arguments, or
    /// reject.
    async fn decide(&mut self, thread: &str, run: &str) {
        let Ok(r) = self.w.api.get(&format!("/api/threads/{thread}/approvals?status=pending"), CALL_PATIENCE).await else { return };
        let approvals = r.body["approvals"].as_array().cloned().unwrap_or_default();
        for a in approvals.iter().filter(|a| a["runId"] == run) {
            tokio::time::sleep(Duration::from_millis(self.rng.random_range(0..300))).await;
            let id = a["id"].as_str().unwrap_or_default().to_owned();
            let proposed = a["arguments"].clone();
            let roll = self.rng.random_range(0..100);
            let (action, path, body, sent) = if roll < 55 {
                ("approve", "approve", json!({}), None)
            } else if roll < 80 {
                let token = format!("{}-edited", proposed["token"].as_str().unwrap_or("x"));
                let edited = json!({"token": token, "note": "edited by the chaos client"});
                ("edit", "approve", json!({"arguments": edited.clone()}), Some(edited))
            } else {
                ("reject", "reject", json!({"reason": "chaos says no"}), None)
            };
            let key = format!("decide-{id}");
            let status = match self.w.api.post(&format!("/api/approvals/{id}/{path}"), body, &key, CALL_PATIENCE).await {
                Ok(r) => r.status,
                Err(_) => 0,
            };
            self.w.tally.add(&format!("workload.decision.{action}_{status}"), 1);
            self.w.decisions.lock().expect("decisions lock").push(Decision {
                approval: id,
                run: run.to_owned(),
                tool_call_id: a["toolCallId"].as_str().unwrap_or_default().to_owned(),
                action,
                proposed,
                sent,
                status,
            });
        }
    }

    /// Resolves the uncertain operations of blocked run `run` the way a careful human would:
    /// asks the receiver whether the effect with that key happened.
    async fn resolve(&mut self, run: &str) {
        // Give an in-flight effect time to land before looking.
        tokio::time::sleep(Duration::from_millis(self.rng.random_range(200..1000))).await;
        let Ok(r) = self.w.api.get(&format!("/api/runs/{run}/operations"), CALL_PATIENCE).await else { return };
        if r.body["run"]["status"] != "blocked" {
            return;
        }
        let mut updated_at = r.body["run"]["updatedAt"].clone();
        let ops = r.body["operations"].as_array().cloned().unwrap_or_default();
        for op in ops.iter().filter(|o| o["status"] == "uncertain") {
            let key = op["key"].as_str().unwrap_or_default().to_owned();
            // Wait (bounded) for an effect still being answered.
            for _ in 0..30 {
                if self.w.stack.receiver.by_key(&key).iter().all(|e| e.answered) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let seen = self.w.stack.receiver.by_key(&key);
            let happened = !seen.is_empty();
            let body = match seen.first() {
                Some(e) => json!({"outcome": "completed", "result": e.response, "runUpdatedAt": updated_at}),
                None => json!({"outcome": "retry", "runUpdatedAt": updated_at}),
            };
            let outcome = if happened { "completed" } else { "retry" };
            let path = format!("/api/runs/{run}/operations/{}/resolve", key.replace(':', "%3A"));
            let idem = format!("resolve-{key}-{}", self.rng.random::<u32>());
            let (status, code) = match self.w.api.post(&path, body, &idem, CALL_PATIENCE).await {
                Ok(r) => {
                    if r.status == 200 {
                        updated_at = r.body["run"]["updatedAt"].clone();
                    }
                    (r.status, r.body["error"]["code"].as_str().unwrap_or("").to_owned())
                }
                Err(e) => (0, format!("{e:#}")),
            };
            self.w.tally.add(&format!("workload.resolve.{outcome}_{status}"), 1);
            self.w.resolves.lock().expect("resolves lock").push(Resolve {
                run: run.to_owned(),
                key,
                happened,
                outcome,
                status,
                code,
            });
            if status != 200 {
                return; // re-read on the next round
            }
        }
    }
}

/// An SSE follower of `thread`: connects with `Last-Event-ID`, disconnects at random while the
/// faults run, reconnects from the last id it received, and records everything.
async fn follow(w: Arc<Workload>, thread: String, cursor: Arc<AtomicI64>, seed: u64) -> SseLog {
    let mut rng = StdRng::seed_from_u64(seed);
    let http = reqwest::Client::builder().connect_timeout(Duration::from_secs(3)).build().expect("sse client");
    let mut log = SseLog { thread: thread.clone(), ..Default::default() };
    let mut last = 0i64;
    let steady = rng.random_bool(0.3);
    while !w.close.is_cancelled() {
        let url = format!("{}/api/threads/{thread}/updates/stream", w.api.base());
        let req = http.get(url).bearer_auth(w.api.key()).header("Last-Event-ID", last.to_string());
        let resp = tokio::select! {
            _ = w.close.cancelled() => break,
            r = tokio::time::timeout(Duration::from_secs(10), req.send()) => r,
        };
        let resp = match resp {
            Ok(Ok(r)) if r.status().is_success() => r,
            _ => {
                log.connect_errors += 1;
                tokio::time::sleep(Duration::from_millis(rng.random_range(100..600))).await;
                continue;
            }
        };
        let mut conn = SseConn { after: last, opened_at: epoch_now(), ..Default::default() };
        // A steady follower never disconnects on purpose (a stalled feed is not healed by its
        // reconnects then); the others live 0.3-6 s per connection while the faults run.
        let life = if steady { Duration::from_secs(3600) } else { Duration::from_millis(rng.random_range(300..6000)) };
        let born = Instant::now();
        let mut stream = eventsource_stream::Eventsource::eventsource(resp.bytes_stream());
        conn.end = loop {
            let limit = if w.settled.is_cancelled() { Duration::from_secs(3600) } else { life.saturating_sub(born.elapsed()) };
            let next = tokio::select! {
                _ = w.close.cancelled() => break "closed".to_owned(),
                _ = tokio::time::sleep(limit) => break "random disconnect".to_owned(),
                _ = w.settled.cancelled(), if !w.settled.is_cancelled() => continue,
                next = stream.next() => next,
            };
            match next {
                Some(Ok(ev)) => {
                    // `connected`, `heartbeat` and the `thread` snapshot sent on connect are not
                    // journal events; a journal `thread` event has its own `id:` (the snapshot
                    // comes before any id on the connection, so its last-event-id is empty).
                    if matches!(ev.event.as_str(), "connected" | "heartbeat") || (ev.event == "thread" && ev.id.trim().is_empty()) {
                        continue;
                    }
                    let Ok(id) = ev.id.trim().parse::<i64>() else { continue };
                    let payload: Value = serde_json::from_str(&ev.data).unwrap_or(Value::String(ev.data.clone()));
                    if ev.event == "reset" {
                        conn.resets.push(id);
                    } else {
                        conn.events.push((id, ev.event.clone(), payload, epoch_now()));
                    }
                    last = id;
                    cursor.store(id, Ordering::Relaxed);
                }
                Some(Err(e)) => break format!("error: {e}"),
                None => break "eof".to_owned(),
            }
        };
        log.connections.push(conn);
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..300))).await;
    }
    log
}

fn epoch_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}
