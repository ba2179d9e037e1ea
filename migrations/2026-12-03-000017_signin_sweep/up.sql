-- Sign-ins that cannot complete on their own no longer hold their run (issue 12 part 5; found
-- by a fresh attack on 000014):
-- - a callback interrupted after it took the state (api killed mid-exchange, a finish that
--   failed) left the authorization `exchanging` and its run `waiting_authorization` for good;
-- - an expired sign-in link (`pending` past `expires_at`) never requeued its run;
-- - a second run of the same principal waiting on the same server stayed parked after the
--   first run's sign-in stored a token.
-- `agentloop_mcp_sweep` ends each such authorization (failed, or completed by the newer token)
-- and requeues its run when nothing else of it is open: the retry of the call uses the token
-- or asks for a new sign-in. Workers run it with the approval-expiry sweep (at start-up, on an
-- `approval:` wake-up — which the callback now sends — and at the earliest known deadline).
ALTER TABLE mcp_authorizations ADD COLUMN IF NOT EXISTS taken_at timestamptz;

CREATE OR REPLACE FUNCTION agentloop_mcp_take_state(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    a mcp_authorizations;
BEGIN
    SELECT * INTO a FROM mcp_authorizations WHERE state_hash = p ->> 'stateHash' FOR UPDATE;
    IF NOT FOUND OR a.principal_id <> (p ->> 'principalId')::uuid THEN
        PERFORM agentloop_refuse(404, 'authorization_not_found', 'no pending sign-in of yours has this state');
    END IF;
    IF a.status <> 'pending' THEN
        PERFORM agentloop_refuse(409, 'authorization_used', format('this sign-in is already %s; a state is used once', a.status));
    END IF;
    IF a.expires_at <= now() THEN
        PERFORM agentloop_refuse(410, 'authorization_expired', 'this sign-in link expired; the run asks again when it retries');
    END IF;
    UPDATE mcp_authorizations SET status = 'exchanging', taken_at = now() WHERE id = a.id RETURNING * INTO a;
    RETURN agentloop_authorization_json(a) || jsonb_build_object(
        'principalId', a.principal_id, 'codeVerifier', a.code_verifier, 'tokenEndpoint', a.token_endpoint,
        'clientId', a.client_id, 'redirectUri', a.redirect_uri, 'resource', a.resource);
END $$;

-- p = {stuckMs?: an `exchanging` authorization older than this is given up (default 60000; the
-- exchange itself is bounded by 10 s), limit?: rows per call (100)}. Returns {ended,
-- nextDeadlineMs} (ms until the next pending link expires or exchange turns stuck; null: none).
-- Locks thread, run, then authorization, like agentloop_mcp_finish.
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

-- Parking wakes the workers' sweep so it knows when the new link expires.
CREATE OR REPLACE FUNCTION agentloop_mcp_park(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_run uuid := (p ->> 'runId')::uuid;
    v_thread uuid := (p ->> 'threadId')::uuid;
    x jsonb := p -> 'authorization';
    r runs;
    a mcp_authorizations;
BEGIN
    PERFORM 1 FROM threads WHERE id = v_thread FOR NO KEY UPDATE;
    SELECT * INTO r FROM runs WHERE id = v_run FOR NO KEY UPDATE;
    IF r.status = 'running' AND r.lease_owner = p ->> 'owner' AND r.lease_epoch = (p ->> 'epoch')::bigint
       AND r.last_commit ->> 'id' IS DISTINCT FROM p ->> 'commitId' THEN
        UPDATE operations SET status = 'prepared', dispatches = greatest(dispatches - 1, 0), dispatched_at = NULL,
                              updated_at = now()
         WHERE key = x ->> 'operationKey' AND run_id = v_run AND status = 'dispatched';
        IF x ->> 'discardFingerprint' IS NOT NULL THEN
            DELETE FROM mcp_tokens WHERE principal_id = r.principal_id AND server = x ->> 'server'
                                     AND fingerprint = x ->> 'discardFingerprint';
        END IF;
        INSERT INTO mcp_authorizations (id, principal_id, thread_id, run_id, tool_call_id, operation_key, server, status,
                                        state_hash, authorization_url, code_verifier, token_endpoint, client_id,
                                        redirect_uri, resource, expires_at)
        VALUES ((x ->> 'id')::uuid, r.principal_id, v_thread, v_run, x ->> 'toolCallId', x ->> 'operationKey',
                x ->> 'server', 'pending', x ->> 'stateHash', x ->> 'authorizationUrl', x ->> 'codeVerifier',
                x ->> 'tokenEndpoint', x ->> 'clientId', x ->> 'redirectUri', x ->> 'resource',
                now() + make_interval(secs => (x ->> 'expiresInMs')::double precision / 1000))
        ON CONFLICT (id) DO NOTHING
        RETURNING * INTO a;
        IF a.id IS NOT NULL THEN
            PERFORM agentloop_journal(v_thread, 'authorization', agentloop_authorization_json(a));
            -- The workers' sweep learns the new link's deadline (`approval:` wake-up).
            PERFORM agentloop_wake('approval:signin');
        END IF;
    END IF;
    RETURN agentloop_commit(p - 'authorization');
END $$;

-- The callback's end also wakes the workers' sweep (`approval:` wake-up), so runs of the same
-- principal waiting on the same server resume with the new token at once.
CREATE OR REPLACE FUNCTION agentloop_mcp_finish(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    a mcp_authorizations;
    r runs;
    t jsonb := p -> 'token';
BEGIN
    SELECT * INTO a FROM mcp_authorizations WHERE id = (p ->> 'authorizationId')::uuid;
    IF NOT FOUND OR a.principal_id <> (p ->> 'principalId')::uuid THEN
        PERFORM agentloop_refuse(404, 'authorization_not_found', 'no such sign-in');
    END IF;
    PERFORM 1 FROM threads WHERE id = a.thread_id FOR NO KEY UPDATE;
    SELECT * INTO r FROM runs WHERE id = a.run_id FOR NO KEY UPDATE;
    SELECT * INTO a FROM mcp_authorizations WHERE id = a.id FOR UPDATE;
    IF a.status <> 'exchanging' THEN
        PERFORM agentloop_refuse(409, 'authorization_used', format('this sign-in is already %s', a.status));
    END IF;
    IF t IS NOT NULL THEN
        INSERT INTO mcp_tokens (principal_id, server, access_token, fingerprint, token_type, scope, expires_at, authorization_id)
        VALUES (a.principal_id, a.server, t ->> 'accessToken', t ->> 'fingerprint', t ->> 'tokenType', t ->> 'scope',
                CASE WHEN t ->> 'expiresInMs' IS NOT NULL
                     THEN now() + make_interval(secs => least((t ->> 'expiresInMs')::double precision / 1000, 315360000)) END,
                a.id)
        ON CONFLICT (principal_id, server) DO UPDATE
            SET access_token = EXCLUDED.access_token, fingerprint = EXCLUDED.fingerprint, token_type = EXCLUDED.token_type,
                scope = EXCLUDED.scope, expires_at = EXCLUDED.expires_at, authorization_id = EXCLUDED.authorization_id,
                created_at = now();
        UPDATE mcp_authorizations SET status = 'completed', completed_at = now() WHERE id = a.id RETURNING * INTO a;
        PERFORM agentloop_wake('approval:signin');
    ELSE
        UPDATE mcp_authorizations SET status = 'failed', error = left(coalesce(p ->> 'error', 'the sign-in failed'), 500),
                                      completed_at = now()
         WHERE id = a.id RETURNING * INTO a;
    END IF;
    PERFORM agentloop_journal(a.thread_id, 'authorization', agentloop_authorization_json(a));
    IF r.status = 'waiting_authorization'
       AND NOT EXISTS (SELECT 1 FROM mcp_authorizations WHERE run_id = r.id AND status IN ('pending', 'exchanging')) THEN
        UPDATE runs SET status = 'queued', queued_at = now(), updated_at = now() WHERE id = r.id RETURNING * INTO r;
        PERFORM agentloop_journal(r.thread_id, 'run', agentloop_run_json(r));
        PERFORM agentloop_wake('queued:' || r.id);
    END IF;
    PERFORM agentloop_notify(ARRAY[a.thread_id]);
    RETURN jsonb_build_object('authorization', agentloop_authorization_json(a), 'run', agentloop_run_json(r));
END $$;
