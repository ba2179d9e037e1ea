-- Workers apply the strictest tool policy of the live fleet (acceptance probe E). A call's
-- approval policy and idempotency come from the executing worker's TOOLS_FILE; a worker started
-- with a laxer file (a rolling change, a mistake) ran a payment without the approval every other
-- worker asked for, and the fleet only alerted (AgentloopWorkersDisagree). Now each worker
-- publishes its policies here every few seconds and applies, per tool, the strictest policy of
-- the workers seen within the row's time to live (and "not idempotent" when any says so):
-- `agentloop_shared::tools::FleetPolicy`.

CREATE TABLE worker_tool_policies (
    -- WORKER_ID plus a per-process suffix: two processes never share a row.
    worker_key text PRIMARY KEY,
    policy jsonb NOT NULL,
    seen_at timestamptz NOT NULL DEFAULT now(),
    -- The row's own time to live (4 x its worker's FLEET_POLICY_REFRESH_MS): workers with
    -- different periods never forget a live one (verification probe I: a strict worker with a
    -- 30 s period was dropped by a lax one's 20 s time to live, 10 s of every 30).
    ttl_ms bigint NOT NULL DEFAULT 30000
);

-- p = {workerKey, policy, ttlMs}: publishes the caller's policy (seen now, live for ttlMs),
-- removes rows not seen within their own time to live (workers gone without a goodbye), and
-- returns the other live workers' policies: {others: [policy, ...]}. p.leaving = true removes the
-- caller's row instead.
CREATE FUNCTION agentloop_publish_tool_policy(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_key text := p ->> 'workerKey';
    v_ttl interval := make_interval(secs => coalesce((p ->> 'ttlMs')::bigint, 30000) / 1000.0);
BEGIN
    IF coalesce((p ->> 'leaving')::boolean, false) THEN
        DELETE FROM worker_tool_policies WHERE worker_key = v_key;
        RETURN '{"others": []}'::jsonb;
    END IF;
    INSERT INTO worker_tool_policies (worker_key, policy, seen_at, ttl_ms)
    VALUES (v_key, p -> 'policy', now(), (extract(epoch FROM v_ttl) * 1000)::bigint)
    ON CONFLICT (worker_key) DO UPDATE SET policy = excluded.policy, seen_at = excluded.seen_at, ttl_ms = excluded.ttl_ms;
    DELETE FROM worker_tool_policies WHERE seen_at < now() - make_interval(secs => ttl_ms / 1000.0);
    RETURN jsonb_build_object('others', coalesce((SELECT jsonb_agg(policy ORDER BY worker_key) FROM worker_tool_policies
                                                   WHERE worker_key <> v_key), '[]'::jsonb));
END $$;
