-- Issue 12 (parts 1, 3, 4): the OpenAI-compatible endpoint's hidden threads, thread import.
-- Additive only: one table and new step functions; no existing function is replaced.
--
-- Hidden threads of POST /v1/chat/completions. The request's messages become a hidden thread
-- (metadata.stateless) with one run; the api process serving the request holds it like a lease:
-- `openai_requests.expires_at` is renewed by that api every lease/3 for all its open requests in
-- one statement. When the request ends (answered, or the client went away) the api cancels the
-- run and purges the thread; when the api process itself dies, the lease expires and the
-- workers' sweep (`agentloop_openai_sweep`) cancels the run and purges the thread. "Purged"
-- means deleted: a stateless API keeps no conversation, so the thread, its messages, runs,
-- steps, journal, approvals and operations go (ON DELETE CASCADE) once no run of it is active.
-- Lock order as everywhere: the thread, then its runs (agentloop_cancel_all); the request row
-- is only ever locked after its thread or on its own (renewal).
CREATE TABLE openai_requests (
    thread_id     uuid PRIMARY KEY REFERENCES threads (id) ON DELETE CASCADE,
    principal_id  uuid NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
    -- The api process serving the request (`<host>-<pid>-<random>`).
    holder        text NOT NULL,
    expires_at    timestamptz NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX openai_requests_expiry ON openai_requests (expires_at);

-- POST /v1/chat/completions: the hidden thread (metadata {stateless: true, clientTools?}) with
-- the request's messages, its one-slice run and the request's lease row, in one transaction.
-- p = {principalId, model, messages, clientTools?, holder, leaseMs}. Returns {threadId, run}.
CREATE FUNCTION agentloop_openai_start(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
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

-- Lease renewal of every open request of one api process, in one statement (never waits on a
-- thread or run). p = {holder, leaseMs, threadIds}. Returns {renewed}.
CREATE FUNCTION agentloop_openai_renew(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    n int;
BEGIN
    UPDATE openai_requests SET expires_at = now() + make_interval(secs => (p ->> 'leaseMs')::bigint / 1000.0)
     WHERE holder = p ->> 'holder'
       AND thread_id IN (SELECT x::uuid FROM jsonb_array_elements_text(p -> 'threadIds') x);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN jsonb_build_object('renewed', n);
END $$;

-- Cancels the hidden thread's runs and deletes it when none is active any more; otherwise
-- releases its lease (expires now) so the sweep deletes it once its run has ended. The thread
-- is locked by the caller. Returns whether it was deleted.
CREATE FUNCTION agentloop_openai_release(p_thread uuid) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    PERFORM agentloop_cancel_all(p_thread);
    IF EXISTS (SELECT 1 FROM runs WHERE thread_id = p_thread
                AND status IN ('pending', 'queued', 'running', 'waiting_approval', 'blocked')) THEN
        UPDATE openai_requests SET expires_at = least(expires_at, now()) WHERE thread_id = p_thread;
        RETURN false;
    END IF;
    DELETE FROM threads WHERE id = p_thread;
    RETURN true;
END $$;

-- The end of a request (answered, failed, or its client gone): see agentloop_openai_release.
-- Idempotent; a thread already purged is not an error. p = {principalId, threadId}.
-- Returns {purged, gone}.
CREATE FUNCTION agentloop_openai_finish(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
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

-- Workers' sweep of requests whose api stopped renewing them (it died) or released them:
-- cancels their runs and purges the threads that are idle, at most p.limit per call; threads
-- locked right now are skipped (SKIP LOCKED). p = {limit}. Returns {purged, pending,
-- nextExpiryMs (ms until the earliest lease of a request still held; null when none)}.
CREATE FUNCTION agentloop_openai_sweep(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
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

-- POST /api/threads/import (issue 12): a new thread with an imported history, in one
-- transaction. The receipt comes first exactly as in agentloop_chat (an identical retry with the
-- same Idempotency-Key replays the stored response — the same thread; another body is 409
-- idempotency_conflict). Messages get gap-free sequences 1..n and strictly increasing
-- timestamp identities: the source's millisecond timestamps, raised where needed so each is
-- above the one before (ts_i = i + max_{j<=i}(src_j - j)). `created_at` keeps the source's
-- own time (so an export of the import shows the original times). Journal: one `thread` event.
-- p = {principalId, commandId?, fingerprint, title, model?, metadata, createdAt?, format,
-- messages: [{role, content, toolCalls?, toolCallId?, reasoning?, stopped?, tokenEstimate,
-- byteSize, timestamp? (ms), createdAt?}]}. Returns {thread, messages (count), format}.
CREATE FUNCTION agentloop_import(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_principal uuid := (p ->> 'principalId')::uuid;
    v_key text := p ->> 'commandId';
    v_fingerprint text;
    v_response jsonb;
    v_now bigint := (extract(epoch FROM clock_timestamp()) * 1000)::bigint;
    v_count int := coalesce(jsonb_array_length(p -> 'messages'), 0);
    v_last bigint;
    t threads;
BEGIN
    IF v_key IS NOT NULL THEN
        INSERT INTO command_receipts (principal_id, command_id, fingerprint)
        VALUES (v_principal, v_key, p ->> 'fingerprint') ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            SELECT fingerprint, response INTO v_fingerprint, v_response FROM command_receipts
             WHERE principal_id = v_principal AND command_id = v_key;
            IF v_response IS NOT NULL AND v_fingerprint = p ->> 'fingerprint' THEN
                RETURN v_response || '{"replayed": true}'::jsonb;
            END IF;
            PERFORM agentloop_refuse(409, 'idempotency_conflict',
                                     'this idempotency key was already used with a different request');
        END IF;
    END IF;
    INSERT INTO threads (id, owner_id, title, model, metadata, created_at)
    VALUES (gen_random_uuid(), v_principal, coalesce(p ->> 'title', ''), p ->> 'model',
            coalesce(p -> 'metadata', '{}'::jsonb), coalesce((p ->> 'createdAt')::timestamptz, now()))
    RETURNING * INTO t;
    WITH src AS (
        -- The api fills every row's time (missing ones from their neighbours); a row without
        -- one still gets a valid identity.
        SELECT e.m, e.ord, coalesce((e.m ->> 'timestamp')::bigint, v_now) AS ts
          FROM jsonb_array_elements(p -> 'messages') WITH ORDINALITY AS e(m, ord)
    ), mono AS (
        SELECT m, ord, ord + max(ts - ord) OVER (ORDER BY ord ROWS UNBOUNDED PRECEDING) AS ts FROM src
    ), ins AS (
        INSERT INTO messages (thread_id, sequence, timestamp_ms, role, content, tool_calls, tool_call_id,
                              reasoning, token_estimate, byte_size, stopped, created_at)
        SELECT t.id, ord, ts, m ->> 'role', coalesce(m -> 'content', '""'::jsonb),
               nullif(m -> 'toolCalls', 'null'::jsonb), m ->> 'toolCallId', m ->> 'reasoning',
               coalesce((m ->> 'tokenEstimate')::int, 0),
               coalesce((m ->> 'byteSize')::int, octet_length((m -> 'content')::text)),
               coalesce((m ->> 'stopped')::boolean, false),
               coalesce((m ->> 'createdAt')::timestamptz, to_timestamp(ts / 1000.0))
          FROM mono
        RETURNING timestamp_ms
    )
    SELECT max(timestamp_ms) INTO v_last FROM ins;
    UPDATE threads SET last_sequence = v_count, message_count = v_count, last_timestamp_ms = coalesce(v_last, 0),
                       updated_at = now()
     WHERE id = t.id RETURNING * INTO t;
    PERFORM agentloop_journal(t.id, 'thread', agentloop_thread_json(t));
    SELECT * INTO t FROM threads WHERE id = t.id;
    v_response := jsonb_build_object('thread', agentloop_thread_json(t), 'messages', v_count, 'format', p ->> 'format',
                                     'repairs', coalesce(p -> 'repairs', '[]'::jsonb));
    IF v_key IS NOT NULL THEN
        UPDATE command_receipts SET response = v_response, thread_id = t.id
         WHERE principal_id = v_principal AND command_id = v_key;
    END IF;
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN v_response;
END $$;
