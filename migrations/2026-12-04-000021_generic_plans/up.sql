-- Step functions keep their plans (issue 9: throughput).
--
-- PL/pgSQL caches one plan per statement and session, but the plan cache re-plans a statement
-- with parameters on EVERY execution when its generic plan looks costlier than the custom
-- plans it made for the first five executions. Three hot statements were in that state, and
-- pg_stat_statements (track_planning) measured them re-planned on every call in bench-scheduler:
--
-- - the claim's `WITH c AS (... LIMIT v_n FOR UPDATE SKIP LOCKED) ...`: a generic plan prices
--   `LIMIT $n` at 10% of the rows, a custom one at n; planning took longer than executing
--   (0.82 against 0.46 ms per call);
-- - agentloop_slice_start's answer: its `CASE WHEN v_open IS NULL ...` folds away two subqueries
--   in a custom plan only (0.35 ms per call);
-- - agentloop_notify's `id = ANY(p_threads)`: a generic plan expects ten array elements (0.11
--   ms per call, on every step and command).
--
-- The first two run with plan_cache_mode = force_generic_plan: each statement is planned once per
-- session (test `step_functions_are_planned_once_per_session`). Their generic plans use the same
-- indexes as their custom plans (checked with auto_explain), but for one: the claim's update
-- joined its locked candidates, which a generic plan expects to be 10% of the table (LIMIT $n),
-- by merging them with a full scan of runs_pkey (2,100 buffers per claim in bench-scheduler,
-- against 125). Its update now also names the candidates' ids (`r.id = ANY(...)`), a lookup in
-- runs_pkey whatever the estimate. The setting holds for what they call (agentloop_slice_start's
-- helpers; the same test covers them). A SET clause restores only the setting it names at the
-- function's exit: the transaction-local `agentloop.wake` and `agentloop.defer_notify` and the
-- session's deferred notifications (`agentloop.deferred`) pass through unchanged. Commands and
-- agentloop_commit keep the default: their statements settle on generic plans by themselves,
-- and `auto` still protects them from a generic plan that would scan.
ALTER FUNCTION agentloop_slice_start(jsonb) SET plan_cache_mode = force_generic_plan;

-- As in 000020, with the update's id lookup and the SET clause.
CREATE OR REPLACE FUNCTION agentloop_claim(p jsonb) RETURNS jsonb LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_owner text := p ->> 'owner';
    v_lease interval := make_interval(secs => (p ->> 'leaseMs')::bigint / 1000.0);
    v_inflight uuid[] := coalesce((SELECT array_agg(x::uuid) FROM jsonb_array_elements_text(p -> 'inflight') x), '{}');
    v_start jsonb := p -> 'start';
    v_adopted jsonb;
    v_claimed jsonb;
    v_fresh uuid[];
    v_starts jsonb := '{}'::jsonb;
    v_n int;
    v_started int := 0;
    v_id uuid;
    fr runs;
    m jsonb;
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
        SELECT id, status AS prior FROM runs
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
          FROM c WHERE r.id = ANY(ARRAY(SELECT id FROM c)) AND r.id = c.id
        RETURNING r.seq, r.id, c.prior, agentloop_run_json(r) AS j
    )
    SELECT coalesce(jsonb_agg(j ORDER BY seq), '[]'::jsonb),
           coalesce(array_agg(id ORDER BY seq) FILTER (WHERE prior = 'queued'), '{}')
      INTO v_claimed, v_fresh FROM u;

    IF jsonb_typeof(v_start) = 'object' THEN
        FOREACH v_id IN ARRAY v_fresh LOOP
            EXIT WHEN v_started >= coalesce((v_start ->> 'limit')::int, 0)
                   OR pg_column_size(v_starts) >= coalesce((v_start ->> 'maxBytes')::bigint, 4194304);
            SELECT * INTO fr FROM runs WHERE id = v_id;
            m := v_start -> 'models' -> fr.model;
            CONTINUE WHEN jsonb_typeof(m) IS DISTINCT FROM 'object'
                       OR fr.faults > coalesce((v_start ->> 'maxRecoveries')::int, 2147483647)
                       OR fr.cancel_requested_at IS NOT NULL
                       OR fr.steps_used >= fr.max_steps;
            BEGIN
                PERFORM 1 FROM threads WHERE id = fr.thread_id FOR NO KEY UPDATE SKIP LOCKED;
                IF FOUND THEN
                    v_starts := v_starts || jsonb_build_object(fr.id::text, agentloop_slice_start(jsonb_build_object(
                        'runId', fr.id, 'threadId', fr.thread_id, 'owner', v_owner, 'epoch', fr.lease_epoch,
                        'leaseMs', (p ->> 'leaseMs')::bigint, 'stepSequence', fr.steps_used + 1,
                        'model', m -> 'model', 'toolTokens', m -> 'toolTokens', 'contextLimit', m -> 'contextLimit')));
                    v_started := v_started + 1;
                END IF;
            EXCEPTION WHEN OTHERS THEN
                -- Rolled back to before this start; the worker starts the run itself.
                NULL;
            END;
        END LOOP;
    END IF;

    IF jsonb_array_length(v_claimed) = v_n AND v_n > 0 THEN
        -- Every slot filled: the caller claims again when a slot frees; no timer needed.
        RETURN jsonb_build_object('runs', v_adopted || v_claimed, 'starts', v_starts,
                                  'nextExpiryMs', NULL, 'queuedLeft', false);
    END IF;
    RETURN jsonb_build_object(
        'runs', v_adopted || v_claimed,
        'starts', v_starts,
        'nextExpiryMs', (SELECT (extract(epoch FROM (min(lease_expires_at) - now())) * 1000)::bigint
                           FROM runs WHERE status IN ('queued', 'running') AND status = 'running'
                            AND lease_owner IS DISTINCT FROM v_owner),
        'queuedLeft', EXISTS (SELECT 1 FROM runs WHERE status IN ('queued', 'running') AND status = 'queued'));
