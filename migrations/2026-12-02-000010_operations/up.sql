-- Operations (issue 13): bounded tables at any age, autovacuum settings of the hot tables, queue
-- figures for metrics and autoscaling, and the indexes retention and thread purging need.
--
-- This migration runs OUTSIDE a transaction (metadata.toml): each group below, up to a line
-- `-- commit`, is one implicit transaction, so the index builds can be CONCURRENTLY (they take
-- no lock that blocks writes). Every group is idempotent: a retry after a lock timeout re-runs
-- the groups already committed. The migration session's lock_timeout is 1 s
-- (agentloop_shared::db::MIGRATION_LOCK_TIMEOUT): no statement here makes the traffic wait
-- longer than that on a lock.

-- Autovacuum and HOT room of the hot tables. Storage parameters take SHARE UPDATE EXCLUSIVE,
-- which no row read or write waits for.
--
-- runs: every durable step rewrites its run row (lease, usage, status), so dead versions pile
-- up at the rate of the whole fleet's steps while the live set that matters (queued and running
-- runs) stays small. The default trigger (20% of the table dead) lets a table of millions of
-- terminal runs accumulate hundreds of thousands of dead versions of the few hot rows — the
-- claim's partial index `runs_claimable` then walks dead entries. 1% (at least 1,000 rows)
-- keeps it compact; analyse at the same rate so the queue's shape is known. fillfactor 80
-- leaves room on each page for HOT updates (lease extensions do not touch an indexed column,
-- so they stay on the page and add no index entries).
ALTER TABLE runs SET (fillfactor = 80,
                      autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
                      autovacuum_analyze_scale_factor = 0.01, autovacuum_analyze_threshold = 1000);
-- threads: every journal append and streaming flush updates the thread row (counters, the
-- streaming snapshot) — the same pattern, with fewer rows.
ALTER TABLE threads SET (fillfactor = 80,
                         autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000,
                         autovacuum_analyze_scale_factor = 0.02, autovacuum_analyze_threshold = 1000);
-- thread_events: append-only except pruning, which deletes in bounded batches. Vacuum after 5%
-- of inserts (PostgreSQL 13+) keeps the visibility map current, so the journal read stays an
-- index-only-friendly range scan, and after 5% of deletes so pruned space is reused instead of
-- growing the file.
ALTER TABLE thread_events SET (autovacuum_vacuum_scale_factor = 0.05, autovacuum_vacuum_threshold = 10000,
                               autovacuum_vacuum_insert_scale_factor = 0.05, autovacuum_vacuum_insert_threshold = 10000,
                               autovacuum_analyze_scale_factor = 0.05, autovacuum_analyze_threshold = 10000);

