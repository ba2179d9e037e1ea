-- Reverts 000041: the splice as in 000038.
DROP FUNCTION agentloop_openai_with_server_calls(uuid, jsonb, int);

CREATE FUNCTION agentloop_openai_with_server_calls(p_principal uuid, p_messages jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_out jsonb := '[]'::jsonb;
    m jsonb;
    k openai_client_calls;
    v_joined text;
    v_own jsonb;
BEGIN
    IF jsonb_typeof(p_messages) <> 'array' THEN
        RETURN p_messages;
    END IF;
    FOR m IN SELECT value FROM jsonb_array_elements(p_messages) LOOP
        IF m ->> 'role' = 'assistant' AND jsonb_typeof(m -> 'toolCalls') = 'array' THEN
            SELECT c.* INTO k
              FROM openai_client_calls c
              JOIN threads t ON t.id = c.thread_id AND t.deleted_at IS NULL
             WHERE c.principal_id = p_principal
               AND c.call_id IN (SELECT x ->> 'id' FROM jsonb_array_elements(m -> 'toolCalls') AS x)
             LIMIT 1;
            IF FOUND THEN
                v_out := v_out || coalesce((
                    SELECT jsonb_agg(jsonb_build_object(
                               'role', e.role, 'content', e.content, 'toolCalls', e.tool_calls,
                               'toolCallId', e.tool_call_id, 'reasoning', e.reasoning,
                               'tokenEstimate', e.token_estimate, 'byteSize', e.byte_size,
                               'stopped', e.stopped, 'finishReason', e.finish_reason) ORDER BY e.sequence)
                      FROM messages e
                     WHERE e.thread_id = k.thread_id AND e.run_id IS NOT NULL AND e.active
                       AND e.sequence < k.sequence), '[]'::jsonb);
                -- The answer's content is every assistant text of the run joined by a blank line
                -- (chat_completions::answer); the earlier ones are now their own messages.
                SELECT string_agg(e.content #>> '{}', E'\n\n' ORDER BY e.sequence) INTO v_joined
                  FROM messages e
                 WHERE e.thread_id = k.thread_id AND e.run_id IS NOT NULL AND e.active AND e.role = 'assistant'
                   AND e.sequence <= k.sequence AND jsonb_typeof(e.content) = 'string' AND e.content #>> '{}' <> '';
                SELECT e.content INTO v_own FROM messages e WHERE e.thread_id = k.thread_id AND e.sequence = k.sequence;
                IF jsonb_typeof(m -> 'content') = 'string' AND m ->> 'content' = v_joined THEN
                    m := jsonb_set(m, '{content}', v_own);
                END IF;
            END IF;
        END IF;
        v_out := v_out || jsonb_build_array(m);
    END LOOP;
    RETURN v_out;
END $$;

CREATE OR REPLACE FUNCTION agentloop_openai_start(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_principal uuid := (p ->> 'principalId')::uuid;
    v_key text := p ->> 'commandId';
    v_lease interval := make_interval(secs => (p ->> 'leaseMs')::bigint / 1000.0);
    v_metadata jsonb := jsonb_build_object('stateless', true)
        || CASE WHEN jsonb_typeof(p -> 'clientTools') = 'array' AND jsonb_array_length(p -> 'clientTools') > 0
                THEN jsonb_build_object('clientTools', p -> 'clientTools') ELSE '{}'::jsonb END
        -- The request's generation settings (`max_completion_tokens`, `temperature`).
        || CASE WHEN jsonb_typeof(p -> 'settings') = 'object' THEN p -> 'settings' ELSE '{}'::jsonb END;
    rc command_receipts;
    v_attachment int;
    t threads;
    r runs;
BEGIN
    IF v_key IS NOT NULL THEN
        -- Resends of one key, from any api process, one at a time.
        PERFORM pg_advisory_xact_lock(hashtextextended('openai:' || v_principal::text || ':' || v_key, 0));
        SELECT * INTO rc FROM command_receipts WHERE principal_id = v_principal AND command_id = v_key;
        IF FOUND THEN
            IF rc.fingerprint IS DISTINCT FROM p ->> 'fingerprint' THEN
                PERFORM agentloop_refuse(409, 'idempotency_conflict',
                                         'this idempotency key was already used with a different request');
            END IF;
            IF rc.response IS NULL THEN
                UPDATE openai_requests SET holder = p ->> 'holder', attachment = attachment + 1,
                                           expires_at = greatest(expires_at, now() + v_lease)
                 WHERE thread_id = rc.thread_id
                RETURNING attachment INTO v_attachment;
                IF FOUND THEN
                    SELECT * INTO r FROM runs WHERE id = rc.run_id;
                    RETURN jsonb_build_object('threadId', rc.thread_id, 'run', agentloop_run_json(r),
                                              'attachment', v_attachment, 'attached', true);
                END IF;
                -- The request ended meanwhile: its outcome may have been recorded since.
                SELECT * INTO rc FROM command_receipts WHERE principal_id = v_principal AND command_id = v_key;
            END IF;
            IF rc.response IS NOT NULL THEN
                RETURN jsonb_build_object('replay', rc.response);
            END IF;
            IF EXISTS (SELECT 1 FROM threads WHERE id = rc.thread_id) THEN
                RETURN jsonb_build_object('interrupted', jsonb_build_object('threadId', rc.thread_id, 'runId', rc.run_id));
            END IF;
            -- Ended by the sweep with nothing kept (no effect): it runs again.
            DELETE FROM command_receipts WHERE principal_id = v_principal AND command_id = v_key;
        END IF;
    END IF;
    t := agentloop_insert_thread(v_principal, 'stateless', p ->> 'model', v_metadata, NULL);
    PERFORM agentloop_append(t.id, NULL, NULL, agentloop_openai_with_server_calls(v_principal, p -> 'messages'));
    r := agentloop_insert_run(t, v_principal, 'queued', p ->> 'model', 1, NULL, NULL, 'agent', NULL);
    INSERT INTO openai_requests (thread_id, principal_id, holder, expires_at, command_id)
    VALUES (t.id, v_principal, p ->> 'holder', now() + v_lease, v_key);
    IF v_key IS NOT NULL THEN
        INSERT INTO command_receipts (principal_id, command_id, fingerprint, thread_id, run_id)
        VALUES (v_principal, v_key, p ->> 'fingerprint', t.id, r.id);
    END IF;
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN jsonb_build_object('threadId', t.id, 'run', agentloop_run_json(r), 'attachment', 1);
END $$;
