-- Reverts 000031: agentloop_append and agentloop_message_json as in 000005, agentloop_import as
-- in 000008, no finish_reason.
CREATE OR REPLACE FUNCTION agentloop_message_json(m messages) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'sequence', m.sequence, 'timestamp', m.timestamp_ms, 'role', m.role, 'content', m.content,
        'runId', m.run_id, 'stepId', m.step_id, 'tokenEstimate', m.token_estimate,
        'active', m.active, 'createdAt', m.created_at)
    || CASE WHEN m.tool_calls IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('toolCalls', m.tool_calls) END
    || CASE WHEN m.tool_call_id IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('toolCallId', m.tool_call_id) END
    || CASE WHEN m.reasoning IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('reasoning', m.reasoning) END
    || CASE WHEN m.stopped THEN '{"stopped": true}'::jsonb ELSE '{}'::jsonb END
$$;

CREATE OR REPLACE FUNCTION agentloop_append(p_thread uuid, p_run uuid, p_step bigint, p_messages jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    k int := coalesce(jsonb_array_length(p_messages), 0);
    v_seq bigint;
    v_ts bigint;
    v_ev bigint;
    v_out jsonb;
BEGIN
    IF k = 0 THEN
        RETURN '[]'::jsonb;
    END IF;
    -- One update allocates k message sequences, k timestamp identities and k journal sequences.
    UPDATE threads SET last_sequence = last_sequence + k,
                       message_count = message_count + k,
                       last_timestamp_ms = GREATEST(last_timestamp_ms + k,
                           (extract(epoch FROM clock_timestamp()) * 1000)::bigint + k - 1),
                       last_event_sequence = last_event_sequence + k,
                       updated_at = now()
     WHERE id = p_thread RETURNING last_sequence, last_timestamp_ms, last_event_sequence INTO v_seq, v_ts, v_ev;
    WITH ins AS (
        INSERT INTO messages (thread_id, sequence, timestamp_ms, role, content, tool_calls,
                              tool_call_id, reasoning, run_id, step_id, token_estimate, byte_size, stopped)
        SELECT p_thread, v_seq - k + e.ord, v_ts - k + e.ord, e.m ->> 'role',
               coalesce(e.m -> 'content', '""'::jsonb), nullif(e.m -> 'toolCalls', 'null'::jsonb),
               e.m ->> 'toolCallId', e.m ->> 'reasoning', p_run, p_step,
               coalesce((e.m ->> 'tokenEstimate')::int, 0),
               coalesce((e.m ->> 'byteSize')::int, octet_length((e.m -> 'content')::text)),
               coalesce((e.m ->> 'stopped')::boolean, false)
          FROM jsonb_array_elements(p_messages) WITH ORDINALITY AS e(m, ord)
        RETURNING *
    ), events AS (
        INSERT INTO thread_events (thread_id, sequence, kind, payload)
        SELECT p_thread, v_ev - v_seq + ins.sequence, 'message', agentloop_message_json(ins::messages) FROM ins
        RETURNING payload
    )
    SELECT jsonb_agg(payload ORDER BY (payload ->> 'sequence')::bigint) INTO v_out FROM events;
    RETURN v_out;
END $$;

CREATE OR REPLACE FUNCTION agentloop_import(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
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

ALTER TABLE messages DROP COLUMN finish_reason;
