ALTER FUNCTION agentloop_slice_start(jsonb) RESET plan_cache_mode;

CREATE OR REPLACE FUNCTION agentloop_search_text(c jsonb) RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE jsonb_typeof(c)
        WHEN 'string' THEN c #>> '{}'
        WHEN 'array' THEN (SELECT string_agg(e ->> 'text', ' ') FROM jsonb_array_elements(c) e
                            WHERE jsonb_typeof(e) = 'object' AND e ->> 'type' = 'text')
        ELSE '' END
$$;

-- As in 000018.
CREATE OR REPLACE FUNCTION agentloop_notify(p_threads uuid[]) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_entry text;
    v_payload text := '';
    v_wake text := nullif(current_setting('agentloop.wake', true), '');
BEGIN
    FOR v_entry IN SELECT id::text || ':' || last_event_sequence::text FROM threads
                    WHERE id = ANY(p_threads) AND last_event_sequence > 0 ORDER BY id LOOP
        IF octet_length(v_payload) + octet_length(v_entry) > 7900 THEN
            PERFORM agentloop_send('agentloop_threads', v_payload);
            v_payload := '';
        END IF;
        v_payload := CASE WHEN v_payload = '' THEN v_entry ELSE v_payload || ',' || v_entry END;
    END LOOP;
    IF v_payload <> '' THEN
        PERFORM agentloop_send('agentloop_threads', v_payload);
    END IF;
    IF v_wake IS NOT NULL THEN
        PERFORM agentloop_send('agentloop_runs', left(v_wake, 7900));
        PERFORM set_config('agentloop.wake', '', true);
    END IF;
END $$;

-- As in 000020.
CREATE OR REPLACE FUNCTION agentloop_claim(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_owner text := p ->> 'owner';
    v_lease interval := make_interval(secs => (p ->> 'leaseMs')::bigint / 1000.0);
    v_inflight uuid[] := coalesce((SELECT array_agg(x::uuid) FROM jsonb_array_elements_text(p -> 'inflight') x), '{}');
    v_start jsonb := p -> 'start';
    v_adopted jsonb;
    v_claimed jsonb;
    v_fresh uuid[];
    v_starts jsonb := '{}'::jsonb;
    v_n int;
    v_started int := 0;
    v_id uuid;
    fr runs;
    m jsonb;
BEGIN
    IF coalesce((p ->> 'adopt')::boolean, false) THEN
        WITH a AS (
            UPDATE runs r SET lease_expires_at = now() + v_lease
             WHERE r.status = 'running' AND r.lease_owner = v_owner AND r.lease_expires_at > now()
               AND NOT (r.id = ANY(v_inflight))
            RETURNING r.seq, agentloop_run_json(r) AS j
        )
        SELECT coalesce(jsonb_agg(j ORDER BY seq), '[]'::jsonb) INTO v_adopted FROM a;
    ELSE
        v_adopted := '[]'::jsonb;
    END IF;
    v_n := greatest((p ->> 'limit')::int - jsonb_array_length(v_adopted), 0);
    WITH c AS (
        SELECT id, status AS prior FROM runs
         WHERE status IN ('queued', 'running') AND (status = 'queued' OR lease_expires_at < now())
         ORDER BY seq LIMIT v_n
           FOR UPDATE SKIP LOCKED
    ), u AS (
        UPDATE runs r SET status = 'running', lease_owner = v_owner, lease_epoch = r.lease_epoch + 1,
                          attempts = r.attempts + 1,
                          recoveries = r.recoveries + (r.status = 'running')::int,
                          faults = r.faults + (r.status = 'running')::int,
                          lease_expires_at = now() + v_lease,
                          started_at = coalesce(r.started_at, clock_timestamp()), updated_at = now()
          FROM c WHERE r.id = c.id
        RETURNING r.seq, r.id, c.prior, agentloop_run_json(r) AS j
    )
    SELECT coalesce(jsonb_agg(j ORDER BY seq), '[]'::jsonb),
           coalesce(array_agg(id ORDER BY seq) FILTER (WHERE prior = 'queued'), '{}')
      INTO v_claimed, v_fresh FROM u;

    IF jsonb_typeof(v_start) = 'object' THEN
        FOREACH v_id IN ARRAY v_fresh LOOP
            EXIT WHEN v_started >= coalesce((v_start ->> 'limit')::int, 0)
                   OR pg_column_size(v_starts) >= coalesce((v_start ->> 'maxBytes')::bigint, 4194304);
            SELECT * INTO fr FROM runs WHERE id = v_id;
            m := v_start -> 'models' -> fr.model;
            CONTINUE WHEN jsonb_typeof(m) IS DISTINCT FROM 'object'
                       OR fr.faults > coalesce((v_start ->> 'maxRecoveries')::int, 2147483647)
                       OR fr.cancel_requested_at IS NOT NULL
                       OR fr.steps_used >= fr.max_steps;
            BEGIN
                PERFORM 1 FROM threads WHERE id = fr.thread_id FOR NO KEY UPDATE SKIP LOCKED;
                IF FOUND THEN
                    v_starts := v_starts || jsonb_build_object(fr.id::text, agentloop_slice_start(jsonb_build_object(
                        'runId', fr.id, 'threadId', fr.thread_id, 'owner', v_owner, 'epoch', fr.lease_epoch,
                        'leaseMs', (p ->> 'leaseMs')::bigint, 'stepSequence', fr.steps_used + 1,
                        'model', m -> 'model', 'toolTokens', m -> 'toolTokens', 'contextLimit', m -> 'contextLimit')));
                    v_started := v_started + 1;
                END IF;
            EXCEPTION WHEN OTHERS THEN
                -- Rolled back to before this start; the worker starts the run itself.
                NULL;
            END;
        END LOOP;
    END IF;

    IF jsonb_array_length(v_claimed) = v_n AND v_n > 0 THEN
        -- Every slot filled: the caller claims again when a slot frees; no timer needed.
        RETURN jsonb_build_object('runs', v_adopted || v_claimed, 'starts', v_starts,
                                  'nextExpiryMs', NULL, 'queuedLeft', false);
    END IF;
    RETURN jsonb_build_object(
        'runs', v_adopted || v_claimed,
        'starts', v_starts,
        'nextExpiryMs', (SELECT (extract(epoch FROM (min(lease_expires_at) - now())) * 1000)::bigint
                           FROM runs WHERE status IN ('queued', 'running') AND status = 'running'
                            AND lease_owner IS DISTINCT FROM v_owner),
        'queuedLeft', EXISTS (SELECT 1 FROM runs WHERE status IN ('queued', 'running') AND status = 'queued'));
END $$;
