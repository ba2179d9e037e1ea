-- Restores 000021's agentloop_claim, 000010's agentloop_purge_threads and 000014's
-- agentloop_end_run.

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

-- As in 000014.
CREATE OR REPLACE FUNCTION agentloop_end_run(p_run uuid, p_step bigint, p_end jsonb, p_usage jsonb DEFAULT '{}',
                                  p_last_commit jsonb DEFAULT NULL) RETURNS runs LANGUAGE plpgsql AS $$
DECLARE
    r runs;
    v_end text := p_end ->> 'status';
    v_status text;
    v_step_status text;
    v_code text := p_end ->> 'code';
    v_message text := p_end ->> 'message';
    v_steps int := CASE WHEN p_step IS NULL THEN 0 ELSE 1 END;
    v_faults int := 0;
    a tool_approvals;
    v_partial jsonb;
BEGIN
    SELECT * INTO r FROM runs WHERE id = p_run;
    IF v_end IN ('waiting_approval', 'waiting_authorization') AND r.cancel_requested_at IS NOT NULL THEN
        v_end := 'cancelled';
    END IF;
    IF v_end IN ('cancelled', 'interrupted', 'handback', 'failed', 'blocked') THEN
        UPDATE operations SET status = 'uncertain', updated_at = now() WHERE run_id = p_run AND status = 'dispatched';
        IF r.cancel_requested_at IS NOT NULL AND EXISTS (SELECT 1 FROM operations WHERE run_id = p_run AND status = 'uncertain') THEN
            -- The user asked for the end (cancel, interrupt, thread deleted): it ends
            -- `cancelled`; an uncertain operation stays `uncertain` (resolvable for the record)
            -- and its call's result says the outcome is unknown (agentloop_close_dangling).
            v_end := 'cancelled';
            v_code := NULL;
            v_message := NULL;
        ELSIF EXISTS (SELECT 1 FROM operations WHERE run_id = p_run AND status = 'uncertain') THEN
            v_end := 'blocked';
            v_code := 'operation_uncertain';
            v_message := agentloop_blocker_message(p_run);
        END IF;
    END IF;
    CASE v_end
        WHEN 'completed' THEN v_status := 'completed'; v_step_status := 'completed';
        WHEN 'requeued' THEN v_status := 'queued'; v_step_status := 'requeued';
        WHEN 'interrupted' THEN v_status := 'queued'; v_step_status := 'interrupted'; v_steps := 0;
        WHEN 'handback' THEN v_status := 'queued'; v_step_status := 'interrupted'; v_steps := 0; v_faults := 1;
        WHEN 'failed' THEN v_status := 'failed'; v_step_status := 'failed';
        WHEN 'cancelled' THEN v_status := 'cancelled'; v_step_status := 'cancelled';
        WHEN 'waiting_approval' THEN v_status := 'waiting_approval'; v_step_status := 'waiting_approval';
        WHEN 'waiting_authorization' THEN v_status := 'waiting_authorization'; v_step_status := 'waiting_authorization';
        WHEN 'blocked' THEN v_status := 'blocked'; v_step_status := 'blocked';
            v_code := coalesce(v_code, 'operation_uncertain');
            v_message := coalesce(v_message, agentloop_blocker_message(p_run));
        ELSE RAISE EXCEPTION 'unknown slice end %', v_end;
    END CASE;
    IF v_status NOT IN ('failed', 'blocked') THEN
        v_code := NULL;
        v_message := NULL;
    END IF;
    IF p_step IS NOT NULL THEN
        UPDATE run_steps SET status = v_step_status, finished_at = clock_timestamp(), error_code = v_code, error_message = v_message,
                             model_calls = model_calls + coalesce((p_usage ->> 'modelCalls')::int, 0),
                             tool_calls = tool_calls + coalesce((p_usage ->> 'toolCalls')::int, 0),
                             prompt_tokens = prompt_tokens + coalesce((p_usage ->> 'promptTokens')::bigint, 0),
                             completion_tokens = completion_tokens + coalesce((p_usage ->> 'completionTokens')::bigint, 0)
         WHERE id = p_step;
    END IF;
    UPDATE runs SET status = v_status,
                    steps_used = steps_used + v_steps,
                    faults = CASE WHEN (p_usage ->> 'progress')::boolean THEN 0 ELSE faults END + v_faults,
                    tool_calls_used = tool_calls_used + coalesce((p_usage ->> 'toolCalls')::int, 0),
                    prompt_tokens = prompt_tokens + coalesce((p_usage ->> 'promptTokens')::bigint, 0),
                    completion_tokens = completion_tokens + coalesce((p_usage ->> 'completionTokens')::bigint, 0),
                    last_commit = CASE WHEN p_last_commit IS NULL THEN last_commit
                                       ELSE jsonb_set(p_last_commit, '{result,status}', to_jsonb(v_status)) END,
                    lease_owner = NULL, lease_expires_at = NULL,
                    error_code = v_code, error_message = v_message,
                    finished_at = CASE WHEN v_status IN ('completed', 'failed', 'cancelled') THEN clock_timestamp() END,
                    queued_at = CASE WHEN v_status = 'queued' THEN now() ELSE queued_at END,
                    updated_at = now()
     WHERE id = p_run RETURNING * INTO r;
    IF v_status = 'cancelled' AND coalesce((p_end ->> 'keepStreamed')::boolean, false) THEN
        -- SPEC §4: a cancelled stream's partial answer is kept, marked stopped, even when the
        -- worker that streamed it is gone.
        v_partial := agentloop_partial(r.thread_id, p_run);
        IF v_partial ->> 'content' <> '' OR v_partial ->> 'reasoning' <> '' THEN
            PERFORM agentloop_append(r.thread_id, p_run, p_step, jsonb_build_array(jsonb_build_object(
                'role', 'assistant', 'content', to_jsonb(v_partial ->> 'content'),
                'reasoning', nullif(v_partial ->> 'reasoning', ''), 'stopped', true,
                'tokenEstimate', 1 + length(v_partial ->> 'content') / 4,
                'byteSize', octet_length(v_partial ->> 'content') + octet_length(v_partial ->> 'reasoning') + 2)));
        END IF;
    END IF;
    UPDATE threads SET streaming_message = NULL WHERE id = r.thread_id AND streaming_message IS NOT NULL;
    IF v_status IN ('completed', 'failed', 'cancelled') THEN
        PERFORM agentloop_close_dangling(r.thread_id, p_run);
        IF v_status <> 'completed' THEN
            FOR a IN UPDATE tool_approvals SET status = 'cancelled', decided_at = now()
                      WHERE run_id = p_run AND status = 'pending' RETURNING * LOOP
                PERFORM agentloop_journal(r.thread_id, 'approval', agentloop_approval_json(a));
            END LOOP;
        END IF;
        PERFORM agentloop_mcp_cancel_authorizations(p_run);
    END IF;
    PERFORM agentloop_journal(r.thread_id, 'run', agentloop_run_json(r));
    IF v_status IN ('completed', 'failed', 'cancelled') THEN
        PERFORM agentloop_promote(r.thread_id);
    ELSIF v_status = 'queued' THEN
        PERFORM agentloop_wake('queued:' || p_run);
    ELSIF v_status = 'waiting_approval' THEN
        PERFORM agentloop_wake('approval:' || p_run);
    END IF;
    RETURN r;
END $$;


DROP FUNCTION agentloop_outage_fault(int, int);
ALTER TABLE runs DROP COLUMN IF EXISTS outages;
