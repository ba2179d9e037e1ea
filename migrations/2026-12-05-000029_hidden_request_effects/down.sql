-- Reverts 000029: the definitions of 000005, 000008, 000014 and 000018.

DROP FUNCTION agentloop_openai_cancel(jsonb);
DROP FUNCTION agentloop_openai_release(uuid, boolean);

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

CREATE FUNCTION agentloop_openai_release(p_thread uuid)
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

CREATE OR REPLACE FUNCTION agentloop_openai_finish(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_thread uuid := (p ->> 'threadId')::uuid;
    v_purged boolean;
BEGIN
    PERFORM 1 FROM threads WHERE id = v_thread AND owner_id = (p ->> 'principalId')::uuid
                             AND metadata ->> 'stateless' = 'true' FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN '{"purged": false, "gone": true}'::jsonb;
    END IF;
    v_purged := agentloop_openai_release(v_thread);
    PERFORM agentloop_notify(ARRAY[v_thread]);
    RETURN jsonb_build_object('purged', v_purged, 'gone', v_purged);
END $$;

CREATE OR REPLACE FUNCTION agentloop_openai_sweep(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    q record;
    v_purged int := 0;
    v_pending int := 0;
    v_threads uuid[] := '{}';
BEGIN
    FOR q IN SELECT thread_id FROM openai_requests WHERE expires_at < now()
              ORDER BY expires_at LIMIT coalesce((p ->> 'limit')::int, 100) LOOP
        PERFORM 1 FROM threads WHERE id = q.thread_id FOR NO KEY UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        IF agentloop_openai_release(q.thread_id) THEN
            v_purged := v_purged + 1;
        ELSE
            v_pending := v_pending + 1;
            v_threads := v_threads || q.thread_id;
        END IF;
    END LOOP;
    PERFORM agentloop_notify(v_threads);
    RETURN jsonb_build_object(
        'purged', v_purged, 'pending', v_pending,
        'nextExpiryMs', (SELECT greatest((extract(epoch FROM (min(expires_at) - now())) * 1000)::bigint, 0)
                           FROM openai_requests WHERE expires_at >= now()));
END $$;
