-- `multitask: interrupt` means the newest turn wins (LangGraph's interrupt cancels every
-- in-flight run of the thread). It cancelled only the active run, so turns waiting behind it
-- (`enqueue`, or earlier interrupts still pending while the active run stopped) were promoted
-- one after another: six interrupts sent at once ran two full answers in turn and left four
-- turns unanswered. Now an interrupt cancels the active run and every pending turn of the
-- thread (agentloop_cancel_all: pending first, so none is promoted), in the same transaction
-- and under the thread lock, so of concurrent interrupts the last one (in lock order) runs.
-- As in 000005 otherwise.
CREATE OR REPLACE FUNCTION agentloop_chat(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_principal uuid := (p ->> 'principalId')::uuid;
    v_key text := p ->> 'commandId';
    t threads;
    a runs;
    r runs;
    v_policy text;
    v_model text;
    v_status text;
    v_message jsonb := 'null'::jsonb;
    v_input jsonb;
    v_response jsonb;
    v_fingerprint text;
BEGIN
    IF v_key IS NOT NULL THEN
        INSERT INTO command_receipts (principal_id, command_id, fingerprint)
        VALUES (v_principal, v_key, p ->> 'fingerprint') ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            SELECT fingerprint, response INTO v_fingerprint, v_response FROM command_receipts
             WHERE principal_id = v_principal AND command_id = v_key;
            IF v_response IS NOT NULL AND v_fingerprint = p ->> 'fingerprint' THEN
                RETURN v_response;
            END IF;
            PERFORM agentloop_refuse(409, 'idempotency_conflict',
                                     'this idempotency key was already used with a different request');
        END IF;
    END IF;
    t := agentloop_lock_thread((p ->> 'threadId')::uuid, v_principal);
    a := agentloop_lock_active(t.id);
    v_policy := coalesce(p ->> 'multitask',
                         CASE WHEN t.metadata ->> 'multitask' IN ('reject', 'enqueue', 'interrupt')
                              THEN t.metadata ->> 'multitask' END,
                         'reject');
    v_model := agentloop_pick_model(t, p);
    IF a.id IS NOT NULL AND v_policy = 'interrupt' THEN
        -- The newest turn wins: the active run and every turn waiting behind it (pending first,
        -- so none is promoted by the active run's end).
        PERFORM agentloop_cancel_all(t.id);
        a := agentloop_lock_active(t.id);
    END IF;
    IF a.id IS NULL THEN
        v_status := 'queued';
    ELSIF a.status = 'waiting_approval' THEN
        PERFORM agentloop_refuse(409, 'approval_required',
            format('run %s is waiting for a tool approval; approve or reject it first', a.id));
    ELSIF v_policy = 'reject' THEN
        PERFORM agentloop_refuse(409, 'run_active',
            format('run %s is still %s; wait for it, cancel it, or send it to be queued (multitask: enqueue)', a.id, a.status));
    ELSE
        v_status := 'pending';
    END IF;
    IF v_status = 'queued' THEN
        v_message := agentloop_append(t.id, NULL, NULL, jsonb_build_array(jsonb_build_object(
            'role', 'user', 'content', p -> 'content', 'tokenEstimate', p -> 'tokenEstimate',
            'byteSize', p -> 'byteSize'))) -> 0;
    ELSE
        v_input := jsonb_build_object('content', p -> 'content', 'tokenEstimate', p -> 'tokenEstimate',
                                      'byteSize', p -> 'byteSize');
    END IF;
    r := agentloop_insert_run(t, v_principal, v_status, v_model, (p ->> 'maxSteps')::int, v_key, v_input, 'agent', NULL);
    v_response := jsonb_build_object('run', agentloop_run_json(r), 'message', v_message);
    IF v_key IS NOT NULL THEN
        UPDATE command_receipts SET response = v_response, thread_id = t.id, run_id = r.id
         WHERE principal_id = v_principal AND command_id = v_key;
    END IF;
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN v_response;
END $$;
