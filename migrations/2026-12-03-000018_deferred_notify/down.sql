-- Back to notifying inside the transaction (000005 / 000011 bodies).
CREATE OR REPLACE FUNCTION agentloop_notify(p_threads uuid[]) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_entry text;
    v_payload text := '';
    v_wake text := nullif(current_setting('agentloop.wake', true), '');
BEGIN
    FOR v_entry IN SELECT id::text || ':' || last_event_sequence::text FROM threads
                    WHERE id = ANY(p_threads) AND last_event_sequence > 0 ORDER BY id LOOP
        IF octet_length(v_payload) + octet_length(v_entry) > 7900 THEN
            PERFORM pg_notify('agentloop_threads', v_payload);
            v_payload := '';
        END IF;
        v_payload := CASE WHEN v_payload = '' THEN v_entry ELSE v_payload || ',' || v_entry END;
    END LOOP;
    IF v_payload <> '' THEN
        PERFORM pg_notify('agentloop_threads', v_payload);
    END IF;
    IF v_wake IS NOT NULL THEN
        PERFORM pg_notify('agentloop_runs', left(v_wake, 7900));
        PERFORM set_config('agentloop.wake', '', true);
    END IF;
END $$;
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
        PERFORM pg_notify('agentloop_webhooks', '');
    END IF;
    RETURN NULL;
END $$;
DROP FUNCTION agentloop_renotify(jsonb);
DROP FUNCTION agentloop_flush_notify();
DROP FUNCTION agentloop_send_deferred(jsonb);
DROP FUNCTION agentloop_send(text, text);
DROP FUNCTION agentloop_defer(jsonb);
