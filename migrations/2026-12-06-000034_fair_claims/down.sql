-- Reverts 000034: agentloop_claim as in 000033 (oldest first, whoever sent the run).
CREATE OR REPLACE FUNCTION agentloop_claim(p jsonb) RETURNS jsonb LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_owner text := p ->> 'owner';
    v_lease interval := make_interval(secs => (p ->> 'leaseMs')::bigint / 1000.0);
    v_inflight uuid[] := coalesce((SELECT array_agg(x::uuid) FROM jsonb_array_elements_text(p -> 'inflight') x), '{}');
    v_released uuid[] := coalesce((SELECT array_agg((x ->> 'runId')::uuid) FROM jsonb_array_elements(p -> 'released') x), '{}');
    v_spare interval := make_interval(secs => coalesce((p ->> 'spareMs')::bigint, 0) / 1000.0);
    -- The models the caller serves (NULL: any).
    v_models text[] := CASE WHEN jsonb_typeof(p -> 'models') = 'array'
                            THEN ARRAY(SELECT jsonb_array_elements_text(p -> 'models')) END;
    v_adopted jsonb;
    v_claimed jsonb;
    v_fresh uuid[];
    v_mine uuid[];
    v_starts jsonb;
    v_n int;
BEGIN
    IF coalesce((p ->> 'adopt')::boolean, false) THEN
        WITH a AS (
            UPDATE runs r SET lease_expires_at = now() + v_lease
             WHERE r.status = 'running' AND r.lease_owner = v_owner AND r.lease_expires_at > now()
               -- A released run gets a new fencing token below: a statement of its old slice may
               -- still be on its way.
               AND NOT (r.id = ANY(v_inflight || v_released))
            RETURNING r.seq, r.id, agentloop_run_json(r) AS j
        )
        SELECT coalesce(jsonb_agg(j ORDER BY seq), '[]'::jsonb), coalesce(array_agg(id), '{}')
          INTO v_adopted, v_mine FROM a;
    ELSE
        v_adopted := '[]'::jsonb;
        v_mine := '{}';
    END IF;
    -- Runs the caller released (3. above): still running under its owner and the epoch its
    -- slice had, they are taken again at once, whatever their lease, with a new fencing token
    -- but no recovery: their worker is alive, it only could not write. A fault only when the
    -- release says so (`fault`: the end it could not write was a faulting hand-back, or what
    -- stopped the write was not an outage), so a poison run still ends `abandoned`.
    WITH x AS (
        SELECT r.id, coalesce(rel.fault, true) AS fault FROM runs r
          JOIN jsonb_to_recordset(coalesce(p -> 'released', '[]'::jsonb)) AS rel("runId" uuid, epoch bigint, fault boolean)
            ON r.id = rel."runId" AND r.lease_epoch = rel.epoch
         WHERE r.status = 'running' AND r.lease_owner = v_owner AND NOT (r.id = ANY(v_mine || v_inflight))
         ORDER BY r.seq LIMIT greatest((p ->> 'limit')::int - jsonb_array_length(v_adopted), 0)
           FOR UPDATE OF r SKIP LOCKED
    ), u AS (
        UPDATE runs r SET lease_epoch = r.lease_epoch + 1, attempts = r.attempts + 1,
                          faults = r.faults + x.fault::int + agentloop_outage_fault(r.outages, (NOT x.fault)::int),
                          outages = r.outages + (NOT x.fault)::int,
                          lease_expires_at = now() + v_lease, updated_at = now()
          FROM x WHERE r.id = x.id
        RETURNING r.seq, r.id, agentloop_run_json(r) AS j
    )
    SELECT v_adopted || coalesce(jsonb_agg(j ORDER BY seq), '[]'::jsonb), v_mine || coalesce(array_agg(id), '{}')
      INTO v_adopted, v_mine FROM u;
    v_n := greatest((p ->> 'limit')::int - jsonb_array_length(v_adopted), 0);
    WITH c AS (
        SELECT id, status AS prior FROM runs
         WHERE status IN ('queued', 'running') AND (status = 'queued' OR lease_expires_at < now() - v_spare)
           -- Never a run the caller still executes (1. above).
           AND NOT (id = ANY(v_inflight))
           AND (v_models IS NULL OR model = ANY(v_models))
         ORDER BY seq LIMIT v_n
           FOR UPDATE SKIP LOCKED
    ), u AS (
        UPDATE runs r SET status = 'running', lease_owner = v_owner, lease_epoch = r.lease_epoch + 1,
                          attempts = r.attempts + 1,
                          recoveries = r.recoveries + (r.status = 'running')::int,
                          faults = r.faults + (r.status = 'running')::int,
                          lease_expires_at = now() + v_lease,
                          started_at = coalesce(r.started_at, clock_timestamp()), updated_at = now()
          FROM c WHERE r.id = ANY(ARRAY(SELECT id FROM c)) AND r.id = c.id
        RETURNING r.seq, r.id, c.prior, agentloop_run_json(r) AS j
    )
    SELECT coalesce(jsonb_agg(j ORDER BY seq), '[]'::jsonb),
           coalesce(array_agg(id ORDER BY seq) FILTER (WHERE prior = 'queued'), '{}'),
           v_mine || v_inflight || coalesce(array_agg(id), '{}')
      INTO v_claimed, v_fresh, v_mine FROM u;

    v_starts := agentloop_claim_starts(p, v_fresh);

    IF jsonb_array_length(v_claimed) = v_n AND v_n > 0 THEN
        -- Every slot filled: the caller claims again when a slot frees; no timer needed.
        RETURN jsonb_build_object('runs', v_adopted || v_claimed, 'starts', v_starts,
                                  'nextExpiryMs', NULL, 'queuedLeft', false);
    END IF;
    RETURN jsonb_build_object(
        'runs', v_adopted || v_claimed,
        'starts', v_starts,
        -- Every lease that can expire into a claim: other owners' runs, and the caller's own
        -- runs it does not execute (in flight, adopted or claimed now, it renews them).
        'nextExpiryMs', (SELECT (extract(epoch FROM (min(lease_expires_at) - now())) * 1000)::bigint
                           FROM runs WHERE status IN ('queued', 'running') AND status = 'running'
                            AND NOT (lease_owner IS NOT DISTINCT FROM v_owner AND id = ANY(v_mine))
                            AND (v_models IS NULL OR model = ANY(v_models))
                            -- Spared runs (2. above) are not due before the window ends.
                            AND (v_spare = interval '0' OR lease_expires_at < now() - v_spare)),
        'queuedLeft', EXISTS (SELECT 1 FROM runs WHERE status IN ('queued', 'running') AND status = 'queued'
                                AND (v_models IS NULL OR model = ANY(v_models))));
END $$;
DROP INDEX IF EXISTS runs_queued_by_principal;
