-- Live reads get slimmed journal payloads from PostgreSQL itself (issue 10).
--
-- A journal row carries the whole changed row: a PATCH of 1 MiB `metadata` journals a 1 MiB
-- `thread` event, a 1 MB turn a 1 MB `message` event. The api used to read each such row whole
-- and slim it in memory (`api/src/hub.rs` `slim`), so every live client catching up pulled
-- megabytes through its pooled connection (whose buffers then kept that size) and spent CPU
-- parsing what it threw away. This function applies the same rule in the query: a payload
-- larger than p_max bytes of JSON text keeps its small members; a member larger than
-- max(p_max / 8, 256) bytes is dropped, or, for a string, cut to that many bytes at a character
-- boundary with a note of how many bytes were omitted; the result says `"truncated": true` and
-- lists the `omitted` members. A client re-reads the row for the full value.
CREATE FUNCTION agentloop_slim_event(p_payload jsonb, p_max int) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v_member_max int := greatest(p_max / 8, 256);
    v_out jsonb := '{}'::jsonb;
    v_omitted jsonb := '[]'::jsonb;
    v_key text;
    v_value jsonb;
    v_text text;
    v_cut text;
    v_chars int;
BEGIN
    IF p_payload IS NULL OR octet_length(p_payload::text) <= p_max THEN
        RETURN p_payload;
    END IF;
    IF jsonb_typeof(p_payload) <> 'object' THEN
        RETURN '{"truncated": true}'::jsonb;
    END IF;
    FOR v_key, v_value IN SELECT key, value FROM jsonb_each(p_payload) LOOP
        IF octet_length(v_value::text) <= v_member_max THEN
            v_out := v_out || jsonb_build_object(v_key, v_value);
            CONTINUE;
        END IF;
        v_omitted := v_omitted || to_jsonb(v_key);
        IF jsonb_typeof(v_value) = 'string' THEN
            v_text := v_value #>> '{}';
            -- Characters, shrunk until the cut fits in v_member_max bytes.
            v_chars := v_member_max;
            v_cut := left(v_text, v_chars);
            WHILE octet_length(v_cut) > v_member_max LOOP
                v_chars := greatest(v_chars * v_member_max / octet_length(v_cut), 1) - 1;
                v_cut := left(v_text, v_chars);
            END LOOP;
            v_out := v_out || jsonb_build_object(v_key,
                v_cut || E'\n…[' || (octet_length(v_text) - octet_length(v_cut))::text || ' bytes omitted]');
        END IF;
    END LOOP;
    RETURN v_out || jsonb_build_object('truncated', true, 'omitted', v_omitted);
END $$;
