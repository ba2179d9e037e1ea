-- As in 000007.
CREATE OR REPLACE FUNCTION agentloop_fork_of(p_thread uuid, p_sequence bigint) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT max(b.parent_sequence) FROM message_branches b
     WHERE b.thread_id = p_thread AND b.parent_sequence < p_sequence
       AND b.parent_sequence >= coalesce((SELECT max(sequence) FROM messages
                                            WHERE thread_id = p_thread AND active AND sequence < p_sequence), 0)
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


DROP FUNCTION agentloop_fork_is_saved(uuid, bigint);
