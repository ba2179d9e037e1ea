-- Hostile clients (issue 10): key lifecycle, browser sessions, per-principal limits counted in
-- PostgreSQL. Additive only; no step function of 000005 is replaced.

-- Key lifecycle: an optional name and expiry; `last_used_at` is refreshed at most once a minute
-- per key (auth.rs), so authentication is not a write per request.
ALTER TABLE api_keys
    ADD COLUMN name text,
    ADD COLUMN expires_at timestamptz,
    ADD COLUMN last_used_at timestamptz;
CREATE INDEX api_keys_principal ON api_keys (principal_id);

-- Browser sign-in sessions (CONTRACTS.md): an opaque random token in an HttpOnly cookie, stored
-- only as its SHA-256, bound to the API key it was made from — revoking, expiring or deleting
-- that key ends the session.
CREATE TABLE sessions (
    id          uuid PRIMARY KEY,
    token_hash  bytea NOT NULL UNIQUE,
    key_id      uuid NOT NULL REFERENCES api_keys (id) ON DELETE CASCADE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
);
CREATE INDEX sessions_key ON sessions (key_id, created_at);
CREATE INDEX sessions_expiry ON sessions (expires_at);

---------------------------------------------------------------------------------------------
-- Per-principal limits counted in PostgreSQL (global across api processes)
---------------------------------------------------------------------------------------------
-- The bounds are session settings of the api's command connections (startup options
-- `-c agentloop.max_active_runs=N`, `agentloop.max_queued_turns`, `agentloop.max_threads`); a
-- connection without them (workers, maintenance, psql) is not limited. A refusal raises
-- SQLSTATE AL429 like a step function's business refusal, so the whole command — receipt
-- included — rolls back and the api answers 429 with the code.
--
-- Counting and inserting are serialised per principal by a transaction-level advisory lock,
-- taken after the thread lock the step function already holds (never before it), so no lock
-- cycle is possible: nobody holding the principal lock waits for a thread.

-- Runs of a principal that are not finished (the index the counts read; `status` is already
-- indexed elsewhere, and lease renewals do not touch these columns, so they stay HOT).
CREATE INDEX runs_principal_open ON runs (principal_id, status)
    WHERE status IN ('pending', 'queued', 'running', 'waiting_approval', 'blocked');

-- The configured bound `agentloop.<p_name>` of this session, or NULL (no limit).
CREATE FUNCTION agentloop_limit(p_name text) RETURNS bigint LANGUAGE sql STABLE AS $$
    SELECT nullif(current_setting('agentloop.' || p_name, true), '')::bigint
$$;

-- Serialises limit checks of one principal until the end of the transaction.
CREATE FUNCTION agentloop_lock_principal(p_principal uuid) RETURNS void LANGUAGE sql AS $$
    SELECT pg_advisory_xact_lock(hashtext('agentloop.principal'), hashtext(p_principal::text))
$$;

-- BEFORE INSERT ON runs: `max_active_runs` bounds runs in queued|running|waiting_approval|
-- blocked, `max_queued_turns` bounds pending runs (turns waiting behind a thread's active run).
CREATE FUNCTION agentloop_runs_limit() RETURNS trigger LANGUAGE plpgsql AS $$
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
    ELSIF NEW.status IN ('queued', 'running', 'waiting_approval', 'blocked') THEN
        v_bound := agentloop_limit('max_active_runs');
        IF v_bound IS NOT NULL THEN
            PERFORM agentloop_lock_principal(NEW.principal_id);
            SELECT count(*) INTO v_count FROM runs
             WHERE principal_id = NEW.principal_id AND status IN ('queued', 'running', 'waiting_approval', 'blocked');
            IF v_count >= v_bound THEN
                PERFORM agentloop_refuse(429, 'too_many_active_runs',
                    format('at most %s runs may be active per principal; wait for one to end or cancel one', v_bound));
            END IF;
        END IF;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER runs_principal_limits BEFORE INSERT ON runs
    FOR EACH ROW EXECUTE FUNCTION agentloop_runs_limit();

-- BEFORE INSERT ON threads: `max_threads` bounds a principal's threads that are not deleted.
CREATE FUNCTION agentloop_threads_limit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_bound bigint := agentloop_limit('max_threads');
    v_count bigint;
BEGIN
    IF v_bound IS NOT NULL THEN
        PERFORM agentloop_lock_principal(NEW.owner_id);
        SELECT count(*) INTO v_count FROM threads WHERE owner_id = NEW.owner_id AND deleted_at IS NULL;
        IF v_count >= v_bound THEN
            PERFORM agentloop_refuse(429, 'too_many_threads',
                format('at most %s threads per principal; delete some first', v_bound));
        END IF;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER threads_principal_limits BEFORE INSERT ON threads
    FOR EACH ROW EXECUTE FUNCTION agentloop_threads_limit();
