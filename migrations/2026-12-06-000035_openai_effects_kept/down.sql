-- Reverts 000035: agentloop_openai_release as in 000029.
CREATE OR REPLACE FUNCTION agentloop_openai_release(p_thread uuid, p_delivered boolean) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_uncertain boolean;
BEGIN
    PERFORM agentloop_cancel_all(p_thread);
    IF EXISTS (SELECT 1 FROM runs WHERE thread_id = p_thread
                AND status IN ('pending', 'queued', 'running', 'waiting_approval', 'waiting_authorization', 'blocked')) THEN
        UPDATE openai_requests SET expires_at = least(expires_at, now()) WHERE thread_id = p_thread;
        RETURN false;
    END IF;
    v_uncertain := EXISTS (SELECT 1 FROM operations WHERE thread_id = p_thread AND status IN ('dispatched', 'uncertain'));
    IF v_uncertain OR (NOT p_delivered AND EXISTS (SELECT 1 FROM operations WHERE thread_id = p_thread)) THEN
        DELETE FROM openai_requests WHERE thread_id = p_thread;
        UPDATE threads SET title = CASE WHEN v_uncertain THEN 'OpenAI request with a tool call of unknown outcome'
                                        ELSE 'OpenAI request not answered after its tool calls took effect' END,
                           metadata = (metadata - 'stateless') || '{"openaiRequest": true}'::jsonb,
                           updated_at = now()
         WHERE id = p_thread;
        RETURN true;
    END IF;
    DELETE FROM threads WHERE id = p_thread;
    RETURN true;
END $$;
