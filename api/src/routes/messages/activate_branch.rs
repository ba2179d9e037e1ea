//! `POST /api/threads/{id}/messages/{sequence}/branches/activate`.

use actix_web::{HttpResponse, web};
use agentloop_shared::commands;
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Body: the alternative to show.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ActivateBranch {
    /// `firstSequence` of one of the fork's alternatives (`GET .../branches`).
    pub first_sequence: i64,
    /// Switch although the shown alternative holds tool calls that took effect (or may have),
    /// which the model would no longer see (else 409 `effects_in_branch`, migration 000037).
    #[serde(default)]
    pub repeat_effects: Option<bool>,
}

/// What a switch changed.
#[derive(Debug, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BranchSwitched {
    pub parent_sequence: i64,
    /// Sequences now active again.
    pub activated: Vec<i64>,
    /// Sequences of the alternative that was shown (kept as a branch).
    pub deactivated: Vec<i64>,
}

/// Shows another alternative of the fork whose shown alternative starts at active message
/// `sequence`: the shown one becomes a branch, the chosen one's messages become active again
/// (rows are never rewritten except `active`), one transaction (`agentloop_activate_branch`);
/// live clients get `messages_deactivated` and `branch_switched`. 200 [`BranchSwitched`].
/// Errors: 404 (no such message or alternative), 409 `run_active` / `approval_required` /
/// `effects_in_branch` (the shown alternative holds tool calls that took effect; `repeatEffects`).
#[utoipa::path(
    post, path = "/api/threads/{id}/messages/{sequence}/branches/activate", tag = "messages", operation_id = "activate_branch",
    params(("id" = Uuid, Path, description = "Thread id"), ("sequence" = i64, Path, description = "Message sequence")),
    request_body = ActivateBranch,
    responses((status = 200, description = "What the switch changed", body = BranchSwitched),
              (status = 404, description = "No such thread, message or branch", body = crate::views::ErrorBody),
              (status = 409, description = "`run_active`: a run is active on the thread; `effects_in_branch`", body = crate::views::ErrorBody))
)]
pub async fn activate_branch(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<(Uuid, i64)>,
    body: crate::extract::Json<ActivateBranch>,
) -> Result<HttpResponse, ApiError> {
    let (thread_id, sequence) = path.into_inner();
    let repeat_effects = body.repeat_effects.unwrap_or(false);
    let body = commands::activate_branch(&state.store, who.0.id, thread_id, sequence, body.first_sequence, repeat_effects).await?;
    Ok(HttpResponse::Ok().json(body))
}
