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
DROP FUNCTION agentloop_check_effects(uuid, bigint, jsonb);
DROP FUNCTION agentloop_effects_from(uuid, bigint);
