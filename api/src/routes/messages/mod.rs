//! Branch operations on canonical messages (SPEC §3, §13): edit, regenerate, delete.

pub mod delete_message;
pub mod edit_message;
pub mod regenerate_message;

use agentloop_shared::runs::{self, NewRun, Run, status};
use agentloop_shared::threads::Thread;
use diesel_async::AsyncPgConnection;
use serde::Deserialize;
use uuid::Uuid;

use crate::error::ApiError;

/// Refuses a branch operation while the thread has an active run (409 `run_active`, or
/// `approval_required` while it waits for an approval): the worker owns the tail then.
pub(crate) async fn ensure_idle(conn: &mut AsyncPgConnection, thread_id: Uuid) -> Result<(), ApiError> {
    match runs::active_for_thread(conn, thread_id).await? {
        None => Ok(()),
        Some(run) if run.status == status::WAITING_APPROVAL => Err(ApiError::conflict(
            "approval_required",
            format!("run {} is waiting for a tool approval; decide it or cancel the run first", run.id),
        )),
        Some(run) => Err(ApiError::conflict(
            "run_active",
            format!("run {} is still {}; wait for it or cancel it first", run.id, run.status),
        )),
    }
}

/// Optional run settings of edit/regenerate: `{maxSteps?, model?}`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RunOptions {
    #[serde(default)]
    pub max_steps: Option<i32>,
    #[serde(default)]
    pub model: Option<String>,
}

/// Enqueues a `queued` agent run on `thread` (the same run a chat post creates).
pub(crate) async fn enqueue(
    conn: &mut AsyncPgConnection,
    state: &crate::AppState,
    thread: &Thread,
    principal: Uuid,
    options: &RunOptions,
) -> Result<Run, ApiError> {
    let max_steps = options.max_steps.unwrap_or(runs::DEFAULT_MAX_STEPS);
    if !(1..=10_000).contains(&max_steps) {
        return Err(ApiError::bad_request("invalid_max_steps", "maxSteps must be within 1..=10000"));
    }
    let model = options
        .model
        .clone()
        .or_else(|| thread.model.clone())
        .or_else(|| state.catalog.default_model().map(|m| m.id.clone()))
        .ok_or_else(|| ApiError::bad_request("no_model", "no model is configured on this server"))?;
    crate::validate::model(&state.catalog, Some(&model))?;
    Ok(runs::insert(
        conn,
        NewRun {
            thread_id: thread.id,
            principal_id: principal,
            model,
            max_steps,
            command_id: None,
            status: status::QUEUED,
            input: None,
            kind: runs::kind::AGENT,
            source_thread_id: None,
        },
    )
    .await?)
}
