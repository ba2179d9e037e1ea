-- Development databases only (production never runs down.sql): the search of 000028.
CREATE OR REPLACE FUNCTION agentloop_search(p jsonb) RETURNS jsonb LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_owner uuid := (p ->> 'principalId')::uuid;
    q tsquery := to_tsquery('simple', p ->> 'query');
    v_limit int := least(greatest(coalesce((p ->> 'limit')::int, 20), 1), 100);
    v_threads jsonb;
    v_messages jsonb;
BEGIN
    SELECT coalesce(jsonb_agg(x ORDER BY u DESC), '[]'::jsonb) INTO v_threads FROM (
        SELECT jsonb_build_object('id', t.id, 'title', t.title, 'updatedAt', t.updated_at) AS x, t.updated_at AS u
          FROM threads t
         WHERE t.owner_id = v_owner AND t.deleted_at IS NULL AND to_tsvector('simple', t.title) @@ q
           AND NOT coalesce((t.metadata ->> 'stateless')::boolean, false)
         ORDER BY t.updated_at DESC LIMIT v_limit) s;
    SELECT coalesce(jsonb_agg(x ORDER BY c DESC), '[]'::jsonb) INTO v_messages FROM (
        SELECT jsonb_build_object('threadId', t.id, 'title', t.title, 'sequence', m.sequence, 'role', m.role,
                                  'createdAt', m.created_at,
                                  'snippet', ts_headline('simple', translate(agentloop_search_text(m.content), chr(2) || chr(3), ''), q,
                                      'StartSel=' || chr(2) || ', StopSel=' || chr(3) || ', MaxWords=24, MinWords=8, MaxFragments=1')) AS x,
               m.created_at AS c
          FROM messages m JOIN threads t ON t.id = m.thread_id
         WHERE m.active AND m.role IN ('user', 'assistant')
           AND to_tsvector('simple', agentloop_search_text(m.content)) @@ q
           AND t.owner_id = v_owner AND t.deleted_at IS NULL
           AND NOT coalesce((t.metadata ->> 'stateless')::boolean, false)
         ORDER BY m.created_at DESC LIMIT v_limit) s;
    RETURN jsonb_build_object('threads', v_threads, 'messages', v_messages);
END $$;


DROP FUNCTION IF EXISTS agentloop_snippet_text(jsonb, text);
