//! The tool calls of a slice (SPEC §6 step 5, §7): approval policy, human approvals, and the
//! operations ledger for calls with external effects.
//!
//! The assistant tool-call message is checkpointed (with ids agentloop assigned, unique per
//! run) BEFORE any call runs. For each unanswered call, in order ([`run_batch`]):
//! - an approval row decides: `approved` runs with the approved (maybe edited) arguments,
//!   `rejected`/`expired`/`cancelled` gets "Tool call declined by the user.";
//! - otherwise the policy: `deny` gets an error result, `ask` (with valid arguments) joins the
//!   approval batch — or, on the stateless endpoint's thread where nobody can decide, fails
//!   closed with an error result — and `auto` runs.
//!
//! Results of calls without external effects are collected and committed together (a crash
//! redoes them: they are idempotent). A call of a non-idempotent tool goes through the ledger:
//! the results before it and its `dispatched` row are committed BEFORE the call leaves, and its
//! outcome is committed with its result message. A call whose outcome is unknown (the tool
//! reports it uncertain: a timeout, a reset or a 5xx after sending; or the slice is aborted
//! mid-call) makes the operation `uncertain` and the run `blocked` — never `failed`, never
//! retried automatically. When the batch needs approvals, its rows are created in the commit
//! that parks the run in `waiting_approval` (lease released); the `auto` calls have run by then.
//!
//! A call of an MCP server with `auth: oauth` carries the run's principal and their token
//! ([`agentloop_shared::mcp_auth::token_for_call`], which also claims the run's completed
//! authorization of that call, once). When the server answers that authorization is required,
//! the call had no effect: the worker discovers the authorization server and parks the run in
//! `waiting_authorization` with a sign-in URL ([`authorize`]); the callback requeues the same run
//! and the next slice retries the call under the same operation key. A sign-in that cannot be
//! offered (no `OAUTH_TOKENS_KEY` / `OAUTH_REDIRECT_URL`, discovery failed) is an error result.

use std::collections::HashSet;
use std::time::Instant;

use agentloop_shared::approvals::{self, Approval, NewApproval};
use agentloop_shared::context::ContextMessage;
use agentloop_shared::messages::{NewMessage, ToolCallRef, role};
use agentloop_shared::operations::{self, Operation, status as op_status};
use agentloop_shared::scheduler::step::{ContextSize, OpenCalls, OperationChange};
use agentloop_shared::scheduler::{Commit, SliceEnd};
use agentloop_shared::mcp_auth;
use agentloop_shared::secrets::SecretsKey;
use agentloop_shared::tools::mcp::{AuthChallenge, McpCredential, McpServer};
use agentloop_shared::tools::{Policy, ToolContext, ToolOutcome};
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// The worker's MCP sign-in settings (`OAUTH_*`).
pub struct SignInSettings {
    /// `OAUTH_TOKENS_KEY`: without it no sign-in is offered (tokens are never stored in clear).
    pub key: Option<Arc<SecretsKey>>,
    /// `OAUTH_REDIRECT_URL`: the api's callback, the `redirect_uri` of every sign-in.
    pub redirect_url: Option<String>,
    /// How long a sign-in link can be used.
    pub ttl: Duration,
    /// Discovery client (timeouts, no redirects).
    pub client: reqwest::Client,
}

use crate::slice::{Slice, SliceError};

/// The calls of one assistant message that still need an answer.
pub struct Batch {
    /// Sequence of the assistant tool-call message.
    pub message_sequence: i64,
    /// Its calls, in order.
    pub calls: Vec<ToolCallRef>,
    /// Ids of calls that already have a result.
    pub answered: HashSet<String>,
}

impl Batch {
    /// The calls of a freshly checkpointed assistant message.
    pub fn new(message_sequence: i64, calls: Vec<ToolCallRef>) -> Self {
        Self { message_sequence, calls, answered: HashSet::new() }
    }

