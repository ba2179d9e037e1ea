-- Reverts 000040: the claim as in 000019.
CREATE OR REPLACE FUNCTION agentloop_webhook_claim(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_worker text := p ->> 'worker';
    v_lease interval := make_interval(secs => (p ->> 'leaseMs')::bigint / 1000.0);
    v_max int := coalesce((p ->> 'maxAttempts')::int, 8);
    v_out jsonb := '[]'::jsonb;
    d record;
BEGIN
    FOR d IN
        SELECT wd.id, wd.attempts, wd.event_type, wd.payload, w.id AS webhook_id, w.url, w.secret
          FROM webhook_deliveries wd LEFT JOIN webhooks w ON w.id = wd.webhook_id
         WHERE wd.status = 'pending' AND wd.next_attempt_at <= now()
         ORDER BY wd.next_attempt_at
         LIMIT coalesce((p ->> 'limit')::int, 1)
           FOR UPDATE OF wd SKIP LOCKED
    LOOP
        IF d.webhook_id IS NULL THEN
            -- Inserted by a transition that raced the deletion of its webhook.
            DELETE FROM webhook_deliveries WHERE id = d.id;
            CONTINUE;
        END IF;
        UPDATE webhook_attempts
           SET finished_at = now(), error = 'no outcome recorded: the worker sending it stopped (its lease expired)'
         WHERE delivery_id = d.id AND finished_at IS NULL;
        IF d.attempts >= v_max THEN
            UPDATE webhook_deliveries SET status = 'failed', next_attempt_at = NULL, lease_owner = NULL,
                   finished_at = now(), updated_at = now()
             WHERE id = d.id;
            CONTINUE;
        END IF;
        UPDATE webhook_deliveries SET attempts = d.attempts + 1, next_attempt_at = now() + v_lease,
               lease_owner = v_worker, updated_at = now()
         WHERE id = d.id;
        INSERT INTO webhook_attempts (delivery_id, attempt, worker) VALUES (d.id, d.attempts + 1, v_worker);
        v_out := v_out || jsonb_build_object('id', d.id, 'attempt', d.attempts + 1, 'webhookId', d.webhook_id,
                                             'url', d.url, 'secret', d.secret, 'eventType', d.event_type,
                                             'payload', d.payload);
    END LOOP;
    RETURN jsonb_build_object(
        'deliveries', v_out,
        'nextDueMs', (SELECT CASE WHEN min(next_attempt_at) IS NOT NULL
                                  THEN greatest((extract(epoch FROM (min(next_attempt_at) - now())) * 1000)::bigint, 0) END
                        FROM webhook_deliveries WHERE status = 'pending'));
END $$;
DROP INDEX IF EXISTS webhook_deliveries_pending_by_principal;
DROP INDEX IF EXISTS webhook_deliveries_leased_by_principal;
