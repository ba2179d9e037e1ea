-- An edit or a regenerate that would replace tool calls which took effect (or may have) asks
-- first (acceptance probe F). Regenerating the message of a `pay` call, or editing the user turn
-- before it (a typo fix), made those rows inactive — the model no longer saw that it had paid —
-- and the new run paid again under a new operation key, without a word to the user. Such a
-- command is now refused 409 `effects_in_branch`, naming the tools, unless it says
-- `repeatEffects: true` (the UI asks the user). Effects: operations `dispatched`, `completed`
-- or `uncertain` of the calls in the replaced rows (the assistant message that made the call,
-- or its result).

-- The distinct tool names of the calls in the active rows of `p_thread` from `p_from` on whose
-- operations took effect or may have; NULL when there is none.
CREATE FUNCTION agentloop_effects_from(p_thread uuid, p_from bigint) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT string_agg(DISTINCT o.tool_name, ', ' ORDER BY o.tool_name)
      FROM operations o
     WHERE o.thread_id = p_thread AND o.status IN ('dispatched', 'completed', 'uncertain')
       AND EXISTS (SELECT 1 FROM messages m
                    WHERE m.run_id = o.run_id AND m.thread_id = p_thread AND m.active AND m.sequence >= p_from
                      AND (m.tool_call_id = o.tool_call_id
                           OR (m.tool_calls IS NOT NULL
                               AND m.tool_calls @> jsonb_build_array(jsonb_build_object('id', o.tool_call_id)))))
$$;

-- Refuses (409 effects_in_branch) unless p.repeatEffects.
CREATE FUNCTION agentloop_check_effects(p_thread uuid, p_from bigint, p jsonb) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_tools text;
BEGIN
    IF coalesce((p ->> 'repeatEffects')::boolean, false) THEN
        RETURN;
    END IF;
    v_tools := agentloop_effects_from(p_thread, p_from);
    IF v_tools IS NOT NULL THEN
        PERFORM agentloop_refuse(409, 'effects_in_branch',
            'the messages this replaces hold tool calls that took effect or may have (' || v_tools
            || '): they are not undone, and a new answer may make them again; send repeatEffects: true to go ahead');
    END IF;
END $$;

-- As in 000007, with the check; a missing message is refused before a busy thread.
CREATE OR REPLACE FUNCTION agentloop_edit_branching(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
    v_from bigint;
BEGIN
    -- A message that does not exist is 404 before a busy thread's 409 (acceptance probe F).
    v_from := agentloop_branch_start(t.id, (p ->> 'sequence')::bigint, true);
    PERFORM agentloop_ensure_idle(t.id);
    PERFORM agentloop_check_effects(t.id, v_from, p);
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
    PERFORM agentloop_check_effects(t.id, v_from, p);
    PERFORM agentloop_save_branch(t.id, v_from);
    RETURN agentloop_regenerate(p);
END $$;
