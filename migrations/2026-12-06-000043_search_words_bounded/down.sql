-- Development databases only (production never runs down.sql): the search text of 000021,
-- unbounded, and the index rebuilt with it.
CREATE OR REPLACE FUNCTION agentloop_search_text(c jsonb) RETURNS text LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN CASE jsonb_typeof(c)
        WHEN 'string' THEN c #>> '{}'
        WHEN 'array' THEN (SELECT string_agg(e ->> 'text', ' ') FROM jsonb_array_elements(c) e
                            WHERE jsonb_typeof(e) = 'object' AND e ->> 'type' = 'text')
        ELSE '' END;
END $$;
-- commit
REINDEX INDEX CONCURRENTLY messages_search;
