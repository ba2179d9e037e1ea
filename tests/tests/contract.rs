//! The API contract can fail (issue 10 point 6): the route table and the OpenAPI document list
//! exactly the same operations, every documented operation is served, and schemathesis — run
//! against a live api with a real key, a worker and the mock model — finds no server error, no
//! undocumented status, no wrong content type and no body that breaks its schema. Every name
//! starts with `contract_`.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use agentloop_tests::{Stack, StackOptions};
use serde_json::Value;
use utoipa::OpenApi;

const METHODS: [&str; 5] = ["get", "post", "put", "patch", "delete"];

fn document() -> Value {
    serde_json::to_value(agentloop_api::openapi::ApiDoc::openapi()).unwrap()
}

fn documented(doc: &Value) -> BTreeSet<(String, String)> {
    let mut ops = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in METHODS {
            if item.get(method).is_some() {
                ops.insert((method.to_owned(), path.clone()));
            }
        }
    }
    ops
}

#[test]
fn contract_route_table_and_openapi_document_list_the_same_operations() {
    let doc = document();
    let table: BTreeSet<(String, String)> =
        agentloop_api::routes::routes().into_iter().map(|(m, p)| (m.as_str().to_ascii_lowercase(), p.to_owned())).collect();
    let documented = documented(&doc);
    let undocumented: Vec<_> = table.difference(&documented).collect();
    let unserved: Vec<_> = documented.difference(&table).collect();
    assert!(undocumented.is_empty(), "routes missing from the OpenAPI document: {undocumented:?}");
    assert!(unserved.is_empty(), "documented operations without a route: {unserved:?}");
    assert!(table.len() >= 30, "{table:?}");

    // Every operation is typed: a 2xx with a schema (not a free-form object), errors in the
    // envelope, request bodies by reference, numeric parameters bounded where the route bounds them.
    let schemas = &doc["components"]["schemas"];
    for (method, path) in &documented {
        let op = &doc["paths"][path][method];
        let responses = op["responses"].as_object().unwrap();
        let ok: Vec<_> = responses.iter().filter(|(s, _)| s.starts_with('2')).collect();
        assert!(!ok.is_empty(), "{method} {path}: no 2xx");
        for (status, response) in ok {
            if let Some(content) = response["content"].as_object() {
                for (media, body) in content {
                    let schema = &body["schema"];
                    if media == "application/json" && path != "/openapi.json" {
                        let name = schema["$ref"].as_str().unwrap_or_else(|| panic!("{method} {path} {status}: untyped body {schema}"));
                        let typed = &schemas[name.rsplit('/').next().unwrap()];
                        assert!(typed["properties"].is_object() || typed["allOf"].is_array(), "{method} {path} {status}: {typed}");
                    }
                }
            }
        }
        for (status, response) in responses.iter().filter(|(s, _)| s.starts_with('4') || s.starts_with('5')) {
            // `/v1/*` speaks OpenAI's error shape (issue 12), everything else the API's envelope.
            let envelope = if path.starts_with("/v1/") { "#/components/schemas/OpenAiError" } else { "#/components/schemas/Error" };
            assert_eq!(response["content"]["application/json"]["schema"]["$ref"], envelope, "{method} {path} {status}");
        }
        if let Some(body) = op.get("requestBody") {
            assert!(body["content"]["application/json"]["schema"].is_object(), "{method} {path}: {body}");
            for status in ["408", "413", "415"] {
                assert!(responses.contains_key(status), "{method} {path}: {status} with a body");
            }
        }
        let secured = op["security"].as_array().is_some_and(|s| s.iter().any(|r| r.as_object().is_some_and(|o| !o.is_empty())));
        if secured {
            for status in ["401", "429"] {
                assert!(responses.contains_key(status), "{method} {path}: {status}");
            }
        }
    }
    let status = &schemas["RunStatus"]["enum"];
    assert_eq!(status.as_array().map(Vec::len), Some(9), "run statuses are an enum: {status}");
    let take = doc["paths"]["/api/threads/{id}/messages"]["get"]["parameters"].as_array().unwrap().iter().find(|p| p["name"] == "take").unwrap();
    assert_eq!((take["schema"]["minimum"].as_i64(), take["schema"]["maximum"].as_i64()), (Some(1), Some(200)));
}