END $$;


-- agentloop_notify (as in 000018) reads each thread's journal position with a point lookup,
-- whose generic plan is its custom plan, instead of `id = ANY(p_threads)`: no SET clause (and its
-- save and restore of the setting) on a function every command calls. One thread (nearly every
-- call) needs no sorting; several are sorted and deduplicated as before.
CREATE OR REPLACE FUNCTION agentloop_notify(p_threads uuid[]) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_ids uuid[] := p_threads;
    v_id uuid;
    v_seq bigint;
    v_entry text;
    v_payload text := '';
    v_wake text := nullif(current_setting('agentloop.wake', true), '');
BEGIN
    IF cardinality(v_ids) > 1 THEN
        v_ids := ARRAY(SELECT DISTINCT x FROM unnest(p_threads) x WHERE x IS NOT NULL ORDER BY x);
    END IF;
    FOREACH v_id IN ARRAY coalesce(v_ids, '{}') LOOP
        SELECT last_event_sequence INTO v_seq FROM threads WHERE id = v_id;
        CONTINUE WHEN v_seq IS NULL OR v_seq <= 0;
        v_entry := v_id::text || ':' || v_seq::text;
        IF octet_length(v_payload) + octet_length(v_entry) > 7900 THEN
            PERFORM agentloop_send('agentloop_threads', v_payload);
            v_payload := '';
        END IF;
        v_payload := CASE WHEN v_payload = '' THEN v_entry ELSE v_payload || ',' || v_entry END;
    END LOOP;
    IF v_payload <> '' THEN
        PERFORM agentloop_send('agentloop_threads', v_payload);
    END IF;
    IF v_wake IS NOT NULL THEN
        PERFORM agentloop_send('agentloop_runs', left(v_wake, 7900));
        PERFORM set_config('agentloop.wake', '', true);
    END IF;
END $$;

-- The search text of a message (000007), evaluated for the messages_search index on every user
-- and assistant message written. As a SQL function with a subquery it cannot be inlined, and
-- PostgreSQL 15 plans a non-inlined SQL function's body on every call (0.06 ms per message);
-- PL/pgSQL plans it once per session. Same result for every input, so the index stays valid.
CREATE OR REPLACE FUNCTION agentloop_search_text(c jsonb) RETURNS text LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN CASE jsonb_typeof(c)
        WHEN 'string' THEN c #>> '{}'
        WHEN 'array' THEN (SELECT string_agg(e ->> 'text', ' ') FROM jsonb_array_elements(c) e
                            WHERE jsonb_typeof(e) = 'object' AND e ->> 'type' = 'text')
        ELSE '' END;
END $$;
