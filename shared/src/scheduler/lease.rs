//! Leases and fencing (SPEC §5 "Lease", "Fencing").
//!
//! A worker holds a run through a [`Lease`]: `(run_id, owner, epoch)`. Every transaction a slice
//! commits begins with [`Lease::fence`], which locks the run row only if the lease is still
//! ours; otherwise it returns [`LeaseLost`] and the transaction writes nothing. Because the fence
//! holds the row lock until commit and claimers use `SKIP LOCKED`, no other worker can take the
//! run between the check and the write.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text, Uuid as SqlUuid};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use uuid::Uuid;

use crate::db::schema::{run_steps, runs};
use crate::runs::{Run, Step, status};
use crate::{events, threads};

/// The lease a worker holds on a claimed run. `epoch` is the fencing token of the claim.
#[derive(Debug, Clone)]
pub struct Lease {
    pub run_id: Uuid,
    pub thread_id: Uuid,
    pub owner: String,
    pub epoch: i64,
}

/// The lease is no longer held (expired and re-claimed, run cancelled/finished elsewhere):
/// the caller must stop and write nothing more.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("lease lost")]
pub struct LeaseLost;

/// What the fence saw on the run row.
#[derive(Debug, Clone, Copy)]
pub struct Fence {
    /// Cancellation was requested (SPEC §5 "Cancellation").
    pub cancel_requested: bool,
}

