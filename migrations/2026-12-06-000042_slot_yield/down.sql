-- Reverts 000042.
DROP FUNCTION IF EXISTS agentloop_slot_wanted(jsonb);

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
        'step', jsonb_build_object('id', s.id, 'sequence', s.sequence),
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