-- Progress of each retention task (worker/src/maintenance.rs): where the current pass resumes
-- after a restart, and when a pass last reached the end (the metrics' "last complete pass").
CREATE TABLE IF NOT EXISTS agentloop_maintenance (
    task                  text PRIMARY KEY,
    cursor                jsonb,
    pass_started_at       timestamptz,
    last_pass_finished_at timestamptz,
    rows_deleted          bigint NOT NULL DEFAULT 0,
    updated_at            timestamptz NOT NULL DEFAULT now()
);

-- Idempotency receipts older than p.keepHours (SPEC §11: at least 24 h), oldest first, at most
-- p.limit rows. Returns {deleted, done}.
CREATE OR REPLACE FUNCTION agentloop_prune_receipts(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_limit int := (p ->> 'limit')::int;
    n bigint;
BEGIN
    WITH v AS (
        SELECT principal_id, command_id FROM command_receipts
         WHERE created_at < now() - make_interval(hours => (p ->> 'keepHours')::int)
         ORDER BY created_at LIMIT v_limit
    )
    DELETE FROM command_receipts c USING v WHERE c.principal_id = v.principal_id AND c.command_id = v.command_id;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN jsonb_build_object('deleted', n, 'done', n < v_limit);
END $$;

-- One batch of journal pruning (SPEC §10: each thread keeps its newest p.keep events; a resume
-- below them gets `reset`): walks threads in id order after p.after (NULL: from the start), at
-- most p.threads of them, deleting at most p.rows events in all — a thread with a larger
-- backlog is resumed by the next batch (the returned cursor stops before it). Deletes are
-- primary-key range deletes; no thread or run row is locked. Returns {deleted, cursor, done}
-- (done: the walk reached the last thread).
CREATE OR REPLACE FUNCTION agentloop_prune_journal(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_keep bigint := greatest((p ->> 'keep')::bigint, 1);
    v_rows bigint := (p ->> 'rows')::bigint;
    v_threads int := (p ->> 'threads')::int;
    v_after uuid := coalesce((p ->> 'after')::uuid, '00000000-0000-0000-0000-000000000000');
    v_cursor uuid := (p ->> 'after')::uuid;
    v_deleted bigint := 0;
    v_seen int := 0;
    v_oldest bigint;
    v_upto bigint;
    v_end bigint;
    n bigint;
    t record;
BEGIN
    FOR t IN SELECT id, last_event_sequence FROM threads WHERE id > v_after ORDER BY id LIMIT v_threads LOOP
        v_seen := v_seen + 1;
        v_upto := t.last_event_sequence - v_keep;
        IF v_upto > 0 THEN
            SELECT sequence INTO v_oldest FROM thread_events WHERE thread_id = t.id ORDER BY sequence LIMIT 1;
            IF v_oldest IS NOT NULL AND v_oldest <= v_upto THEN
                v_end := least(v_upto, v_oldest + (v_rows - v_deleted) - 1);
                DELETE FROM thread_events WHERE thread_id = t.id AND sequence BETWEEN v_oldest AND v_end;
                GET DIAGNOSTICS n = ROW_COUNT;
                v_deleted := v_deleted + n;
                IF v_end < v_upto THEN
                    -- The budget ran out inside this thread: the next batch starts with it again.
                    RETURN jsonb_build_object('deleted', v_deleted, 'cursor', v_cursor, 'done', false);
                END IF;
            END IF;
        END IF;
        v_cursor := t.id;
        IF v_deleted >= v_rows THEN
            RETURN jsonb_build_object('deleted', v_deleted, 'cursor', v_cursor, 'done', false);
        END IF;
    END LOOP;
    RETURN jsonb_build_object('deleted', v_deleted, 'cursor', v_cursor, 'done', v_seen < v_threads);
END $$;

-- One batch of step retention: the run_steps rows of runs that ended (completed, failed,
-- cancelled) more than p.keepHours ago, walking terminal runs in (finished_at, id) order after
-- the cursor p.after ({finishedAt, id}; NULL: from the start) over the partial index
-- runs_terminal_finished, at most p.runs runs or p.rows step rows per batch. The run row, its
-- usage totals and its messages stay; GET /api/runs/{id} then lists no steps. A terminal run
-- never changes again and its finished_at is final, so the cursor never has to look back.
-- Returns {deleted, runs, cursor, done}.
CREATE OR REPLACE FUNCTION agentloop_prune_steps(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_cutoff timestamptz := now() - make_interval(hours => (p ->> 'keepHours')::int);
    v_after_at timestamptz := coalesce((p #>> '{after,finishedAt}')::timestamptz, '-infinity');
    v_after_id uuid := coalesce((p #>> '{after,id}')::uuid, '00000000-0000-0000-0000-000000000000');
    v_rows bigint := (p ->> 'rows')::bigint;
    v_cursor jsonb := p -> 'after';
    v_deleted bigint := 0;
    v_runs int := 0;
    n bigint;
    r record;
BEGIN
    FOR r IN SELECT id, finished_at FROM runs
              WHERE status IN ('completed', 'failed', 'cancelled')
                AND (finished_at, id) > (v_after_at, v_after_id) AND finished_at < v_cutoff
              ORDER BY finished_at, id LIMIT (p ->> 'runs')::int LOOP
        DELETE FROM run_steps WHERE run_id = r.id;
        GET DIAGNOSTICS n = ROW_COUNT;
        v_deleted := v_deleted + n;
        v_runs := v_runs + 1;
        v_cursor := jsonb_build_object('finishedAt', r.finished_at, 'id', r.id);
        EXIT WHEN v_deleted >= v_rows;
    END LOOP;
    RETURN jsonb_build_object('deleted', v_deleted, 'runs', v_runs, 'cursor', v_cursor,
                              'done', v_runs < (p ->> 'runs')::int AND v_deleted < v_rows);
END $$;

-- Deletes up to p_limit rows of `p_table` matching `p_where` (with $1 = p_thread) by ctid, so a
-- large child set is removed over several batches. Returns rows deleted.
CREATE OR REPLACE FUNCTION agentloop_delete_some(p_table regclass, p_where text, p_thread uuid, p_limit bigint)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
BEGIN
    IF p_limit <= 0 THEN
        RETURN 0;
    END IF;
    EXECUTE format('DELETE FROM %s WHERE ctid = ANY(ARRAY(SELECT ctid FROM %s WHERE %s LIMIT %s))',
                   p_table, p_table, p_where, p_limit) USING p_thread;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

-- One batch of purging soft-deleted threads (DELETE /api/threads/{id} sets deleted_at and
-- cancels its runs): the oldest thread deleted more than p.keepHours ago loses at most p.rows
-- rows of its children — journal, messages, snapshots, approvals, operations, steps, runs, in
-- an order no foreign key objects to — and, once it has none left, its own row. The thread row
-- is locked (SKIP LOCKED: a thread another session holds is left for the next batch), the
-- same first lock every step function takes. Returns {deleted, threads, done}.
CREATE OR REPLACE FUNCTION agentloop_purge_threads(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_rows bigint := (p ->> 'rows')::bigint;
    v_deleted bigint := 0;
    v_threads int := 0;
    v_thread uuid;
BEGIN
    LOOP
        SELECT id INTO v_thread FROM threads
         WHERE deleted_at IS NOT NULL AND deleted_at < now() - make_interval(hours => (p ->> 'keepHours')::int)
         ORDER BY deleted_at LIMIT 1 FOR UPDATE SKIP LOCKED;
        IF v_thread IS NULL THEN
            RETURN jsonb_build_object('deleted', v_deleted, 'threads', v_threads, 'done', true);
        END IF;
        v_deleted := v_deleted + agentloop_delete_some('thread_events', 'thread_id = $1', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('messages', 'thread_id = $1', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('context_snapshots', 'thread_id = $1', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('tool_approvals', 'thread_id = $1', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('operations', 'thread_id = $1', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('run_steps',
            'run_id IN (SELECT id FROM runs WHERE thread_id = $1)', v_thread, v_rows - v_deleted);
        v_deleted := v_deleted + agentloop_delete_some('runs', 'thread_id = $1', v_thread, v_rows - v_deleted);
        IF v_deleted >= v_rows THEN
            RETURN jsonb_build_object('deleted', v_deleted, 'threads', v_threads, 'done', false);
        END IF;
        -- Nothing is left under it: the row itself (children of other threads that point at it —
        -- a compaction's source, a child thread — get NULL through their indexed foreign keys).
        DELETE FROM threads WHERE id = v_thread;
        v_deleted := v_deleted + 1;
        v_threads := v_threads + 1;
        IF v_deleted >= v_rows THEN
            RETURN jsonb_build_object('deleted', v_deleted, 'threads', v_threads, 'done', false);
        END IF;
        v_thread := NULL;
    END LOOP;
END $$;

-- Runs waiting for a worker or held by one: `queued` runs plus `running` runs (live or with an
-- expired lease, which any worker may claim). The demand figure of the workers' autoscaler
-- (deploy/k8s/worker-scaledobject.yaml: KEDA's postgresql scaler runs
-- `SELECT agentloop_worker_demand()`), served by the partial index runs_claimable whatever the
-- statistics say.
CREATE OR REPLACE FUNCTION agentloop_worker_demand() RETURNS bigint LANGUAGE sql STABLE
SET enable_seqscan = off AS $$
    SELECT count(*) FROM runs WHERE status IN ('queued', 'running');
$$;

-- Queue figures for the metrics (worker/src/maintenance.rs samples them every 15 s): runs per
-- active status, running runs whose lease expired, the age of the oldest queued run and the
-- fill ratio of PostgreSQL's NOTIFY queue (pg_notification_queue_usage(): 0..1; at 1 every
-- notifying commit fails). Each count reads one partial index (active runs only).
CREATE OR REPLACE FUNCTION agentloop_queue_stats() RETURNS jsonb LANGUAGE sql STABLE
SET enable_seqscan = off AS $$
    SELECT jsonb_build_object(
        'pending', (SELECT count(*) FROM runs WHERE status = 'pending'),
        'queued', (SELECT count(*) FROM runs WHERE status IN ('queued', 'running') AND status = 'queued'),
        'running', (SELECT count(*) FROM runs WHERE status IN ('queued', 'running') AND status = 'running'
                                                 AND lease_expires_at >= now()),
        'expired', (SELECT count(*) FROM runs WHERE status IN ('queued', 'running') AND status = 'running'
                                                 AND lease_expires_at < now()),
        'waiting_approval', (SELECT count(*) FROM runs
                              WHERE status IN ('queued', 'running', 'waiting_approval', 'blocked')
                                AND status = 'waiting_approval'),
        'blocked', (SELECT count(*) FROM runs
                     WHERE status IN ('queued', 'running', 'waiting_approval', 'blocked') AND status = 'blocked'),
        'oldestQueuedSeconds', (SELECT coalesce(extract(epoch FROM now() - min(coalesce(queued_at, created_at))), 0)
                                  FROM runs WHERE status IN ('queued', 'running') AND status = 'queued'),
        'notificationQueueUsage', pg_notification_queue_usage());
$$;
-- commit

-- Indexes, each built CONCURRENTLY (no lock that blocks reads or writes). A build that failed
-- half-way leaves an INVALID index, which `IF NOT EXISTS` would keep: drop it first.
DO $$
DECLARE
    v text;
BEGIN
    FOR v IN SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
              WHERE NOT i.indisvalid AND c.relname IN ('runs_terminal_finished', 'threads_deleted',
                    'threads_by_parent', 'runs_by_source_thread', 'operations_by_thread') LOOP
        EXECUTE format('DROP INDEX %I', v);
    END LOOP;
END $$;
-- commit
-- A concurrent build waits for every transaction older than it (a pg_dump, a long report) to
-- end; that wait blocks no reader or writer (it holds SHARE UPDATE EXCLUSIVE), so it is exempt
-- from the migration's lock_timeout — which the runner restores after the last group.
SET lock_timeout = 0;
-- commit
-- Step retention walks terminal runs by end time.
CREATE INDEX CONCURRENTLY IF NOT EXISTS runs_terminal_finished ON runs (finished_at, id)
    WHERE status IN ('completed', 'failed', 'cancelled');
-- commit
-- Purging finds soft-deleted threads by deletion time.
CREATE INDEX CONCURRENTLY IF NOT EXISTS threads_deleted ON threads (deleted_at) WHERE deleted_at IS NOT NULL;
-- commit
-- Deleting a thread sets threads.parent_thread_id and runs.source_thread_id of rows pointing at
-- it to NULL and deletes its operations: without these, each purge scans those tables whole.
CREATE INDEX CONCURRENTLY IF NOT EXISTS threads_by_parent ON threads (parent_thread_id) WHERE parent_thread_id IS NOT NULL;
-- commit
CREATE INDEX CONCURRENTLY IF NOT EXISTS runs_by_source_thread ON runs (source_thread_id) WHERE source_thread_id IS NOT NULL;
-- commit
CREATE INDEX CONCURRENTLY IF NOT EXISTS operations_by_thread ON operations (thread_id);
