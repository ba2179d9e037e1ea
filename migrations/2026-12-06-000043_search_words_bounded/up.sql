-- Message text reaches PostgreSQL's text search bounded (found in the web UI: an answer of
-- 48,000 `_a` on one line could never be committed). PostgreSQL's default text-search parser
-- takes time quadratic in the length of a run without whitespace for some characters (`_a`,
-- `a_`, `./`, `/~` repeated: 16,000 characters 8 s, 96,000 about 5 minutes), and the search
-- index computed that for every message written: the worker's commit of such an answer timed
-- out, was retried, and the paid answer was never stored; a turn or an import with it failed the
-- same way. And a tsvector holds at most 1 MiB: an answer of ~2 MB of distinct words failed its
-- insert with `string is too long for tsvector`. Now the indexed text of a message is its first
-- 131,072 characters (at most ~512 KiB of lexemes), with every run of 64 non-whitespace
-- characters cut after its 64th — linear time (~1 s for 1 MB of the worst case) and always
-- within the tsvector bound. Search then finds words in a message's first 128 Ki characters;
-- a word inside a run of more than 64 non-space characters (a long URL, base64) may be cut in
-- two. Titles (500 characters at most) and search queries (16 words of at most 64 letters or
-- digits, api/src/reads.rs) need no bound.

CREATE OR REPLACE FUNCTION agentloop_search_words(c jsonb) RETURNS text LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v text := agentloop_search_text(c);
BEGIN
    IF v IS NULL THEN RETURN NULL; END IF;
    IF length(v) > 131072 THEN v := left(v, 131072); END IF;
    RETURN regexp_replace(v, '(\S{64})', '\1 ', 'g');
END $$;
-- commit
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                WHERE NOT i.indisvalid AND c.relname = 'messages_search_words') THEN
        DROP INDEX messages_search_words;
    END IF;
END $$;
-- commit
SET lock_timeout = 0;
-- commit
CREATE INDEX CONCURRENTLY IF NOT EXISTS messages_search_words ON messages
    USING gin (to_tsvector('simple', agentloop_search_words(content)))
    WHERE active AND role IN ('user', 'assistant');
-- commit
-- As in 000028, on the bounded text.
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
                                  'snippet', ts_headline('simple', translate(agentloop_search_words(m.content), chr(2) || chr(3), ''), q,
                                      'StartSel=' || chr(2) || ', StopSel=' || chr(3) || ', MaxWords=24, MinWords=8, MaxFragments=1')) AS x,
               m.created_at AS c
          FROM messages m JOIN threads t ON t.id = m.thread_id
         WHERE m.active AND m.role IN ('user', 'assistant')
           AND to_tsvector('simple', agentloop_search_words(m.content)) @@ q
           AND t.owner_id = v_owner AND t.deleted_at IS NULL
           AND NOT coalesce((t.metadata ->> 'stateless')::boolean, false)
         ORDER BY m.created_at DESC LIMIT v_limit) s;
    RETURN jsonb_build_object('threads', v_threads, 'messages', v_messages);
END $$;

-- commit
DROP INDEX CONCURRENTLY IF EXISTS messages_search;
