-- Reverts 000038: agentloop_openai_start as in 000036.
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
    PERFORM agentloop_append(t.id, NULL, NULL, p -> 'messages');
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
DROP FUNCTION agentloop_openai_with_server_calls(uuid, jsonb);
DROP FUNCTION agentloop_openai_note_client_calls(jsonb);
DROP TABLE openai_client_calls;
