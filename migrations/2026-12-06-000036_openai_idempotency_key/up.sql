-- `Idempotency-Key` on POST /v1/chat/completions (acceptance probe F). The header was accepted
-- and ignored, and OpenAI's SDKs resend a request after their own timeout or a dropped
-- connection (`max_retries`, 2 by default): each resend was a new run, and a server-side payment
-- tool was charged three times under three operation keys. With a key:
-- - the request's receipt (`command_receipts`, command id `v1:<key>`) is written with its hidden
--   thread in one transaction;
-- - a resend while the run is in flight attaches to it (the same run, answered or streamed from
--   its start) instead of starting another; the request row's `attachment` counts attachments,
--   and only the newest one ends the request (`agentloop_openai_finish` with `attachment`);
-- - the request's outcome (`{status, body}`: the completion or the error) is kept on the receipt
--   when it ends, and a later resend gets it again (receipts live RECEIPT_RETENTION_HOURS);
-- - a keyed request whose api died is not cancelled by the sweep while its run goes on (up to
--   600 s); a resend attaches to it, or — the run ended, nothing recorded — gets the outcome read
--   from the thread when it was kept (the run's answer, or its error; `request_interrupted` when
--   it was cancelled), and runs again when nothing of it was kept (it had no effect);
-- - the same key with another request body is 409 `idempotency_conflict`.

ALTER TABLE openai_requests ADD COLUMN command_id text, ADD COLUMN attachment int NOT NULL DEFAULT 1;

-- As in 000008, with p.settings (the thread's maxTokens, temperature: the request's
-- `max_completion_tokens`, `temperature`, which were ignored) and p.commandId and p.fingerprint
-- (both or neither). Returns {threadId, run,
-- attachment} for a request started or attached to (`attached: true`), {replay: {status, body}}
-- for one that ended, {interrupted: {threadId, runId}} (see above).
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

-- As in 000029, with p.attachment (the caller's; absent: any) and p.response (kept on the
-- request's receipt, if it has one, before the thread is released). An attachment that is not
-- the newest does nothing: {superseded: true}.
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
    IF p ? 'attachment' AND EXISTS (SELECT 1 FROM openai_requests WHERE thread_id = v_thread
                                      AND attachment <> (p ->> 'attachment')::int) THEN
        RETURN '{"purged": false, "gone": true, "superseded": true}'::jsonb;
    END IF;
    IF jsonb_typeof(p -> 'response') = 'object' THEN
        UPDATE command_receipts c SET response = p -> 'response'
          FROM openai_requests o
         WHERE o.thread_id = v_thread AND o.command_id IS NOT NULL
           AND c.principal_id = o.principal_id AND c.command_id = o.command_id AND c.response IS NULL;
    END IF;
    v_purged := agentloop_openai_release(v_thread, coalesce((p ->> 'delivered')::boolean, true));
    PERFORM agentloop_notify(ARRAY[v_thread]);
    RETURN jsonb_build_object('purged', v_purged, 'gone', v_purged);
END $$;

-- As in 000029, but a keyed request whose api is gone keeps its run going (see below), and
-- p.spareMs spares leases that expired during a database outage the caller saw.
CREATE OR REPLACE FUNCTION agentloop_openai_sweep(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    q record;
    v_purged int := 0;
    v_pending int := 0;
    v_threads uuid[] := '{}';
BEGIN
    -- p.spareMs: leases that expired less than this long ago are left (the caller's database
    -- outage ended recently: the apis renew them now).
    FOR q IN SELECT thread_id, command_id, created_at FROM openai_requests
              WHERE expires_at < now() - make_interval(secs => coalesce((p ->> 'spareMs')::bigint, 0) / 1000.0)
              ORDER BY expires_at LIMIT coalesce((p ->> 'limit')::int, 100) LOOP
        PERFORM 1 FROM threads WHERE id = q.thread_id FOR NO KEY UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        -- A keyed request whose api is gone (dead or paused past its lease): its run goes on
        -- for the resend, as when its client goes away, up to the request's own bound (600 s,
        -- MAX_WAIT); looked at again in 5 s. A resend attaches to it, or gets its outcome from
        -- the thread once it ended (verification probe G: the sweep cut keyed runs).
        IF q.command_id IS NOT NULL AND q.created_at > now() - interval '600 seconds'
           AND EXISTS (SELECT 1 FROM runs WHERE thread_id = q.thread_id
                        AND status IN ('pending', 'queued', 'running', 'waiting_approval', 'waiting_authorization', 'blocked')) THEN
            UPDATE openai_requests SET expires_at = now() + interval '5 seconds' WHERE thread_id = q.thread_id;
            CONTINUE;
        END IF;
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
