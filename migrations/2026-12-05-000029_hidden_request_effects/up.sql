-- The OpenAI endpoint's hidden threads and external effects (acceptance probe, 2026-12-05).
--
-- 1. A hidden thread whose run left an operation `uncertain` (a non-idempotent call that may
--    have taken effect: the client went away mid-call, or the call's outcome was unknown and a
--    stateless caller cannot resolve it), or whose request ended without its answer after a tool
--    call took effect (the run failed, the client went away, the api died), is no longer deleted:
--    deleting it erased the only record of an effect that happened or may have happened. agentloop_openai_release keeps
--    it as an ordinary thread of the principal — listed, titled so, its operation resolvable
--    (`/api/runs/{id}/operations`) — and drops its request row, so it is hidden no more and no
--    sweep deletes it. Threads without such an operation are deleted as before.
-- 2. A hidden thread (a row of openai_requests: a request in flight) is the request's alone:
--    the thread and run commands of principals (agentloop_lock_thread and
--    agentloop_thread_of_run with an owner: PATCH, compact, delete, chat, cancel, approvals...)
--    answer 404 as for another principal's thread, as the reads already did
--    (`shared::threads::not_hidden`). The request itself cancels its run with
--    agentloop_openai_cancel.
-- 3. No webhook delivery for the runs of hidden threads: it showed their ids.

-- As in 000005, and a hidden thread is not found for an owner (2. above).
CREATE OR REPLACE FUNCTION agentloop_lock_thread(p_thread uuid, p_owner uuid) RETURNS threads
LANGUAGE plpgsql AS $$
DECLARE
    t threads;
BEGIN
    SELECT * INTO t FROM threads
     WHERE id = p_thread
       AND (p_owner IS NULL
            OR (owner_id = p_owner AND deleted_at IS NULL
                AND NOT EXISTS (SELECT 1 FROM openai_requests o WHERE o.thread_id = p_thread)))
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        PERFORM agentloop_refuse(404, 'not_found', 'not found');
    END IF;
    RETURN t;
END $$;

-- As in 000005, and the run of a hidden thread is not found (2. above).
CREATE OR REPLACE FUNCTION agentloop_thread_of_run(p_run uuid, p_principal uuid) RETURNS uuid LANGUAGE plpgsql AS $$
DECLARE
    v_thread uuid;
BEGIN
    SELECT r.thread_id INTO v_thread FROM runs r JOIN threads t ON t.id = r.thread_id
     WHERE r.id = p_run AND t.owner_id = p_principal AND t.deleted_at IS NULL
       AND NOT EXISTS (SELECT 1 FROM openai_requests o WHERE o.thread_id = t.id);
    IF NOT FOUND THEN
        PERFORM agentloop_refuse(404, 'not_found', 'not found');
    END IF;
    RETURN v_thread;
END $$;

-- A request cancels its own run (its run waits for a human, whom a stateless caller cannot
-- be). p = {principalId, threadId}. Returns {runs} (agentloop_cancel_all), or {gone: true}
-- when the thread is no longer the request's.
CREATE FUNCTION agentloop_openai_cancel(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_thread uuid := (p ->> 'threadId')::uuid;
    v_runs jsonb;
BEGIN
    PERFORM 1 FROM threads WHERE id = v_thread AND owner_id = (p ->> 'principalId')::uuid
                             AND metadata ->> 'stateless' = 'true' FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN '{"gone": true}'::jsonb;
    END IF;
    v_runs := agentloop_cancel_all(v_thread);
    PERFORM agentloop_notify(ARRAY[v_thread]);
    RETURN jsonb_build_object('runs', v_runs);
END $$;

-- As in 000014, but a thread is kept instead of deleted (1. above) when a run of it left an
-- operation uncertain, or when its request ends without its answer delivered (`p_delivered`
-- false: the run failed, the client went away, the api died) after a tool call took effect —
-- the client cannot know what happened, and a resend would do it again. Returns whether the request is over
-- (the thread deleted or kept).
DROP FUNCTION agentloop_openai_release(uuid);
CREATE FUNCTION agentloop_openai_release(p_thread uuid, p_delivered boolean) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_uncertain boolean;
BEGIN
    PERFORM agentloop_cancel_all(p_thread);
    IF EXISTS (SELECT 1 FROM runs WHERE thread_id = p_thread
                AND status IN ('pending', 'queued', 'running', 'waiting_approval', 'waiting_authorization', 'blocked')) THEN
        UPDATE openai_requests SET expires_at = least(expires_at, now()) WHERE thread_id = p_thread;
        RETURN false;
    END IF;
    v_uncertain := EXISTS (SELECT 1 FROM operations WHERE thread_id = p_thread AND status IN ('dispatched', 'uncertain'));
    IF v_uncertain OR (NOT p_delivered AND EXISTS (SELECT 1 FROM operations WHERE thread_id = p_thread)) THEN
        DELETE FROM openai_requests WHERE thread_id = p_thread;
        UPDATE threads SET title = CASE WHEN v_uncertain THEN 'OpenAI request with a tool call of unknown outcome'
                                        ELSE 'OpenAI request not answered after its tool calls took effect' END,
                           metadata = (metadata - 'stateless') || '{"openaiRequest": true}'::jsonb,
                           updated_at = now()
         WHERE id = p_thread;
        RETURN true;
    END IF;
    DELETE FROM threads WHERE id = p_thread;
    RETURN true;
END $$;

-- As in 000008, with p.delivered (default true): whether the client got the run's answer
-- (agentloop_openai_release). Returns {purged, gone}.
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

-- As in 000008: a request the sweep ends was never answered (its api died or let it go).
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

-- As in 000018, but no delivery for a run of a hidden thread (3. above).
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
     WHERE w.principal_id = NEW.principal_id AND v_type = ANY (w.events)
       AND NOT EXISTS (SELECT 1 FROM openai_requests o WHERE o.thread_id = NEW.thread_id);
    GET DIAGNOSTICS v_count = ROW_COUNT;
    IF v_count > 0 THEN
        PERFORM agentloop_send('agentloop_webhooks', '');
    END IF;
    RETURN NULL;
END $$;
