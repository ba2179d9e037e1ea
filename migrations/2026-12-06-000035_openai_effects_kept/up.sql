-- The record of a `/v1/chat/completions` request whose tool calls took effect is always kept
-- (acceptance probe F). 000029 kept it only when the request ended without its answer
-- *delivered*, but the api cannot know that: a response handed to the socket after the client
-- had gone counted as delivered (a client that closed 154 ms before the answer: its payment
-- happened, it never got the answer, and the thread, the run and the operation were deleted —
-- 2-5 of 30 disconnecting clients per try). Such a client resends, and the operator had no
-- record of the first payment. Now a hidden thread with any operation (a non-idempotent call
-- dispatched) is kept as an ordinary thread of the principal whatever the delivery; threads
-- without one are deleted as before.

-- As in 000029, with the delivery only choosing the title.
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
    IF v_uncertain OR EXISTS (SELECT 1 FROM operations WHERE thread_id = p_thread) THEN
        DELETE FROM openai_requests WHERE thread_id = p_thread;
        UPDATE threads SET title = CASE WHEN v_uncertain THEN 'OpenAI request with a tool call of unknown outcome'
                                        WHEN p_delivered THEN 'OpenAI request whose tool calls took effect'
                                        ELSE 'OpenAI request not answered after its tool calls took effect' END,
                           metadata = (metadata - 'stateless') || '{"openaiRequest": true}'::jsonb,
                           updated_at = now()
         WHERE id = p_thread;
        RETURN true;
    END IF;
    DELETE FROM threads WHERE id = p_thread;
    RETURN true;
END $$;
