-- Fair webhook deliveries between principals (acceptance probe H). Deliveries were claimed
-- strictly by `next_attempt_at` whoever owned them: one tenant whose endpoints never answer (20
-- webhooks on run.completed, each attempt held to WEBHOOK_TIMEOUT_MS) kept every worker's
-- delivery slots busy with its backlog, and another tenant's run.completed was not delivered
-- after 240 s. Now one principal has at most p.perPrincipal attempts in flight across the fleet
-- (WEBHOOK_CONCURRENCY_PER_PRINCIPAL, default 2), and a claim offers its slots to the principals
-- with due deliveries in order of their attempts in flight (each one's own oldest first), with
-- bounded work: a skip scan of at most 2 x limit + 2 principals from a random point.

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                WHERE NOT i.indisvalid AND c.relname IN ('webhook_deliveries_pending_by_principal',
                                                          'webhook_deliveries_leased_by_principal')) THEN
        DROP INDEX IF EXISTS webhook_deliveries_pending_by_principal;
        DROP INDEX IF EXISTS webhook_deliveries_leased_by_principal;
    END IF;
END $$;
-- commit
SET lock_timeout = 0;
-- commit
CREATE INDEX CONCURRENTLY IF NOT EXISTS webhook_deliveries_pending_by_principal
    ON webhook_deliveries (principal_id, next_attempt_at) WHERE status = 'pending';
-- commit
CREATE INDEX CONCURRENTLY IF NOT EXISTS webhook_deliveries_leased_by_principal
    ON webhook_deliveries (principal_id) WHERE status = 'pending' AND lease_owner IS NOT NULL;
-- commit
-- As in 000019, with the deliveries chosen fairly.
CREATE OR REPLACE FUNCTION agentloop_webhook_claim(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_worker text := p ->> 'worker';
    v_lease interval := make_interval(secs => (p ->> 'leaseMs')::bigint / 1000.0);
    v_max int := coalesce((p ->> 'maxAttempts')::int, 8);
    v_limit int := greatest(coalesce((p ->> 'limit')::int, 1), 1);
    v_cap int := greatest(coalesce((p ->> 'perPrincipal')::int, 2), 1);
    v_from uuid := gen_random_uuid();
    v_width int := least(2 * greatest(coalesce((p ->> 'limit')::int, 1), 1) + 2, 64);
    v_order uuid[];
    v_out jsonb := '[]'::jsonb;
    d record;
BEGIN
    -- Principals with pending deliveries (a skip scan of webhook_deliveries_pending_by_principal
    -- from a random point, wrapping), the due deliveries of each under its cap, ranked by the
    -- principal's attempts in flight plus the delivery's place among its own, then by age.
    v_order := ARRAY(
        WITH RECURSIVE up AS (
            (SELECT principal_id FROM webhook_deliveries WHERE status = 'pending' AND principal_id >= v_from
              ORDER BY principal_id LIMIT 1)
            UNION ALL
            SELECT (SELECT w.principal_id FROM webhook_deliveries w
                     WHERE w.status = 'pending' AND w.principal_id > up.principal_id
                     ORDER BY w.principal_id LIMIT 1)
              FROM up WHERE up.principal_id IS NOT NULL
        ), down AS (
            (SELECT principal_id FROM webhook_deliveries WHERE status = 'pending' AND principal_id < v_from
              ORDER BY principal_id LIMIT 1)
            UNION ALL
            SELECT (SELECT w.principal_id FROM webhook_deliveries w
                     WHERE w.status = 'pending' AND w.principal_id > down.principal_id AND w.principal_id < v_from
                     ORDER BY w.principal_id LIMIT 1)
              FROM down WHERE down.principal_id IS NOT NULL
        ), pr AS (
            SELECT principal_id FROM (
                (SELECT principal_id FROM up WHERE principal_id IS NOT NULL LIMIT v_width)
                UNION ALL
                (SELECT principal_id FROM down WHERE principal_id IS NOT NULL LIMIT v_width)) a
             LIMIT v_width
        ), cand AS (
            SELECT q.id, q.next_attempt_at,
                   busy.n + row_number() OVER (PARTITION BY pr.principal_id ORDER BY q.next_attempt_at) AS share
              FROM pr
             CROSS JOIN LATERAL (
                   SELECT count(*) AS n FROM webhook_deliveries
                    WHERE principal_id = pr.principal_id AND status = 'pending'
                      AND lease_owner IS NOT NULL AND next_attempt_at > now()) busy
             CROSS JOIN LATERAL (
                   SELECT id, next_attempt_at FROM webhook_deliveries
                    WHERE principal_id = pr.principal_id AND status = 'pending' AND next_attempt_at <= now()
                    ORDER BY next_attempt_at LIMIT greatest(v_cap - busy.n, 0)) q
        )
        SELECT id FROM cand WHERE share <= v_cap ORDER BY share, next_attempt_at LIMIT v_limit * 2);
    FOR d IN
        SELECT wd.id, wd.attempts, wd.event_type, wd.payload, w.id AS webhook_id, w.url, w.secret
          FROM webhook_deliveries wd LEFT JOIN webhooks w ON w.id = wd.webhook_id
         WHERE wd.id = ANY(v_order) AND wd.status = 'pending' AND wd.next_attempt_at <= now()
         ORDER BY array_position(v_order, wd.id)
         LIMIT v_limit
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
    -- When to claim again without a wake-up: the next retry or lease end. Due deliveries left
    -- here are of principals at their cap (or taken by a concurrent claim): an attempt ending
    -- frees its worker's slot, which claims again at once.
    RETURN jsonb_build_object(
        'deliveries', v_out,
        'nextDueMs', (SELECT CASE WHEN min(next_attempt_at) IS NOT NULL
                                  THEN greatest((extract(epoch FROM (min(next_attempt_at) - now())) * 1000)::bigint, 0) END
                        FROM webhook_deliveries WHERE status = 'pending' AND next_attempt_at > now()));
END $$;
