-- Slots are given back at step boundaries when another principal waits with fewer runs running
-- (acceptance probe H, H-3: fair claims hand a FREE slot to the principal with the fewest runs
-- running, but nothing freed a slot: one principal whose runs were long agent loops held every
-- slot for whole slices — up to WORKER_TOOL_CALL_LIMIT tool calls and as many model calls —
-- while another principal's one-line turn waited). A worker whose slots are all busy, having
-- seen a run queued since, asks this between two steps of a slice (after a tool batch is
-- committed), at most once per WORKER_YIELD_CHECK_MS; when it answers true, the slice ends
-- `interrupted` (back to `queued`, the step not consumed) and the free slot goes, by the fair
-- claim, to the principal that waited.
--
-- p = {runId, models: [text] | null, waitedMs}: true when a principal other than the run's has a
-- queued run (of a model the caller serves) waiting at least `waitedMs`, and runs at least two
-- fewer than the run's principal runs now, fleet-wide — so a slot handed over never makes the giver
-- the one with fewer (no ping-pong between two principals). Bounded work: the running count of
-- the caller, then a skip scan of at most 64 principals with queued runs, each with its oldest
-- queued run and its running count (indexes runs_queued_by_principal, runs_principal_open_v2).
CREATE OR REPLACE FUNCTION agentloop_slot_wanted(p jsonb) RETURNS jsonb LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_principal uuid := (SELECT principal_id FROM runs WHERE id = (p ->> 'runId')::uuid);
    v_models text[] := CASE WHEN jsonb_typeof(p -> 'models') = 'array'
                            THEN ARRAY(SELECT jsonb_array_elements_text(p -> 'models')) END;
    v_waited interval := make_interval(secs => coalesce((p ->> 'waitedMs')::bigint, 0) / 1000.0);
    v_mine bigint;
BEGIN
    SELECT count(*) INTO v_mine FROM runs WHERE principal_id = v_principal AND status = 'running';
    IF v_mine < 2 THEN
        RETURN '{"wanted": false}'::jsonb;
    END IF;
    RETURN jsonb_build_object('wanted', EXISTS (
        WITH RECURSIVE pr AS (
            (SELECT principal_id FROM runs WHERE status = 'queued' ORDER BY principal_id LIMIT 1)
            UNION ALL
            SELECT (SELECT r.principal_id FROM runs r
                     WHERE r.status = 'queued' AND r.principal_id > pr.principal_id
                     ORDER BY r.principal_id LIMIT 1)
              FROM pr WHERE pr.principal_id IS NOT NULL
        ), other AS (
            SELECT principal_id FROM pr
             WHERE principal_id IS NOT NULL AND principal_id <> v_principal
             LIMIT 64
        )
        SELECT 1 FROM other o
         WHERE (SELECT q.queued_at FROM runs q
                 WHERE q.status = 'queued' AND q.principal_id = o.principal_id
                   AND (v_models IS NULL OR q.model = ANY (v_models))
                 ORDER BY q.seq LIMIT 1) <= now() - v_waited
           AND (SELECT count(*) FROM runs r WHERE r.principal_id = o.principal_id AND r.status = 'running') + 2 <= v_mine));
END $$;
