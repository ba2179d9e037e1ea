//! Webhook delivery (issue 12, part 2): the worker side of the outbox.
//!
//! Run transitions write `webhook_deliveries` rows in their own transaction (the trigger of
//! `migrations/2026-12-02-000011_webhooks`). Every worker runs one dispatcher: it claims due rows
//! (`agentloop_webhook_claim`: `FOR UPDATE SKIP LOCKED`, at most its free slots, fairly between
//! principals and at most `WEBHOOK_CONCURRENCY_PER_PRINCIPAL` of one principal in flight across
//! the fleet — migration 000040 —, each claim a
//! lease of `WEBHOOK_TIMEOUT_MS` + 5 s on the row), sends each with the safe client of
//! [`agentloop_shared::webhooks`] (signed per Standard Webhooks, no redirects, timeouts, 1 KiB
//! of answer read, no private targets unless allowed), and records the attempt
//! (`agentloop_webhook_finish`): delivered on a 2xx, else the next attempt after an exponential
//! backoff with jitter (`WEBHOOK_RETRY_BASE_MS` doubling up to `WEBHOOK_RETRY_MAX_MS`), failed
//! after `WEBHOOK_MAX_ATTEMPTS`. A worker killed mid-request loses nothing: the row is due again
//! when its lease ends, and is sent again with the same `webhook-id` (at-least-once).
//!
//! Wake-ups: the trigger's `agentloop_webhooks` notification (forwarded by the claim loop's
//! listener), a slot freeing, a timer for the earliest due row (retries and leases; returned by
//! every claim) and the safety poll. An idle worker issues no periodic query of its own beyond
//! the safety poll.

use std::sync::Arc;
use std::time::Duration;

use agentloop_shared::store::{Replay, Store};
use agentloop_shared::webhooks::{self, ClientSettings, SecretsKey};
use serde_json::{Value, json};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Delivery settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Deliveries in flight per worker.
    pub concurrency: usize,
    /// Delivery attempts of one principal in flight across the fleet (fair claims, migration
    /// 000040).
    pub per_principal: u32,
    /// Attempts before a delivery fails.
    pub max_attempts: u32,
    /// First retry delay (doubling).
    pub retry_base: Duration,
    /// Longest retry delay.
    pub retry_max: Duration,
    /// Bound of one attempt.
    pub timeout: Duration,
    /// Non-public targets allowed.
    pub allow_private: bool,
    /// Idle safety poll.
    pub safety_poll: Duration,
    /// Grace for deliveries in flight at shutdown.
    pub shutdown_grace: Duration,
}

impl Settings {
    /// The claim lease: the attempt's bound plus a margin for recording its outcome.
    fn lease(&self) -> Duration {
        self.timeout + Duration::from_secs(5)
    }
}

/// One claimed delivery.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Claimed {
    id: Uuid,
    attempt: u32,
    webhook_id: Uuid,
    url: String,
    secret: String,
    event_type: String,
    payload: Value,
}

