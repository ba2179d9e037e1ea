-- Restores 000021's agentloop_claim and 000010's agentloop_purge_threads.

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

DROP FUNCTION agentloop_claim_starts(jsonb, uuid[]);

-- As in 000010.
CREATE OR REPLACE FUNCTION agentloop_purge_threads(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_rows bigint := (p ->> 'rows')::bigint;
    v_deleted bigint := 0;
    v_threads int := 0;
    v_thread uuid;
BEGIN
    LOOP
        SELECT id INTO v_thread FROM threads
         WHERE deleted_at IS NOT NULL AND deleted_at < now() - make_interval(hours => (p ->> 'keepHours')::int)
         ORDER BY deleted_at LIMIT 1 FOR UPDATE SKIP LOCKED;
        IF v_thread IS NULL THEN
            RETURN jsonb_build_object('deleted', v_deleted, 'threads', v_threads, 'done', true);
        END IF;
        v_deleted := v_deleted + agentloop_delete_some('thread_events', 'thread_id = $1', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('messages', 'thread_id = $1', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('context_snapshots', 'thread_id = $1', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('tool_approvals', 'thread_id = $1', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('operations', 'thread_id = $1', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('run_steps',
            'run_id IN (SELECT id FROM runs WHERE thread_id = $1)', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('runs', 'thread_id = $1', v_thread, v_rows - v_deleted);
        IF v_deleted >= v_rows THEN
            RETURN jsonb_build_object('deleted', v_deleted, 'threads', v_threads, 'done', false);
        END IF;
        -- Nothing is left under it: the row itself (children of other threads that point at it —
        -- a compaction's source, a child thread — get NULL through their indexed foreign keys).
        DELETE FROM threads WHERE id = v_thread;
        v_deleted := v_deleted + 1;
        v_threads := v_threads + 1;
        IF v_deleted >= v_rows THEN
            RETURN jsonb_build_object('deleted', v_deleted, 'threads', v_threads, 'done', false);
        END IF;
        v_thread := NULL;
    END LOOP;
END $$;
