-- Notifications after commit, for callers that ask (issue 9: throughput).
--
-- PostgreSQL serialises every transaction that has called pg_notify from PreCommit_Notify to
-- the end of its commit, WAL flush included: async.c takes a database-wide lock "to ensure
-- queue entries appear in commit order". Notifying step transactions therefore cannot share a
-- WAL flush (group commit), and each one also wakes every listening backend of the database.
-- Measured with pgbench on the 2-core dev machine (8 clients, one listener): an update and a
-- pg_notify in one transaction 1,765 TPS; the update, then a notify-only transaction 2,339; the
-- update alone 2,921.
--
-- A caller that wraps its argument in `agentloop_defer(p)` (the workers' step calls,
-- `agentloop_shared::store`) gets its notifications deferred: `agentloop_send` keeps them in the
-- session setting `agentloop.deferred`, written inside the step's transaction (so an aborted
-- step leaves nothing), as a JSON array of [channel, payload] pairs. The caller's next
-- statement, pipelined in the same round trip, is `agentloop_flush_notify()`: it sends them in
-- a transaction of its own, which writes no row and does not wait for a WAL flush
-- (synchronous_commit off: a notification is not durable anyway). The step statement also
-- returns the pairs, so when the flush did not run (its connection broke between the two
-- statements) the caller sends them on another connection with `agentloop_send_deferred(p)`.
-- Callers that do not ask (the api's commands, maintenance, ad-hoc SQL) notify in their
-- transaction as before.

-- Marks the current transaction's notifications deferred; returns `p` unchanged, so it can wrap
-- a step function's argument (evaluated before the function runs).
CREATE FUNCTION agentloop_defer(p jsonb) RETURNS jsonb LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM set_config('agentloop.defer_notify', 'on', true);
    RETURN p;
END $$;

-- pg_notify, or its deferral when the transaction asked for it.
CREATE FUNCTION agentloop_send(p_channel text, p_payload text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('agentloop.defer_notify', true) = 'on' THEN
        PERFORM set_config('agentloop.deferred',
            (coalesce(nullif(current_setting('agentloop.deferred', true), '')::jsonb, '[]'::jsonb)
             || jsonb_build_array(jsonb_build_array(p_channel, p_payload)))::text,
            false);
    ELSE
        PERFORM pg_notify(p_channel, p_payload);
    END IF;
END $$;

-- Sends [channel, payload] pairs now, in the caller's transaction, without waiting for a WAL
-- flush. Returns how many were sent.
CREATE FUNCTION agentloop_send_deferred(p jsonb) RETURNS int LANGUAGE plpgsql AS $$
DECLARE
    x jsonb;
    n int := 0;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    FOR x IN SELECT value FROM jsonb_array_elements(coalesce(p, '[]'::jsonb)) LOOP
        PERFORM pg_notify(x ->> 0, x ->> 1);
        n := n + 1;
    END LOOP;
    RETURN n;
END $$;

-- Sends and clears this session's deferred notifications. Returns how many were sent.
CREATE FUNCTION agentloop_flush_notify() RETURNS int LANGUAGE plpgsql AS $$
DECLARE
    v_pending jsonb := nullif(current_setting('agentloop.deferred', true), '')::jsonb;
BEGIN
    IF v_pending IS NULL THEN
        RETURN 0;
    END IF;
    PERFORM set_config('agentloop.deferred', '', false);
    RETURN agentloop_send_deferred(v_pending);
END $$;

-- Announces the thread's journal position again (p = {threadId}). A step replayed after an
-- unknown outcome (agentloop_commit's `replayed`) calls it: the first attempt committed, but its
-- deferred notifications may have gone down with its connection.
CREATE FUNCTION agentloop_renotify(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    PERFORM agentloop_notify(ARRAY[(p ->> 'threadId')::uuid]);
    RETURN '{}'::jsonb;
END $$;

-- As in 000005, through agentloop_send.
CREATE OR REPLACE FUNCTION agentloop_notify(p_threads uuid[]) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_entry text;
    v_payload text := '';
    v_wake text := nullif(current_setting('agentloop.wake', true), '');
BEGIN
    FOR v_entry IN SELECT id::text || ':' || last_event_sequence::text FROM threads
                    WHERE id = ANY(p_threads) AND last_event_sequence > 0 ORDER BY id LOOP
        IF octet_length(v_payload) + octet_length(v_entry) > 7900 THEN
            PERFORM agentloop_send('agentloop_threads', v_payload);
            v_payload := '';
        END IF;
        v_payload := CASE WHEN v_payload = '' THEN v_entry ELSE v_payload || ',' || v_entry END;
    END LOOP;
    IF v_payload <> '' THEN
        PERFORM agentloop_send('agentloop_threads', v_payload);
    END IF;
    IF v_wake IS NOT NULL THEN
        PERFORM agentloop_send('agentloop_runs', left(v_wake, 7900));
        PERFORM set_config('agentloop.wake', '', true);
    END IF;
END $$;

-- As in 000011, through agentloop_send.
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
