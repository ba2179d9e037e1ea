-- An edit, a regenerate or a message delete that would take tool calls which took effect (or may
-- have) out of the conversation asks first (acceptance probes F and G). Regenerating the message of a `pay` call, or editing the user turn
-- before it (a typo fix), made those rows inactive — the model no longer saw that it had paid —
-- and the new run paid again under a new operation key, without a word to the user. Such a
-- command is now refused 409 `effects_in_branch`, naming the tools, unless it says
-- `repeatEffects: true` (the UI asks the user). Effects: operations `dispatched`, `completed`
-- or `uncertain` of the calls in the replaced rows (the assistant message that made the call,
-- or its result).

-- The distinct tool names of the calls in the rows `p_sequences` of `p_thread` whose operations
-- took effect or may have; NULL when there is none.
CREATE FUNCTION agentloop_effects_in(p_thread uuid, p_sequences bigint[]) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT string_agg(DISTINCT o.tool_name, ', ' ORDER BY o.tool_name)
      FROM operations o
     WHERE o.thread_id = p_thread AND o.status IN ('dispatched', 'completed', 'uncertain')
       AND EXISTS (SELECT 1 FROM messages m
                    WHERE m.run_id = o.run_id AND m.thread_id = p_thread AND m.sequence = ANY(p_sequences)
                      AND (m.tool_call_id = o.tool_call_id
                           OR (m.tool_calls IS NOT NULL
                               AND m.tool_calls @> jsonb_build_array(jsonb_build_object('id', o.tool_call_id)))))
$$;

-- Refuses (409 effects_in_branch) to take the rows `p_sequences` out of the conversation when
-- their calls took effect, unless p.repeatEffects.
CREATE FUNCTION agentloop_check_effects(p_thread uuid, p_sequences bigint[], p jsonb) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_tools text;
BEGIN
    IF coalesce((p ->> 'repeatEffects')::boolean, false) THEN
        RETURN;
    END IF;
    v_tools := agentloop_effects_in(p_thread, p_sequences);
    IF v_tools IS NOT NULL THEN
        PERFORM agentloop_refuse(409, 'effects_in_branch',
            'the messages this takes out of the conversation hold tool calls that took effect or may have (' || v_tools
            || '): they are not undone, and the model, no longer seeing them, may make them again; send repeatEffects: true to go ahead');
    END IF;
END $$;

-- The active rows of `p_thread` from `p_from` on.
CREATE FUNCTION agentloop_active_from(p_thread uuid, p_from bigint) RETURNS bigint[] LANGUAGE sql STABLE AS $$
    SELECT coalesce(array_agg(sequence), '{}') FROM messages WHERE thread_id = p_thread AND active AND sequence >= p_from
$$;

-- As in 000007, with the check; a missing message is refused before a busy thread.
CREATE OR REPLACE FUNCTION agentloop_edit_branching(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
    v_from bigint;
BEGIN
    -- A message that does not exist is 404 before a busy thread's 409 (acceptance probe F).
    v_from := agentloop_branch_start(t.id, (p ->> 'sequence')::bigint, true);
    PERFORM agentloop_ensure_idle(t.id);
    PERFORM agentloop_check_effects(t.id, agentloop_active_from(t.id, v_from), p);
    PERFORM agentloop_save_branch(t.id, v_from);
    RETURN agentloop_edit(p);
END $$;

CREATE OR REPLACE FUNCTION agentloop_regenerate_branching(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
    v_from bigint;
BEGIN
    -- A message that does not exist is 404 before a busy thread's 409 (acceptance probe F).
    v_from := agentloop_branch_start(t.id, (p ->> 'sequence')::bigint, false);
    PERFORM agentloop_ensure_idle(t.id);
    PERFORM agentloop_check_effects(t.id, agentloop_active_from(t.id, v_from), p);
    PERFORM agentloop_save_branch(t.id, v_from);
    RETURN agentloop_regenerate(p);
END $$;

-- As in 000005, with the check (a tool group whose calls took effect: the model would no longer
-- see them; acceptance probe G deleted a payment's group, regenerated, and it paid again).
CREATE OR REPLACE FUNCTION agentloop_delete_message(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
    m messages;
    v_group bigint[];
    v_done jsonb;
BEGIN
    m := agentloop_active_at(t.id, (p ->> 'sequence')::bigint);
    PERFORM agentloop_ensure_idle(t.id);
    v_group := agentloop_tool_group(m);
    PERFORM agentloop_check_effects(t.id, v_group, p);
    v_done := agentloop_deactivate(t.id, v_group);
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN jsonb_build_object('deactivated', v_done);
END $$;

-- As in 000007, with the check: the alternative shown now leaves the model's view.
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
    PERFORM agentloop_check_effects(t.id, ARRAY(SELECT unnest(v_current) EXCEPT SELECT unnest(b.sequences)), p);
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
