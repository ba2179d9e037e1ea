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
    seen_at timestamptz NOT NULL DEFAULT now()
);

-- p = {workerKey, policy, ttlMs}: publishes the caller's policy (seen now), removes rows not
-- seen within ttlMs (workers gone without a goodbye), and returns the other live workers'
-- policies: {others: [policy, ...]}. p.leaving = true removes the caller's row instead.
CREATE FUNCTION agentloop_publish_tool_policy(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_key text := p ->> 'workerKey';
    v_ttl interval := make_interval(secs => coalesce((p ->> 'ttlMs')::bigint, 30000) / 1000.0);
BEGIN
    IF coalesce((p ->> 'leaving')::boolean, false) THEN
        DELETE FROM worker_tool_policies WHERE worker_key = v_key;
        RETURN '{"others": []}'::jsonb;
    END IF;
    INSERT INTO worker_tool_policies (worker_key, policy, seen_at) VALUES (v_key, p -> 'policy', now())
    ON CONFLICT (worker_key) DO UPDATE SET policy = excluded.policy, seen_at = excluded.seen_at;
    DELETE FROM worker_tool_policies WHERE seen_at < now() - v_ttl;
    RETURN jsonb_build_object('others', coalesce((SELECT jsonb_agg(policy ORDER BY worker_key) FROM worker_tool_policies
                                                   WHERE worker_key <> v_key), '[]'::jsonb));
END $$;
