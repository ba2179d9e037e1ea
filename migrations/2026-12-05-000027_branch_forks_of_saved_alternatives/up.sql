-- Branches (issue 11, found by an acceptance probe): after a regenerate and then an edit of the
-- question before it, the edited turn's branch list offered the replaced ANSWER instead of the
-- original turn; activating it left a history starting with an assistant message, and the
-- original question and its answer could no longer be reached. A fork is found by range (the
-- highest recorded parent between the previous active message and the message asked about, so
-- a fork stays findable after its parent row was deleted), and the regenerate's fork (parent 1)
-- lay in the range of the edit's fork (parent 0) although message 1 was no longer shown: it had
-- become part of the alternative the edit saved. A fork whose parent row is inactive and kept
-- in a saved alternative belongs to that alternative — it is offered again when that
-- alternative is shown — so it is skipped (agentloop_fork_is_saved), in the lookup of a fork
-- and in the switchers of a message window. As in 000007 otherwise.

-- Whether fork parent p_parent of thread p_thread is a row of a saved (not shown) alternative:
-- inactive, and listed in one of the thread's saved alternatives. 0 (the start) never is.
CREATE FUNCTION agentloop_fork_is_saved(p_thread uuid, p_parent bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT p_parent > 0
       AND NOT EXISTS (SELECT 1 FROM messages WHERE thread_id = p_thread AND sequence = p_parent AND active)
       AND EXISTS (SELECT 1 FROM message_branches o WHERE o.thread_id = p_thread AND p_parent = ANY(o.sequences))
$$;

CREATE OR REPLACE FUNCTION agentloop_fork_of(p_thread uuid, p_sequence bigint) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT max(b.parent_sequence) FROM message_branches b
     WHERE b.thread_id = p_thread AND b.parent_sequence < p_sequence
       AND b.parent_sequence >= coalesce((SELECT max(sequence) FROM messages
                                            WHERE thread_id = p_thread AND active AND sequence < p_sequence), 0)
       AND NOT agentloop_fork_is_saved(p_thread, b.parent_sequence)
$$;


CREATE OR REPLACE FUNCTION agentloop_branch_marks(p_thread uuid, p_from bigint, p_to bigint) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    WITH forks AS (
        SELECT b.parent_sequence, count(*) AS saved,
               count(*) FILTER (WHERE b.first_sequence < (SELECT min(sequence) FROM messages
                                                           WHERE thread_id = p_thread AND active
                                                             AND sequence > b.parent_sequence)) AS before
          FROM message_branches b
         WHERE b.thread_id = p_thread AND b.parent_sequence < p_to
           AND b.parent_sequence >= coalesce((SELECT max(sequence) FROM messages
                                               WHERE thread_id = p_thread AND active AND sequence < p_from), 0)
           AND NOT agentloop_fork_is_saved(p_thread, b.parent_sequence)
         GROUP BY b.parent_sequence
    ), marks AS (
        SELECT (SELECT min(sequence) FROM messages WHERE thread_id = p_thread AND active
                                                    AND sequence > f.parent_sequence) AS sequence,
               f.saved, f.before
          FROM forks f
    )
    SELECT coalesce(jsonb_agg(jsonb_build_object('sequence', sequence, 'index', before + 1, 'count', saved + 1)
                              ORDER BY sequence), '[]'::jsonb)
      FROM marks WHERE sequence BETWEEN p_from AND p_to
$$;

