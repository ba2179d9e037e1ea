DROP FUNCTION IF EXISTS agentloop_commit_group(jsonb);
DROP FUNCTION IF EXISTS agentloop_slice_start_group(jsonb);
-- agentloop_send as in 000018.
CREATE OR REPLACE FUNCTION agentloop_send(p_channel text, p_payload text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('agentloop.defer_notify', true) = 'on' THEN
        PERFORM set_config('agentloop.deferred',
            (coalesce(nullif(current_setting('agentloop.deferred', true), '')::jsonb, '[]'::jsonb)
             || jsonb_build_array(jsonb_build_array(p_channel, p_payload)))::text,
            false);
    ELSE
        PERFORM pg_notify(p_channel, p_payload);
    END IF;
END $$;
-- agentloop_mcp_sweep as in 000017.
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
    FOR c IN
        SELECT x.id, x.thread_id, x.run_id FROM mcp_authorizations x
         WHERE (x.status = 'pending'
                AND (x.expires_at <= now()
                     OR EXISTS (SELECT 1 FROM mcp_tokens k
                                 WHERE k.principal_id = x.principal_id AND k.server = x.server
                                   AND k.created_at > x.created_at AND (k.expires_at IS NULL OR k.expires_at > now()))))
            OR (x.status = 'exchanging' AND coalesce(x.taken_at, x.created_at) < now() - v_stuck)
         ORDER BY x.created_at
         LIMIT v_limit
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

