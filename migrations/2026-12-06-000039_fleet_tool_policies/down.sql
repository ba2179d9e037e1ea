DROP FUNCTION agentloop_publish_tool_policy(jsonb);
DROP TABLE worker_tool_policies;
