-- Search snippets cost a bounded amount per hit (acceptance probe N, N-9). `ts_headline` parsed
-- the whole search text of each hit (up to 131,072 characters since 000043) again, for every one
-- of up to 100 hits: a 16-word search over 90 messages of 128 KB took PostgreSQL past the api's
-- 10 s bound (503) every time. A snippet is now cut from 4,096 characters around the first
-- place the query's first word occurs (or the text's start), which holds every snippet
-- ts_headline makes (MaxWords=24). The hit markers are removed from that text as in 000028.

CREATE OR REPLACE FUNCTION agentloop_snippet_text(c jsonb, p_word text) RETURNS text LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v text := translate(agentloop_search_text(c), chr(2) || chr(3), '');
    v_at int := 0;
BEGIN
    IF v IS NULL OR length(v) <= 4096 THEN RETURN v; END IF;
    IF p_word IS NOT NULL AND p_word <> '' THEN v_at := strpos(lower(v), p_word); END IF;
    RETURN substr(v, greatest(1, v_at - 1024), 4096);
END $$;

-- As in 000028, with the snippet cut from agentloop_snippet_text.
CREATE OR REPLACE FUNCTION agentloop_search(p jsonb) RETURNS jsonb LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_owner uuid := (p ->> 'principalId')::uuid;
    q tsquery := to_tsquery('simple', p ->> 'query');
    v_limit int := least(greatest(coalesce((p ->> 'limit')::int, 20), 1), 100);
    -- The query's first word (the api writes `'word' & ... & 'last':*`, lower case).
    v_word text := substring(p ->> 'query' from '''([^'']+)''');
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
                                  'snippet', ts_headline('simple', agentloop_snippet_text(m.content, v_word), q,
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

