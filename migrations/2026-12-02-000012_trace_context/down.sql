-- Development databases only (migrations/README.md).
CREATE OR REPLACE FUNCTION agentloop_run_json(r runs) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'id', r.id, 'threadId', r.thread_id, 'status', r.status, 'commandId', r.command_id,
        'model', r.model, 'maxSteps', r.max_steps, 'stepsUsed', r.steps_used,
        'toolCallsUsed', r.tool_calls_used, 'promptTokens', r.prompt_tokens,
        'completionTokens', r.completion_tokens, 'contextTokens', r.context_tokens,
        'contextLimit', r.context_limit, 'leaseOwner', r.lease_owner, 'leaseEpoch', r.lease_epoch,
        'leaseExpiresAt', r.lease_expires_at, 'attempts', r.attempts, 'recoveries', r.recoveries,
        'faults', r.faults, 'errorCode', r.error_code, 'errorMessage', r.error_message,
        'cancelRequestedAt', r.cancel_requested_at, 'createdAt', r.created_at,
        'queuedAt', r.queued_at, 'startedAt', r.started_at, 'finishedAt', r.finished_at,
        'updatedAt', r.updated_at, 'input', r.input, 'kind', r.kind,
        'sourceThreadId', r.source_thread_id)
    || CASE WHEN r.error_code IS NULL THEN '{}'::jsonb
            ELSE jsonb_build_object('error', jsonb_build_object('code', r.error_code,
                                                                 'message', coalesce(r.error_message, '')))
       END
$$;
CREATE OR REPLACE FUNCTION agentloop_insert_run(t threads, p_principal uuid, p_status text, p_model text, p_max_steps int,
                                                p_command text, p_input jsonb, p_kind text, p_source uuid) RETURNS runs
LANGUAGE plpgsql AS $$
DECLARE
    r runs;
BEGIN
    INSERT INTO runs (id, thread_id, principal_id, status, command_id, model, max_steps, queued_at, input, kind,
                      source_thread_id)
    VALUES (gen_random_uuid(), t.id, p_principal, p_status, p_command, p_model, p_max_steps,
            CASE WHEN p_status = 'queued' THEN now() END, p_input, p_kind, p_source)
    RETURNING * INTO r;
    PERFORM agentloop_journal(t.id, 'run', agentloop_run_json(r));
    IF p_status = 'queued' THEN
        PERFORM agentloop_wake('queued:' || r.id);
    END IF;
    RETURN r;
END $$;
DROP FUNCTION IF EXISTS agentloop_trace(jsonb);
ALTER TABLE runs DROP COLUMN IF EXISTS traceparent;
