-- Reverts 2026-12-03-000014_mcp_authorization (development databases only). Runs that wait for
-- a sign-in are cancelled first (the old status checks do not know them).
UPDATE runs SET status = 'cancelled', finished_at = clock_timestamp(), lease_owner = NULL, lease_expires_at = NULL,
                updated_at = now()
 WHERE status = 'waiting_authorization';
UPDATE run_steps SET status = 'cancelled' WHERE status = 'waiting_authorization';
CREATE OR REPLACE FUNCTION agentloop_cancel_all(p_thread uuid)
 RETURNS jsonb
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_id uuid;
    v_out jsonb := '[]'::jsonb;
BEGIN
    PERFORM agentloop_lock_active(p_thread);
    FOR v_id IN SELECT id FROM runs
                 WHERE thread_id = p_thread
                   AND status IN ('pending', 'queued', 'running', 'waiting_approval', 'blocked')
                 ORDER BY (status = 'pending') DESC, seq DESC LOOP
        v_out := v_out || agentloop_run_json(agentloop_cancel(v_id));
    END LOOP;
    RETURN v_out;
END $function$;

CREATE OR REPLACE FUNCTION agentloop_openai_release(p_thread uuid)
 RETURNS boolean
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM agentloop_cancel_all(p_thread);
    IF EXISTS (SELECT 1 FROM runs WHERE thread_id = p_thread
                AND status IN ('pending', 'queued', 'running', 'waiting_approval', 'blocked')) THEN
        UPDATE openai_requests SET expires_at = least(expires_at, now()) WHERE thread_id = p_thread;
        RETURN false;
    END IF;
    DELETE FROM threads WHERE id = p_thread;
    RETURN true;
END $function$;

CREATE OR REPLACE FUNCTION agentloop_runs_limit()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_bound bigint;
    v_count bigint;
BEGIN
    IF NEW.status = 'pending' THEN
        v_bound := agentloop_limit('max_queued_turns');
        IF v_bound IS NOT NULL THEN
            PERFORM agentloop_lock_principal(NEW.principal_id);
            SELECT count(*) INTO v_count FROM runs WHERE principal_id = NEW.principal_id AND status = 'pending';
            IF v_count >= v_bound THEN
                PERFORM agentloop_refuse(429, 'too_many_queued_turns',
                    format('at most %s turns may wait behind active runs per principal; wait for some to run', v_bound));
            END IF;
        END IF;
    ELSIF NEW.status IN ('queued', 'running', 'waiting_approval', 'blocked') THEN
        v_bound := agentloop_limit('max_active_runs');
        IF v_bound IS NOT NULL THEN
            PERFORM agentloop_lock_principal(NEW.principal_id);
            SELECT count(*) INTO v_count FROM runs
             WHERE principal_id = NEW.principal_id AND status IN ('queued', 'running', 'waiting_approval', 'blocked');
            IF v_count >= v_bound THEN
                PERFORM agentloop_refuse(429, 'too_many_active_runs',
                    format('at most %s runs may be active per principal; wait for one to end or cancel one', v_bound));
            END IF;
        END IF;
    END IF;
    RETURN NEW;
END $function$;

CREATE OR REPLACE FUNCTION agentloop_lock_active(p_thread uuid)
 RETURNS runs
 LANGUAGE plpgsql
AS $function$
DECLARE
    a runs;
BEGIN
    SELECT * INTO a FROM runs
     WHERE thread_id = p_thread AND status IN ('queued', 'running', 'waiting_approval', 'blocked') FOR UPDATE;
    RETURN a;
END $function$;

CREATE OR REPLACE FUNCTION agentloop_cancel(p_run uuid) RETURNS runs LANGUAGE plpgsql AS $$
DECLARE
    r runs;
    a tool_approvals;
    v_active boolean;
BEGIN
    SELECT * INTO r FROM runs WHERE id = p_run FOR UPDATE;
    IF r.status IN ('pending', 'queued', 'waiting_approval', 'blocked') THEN
        v_active := r.status <> 'pending';
        UPDATE runs SET status = 'cancelled', cancel_requested_at = coalesce(cancel_requested_at, now()),
                        finished_at = clock_timestamp(), lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
         WHERE id = p_run RETURNING * INTO r;
        FOR a IN UPDATE tool_approvals SET status = 'cancelled', decided_at = now()
                  WHERE run_id = p_run AND status = 'pending' RETURNING * LOOP
            PERFORM agentloop_journal(r.thread_id, 'approval', agentloop_approval_json(a));
        END LOOP;
        PERFORM agentloop_close_dangling(r.thread_id, p_run);
        PERFORM agentloop_journal(r.thread_id, 'run', agentloop_run_json(r));
        IF v_active THEN
            PERFORM agentloop_promote(r.thread_id);
        END IF;
    ELSIF r.status = 'running' AND r.cancel_requested_at IS NULL THEN
        UPDATE runs SET cancel_requested_at = now(), updated_at = now() WHERE id = p_run RETURNING * INTO r;
        PERFORM agentloop_journal(r.thread_id, 'run', agentloop_run_json(r));
        PERFORM agentloop_wake('cancel:' || p_run);
    END IF;
    RETURN r;
END $$;
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
DROP FUNCTION IF EXISTS agentloop_mcp_finish(jsonb);
DROP FUNCTION IF EXISTS agentloop_mcp_take_state(jsonb);
DROP FUNCTION IF EXISTS agentloop_mcp_token(jsonb);
DROP FUNCTION IF EXISTS agentloop_mcp_park(jsonb);
DROP FUNCTION IF EXISTS agentloop_mcp_cancel_authorizations(uuid);
DROP FUNCTION IF EXISTS agentloop_authorization_json(mcp_authorizations);
DROP TABLE IF EXISTS mcp_tokens;
DROP TABLE IF EXISTS mcp_authorizations;
-- commit
ALTER TABLE run_steps DROP CONSTRAINT IF EXISTS run_steps_status_check;
ALTER TABLE run_steps ADD CONSTRAINT run_steps_status_check
    CHECK (status IN ('running', 'completed', 'requeued', 'failed', 'cancelled', 'interrupted',
                      'waiting_approval', 'blocked'));
ALTER TABLE runs DROP CONSTRAINT IF EXISTS runs_status_check;
ALTER TABLE runs ADD CONSTRAINT runs_status_check
    CHECK (status IN ('pending', 'queued', 'running', 'waiting_approval', 'blocked', 'completed', 'failed', 'cancelled'));
-- commit
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS runs_one_active_per_thread ON runs (thread_id)
    WHERE status IN ('queued', 'running', 'waiting_approval', 'blocked');
-- commit
DROP INDEX CONCURRENTLY IF EXISTS runs_one_active_per_thread_v2;
-- commit
CREATE INDEX CONCURRENTLY IF NOT EXISTS runs_principal_open ON runs (principal_id, status)
    WHERE status IN ('pending', 'queued', 'running', 'waiting_approval', 'blocked');
-- commit
DROP INDEX CONCURRENTLY IF EXISTS runs_principal_open_v2;