    /// The run's open tool-call message as found at slice start.
    pub fn open(open: &OpenCalls) -> Self {
        Self {
            message_sequence: open.message.sequence,
            calls: agentloop_shared::messages::tool_calls_of(open.message.tool_calls.as_ref()),
            answered: open.answered.iter().cloned().collect(),
        }
    }

    /// Calls still without a result.
    pub fn pending(&self) -> usize {
        self.calls.iter().filter(|c| !self.answered.contains(&c.id)).count()
    }

    /// Every call has a result.
    pub fn is_done(&self) -> bool {
        self.pending() == 0
    }
}

/// What [`run_batch`] did.
pub enum BatchEnd {
    /// Every call is answered; the results (committed, with their identities) in order.
    Answered { results: Vec<ContextMessage>, answered: u32 },
    /// The slice ended (waiting for approval, blocked, ...): its end is committed.
    Ended(SliceEnd),
}

/// Text an `ask` call gets when nobody can approve it (the stateless endpoint's hidden thread,
/// `metadata.stateless = true`): it fails closed.
fn no_owner(name: &str) -> String {
    format!("Tool `{name}` needs a human approval, and this request has no interactive owner (stateless API): it was not run.")
}

/// Text a call of a `deny` tool gets.
fn denied(name: &str) -> String {
    format!("Tool `{name}` is not allowed by the operator's policy (deny); it was not run.")
}

/// The result of a call its tool's `deny` policy stops: "not run", unless its operation (`key`)
/// was sent before — a `retry` resolve of an uncertain call — when it may have taken effect and
/// its outcome is unknown (verification of probe E: it said "it was not run").
fn denied_result(call: &ToolCallRef, operations: &[Operation], key: &str) -> String {
    if operations.iter().any(|o| o.key == key && o.dispatches > 0) {
        format!(
            "[outcome unknown: this call may have taken effect; it was not sent again because the operator's policy now denies `{}`]",
            call.name
        )
    } else {
        denied(&call.name)
    }
}

fn result_for(call: &ToolCallRef, text: String) -> NewMessage {
    let mut message = NewMessage::text(role::TOOL, text);
    message.tool_call_id = Some(call.id.clone());
    message
}

/// The content of a result; notes arguments the user edited before approving.
fn content_of(outcome: &ToolOutcome, edited: Option<&Value>) -> String {
    match edited {
        Some(arguments) => format!("[The user edited the arguments before approving; the tool ran with {arguments}]\n{}", outcome.content),
        None => outcome.content.clone(),
    }
}

/// Results appended (or about to be) in call order.
#[derive(Default)]
struct Results {
    /// Committed and uncommitted results, in order.
    all: Vec<ContextMessage>,
    /// Indexes into `all` not committed yet.
    uncommitted: Vec<usize>,
}

impl Results {
    fn push(&mut self, message: NewMessage) {
        self.uncommitted.push(self.all.len());
        self.all.push(ContextMessage { identity: None, message });
    }

    /// The uncommitted messages (for the next commit).
    fn take(&self) -> Vec<NewMessage> {
        self.uncommitted.iter().map(|&i| self.all[i].message.clone()).collect()
    }

    /// Records the identities of a commit that contained `take()` followed by `extra` messages.
    fn committed(&mut self, identities: &[agentloop_shared::scheduler::step::Identity]) {
        for (&i, identity) in self.uncommitted.iter().zip(identities) {
            self.all[i].identity = Some(identity.timestamp);
        }
        self.uncommitted.clear();
    }
}

