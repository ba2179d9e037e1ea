-- Back to 000014's bodies, then the column and the sweep go.
DROP FUNCTION IF EXISTS agentloop_mcp_sweep(jsonb);
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
    UPDATE mcp_authorizations SET status = 'exchanging' WHERE id = a.id RETURNING * INTO a;
    RETURN agentloop_authorization_json(a) || jsonb_build_object(
        'principalId', a.principal_id, 'codeVerifier', a.code_verifier, 'tokenEndpoint', a.token_endpoint,
        'clientId', a.client_id, 'redirectUri', a.redirect_uri, 'resource', a.resource);
END $$;

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
                     THEN now() + make_interval(secs => (t ->> 'expiresInMs')::double precision / 1000) END,
                a.id)
        ON CONFLICT (principal_id, server) DO UPDATE
            SET access_token = EXCLUDED.access_token, fingerprint = EXCLUDED.fingerprint, token_type = EXCLUDED.token_type,
                scope = EXCLUDED.scope, expires_at = EXCLUDED.expires_at, authorization_id = EXCLUDED.authorization_id,
                created_at = now();
        UPDATE mcp_authorizations SET status = 'completed', completed_at = now() WHERE id = a.id RETURNING * INTO a;
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
        END IF;
    END IF;
    RETURN agentloop_commit(p - 'authorization');
END $$;

ALTER TABLE mcp_authorizations DROP COLUMN IF EXISTS taken_at;
