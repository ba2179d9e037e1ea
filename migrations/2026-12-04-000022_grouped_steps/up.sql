-- Grouped steps (issue 9: throughput, "grouped commits").
--
-- A worker whose slices reach a checkpoint (or a slice start) at the same moment sends them as
-- ONE statement: `agentloop_commit_group` / `agentloop_slice_start_group` apply each item in
-- turn, in the caller's order (the workers sort items by thread id: one lock order for every
-- group), in one transaction with one notification flush. Each item is exactly the call it
-- would have been alone — its own fence, its own commit id (a replayed group returns each
-- item's first result) — so a group is as replay-safe as its items. A group is tried once; one
-- that fails (a lock wait past its 250 ms lock_timeout included) is split by the caller and each
-- item sent alone (`shared/src/store/group.rs`), so one item's error or wait never becomes
-- another's.
--
-- Measured before building it, with pgbench driving the workers' SQL (8 clients, 2 cores):
-- four runs per group (claim of 4, 4 starts in one statement, 4 commits in one statement)
-- completed 1.7-2x the runs per second of one run at a time.

-- p = {items: [agentloop_commit values]}; returns the array of their results, in order. A group
-- waits at most 250 ms for any lock (an item whose thread another session holds): it then fails
-- as a whole and the caller sends each item alone, so a blocked item holds up no other.
CREATE FUNCTION agentloop_commit_group(p jsonb) RETURNS jsonb LANGUAGE plpgsql
SET lock_timeout = '250ms' AS $$
DECLARE
    v_item jsonb;
    v_out jsonb[] := '{}';
BEGIN
    FOR v_item IN SELECT value FROM jsonb_array_elements(p -> 'items') WITH ORDINALITY ORDER BY ordinality LOOP
        v_out := v_out || agentloop_commit(v_item);
    END LOOP;
    RETURN to_jsonb(v_out);
END $$;

-- p = {items: [agentloop_slice_start values]}; as agentloop_commit_group.
CREATE FUNCTION agentloop_slice_start_group(p jsonb) RETURNS jsonb LANGUAGE plpgsql
SET lock_timeout = '250ms' AS $$
DECLARE
    v_item jsonb;
    v_out jsonb[] := '{}';
BEGIN
    FOR v_item IN SELECT value FROM jsonb_array_elements(p -> 'items') WITH ORDINALITY ORDER BY ordinality LOOP
        v_out := v_out || agentloop_slice_start(v_item);
    END LOOP;
    RETURN to_jsonb(v_out);
END $$;

-- As in 000018, but a deferred notification on the same channel as the one deferred just before
-- it joins that payload (comma-separated, as every listener reads them; identical payloads
-- once), below 7900 bytes: a group of steps still sends one notification per channel.
CREATE OR REPLACE FUNCTION agentloop_send(p_channel text, p_payload text) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_pending jsonb;
    v_n int;
    v_last text;
BEGIN
    IF current_setting('agentloop.defer_notify', true) = 'on' THEN
        v_pending := coalesce(nullif(current_setting('agentloop.deferred', true), '')::jsonb, '[]'::jsonb);
        v_n := jsonb_array_length(v_pending);
        v_last := CASE WHEN v_n > 0 AND v_pending -> (v_n - 1) ->> 0 = p_channel THEN v_pending -> (v_n - 1) ->> 1 END;
        IF v_last IS NOT NULL AND (v_last = p_payload OR octet_length(v_last) + octet_length(p_payload) < 7900) THEN
            v_pending := jsonb_set(v_pending, ARRAY[(v_n - 1)::text, '1'],
                                   to_jsonb(CASE WHEN v_last = p_payload OR p_payload = '' THEN v_last
                                                 WHEN v_last = '' THEN p_payload
                                                 ELSE v_last || ',' || p_payload END));
        ELSE
            v_pending := v_pending || jsonb_build_array(jsonb_build_array(p_channel, p_payload));
        END IF;
        PERFORM set_config('agentloop.deferred', v_pending::text, false);
    ELSE
        PERFORM pg_notify(p_channel, p_payload);
    END IF;
END $$;

-- As in 000017, but the due rows are taken in thread id order (see above): a group of steps
-- locks its threads in id order too, and the sweep waits for thread locks, so the two must
-- agree or they could deadlock.
CREATE OR REPLACE FUNCTION agentloop_mcp_sweep(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_stuck interval := make_interval(secs => coalesce((p ->> 'stuckMs')::double precision, 60000) / 1000);
    v_limit int := coalesce((p ->> 'limit')::int, 100);
    c record;
    a mcp_authorizations;
    r runs;
    v_ended int := 0;
    v_threads uuid[] := '{}';
    v_next timestamptz;
    v_newer_token boolean;
BEGIN
    -- The oldest due rows, taken in thread id order: the threads are locked (waiting) in the
    -- one order every statement that locks several threads follows (000022).
    FOR c IN
        SELECT * FROM (
        SELECT x.id, x.thread_id, x.run_id FROM mcp_authorizations x
         WHERE (x.status = 'pending'
                AND (x.expires_at <= now()
                     OR EXISTS (SELECT 1 FROM mcp_tokens k
                                 WHERE k.principal_id = x.principal_id AND k.server = x.server
                                   AND k.created_at > x.created_at AND (k.expires_at IS NULL OR k.expires_at > now()))))
            OR (x.status = 'exchanging' AND coalesce(x.taken_at, x.created_at) < now() - v_stuck)
         ORDER BY x.created_at
         LIMIT v_limit) due
         ORDER BY due.thread_id, due.id
    LOOP
        PERFORM 1 FROM threads WHERE id = c.thread_id FOR NO KEY UPDATE;
        SELECT * INTO r FROM runs WHERE id = c.run_id FOR NO KEY UPDATE;
        SELECT * INTO a FROM mcp_authorizations WHERE id = c.id FOR UPDATE;
        v_newer_token := EXISTS (SELECT 1 FROM mcp_tokens k
                                  WHERE k.principal_id = a.principal_id AND k.server = a.server
                                    AND k.created_at > a.created_at AND (k.expires_at IS NULL OR k.expires_at > now()));
        IF a.status = 'pending' AND v_newer_token THEN
            UPDATE mcp_authorizations SET status = 'completed', completed_at = now(),
                   error = 'completed by a later sign-in of the same principal to this server'
             WHERE id = a.id RETURNING * INTO a;
        ELSIF a.status = 'pending' AND a.expires_at <= now() THEN
            UPDATE mcp_authorizations SET status = 'failed', completed_at = now(),
                   error = 'the sign-in link expired before it was used; the run asks again'
             WHERE id = a.id RETURNING * INTO a;
        ELSIF a.status = 'exchanging' AND coalesce(a.taken_at, a.created_at) < now() - v_stuck THEN
            UPDATE mcp_authorizations SET status = 'failed', completed_at = now(),
                   error = 'the sign-in was interrupted while its code was exchanged; the run asks again'
             WHERE id = a.id RETURNING * INTO a;
        ELSE
            CONTINUE; -- changed meanwhile
        END IF;
        v_ended := v_ended + 1;
        PERFORM agentloop_journal(a.thread_id, 'authorization', agentloop_authorization_json(a));
        IF r.status = 'waiting_authorization'
           AND NOT EXISTS (SELECT 1 FROM mcp_authorizations WHERE run_id = r.id AND status IN ('pending', 'exchanging')) THEN
            UPDATE runs SET status = 'queued', queued_at = now(), updated_at = now() WHERE id = r.id RETURNING * INTO r;
            PERFORM agentloop_journal(r.thread_id, 'run', agentloop_run_json(r));
            PERFORM agentloop_wake('queued:' || r.id);
        END IF;
        v_threads := v_threads || a.thread_id;
    END LOOP;
    IF cardinality(v_threads) > 0 THEN
        PERFORM agentloop_notify(v_threads);
    END IF;
    SELECT min(t) INTO v_next FROM (
        SELECT min(expires_at) AS t FROM mcp_authorizations WHERE status = 'pending'
        UNION ALL
        SELECT min(coalesce(taken_at, created_at)) + v_stuck FROM mcp_authorizations WHERE status = 'exchanging') s;
    RETURN jsonb_build_object('ended', v_ended,
        'nextDeadlineMs', CASE WHEN v_next IS NOT NULL
                               THEN greatest(0, (extract(epoch FROM v_next - now()) * 1000)::bigint) END);
END $$;