/// Runs the dispatcher until `shutdown`; then lets deliveries in flight finish within the
/// grace period (one cut short is sent again by another worker after its lease).
pub async fn run(
    store: Store,
    worker_id: String,
    settings: Settings,
    key: Option<Arc<SecretsKey>>,
    wake: Arc<Notify>,
    shutdown: CancellationToken,
) {
    let client = match webhooks::client(ClientSettings { timeout: settings.timeout, allow_private: settings.allow_private }) {
        Ok(client) => client,
        Err(error) => {
            tracing::error!(%error, "cannot build the webhook client; this worker delivers no webhooks");
            return;
        }
    };
    let settings = Arc::new(settings);
    let mut in_flight: JoinSet<()> = JoinSet::new();
    let mut timer = settings.safety_poll;
    while !shutdown.is_cancelled() {
        let free = settings.concurrency.saturating_sub(in_flight.len());
        // Every wake-up (notification, a freed slot, the timer) is a claim pass when a slot is free.
        if free > 0 {
            let arg = json!({
                "worker": worker_id, "limit": free, "leaseMs": settings.lease().as_millis() as u64,
                "maxAttempts": settings.max_attempts, "perPrincipal": settings.per_principal,
            });
            match store.call("agentloop_webhook_claim", &arg, Replay::Safe, None).await {
                Ok(claimed) => {
                    let deliveries: Vec<Claimed> = serde_json::from_value(claimed["deliveries"].clone()).unwrap_or_default();
                    timer = claimed["nextDueMs"]
                        .as_i64()
                        .map_or(settings.safety_poll, |ms| Duration::from_millis(ms.max(0) as u64 + 20).min(settings.safety_poll));
                    for delivery in deliveries {
                        let (store, client, settings, key) = (store.clone(), client.clone(), settings.clone(), key.clone());
                        in_flight.spawn(deliver(store, client, settings, key, delivery));
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "webhook claim failed; retrying");
                    timer = Duration::from_secs(1);
                }
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = wake.notified() => {}
            Some(_) = in_flight.join_next(), if !in_flight.is_empty() => {}
            _ = tokio::time::sleep(timer) => {}
        }
    }
    let _ = tokio::time::timeout(settings.shutdown_grace, async { while in_flight.join_next().await.is_some() {} }).await;
}

/// Sends one claimed delivery and records the attempt.
async fn deliver(store: Store, client: reqwest::Client, settings: Arc<Settings>, key: Option<Arc<SecretsKey>>, delivery: Claimed) {
    let msg_id = webhooks::message_id(delivery.id);
    let outcome = match webhooks::open(&delivery.secret, key.as_deref(), delivery.webhook_id) {
        Ok(secret) => {
            let body = delivery.payload.to_string();
            webhooks::send(&client, &delivery.url, &msg_id, &secret, &body, settings.allow_private).await
        }
        Err(error) => webhooks::AttemptOutcome { error: Some(error.to_string()), ..Default::default() },
    };
    let retry_in = webhooks::backoff(delivery.attempt, settings.retry_base, settings.retry_max);
    tracing::info!(
        webhook.id = %delivery.webhook_id, webhook.message_id = %msg_id, webhook.event = %delivery.event_type,
        webhook.attempt = delivery.attempt, ok = outcome.ok, status = outcome.status_code, duration_ms = outcome.duration_ms,
        "webhook attempt"
    );
    let label = if outcome.ok { "delivered" } else { "failed" };
    metrics::counter!("agentloop_webhook_attempts_total", "outcome" => label).increment(1);
    metrics::histogram!("agentloop_webhook_attempt_duration_seconds").record(outcome.duration_ms as f64 / 1000.0);
    let arg = json!({
        "id": delivery.id, "attempt": delivery.attempt, "ok": outcome.ok, "statusCode": outcome.status_code,
        "responseBody": outcome.response_body, "error": outcome.error, "durationMs": outcome.duration_ms,
        "retryInMs": retry_in.as_millis() as u64, "maxAttempts": settings.max_attempts,
    });
    match store.call("agentloop_webhook_finish", &arg, Replay::Safe, None).await {
        Ok(result) => {
            if result["status"] == "failed" {
                tracing::warn!(webhook.id = %delivery.webhook_id, webhook.message_id = %msg_id, attempts = delivery.attempt, "webhook delivery failed for good");
                metrics::counter!("agentloop_webhook_deliveries_failed_total").increment(1);
            }
        }
        // The row stays leased to this attempt; when the lease ends it is sent again.
        Err(error) => tracing::warn!(%error, webhook.message_id = %msg_id, "recording a webhook attempt failed; it is sent again after its lease"),
    }
}

/// Deletes deliveries that ended more than `hours` ago, in batches, until none is left or
/// `shutdown`. Returns the number deleted.
pub async fn prune(store: &Store, hours: i64, shutdown: &CancellationToken) -> u64 {
    let mut deleted = 0;
    while !shutdown.is_cancelled() {
        match store.call("agentloop_prune_webhook_deliveries", &json!({"hours": hours, "limit": 500}), Replay::Safe, None).await {
            Ok(result) => {
                let n = result["deleted"].as_u64().unwrap_or(0);
                deleted += n;
                if n < 500 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => {
                tracing::warn!(%error, "pruning webhook deliveries failed; tried again at the next pass");
                break;
            }
        }
    }
    deleted
}
