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

-- The slice start answers the step's tool calls so far (`step.toolCalls`): a step re-opened after
-- a slot was given back (or a shutdown hand-back, or a recovery) goes on counting towards
-- WORKER_TOOL_CALL_LIMIT instead of starting again at zero (verification probe L, L-1: with
-- `maxSteps: 1`, runs whose slot was given back made 30 to 49 tool calls, others stopped at 25).
-- As in 000005 (with 000021's plan setting), the answer's `step` extended.
CREATE OR REPLACE FUNCTION agentloop_slice_start(p jsonb) RETURNS jsonb LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_run uuid := (p ->> 'runId')::uuid;
    v_thread uuid := (p ->> 'threadId')::uuid;
    t threads;
    r runs;
    s run_steps;
    v_context jsonb;
    v_tokens int;
    v_open jsonb;
    v_seq bigint;
BEGIN
    SELECT * INTO t FROM threads WHERE id = v_thread FOR NO KEY UPDATE;
    r := agentloop_fence(p);
    IF r.id IS NULL THEN
        RETURN '{"lost": true}'::jsonb;
    END IF;
    UPDATE operations SET status = 'uncertain', updated_at = now() WHERE run_id = v_run AND status = 'dispatched';
    IF EXISTS (SELECT 1 FROM operations WHERE run_id = v_run AND status = 'uncertain') THEN
        INSERT INTO run_steps (run_id, sequence, idempotency_key, status, attempt, lease_epoch, worker_id, model)
        VALUES (v_run, (p ->> 'stepSequence')::int, 'run:' || v_run || ':step:' || (p ->> 'stepSequence'),
                'running', r.attempts, r.lease_epoch, r.lease_owner, p ->> 'model')
        ON CONFLICT (idempotency_key) DO UPDATE SET status = 'running', attempt = EXCLUDED.attempt
        RETURNING * INTO s;
        r := agentloop_end_run(v_run, s.id, '{"status": "blocked"}'::jsonb);
        PERFORM agentloop_notify(ARRAY[v_thread]);
        RETURN jsonb_build_object('ended', 'blocked', 'run', agentloop_run_json(r));
    END IF;
    v_context := agentloop_context(v_thread);
    v_tokens := least((v_context ->> 'tokens')::bigint + coalesce((p ->> 'toolTokens')::bigint, 0), 2147483647)::int;
    INSERT INTO run_steps (run_id, sequence, idempotency_key, status, attempt, lease_epoch, worker_id, model, context_tokens)
    VALUES (v_run, (p ->> 'stepSequence')::int, 'run:' || v_run || ':step:' || (p ->> 'stepSequence'),
            'running', r.attempts, r.lease_epoch, r.lease_owner, p ->> 'model', v_tokens)
    ON CONFLICT (idempotency_key) DO UPDATE
        SET status = 'running', attempt = EXCLUDED.attempt, lease_epoch = EXCLUDED.lease_epoch,
            worker_id = EXCLUDED.worker_id, model = EXCLUDED.model, started_at = clock_timestamp(),
            finished_at = NULL, error_code = NULL, error_message = NULL, context_tokens = EXCLUDED.context_tokens
    RETURNING * INTO s;
    UPDATE runs SET context_tokens = v_tokens, context_limit = (p ->> 'contextLimit')::int,
                    lease_expires_at = now() + make_interval(secs => (p ->> 'leaseMs')::bigint / 1000.0)
     WHERE id = v_run RETURNING * INTO r;
    -- The `run` event and the context size in one update of the thread.
    UPDATE threads SET context_tokens = v_tokens, last_event_sequence = last_event_sequence + 1
     WHERE id = v_thread RETURNING last_event_sequence INTO v_seq;
    INSERT INTO thread_events (thread_id, sequence, kind, payload) VALUES (v_thread, v_seq, 'run', agentloop_run_json(r));
    v_open := agentloop_open_calls(v_thread, v_run);
    PERFORM agentloop_notify(ARRAY[v_thread]);
    RETURN jsonb_build_object(
        'step', jsonb_build_object('id', s.id, 'sequence', s.sequence, 'toolCalls', s.tool_calls),
        'run', agentloop_run_json(r),
        'metadata', t.metadata,
        'context', v_context,
        'open', v_open,
        'approvals', CASE WHEN v_open IS NULL THEN '[]'::jsonb ELSE
            (SELECT coalesce(jsonb_agg(agentloop_approval_json(a) ORDER BY a.created_at, a.tool_call_id), '[]'::jsonb)
               FROM tool_approvals a WHERE a.run_id = v_run) END,
        'operations', CASE WHEN v_open IS NULL THEN '[]'::jsonb ELSE
            (SELECT coalesce(jsonb_agg(agentloop_operation_json(o) ORDER BY o.created_at), '[]'::jsonb)
               FROM operations o WHERE o.run_id = v_run) END);
END $$;
