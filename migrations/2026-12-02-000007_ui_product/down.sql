-- Development only (migrations/README.md).
DROP INDEX IF EXISTS threads_search;
DROP INDEX IF EXISTS messages_search;
DROP FUNCTION IF EXISTS agentloop_run_inspect(uuid, bigint, bigint, bigint);
DROP FUNCTION IF EXISTS agentloop_search(jsonb);
DROP FUNCTION IF EXISTS agentloop_branch_marks(uuid, bigint, bigint);
DROP FUNCTION IF EXISTS agentloop_branches_of(uuid, bigint);
DROP FUNCTION IF EXISTS agentloop_search_text(jsonb);
DROP FUNCTION IF EXISTS agentloop_restore_thread(jsonb);
DROP FUNCTION IF EXISTS agentloop_auto_title(jsonb);
DROP FUNCTION IF EXISTS agentloop_activate_branch(jsonb);
DROP FUNCTION IF EXISTS agentloop_regenerate_branching(jsonb);
DROP FUNCTION IF EXISTS agentloop_edit_branching(jsonb);
DROP FUNCTION IF EXISTS agentloop_branch_start(uuid, bigint, boolean);
DROP FUNCTION IF EXISTS agentloop_save_branch(uuid, bigint);
DROP FUNCTION IF EXISTS agentloop_fork_of(uuid, bigint);
DROP TABLE IF EXISTS message_branches;
