-- An assistant answer that the provider ended for another reason than a finished answer or
-- tool calls (`finish_reason` `length`: it reached max_tokens or the context's end;
-- `content_filter`; ...) says so: `messages.finish_reason` (NULL = ended normally), in the
-- message JSON as `finishReason`. Before, a cut answer looked complete to the user, to the
-- OpenAI-compatible endpoint's clients (always `stop`) and to the model in later turns.
ALTER TABLE messages ADD COLUMN finish_reason text;

CREATE OR REPLACE FUNCTION agentloop_message_json(m messages) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'sequence', m.sequence, 'timestamp', m.timestamp_ms, 'role', m.role, 'content', m.content,
        'runId', m.run_id, 'stepId', m.step_id, 'tokenEstimate', m.token_estimate,
        'active', m.active, 'createdAt', m.created_at)
    || CASE WHEN m.tool_calls IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('toolCalls', m.tool_calls) END
    || CASE WHEN m.tool_call_id IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('toolCallId', m.tool_call_id) END
    || CASE WHEN m.reasoning IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('reasoning', m.reasoning) END
    || CASE WHEN m.stopped THEN '{"stopped": true}'::jsonb ELSE '{}'::jsonb END
    || CASE WHEN m.finish_reason IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('finishReason', m.finish_reason) END
$$;

-- As in 000005, and `finishReason` (at most 64 characters) is stored.
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
                              tool_call_id, reasoning, run_id, step_id, token_estimate, byte_size, stopped,
                              finish_reason)
        SELECT p_thread, v_seq - k + e.ord, v_ts - k + e.ord, e.m ->> 'role',
               coalesce(e.m -> 'content', '""'::jsonb), nullif(e.m -> 'toolCalls', 'null'::jsonb),
               e.m ->> 'toolCallId', e.m ->> 'reasoning', p_run, p_step,
               coalesce((e.m ->> 'tokenEstimate')::int, 0),
               coalesce((e.m ->> 'byteSize')::int, octet_length((e.m -> 'content')::text)),
               coalesce((e.m ->> 'stopped')::boolean, false), left(e.m ->> 'finishReason', 64)
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
