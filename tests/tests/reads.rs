//! Reads and live updates at any thread length (issue 5, SPEC §10): the bounded thread window,
//! tool-group-safe paging of the middle, SSE resume and reset, long-poll latency, transport
//! modes. Big threads are built with SQL directly (messages + consistent thread counters).

use std::time::{Duration, Instant};

use agentloop_tests::{Stack, StackOptions, script};
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde_json::{Value, json};
use uuid::Uuid;

const T: Duration = Duration::from_secs(30);
const KIB: usize = 1024;

/// One message to insert with SQL.
struct Row {
    role: &'static str,
    text: String,
    tool_calls: Option<Value>,
    tool_call_id: Option<String>,
}

fn msg(role: &'static str, text: impl Into<String>) -> Row {
    Row { role, text: text.into(), tool_calls: None, tool_call_id: None }
}

/// An assistant message calling `n` tools with ids `{tag}-0..n`.
fn calls(tag: &str, n: usize) -> Row {
    let calls: Vec<Value> = (0..n)
        .map(|i| json!({"id": format!("{tag}-{i}"), "type": "function", "function": {"name": "calculator", "arguments": "{\"expression\":\"1+1\"}"}}))
        .collect();
    Row { role: "assistant", text: String::new(), tool_calls: Some(Value::Array(calls)), tool_call_id: None }
}

fn result(tag: &str, i: usize, text: impl Into<String>) -> Row {
    Row { role: "tool", text: text.into(), tool_calls: None, tool_call_id: Some(format!("{tag}-{i}")) }
}

/// `n` alternating user/assistant messages of `bytes` characters each.
fn filler(n: usize, bytes: usize) -> Vec<Row> {
    (0..n).map(|i| msg(if i % 2 == 0 { "user" } else { "assistant" }, "x".repeat(bytes))).collect()
}

/// Appends `rows` to `thread` after its current last sequence and keeps `threads.message_count`
/// / `last_sequence` / `last_timestamp_ms` consistent. Returns the last sequence.
async fn insert(db: &tokio_postgres::Client, thread: &str, rows: &[Row]) -> i64 {
    let id = Uuid::parse_str(thread).unwrap();
    let roles: Vec<&str> = rows.iter().map(|r| r.role).collect();
    let texts: Vec<&str> = rows.iter().map(|r| r.text.as_str()).collect();
    let calls: Vec<Option<String>> = rows.iter().map(|r| r.tool_calls.as_ref().map(Value::to_string)).collect();
    let ids: Vec<Option<&str>> = rows.iter().map(|r| r.tool_call_id.as_deref()).collect();
    let n = rows.len() as i64;
    db.execute(
        "INSERT INTO messages (thread_id, sequence, timestamp_ms, role, content, tool_calls, tool_call_id, byte_size)
         SELECT $1, t.last_sequence + r.n, t.last_timestamp_ms + r.n, r.role,
                CASE WHEN r.tc IS NOT NULL AND r.txt = '' THEN 'null'::jsonb ELSE to_jsonb(r.txt) END,
                r.tc::jsonb, r.tcid,
                octet_length(to_jsonb(r.txt)::text) + coalesce(octet_length(r.tc), 0)
         FROM (SELECT last_sequence, greatest(last_timestamp_ms, 1700000000000) AS last_timestamp_ms FROM threads WHERE id = $1) t,
              unnest($2::text[], $3::text[], $4::text[], $5::text[]) WITH ORDINALITY AS r(role, txt, tc, tcid, n)",
        &[&id, &roles, &texts, &calls, &ids],
    )
    .await
    .unwrap();
    let row = db
        .query_one(
            "UPDATE threads SET last_sequence = last_sequence + $2, message_count = message_count + $2::int,
                    last_timestamp_ms = greatest(last_timestamp_ms, 1700000000000) + $2
             WHERE id = $1 RETURNING last_sequence",
            &[&id, &n],
        )
        .await
        .unwrap();
    row.get(0)
}

fn seqs(messages: &Value) -> Vec<i64> {
    messages.as_array().unwrap().iter().map(|m| m["sequence"].as_i64().unwrap()).collect()
}

fn range(a: i64, b: i64) -> Vec<i64> {
    (a..=b).collect()
}

/// Bytes of a message as the bounds count them (content + tool calls as JSON text).
fn shown_bytes(m: &Value) -> usize {
    m["content"].to_string().len() + m.get("toolCalls").map_or(0, |c| c.to_string().len())
}

async fn page(stack: &Stack, thread: &str, query: &str) -> Value {
    let r = stack.client().get(&format!("/api/threads/{thread}/messages?{query}")).await.unwrap();
    assert_eq!(r.status, 200, "{query}: {r:?}");
    r.body
}

