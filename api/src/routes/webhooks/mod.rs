//! Webhooks on run state (issue 12, part 2): a principal's subscriptions and their deliveries.
//! The outbox and the delivery protocol: `migrations/2026-12-02-000011_webhooks`,
//! `agentloop_shared::webhooks`, `worker/src/webhooks.rs`.

pub mod create_webhook;
pub mod delete_webhook;
pub mod get_webhook;
pub mod list_deliveries;
pub mod list_webhooks;

/// Webhook settings of the api.
pub struct WebhookState {
    /// `WEBHOOK_SECRETS_KEY`: signing secrets are stored encrypted with it.
    pub key: Option<agentloop_shared::webhooks::SecretsKey>,
    /// `WEBHOOK_ALLOW_PRIVATE_TARGETS`.
    pub allow_private: bool,
    /// `WEBHOOK_MAX_PER_PRINCIPAL`.
    pub max_per_principal: u32,
}
