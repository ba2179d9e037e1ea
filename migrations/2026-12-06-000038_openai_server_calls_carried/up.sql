-- A `/v1/chat/completions` client's tool loop no longer hides the server's own tool calls from
-- the model (acceptance probe G, G-7). A request may run server tools (a payment) and then end
-- with a call of a client tool; the answer returns only the client's calls, and the client's
-- next request carries only what it saw: the model's next context lacked the payment and its
-- result, and a model that does not see it may pay again. Now:
-- - when the api answers a completed run with client calls whose thread is kept as the record
--   of an effect (000035: a non-idempotent call was dispatched), it notes those call ids
--   (`openai_client_calls`, `agentloop_openai_note_client_calls`) BEFORE it sends the answer;
-- - a later request of the same principal whose messages carry an assistant message with one
--   of those call ids gets that run's earlier messages — the server's calls and their results,
--   as the kept thread holds them — put back right before it, and that message's text is the
--   run's last message's own when the client sent the answer's joined text unchanged.
-- The ids are the run's own (`call_` + 96 random bits, issue 9), so a note cannot be matched by
-- another request by chance; notes belong to the principal and go with the kept thread.

CREATE TABLE openai_client_calls (
    call_id text PRIMARY KEY,
    principal_id uuid NOT NULL,
    thread_id uuid NOT NULL REFERENCES threads (id) ON DELETE CASCADE,
    -- The message carrying the call (the run's last).
    sequence bigint NOT NULL
);
CREATE INDEX openai_client_calls_thread ON openai_client_calls (thread_id);

-- p = {threadId}: notes the client calls of the thread's run when the thread holds
-- an effect (an operation). Returns {noted: n}. Idempotent.
CREATE FUNCTION agentloop_openai_note_client_calls(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_thread uuid := (p ->> 'threadId')::uuid;
    v_noted int;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM operations WHERE thread_id = v_thread) THEN
        RETURN '{"noted": 0}'::jsonb;
    END IF;
    INSERT INTO openai_client_calls (call_id, principal_id, thread_id, sequence)
    SELECT c ->> 'id', t.owner_id, m.thread_id, m.sequence
      FROM threads t
      JOIN messages m ON m.thread_id = t.id
     CROSS JOIN LATERAL jsonb_array_elements(CASE WHEN jsonb_typeof(m.tool_calls) = 'array' THEN m.tool_calls ELSE '[]'::jsonb END) AS c
     WHERE t.id = v_thread
       AND m.run_id IS NOT NULL AND m.role = 'assistant' AND m.active
       AND c ->> 'clientSide' = 'true' AND c ->> 'id' IS NOT NULL
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS v_noted = ROW_COUNT;
    RETURN jsonb_build_object('noted', v_noted);
END $$;

-- The messages of a request (the import's shape, as agentloop_append takes them) with the
-- server's earlier messages of each noted run put back before the assistant message that carries
-- its client calls (see above). Messages without noted calls pass unchanged.
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

-- As in 000036, with the request's messages passed through agentloop_openai_with_server_calls.
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
