-- MCP sign-in blockers (issue 12 part 5; docs/architecture.md §15). An MCP tool server of a
-- `"auth": {"type": "oauth"}` entry answers a call without a (valid) token of the run's
-- principal with HTTP 401: the worker discovers its authorization server, and the run parks in
-- the new status `waiting_authorization` (lease released, like `waiting_approval`) with an
-- `mcp_authorizations` row bound to the run's principal, the server and a sign-in URL. The OAuth
-- callback of the api completes it (token stored encrypted in `mcp_tokens`, for that principal
-- and that server only) and requeues the SAME run; its retry of the same call (same operation
-- key) uses the token and claims the completed authorization exactly once.
--
-- Groups (split at `-- commit`, each its own implicit transaction, each idempotent):
-- 1. the new tables and step functions, and every step function whose list of active statuses
--    gains `waiting_authorization` (agentloop_cancel, agentloop_cancel_all, agentloop_lock_active,
--    agentloop_openai_release, agentloop_runs_limit, agentloop_end_run);
-- 2-3. the status checks of run_steps and runs (NOT VALID: a brief lock, no scan), validated in 4;
-- 5-9. the active-run indexes rebuilt CONCURRENTLY with the new status.

CREATE TABLE IF NOT EXISTS mcp_authorizations (
    id                uuid PRIMARY KEY,
    principal_id      uuid NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
    thread_id         uuid NOT NULL,
    run_id            uuid NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    -- The call that needs it (agentloop's id, unique per run) and its operation key.
    tool_call_id      text NOT NULL,
    operation_key     text NOT NULL,
    -- The MCP server's configured name.
    server            text NOT NULL,
    -- pending -> exchanging (the callback took the state: single use) -> completed | failed;
    -- completed -> claimed (the run's retry of the call took it, once); pending -> cancelled.
    status            text NOT NULL CHECK (status IN ('pending', 'exchanging', 'completed', 'claimed', 'failed', 'cancelled')),
    -- SHA-256 (hex) of the `state` parameter; the state itself is only in the sign-in URL.
    state_hash        text NOT NULL UNIQUE,
    -- The authorization server's authorize URL with client_id, redirect_uri, PKCE challenge,
    -- state, resource and scope.
    authorization_url text NOT NULL,
    -- The PKCE code verifier, sealed (AES-256-GCM under OAUTH_TOKENS_KEY, the id as AAD).
    code_verifier     text NOT NULL,
    token_endpoint    text NOT NULL,
    client_id         text NOT NULL,
    redirect_uri      text NOT NULL,
    resource          text,
    error             text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    expires_at        timestamptz NOT NULL,
    completed_at      timestamptz,
    claimed_at        timestamptz
);
CREATE INDEX IF NOT EXISTS mcp_authorizations_by_run ON mcp_authorizations (run_id, created_at);
CREATE INDEX IF NOT EXISTS mcp_authorizations_by_principal ON mcp_authorizations (principal_id);

-- One token per (principal, MCP server): the access token sealed with the principal and the
-- server as additional data (a row moved to another principal cannot be opened).
CREATE TABLE IF NOT EXISTS mcp_tokens (
    principal_id     uuid NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
    server           text NOT NULL,
    access_token     text NOT NULL,
    -- SHA-256 (hex) of the access token: a 401 discards the token only if it is still this one.
    fingerprint      text NOT NULL,
    token_type       text,
    scope            text,
    expires_at       timestamptz,
    authorization_id uuid,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (principal_id, server)
);

-- The public view of an authorization (journal `authorization` events, GET /api/runs/{id}): no
-- state, no verifier; the sign-in URL only while it can still be used.
CREATE OR REPLACE FUNCTION agentloop_authorization_json(a mcp_authorizations) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'id', a.id, 'runId', a.run_id, 'threadId', a.thread_id, 'server', a.server,
        'toolCallId', a.tool_call_id, 'status', a.status,
        'url', CASE WHEN a.status = 'pending' AND a.expires_at > now() THEN a.authorization_url END,
        'error', a.error, 'createdAt', a.created_at, 'expiresAt', a.expires_at,
        'completedAt', a.completed_at, 'claimedAt', a.claimed_at)
$$;

-- Cancels the pending authorizations of a run that ends (thread and run locked by the caller).
CREATE OR REPLACE FUNCTION agentloop_mcp_cancel_authorizations(p_run uuid) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    a mcp_authorizations;
BEGIN
    FOR a IN UPDATE mcp_authorizations SET status = 'cancelled'
              WHERE run_id = p_run AND status = 'pending' RETURNING * LOOP
        PERFORM agentloop_journal(a.thread_id, 'authorization', agentloop_authorization_json(a));
    END LOOP;
END $$;

-- The worker's checkpoint that parks a run in `waiting_authorization`: p = an agentloop_commit
-- value (fence, commitId, messages, `end: {status: waiting_authorization}`) plus
-- `authorization: {id, toolCallId, operationKey, server, stateHash, authorizationUrl,
-- codeVerifier, tokenEndpoint, clientId, redirectUri, resource, expiresInMs,
-- discardFingerprint?}`. In one transaction, under the fence (thread, then run, then
-- operations): the call's `dispatched` operation goes back to `prepared` (a 401 is a refusal:
-- the call had no effect, and the retry dispatches it again under the same key), a token the
-- server refused (`discardFingerprint`) is discarded, the authorization row is written and
-- journaled, and agentloop_commit ends the slice (which releases the lease; a cancellation
-- requested meanwhile wins and the authorization is cancelled with the run). Replay-safe: the
-- commit id replays, the row is keyed by its id. Returns agentloop_commit's result.
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

