-- Restores agentloop_end_run and agentloop_close_dangling of 2026-12-01-000005_durable_core.

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
    IF v_end = 'waiting_approval' AND r.cancel_requested_at IS NOT NULL THEN
        v_end := 'cancelled';
    END IF;
    IF v_end IN ('cancelled', 'interrupted', 'handback', 'failed', 'blocked') THEN
        UPDATE operations SET status = 'uncertain', updated_at = now() WHERE run_id = p_run AND status = 'dispatched';
        IF EXISTS (SELECT 1 FROM operations WHERE run_id = p_run AND status = 'uncertain') THEN
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

-- Gives every unanswered call of the run's last tool-call message a synthetic "cancelled"
-- result, so history stays valid for every provider (SPEC §4 interrupt, seed 000).
CREATE OR REPLACE FUNCTION agentloop_close_dangling(p_thread uuid, p_run uuid) RETURNS int LANGUAGE plpgsql AS $$
DECLARE
    v_open jsonb := agentloop_open_calls(p_thread, p_run);
    v_missing jsonb;
BEGIN
    IF v_open IS NULL THEN
        RETURN 0;
    END IF;
    -- A call whose operation may have taken effect says so: never "cancelled" for an effect
    -- that may have happened.
    SELECT coalesce(jsonb_agg(jsonb_build_object(
               'role', 'tool',
               'content', to_jsonb(CASE WHEN o.status IN ('dispatched', 'uncertain')
                   THEN '[outcome unknown: this call may have taken effect; the run ended before its outcome was resolved]'
                   ELSE '[cancelled: the run ended before this tool call produced a result]' END),
               'toolCallId', x.call ->> 'id', 'tokenEstimate', 20, 'byteSize', 100) ORDER BY x.ord), '[]'::jsonb)
      INTO v_missing
      FROM jsonb_array_elements(v_open -> 'message' -> 'toolCalls') WITH ORDINALITY AS x(call, ord)
      LEFT JOIN operations o ON o.run_id = p_run AND o.tool_call_id = x.call ->> 'id'
     WHERE x.call ->> 'id' IS NOT NULL AND NOT (v_open -> 'answered') ? (x.call ->> 'id');
    PERFORM agentloop_append(p_thread, p_run, (v_open -> 'message' ->> 'stepId')::bigint, v_missing);
    RETURN jsonb_array_length(v_missing);
END $$;
