-- Message text reaches PostgreSQL's text search bounded (found in the web UI: an answer of
-- 48,000 `_a` on one line could never be committed). PostgreSQL's default text-search parser
-- takes time quadratic in the length of a run without whitespace for some characters (`_a`,
-- `a_`, `./`, `/~` repeated: 16,000 characters 8 s, 96,000 about 5 minutes), and the search
-- index computed that for every message written: the worker's commit of such an answer timed
-- out, was retried, and the paid answer was never stored; a turn or an import with it failed the
-- same way. And a tsvector holds at most 1 MiB: an answer of ~2 MB of distinct words failed its
-- insert with `string is too long for tsvector`. Now the search text of a message (its index
-- expression, and the text snippets are cut from) is its first 131,072 characters (at most
-- ~512 KiB of lexemes), with every run of 64 non-whitespace characters cut after its 64th —
-- linear time (~1 s for 1 MB of the worst case) and always within the tsvector bound. Search
-- then finds words in a message's first 128 Ki characters; a word inside a run of more than 64
-- non-space characters (a long URL, base64) may be cut in two. Titles (500 characters at most)
-- and search queries (16 words of at most 64 letters or digits, api/src/reads.rs) need no bound.

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
-- commit
-- The index holds the old function's vectors until it is rebuilt: a rebuild left invalid by an
-- earlier failed attempt is dropped first.
DO $$
DECLARE
    v_name text;
BEGIN
    FOR v_name IN SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                   WHERE NOT i.indisvalid AND c.relname LIKE 'messages\_search\_ccnew%' LOOP
        EXECUTE format('DROP INDEX %I', v_name);
    END LOOP;
END $$;
-- commit
SET lock_timeout = 0;
-- commit
REINDEX INDEX CONCURRENTLY messages_search;