#[tokio::test]
async fn contract_every_documented_operation_is_served() {
    let stack = Stack::start("contract_served", StackOptions { workers: 0, ..Default::default() }).await.unwrap();
    let doc: Value = stack.client().get("/openapi.json").await.unwrap().body;
    assert_eq!(documented(&doc), documented(&document()), "the served document is the built one");
    let http = reqwest::Client::new();
    for (method, path) in documented(&doc) {
        let url = path.replace("{id}", "00000000-0000-0000-0000-000000000000").replace("{sequence}", "1").replace("{key}", "k");
        let mut request = http
            .request(method.to_ascii_uppercase().parse().unwrap(), format!("{}{url}?timeoutMs=0", stack.api_url))
            .bearer_auth(&stack.key)
            .timeout(std::time::Duration::from_secs(10));
        if method == "post" || method == "patch" {
            request = request.header("Content-Type", "application/json").body("{}");
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        assert!(status != 405 && body["error"]["code"] != "route_not_found", "{method} {path}: {status} {body}");
        assert!(status < 500, "{method} {path}: {status} {body}");
    }
}

/// The schemathesis CLI: `SCHEMATHESIS` or `.stack/venv/bin/st` (installed by `.ci/run` and
/// `deploy/test.sh` from PyPI).
fn schemathesis() -> Option<PathBuf> {
    if let Ok(path) = std::env::var("SCHEMATHESIS") {
        return Some(PathBuf::from(path));
    }
    let local = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.stack/venv/bin/st");
    local.exists().then_some(local)
}

#[tokio::test]
async fn contract_schemathesis_finds_no_failures() {
    let Some(st) = schemathesis() else {
        assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "CI must install schemathesis (.ci/run does)");
        eprintln!("SKIPPED: schemathesis is not installed (run ./deploy/test.sh, which installs it into .stack/venv)");
        return;
    };
    let options = StackOptions {
        workers: 1,
        api_env: [("SSE_MAX_STREAM_MS", "1000"), ("LONG_POLL_MAX_MS", "300"), ("LONG_POLL_TIMEOUT_MS", "300")]
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..Default::default()
    };
    let stack = Stack::start("contract_schemathesis", options).await.unwrap();
    let report = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../test-output/contract_schemathesis");
    std::fs::create_dir_all(&report).unwrap();
    let max_time = std::env::var("SCHEMATHESIS_MAX_TIME").unwrap_or_else(|_| "75".into());
    let started = Instant::now();
    let out = tokio::task::spawn_blocking({
        let (api, key, report) = (stack.api_url.clone(), stack.key.clone(), report.clone());
        move || {
            Command::new(st)
                .args(["run", &format!("{api}/openapi.json")])
                .args(["--checks", "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"])
                .args(["--header", &format!("Authorization: Bearer {key}")])
                .args(["--phases", "examples,coverage,fuzzing,stateful"])
                // One worker: with two, hypothesis's lambda-source cache (CPython 3.11's `ast`) races and
                // schemathesis reports an internal error ("AST constructor recursion depth mismatch").
                .args(["--max-time", &max_time, "--max-examples", "40", "--request-timeout", "15", "--workers", "1", "--seed", "10"])
                .args(["--report", "junit", "--report-dir"])
                .arg(&report)
                .current_dir(&report) // its cache directory goes there, not into the checkout
                .env("NO_COLOR", "1")
                .env("SCHEMATHESIS_TELEMETRY", "false")
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    std::fs::write(report.join("output.txt"), stdout.as_bytes()).unwrap();
    // The run count and the summary, for the CI log.
    let summary: Vec<&str> = stdout.lines().filter(|l| {
        let l = l.to_ascii_lowercase();
        l.contains("test cases") || l.contains("operations") || l.contains("failures") || l.contains("passed") || l.contains("errors") || l.contains("seed")
    }).collect();
    println!("schemathesis ({:.0} s):\n{}", started.elapsed().as_secs_f64(), summary.join("\n"));
    assert!(out.status.success(), "schemathesis found failures (full output in test-output/contract_schemathesis/output.txt):\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
}
