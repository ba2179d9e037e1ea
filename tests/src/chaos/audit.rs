//! Write audit: triggers installed in the chaos database that record who wrote what, and the
//! run's lease at that moment, so writes after a lease loss can be counted exactly.
//!
//! - `chaos_audit`: one row per `INSERT` on `messages` and per `INSERT`/`UPDATE` on
//!   `operations`: the writing session's `application_name`, its transaction id, the row's
//!   thread/run, and — read inside the trigger, in the writer's transaction — the run's
//!   `status`, `lease_owner`, `lease_epoch` and `lease_expires_at`.
//! - `chaos_run_audit`: one row per `UPDATE` of `runs` that changes `status`, `lease_owner` or
//!   `lease_epoch` (renewals are not recorded), with the old and new values.
//!
//! Worker pool sessions are named `agentloop-worker <worker id>` (the id the worker writes as
//! `lease_owner`); listeners are `agentloop-worker-listener` / `agentloop-api-listener` and never
//! write. A worker write is legitimate (README "How a turn runs" 5, "Turns, cancellation and
//! recovery") when:
//!
//! 1. the run it belongs to is `running` with `lease_owner` = the writer at that moment (for an
//!    operation row, also under the epoch it records — except `uncertain`, which a later attempt
//!    writes over an earlier attempt's row); a row without a run: some `running` run of the
//!    thread is leased to the writer;
//! 2. or the same transaction ended a run of that thread which the writer held
//!    (`running`/owner = writer before the update): the synthetic results of dangling tool calls
//!    and the user turn of the FIFO-promoted next run are written after the run row changed;
//! 3. or the same transaction is the approval-expiry sweep finishing a batch
//!    (`waiting_approval` -> `queued`);
//! 4. or it records a known outcome (`completed`/`failed`) on an operation row under the epoch
//!    the writer itself claimed the run with (`agentloop_record_outcome`: an attempt that got a
//!    dispatched call's answer but lost its lease before its checkpoint records the fact on the
//!    row it dispatched — without the lease, by design; the function only moves a
//!    `dispatched`/`uncertain` row of that epoch that nobody resolved).
//!
//! Anything else is a write after lease loss. Run-row changes by a worker are legitimate when
//! they are a claim (`queued`/`running` -> `running`, owner = writer, epoch + 1), the end of a
//! slice it held, the FIFO promotion in such a transaction, or the approval-expiry requeue. A
//! claim of a `running` run whose lease had not expired at the claim's `now()` is counted too, but
//! not a worker's claim of a run it released itself (same owner, no recovery: migration 000026).
//! Limit: a worker process that re-claims its own expired run keeps its id, so a stale slice of
//! the same process (older epoch) writing message rows is indistinguishable by session name;
//! operation rows carry the epoch and are checked.

use anyhow::Result;
use tokio_postgres::Client;

/// DDL of the audit tables, functions and triggers.
pub const INSTALL: &str = r#"
CREATE TABLE chaos_audit (
    id bigserial PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT clock_timestamp(),
    txid bigint NOT NULL DEFAULT txid_current(),
    app text NOT NULL,
    tbl text NOT NULL,
    op text NOT NULL,
    thread_id uuid,
    run_id uuid,
    row_ref text,
    row_status text,
    row_epoch bigint,
    run_status text,
    run_owner text,
    run_epoch bigint,
    run_lease_expires_at timestamptz,
    held_on_thread boolean
);
CREATE INDEX chaos_audit_txid ON chaos_audit (txid);
CREATE TABLE chaos_run_audit (
    id bigserial PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT clock_timestamp(),
    txid bigint NOT NULL DEFAULT txid_current(),
    tx_now timestamptz NOT NULL DEFAULT now(),
    app text NOT NULL,
    run_id uuid NOT NULL,
    thread_id uuid NOT NULL,
    old_status text,
    new_status text,
    old_owner text,
    new_owner text,
    old_epoch bigint,
    new_epoch bigint,
    old_lease_expires_at timestamptz,
    old_recoveries int,
    new_recoveries int
);
CREATE INDEX chaos_run_audit_txid ON chaos_run_audit (txid);
CREATE FUNCTION chaos_worker_of(app text) RETURNS text LANGUAGE sql IMMUTABLE AS
  $$ SELECT CASE WHEN app LIKE 'agentloop-worker %' THEN substr(app, 18) END $$;
CREATE FUNCTION chaos_audit_row() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    app text := current_setting('application_name');
    w text := chaos_worker_of(current_setting('application_name'));
    rs text; ro text; re bigint; rx timestamptz; held boolean;
