-- Development only (migrations/README.md).
DROP TRIGGER IF EXISTS runs_webhooks_outbox ON runs;
DROP FUNCTION IF EXISTS agentloop_prune_webhook_deliveries(jsonb);
DROP FUNCTION IF EXISTS agentloop_webhook_finish(jsonb);
DROP FUNCTION IF EXISTS agentloop_webhook_claim(jsonb);
DROP FUNCTION IF EXISTS agentloop_webhook_deliveries(jsonb);
DROP FUNCTION IF EXISTS agentloop_webhooks_read(jsonb);
DROP FUNCTION IF EXISTS agentloop_webhook_delete(jsonb);
DROP FUNCTION IF EXISTS agentloop_webhook_create(jsonb);
DROP FUNCTION IF EXISTS agentloop_webhook_json(webhooks);
DROP FUNCTION IF EXISTS agentloop_webhooks_outbox();
DROP TABLE IF EXISTS webhook_attempts;
DROP TABLE IF EXISTS webhook_deliveries;
DROP TABLE IF EXISTS webhooks;
