-- Development databases only (migrations/README.md). Runs outside a transaction, group by group.
DROP INDEX CONCURRENTLY IF EXISTS operations_by_thread;
-- commit
DROP INDEX CONCURRENTLY IF EXISTS runs_by_source_thread;
-- commit
DROP INDEX CONCURRENTLY IF EXISTS threads_by_parent;
-- commit
DROP INDEX CONCURRENTLY IF EXISTS threads_deleted;
-- commit
DROP INDEX CONCURRENTLY IF EXISTS runs_terminal_finished;
-- commit
DROP FUNCTION IF EXISTS agentloop_queue_stats();
DROP FUNCTION IF EXISTS agentloop_worker_demand();
DROP FUNCTION IF EXISTS agentloop_purge_threads(jsonb);
DROP FUNCTION IF EXISTS agentloop_delete_some(regclass, text, uuid, bigint);
DROP FUNCTION IF EXISTS agentloop_prune_steps(jsonb);
DROP FUNCTION IF EXISTS agentloop_prune_journal(jsonb);
DROP FUNCTION IF EXISTS agentloop_prune_receipts(jsonb);
DROP TABLE IF EXISTS agentloop_maintenance;
ALTER TABLE thread_events RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,
                                 autovacuum_vacuum_insert_scale_factor, autovacuum_vacuum_insert_threshold,
                                 autovacuum_analyze_scale_factor, autovacuum_analyze_threshold);
ALTER TABLE threads RESET (fillfactor, autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,
                           autovacuum_analyze_scale_factor, autovacuum_analyze_threshold);
ALTER TABLE runs RESET (fillfactor, autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,
                        autovacuum_analyze_scale_factor, autovacuum_analyze_threshold);