BEGIN
    IF NEW.run_id IS NOT NULL THEN
        SELECT status, lease_owner, lease_epoch, lease_expires_at INTO rs, ro, re, rx FROM runs WHERE id = NEW.run_id;
    END IF;
    held := w IS NOT NULL AND EXISTS (SELECT 1 FROM runs WHERE thread_id = NEW.thread_id AND status = 'running' AND lease_owner = w);
    IF TG_TABLE_NAME = 'messages' THEN
        INSERT INTO chaos_audit (app, tbl, op, thread_id, run_id, row_ref, run_status, run_owner, run_epoch, run_lease_expires_at, held_on_thread)
        VALUES (app, 'messages', TG_OP, NEW.thread_id, NEW.run_id, NEW.id::text, rs, ro, re, rx, held);
    ELSE
        INSERT INTO chaos_audit (app, tbl, op, thread_id, run_id, row_ref, row_status, row_epoch, run_status, run_owner, run_epoch, run_lease_expires_at, held_on_thread)
        VALUES (app, 'operations', TG_OP, NEW.thread_id, NEW.run_id, NEW.key, NEW.status, NEW.lease_epoch, rs, ro, re, rx, held);
    END IF;
    RETURN NULL;
END $$;
CREATE FUNCTION chaos_audit_run() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos_run_audit (app, run_id, thread_id, old_status, new_status, old_owner, new_owner, old_epoch, new_epoch,
                                 old_lease_expires_at, old_recoveries, new_recoveries)
    VALUES (current_setting('application_name'), NEW.id, NEW.thread_id, OLD.status, NEW.status, OLD.lease_owner, NEW.lease_owner,
            OLD.lease_epoch, NEW.lease_epoch, OLD.lease_expires_at, OLD.recoveries, NEW.recoveries);
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_audit_messages AFTER INSERT ON messages FOR EACH ROW EXECUTE FUNCTION chaos_audit_row();
CREATE TRIGGER chaos_audit_operations AFTER INSERT OR UPDATE ON operations FOR EACH ROW EXECUTE FUNCTION chaos_audit_row();
CREATE TRIGGER chaos_audit_runs AFTER UPDATE ON runs FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.lease_owner IS DISTINCT FROM NEW.lease_owner
          OR OLD.lease_epoch IS DISTINCT FROM NEW.lease_epoch)
    EXECUTE FUNCTION chaos_audit_run();
"#;

/// Worker row writes that none of the rules allow.
const LEASE_VIOLATIONS: &str = r#"
SELECT a.id, a.at::text, a.app, a.tbl, a.op, a.run_id::text, a.row_ref, coalesce(a.row_status, ''),
       coalesce(a.run_status, ''), coalesce(a.run_owner, ''), coalesce(a.run_epoch, -1), coalesce(a.row_epoch, -1)
FROM chaos_audit a
WHERE chaos_worker_of(a.app) IS NOT NULL
  AND NOT (
        (a.run_id IS NOT NULL AND a.run_status = 'running' AND a.run_owner = chaos_worker_of(a.app)
         AND (a.tbl <> 'operations' OR a.row_status = 'uncertain' OR a.row_epoch = a.run_epoch))
     OR (a.run_id IS NULL AND a.held_on_thread)
     OR EXISTS (SELECT 1 FROM chaos_run_audit r WHERE r.txid = a.txid AND r.thread_id = a.thread_id
                AND r.old_status = 'running' AND r.old_owner = chaos_worker_of(a.app))
     OR EXISTS (SELECT 1 FROM chaos_run_audit r WHERE r.txid = a.txid AND r.run_id = a.run_id
                AND r.old_status = 'waiting_approval' AND r.new_status = 'queued')
     OR (a.tbl = 'operations' AND a.op = 'UPDATE' AND a.row_status IN ('completed', 'failed')
         AND EXISTS (SELECT 1 FROM chaos_run_audit r WHERE r.run_id = a.run_id AND r.new_status = 'running'
                     AND r.new_epoch = a.row_epoch AND r.new_owner = chaos_worker_of(a.app)))
  )
ORDER BY a.id
"#;

/// Run-row changes by workers that none of the rules allow.
const RUN_VIOLATIONS: &str = r#"
SELECT r.id, r.at::text, r.app, r.run_id::text, coalesce(r.old_status, ''), coalesce(r.new_status, ''),
       coalesce(r.old_owner, ''), coalesce(r.new_owner, ''), r.old_epoch, r.new_epoch
FROM chaos_run_audit r
WHERE chaos_worker_of(r.app) IS NOT NULL
  AND NOT (
        (r.new_status = 'running' AND r.new_owner = chaos_worker_of(r.app) AND r.new_epoch = r.old_epoch + 1
         AND r.old_status IN ('queued', 'running'))
     OR (r.old_status = 'running' AND r.old_owner = chaos_worker_of(r.app))
     OR (r.old_status = 'pending' AND r.new_status = 'queued' AND EXISTS (
            SELECT 1 FROM chaos_run_audit e WHERE e.txid = r.txid AND e.thread_id = r.thread_id
            AND e.old_status = 'running' AND e.old_owner = chaos_worker_of(r.app)))
     OR (r.old_status = 'waiting_approval' AND r.new_status = 'queued')
  )
