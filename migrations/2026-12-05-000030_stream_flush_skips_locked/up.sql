-- The stream flush never waits for a thread another session holds (acceptance probe,
-- 2026-12-05). One flush writes the partial answers of all the streams of a worker, and a slice
-- that ends its model call waits for the flush in progress before it commits. The flush locked
-- its threads waiting: one thread held by another session (an operator's transaction, a long
-- command) froze the live answers of every other stream of the worker and held up their
-- checkpoints until the flush timed out. Now it locks with SKIP LOCKED and answers the runs of
-- the threads it could not lock as `skipped`: their offsets are not advanced, and the next flush
-- (250 ms later) sends the same text again.
--
-- As in 000005 otherwise. p = {owner, items: [...]}. Returns {lost: [runId...], skipped: [runId...]}.
CREATE OR REPLACE FUNCTION agentloop_stream(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    it record;
    v_seq bigint;
    v_locked uuid[];
    v_threads uuid[] := '{}';
    v_lost jsonb := '[]'::jsonb;
    v_skipped jsonb := '[]'::jsonb;
    v_payload jsonb;
BEGIN
    SELECT coalesce(array_agg(id), '{}') INTO v_locked FROM (
        SELECT id FROM threads
         WHERE id IN (SELECT (x ->> 'threadId')::uuid FROM jsonb_array_elements(p -> 'items') x)
         ORDER BY id FOR NO KEY UPDATE SKIP LOCKED) l;
    FOR it IN SELECT x, (x ->> 'runId')::uuid AS run_id, (x ->> 'threadId')::uuid AS thread_id
                FROM jsonb_array_elements(p -> 'items') x LOOP
        IF NOT (it.thread_id = ANY(v_locked)) THEN
            v_skipped := v_skipped || to_jsonb(it.run_id);
        ELSIF EXISTS (SELECT 1 FROM runs WHERE id = it.run_id AND status = 'running' AND lease_owner = p ->> 'owner'
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
    RETURN jsonb_build_object('lost', v_lost, 'skipped', v_skipped);
END $$;
