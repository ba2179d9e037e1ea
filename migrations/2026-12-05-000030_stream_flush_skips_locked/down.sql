-- Reverts 000030: agentloop_stream as in 000005.
CREATE OR REPLACE FUNCTION agentloop_stream(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    it record;
    v_seq bigint;
    v_threads uuid[] := '{}';
    v_lost jsonb := '[]'::jsonb;
    v_payload jsonb;
BEGIN
    PERFORM 1 FROM threads
     WHERE id IN (SELECT (x ->> 'threadId')::uuid FROM jsonb_array_elements(p -> 'items') x)
     ORDER BY id FOR NO KEY UPDATE;
    FOR it IN SELECT x, (x ->> 'runId')::uuid AS run_id, (x ->> 'threadId')::uuid AS thread_id
                FROM jsonb_array_elements(p -> 'items') x LOOP
        IF EXISTS (SELECT 1 FROM runs WHERE id = it.run_id AND status = 'running' AND lease_owner = p ->> 'owner'
                                         AND lease_epoch = (it.x ->> 'epoch')::bigint) THEN
            v_payload := jsonb_build_object('runId', it.run_id, 'offset', it.x -> 'offset', 'delta', coalesce(it.x -> 'delta', '""'::jsonb));
            IF it.x ? 'reasoningDelta' THEN
                v_payload := v_payload || jsonb_build_object('reasoningOffset', it.x -> 'reasoningOffset',
                                                             'reasoningDelta', it.x -> 'reasoningDelta');
            END IF;
            v_seq := agentloop_journal(it.thread_id, 'streaming', v_payload);
            IF jsonb_typeof(it.x -> 'snapshot') = 'object' THEN
                UPDATE threads SET streaming_message = (it.x -> 'snapshot')
                                   || jsonb_build_object('runId', it.run_id, 'eventSequence', v_seq)
                 WHERE id = it.thread_id;
            END IF;
            v_threads := v_threads || it.thread_id;
        ELSE
            v_lost := v_lost || to_jsonb(it.run_id);
        END IF;
    END LOOP;
    PERFORM agentloop_notify(v_threads);
    RETURN jsonb_build_object('lost', v_lost);
END $$;
