-- Reverts 000036: agentloop_openai_start as in 000008, agentloop_openai_finish as in 000029.
CREATE OR REPLACE FUNCTION agentloop_openai_start(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_principal uuid := (p ->> 'principalId')::uuid;
    v_metadata jsonb := jsonb_build_object('stateless', true)
        || CASE WHEN jsonb_typeof(p -> 'clientTools') = 'array' AND jsonb_array_length(p -> 'clientTools') > 0
                THEN jsonb_build_object('clientTools', p -> 'clientTools') ELSE '{}'::jsonb END;
    t threads := agentloop_insert_thread(v_principal, 'stateless', p ->> 'model', v_metadata, NULL);
    r runs;
BEGIN
    PERFORM agentloop_append(t.id, NULL, NULL, p -> 'messages');
    r := agentloop_insert_run(t, v_principal, 'queued', p ->> 'model', 1, NULL, NULL, 'agent', NULL);
    INSERT INTO openai_requests (thread_id, principal_id, holder, expires_at)
    VALUES (t.id, v_principal, p ->> 'holder', now() + make_interval(secs => (p ->> 'leaseMs')::bigint / 1000.0));
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN jsonb_build_object('threadId', t.id, 'run', agentloop_run_json(r));
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
    v_purged := agentloop_openai_release(v_thread, coalesce((p ->> 'delivered')::boolean, true));
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
        IF agentloop_openai_release(q.thread_id, false) THEN
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
ALTER TABLE openai_requests DROP COLUMN command_id, DROP COLUMN attachment;
