UPDATE run_steps SET status = 'interrupted' WHERE status = 'blocked';
ALTER TABLE run_steps DROP CONSTRAINT run_steps_status_check;
ALTER TABLE run_steps ADD CONSTRAINT run_steps_status_check
    CHECK (status IN ('running', 'completed', 'requeued', 'failed', 'cancelled', 'interrupted', 'waiting_approval'));
DROP TABLE IF EXISTS operations;
DROP TABLE IF EXISTS tool_approvals;