ORDER BY r.id
"#;

/// Claims of a `running` run whose lease was still live at the claim's `now()` — but a worker's
/// claim of a run it released itself (migration 000026: its slice ended and could not write the
/// end; same owner, new fencing token, no recovery counted), which takes nothing from anyone.
const LIVE_CLAIMS: &str = r#"
SELECT r.id, r.at::text, r.app, r.run_id::text, coalesce(r.old_owner, ''), r.old_lease_expires_at::text, r.tx_now::text
FROM chaos_run_audit r
WHERE r.old_status = 'running' AND r.new_status = 'running' AND r.new_epoch = r.old_epoch + 1
  AND r.old_lease_expires_at >= r.tx_now
  AND NOT (r.old_owner = r.new_owner AND r.new_recoveries = r.old_recoveries)
ORDER BY r.id
"#;

/// What the audit found.
#[derive(Debug, Default, Clone)]
pub struct AuditFindings {
    /// Worker writes of message/operation rows recorded.
    pub worker_writes: i64,
    /// ... of which written by the lease owner after `lease_expires_at` had passed (allowed by
    /// the fence: nobody had claimed the run yet).
    pub owner_writes_after_expiry: i64,
    /// Claims of runs whose lease had expired (recoveries), per the run audit.
    pub recovery_claims: i64,
    pub lease_violations: Vec<String>,
    pub run_violations: Vec<String>,
    pub live_claims: Vec<String>,
}

/// Creates the audit tables and triggers in the database of `client`.
pub async fn install(client: &Client) -> Result<()> {
    client.batch_execute(INSTALL).await?;
    Ok(())
}

/// Evaluates the audit rules (see the module docs).
pub async fn check(client: &Client) -> Result<AuditFindings> {
    let mut f = AuditFindings {
        worker_writes: client
            .query_one("SELECT count(*) FROM chaos_audit WHERE chaos_worker_of(app) IS NOT NULL", &[])
            .await?
            .get(0),
        owner_writes_after_expiry: client
            .query_one(
                "SELECT count(*) FROM chaos_audit WHERE chaos_worker_of(app) IS NOT NULL AND run_owner = chaos_worker_of(app)
                 AND run_status = 'running' AND run_lease_expires_at < at",
                &[],
            )
            .await?
            .get(0),
        recovery_claims: client
            .query_one(
                "SELECT count(*) FROM chaos_run_audit WHERE old_status = 'running' AND new_status = 'running' AND new_epoch = old_epoch + 1",
                &[],
            )
            .await?
            .get(0),
        ..Default::default()
    };
    for row in client.query(LEASE_VIOLATIONS, &[]).await? {
        f.lease_violations.push(format!(
            "audit#{} at {} by '{}': {} {} run {} row {} (row status '{}', epoch {}) while the run was '{}' owner '{}' epoch {}",
            row.get::<_, i64>(0),
            row.get::<_, String>(1),
            row.get::<_, String>(2),
            row.get::<_, String>(4),
            row.get::<_, String>(3),
            row.get::<_, Option<String>>(5).unwrap_or_default(),
            row.get::<_, Option<String>>(6).unwrap_or_default(),
            row.get::<_, String>(7),
            row.get::<_, i64>(11),
            row.get::<_, String>(8),
            row.get::<_, String>(9),
            row.get::<_, i64>(10),
        ));
    }
    for row in client.query(RUN_VIOLATIONS, &[]).await? {
        f.run_violations.push(format!(
            "run-audit#{} at {} by '{}': run {} {} -> {} owner '{}' -> '{}' epoch {:?} -> {:?}",
            row.get::<_, i64>(0),
            row.get::<_, String>(1),
            row.get::<_, String>(2),
            row.get::<_, String>(3),
            row.get::<_, String>(4),
            row.get::<_, String>(5),
            row.get::<_, String>(6),
            row.get::<_, String>(7),
            row.get::<_, Option<i64>>(8),
            row.get::<_, Option<i64>>(9),
        ));
    }
    for row in client.query(LIVE_CLAIMS, &[]).await? {
        f.live_claims.push(format!(
            "run-audit#{} at {} by '{}': claimed run {} from '{}' whose lease ran until {} (claim now() {})",
            row.get::<_, i64>(0),
            row.get::<_, String>(1),
            row.get::<_, String>(2),
            row.get::<_, String>(3),
            row.get::<_, String>(4),
            row.get::<_, Option<String>>(5).unwrap_or_default(),
            row.get::<_, String>(6),
        ));
    }
    Ok(f)
}
