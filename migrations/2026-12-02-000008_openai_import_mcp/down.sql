-- Development only (migrations/README.md).
DROP FUNCTION IF EXISTS agentloop_import(jsonb);
DROP FUNCTION IF EXISTS agentloop_openai_sweep(jsonb);
DROP FUNCTION IF EXISTS agentloop_openai_finish(jsonb);
DROP FUNCTION IF EXISTS agentloop_openai_release(uuid);
DROP FUNCTION IF EXISTS agentloop_openai_renew(jsonb);
DROP FUNCTION IF EXISTS agentloop_openai_start(jsonb);
DROP TABLE IF EXISTS openai_requests;
