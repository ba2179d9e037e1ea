-- Development databases only (production never runs down.sql): the expression index, the
-- search and snippet of 000045 and the search text of 000043.
CREATE INDEX CONCURRENTLY IF NOT EXISTS messages_search ON messages
    USING gin (to_tsvector('simple', agentloop_search_text(content))) WHERE active AND role IN ('user', 'assistant');
-- commit
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
-- commit
DROP INDEX CONCURRENTLY IF EXISTS messages_search_vector;
-- commit
DROP TRIGGER IF EXISTS messages_search_vector ON messages;
DROP FUNCTION IF EXISTS agentloop_message_search_vector();
ALTER TABLE messages DROP COLUMN IF EXISTS search_vector;
CREATE OR REPLACE FUNCTION agentloop_snippet_text(c jsonb, p_word text) RETURNS text LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v text := translate(agentloop_search_text(c), chr(2) || chr(3), '');
    v_at int := 0;
BEGIN
    IF v IS NULL OR length(v) <= 4096 THEN RETURN v; END IF;
    IF p_word IS NOT NULL AND p_word <> '' THEN v_at := strpos(lower(v), p_word); END IF;
    RETURN substr(v, greatest(1, v_at - 1024), 4096);
END $$;
CREATE OR REPLACE FUNCTION agentloop_search_text(c jsonb) RETURNS text LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v text := CASE jsonb_typeof(c)
        WHEN 'string' THEN c #>> '{}'
        WHEN 'array' THEN (SELECT string_agg(e ->> 'text', ' ') FROM jsonb_array_elements(c) e
                            WHERE jsonb_typeof(e) = 'object' AND e ->> 'type' = 'text')
        ELSE '' END;
BEGIN
    IF length(v) > 131072 THEN v := left(v, 131072); END IF;
    RETURN regexp_replace(v, '(\S{64})', '\1 ', 'g');
END $$;
DROP FUNCTION IF EXISTS agentloop_content_text(jsonb);