#[tokio::test]
async fn window_is_bounded_by_count_and_bytes_and_names_the_omitted_middle() {
    let stack = Stack::start("reads_window", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let db = stack.db.client().await.unwrap();

    // 1,000 small messages: 20 from the start, 100 from the end, 880 named as omitted.
    let thread = c.create_thread().await.unwrap();
    insert(&db, &thread, &filler(1000, 50)).await;
    let w = c.get(&format!("/api/threads/{thread}")).await.unwrap().body;
    assert_eq!(w["messageCount"], 1000);
    let got = seqs(&w["messages"]);
    let mut expected = range(1, 20);
    expected.extend(range(901, 1000));
    assert_eq!(got, expected);
    let mw = &w["messageWindow"];
    assert_eq!(mw["head"], json!({"first": 1, "last": 20, "count": 20}));
    assert_eq!(mw["tail"], json!({"first": 901, "last": 1000, "count": 100}));
    assert_eq!(mw["omitted"], json!({"after": 20, "before": 901, "count": 880}));

    // A short thread: everything, nothing omitted, no duplicate between head and tail.
    let short = c.create_thread().await.unwrap();
    insert(&db, &short, &filler(30, 10)).await;
    let w = c.get(&format!("/api/threads/{short}")).await.unwrap().body;
    assert_eq!(seqs(&w["messages"]), range(1, 30));
    assert_eq!(w["messageWindow"]["omitted"]["count"], 0);

    // A short thread whose head is cut by bytes: the tail is what follows the head as shown,
    // so the newest messages are in the window (acceptance probe K, K-3: five messages of
    // 100 KiB showed only the first, and named the other four as omitted up to no end).
    let short_wide = c.create_thread().await.unwrap();
    insert(&db, &short_wide, &filler(5, 100 * KIB)).await;
    let w = c.get(&format!("/api/threads/{short_wide}")).await.unwrap().body;
    let got = seqs(&w["messages"]);
    assert_eq!(got.last(), Some(&5), "the newest message is shown: {got:?}");
    assert_eq!(w["messageWindow"]["tail"]["last"], 5);
    assert!(w["messageWindow"]["omitted"]["before"].is_i64(), "{}", w["messageWindow"]);

    // 200 messages of 10 KiB: the byte bounds cut before the count bounds.
    let wide = c.create_thread().await.unwrap();
    insert(&db, &wide, &filler(200, 10 * KIB)).await;
    let w = c.get(&format!("/api/threads/{wide}")).await.unwrap().body;
    let mw = &w["messageWindow"];
    let (head_n, tail_n) = (mw["head"]["count"].as_u64().unwrap() as usize, mw["tail"]["count"].as_u64().unwrap() as usize);
    let msgs = w["messages"].as_array().unwrap();
    assert_eq!(msgs.len(), head_n + tail_n);
    let head_bytes: usize = msgs[..head_n].iter().map(shown_bytes).sum();
    let tail_bytes: usize = msgs[head_n..].iter().map(shown_bytes).sum();
    assert!(head_n < 20 && head_bytes <= 128 * KIB, "head {head_n} messages, {head_bytes} bytes");
    assert!(tail_n < 100 && tail_bytes <= 384 * KIB, "tail {tail_n} messages, {tail_bytes} bytes");
    assert!(head_bytes > 100 * KIB && tail_bytes > 350 * KIB, "the bounds are used, not undershot: {head_bytes} / {tail_bytes}");
    assert_eq!(mw["omitted"]["count"].as_u64().unwrap() as usize, 200 - head_n - tail_n);
    assert_eq!(mw["omitted"]["after"], head_n as i64);
    assert_eq!(mw["omitted"]["before"], (200 - tail_n + 1) as i64);

    // A huge first and a huge last message: both shown, truncated with a marker, never dropped.
    let huge = c.create_thread().await.unwrap();
    let mut rows = vec![msg("user", "h".repeat(300 * KIB))];
    rows.extend(filler(40, 100));
    rows.push(msg("assistant", "t".repeat(1024 * KIB)));
    let last = insert(&db, &huge, &rows).await;
    let w = c.get(&format!("/api/threads/{huge}")).await.unwrap().body;
    let msgs = w["messages"].as_array().unwrap();
    let first = &msgs[0];
    assert_eq!(first["sequence"], 1);
    assert_eq!(first["truncated"], true);
    let text = first["content"].as_str().unwrap();
    assert!(text.len() <= 128 * KIB + 64 && text.contains("bytes omitted]"), "{}", text.len());
    let tail = msgs.last().unwrap();
    assert_eq!(tail["sequence"], last);
    assert_eq!(tail["truncated"], true);
    let text = tail["content"].as_str().unwrap();
    assert!(text.len() <= 384 * KIB + 64 && text.contains("bytes omitted]"), "{}", text.len());
    assert_eq!(w["messageWindow"]["tail"]["last"], last);
    let reported = w["messageWindow"]["omitted"]["count"].as_u64().unwrap() as usize;
    assert_eq!(reported, rows.len() - msgs.len(), "whatever is not shown is counted as omitted");
}

#[tokio::test]
async fn paging_before_after_clamps_and_flags() {
    let stack = Stack::start("reads_paging", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let db = stack.db.client().await.unwrap();
    let thread = c.create_thread().await.unwrap();
    insert(&db, &thread, &filler(1000, 40)).await;

    // Neither bound: the latest `take` (default 100), ascending.
    let p = page(&stack, &thread, "").await;
    assert_eq!(seqs(&p["messages"]), range(901, 1000));
    assert_eq!((p["firstSequence"].as_i64(), p["lastSequence"].as_i64()), (Some(901), Some(1000)));
    assert_eq!((p["hasMoreBefore"].as_bool(), p["hasMoreAfter"].as_bool()), (Some(true), Some(false)));

    // `before` only: the messages just before it.
    let p = page(&stack, &thread, "before=500&take=10").await;
    assert_eq!(seqs(&p["messages"]), range(490, 499));
    assert_eq!((p["hasMoreBefore"].as_bool(), p["hasMoreAfter"].as_bool()), (Some(true), Some(false)));
    let p = page(&stack, &thread, "before=5&take=10").await;
    assert_eq!(seqs(&p["messages"]), range(1, 4));
    assert_eq!(p["hasMoreBefore"], false);

    // `after` only: the messages just after it.
    let p = page(&stack, &thread, "after=500&take=10").await;
    assert_eq!(seqs(&p["messages"]), range(501, 510));
    assert_eq!((p["hasMoreBefore"].as_bool(), p["hasMoreAfter"].as_bool()), (Some(false), Some(true)));
    let p = page(&stack, &thread, "after=995").await;
    assert_eq!(seqs(&p["messages"]), range(996, 1000));
    assert_eq!(p["hasMoreAfter"], false);

    // Both: from just after `after`, up to `take`, never reaching `before`.
    let p = page(&stack, &thread, "after=20&before=901&take=50").await;
    assert_eq!(seqs(&p["messages"]), range(21, 70));
    assert_eq!((p["hasMoreBefore"].as_bool(), p["hasMoreAfter"].as_bool()), (Some(false), Some(true)));
    let p = page(&stack, &thread, "after=10&before=15&take=50").await;
    assert_eq!(seqs(&p["messages"]), range(11, 14));
    assert_eq!((p["hasMoreBefore"].as_bool(), p["hasMoreAfter"].as_bool()), (Some(false), Some(false)));
    let p = page(&stack, &thread, "after=10&before=11").await;
    assert_eq!(p["messages"], json!([]));
    assert_eq!(p["firstSequence"], Value::Null);
    // Walking the whole gap with `after = lastSequence` visits every message exactly once.
    let (mut after, mut seen) = (20, Vec::new());
    loop {
        let p = page(&stack, &thread, &format!("after={after}&before=901&take=200")).await;
        seen.extend(seqs(&p["messages"]));
        if p["hasMoreAfter"] == false {
            break;
        }
        after = p["lastSequence"].as_i64().unwrap();
    }
    assert_eq!(seen, range(21, 900));

    // `take` is 1..=200: at both bounds a page, outside them 400 (never silently clamped).
    assert_eq!(seqs(&page(&stack, &thread, "take=1").await["messages"]), vec![1000]);
    assert_eq!(page(&stack, &thread, "take=200").await["messages"].as_array().unwrap().len(), 200);
    for query in ["take=0", "take=-7", "take=201", "take=100000", "maxBytes=-1", "maxBytes=1", "maxBytes=999999999"] {
        let r = c.get(&format!("/api/threads/{thread}/messages?{query}")).await.unwrap();
        assert_eq!((r.status, r.body["error"]["code"].as_str()), (400, Some("invalid_query")), "{query}: {r:?}");
    }

    // Another principal's thread is not found; bad numbers are invalid queries.
    let other = stack.client_for("mallory").unwrap();
    let r = other.get(&format!("/api/threads/{thread}/messages")).await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (404, Some("not_found")));
    let r = c.get(&format!("/api/threads/{}/messages", Uuid::new_v4())).await.unwrap();
    assert_eq!(r.status, 404);
    let r = c.get(&format!("/api/threads/{thread}/messages?take=many")).await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (400, Some("invalid_query")));
    let anonymous = agentloop_tests::Client { key: None, ..c.clone() };
    assert_eq!(anonymous.get(&format!("/api/threads/{thread}/messages")).await.unwrap().status, 401);
}

