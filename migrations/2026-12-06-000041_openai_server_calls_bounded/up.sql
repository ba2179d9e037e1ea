-- The server's calls put back into a `/v1` client's tool loop (000038) are bounded
-- (review of stop 27): the request's messages were counted (at most 10,000) before the splice,
-- and one run's messages were put back before EVERY assistant message carrying one of its call
-- ids, so a request repeating a noted message N times grew the hidden thread by N copies of
-- the run. Now each run is put back once, and the conversation after the splice is refused
-- (400 `too_many_messages`) beyond the request bound the api passes (`maxMessages`). And the
-- splice built its answer by jsonb concatenation, quadratic in the request's messages: every
-- request of 10,000 messages spent 7.2 s in it and failed at the statement timeout; a request
-- without a noted call now passes unchanged after one lookup.

DROP FUNCTION agentloop_openai_with_server_calls(uuid, jsonb);

CREATE FUNCTION agentloop_openai_with_server_calls(p_principal uuid, p_messages jsonb, p_max int) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    -- Built as an array (appended in place), not by jsonb concatenation, which copies the whole
    -- value each time: 7.2 s for a request of 10,000 messages in 000038.
    v_out jsonb[] := '{}';
    m jsonb;
    k openai_client_calls;
    v_joined text;
    v_own jsonb;
    v_spliced uuid[] := '{}';
BEGIN
    IF jsonb_typeof(p_messages) <> 'array' THEN
        RETURN p_messages;
    END IF;
    -- Most requests carry no noted call: one lookup, and the messages as they came.
    IF NOT EXISTS (
        SELECT 1
          FROM jsonb_array_elements(p_messages) AS x
         CROSS JOIN LATERAL jsonb_array_elements(CASE WHEN jsonb_typeof(x -> 'toolCalls') = 'array'
                                                      THEN x -> 'toolCalls' ELSE '[]'::jsonb END) AS c
          JOIN openai_client_calls n ON n.call_id = c ->> 'id' AND n.principal_id = p_principal
         WHERE x ->> 'role' = 'assistant') THEN
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
            -- A run's messages are put back once, before the first message that carries its
            -- calls; a later one carrying them too passes unchanged.
            IF FOUND AND NOT k.thread_id = ANY (v_spliced) THEN
                v_spliced := v_spliced || k.thread_id;
                v_out := v_out || ARRAY(
                    SELECT jsonb_build_object(
                               'role', e.role, 'content', e.content, 'toolCalls', e.tool_calls,
                               'toolCallId', e.tool_call_id, 'reasoning', e.reasoning,
                               'tokenEstimate', e.token_estimate, 'byteSize', e.byte_size,
                               'stopped', e.stopped, 'finishReason', e.finish_reason)
                      FROM messages e
                     WHERE e.thread_id = k.thread_id AND e.run_id IS NOT NULL AND e.active
                       AND e.sequence < k.sequence
                     ORDER BY e.sequence);
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
        v_out := array_append(v_out, m);
    END LOOP;
    IF p_max IS NOT NULL AND cardinality(v_out) > p_max THEN
        PERFORM agentloop_refuse(400, 'too_many_messages',
            format('with the server''s own tool calls of earlier requests put back, the conversation has %s messages; at most %s are accepted',
                   cardinality(v_out), p_max));
    END IF;
    RETURN to_jsonb(v_out);
END $$;

-- As in 000038, passing the bound.
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
    PERFORM agentloop_append(t.id, NULL, NULL, agentloop_openai_with_server_calls(v_principal, p -> 'messages', (p ->> 'maxMessages')::int));
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
