DROP FUNCTION IF EXISTS agentloop_slim_event(jsonb, int);
