-- Reverts 000037: edit and regenerate as in 000007 (no check).
CREATE OR REPLACE FUNCTION agentloop_edit_branching(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
BEGIN
    PERFORM agentloop_ensure_idle(t.id);
    PERFORM agentloop_save_branch(t.id, agentloop_branch_start(t.id, (p ->> 'sequence')::bigint, true));
    RETURN agentloop_edit(p);
END $$;
CREATE OR REPLACE FUNCTION agentloop_regenerate_branching(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
BEGIN
    PERFORM agentloop_ensure_idle(t.id);
    PERFORM agentloop_save_branch(t.id, agentloop_branch_start(t.id, (p ->> 'sequence')::bigint, false));
    RETURN agentloop_regenerate(p);
END $$;
DROP FUNCTION agentloop_check_effects(uuid, bigint[], jsonb);
DROP FUNCTION agentloop_effects_in(uuid, bigint[]);
DROP FUNCTION agentloop_active_from(uuid, bigint);
CREATE OR REPLACE FUNCTION agentloop_delete_message(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
    m messages;
    v_done jsonb;
BEGIN
    PERFORM agentloop_ensure_idle(t.id);
    m := agentloop_active_at(t.id, (p ->> 'sequence')::bigint);
    v_done := agentloop_deactivate(t.id, agentloop_tool_group(m));
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN jsonb_build_object('deactivated', v_done);
END $$;
CREATE OR REPLACE FUNCTION agentloop_activate_branch(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
    m messages;
    v_parent bigint;
    v_target bigint := (p ->> 'firstSequence')::bigint;
    b message_branches;
    v_current bigint[];
    v_done jsonb;
    v_activated jsonb;
    v_n int;
BEGIN
    PERFORM agentloop_ensure_idle(t.id);
    m := agentloop_active_at(t.id, (p ->> 'sequence')::bigint);
    v_parent := agentloop_fork_of(t.id, m.sequence);
    IF v_parent IS NULL THEN
        PERFORM agentloop_refuse(404, 'not_found', 'this message has no other branch');
    END IF;
    IF v_target = m.sequence THEN
        RETURN jsonb_build_object('parentSequence', v_parent, 'activated', '[]'::jsonb, 'deactivated', '[]'::jsonb);
    END IF;
    SELECT * INTO b FROM message_branches
     WHERE thread_id = t.id AND parent_sequence = v_parent AND first_sequence = v_target FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM agentloop_refuse(404, 'not_found', format('no branch starting at message %s here', v_target));
    END IF;
    v_current := ARRAY(SELECT sequence FROM messages WHERE thread_id = t.id AND active AND sequence > v_parent
                        ORDER BY sequence);
    INSERT INTO message_branches (thread_id, parent_sequence, first_sequence, sequences)
    VALUES (t.id, v_parent, v_current[1], v_current)
    ON CONFLICT (thread_id, parent_sequence, first_sequence) DO UPDATE SET sequences = excluded.sequences;
    v_done := agentloop_deactivate(t.id, v_current);
    WITH a AS (
        UPDATE messages SET active = true
         WHERE thread_id = t.id AND NOT active AND sequence = ANY(b.sequences) RETURNING sequence
    )
    SELECT coalesce(jsonb_agg(sequence ORDER BY sequence), '[]'::jsonb), count(*) INTO v_activated, v_n FROM a;
    UPDATE threads SET message_count = message_count + v_n, updated_at = now() WHERE id = t.id;
    DELETE FROM message_branches WHERE thread_id = t.id AND parent_sequence = v_parent AND first_sequence = v_target;
    PERFORM agentloop_journal(t.id, 'branch_switched', jsonb_build_object(
        'parentSequence', v_parent, 'activated', v_activated, 'deactivated', v_done));
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN jsonb_build_object('parentSequence', v_parent, 'activated', v_activated, 'deactivated', v_done);
END $$;