/// Answers every unanswered call of `batch` in order (see the module docs). `approvals` and
/// `operations` are the run's rows as of slice start (empty for a batch just checkpointed);
/// `size` is the context size before the results (recorded with them).
pub async fn run_batch(
    slice: &mut Slice,
    batch: &Batch,
    approvals: &[Approval],
    operations: &[Operation],
    interactive: bool,
    size: ContextSize,
) -> Result<BatchEnd, SliceError> {
    let tools = slice.env.tools.clone();
    let mut results = Results::default();
    let mut needs: Vec<NewApproval> = Vec::new();
    let mut answered = 0u32;
    for call in batch.calls.iter().filter(|c| !batch.answered.contains(&c.id)) {
        slice.check_abort()?;
        let approval = approvals.iter().find(|a| a.tool_call_id == call.id);
        match approval.map(|a| a.status.as_str()) {
            Some(approvals::status::APPROVED) => {
                let approval = approval.expect("matched");
                let arguments = approval.approved_arguments.clone().unwrap_or_else(|| approval.arguments.clone());
                let edited = approval.arguments_edited.then_some(&arguments);
                if let Some(end) = execute(slice, &mut results, operations, call, &arguments.to_string(), edited).await? {
                    return Ok(BatchEnd::Ended(end));
                }
            }
            Some(approvals::status::PENDING) => {
                let approval = approval.expect("matched");
                needs.push(NewApproval {
                    message_sequence: batch.message_sequence,
                    tool_call_id: call.id.clone(),
                    tool_name: call.name.clone(),
                    arguments: approval.arguments.clone(),
                    parameters: approval.parameters.clone(),
                });
                continue;
            }
            Some(approvals::status::EXPIRED) => results.push(result_for(call, approvals::EXPIRED_RESULT.to_owned())),
            Some(_) => {
                let reason = approval.and_then(|a| a.reason.as_deref());
                results.push(result_for(call, approvals::declined_result(reason)));
            }
            None => match tools.policy(&call.name) {
                Policy::Deny => {
                    let key = operations::key(slice.lease.run_id, &call.id);
                    results.push(result_for(call, denied_result(call, operations, &key)));
                }
                Policy::Ask if !interactive => results.push(result_for(call, no_owner(&call.name))),
                Policy::Ask => match tools.prepare(&call.name, &call.arguments).await {
                    Ok((tool, arguments)) => {
                        needs.push(NewApproval {
                            message_sequence: batch.message_sequence,
                            tool_call_id: call.id.clone(),
                            tool_name: call.name.clone(),
                            arguments,
                            parameters: tool.parameters(),
                        });
                        continue;
                    }
                    Err(outcome) => results.push(result_for(call, outcome.content)),
                },
                Policy::Auto => {
                    if let Some(end) = execute(slice, &mut results, operations, call, &call.arguments, None).await? {
                        return Ok(BatchEnd::Ended(end));
                    }
                }
            },
        }
        answered += 1;
        slice.usage.tool_calls += 1;
    }
    let size = ContextSize {
        tokens: size.tokens + results.all.iter().map(|c| i64::from(c.message.token_estimate.max(1))).sum::<i64>(),
        limit: size.limit,
    };
    if !needs.is_empty() {
        let count = needs.len();
        let done = slice
            .commit(Commit {
                messages: results.take(),
                approvals: needs,
                approval_timeout_ms: Some(slice.env.approval_timeout.as_millis() as u64),
                context: Some(size),
                end: Some(SliceEnd::WaitingApproval),
                ..Commit::default()
            })
            .await?;
        if done.status == agentloop_shared::runs::status::WAITING_APPROVAL {
            tracing::info!(approvals = count, "tool calls need approval: the run waits");
            metrics::counter!("agentloop_tool_approvals_requested_total").increment(count as u64);
            return Ok(BatchEnd::Ended(SliceEnd::WaitingApproval));
        }
        // A cancellation requested meanwhile won: nobody would decide.
        return Ok(BatchEnd::Ended(SliceEnd::Cancelled { keep_streamed: false }));
    }
    if !results.uncommitted.is_empty() {
        let done = slice.commit(Commit { messages: results.take(), context: Some(size), ..Commit::default() }).await?;
        results.committed(&done.messages);
    }
    Ok(BatchEnd::Answered { results: results.all, answered })
}

