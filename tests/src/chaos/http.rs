//! The robust API client of the chaos workload: every POST carries an `Idempotency-Key` and is
//! retried with the same key on connection errors, timeouts and 5xx, with backoff, until a
//! deadline; GETs are retried the same way. Requests go to the api processes in turn.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use serde_json::Value;

use super::tally::Tally;
use crate::Reply;

/// A shared API client.
#[derive(Clone)]
pub struct Api {
    http: reqwest::Client,
    bases: Arc<Vec<String>>,
    key: String,
    next: Arc<AtomicUsize>,
    tally: Tally,
}

impl Api {
    pub fn new(bases: Vec<String>, key: String, tally: Tally) -> Self {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .connect_timeout(Duration::from_secs(3))
            .pool_idle_timeout(Duration::from_secs(20))
            .build()
            .expect("http client");
        Self { http, bases: Arc::new(bases), key, next: Arc::new(AtomicUsize::new(0)), tally }
    }

    /// The base URL of the next api process (round robin).
    pub fn base(&self) -> String {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        self.bases[i % self.bases.len()].clone()
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// One attempt.
    async fn once(&self, method: &reqwest::Method, path: &str, body: Option<&Value>, idempotency_key: Option<&str>) -> Result<Reply> {
        let mut req = self.http.request(method.clone(), format!("{}{}", self.base(), path)).bearer_auth(&self.key);
        if let Some(k) = idempotency_key {
            req = req.header("Idempotency-Key", k);
        }
        if let Some(b) = body {
            req = req.json(b);
        }
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        let text = resp.text().await?;
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok(Reply { status, body })
    }

    /// Sends until a non-5xx answer arrives or `patience` has passed (then the last error).
    pub async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
        idempotency_key: Option<&str>,
        patience: Duration,
    ) -> Result<Reply> {
        let deadline = Instant::now() + patience;
        let mut backoff = Duration::from_millis(100);
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let outcome = self.once(&method, path, body.as_ref(), idempotency_key).await;
            let retry_reason = match &outcome {
                Ok(r) if r.status >= 500 => format!("HTTP {}: {}", r.status, short(&r.body)),
                Ok(_) => {
                    if attempt > 1 {
                        self.tally.add(if method == reqwest::Method::POST { "http.post_retried_ok" } else { "http.get_retried_ok" }, 1);
                    }
                    return outcome;
                }
                Err(e) => format!("{e:#}"),
            };
            self.tally.add(if method == reqwest::Method::POST { "http.post_retries" } else { "http.get_retries" }, 1);
            if Instant::now() + backoff > deadline {
                self.tally.add("http.gave_up", 1);
                bail!("{method} {path}: gave up after {attempt} attempts: {retry_reason}");
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    pub async fn get(&self, path: &str, patience: Duration) -> Result<Reply> {
        self.send(reqwest::Method::GET, path, None, None, patience).await
    }

    pub async fn post(&self, path: &str, body: Value, idempotency_key: &str, patience: Duration) -> Result<Reply> {
        self.send(reqwest::Method::POST, path, Some(body), Some(idempotency_key), patience).await
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 200 { format!("{}…", &s[..s.char_indices().nth(200).map_or(s.len(), |(i, _)| i)]) } else { s }
}