-- The token of the run's principal for MCP server `server`, for the worker about to call one of
-- its tools: p = {runId, server, toolCallId}. An expired token is deleted (the call then goes
-- without one and the server's 401 asks for a new sign-in). The run's completed authorization
-- for this call is claimed here — exactly once: a second call finds it `claimed`. Returns
-- {principalId, token?: {accessToken (sealed), fingerprint, expiresAt}, claimed?: id}.
CREATE OR REPLACE FUNCTION agentloop_mcp_token(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_run uuid := (p ->> 'runId')::uuid;
    v_server text := p ->> 'server';
    v_principal uuid;
    k mcp_tokens;
    v_claimed uuid;
BEGIN
    SELECT principal_id INTO v_principal FROM runs WHERE id = v_run;
    IF v_principal IS NULL THEN
        RETURN '{}'::jsonb;
    END IF;
    DELETE FROM mcp_tokens WHERE principal_id = v_principal AND server = v_server AND expires_at <= now();
    SELECT * INTO k FROM mcp_tokens WHERE principal_id = v_principal AND server = v_server;
    UPDATE mcp_authorizations SET status = 'claimed', claimed_at = now()
     WHERE run_id = v_run AND tool_call_id = p ->> 'toolCallId' AND server = v_server AND status = 'completed'
    RETURNING id INTO v_claimed;
    RETURN jsonb_strip_nulls(jsonb_build_object(
        'principalId', v_principal,
        'token', CASE WHEN k.principal_id IS NOT NULL THEN jsonb_build_object(
            'accessToken', k.access_token, 'fingerprint', k.fingerprint, 'expiresAt', k.expires_at) END,
        'claimed', v_claimed));
END $$;

-- The OAuth callback takes the authorization its `state` names (p = {stateHash, principalId}),
-- once: pending -> exchanging, before the code is exchanged. Refusals: 404
-- `authorization_not_found` (no such state, or another principal's — which it does not
-- consume), 409 `authorization_used` (already taken: a replayed state), 410
-- `authorization_expired`. Returns the row with what the exchange needs (sealed verifier).
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

-- The end of a callback: p = {authorizationId, principalId, token?: {accessToken (sealed),
-- fingerprint, tokenType, scope, expiresInMs}, error?}. With a token: the token of (principal,
-- server) is stored (replacing an older one) and the authorization `completed`; without:
-- `failed` with the error. Either way the run, if it still waits and has no other open
-- authorization, goes back to `queued` (the SAME run: its retry of the call uses the token, or
-- asks for a new sign-in). Locks the thread, then the run, then the authorization.
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

-- Active-status lists: waiting_authorization is active (one per thread, counted by the limits).
CREATE OR REPLACE FUNCTION agentloop_cancel_all(p_thread uuid)
 RETURNS jsonb
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_id uuid;
    v_out jsonb := '[]'::jsonb;
BEGIN
    PERFORM agentloop_lock_active(p_thread);
    FOR v_id IN SELECT id FROM runs
                 WHERE thread_id = p_thread
                   AND status IN ('pending', 'queued', 'running', 'waiting_approval', 'waiting_authorization', 'blocked')
                 ORDER BY (status = 'pending') DESC, seq DESC LOOP
        v_out := v_out || agentloop_run_json(agentloop_cancel(v_id));
    END LOOP;
    RETURN v_out;
END $function$;

CREATE OR REPLACE FUNCTION agentloop_openai_release(p_thread uuid)
 RETURNS boolean
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM agentloop_cancel_all(p_thread);
    IF EXISTS (SELECT 1 FROM runs WHERE thread_id = p_thread
                AND status IN ('pending', 'queued', 'running', 'waiting_approval', 'waiting_authorization', 'blocked')) THEN
        UPDATE openai_requests SET expires_at = least(expires_at, now()) WHERE thread_id = p_thread;
        RETURN false;
    END IF;
    DELETE FROM threads WHERE id = p_thread;
    RETURN true;
END $function$;

CREATE OR REPLACE FUNCTION agentloop_runs_limit()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_bound bigint;
    v_count bigint;
BEGIN
    IF NEW.status = 'pending' THEN
        v_bound := agentloop_limit('max_queued_turns');
        IF v_bound IS NOT NULL THEN
            PERFORM agentloop_lock_principal(NEW.principal_id);
            SELECT count(*) INTO v_count FROM runs WHERE principal_id = NEW.principal_id AND status = 'pending';
            IF v_count >= v_bound THEN
                PERFORM agentloop_refuse(429, 'too_many_queued_turns',
                    format('at most %s turns may wait behind active runs per principal; wait for some to run', v_bound));
            END IF;
        END IF;
    ELSIF NEW.status IN ('queued', 'running', 'waiting_approval', 'waiting_authorization', 'blocked') THEN
        v_bound := agentloop_limit('max_active_runs');
        IF v_bound IS NOT NULL THEN
            PERFORM agentloop_lock_principal(NEW.principal_id);
            SELECT count(*) INTO v_count FROM runs
             WHERE principal_id = NEW.principal_id AND status IN ('queued', 'running', 'waiting_approval', 'waiting_authorization', 'blocked');
            IF v_count >= v_bound THEN
                PERFORM agentloop_refuse(429, 'too_many_active_runs',
                    format('at most %s runs may be active per principal; wait for one to end or cancel one', v_bound));
            END IF;
        END IF;
    END IF;
    RETURN NEW;
END $function$;

CREATE OR REPLACE FUNCTION agentloop_lock_active(p_thread uuid)
 RETURNS runs
 LANGUAGE plpgsql
AS $function$
DECLARE
    a runs;
BEGIN
    SELECT * INTO a FROM runs
     WHERE thread_id = p_thread AND status IN ('queued', 'running', 'waiting_approval', 'waiting_authorization', 'blocked') FOR UPDATE;
    RETURN a;
END $function$;

-- A waiting_authorization run is cancelled at once, like a waiting_approval one.
CREATE OR REPLACE FUNCTION agentloop_cancel(p_run uuid) RETURNS runs LANGUAGE plpgsql AS $$
DECLARE
    r runs;
    a tool_approvals;
    v_active boolean;
BEGIN
    SELECT * INTO r FROM runs WHERE id = p_run FOR UPDATE;
    IF r.status IN ('pending', 'queued', 'waiting_approval', 'waiting_authorization', 'blocked') THEN
        v_active := r.status <> 'pending';
        UPDATE runs SET status = 'cancelled', cancel_requested_at = coalesce(cancel_requested_at, now()),
                        finished_at = clock_timestamp(), lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
         WHERE id = p_run RETURNING * INTO r;
        FOR a IN UPDATE tool_approvals SET status = 'cancelled', decided_at = now()
                  WHERE run_id = p_run AND status = 'pending' RETURNING * LOOP
            PERFORM agentloop_journal(r.thread_id, 'approval', agentloop_approval_json(a));
        END LOOP;
        PERFORM agentloop_mcp_cancel_authorizations(p_run);
        PERFORM agentloop_close_dangling(r.thread_id, p_run);
        PERFORM agentloop_journal(r.thread_id, 'run', agentloop_run_json(r));
        IF v_active THEN
            PERFORM agentloop_promote(r.thread_id);
        END IF;
    ELSIF r.status = 'running' AND r.cancel_requested_at IS NULL THEN
        UPDATE runs SET cancel_requested_at = now(), updated_at = now() WHERE id = p_run RETURNING * INTO r;
        PERFORM agentloop_journal(r.thread_id, 'run', agentloop_run_json(r));
        PERFORM agentloop_wake('cancel:' || p_run);
    END IF;
    RETURN r;
END $$;
-- The slice end waiting_authorization (a cancellation requested meanwhile wins); a run that ends cancels its pending authorizations.
CREATE OR REPLACE FUNCTION agentloop_end_run(p_run uuid, p_step bigint, p_end jsonb, p_usage jsonb DEFAULT '{}',
                                  p_last_commit jsonb DEFAULT NULL) RETURNS runs LANGUAGE plpgsql AS $$
DECLARE
    r runs;
    v_end text := p_end ->> 'status';
    v_status text;
    v_step_status text;
    v_code text := p_end ->> 'code';
    v_message text := p_end ->> 'message';
    v_steps int := CASE WHEN p_step IS NULL THEN 0 ELSE 1 END;
    v_faults int := 0;
    a tool_approvals;
    v_partial jsonb;
BEGIN
    SELECT * INTO r FROM runs WHERE id = p_run;
    IF v_end IN ('waiting_approval', 'waiting_authorization') AND r.cancel_requested_at IS NOT NULL THEN
        v_end := 'cancelled';
    END IF;
    IF v_end IN ('cancelled', 'interrupted', 'handback', 'failed', 'blocked') THEN
        UPDATE operations SET status = 'uncertain', updated_at = now() WHERE run_id = p_run AND status = 'dispatched';
        IF r.cancel_requested_at IS NOT NULL AND EXISTS (SELECT 1 FROM operations WHERE run_id = p_run AND status = 'uncertain') THEN
            -- The user asked for the end (cancel, interrupt, thread deleted): it ends
            -- `cancelled`; an uncertain operation stays `uncertain` (resolvable for the record)
            -- and its call's result says the outcome is unknown (agentloop_close_dangling).
            v_end := 'cancelled';
            v_code := NULL;
            v_message := NULL;
        ELSIF EXISTS (SELECT 1 FROM operations WHERE run_id = p_run AND status = 'uncertain') THEN
            v_end := 'blocked';
            v_code := 'operation_uncertain';
            v_message := agentloop_blocker_message(p_run);
        END IF;
    END IF;
    CASE v_end
        WHEN 'completed' THEN v_status := 'completed'; v_step_status := 'completed';
        WHEN 'requeued' THEN v_status := 'queued'; v_step_status := 'requeued';
        WHEN 'interrupted' THEN v_status := 'queued'; v_step_status := 'interrupted'; v_steps := 0;
        WHEN 'handback' THEN v_status := 'queued'; v_step_status := 'interrupted'; v_steps := 0; v_faults := 1;
        WHEN 'failed' THEN v_status := 'failed'; v_step_status := 'failed';
        WHEN 'cancelled' THEN v_status := 'cancelled'; v_step_status := 'cancelled';
        WHEN 'waiting_approval' THEN v_status := 'waiting_approval'; v_step_status := 'waiting_approval';
        WHEN 'waiting_authorization' THEN v_status := 'waiting_authorization'; v_step_status := 'waiting_authorization';
        WHEN 'blocked' THEN v_status := 'blocked'; v_step_status := 'blocked';
            v_code := coalesce(v_code, 'operation_uncertain');
            v_message := coalesce(v_message, agentloop_blocker_message(p_run));
        ELSE RAISE EXCEPTION 'unknown slice end %', v_end;
    END CASE;
    IF v_status NOT IN ('failed', 'blocked') THEN
        v_code := NULL;
        v_message := NULL;
    END IF;
    IF p_step IS NOT NULL THEN
        UPDATE run_steps SET status = v_step_status, finished_at = clock_timestamp(), error_code = v_code, error_message = v_message,
                             model_calls = model_calls + coalesce((p_usage ->> 'modelCalls')::int, 0),
                             tool_calls = tool_calls + coalesce((p_usage ->> 'toolCalls')::int, 0),
                             prompt_tokens = prompt_tokens + coalesce((p_usage ->> 'promptTokens')::bigint, 0),
                             completion_tokens = completion_tokens + coalesce((p_usage ->> 'completionTokens')::bigint, 0)
         WHERE id = p_step;
    END IF;
    UPDATE runs SET status = v_status,
                    steps_used = steps_used + v_steps,
                    faults = CASE WHEN (p_usage ->> 'progress')::boolean THEN 0 ELSE faults END + v_faults,
                    tool_calls_used = tool_calls_used + coalesce((p_usage ->> 'toolCalls')::int, 0),
                    prompt_tokens = prompt_tokens + coalesce((p_usage ->> 'promptTokens')::bigint, 0),
                    completion_tokens = completion_tokens + coalesce((p_usage ->> 'completionTokens')::bigint, 0),
                    last_commit = CASE WHEN p_last_commit IS NULL THEN last_commit
                                       ELSE jsonb_set(p_last_commit, '{result,status}', to_jsonb(v_status)) END,
                    lease_owner = NULL, lease_expires_at = NULL,
                    error_code = v_code, error_message = v_message,
                    finished_at = CASE WHEN v_status IN ('completed', 'failed', 'cancelled') THEN clock_timestamp() END,
                    queued_at = CASE WHEN v_status = 'queued' THEN now() ELSE queued_at END,
                    updated_at = now()
     WHERE id = p_run RETURNING * INTO r;
    IF v_status = 'cancelled' AND coalesce((p_end ->> 'keepStreamed')::boolean, false) THEN
        -- SPEC §4: a cancelled stream's partial answer is kept, marked stopped, even when the
        -- worker that streamed it is gone.
        v_partial := agentloop_partial(r.thread_id, p_run);
        IF v_partial ->> 'content' <> '' OR v_partial ->> 'reasoning' <> '' THEN
            PERFORM agentloop_append(r.thread_id, p_run, p_step, jsonb_build_array(jsonb_build_object(
                'role', 'assistant', 'content', to_jsonb(v_partial ->> 'content'),
                'reasoning', nullif(v_partial ->> 'reasoning', ''), 'stopped', true,
                'tokenEstimate', 1 + length(v_partial ->> 'content') / 4,
                'byteSize', octet_length(v_partial ->> 'content') + octet_length(v_partial ->> 'reasoning') + 2)));
        END IF;
    END IF;
    UPDATE threads SET streaming_message = NULL WHERE id = r.thread_id AND streaming_message IS NOT NULL;
    IF v_status IN ('completed', 'failed', 'cancelled') THEN
        PERFORM agentloop_close_dangling(r.thread_id, p_run);
        IF v_status <> 'completed' THEN
            FOR a IN UPDATE tool_approvals SET status = 'cancelled', decided_at = now()
                      WHERE run_id = p_run AND status = 'pending' RETURNING * LOOP
                PERFORM agentloop_journal(r.thread_id, 'approval', agentloop_approval_json(a));
            END LOOP;
        END IF;
        PERFORM agentloop_mcp_cancel_authorizations(p_run);
    END IF;
    PERFORM agentloop_journal(r.thread_id, 'run', agentloop_run_json(r));
    IF v_status IN ('completed', 'failed', 'cancelled') THEN
        PERFORM agentloop_promote(r.thread_id);
    ELSIF v_status = 'queued' THEN
        PERFORM agentloop_wake('queued:' || p_run);
    ELSIF v_status = 'waiting_approval' THEN
        PERFORM agentloop_wake('approval:' || p_run);
    END IF;
    RETURN r;
END $$;
-- commit
ALTER TABLE run_steps DROP CONSTRAINT IF EXISTS run_steps_status_check;
ALTER TABLE run_steps ADD CONSTRAINT run_steps_status_check
    CHECK (status IN ('running', 'completed', 'requeued', 'failed', 'cancelled', 'interrupted',
                      'waiting_approval', 'waiting_authorization', 'blocked')) NOT VALID;
-- commit
ALTER TABLE runs DROP CONSTRAINT IF EXISTS runs_status_check;
ALTER TABLE runs ADD CONSTRAINT runs_status_check
    CHECK (status IN ('pending', 'queued', 'running', 'waiting_approval', 'waiting_authorization', 'blocked',
                      'completed', 'failed', 'cancelled')) NOT VALID;
-- commit
ALTER TABLE run_steps VALIDATE CONSTRAINT run_steps_status_check;
ALTER TABLE runs VALIDATE CONSTRAINT runs_status_check;
-- commit
-- The active-run indexes with the new status, each built CONCURRENTLY; a build that failed
-- half-way leaves an INVALID index, which `IF NOT EXISTS` would keep: drop it first.
DO $$
DECLARE
    v_name text;
BEGIN
    FOR v_name IN SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                   WHERE NOT i.indisvalid AND c.relname IN ('runs_one_active_per_thread_v2', 'runs_principal_open_v2') LOOP
        EXECUTE format('DROP INDEX %I', v_name);
    END LOOP;
END $$;
-- commit
SET lock_timeout = 0;
-- commit
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS runs_one_active_per_thread_v2 ON runs (thread_id)
    WHERE status IN ('queued', 'running', 'waiting_approval', 'waiting_authorization', 'blocked');
-- commit
DROP INDEX CONCURRENTLY IF EXISTS runs_one_active_per_thread;
-- commit
CREATE INDEX CONCURRENTLY IF NOT EXISTS runs_principal_open_v2 ON runs (principal_id, status)
    WHERE status IN ('pending', 'queued', 'running', 'waiting_approval', 'waiting_authorization', 'blocked');
-- commit
DROP INDEX CONCURRENTLY IF EXISTS runs_principal_open;