/// Runs one call. Idempotent tools just run (their result joins `results`); the others go
/// through the ledger. Returns the slice's end when the call ended it (blocked).
async fn execute(
    slice: &mut Slice,
    results: &mut Results,
    operations: &[Operation],
    call: &ToolCallRef,
    raw_arguments: &str,
    edited: Option<&Value>,
) -> Result<Option<SliceEnd>, SliceError> {
    let tools = slice.env.tools.clone();
    let key = operations::key(slice.lease.run_id, &call.id);
    let (tool, arguments) = match tools.prepare(&call.name, raw_arguments).await {
        Ok(prepared) => prepared,
        Err(outcome) => {
            results.push(result_for(call, outcome.content));
            return Ok(None);
        }
    };
    let oauth = tools.oauth_server(&call.name);
    let credential = match &oauth {
        Some(server) => credential_for(slice, server, call).await?,
        None => None,
    };
    let used = credential.as_ref().and_then(|c| c.token.as_deref()).map(agentloop_shared::tools::mcp::fingerprint);
    let ctx = ToolContext { idempotency_key: key.clone(), cancel: slice.control.cancel_token(), credential };
    let started = Instant::now();
    // `deny` is the operator's kill switch: it holds for every call not sent yet, approved ones
    // included (acceptance probe E: a call approved after the tool was set to deny still ran).
    let denied_now = matches!(tools.policy(&call.name), Policy::Deny);
    if tools.is_idempotent(&call.name) {
        if denied_now {
            results.push(result_for(call, denied_result(call, operations, &key)));
            return Ok(None);
        }
        let span = tool_span(call);
        let mut outcome = tools.invoke(tool.as_ref(), arguments, ctx).instrument(span.clone()).await;
        traced(&span, &outcome);
        slice.check_abort()?;
        record(call, &outcome, false, started);
        if let (Some(challenge), Some(server)) = (outcome.authorization.clone(), &oauth) {
            match authorize(slice, results, call, &key, &challenge, server, used.clone()).await? {
                Ok(end) => return Ok(Some(end)),
                Err(reason) => outcome.content = reason,
            }
        }
        results.push(result_for(call, content_of(&outcome, edited)));
        return Ok(None);
    }
    match operations.iter().find(|o| o.key == key).map(|o| o.status.as_str()) {
        Some(op_status::COMPLETED | op_status::FAILED) => {
            let op = operations.iter().find(|o| o.key == key).expect("matched");
            results.push(operations::result_message(op));
            return Ok(None);
        }
        Some(op_status::DISPATCHED | op_status::UNCERTAIN) => {
            // Slice start blocks runs with such rows; reaching one here means its outcome is
            // unknown all the same.
            let messages = results.take();
            slice.commit(Commit { messages, end: Some(SliceEnd::Blocked), ..Commit::default() }).await?;
            return Ok(Some(SliceEnd::Blocked));
        }
        _ if denied_now => {
            results.push(result_for(call, denied_result(call, operations, &key)));
            return Ok(None);
        }
        _ => {}
    }
    // The results before this call and its `dispatched` row, committed before it leaves.
    let dispatch = OperationChange::Dispatch {
        key: key.clone(),
        tool_call_id: call.id.clone(),
        tool_name: call.name.clone(),
        arguments: arguments.clone(),
    };
    let done = slice.commit(Commit { messages: results.take(), operations: vec![dispatch], ..Commit::default() }).await?;
    results.committed(&done.messages);
    // No abort check between the dispatch and the call: an abort that came in between is seen
    // by the registry as "cancelled before the call started" (failed, nothing sent). A shutdown
    // lets the call finish (the effects token ignores it); a cancellation or a lost lease cuts
    // it, and the registry then reports the outcome as uncertain.
    let ctx = ToolContext { cancel: slice.control.effect_token(), ..ctx };
    let span = tool_span(call);
    slice.control.effect_in_flight(true);
    let mut outcome = tools.invoke(tool.as_ref(), arguments, ctx).instrument(span.clone()).await;
    slice.control.effect_in_flight(false);
    traced(&span, &outcome);
    record(call, &outcome, true, started);
    if let (Some(challenge), Some(server)) = (outcome.authorization.clone(), &oauth) {
        // Refused for want of authorization: the call had no effect. Parking puts its
        // operation back to `prepared`, so the retry dispatches it again under the same key.
        match authorize(slice, results, call, &key, &challenge, server, used.clone()).await? {
            Ok(end) => return Ok(Some(end)),
            Err(reason) => outcome.content = reason,
        }
    }
    if outcome.uncertain {
        tracing::warn!(tool.name = %call.name, "the outcome of a call with external effects is unknown: the run is blocked");
        let finish = OperationChange::Finish { key, status: op_status::UNCERTAIN, result: outcome.content.clone() };
        slice.commit(Commit { operations: vec![finish], end: Some(SliceEnd::Blocked), ..Commit::default() }).await?;
        return Ok(Some(SliceEnd::Blocked));
    }
    let message = result_for(call, content_of(&outcome, edited));
    let status = if outcome.is_error { op_status::FAILED } else { op_status::COMPLETED };
    let text = message.content.as_str().unwrap_or_default().to_owned();
    let finish = OperationChange::Finish { key: key.clone(), status, result: text.clone() };
    results.push(message);
    match slice.commit(Commit { messages: results.take(), operations: vec![finish], ..Commit::default() }).await {
        Ok(done) => results.committed(&done.messages),
        Err(error @ (SliceError::LeaseLost | SliceError::Transient(_) | SliceError::Outage(_))) => {
            // The outcome is known: record it on the operation row even without the lease, so
            // the next attempt uses it instead of blocking the run on an "unknown" outcome.
            let deadline = Instant::now() + slice.env.lease * 4;
            match agentloop_shared::scheduler::step::record_outcome(&slice.env.store, &slice.lease, &key, status, &text, deadline).await {
                Ok(recorded) => tracing::warn!(recorded, "the call's checkpoint could not be committed; its outcome was recorded on the operation"),
                Err(e) => tracing::error!(error = %e, "the call's outcome could not be recorded; the run will be blocked on it"),
            }
            return Err(error);
        }
        Err(error) => return Err(error),
    }
    Ok(None)
}

