-- Back to 000005's body.
CREATE OR REPLACE FUNCTION agentloop_claim(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_owner text := p ->> 'owner';
    v_lease interval := make_interval(secs => (p ->> 'leaseMs')::bigint / 1000.0);
    v_inflight uuid[] := coalesce((SELECT array_agg(x::uuid) FROM jsonb_array_elements_text(p -> 'inflight') x), '{}');
    v_adopted jsonb;
    v_claimed jsonb;
    v_n int;
BEGIN
    IF coalesce((p ->> 'adopt')::boolean, false) THEN
        WITH a AS (
            UPDATE runs r SET lease_expires_at = now() + v_lease
             WHERE r.status = 'running' AND r.lease_owner = v_owner AND r.lease_expires_at > now()
               AND NOT (r.id = ANY(v_inflight))
            RETURNING r.seq, agentloop_run_json(r) AS j
        )
        SELECT coalesce(jsonb_agg(j ORDER BY seq), '[]'::jsonb) INTO v_adopted FROM a;
    ELSE
        v_adopted := '[]'::jsonb;
    END IF;
    v_n := greatest((p ->> 'limit')::int - jsonb_array_length(v_adopted), 0);
    WITH c AS (
        SELECT id FROM runs
         WHERE status IN ('queued', 'running') AND (status = 'queued' OR lease_expires_at < now())
         ORDER BY seq LIMIT v_n
           FOR UPDATE SKIP LOCKED
    ), u AS (
        UPDATE runs r SET status = 'running', lease_owner = v_owner, lease_epoch = r.lease_epoch + 1,
                          attempts = r.attempts + 1,
                          recoveries = r.recoveries + (r.status = 'running')::int,
                          faults = r.faults + (r.status = 'running')::int,
                          lease_expires_at = now() + v_lease,
                          started_at = coalesce(r.started_at, clock_timestamp()), updated_at = now()
          FROM c WHERE r.id = c.id
        RETURNING r.seq, agentloop_run_json(r) AS j
    )
    SELECT coalesce(jsonb_agg(j ORDER BY seq), '[]'::jsonb) INTO v_claimed FROM u;
    IF jsonb_array_length(v_claimed) = v_n AND v_n > 0 THEN
        -- Every slot filled: the caller claims again when a slot frees; no timer needed.
        RETURN jsonb_build_object('runs', v_adopted || v_claimed, 'nextExpiryMs', NULL, 'queuedLeft', false);
    END IF;
    RETURN jsonb_build_object(
        'runs', v_adopted || v_claimed,
        'nextExpiryMs', (SELECT (extract(epoch FROM (min(lease_expires_at) - now())) * 1000)::bigint
                           FROM runs WHERE status IN ('queued', 'running') AND status = 'running'
                            AND lease_owner IS DISTINCT FROM v_owner),
        'queuedLeft', EXISTS (SELECT 1 FROM runs WHERE status IN ('queued', 'running') AND status = 'queued'));
END $$;
