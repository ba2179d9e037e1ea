-- Tool approvals (SPEC §3 `tool_approvals`, §6 step 5; seed 000 "Interactive tool approval")
-- and the operations ledger of external effects (SPEC §7; seed 002 "External operations and
-- uncertainty").

-- One row per tool call of an assistant message (the batch) that needed a human decision.
-- Decisions are compare-and-set updates of `status` from 'pending'.
CREATE TABLE tool_approvals (
    id                  uuid PRIMARY KEY,
    run_id              uuid NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    thread_id           uuid NOT NULL REFERENCES threads (id) ON DELETE CASCADE,
    -- Sequence of the assistant message carrying the call (the batch).
    message_sequence    bigint NOT NULL,
    tool_call_id        text NOT NULL,
    tool_name           text NOT NULL,
    -- The model's proposed arguments (a JSON object; the raw text when it was not JSON).
    arguments           jsonb NOT NULL,
    -- The tool's JSON schema when the call was proposed: edited arguments are validated
    -- against it (the api needs no tool configuration).
    parameters          jsonb NOT NULL DEFAULT '{}'::jsonb,
    status              text NOT NULL DEFAULT 'pending'
                        CHECK (status IN ('pending', 'approved', 'rejected', 'expired', 'cancelled')),
    -- Arguments the tool runs with once approved (the proposal, or the user's edit).
    approved_arguments  jsonb,
    arguments_edited    boolean NOT NULL DEFAULT false,
    reason              text,
    decided_by          uuid REFERENCES principals (id) ON DELETE SET NULL,
    -- Undecided at this time (database clock): rejected automatically with reason 'expired'.
    deadline_at         timestamptz NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    decided_at          timestamptz,
    CONSTRAINT tool_approvals_run_call UNIQUE (run_id, tool_call_id)
);
-- The expiry sweep and the worker's deadline timer read only pending rows.
CREATE INDEX tool_approvals_pending_deadline ON tool_approvals (deadline_at) WHERE status = 'pending';
CREATE INDEX tool_approvals_by_thread ON tool_approvals (thread_id, created_at DESC);

-- External effects of non-idempotent tool calls, keyed by the worker's stable caller-supplied
-- key `run:{run_id}:call:{tool_call_id}` (never by attempt).
-- prepared -> dispatched -> completed | failed | uncertain.
CREATE TABLE operations (
    key            text PRIMARY KEY,
    run_id         uuid NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    thread_id      uuid NOT NULL REFERENCES threads (id) ON DELETE CASCADE,
    tool_call_id   text NOT NULL,
    tool_name      text NOT NULL,
    arguments      jsonb NOT NULL,
    status         text NOT NULL CHECK (status IN ('prepared', 'dispatched', 'completed', 'failed', 'uncertain')),
    -- Outcome text (bounded), when known.
    result         text,
    -- An explicit resolve of an uncertain row: 'completed', 'failed' or 'retry'.
    resolution     text CHECK (resolution IN ('completed', 'failed', 'retry')),
    resolved_by    uuid REFERENCES principals (id) ON DELETE SET NULL,
    -- Times the effect left the process.
    dispatches     integer NOT NULL DEFAULT 0,
    -- Fencing token of the attempt that last prepared/dispatched it.
    lease_epoch    bigint NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    dispatched_at  timestamptz,
    finished_at    timestamptz,
    resolved_at    timestamptz
);
CREATE INDEX operations_by_run ON operations (run_id, created_at);
CREATE INDEX operations_open ON operations (run_id) WHERE status IN ('prepared', 'dispatched', 'uncertain');

-- A slice can now end with its run parked on an uncertain operation.
ALTER TABLE run_steps DROP CONSTRAINT run_steps_status_check;
ALTER TABLE run_steps ADD CONSTRAINT run_steps_status_check
    CHECK (status IN ('running', 'completed', 'requeued', 'failed', 'cancelled', 'interrupted',
                      'waiting_approval', 'blocked'));