/// The run's principal and their token for `server` (claiming the run's completed authorization
/// of this call, once).
async fn credential_for(slice: &Slice, server: &McpServer, call: &ToolCallRef) -> Result<Option<McpCredential>, SliceError> {
    let key = slice.env.oauth.key.as_deref();
    let found = mcp_auth::token_for_call(&slice.env.store, slice.lease.run_id, server.name(), &call.id, key).await?;
    Ok(found.map(|found| {
        if let Some(id) = found.claimed {
            tracing::info!(mcp.server = server.name(), authorization.id = %id, "the call claims its completed sign-in");
            metrics::counter!("agentloop_mcp_authorizations_claimed_total").increment(1);
        }
        McpCredential { principal: found.principal, token: found.token }
    }))
}

/// A call refused for want of authorization: discovers the server's authorization server and
/// parks the run in `waiting_authorization` with a sign-in URL (the results before the call in
/// the same transaction). `Ok(Err(reason))`: no sign-in can be offered; `reason` is the call's
/// error result.
async fn authorize(
    slice: &mut Slice,
    results: &mut Results,
    call: &ToolCallRef,
    key: &str,
    challenge: &AuthChallenge,
    server: &McpServer,
    used: Option<String>,
) -> Result<Result<SliceEnd, String>, SliceError> {
    let name = server.name().to_owned();
    let settings = &slice.env.oauth;
    let (Some(secrets), Some(redirect)) = (settings.key.clone(), settings.redirect_url.clone()) else {
        tracing::warn!(mcp.server = %name, "an MCP server asks for a sign-in, but OAUTH_TOKENS_KEY or OAUTH_REDIRECT_URL is not set");
        return Ok(Err(format!("MCP server `{name}` requires the user's sign-in, and sign-in is not configured on this server (OAUTH_TOKENS_KEY, OAUTH_REDIRECT_URL).")));
    };
    let oauth = server.oauth().expect("an oauth server").clone();
    let discovered = match mcp_auth::discover(&settings.client, challenge, server.url().unwrap_or_default(), &oauth.scopes).await {
        Ok(discovered) => discovered,
        Err(error) => {
            tracing::warn!(mcp.server = %name, %error, "MCP authorization discovery failed");
            return Ok(Err(format!("MCP server `{name}` requires the user's sign-in, but its authorization server could not be found: {error}")));
        }
    };
    let sign_in = match mcp_auth::SignIn::new(&discovered, &oauth.client_id, &redirect) {
        Ok(sign_in) => sign_in,
        Err(error) => return Ok(Err(format!("MCP server `{name}` requires the user's sign-in, but: {error}"))),
    };
    // A refused token (revoked, or expired at the server) is discarded in the same transaction.
    let discard = if challenge.had_token { used } else { None };
    let park = mcp_auth::Park {
        sign_in: &sign_in,
        discovered: &discovered,
        server: &name,
        client_id: &oauth.client_id,
        redirect_uri: &redirect,
        tool_call_id: &call.id,
        operation_key: key,
        ttl: settings.ttl,
        discard,
    };
    let commit = Commit { messages: results.take(), end: Some(SliceEnd::WaitingAuthorization), ..Commit::default() };
    let done = slice.park_authorization(commit, &park, &secrets).await?;
    if done.status == agentloop_shared::runs::status::WAITING_AUTHORIZATION {
        tracing::info!(mcp.server = %name, authorization.id = %sign_in.id, revoked = challenge.had_token, "a tool call needs the user's sign-in: the run waits");
        metrics::counter!("agentloop_mcp_authorizations_requested_total").increment(1);
        return Ok(Ok(SliceEnd::WaitingAuthorization));
    }
    // A cancellation requested meanwhile won.
    Ok(Ok(SliceEnd::Cancelled { keep_streamed: false }))
}