/// Errors of fenced writes.
#[derive(Debug, thiserror::Error)]
pub enum FencedError {
    #[error(transparent)]
    LeaseLost(#[from] LeaseLost),
    #[error(transparent)]
    Query(#[from] diesel::result::Error),
}

impl Lease {
    /// Builds the lease of a freshly claimed run.
    pub fn of(run: &Run) -> Self {
        Self {
            run_id: run.id,
            thread_id: run.thread_id,
            owner: run.lease_owner.clone().unwrap_or_default(),
            epoch: run.lease_epoch,
        }
    }

    /// Locks the run row if this lease still holds it (`status = 'running' AND lease_owner = me
    /// AND lease_epoch = mine`). Call first in every slice transaction.
    pub async fn fence(&self, conn: &mut AsyncPgConnection) -> Result<Fence, FencedError> {
        let row: Option<Option<DateTime<Utc>>> = runs::table
            .filter(runs::id.eq(self.run_id))
            .filter(runs::status.eq(status::RUNNING))
            .filter(runs::lease_owner.eq(&self.owner))
            .filter(runs::lease_epoch.eq(self.epoch))
            .select(runs::cancel_requested_at)
            .for_update()
            .first(conn)
            .await
            .optional()?;
        match row {
            Some(cancel) => Ok(Fence { cancel_requested: cancel.is_some() }),
            None => Err(LeaseLost.into()),
        }
    }

    /// Extends the lease to `now() + lease` under the fencing condition. Returns whether
    /// cancellation was requested; [`LeaseLost`] when zero rows matched.
    pub async fn renew(&self, conn: &mut AsyncPgConnection, lease: Duration) -> Result<Fence, FencedError> {
        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            cancel_requested: bool,
        }
        let row: Option<Row> = diesel::sql_query(
            "UPDATE runs SET lease_expires_at = now() + make_interval(secs => $4::bigint / 1000.0)
             WHERE id = $1 AND lease_owner = $2 AND lease_epoch = $3 AND status = 'running'
             RETURNING cancel_requested_at IS NOT NULL AS cancel_requested",
        )
        .bind::<SqlUuid, _>(self.run_id)
        .bind::<Text, _>(&self.owner)
        .bind::<BigInt, _>(self.epoch)
        .bind::<BigInt, _>(lease.as_millis() as i64)
        .get_result(conn)
        .await
        .optional()?;
        row.map(|r| Fence { cancel_requested: r.cancel_requested }).ok_or(LeaseLost.into())
    }

    /// Creates (or, after a recovery, re-opens) the step row `sequence` with its idempotency key
    /// `run:{run_id}:step:{sequence}`. Fenced; journals a `run` event with the new progress.
    pub async fn begin_step(
        &self,
        conn: &mut AsyncPgConnection,
        sequence: i32,
        attempt: i32,
        model: &str,
    ) -> Result<Step, FencedError> {
        self.fence(conn).await?;
        let step: Step = diesel::insert_into(run_steps::table)
            .values((
                run_steps::run_id.eq(self.run_id),
                run_steps::sequence.eq(sequence),
                run_steps::idempotency_key.eq(crate::runs::step_key(self.run_id, sequence)),
                run_steps::status.eq("running"),
                run_steps::attempt.eq(attempt),
                run_steps::lease_epoch.eq(self.epoch),
                run_steps::worker_id.eq(&self.owner),
                run_steps::model.eq(model),
            ))
            .on_conflict(run_steps::idempotency_key)
            .do_update()
            .set((
                run_steps::status.eq("running"),
                run_steps::attempt.eq(attempt),
                run_steps::lease_epoch.eq(self.epoch),
                run_steps::worker_id.eq(&self.owner),
                run_steps::started_at.eq(diesel::dsl::now),
                run_steps::finished_at.eq(None::<DateTime<Utc>>),
                run_steps::error_code.eq(None::<String>),
                run_steps::error_message.eq(None::<String>),
            ))
            .returning(Step::as_returning())
            .get_result(conn)
            .await?;
        let run = crate::runs::get(conn, self.run_id).await?;
        crate::runs::journal(conn, &run).await?;
        Ok(step)
    }
}

/// Counters a slice accumulates and writes at its end.
#[derive(Debug, Clone, Copy, Default)]
pub struct SliceUsage {
    pub model_calls: i32,
    pub tool_calls: i32,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
}

/// How a slice ends (the run transition written with its last checkpoint).
#[derive(Debug, Clone)]
pub enum SliceEnd {
    /// Final answer: the run is `completed`.
    Completed,
    /// Per-slice tool-call limit reached: the same run goes back to `queued`.
    Requeued,
    /// Shutdown or local abort with the lease still held: back to `queued`, step `interrupted`.
    Interrupted,
    /// The run failed with a stable error code and a message.
    Failed { code: String, message: String },
    /// Cancellation was requested and honoured.
    Cancelled,
    /// A tool call needs a human decision: the run is `waiting_approval` (lease released) until
    /// its approval batch is decided (SPEC §4; see [`crate::approvals`]).
    WaitingApproval,
    /// An operation's outcome is unknown: the run is `blocked` with error code
    /// `operation_uncertain` and this message until it is resolved (SPEC §7).
    Blocked { message: String },
}

/// Writes the end of a slice: step outcome and usage, run progress and status, streaming column
/// cleared, FIFO promotion of the thread's next pending run, journal events and wake-ups.
/// Must follow [`Lease::fence`] in the same transaction. `step_id` is `None` when the slice ended
/// before its step row existed (e.g. abandoned on claim).
///
/// An end that stops the run's work early (cancelled, interrupted, failed) first turns the
/// run's `dispatched` operations into `uncertain` (SPEC §7): if there are any, the run ends
/// [`SliceEnd::Blocked`] instead.
pub async fn end_slice(
    conn: &mut AsyncPgConnection,
    lease: &Lease,
    step_id: Option<i64>,
    usage: SliceUsage,
    end: &SliceEnd,
) -> diesel::QueryResult<Run> {
    let blocked;
    let end = if matches!(end, SliceEnd::Cancelled | SliceEnd::Interrupted | SliceEnd::Failed { .. }) {
        let uncertain = crate::operations::mark_uncertain(conn, lease.run_id).await?;
        if uncertain.is_empty() {
            end
        } else {
            blocked = SliceEnd::Blocked { message: crate::operations::blocker_message(&uncertain) };
            &blocked
        }
    } else {
        end
    };
    let (run_status, step_status, error): (&str, &str, Option<(&str, &str)>) = match end {
        SliceEnd::Completed => (status::COMPLETED, "completed", None),
        SliceEnd::Requeued => (status::QUEUED, "requeued", None),
        SliceEnd::Interrupted => (status::QUEUED, "interrupted", None),
        SliceEnd::Failed { code, message } => (status::FAILED, "failed", Some((code, message))),
        SliceEnd::Cancelled => (status::CANCELLED, "cancelled", None),
        SliceEnd::WaitingApproval => (status::WAITING_APPROVAL, "waiting_approval", None),
        SliceEnd::Blocked { message } => (status::BLOCKED, "blocked", Some((crate::operations::BLOCKED_CODE, message.as_str()))),
    };
    if let Some(step_id) = step_id {
        diesel::update(run_steps::table.find(step_id))
            .set((
                run_steps::status.eq(step_status),
                run_steps::finished_at.eq(diesel::dsl::now),
                run_steps::model_calls.eq(run_steps::model_calls + usage.model_calls),
                run_steps::tool_calls.eq(run_steps::tool_calls + usage.tool_calls),
                run_steps::prompt_tokens.eq(run_steps::prompt_tokens + usage.prompt_tokens),
                run_steps::completion_tokens.eq(run_steps::completion_tokens + usage.completion_tokens),
                run_steps::error_code.eq(error.map(|e| e.0)),
                run_steps::error_message.eq(error.map(|e| e.1)),
            ))
            .execute(conn)
            .await?;
    }
    let terminal = matches!(end, SliceEnd::Completed | SliceEnd::Failed { .. } | SliceEnd::Cancelled);
    let requeued = matches!(end, SliceEnd::Requeued | SliceEnd::Interrupted);
    // An interrupted slice does not consume the budget: it will be redone under the same key.
    let steps_delta = i32::from(step_id.is_some() && !matches!(end, SliceEnd::Interrupted));
    let run: Run = diesel::update(runs::table.find(lease.run_id))
        .set((
            runs::status.eq(run_status),
            runs::steps_used.eq(runs::steps_used + steps_delta),
            runs::tool_calls_used.eq(runs::tool_calls_used + usage.tool_calls),
            runs::prompt_tokens.eq(runs::prompt_tokens + usage.prompt_tokens),
            runs::completion_tokens.eq(runs::completion_tokens + usage.completion_tokens),
            runs::lease_owner.eq(None::<String>),
            runs::lease_expires_at.eq(None::<DateTime<Utc>>),
            runs::error_code.eq(error.map(|e| e.0)),
            runs::error_message.eq(error.map(|e| e.1)),
            runs::finished_at.eq(terminal.then(Utc::now)),
            runs::queued_at.eq(diesel::dsl::sql::<diesel::sql_types::Nullable<diesel::sql_types::Timestamptz>>(
                if requeued { "now()" } else { "queued_at" },
            )),
            runs::updated_at.eq(diesel::dsl::now),
        ))
        .returning(Run::as_returning())
        .get_result(conn)
        .await?;
    threads::set_streaming(conn, lease.thread_id, None).await?;
    if terminal {
        crate::messages::close_dangling_tool_calls(conn, lease.thread_id, lease.run_id).await?;
    }
    crate::runs::journal(conn, &run).await?;
    if terminal {
        crate::runs::promote_next_pending(conn, lease.thread_id).await?;
    } else if requeued {
        events::notify_runs(conn, "queued", run.id).await?;
    }
    Ok(run)
}

/// Records the measured context size (tokens) on the step, the run and its thread (SPEC §6
/// step 2). Fenced by the caller.
pub async fn record_context(
    conn: &mut AsyncPgConnection,
    lease: &Lease,
    step_id: i64,
    context_tokens: i32,
    context_limit: Option<i32>,
) -> diesel::QueryResult<()> {
    diesel::update(run_steps::table.find(step_id))
        .set(run_steps::context_tokens.eq(context_tokens))
        .execute(conn)
        .await?;
    diesel::update(runs::table.find(lease.run_id))
        .set((runs::context_tokens.eq(context_tokens), runs::context_limit.eq(context_limit)))
        .execute(conn)
        .await?;
    threads::set_context_tokens(conn, lease.thread_id, context_tokens).await
}
