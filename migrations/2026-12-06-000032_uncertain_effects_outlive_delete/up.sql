-- The record of a tool call that may or may not have taken effect (an `uncertain` operation)
-- outlives a thread's deletion, as it outlives an OpenAI-endpoint request (000029):
-- 1. agentloop_delete_thread refuses (409 `operations_uncertain`) while an operation of the
--    thread is uncertain: resolve it first. Deleting while an effect is in flight is still
--    accepted (the run is cancelled; its operation becomes uncertain on the deleted thread).
-- 2. agentloop_restore_thread brings such a thread back after the undo window too, while an
--    operation of it is uncertain, so the operation can be seen and resolved.
-- 3. agentloop_purge_threads never deletes a thread with an uncertain operation (before, the
--    purge deleted the only record of a payment that may have happened after
--    DELETED_THREAD_RETENTION_HOURS).

-- As in 000005, with 1.
CREATE OR REPLACE FUNCTION agentloop_delete_thread(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
    v_uncertain bigint;
BEGIN
    SELECT count(*) INTO v_uncertain FROM operations WHERE thread_id = t.id AND status = 'uncertain';
    IF v_uncertain > 0 THEN
        PERFORM agentloop_refuse(409, 'operations_uncertain',
            format('%s tool call(s) of this thread may or may not have taken effect: resolve them first '
                   '(GET /api/runs/{id}/operations, then "it happened" or "it did not"), so their record is not lost',
                   v_uncertain));
    END IF;
    PERFORM agentloop_cancel_all(t.id);
    UPDATE threads SET deleted_at = now(), updated_at = now() WHERE id = t.id;
    PERFORM agentloop_journal(t.id, 'thread_deleted', jsonb_build_object('threadId', t.id));
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN jsonb_build_object('threadId', t.id);
END $$;

-- As in 000007, with 2.
CREATE OR REPLACE FUNCTION agentloop_restore_thread(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads;
BEGIN
    SELECT * INTO t FROM threads
     WHERE id = (p ->> 'threadId')::uuid AND owner_id = (p ->> 'principalId')::uuid
       AND deleted_at IS NOT NULL
       AND (deleted_at > now() - make_interval(secs => (p ->> 'windowMs')::double precision / 1000)
            OR EXISTS (SELECT 1 FROM operations o WHERE o.thread_id = threads.id AND o.status = 'uncertain'))
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        PERFORM agentloop_refuse(404, 'not_found', 'no deleted thread to restore (the undo window may have passed)');
    END IF;
    UPDATE threads SET deleted_at = NULL, updated_at = now() WHERE id = t.id RETURNING * INTO t;
    PERFORM agentloop_journal(t.id, 'thread', agentloop_thread_json(t));
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN agentloop_thread_json(t);
END $$;

-- As in 000023, with 3.
CREATE OR REPLACE FUNCTION agentloop_purge_threads(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_rows bigint := (p ->> 'rows')::bigint;
    v_deleted bigint := 0;
    v_threads int := 0;
    v_thread uuid;
    v_held boolean;
    v_skipped uuid[] := '{}';
BEGIN
    LOOP
        SELECT id INTO v_thread FROM threads
         WHERE deleted_at IS NOT NULL AND deleted_at < now() - make_interval(hours => (p ->> 'keepHours')::int)
           AND NOT (id = ANY(v_skipped))
           AND NOT EXISTS (SELECT 1 FROM operations o WHERE o.thread_id = threads.id AND o.status = 'uncertain')
         ORDER BY deleted_at LIMIT 1 FOR UPDATE SKIP LOCKED;
        IF v_thread IS NULL THEN
            RETURN jsonb_build_object('deleted', v_deleted, 'threads', v_threads, 'done', true);
        END IF;
        v_deleted := v_deleted + agentloop_delete_some('thread_events', 'thread_id = $1', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('messages', 'thread_id = $1', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('context_snapshots', 'thread_id = $1', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('tool_approvals', 'thread_id = $1', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('operations', 'thread_id = $1', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('run_steps',
            'run_id IN (SELECT id FROM runs WHERE thread_id = $1)', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('runs', 'thread_id = $1', v_thread, v_rows - v_deleted);
        IF v_deleted >= v_rows THEN
            RETURN jsonb_build_object('deleted', v_deleted, 'threads', v_threads, 'done', false);
        END IF;
        -- Nothing is left under it: the row itself. Rows of other threads that point at it (a
        -- child thread, a run whose context was compacted from it) get NULL through their
        -- foreign keys, which would lock them in storage order, waiting. So they are locked here
        -- first: child threads in id order, then those runs, none waited for. One held by
        -- another transaction leaves the thread row to the next pass; the batch goes on with the
        -- next deleted thread.
        WITH c AS (SELECT id FROM threads WHERE parent_thread_id = v_thread ORDER BY id FOR NO KEY UPDATE SKIP LOCKED),
             r AS (SELECT id FROM runs WHERE source_thread_id = v_thread ORDER BY id FOR NO KEY UPDATE SKIP LOCKED)
        SELECT (SELECT count(*) FROM c) < (SELECT count(*) FROM threads WHERE parent_thread_id = v_thread)
            OR (SELECT count(*) FROM r) < (SELECT count(*) FROM runs WHERE source_thread_id = v_thread)
          INTO v_held;
        IF v_held THEN
            v_skipped := v_skipped || v_thread;
            v_thread := NULL;
            CONTINUE;
        END IF;
        DELETE FROM threads WHERE id = v_thread;
        v_deleted := v_deleted + 1;
        v_threads := v_threads + 1;
        IF v_deleted >= v_rows THEN
            RETURN jsonb_build_object('deleted', v_deleted, 'threads', v_threads, 'done', false);
        END IF;
        v_thread := NULL;
    END LOOP;
END $$;
