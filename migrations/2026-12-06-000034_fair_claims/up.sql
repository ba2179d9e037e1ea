-- Fair claims between principals. Workers claimed queued runs strictly oldest first, whoever sent
-- them: a principal with MAX_ACTIVE_RUNS_PER_PRINCIPAL slow runs held every worker slot and the
-- one-line turns of others waited behind all of them (acceptance probe E: 39-46 s behind 16 slow
-- runs on 8 slots). A claim now offers its free slots to the principals with queued runs in
-- order of the runs they have running (max-min share); within a principal, oldest first; a
-- principal alone takes every slot. Expired leases (recoveries) still come first, oldest first.

-- The first queued runs of one principal, and the skip scan over principals with queued runs.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                WHERE NOT i.indisvalid AND c.relname = 'runs_queued_by_principal') THEN
        DROP INDEX runs_queued_by_principal;
    END IF;
END $$;
-- commit
SET lock_timeout = 0;
-- commit
CREATE INDEX CONCURRENTLY IF NOT EXISTS runs_queued_by_principal ON runs (principal_id, seq)
    WHERE status = 'queued';
-- commit
-- As in 000033, with the queued runs chosen fairly.
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
    -- Runs whose expired lease this claim takes over, and every run it takes.
    v_recovered uuid[];
    v_take uuid[];
    v_left int;
    -- Where the scan of principals with queued runs starts, and the queued candidates in the
    -- order they are offered.
    v_from uuid;
    v_width int;
    v_order uuid[];
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
    -- Expired leases first (recoveries: their runs had started), oldest first.
    SELECT coalesce(array_agg(id ORDER BY seq), '{}') INTO v_recovered FROM (
        SELECT id, seq FROM runs
         WHERE status = 'running' AND lease_expires_at < now() - v_spare
           -- Never a run the caller still executes (1. above).
           AND NOT (id = ANY(v_inflight))
           AND (v_models IS NULL OR model = ANY(v_models))
         ORDER BY seq LIMIT v_n
           FOR UPDATE SKIP LOCKED) x;
    v_take := v_recovered;
    v_left := v_n - cardinality(v_take);
    IF v_left > 0 THEN
        -- Queued runs, fairly between principals: some principals with queued runs (at most
        -- 2 x the free slots + 2, so the claim's cost does not grow with the number of
        -- principals waiting: a skip scan of runs_queued_by_principal from a random point,
        -- wrapping, so each pass looks at different ones), the first `v_left` queued runs of
        -- each in their own order, ranked by the principal's runs running now plus the run's
        -- place among its principal's candidates, then by age. A principal with many runs therefore takes the free slots only while nobody
        -- else waits; before, runs were claimed strictly oldest first and one principal with
        -- MAX_ACTIVE_RUNS_PER_PRINCIPAL slow runs held every slot while others waited behind
        -- all of them (acceptance probe E: 39-46 s for one-line turns).
        v_from := gen_random_uuid();
        v_width := least(2 * v_left + 2, 64);
        v_order := ARRAY(
            WITH RECURSIVE up AS (
                (SELECT principal_id FROM runs WHERE status = 'queued' AND principal_id >= v_from
                  ORDER BY principal_id LIMIT 1)
                UNION ALL
                SELECT (SELECT r.principal_id FROM runs r
                         WHERE r.status = 'queued' AND r.principal_id > up.principal_id
                         ORDER BY r.principal_id LIMIT 1)
                  FROM up WHERE up.principal_id IS NOT NULL
            ), down AS (
                (SELECT principal_id FROM runs WHERE status = 'queued' AND principal_id < v_from
                  ORDER BY principal_id LIMIT 1)
                UNION ALL
                SELECT (SELECT r.principal_id FROM runs r
                         WHERE r.status = 'queued' AND r.principal_id > down.principal_id
                           AND r.principal_id < v_from
                         ORDER BY r.principal_id LIMIT 1)
                  FROM down WHERE down.principal_id IS NOT NULL
            ), pr AS (
                -- `down` is read only when `up` had fewer (an Append reads its parts in turn).
                SELECT principal_id FROM (
                    (SELECT principal_id FROM up WHERE principal_id IS NOT NULL LIMIT v_width)
                    UNION ALL
                    (SELECT principal_id FROM down WHERE principal_id IS NOT NULL LIMIT v_width)) a
                 LIMIT v_width
            ), cand AS (
                SELECT q.id, q.seq,
                       busy.n + row_number() OVER (PARTITION BY pr.principal_id ORDER BY q.seq) AS share
                  FROM pr
                 CROSS JOIN LATERAL (
                       SELECT id, seq FROM runs
                        WHERE status = 'queued' AND principal_id = pr.principal_id
                          AND NOT (id = ANY(v_inflight))
                          AND (v_models IS NULL OR model = ANY(v_models))
                        ORDER BY seq LIMIT v_left) q
                 CROSS JOIN LATERAL (
                       SELECT count(*) AS n FROM runs
                        WHERE principal_id = pr.principal_id AND status = 'running') busy
            )
            SELECT id FROM cand ORDER BY share, seq);
        -- Lock them in that order, skipping runs another claim holds.
        SELECT v_take || coalesce(array_agg(id ORDER BY ord), '{}') INTO v_take FROM (
            SELECT id, array_position(v_order, id) AS ord FROM runs
             WHERE id = ANY(v_order) AND status = 'queued'
             ORDER BY 2 LIMIT v_left
               FOR UPDATE SKIP LOCKED) x;
        v_left := v_n - cardinality(v_take);
        IF v_left > 0 THEN
            -- Candidates another claim held, or principals past the 64: oldest first.
            SELECT v_take || coalesce(array_agg(id ORDER BY seq), '{}') INTO v_take FROM (
                SELECT id, seq FROM runs
                 WHERE status IN ('queued', 'running') AND status = 'queued'
                   AND NOT (id = ANY(v_inflight || v_take))
                   AND (v_models IS NULL OR model = ANY(v_models))
                 ORDER BY seq LIMIT v_left
                   FOR UPDATE SKIP LOCKED) x;
        END IF;
    END IF;
    WITH u AS (
        UPDATE runs r SET status = 'running', lease_owner = v_owner, lease_epoch = r.lease_epoch + 1,
                          attempts = r.attempts + 1,
                          recoveries = r.recoveries + (r.status = 'running')::int,
                          faults = r.faults + (r.status = 'running')::int,
                          lease_expires_at = now() + v_lease,
                          started_at = coalesce(r.started_at, clock_timestamp()), updated_at = now()
         WHERE r.id = ANY(v_take)
        RETURNING r.seq, r.id, agentloop_run_json(r) AS j
    )
    SELECT coalesce(jsonb_agg(j ORDER BY seq), '[]'::jsonb),
           coalesce(array_agg(id ORDER BY seq) FILTER (WHERE NOT (id = ANY(v_recovered))), '{}'),
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