/// The span of one tool call, `execute_tool {name}` with the GenAI semantic-convention
/// attributes `gen_ai.operation.name`, `gen_ai.tool.name`, `gen_ai.tool.call.id`; never the
/// arguments or the result.
fn tool_span(call: &ToolCallRef) -> tracing::Span {
    tracing::info_span!(
        "execute_tool",
        otel.name = %format_args!("execute_tool {}", call.name),
        otel.status_code = tracing::field::Empty,
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = %call.name,
        gen_ai.tool.call.id = %call.id,
        error.type = tracing::field::Empty,
    )
}

/// Marks the tool span failed when the call failed (`error.type`: `tool_error` | `uncertain`).
fn traced(span: &tracing::Span, outcome: &ToolOutcome) {
    if outcome.is_error || outcome.uncertain {
        span.record("error.type", if outcome.uncertain { "uncertain" } else { "tool_error" });
        span.record("otel.status_code", "ERROR");
    }
}

fn record(call: &ToolCallRef, outcome: &ToolOutcome, ledger: bool, started: Instant) {
    tracing::info!(tool.name = %call.name, tool.error = outcome.is_error, tool.uncertain = outcome.uncertain, tool.ledger = ledger,
                   duration_ms = started.elapsed().as_millis() as u64, "tool call");
    let label = if outcome.uncertain { "uncertain" } else if outcome.is_error { "error" } else { "ok" };
    metrics::counter!("agentloop_tool_calls_total", "tool" => call.name.clone(), "outcome" => label).increment(1);
    metrics::histogram!("agentloop_tool_call_duration_seconds", "tool" => call.name.clone(), "outcome" => label)
        .record(started.elapsed().as_secs_f64());
}