#[tokio::test]
async fn paging_is_byte_bounded_and_truncates_a_huge_message() {
    let stack = Stack::start("reads_paging_bytes", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let db = stack.db.client().await.unwrap();
    let thread = c.create_thread().await.unwrap();
    // 300 messages of 20 KiB, then one of 3 MiB, then 5 small ones.
    let mut rows = filler(300, 20 * KIB);
    rows.push(msg("assistant", "H".repeat(3 * 1024 * KIB)));
    rows.extend(filler(5, 10));
    insert(&db, &thread, &rows).await;
    let each = 20 * KIB + 2; // a JSON string: the quotes count

    let count = |p: &Value| p["messages"].as_array().unwrap().len();
    let bytes = |p: &Value| p["messages"].as_array().unwrap().iter().map(shown_bytes).sum::<usize>();
    // Default 512 KiB.
    let p = page(&stack, &thread, "before=301&take=200").await;
    assert_eq!(count(&p), 512 * KIB / each);
    assert!(bytes(&p) <= 512 * KIB);
    assert_eq!(p["lastSequence"], 300);
    assert_eq!(p["hasMoreBefore"], true);
    // maxBytes is 64 KiB..=2 MiB.
    assert_eq!(count(&page(&stack, &thread, "before=301&take=200&maxBytes=65536").await), 64 * KIB / each);
    let p = page(&stack, &thread, "before=301&take=200&maxBytes=2097152").await;
    assert_eq!(count(&p), 2 * 1024 * KIB / each);
    assert!(bytes(&p) <= 2 * 1024 * KIB);
    assert_eq!(count(&page(&stack, &thread, "before=301&take=200&maxBytes=200000").await), 200_000 / each);

    // A single message larger than maxBytes: returned alone, truncated with a marker.
    let p = page(&stack, &thread, "before=302&take=10&maxBytes=100000").await;
    assert_eq!(seqs(&p["messages"]), vec![301]);
    let m = &p["messages"][0];
    assert_eq!(m["truncated"], true);
    let text = m["content"].as_str().unwrap();
    assert!(text.len() <= 100_000 + 64 && text.ends_with("bytes omitted]"), "{}", text.len());
    assert_eq!((p["hasMoreBefore"].as_bool(), p["hasMoreAfter"].as_bool()), (Some(true), Some(false)));
    // Forward from before it: the small messages after it are not pushed out by it.
    let p = page(&stack, &thread, "after=301").await;
    assert_eq!(seqs(&p["messages"]), range(302, 306));

    // A message whose size is in its tool calls: their arguments are cut too, the short content
    // is left as it is (acceptance probe: 2 MB of arguments came back whole, marked truncated,
    // with the content turned into "\n…[0 bytes omitted]").
    let mut big = Row { role: "assistant", text: "calling".into(), tool_calls: None, tool_call_id: None };
    big.tool_calls = Some(json!([{"id": "c1", "name": "pay", "arguments": format!("{{\"memo\":\"{}\"}}", "m".repeat(2 * 1024 * KIB))}]));
    let last = insert(&db, &thread, &[big]).await;
    let p = page(&stack, &thread, &format!("after={}&maxBytes=100000", last - 1)).await;
    let m = &p["messages"][0];
    assert_eq!((m["sequence"].as_i64(), m["truncated"].as_bool(), m["content"].as_str()), (Some(last), Some(true), Some("calling")));
    let arguments = m["toolCalls"][0]["arguments"].as_str().unwrap();
    assert!(arguments.len() <= 100_000 + 64 && arguments.ends_with("bytes omitted]"), "{}", arguments.len());
    assert_eq!((m["toolCalls"][0]["id"].as_str(), m["toolCalls"][0]["name"].as_str()), (Some("c1"), Some("pay")));
}

#[tokio::test]
async fn paging_never_splits_a_tool_group() {
    let stack = Stack::start("reads_paging_groups", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let db = stack.db.client().await.unwrap();
    let thread = c.create_thread().await.unwrap();
    let mut rows = vec![msg("user", "compute")]; // 1
    rows.push(calls("a", 5)); // 2
    rows.extend((0..5).map(|i| result("a", i, format!("r{i}")))); // 3..7
    rows.push(msg("assistant", "done a")); // 8
    rows.push(msg("user", "more")); // 9
    rows.push(calls("b", 8)); // 10
    rows.extend((0..8).map(|i| result("b", i, "B".repeat(100 * KIB)))); // 11..18
    rows.push(msg("assistant", "done b")); // 19
    rows.extend(filler(20, 10)); // 20..39
    rows.push(calls("c", 3)); // 40
    rows.extend((0..3).map(|i| result("c", i, "ok"))); // 41..43
    let last = insert(&db, &thread, &rows).await;
    assert_eq!(last, 43);
    let roles = |p: &Value| p["messages"].as_array().unwrap().iter().map(|m| m["role"].as_str().unwrap().to_owned()).collect::<Vec<_>>();

    // The page would start inside group a: widened down to its assistant message.
    let p = page(&stack, &thread, "before=8&take=2").await;
    assert_eq!(seqs(&p["messages"]), range(2, 7));
    assert!(p["messages"][0]["toolCalls"].is_array());
    // The page would end inside group a: widened up over all its results (beyond take).
    let p = page(&stack, &thread, "after=1&take=1").await;
    assert_eq!(seqs(&p["messages"]), range(2, 7));
    assert_eq!(roles(&p), ["assistant", "tool", "tool", "tool", "tool", "tool"]);
    assert_eq!(p["hasMoreAfter"], true);
    // A bound inside the group: the page still holds the whole group (rows at or below
    // `after` included), so a page never starts with a result whose call it lacks.
    let p = page(&stack, &thread, "after=3&take=1").await;
    assert_eq!(seqs(&p["messages"]), range(2, 7));
    assert_eq!((p["hasMoreBefore"].as_bool(), p["hasMoreAfter"].as_bool()), (Some(false), Some(true)));
    // Latest page ending in a group: take=2 lands on two results, widened to the whole group.
    let p = page(&stack, &thread, "take=2").await;
    assert_eq!(seqs(&p["messages"]), range(40, 43));
    assert_eq!(p["hasMoreAfter"], false);
    // Both edges at once.
    let p = page(&stack, &thread, "after=4&before=12&take=6").await;
    assert_eq!(seqs(&p["messages"]), range(2, 18), "both bounds inside groups: both groups whole");
    let p = page(&stack, &thread, "before=11&take=1").await;
    assert_eq!(seqs(&p["messages"]), range(10, 18), "a lone call never ends a page");
    let p = page(&stack, &thread, "after=8&take=3").await;
    assert_eq!(seqs(&p["messages"]), range(9, 18));
    // A group larger than the byte budget is still whole; the extra results are truncated.
    let p = page(&stack, &thread, "before=19&take=1&maxBytes=65536").await;
    assert_eq!(seqs(&p["messages"]), range(10, 18));
    let msgs = p["messages"].as_array().unwrap();
    assert!(msgs[1..].iter().all(|m| m["truncated"] == true && m["toolCallId"].is_string()), "{}", p);
    let total: usize = msgs.iter().map(shown_bytes).sum();
    assert!(total < 64 * KIB + 9 * 9 * KIB, "widening stays bounded: {total}");
    // Every page boundary of a full walk lands outside groups.
    for take in 1..=6 {
        let (mut before, mut pages) = (None::<i64>, Vec::new());
        loop {
            let q = before.map_or(format!("take={take}"), |b| format!("before={b}&take={take}"));
            let p = page(&stack, &thread, &q).await;
            let first = &p["messages"][0];
            assert!(first["role"] != "tool", "take={take}: a page starts with a tool result: {q}");
            pages.push(seqs(&p["messages"]));
            if p["hasMoreBefore"] == false {
                break;
            }
            before = p["firstSequence"].as_i64();
        }
        let all: Vec<i64> = pages.into_iter().rev().flatten().collect();
        assert_eq!(all, range(1, 43), "take={take}");
    }
}

/// A thread's active rows as paging sees them, and the page the route must answer for a query.
struct Paging {
    /// (sequence, role, has tool calls) of every active message, ascending.
    rows: Vec<(i64, String, bool)>,
}

impl Paging {
    fn tool(&self, i: usize) -> bool {
        self.rows[i].1 == "tool"
    }

    fn call(&self, i: usize) -> bool {
        self.rows[i].1 == "assistant" && self.rows[i].2
    }

    /// Widens the index range `lo..=hi` to whole tool groups (a call and its contiguous results).
    fn whole(&self, mut lo: usize, mut hi: usize) -> (usize, usize) {
        while lo > 0 && self.tool(lo) && (self.tool(lo - 1) || self.call(lo - 1)) {
            lo -= 1;
        }
        while hi + 1 < self.rows.len() && self.tool(hi + 1) && (self.tool(hi) || self.call(hi)) {
            hi += 1;
        }
        (lo, hi)
    }

    /// Checks a page answered for `after`/`before`/`take`. `cores` are the acceptable core sizes
    /// (exactly `take` unless a byte budget may cut it).
    fn check(&self, after: Option<i64>, before: Option<i64>, take: usize, byte_cut: bool, p: &Value) -> Result<(), String> {
        let got = seqs(&p["messages"]);
        let inside: Vec<usize> = (0..self.rows.len())
            .filter(|&i| after.is_none_or(|a| self.rows[i].0 > a) && before.is_none_or(|b| self.rows[i].0 < b))
            .collect();
        let (Some(&start), Some(&end)) = (inside.first(), inside.last()) else {
            return if got.is_empty() { Ok(()) } else { Err("nothing is in bounds".into()) };
        };
        // Whatever the query, neither edge of the page splits a group.
        if let (Some(first), Some(last)) = (got.first(), got.last()) {
            let (fi, li) = (self.index(*first)?, self.index(*last)?);
            if self.tool(fi) && fi > 0 && (self.tool(fi - 1) || self.call(fi - 1)) {
                return Err(format!("starts with tool result {first}, splitting its group"));
            }
            if li + 1 < self.rows.len() && self.tool(li + 1) && (self.tool(li) || self.call(li)) {
                return Err(format!("ends at {last} although tool result {} of its group follows", self.rows[li + 1].0));
            }
        }
        // Exactly the `take` rows nearest the anchor (fewer when bytes cut), widened to whole groups.
        let sizes = if byte_cut { 1..=take.min(inside.len()) } else { take.min(inside.len())..=take.min(inside.len()) };
        let mut tried = Vec::new();
        for n in sizes {
            let (lo, hi) = if after.is_some() { (start, inside[n - 1]) } else { (inside[inside.len() - n], end) };
            let (lo, hi) = self.whole(lo, hi);
            let expected: Vec<i64> = self.rows[lo..=hi].iter().map(|r| r.0).collect();
            if expected == got {
                // Flags: active rows left between the page and the requested bound on each side.
                let (more_before, more_after) = (lo > start, hi < end);
                if p["hasMoreBefore"] != more_before || p["hasMoreAfter"] != more_after {
                    return Err(format!("flags {} / {}, expected {more_before} / {more_after}", p["hasMoreBefore"], p["hasMoreAfter"]));
                }
                if p["firstSequence"] != self.rows[lo].0 || p["lastSequence"] != self.rows[hi].0 {
                    return Err("firstSequence / lastSequence do not match the rows".into());
                }
                return Ok(());
            }
            tried.push(expected);
        }
        Err(format!("expected {}", tried.iter().map(|t| format!("{t:?}")).collect::<Vec<_>>().join(" or ")))
    }

    fn index(&self, sequence: i64) -> Result<usize, String> {
        self.rows.iter().position(|r| r.0 == sequence).ok_or(format!("{sequence} is not an active row"))
    }
}

/// Property (seed 000: paging never splits an assistant tool call from its results): on a
/// thread with tool groups of 1..5 results — at its very start and end, back to back,
/// separated by plain turns and by an inactive (edited) row — every page, for every `take`
/// 1..=5 and every `after`/`before` position (each alone, both, neither; positions inside
/// groups included), is exactly the `take` rows nearest its anchor widened to whole groups
/// (past a bound that falls inside a group), with exact flags; walking backward and forward
/// from either end visits every active row exactly once. A second pass repeats it with 40 KiB
/// results and `maxBytes=65536`, where the byte budget cuts pages inside groups.
#[tokio::test]
async fn paging_property_every_take_and_cursor_keeps_groups_whole() {
    let stack = Stack::start("reads_paging_property", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let db = stack.db.client().await.unwrap();
    for (pass, big) in [(0, 2usize), (1, 40 * KIB)] {
        let thread = c.create_thread().await.unwrap();
        let body = |i: usize| "r".repeat(big.max(i + 1));
        let mut rows = vec![calls("a", 2), result("a", 0, body(0)), result("a", 1, body(1))]; // 1..3: a group at the start
        rows.push(calls("b", 1)); // 4: back to back with a
        rows.push(result("b", 0, body(0))); // 5
        rows.push(msg("user", "edited away")); // 6: made inactive below
        rows.push(msg("user", "q")); // 7
        rows.push(calls("c", 3)); // 8
        rows.extend((0..3).map(|i| result("c", i, body(i)))); // 9..11
        rows.push(calls("d", 1)); // 12
        rows.push(result("d", 0, body(0))); // 13
        rows.push(msg("assistant", "text")); // 14
        rows.push(msg("user", "q2")); // 15
        rows.push(calls("e", 5)); // 16
        rows.extend((0..5).map(|i| result("e", i, body(i)))); // 17..21
        rows.push(msg("user", "q3")); // 22
        rows.push(calls("f", 2)); // 23
        rows.extend((0..2).map(|i| result("f", i, body(i)))); // 24..25: a group at the end
        assert_eq!(insert(&db, &thread, &rows).await, 25);
        let id = Uuid::parse_str(&thread).unwrap();
        db.execute("UPDATE messages SET active = false WHERE thread_id = $1 AND sequence = 6", &[&id]).await.unwrap();
        db.execute("UPDATE threads SET message_count = message_count - 1 WHERE id = $1", &[&id]).await.unwrap();
        let paging = Paging {
            rows: db
                .query("SELECT sequence, role, tool_calls IS NOT NULL FROM messages WHERE thread_id = $1 AND active ORDER BY sequence", &[&id])
                .await
                .unwrap()
                .iter()
                .map(|r| (r.get(0), r.get(1), r.get(2)))
                .collect(),
        };
        let bytes = if pass == 1 { "&maxBytes=65536" } else { "" };
        let mut queries = Vec::new();
        for take in 1..=5usize {
            for after in std::iter::once(None).chain((0..=25).map(Some)) {
                for before in std::iter::once(None).chain((1..=26).map(Some)) {
                    if matches!((after, before), (Some(a), Some(b)) if b <= a) {
                        continue;
                    }
                    let mut q = format!("take={take}{bytes}");
                    q.extend(after.map(|a| format!("&after={a}")));
                    q.extend(before.map(|b| format!("&before={b}")));
                    queries.push((after, before, take, q));
                }
            }
        }
        let answers: Vec<_> = futures_util::stream::iter(queries)
            .map(|(after, before, take, q)| {
                let c = c.clone();
                let path = format!("/api/threads/{thread}/messages?{q}");
                async move { (after, before, take, q, c.get(&path).await.unwrap()) }
            })
            .buffer_unordered(6)
            .collect()
            .await;
        let mut failures = Vec::new();
        for (after, before, take, q, r) in &answers {
            assert_eq!(r.status, 200, "{q}: {r:?}");
            if let Err(e) = paging.check(*after, *before, *take, pass == 1, &r.body) {
                failures.push(format!("{q}: {e}, got {:?}", seqs(&r.body["messages"])));
            }
        }
        failures.sort();
        // Walks from both ends.
        let all: Vec<i64> = paging.rows.iter().map(|r| r.0).collect();
        for take in 1..=5usize {
            let (mut cursor, mut back) = (None::<i64>, Vec::new());
            loop {
                let q = cursor.map_or(format!("take={take}{bytes}"), |b| format!("before={b}&take={take}{bytes}"));
                let p = page(&stack, &thread, &q).await;
                back.splice(0..0, seqs(&p["messages"]));
                if p["hasMoreBefore"] != true || back.len() > all.len() {
                    break;
                }
                cursor = p["firstSequence"].as_i64();
            }
            let (mut cursor, mut fwd) = (0i64, Vec::new());
            loop {
                let p = page(&stack, &thread, &format!("after={cursor}&take={take}{bytes}")).await;
                fwd.extend(seqs(&p["messages"]));
                if p["hasMoreAfter"] != true || fwd.len() > all.len() {
                    break;
                }
                cursor = p["lastSequence"].as_i64().unwrap();
            }
            if back != all || fwd != all {
                failures.push(format!("take={take}{bytes}: walks {back:?} / {fwd:?}"));
            }
        }
        assert!(
            failures.is_empty(),
            "pass {pass}: {} of {} pages wrong, e.g.:\n{}",
            failures.len(),
            answers.len(),
            failures.iter().step_by((failures.len() / 30).max(1)).cloned().collect::<Vec<_>>().join("\n")
        );
    }
}

type Sse = std::pin::Pin<Box<dyn futures_util::Stream<Item = (String, String, Value)> + Send>>;

/// Opens the SSE stream of `thread` with `query` (and optionally `Last-Event-ID`).
async fn sse(stack: &Stack, thread: &str, query: &str, last_event_id: Option<i64>) -> Sse {
    let mut req = reqwest::Client::new()
        .get(format!("{}/api/threads/{thread}/updates/stream?{query}", stack.api_url))
        .bearer_auth(&stack.key);
    if let Some(id) = last_event_id {
        req = req.header("Last-Event-ID", id.to_string());
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-accel-buffering"], "no");
    Box::pin(resp.bytes_stream().eventsource().filter_map(|e| async move {
        let e = e.ok()?;
        Some((e.event, e.id, serde_json::from_str(&e.data).unwrap_or(Value::Null)))
    }))
}

/// Next non-heartbeat event within `within`.
async fn next(events: &mut Sse, within: Duration) -> Option<(String, String, Value)> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, events.next()).await {
            Ok(Some(e)) if e.0 == "heartbeat" => continue,
            Ok(e) => return e,
            Err(_) => return None,
        }
    }
}

async fn journal(db: &tokio_postgres::Client, thread: &str) -> Vec<i64> {
    let id = Uuid::parse_str(thread).unwrap();
    db.query("SELECT sequence FROM thread_events WHERE thread_id = $1 ORDER BY sequence", &[&id])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Appends one journal event the way the server does (same transaction, NOTIFY on commit);
/// returns its sequence and the instant of the commit.
async fn journal_event(db: &tokio_postgres::Client, thread: &str, n: i64) -> (i64, Instant) {
    let id = Uuid::parse_str(thread).unwrap();
    let row = db
        .query_one(
            "WITH t AS (UPDATE threads SET last_event_sequence = last_event_sequence + 1 WHERE id = $1 RETURNING last_event_sequence),
                  ins AS (INSERT INTO thread_events (thread_id, sequence, kind, payload)
                          SELECT $1, t.last_event_sequence, 'thread', jsonb_build_object('probe', $2::bigint) FROM t RETURNING sequence)
             SELECT ins.sequence, pg_notify('agentloop_threads', $1::text || ':' || ins.sequence::text) IS NULL FROM ins",
            &[&id, &n],
        )
        .await
        .unwrap();
    (row.get(0), Instant::now())
}

#[tokio::test]
async fn sse_resumes_from_after_sequence_or_last_event_id() {
    let stack = Stack::start("reads_sse_resume", StackOptions::default()).await.unwrap();
    let c = stack.client();
    let db = stack.db.client().await.unwrap();
    let thread = c.create_thread().await.unwrap();
    let posted = c.chat(&thread, &script(json!([{"toolCalls": [{"name": "calculator", "arguments": {"expression": "2*3"}}]}, {"text": "six"}]))).await.unwrap();
    c.wait_terminal(posted["run"]["id"].as_str().unwrap(), T).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ids = journal(&db, &thread).await;
    assert!(ids.len() >= 6, "{ids:?}");
    let last = *ids.last().unwrap();
    let middle = ids[ids.len() / 2];

    let mut s = sse(&stack, &thread, &format!("afterSequence={middle}"), None).await;
    let connected = next(&mut s, T).await.unwrap();
    assert_eq!(connected.0, "connected");
    assert_eq!(connected.2["sequence"], middle);
    assert_eq!(next(&mut s, T).await.unwrap().0, "thread");
    let mut got = Vec::new();
    while got.len() < (last - middle) as usize {
        let (kind, id, data) = next(&mut s, T).await.expect("resumed events");
        assert_ne!(kind, "reset", "{data}");
        got.push(id.parse::<i64>().unwrap());
    }
    assert_eq!(got, range(middle + 1, last));
    assert!(next(&mut s, Duration::from_millis(300)).await.is_none(), "nothing past the end");
    // Live after the resumed backlog.
    let (probe, _) = journal_event(&db, &thread, 1).await;
    let (kind, id, data) = next(&mut s, T).await.unwrap();
    assert_eq!((kind.as_str(), id.parse::<i64>().unwrap(), &data["probe"]), ("thread", probe, &json!(1)));

    // Last-Event-ID wins over afterSequence.
    let mut s = sse(&stack, &thread, "afterSequence=0", Some(last - 1)).await;
    assert_eq!(next(&mut s, T).await.unwrap().2["sequence"], last - 1);
    assert_eq!(next(&mut s, T).await.unwrap().0, "thread");
    let ids: Vec<i64> = [next(&mut s, T).await.unwrap(), next(&mut s, T).await.unwrap()].iter().map(|e| e.1.parse().unwrap()).collect();
    assert_eq!(ids, vec![last, probe]);

    // A Last-Event-ID that is not an integer, even one that is not ASCII, is a 400, never ignored.
    for bad in ["abc", "é"] {
        let r = reqwest::Client::new()
            .get(format!("{}/api/threads/{thread}/updates?timeoutMs=0", stack.api_url))
            .bearer_auth(&stack.key)
            .header("Last-Event-ID", reqwest::header::HeaderValue::from_bytes(bad.as_bytes()).unwrap())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{bad}");
        assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "invalid_last_event_id", "{bad}");
    }
    // Nor is a negative position reset silently (acceptance probe F), and a malformed one is
    // refused naming what was sent.
    for (query, header) in [("afterSequence=-5", None), ("", Some("-1")), ("afterSequence=abc", None)] {
        let mut request = reqwest::Client::new()
            .get(format!("{}/api/threads/{thread}/updates?timeoutMs=0&{query}", stack.api_url))
            .bearer_auth(&stack.key);
        if let Some(h) = header {
            request = request.header("Last-Event-ID", h);
        }
        let r = request.send().await.unwrap();
        assert_eq!(r.status(), 400, "{query} {header:?}");
        let error: Value = r.json().await.unwrap();
        let code = if header.is_some() { "invalid_last_event_id" } else { "invalid_query" };
        assert_eq!(error["error"]["code"], code, "{query}: {error}");
        if query.ends_with("abc") {
            assert!(error["error"]["message"].as_str().unwrap().contains("afterSequence=abc"), "{error}");
        }
    }

    // No position: starts at the present.
    let mut s = sse(&stack, &thread, "", None).await;
    assert_eq!(next(&mut s, T).await.unwrap().2["sequence"], probe);
    assert_eq!(next(&mut s, T).await.unwrap().0, "thread");
    assert!(next(&mut s, Duration::from_millis(300)).await.is_none());
}

#[tokio::test]
async fn a_pruned_position_gets_a_reset_with_the_current_position() {
    let stack = Stack::start("reads_reset", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let db = stack.db.client().await.unwrap();
    let thread = c.create_thread().await.unwrap();
    for n in 0..10 {
        journal_event(&db, &thread, n).await;
    }
    let ids = journal(&db, &thread).await;
    let current = *ids.last().unwrap();
    assert_eq!(ids, range(1, current));
    // Prune everything but the newest 3 events.
    let id = Uuid::parse_str(&thread).unwrap();
    db.execute("DELETE FROM thread_events WHERE thread_id = $1 AND sequence <= $2", &[&id, &(current - 3)]).await.unwrap();

    // SSE with an old cursor: connected, thread snapshot, then reset carrying the current end.
    let mut s = sse(&stack, &thread, "afterSequence=2", None).await;
    assert_eq!(next(&mut s, T).await.unwrap().0, "connected");
    assert_eq!(next(&mut s, T).await.unwrap().0, "thread");
    let (kind, _, data) = next(&mut s, T).await.unwrap();
    assert_eq!((kind.as_str(), &data["sequence"]), ("reset", &json!(current)));
    // ... and continues live from there.
    let (probe, _) = journal_event(&db, &thread, 99).await;
    assert_eq!(next(&mut s, T).await.unwrap().1, probe.to_string());
    // Last-Event-ID below the retained range: the same.
    let mut s = sse(&stack, &thread, "", Some(1)).await;
    next(&mut s, T).await.unwrap();
    next(&mut s, T).await.unwrap();
    let (kind, _, data) = next(&mut s, T).await.unwrap();
    assert_eq!((kind.as_str(), &data["sequence"]), ("reset", &json!(probe)));
    // Exactly at the edge of the retained range: no reset, the retained events follow.
    let mut s = sse(&stack, &thread, &format!("afterSequence={}", current - 3), None).await;
    next(&mut s, T).await.unwrap();
    next(&mut s, T).await.unwrap();
    let e = next(&mut s, T).await.unwrap();
    assert_eq!((e.0.as_str(), e.1.clone()), ("thread", (current - 2).to_string()));

    // Long-poll: the same reset.
    let r = c.get(&format!("/api/threads/{thread}/updates?afterSequence=2&timeoutMs=5000")).await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!((r.body["reset"].as_bool(), r.body["nextSequence"].as_i64()), (Some(true), Some(probe)));
    assert_eq!(r.body["events"], json!([]));
    // Resuming from the reset position works.
    let r = c.get(&format!("/api/threads/{thread}/updates?afterSequence={}&timeoutMs=200", current - 1)).await.unwrap();
    assert_eq!(r.body["reset"], false);
    let got: Vec<i64> = r.body["events"].as_array().unwrap().iter().map(|e| e["sequence"].as_i64().unwrap()).collect();
    assert_eq!(got, vec![current, probe]);
}

#[tokio::test]
async fn long_poll_returns_at_once_when_behind_and_wakes_within_a_second() {
    let stack = Stack::start("reads_long_poll", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let c = stack.client();
    let db = stack.db.client().await.unwrap();
    let thread = c.create_thread().await.unwrap();
    let (seq, _) = journal_event(&db, &thread, 0).await;

    // Something newer exists: immediate answer despite a long timeout.
    let t0 = Instant::now();
    let r = c.get(&format!("/api/threads/{thread}/updates?afterSequence=0&timeoutMs=20000")).await.unwrap();
    let immediate = t0.elapsed();
    assert_eq!(r.status, 200);
    assert_eq!(r.body["nextSequence"], seq);
    assert!(immediate < Duration::from_millis(1000), "{immediate:?}");

    // Nothing newer: waits for the timeout, then answers empty at the same cursor.
    let t0 = Instant::now();
    let r = c.get(&format!("/api/threads/{thread}/updates?afterSequence={seq}&timeoutMs=400")).await.unwrap();
    let waited = t0.elapsed();
    assert_eq!((r.body["events"].clone(), r.body["nextSequence"].as_i64()), (json!([]), Some(seq)));
    assert!(waited >= Duration::from_millis(380) && waited < Duration::from_secs(3), "{waited:?}");

    // Waiting: woken by a new event (NOTIFY → hub → journal read) well within a second.
    let mut cursor = seq;
    let mut latencies = Vec::new();
    for n in 1..=5 {
        let poll = {
            let (c, thread) = (c.clone(), thread.clone());
            tokio::spawn(async move {
                let r = c.get(&format!("/api/threads/{thread}/updates?afterSequence={cursor}&timeoutMs=20000")).await.unwrap();
                (r, Instant::now())
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!poll.is_finished(), "the poll waits while nothing is newer");
        let (probe, committed) = journal_event(&db, &thread, n).await;
        let (r, answered) = poll.await.unwrap();
        assert_eq!(r.body["events"][0]["sequence"], probe, "{:?}", r.body);
        assert_eq!(r.body["events"][0]["payload"]["probe"], n);
        latencies.push(answered.duration_since(committed));
        cursor = probe;
    }
    latencies.sort();
    println!("long-poll wake-up latency after commit: min {:?}, median {:?}, max {:?}", latencies[0], latencies[2], latencies[4]);
    assert!(latencies[4] < Duration::from_secs(2), "{latencies:?}");
}

#[tokio::test]
async fn transport_long_poll_disables_sse() {
    let env = |v: &str| StackOptions { workers: 0, api_env: vec![("EVENTS_TRANSPORT".into(), v.into())], ..Default::default() };
    let stack = Stack::start("reads_transport_long_poll", env("long-poll")).await.unwrap();
    let c = stack.client();
    let thread = c.create_thread().await.unwrap();
    let r = c.get(&format!("/api/threads/{thread}/updates/stream")).await.unwrap();
    assert_eq!(r.status, 503);
    assert_eq!(r.body["error"]["code"], "sse_unavailable");
    assert!(r.body["error"]["message"].as_str().unwrap().contains("/updates"), "{r:?}");
    // Long-poll still works there.
    let r = c.get(&format!("/api/threads/{thread}/updates?afterSequence=0&timeoutMs=100")).await.unwrap();
    assert_eq!(r.status, 200);
    assert!(!r.body["events"].as_array().unwrap().is_empty());
    drop(stack);

    // An unknown value stops the api at start (operations::settings_a_process_cannot_work_with_are_refused_at_start).
    for value in ["sse", "auto"] {
        let stack = Stack::start(&format!("reads_transport_{value}"), env(value)).await.unwrap();
        let thread = stack.client().create_thread().await.unwrap();
        let mut s = sse(&stack, &thread, "afterSequence=0", None).await;
        let (kind, _, data) = next(&mut s, T).await.unwrap();
        assert_eq!(kind, "connected");
        assert_eq!(data["transport"], value);
        assert_eq!(next(&mut s, T).await.unwrap().0, "thread");
        assert_eq!(next(&mut s, T).await.unwrap().1, "1", "the journal follows");
        let r = stack.client().get(&format!("/api/threads/{thread}/updates?afterSequence=0&timeoutMs=100")).await.unwrap();
        assert_eq!(r.status, 200, "long-poll is always available");
    }
}
