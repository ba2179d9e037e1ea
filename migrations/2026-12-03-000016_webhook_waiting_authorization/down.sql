DROP TRIGGER runs_webhooks_outbox ON runs;
CREATE TRIGGER runs_webhooks_outbox AFTER UPDATE OF status ON runs
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          AND NEW.status IN ('completed', 'failed', 'cancelled', 'waiting_approval', 'blocked'))
    EXECUTE FUNCTION agentloop_webhooks_outbox();
