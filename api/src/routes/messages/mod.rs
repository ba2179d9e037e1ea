//! Branch operations on canonical messages (SPEC §3, §13): edit, regenerate, delete.

pub mod activate_branch;
pub mod delete_message;
pub mod edit_message;
pub mod list_branches;
pub mod regenerate_message;

use serde::Deserialize;

use crate::error::ApiError;

/// Optional run settings of edit/regenerate: `{maxSteps?, model?, repeatEffects?}`.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RunOptions {
    #[serde(default)]
    #[schema(minimum = 1, maximum = 10000)]
    pub max_steps: Option<i32>,
    #[serde(default)]
    pub model: Option<String>,
    /// Go ahead although the replaced messages hold tool calls that took effect (or may have):
    /// without it such an edit or regenerate is 409 `effects_in_branch` (migration 000037).
    #[serde(default)]
    pub repeat_effects: Option<bool>,
}

impl RunOptions {
    /// Validated options of the enqueued run (400 `invalid_max_steps` / `unknown_model`).
    pub(crate) fn validated(self, state: &crate::AppState) -> Result<agentloop_shared::commands::RunOptions, ApiError> {
        let max_steps = self.max_steps.unwrap_or(agentloop_shared::runs::DEFAULT_MAX_STEPS);
        if !(1..=10_000).contains(&max_steps) {
            return Err(ApiError::bad_request("invalid_max_steps", "maxSteps must be within 1..=10000"));
        }
        crate::validate::model(&state.catalog, self.model.as_deref())?;
        Ok(agentloop_shared::commands::RunOptions {
            max_steps,
            model: state.model_choice(self.model),
            repeat_effects: self.repeat_effects.unwrap_or(false),
        })
    }
}
