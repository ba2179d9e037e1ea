-- The claim's timer counts the caller's own idle runs, the claim takes back what its worker
-- released, and the purge never waits for a thread out of order (issue 9: a lease expiry wakes a
-- worker; transient faults never fail a run; one lock order).
--
-- 1. agentloop_claim's `nextExpiryMs` told the worker when the next lease of ANOTHER owner
--    expires, so it could claim that run then. A run the caller owns but no longer executes
--    (its slice ended and the hand-back could not be written: a database outage longer than the
--    store's retry window; a late statement that extended a lease after the slice gave up) is
--    claimable once its lease expires too, but nothing woke the worker for it: with no other
--    event it waited for the safety poll (60 s by default). The timer now counts every running
--    run but the caller's own in-flight runs (`inflight`, which the worker renews).
--    The start loop moves to agentloop_claim_starts, so a later change to either part replaces
--    less.
--
-- 2. agentloop_purge_threads deleted a thread row and let the foreign keys
--    `threads.parent_thread_id` and `runs.source_thread_id` (ON DELETE SET NULL) lock the
--    referencing rows in storage order, waiting for each. A group of steps or a stream flush
--    holding two such child threads could deadlock with it (docs/architecture.md, "Lock
--    order"). The purge now locks the referencing rows itself, child threads in id order, with
--    SKIP LOCKED: when one is held, the thread row waits for the next pass; the purge never
--    waits for a thread or run lock.
--
-- 3. A run whose slice could not record its end (a transient fault outlasted the store's
--    retries: a full disk, a database that refuses writes) stayed `running` under its live
--    worker until its lease expired; the next claim then counted a recovery and a fault, and a
--    partial outage (claims still written, steps not) cost a fault every lease period until the
--    run failed `abandoned`, although nothing about it was poison. The worker now names such
--    runs in its next claim (`released`); the claim takes them back at once with a new fencing
--    token, without a recovery or a fault. Worker crashes still count: a dead worker releases
--    nothing.
--
-- 4. A hand-back (a transient fault outlasted the slice's lease) counted a fault, so that a run
--    whose own statements keep failing (a statement timeout on its huge context) ends
--    `abandoned`. But when the database was unavailable to everyone — connections lost,
--    shutting down, read-only, disk full, no connection (agentloop_shared::store::fault, "outage")
--    — the run is not to blame, and a long outage failed every active run. The slice end
--    `handback` now carries `fault`; false counts an outage (`runs.outages`), and only every
--    tenth outage a fault (see agentloop_outage_fault). Absent (older workers), it counts.

-- Outages (4. above) are not the run's fault, but a run whose own statements crash the server
-- (its backend OOM-killed) would hand back as an outage forever. So every tenth outage
-- hand-back or release of a run counts one fault: a run is abandoned only after about ten times
-- as many outage interruptions in a row without progress (60 with WORKER_MAX_RECOVERIES 5; 15
-- minutes of outage at a 15 s lease), while a real outage of minutes fails nothing.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS outages integer NOT NULL DEFAULT 0;

-- The fault an outage interruption adds to a run that had `p_outages` before it: 1 on every
-- tenth, else 0 (`p_outage` 0: not an outage, nothing).
CREATE OR REPLACE FUNCTION agentloop_outage_fault(p_outages int, p_outage int) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN p_outage > 0 AND (p_outages + p_outage) % 10 = 0 THEN 1 ELSE 0 END
$$;

-- p as agentloop_claim's; the answer's `starts` as before (000020).
CREATE OR REPLACE FUNCTION agentloop_claim_starts(p jsonb, p_fresh uuid[]) RETURNS jsonb LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_owner text := p ->> 'owner';
    v_start jsonb := p -> 'start';
    v_starts jsonb := '{}'::jsonb;
    v_started int := 0;
    v_id uuid;
    fr runs;
    m jsonb;
BEGIN
    IF jsonb_typeof(v_start) IS DISTINCT FROM 'object' THEN
        RETURN v_starts;
    END IF;
    FOREACH v_id IN ARRAY p_fresh LOOP
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
    RETURN v_starts;
END $$;

-- As in 000021, with the start loop in agentloop_claim_starts, the timer counting the caller's
-- runs that are not in flight, and `released` (3. above).
-- p = {owner, limit, leaseMs, inflight: [run id], adopt, released: [{runId, epoch, fault}], start}.
CREATE OR REPLACE FUNCTION agentloop_claim(p jsonb) RETURNS jsonb LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_owner text := p ->> 'owner';
    v_lease interval := make_interval(secs => (p ->> 'leaseMs')::bigint / 1000.0);
    v_inflight uuid[] := coalesce((SELECT array_agg(x::uuid) FROM jsonb_array_elements_text(p -> 'inflight') x), '{}');
    v_released uuid[] := coalesce((SELECT array_agg((x ->> 'runId')::uuid) FROM jsonb_array_elements(p -> 'released') x), '{}');
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
                            AND NOT (lease_owner IS NOT DISTINCT FROM v_owner AND id = ANY(v_mine))),
        'queuedLeft', EXISTS (SELECT 1 FROM runs WHERE status IN ('queued', 'running') AND status = 'queued'));
END $$;

-- As in 000010, but the rows whose foreign keys point at the thread are locked first, without
-- waiting (see 2. above).
CREATE OR REPLACE FUNCTION agentloop_purge_threads(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_rows bigint := (p ->> 'rows')::bigint;
    v_deleted bigint := 0;
    v_threads int := 0;
    v_thread uuid;
    v_held boolean;
    v_skipped uuid[] := '{}';
BEGIN
    LOOP
        SELECT id INTO v_thread FROM threads
         WHERE deleted_at IS NOT NULL AND deleted_at < now() - make_interval(hours => (p ->> 'keepHours')::int)
           AND NOT (id = ANY(v_skipped))
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
        -- Nothing is left under it: the row itself. Rows of other threads that point at it (a
        -- child thread, a run whose context was compacted from it) get NULL through their
        -- foreign keys, which would lock them in storage order, waiting. So they are locked here
        -- first: child threads in id order, then those runs, none waited for. One held by
        -- another transaction leaves the thread row to the next pass; the batch goes on with the
        -- next deleted thread.
        WITH c AS (SELECT id FROM threads WHERE parent_thread_id = v_thread ORDER BY id FOR NO KEY UPDATE SKIP LOCKED),
             r AS (SELECT id FROM runs WHERE source_thread_id = v_thread ORDER BY id FOR NO KEY UPDATE SKIP LOCKED)
        SELECT (SELECT count(*) FROM c) < (SELECT count(*) FROM threads WHERE parent_thread_id = v_thread)
            OR (SELECT count(*) FROM r) < (SELECT count(*) FROM runs WHERE source_thread_id = v_thread)
          INTO v_held;
        IF v_held THEN
            v_skipped := v_skipped || v_thread;
            v_thread := NULL;
            CONTINUE;
        END IF;
        DELETE FROM threads WHERE id = v_thread;
        v_deleted := v_deleted + 1;
        v_threads := v_threads + 1;
        IF v_deleted >= v_rows THEN
            RETURN jsonb_build_object('deleted', v_deleted, 'threads', v_threads, 'done', false);
        END IF;
        v_thread := NULL;
    END LOOP;
END $$;

-- As in 000014, but a hand-back with `fault: false` counts no fault (4. above).
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
    v_outage int := 0;
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
        WHEN 'handback' THEN v_status := 'queued'; v_step_status := 'interrupted'; v_steps := 0;
            -- An outage (`fault: false`) says nothing about the run (4. above).
            v_outage := CASE WHEN (p_end ->> 'fault')::boolean IS FALSE THEN 1 ELSE 0 END;
            v_faults := 1 - v_outage;
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
                    faults = CASE WHEN (p_usage ->> 'progress')::boolean THEN 0 ELSE faults END + v_faults
                             + agentloop_outage_fault(outages, v_outage),
                    outages = outages + v_outage,
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

