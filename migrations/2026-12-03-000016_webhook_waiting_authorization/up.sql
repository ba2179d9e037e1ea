-- Webhooks learn of runs parked for an MCP sign-in (`run.waiting_authorization`, issue 12 part
-- 5): the outbox trigger of 000011 fires for that status too. Drop and create in one
-- transaction: a brief lock on runs, taken under the migration's lock_timeout.
DROP TRIGGER runs_webhooks_outbox ON runs;
CREATE TRIGGER runs_webhooks_outbox AFTER UPDATE OF status ON runs
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          AND NEW.status IN ('completed', 'failed', 'cancelled', 'waiting_approval', 'waiting_authorization', 'blocked'))
    EXECUTE FUNCTION agentloop_webhooks_outbox();
