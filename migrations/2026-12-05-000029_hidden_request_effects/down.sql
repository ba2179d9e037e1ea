-- Reverts 000029: the definitions of 000005, 000014 and 000018.

DROP FUNCTION agentloop_openai_cancel(jsonb);

CREATE OR REPLACE FUNCTION agentloop_lock_thread(p_thread uuid, p_owner uuid) RETURNS threads
LANGUAGE plpgsql AS $$
DECLARE
    t threads;
BEGIN
    SELECT * INTO t FROM threads
     WHERE id = p_thread AND (p_owner IS NULL OR (owner_id = p_owner AND deleted_at IS NULL))
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        PERFORM agentloop_refuse(404, 'not_found', 'not found');
    END IF;
    RETURN t;
END $$;

CREATE OR REPLACE FUNCTION agentloop_thread_of_run(p_run uuid, p_principal uuid) RETURNS uuid LANGUAGE plpgsql AS $$
DECLARE
    v_thread uuid;
BEGIN
    SELECT r.thread_id INTO v_thread FROM runs r JOIN threads t ON t.id = r.thread_id
     WHERE r.id = p_run AND t.owner_id = p_principal AND t.deleted_at IS NULL;
    IF NOT FOUND THEN
        PERFORM agentloop_refuse(404, 'not_found', 'not found');
    END IF;
    RETURN v_thread;
END $$;

CREATE OR REPLACE FUNCTION agentloop_openai_release(p_thread uuid)
 RETURNS boolean
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM agentloop_cancel_all(p_thread);
    IF EXISTS (SELECT 1 FROM runs WHERE thread_id = p_thread
                AND status IN ('pending', 'queued', 'running', 'waiting_approval', 'waiting_authorization', 'blocked')) THEN
        UPDATE openai_requests SET expires_at = least(expires_at, now()) WHERE thread_id = p_thread;
        RETURN false;
    END IF;
    DELETE FROM threads WHERE id = p_thread;
    RETURN true;
END $function$;

CREATE OR REPLACE FUNCTION agentloop_webhooks_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_type text := 'run.' || NEW.status;
    v_count int;
BEGIN
    INSERT INTO webhook_deliveries (id, webhook_id, principal_id, event_type, run_id, thread_id, payload, next_attempt_at)
    SELECT gen_random_uuid(), w.id, w.principal_id, v_type, NEW.id, NEW.thread_id,
           jsonb_build_object(
               'type', v_type,
               'timestamp', now(),
               'data', jsonb_strip_nulls(jsonb_build_object(
                   'runId', NEW.id,
                   'threadId', NEW.thread_id,
                   'status', NEW.status,
                   'kind', NEW.kind,
                   'model', NEW.model,
                   'errorCode', NEW.error_code,
                   'errorMessage', NEW.error_message,
                   'stepsUsed', NEW.steps_used,
                   'toolCallsUsed', NEW.tool_calls_used,
                   'usage', jsonb_build_object('promptTokens', NEW.prompt_tokens, 'completionTokens', NEW.completion_tokens),
                   'createdAt', NEW.created_at,
                   'startedAt', NEW.started_at,
                   'finishedAt', NEW.finished_at))),
           now()
      FROM webhooks w
     WHERE w.principal_id = NEW.principal_id AND v_type = ANY (w.events);
    GET DIAGNOSTICS v_count = ROW_COUNT;
    IF v_count > 0 THEN
        PERFORM agentloop_send('agentloop_webhooks', '');
    END IF;
    RETURN NULL;
END $$;
