-- The durable write path (issue 9, "one fenced commit per step"; docs/architecture.md).
--
-- Every durable step of the protocol is ONE call of ONE function below, sent as one statement
-- in autocommit mode: one transaction, one round trip (the statement is prepared once per
-- connection). Rust computes the step as a value (a jsonb argument); the function applies it.
--
-- Lock order, the same in every function, by construction:
--   1. the thread row (`FOR NO KEY UPDATE`) — the mutex of one conversation;
--   2. its runs (the active run, then pending runs in `seq` order);
--   3. approvals, then operations.
-- The claim and the lease renewal lock single run rows with SKIP LOCKED and never wait, so they
-- cannot close a cycle; the streaming flush locks several thread rows in id order and nothing
-- after them. A command can therefore never wait on a run row that another command holds while
-- that command waits for the thread.
--
-- Fencing: a worker step starts (after the thread lock) with
--   UPDATE runs SET lease_expires_at = now() + lease
--   WHERE id = $run AND lease_owner = $me AND lease_epoch = $mine AND status = 'running'
-- and writes nothing when it matched no row (`{"lost": true}`). Every successful step also
-- extends the lease.
--
-- Unknown commit outcomes: a worker step carries a unique `commitId`; the function records
-- `runs.last_commit = {id, result}` and, when called again with the same id (the caller lost
-- the answer and retries the same value), returns the stored result instead of applying it
-- twice. The check runs after the thread lock, so a retry serialises behind a first attempt
-- that is still executing.
--
-- Wake-ups: each function ends with at most one pg_notify per channel (agentloop_threads:
-- `<thread>:<journal seq>[,...]`; agentloop_runs: `queued:<id>|cancel:<id>|approval:<id>[,...]`),
-- delivered on commit. PostgreSQL serialises notifying commits, not notify calls.
--
-- Business refusals raise SQLSTATE `AL<http status>` with MESSAGE = the stable error code and
-- DETAIL = the human message, so the whole transaction (receipt claim included) rolls back.
-- Timestamps come from the database, never a process clock: `now()` for bookkeeping, and
-- `clock_timestamp()` for the lifecycle stamps of runs and steps (`started_at`, `finished_at`).
-- A PL/pgSQL statement takes a new snapshot, so it can act on a row committed after its own
-- transaction began: `now()` (the transaction's start) would then predate the row's creation
-- (a claim stamping `started_at` before the run's `created_at`).

ALTER TABLE runs ADD COLUMN last_commit jsonb;
-- Consecutive attempts that ended by a fault (lease expiry, transient hand-back) without the run
-- committing progress; reset by every checkpoint that appends history. Bounds poison runs.
ALTER TABLE runs ADD COLUMN faults integer NOT NULL DEFAULT 0;
-- An assistant message committed from the partial answer of a cancelled stream (SPEC §4).
ALTER TABLE messages ADD COLUMN stopped boolean NOT NULL DEFAULT false;

-- Journal rows of one kind per thread are read by the window (streaming reconstruction).
CREATE INDEX thread_events_streaming ON thread_events (thread_id, sequence) WHERE kind = 'streaming';
-- `lease_expires_at` is no longer indexed on its own: every step extends the lease, and an
-- indexed column would make each of those updates a non-HOT update (new entries in every
-- index of `runs`). The recovery timer reads `runs_claimable`, whose running entries are at
-- most the fleet's total concurrency.
DROP INDEX IF EXISTS runs_running_lease;

---------------------------------------------------------------------------------------------
-- JSON views (the shapes clients and the Rust types use; camelCase)
---------------------------------------------------------------------------------------------

CREATE FUNCTION agentloop_run_json(r runs) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'id', r.id, 'threadId', r.thread_id, 'status', r.status, 'commandId', r.command_id,
        'model', r.model, 'maxSteps', r.max_steps, 'stepsUsed', r.steps_used,
        'toolCallsUsed', r.tool_calls_used, 'promptTokens', r.prompt_tokens,
        'completionTokens', r.completion_tokens, 'contextTokens', r.context_tokens,
        'contextLimit', r.context_limit, 'leaseOwner', r.lease_owner, 'leaseEpoch', r.lease_epoch,
        'leaseExpiresAt', r.lease_expires_at, 'attempts', r.attempts, 'recoveries', r.recoveries,
        'faults', r.faults, 'errorCode', r.error_code, 'errorMessage', r.error_message,
        'cancelRequestedAt', r.cancel_requested_at, 'createdAt', r.created_at,
        'queuedAt', r.queued_at, 'startedAt', r.started_at, 'finishedAt', r.finished_at,
        'updatedAt', r.updated_at, 'input', r.input, 'kind', r.kind,
        'sourceThreadId', r.source_thread_id)
    || CASE WHEN r.error_code IS NULL THEN '{}'::jsonb
            ELSE jsonb_build_object('error', jsonb_build_object('code', r.error_code,
                                                                 'message', coalesce(r.error_message, '')))
       END
$$;

CREATE FUNCTION agentloop_message_json(m messages) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'sequence', m.sequence, 'timestamp', m.timestamp_ms, 'role', m.role, 'content', m.content,
        'runId', m.run_id, 'stepId', m.step_id, 'tokenEstimate', m.token_estimate,
        'active', m.active, 'createdAt', m.created_at)
    || CASE WHEN m.tool_calls IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('toolCalls', m.tool_calls) END
    || CASE WHEN m.tool_call_id IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('toolCallId', m.tool_call_id) END
    || CASE WHEN m.reasoning IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('reasoning', m.reasoning) END
    || CASE WHEN m.stopped THEN '{"stopped": true}'::jsonb ELSE '{}'::jsonb END
$$;

CREATE FUNCTION agentloop_thread_json(t threads) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'id', t.id, 'title', t.title, 'model', t.model, 'metadata', t.metadata,
        'parentThreadId', t.parent_thread_id, 'messageCount', t.message_count,
        'lastSequence', t.last_sequence, 'lastEventSequence', t.last_event_sequence,
        'contextTokens', t.context_tokens, 'createdAt', t.created_at, 'updatedAt', t.updated_at)
$$;

CREATE FUNCTION agentloop_approval_json(a tool_approvals) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'id', a.id, 'runId', a.run_id, 'threadId', a.thread_id, 'messageSequence', a.message_sequence,
        'toolCallId', a.tool_call_id, 'toolName', a.tool_name, 'arguments', a.arguments,
        'parameters', a.parameters, 'status', a.status, 'approvedArguments', a.approved_arguments,
        'argumentsEdited', a.arguments_edited, 'reason', a.reason, 'deadlineAt', a.deadline_at,
        'createdAt', a.created_at, 'decidedAt', a.decided_at)
$$;

CREATE FUNCTION agentloop_operation_json(o operations) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'key', o.key, 'runId', o.run_id, 'threadId', o.thread_id, 'toolCallId', o.tool_call_id,
        'toolName', o.tool_name, 'arguments', o.arguments, 'status', o.status, 'result', o.result,
        'resolution', o.resolution, 'dispatches', o.dispatches, 'leaseEpoch', o.lease_epoch,
        'createdAt', o.created_at, 'updatedAt', o.updated_at, 'dispatchedAt', o.dispatched_at,
        'finishedAt', o.finished_at, 'resolvedAt', o.resolved_at)
$$;

---------------------------------------------------------------------------------------------
-- Building blocks (called only from the step functions below, inside their transaction)
---------------------------------------------------------------------------------------------

-- Refuses a command: raises SQLSTATE AL<status>, MESSAGE = code, DETAIL = message.
CREATE FUNCTION agentloop_refuse(p_status int, p_code text, p_message text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'AL' || p_status::text, MESSAGE = p_code, DETAIL = p_message;
END $$;

-- Appends one event to the thread's journal with the next gap-free sequence.
CREATE FUNCTION agentloop_journal(p_thread uuid, p_kind text, p_payload jsonb) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_seq bigint;
BEGIN
    UPDATE threads SET last_event_sequence = last_event_sequence + 1
     WHERE id = p_thread RETURNING last_event_sequence INTO v_seq;
    INSERT INTO thread_events (thread_id, sequence, kind, payload) VALUES (p_thread, v_seq, p_kind, p_payload);
    RETURN v_seq;
END $$;

-- Records a scheduler wake-up (`queued:<id>`, `cancel:<id>`, `approval:<id>`) sent by
-- agentloop_notify at the end of the transaction.
CREATE FUNCTION agentloop_wake(p_entry text) RETURNS void LANGUAGE sql AS $$
    SELECT set_config('agentloop.wake',
                      concat_ws(',', nullif(current_setting('agentloop.wake', true), ''), p_entry), true);
$$;

-- The end of every step: one notification per channel (payloads split below 8000 bytes).
CREATE FUNCTION agentloop_notify(p_threads uuid[]) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_entry text;
    v_payload text := '';
    v_wake text := nullif(current_setting('agentloop.wake', true), '');
BEGIN
    FOR v_entry IN SELECT id::text || ':' || last_event_sequence::text FROM threads
                    WHERE id = ANY(p_threads) AND last_event_sequence > 0 ORDER BY id LOOP
        IF octet_length(v_payload) + octet_length(v_entry) > 7900 THEN
            PERFORM pg_notify('agentloop_threads', v_payload);
            v_payload := '';
        END IF;
        v_payload := CASE WHEN v_payload = '' THEN v_entry ELSE v_payload || ',' || v_entry END;
    END LOOP;
    IF v_payload <> '' THEN
        PERFORM pg_notify('agentloop_threads', v_payload);
    END IF;
    IF v_wake IS NOT NULL THEN
        PERFORM pg_notify('agentloop_runs', left(v_wake, 7900));
        PERFORM set_config('agentloop.wake', '', true);
    END IF;
END $$;

-- Locks the thread (lock order step 1). With p_owner: only the owner's live thread, else 404.
CREATE FUNCTION agentloop_lock_thread(p_thread uuid, p_owner uuid) RETURNS threads
LANGUAGE plpgsql AS $$
DECLARE
    t threads;
BEGIN
    SELECT * INTO t FROM threads
     WHERE id = p_thread AND (p_owner IS NULL OR (owner_id = p_owner AND deleted_at IS NULL))
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        PERFORM agentloop_refuse(404, 'not_found', 'not found');
    END IF;
    RETURN t;
END $$;

-- Appends messages (jsonb array of {role, content, toolCalls?, toolCallId?, reasoning?,
-- tokenEstimate, byteSize, stopped?}) to the thread's active history in order: gap-free
-- sequences and monotonic timestamp identities max(now_ms, last + 1), provenance (run, step),
-- one `message` journal event per row. Returns the rows' JSON. The thread is locked.
CREATE FUNCTION agentloop_append(p_thread uuid, p_run uuid, p_step bigint, p_messages jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    k int := coalesce(jsonb_array_length(p_messages), 0);
    v_seq bigint;
    v_ts bigint;
    v_ev bigint;
    v_out jsonb;
BEGIN
    IF k = 0 THEN
        RETURN '[]'::jsonb;
    END IF;
    -- One update allocates k message sequences, k timestamp identities and k journal sequences.
    UPDATE threads SET last_sequence = last_sequence + k,
                       message_count = message_count + k,
                       last_timestamp_ms = GREATEST(last_timestamp_ms + k,
                           (extract(epoch FROM clock_timestamp()) * 1000)::bigint + k - 1),
                       last_event_sequence = last_event_sequence + k,
                       updated_at = now()
     WHERE id = p_thread RETURNING last_sequence, last_timestamp_ms, last_event_sequence INTO v_seq, v_ts, v_ev;
    WITH ins AS (
        INSERT INTO messages (thread_id, sequence, timestamp_ms, role, content, tool_calls,
                              tool_call_id, reasoning, run_id, step_id, token_estimate, byte_size, stopped)
        SELECT p_thread, v_seq - k + e.ord, v_ts - k + e.ord, e.m ->> 'role',
               coalesce(e.m -> 'content', '""'::jsonb), nullif(e.m -> 'toolCalls', 'null'::jsonb),
               e.m ->> 'toolCallId', e.m ->> 'reasoning', p_run, p_step,
               coalesce((e.m ->> 'tokenEstimate')::int, 0),
               coalesce((e.m ->> 'byteSize')::int, octet_length((e.m -> 'content')::text)),
               coalesce((e.m ->> 'stopped')::boolean, false)
          FROM jsonb_array_elements(p_messages) WITH ORDINALITY AS e(m, ord)
        RETURNING *
    ), events AS (
        INSERT INTO thread_events (thread_id, sequence, kind, payload)
        SELECT p_thread, v_ev - v_seq + ins.sequence, 'message', agentloop_message_json(ins::messages) FROM ins
        RETURNING payload
    )
    SELECT jsonb_agg(payload ORDER BY (payload ->> 'sequence')::bigint) INTO v_out FROM events;
    RETURN v_out;
END $$;

-- The run's last active assistant tool-call message and the ids of its calls that have a result:
-- {message, answered}; NULL when the run made no call.
CREATE FUNCTION agentloop_open_calls(p_thread uuid, p_run uuid) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    c messages;
BEGIN
    SELECT * INTO c FROM messages
     WHERE run_id = p_run AND active AND role = 'assistant' AND tool_calls IS NOT NULL
     ORDER BY sequence DESC LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN jsonb_build_object(
        'message', agentloop_message_json(c),
        'answered', (SELECT coalesce(jsonb_agg(m.tool_call_id ORDER BY m.sequence), '[]'::jsonb)
                       FROM messages m
                      WHERE m.thread_id = p_thread AND m.active AND m.sequence > c.sequence
                        AND m.role = 'tool' AND m.tool_call_id IS NOT NULL));
END $$;

-- Gives every unanswered call of the run's last tool-call message a synthetic "cancelled"
-- result, so history stays valid for every provider (SPEC §4 interrupt, seed 000).
CREATE FUNCTION agentloop_close_dangling(p_thread uuid, p_run uuid) RETURNS int LANGUAGE plpgsql AS $$
DECLARE
    v_open jsonb := agentloop_open_calls(p_thread, p_run);
    v_missing jsonb;
BEGIN
    IF v_open IS NULL THEN
        RETURN 0;
    END IF;
    -- A call whose operation may have taken effect says so: never "cancelled" for an effect
    -- that may have happened.
    SELECT coalesce(jsonb_agg(jsonb_build_object(
               'role', 'tool',
               'content', to_jsonb(CASE WHEN o.status IN ('dispatched', 'uncertain')
                   THEN '[outcome unknown: this call may have taken effect; the run ended before its outcome was resolved]'
                   ELSE '[cancelled: the run ended before this tool call produced a result]' END),
               'toolCallId', x.call ->> 'id', 'tokenEstimate', 20, 'byteSize', 100) ORDER BY x.ord), '[]'::jsonb)
      INTO v_missing
      FROM jsonb_array_elements(v_open -> 'message' -> 'toolCalls') WITH ORDINALITY AS x(call, ord)
      LEFT JOIN operations o ON o.run_id = p_run AND o.tool_call_id = x.call ->> 'id'
     WHERE x.call ->> 'id' IS NOT NULL AND NOT (v_open -> 'answered') ? (x.call ->> 'id');
    PERFORM agentloop_append(p_thread, p_run, (v_open -> 'message' ->> 'stepId')::bigint, v_missing);
    RETURN jsonb_array_length(v_missing);
END $$;

-- Promotes the thread's oldest pending run to queued (FIFO, SPEC §4): its user turn enters
-- history now, a `run` event and a `queued:` wake-up follow. The thread is locked.
CREATE FUNCTION agentloop_promote(p_thread uuid) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    r runs;
BEGIN
    SELECT * INTO r FROM runs WHERE thread_id = p_thread AND status = 'pending' ORDER BY seq LIMIT 1 FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE runs SET status = 'queued', queued_at = now(), updated_at = now() WHERE id = r.id RETURNING * INTO r;
    IF r.input IS NOT NULL THEN
        PERFORM agentloop_append(p_thread, r.id, NULL, jsonb_build_array(jsonb_build_object(
            'role', 'user', 'content', r.input -> 'content', 'tokenEstimate', r.input -> 'tokenEstimate',
            'byteSize', r.input -> 'byteSize')));
    END IF;
    PERFORM agentloop_journal(p_thread, 'run', agentloop_run_json(r));
    PERFORM agentloop_wake('queued:' || r.id);
END $$;

-- Cancellation of one run (SPEC §5): pending/queued/waiting_approval/blocked end `cancelled` at
-- once (pending approvals cancelled, dangling calls closed, the next pending run promoted when
-- this one was active); a running run gets `cancel_requested_at` and a `cancel:` wake-up for its
-- worker; a terminal run is left alone. The thread and the run are locked by the caller.
CREATE FUNCTION agentloop_cancel(p_run uuid) RETURNS runs LANGUAGE plpgsql AS $$
DECLARE
    r runs;
    a tool_approvals;
    v_active boolean;
BEGIN
    SELECT * INTO r FROM runs WHERE id = p_run FOR UPDATE;
    IF r.status IN ('pending', 'queued', 'waiting_approval', 'blocked') THEN
        v_active := r.status <> 'pending';
        UPDATE runs SET status = 'cancelled', cancel_requested_at = coalesce(cancel_requested_at, now()),
                        finished_at = clock_timestamp(), lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
         WHERE id = p_run RETURNING * INTO r;
        FOR a IN UPDATE tool_approvals SET status = 'cancelled', decided_at = now()
                  WHERE run_id = p_run AND status = 'pending' RETURNING * LOOP
            PERFORM agentloop_journal(r.thread_id, 'approval', agentloop_approval_json(a));
        END LOOP;
        PERFORM agentloop_close_dangling(r.thread_id, p_run);
        PERFORM agentloop_journal(r.thread_id, 'run', agentloop_run_json(r));
        IF v_active THEN
            PERFORM agentloop_promote(r.thread_id);
        END IF;
    ELSIF r.status = 'running' AND r.cancel_requested_at IS NULL THEN
        UPDATE runs SET cancel_requested_at = now(), updated_at = now() WHERE id = p_run RETURNING * INTO r;
        PERFORM agentloop_journal(r.thread_id, 'run', agentloop_run_json(r));
        PERFORM agentloop_wake('cancel:' || p_run);
    END IF;
    RETURN r;
END $$;

-- Text a declined call gets (what the model reads).
CREATE FUNCTION agentloop_declined(p_reason text) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN nullif(btrim(p_reason), '') IS NULL THEN 'Tool call declined by the user.'
                ELSE 'Tool call declined by the user. Reason: ' || btrim(p_reason) END
$$;

-- Ends a run's approval wait when none of its approvals is pending any more: the declined calls
-- get their results and the SAME run goes back to `queued` (seed 000). Run and thread locked.
CREATE FUNCTION agentloop_finish_batch(p_run uuid) RETURNS runs LANGUAGE plpgsql AS $$
DECLARE
    r runs;
    v_open jsonb;
    v_results jsonb;
BEGIN
    SELECT * INTO r FROM runs WHERE id = p_run;
    IF r.status <> 'waiting_approval'
       OR EXISTS (SELECT 1 FROM tool_approvals WHERE run_id = p_run AND status = 'pending') THEN
        RETURN r;
    END IF;
    v_open := agentloop_open_calls(r.thread_id, p_run);
    IF v_open IS NOT NULL THEN
        SELECT coalesce(jsonb_agg(jsonb_build_object(
                   'role', 'tool', 'content', to_jsonb(CASE WHEN a.status = 'expired'
                       THEN 'Tool call not run: nobody approved it before its approval expired.'
                       ELSE agentloop_declined(a.reason) END),
                   'toolCallId', a.tool_call_id, 'tokenEstimate', 12 + length(coalesce(a.reason, '')) / 4,
                   'byteSize', 40 + octet_length(coalesce(a.reason, ''))) ORDER BY x.ord), '[]'::jsonb)
          INTO v_results
          FROM jsonb_array_elements(v_open -> 'message' -> 'toolCalls') WITH ORDINALITY AS x(call, ord)
          JOIN tool_approvals a ON a.run_id = p_run AND a.tool_call_id = x.call ->> 'id'
         WHERE a.status IN ('rejected', 'expired') AND NOT (v_open -> 'answered') ? (x.call ->> 'id');
        PERFORM agentloop_append(r.thread_id, p_run, (v_open -> 'message' ->> 'stepId')::bigint, v_results);
    END IF;
    UPDATE runs SET status = 'queued', queued_at = now(), updated_at = now() WHERE id = p_run RETURNING * INTO r;
    PERFORM agentloop_journal(r.thread_id, 'run', agentloop_run_json(r));
    PERFORM agentloop_wake('queued:' || p_run);
    RETURN r;
END $$;

-- The `run.error.message` of a run blocked on uncertain operations.
CREATE FUNCTION agentloop_blocker_message(p_run uuid) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT 'the outcome of ' || string_agg(tool_name || ' (' || key || ')', ', ' ORDER BY created_at)
           || ' is unknown (the call may have taken effect); resolve it as completed, failed or retry'
      FROM operations WHERE run_id = p_run AND status = 'uncertain'
$$;

-- The model context of a thread (SPEC §6 step 2): without a live snapshot every active row;
-- with one, the system/developer rows before its coverage (`instructions`), its summary and the
-- active rows after it. `tokens` = sum of max(token_estimate, 1) + the summary's estimate.
CREATE FUNCTION agentloop_context(p_thread uuid) RETURNS jsonb LANGUAGE plpgsql STABLE AS $$
DECLARE
    s context_snapshots;
    v_instructions jsonb := '[]'::jsonb;
    v_messages jsonb;
    v_tokens bigint;
    v_itokens bigint := 0;
BEGIN
    SELECT * INTO s FROM context_snapshots
     WHERE thread_id = p_thread AND superseded_at IS NULL ORDER BY version DESC LIMIT 1;
    IF NOT FOUND THEN
        SELECT coalesce(jsonb_agg(agentloop_message_json(m) ORDER BY m.sequence), '[]'::jsonb),
               coalesce(sum(greatest(m.token_estimate, 1)), 0)
          INTO v_messages, v_tokens
          FROM messages m WHERE m.thread_id = p_thread AND m.active;
        RETURN jsonb_build_object('snapshot', NULL, 'instructions', '[]'::jsonb, 'messages', v_messages,
                                  'tokens', v_tokens);
    END IF;
    SELECT coalesce(jsonb_agg(agentloop_message_json(m) ORDER BY m.sequence), '[]'::jsonb),
           coalesce(sum(greatest(m.token_estimate, 1)), 0)
      INTO v_instructions, v_itokens
      FROM messages m
     WHERE m.thread_id = p_thread AND m.active AND m.sequence < s.from_sequence
       AND m.role IN ('system', 'developer');
    SELECT coalesce(jsonb_agg(agentloop_message_json(m) ORDER BY m.sequence), '[]'::jsonb),
           coalesce(sum(greatest(m.token_estimate, 1)), 0)
      INTO v_messages, v_tokens
      FROM messages m WHERE m.thread_id = p_thread AND m.active AND m.sequence > s.to_sequence;
    RETURN jsonb_build_object(
        'snapshot', jsonb_build_object('version', s.version, 'summary', s.summary,
                                       'fromSequence', s.from_sequence, 'toSequence', s.to_sequence,
                                       'tokenEstimate', s.token_estimate),
        'instructions', v_instructions, 'messages', v_messages,
        'tokens', v_tokens + v_itokens + greatest(s.token_estimate, 1));
END $$;

-- The longest prefix of s that is at most `units` UTF-16 code units long (what JavaScript's
-- `slice(0, units)` keeps): the streaming offsets count UTF-16 units.
CREATE FUNCTION agentloop_utf16_prefix(s text, units int) RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    i int := 0;
    n int := 0;
    c text;
BEGIN
    IF s !~ '[\U00010000-\U0010FFFF]' THEN
        RETURN left(s, units);
    END IF;
    FOR c IN SELECT x FROM regexp_split_to_table(s, '') AS x LOOP
        n := n + CASE WHEN c ~ '[\U00010000-\U0010FFFF]' THEN 2 ELSE 1 END;
        EXIT WHEN n > units;
        i := i + 1;
    END LOOP;
    RETURN left(s, i);
END $$;

-- The partial answer of run p_run as the database holds it: the thread's streaming snapshot
-- plus the run's `streaming` deltas journaled after it. {content, reasoning}, or NULL.
CREATE FUNCTION agentloop_partial(p_thread uuid, p_run uuid) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads;
    v_content text;
    v_reasoning text;
    e jsonb;
BEGIN
    SELECT * INTO t FROM threads WHERE id = p_thread;
    IF t.streaming_message IS NULL OR t.streaming_message ->> 'runId' IS DISTINCT FROM p_run::text THEN
        RETURN NULL;
    END IF;
    v_content := coalesce(t.streaming_message ->> 'content', '');
    v_reasoning := coalesce(t.streaming_message ->> 'reasoning', '');
    FOR e IN SELECT payload FROM thread_events
              WHERE thread_id = p_thread AND kind = 'streaming'
                AND sequence > coalesce((t.streaming_message ->> 'eventSequence')::bigint, 0)
              ORDER BY sequence LOOP
        CONTINUE WHEN e ->> 'runId' IS DISTINCT FROM p_run::text;
        IF e ->> 'offset' IS NOT NULL THEN
            v_content := agentloop_utf16_prefix(v_content, (e ->> 'offset')::int) || coalesce(e ->> 'delta', '');
        END IF;
        IF e ->> 'reasoningOffset' IS NOT NULL THEN
            v_reasoning := agentloop_utf16_prefix(v_reasoning, (e ->> 'reasoningOffset')::int) || coalesce(e ->> 'reasoningDelta', '');
        END IF;
    END LOOP;
    RETURN jsonb_build_object('content', v_content, 'reasoning', v_reasoning);
END $$;

-- The end of a slice (SPEC §5 "Slice end"): step outcome and usage, run transition, lease
-- released, streaming partial cleared, and for terminal ends the dangling calls closed, pending
-- approvals cancelled and the next pending run promoted. `p_end.status` is one of completed,
-- requeued (tool-call limit), interrupted (shutdown), handback (transient fault), failed,
-- cancelled, waiting_approval, blocked; `code`/`message` for failed. An end that stops the
-- run's work early first turns its `dispatched` operations `uncertain`; if any operation is
-- uncertain the run ends `blocked` instead (SPEC §7). A waiting_approval end yields to a
-- requested cancellation. `p_usage` ({modelCalls, toolCalls, promptTokens, completionTokens,
-- progress}) is added to step and run in the same updates; `p_last_commit` ({id, result}) is
-- recorded with the run's `status` added to the result. Thread and run are locked by the caller.
CREATE FUNCTION agentloop_end_run(p_run uuid, p_step bigint, p_end jsonb, p_usage jsonb DEFAULT '{}',
                                  p_last_commit jsonb DEFAULT NULL) RETURNS runs LANGUAGE plpgsql AS $$
DECLARE
    r runs;
    v_end text := p_end ->> 'status';
    v_status text;
    v_step_status text;
    v_code text := p_end ->> 'code';
    v_message text := p_end ->> 'message';
    v_steps int := CASE WHEN p_step IS NULL THEN 0 ELSE 1 END;
    v_faults int := 0;
    a tool_approvals;
    v_partial jsonb;
BEGIN
    SELECT * INTO r FROM runs WHERE id = p_run;
    IF v_end = 'waiting_approval' AND r.cancel_requested_at IS NOT NULL THEN
        v_end := 'cancelled';
    END IF;
    IF v_end IN ('cancelled', 'interrupted', 'handback', 'failed', 'blocked') THEN
        UPDATE operations SET status = 'uncertain', updated_at = now() WHERE run_id = p_run AND status = 'dispatched';
        IF EXISTS (SELECT 1 FROM operations WHERE run_id = p_run AND status = 'uncertain') THEN
            v_end := 'blocked';
            v_code := 'operation_uncertain';
            v_message := agentloop_blocker_message(p_run);
        END IF;
    END IF;
    CASE v_end
        WHEN 'completed' THEN v_status := 'completed'; v_step_status := 'completed';
        WHEN 'requeued' THEN v_status := 'queued'; v_step_status := 'requeued';
        WHEN 'interrupted' THEN v_status := 'queued'; v_step_status := 'interrupted'; v_steps := 0;
        WHEN 'handback' THEN v_status := 'queued'; v_step_status := 'interrupted'; v_steps := 0; v_faults := 1;
        WHEN 'failed' THEN v_status := 'failed'; v_step_status := 'failed';
        WHEN 'cancelled' THEN v_status := 'cancelled'; v_step_status := 'cancelled';
        WHEN 'waiting_approval' THEN v_status := 'waiting_approval'; v_step_status := 'waiting_approval';
        WHEN 'blocked' THEN v_status := 'blocked'; v_step_status := 'blocked';
            v_code := coalesce(v_code, 'operation_uncertain');
            v_message := coalesce(v_message, agentloop_blocker_message(p_run));
        ELSE RAISE EXCEPTION 'unknown slice end %', v_end;
    END CASE;
    IF v_status NOT IN ('failed', 'blocked') THEN
        v_code := NULL;
        v_message := NULL;
    END IF;
    IF p_step IS NOT NULL THEN
        UPDATE run_steps SET status = v_step_status, finished_at = clock_timestamp(), error_code = v_code, error_message = v_message,
                             model_calls = model_calls + coalesce((p_usage ->> 'modelCalls')::int, 0),
                             tool_calls = tool_calls + coalesce((p_usage ->> 'toolCalls')::int, 0),
                             prompt_tokens = prompt_tokens + coalesce((p_usage ->> 'promptTokens')::bigint, 0),
                             completion_tokens = completion_tokens + coalesce((p_usage ->> 'completionTokens')::bigint, 0)
         WHERE id = p_step;
    END IF;
    UPDATE runs SET status = v_status,
                    steps_used = steps_used + v_steps,
                    faults = CASE WHEN (p_usage ->> 'progress')::boolean THEN 0 ELSE faults END + v_faults,
                    tool_calls_used = tool_calls_used + coalesce((p_usage ->> 'toolCalls')::int, 0),
                    prompt_tokens = prompt_tokens + coalesce((p_usage ->> 'promptTokens')::bigint, 0),
                    completion_tokens = completion_tokens + coalesce((p_usage ->> 'completionTokens')::bigint, 0),
                    last_commit = CASE WHEN p_last_commit IS NULL THEN last_commit
                                       ELSE jsonb_set(p_last_commit, '{result,status}', to_jsonb(v_status)) END,
                    lease_owner = NULL, lease_expires_at = NULL,
                    error_code = v_code, error_message = v_message,
                    finished_at = CASE WHEN v_status IN ('completed', 'failed', 'cancelled') THEN clock_timestamp() END,
                    queued_at = CASE WHEN v_status = 'queued' THEN now() ELSE queued_at END,
                    updated_at = now()
     WHERE id = p_run RETURNING * INTO r;
    IF v_status = 'cancelled' AND coalesce((p_end ->> 'keepStreamed')::boolean, false) THEN
        -- SPEC §4: a cancelled stream's partial answer is kept, marked stopped, even when the
        -- worker that streamed it is gone.
        v_partial := agentloop_partial(r.thread_id, p_run);
        IF v_partial ->> 'content' <> '' OR v_partial ->> 'reasoning' <> '' THEN
            PERFORM agentloop_append(r.thread_id, p_run, p_step, jsonb_build_array(jsonb_build_object(
                'role', 'assistant', 'content', to_jsonb(v_partial ->> 'content'),
                'reasoning', nullif(v_partial ->> 'reasoning', ''), 'stopped', true,
                'tokenEstimate', 1 + length(v_partial ->> 'content') / 4,
                'byteSize', octet_length(v_partial ->> 'content') + octet_length(v_partial ->> 'reasoning') + 2)));
        END IF;
    END IF;
    UPDATE threads SET streaming_message = NULL WHERE id = r.thread_id AND streaming_message IS NOT NULL;
    IF v_status IN ('completed', 'failed', 'cancelled') THEN
        PERFORM agentloop_close_dangling(r.thread_id, p_run);
        IF v_status <> 'completed' THEN
            FOR a IN UPDATE tool_approvals SET status = 'cancelled', decided_at = now()
                      WHERE run_id = p_run AND status = 'pending' RETURNING * LOOP
                PERFORM agentloop_journal(r.thread_id, 'approval', agentloop_approval_json(a));
            END LOOP;
        END IF;
    END IF;
    PERFORM agentloop_journal(r.thread_id, 'run', agentloop_run_json(r));
    IF v_status IN ('completed', 'failed', 'cancelled') THEN
        PERFORM agentloop_promote(r.thread_id);
    ELSIF v_status = 'queued' THEN
        PERFORM agentloop_wake('queued:' || p_run);
    ELSIF v_status = 'waiting_approval' THEN
        PERFORM agentloop_wake('approval:' || p_run);
    END IF;
    RETURN r;
END $$;

-- Fence (lock order: the caller locked the thread): locks the run row if this worker's lease
-- still holds it and returns it; NULL fields when the lease is gone. It writes no row version:
-- the step's one final update of the run extends the lease.
CREATE FUNCTION agentloop_fence(p jsonb) RETURNS runs LANGUAGE plpgsql AS $$
DECLARE
    r runs;
BEGIN
    SELECT * INTO r FROM runs
     WHERE id = (p ->> 'runId')::uuid AND lease_owner = p ->> 'owner'
       AND lease_epoch = (p ->> 'epoch')::bigint AND status = 'running'
       FOR NO KEY UPDATE;
    RETURN r;
END $$;

---------------------------------------------------------------------------------------------
-- Worker steps
---------------------------------------------------------------------------------------------

-- Claim (SPEC §5): with `p.adopt` (after a claim whose answer was lost) first re-adopts runs
-- this worker holds but is not executing (`p.inflight` lists the runs it executes), then claims up to `p.limit` minus
-- those: `queued` runs and `running` runs whose lease expired, in `seq` order, SKIP LOCKED. Each
-- claimed row gets lease_epoch + 1 (the fencing token), attempts + 1 and, when recovered,
-- recoveries + 1 and faults + 1. Returns {runs, nextExpiryMs (earliest lease expiry of runs
-- other workers hold, ms from now), queuedLeft (a queued run was skipped while locked)}.
CREATE FUNCTION agentloop_claim(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_owner text := p ->> 'owner';
    v_lease interval := make_interval(secs => (p ->> 'leaseMs')::bigint / 1000.0);
    v_inflight uuid[] := coalesce((SELECT array_agg(x::uuid) FROM jsonb_array_elements_text(p -> 'inflight') x), '{}');
    v_adopted jsonb;
    v_claimed jsonb;
    v_n int;
BEGIN
    IF coalesce((p ->> 'adopt')::boolean, false) THEN
        WITH a AS (
            UPDATE runs r SET lease_expires_at = now() + v_lease
             WHERE r.status = 'running' AND r.lease_owner = v_owner AND r.lease_expires_at > now()
               AND NOT (r.id = ANY(v_inflight))
            RETURNING r.seq, agentloop_run_json(r) AS j
        )
        SELECT coalesce(jsonb_agg(j ORDER BY seq), '[]'::jsonb) INTO v_adopted FROM a;
    ELSE
        v_adopted := '[]'::jsonb;
    END IF;
    v_n := greatest((p ->> 'limit')::int - jsonb_array_length(v_adopted), 0);
    WITH c AS (
        SELECT id FROM runs
         WHERE status IN ('queued', 'running') AND (status = 'queued' OR lease_expires_at < now())
         ORDER BY seq LIMIT v_n
           FOR UPDATE SKIP LOCKED
    ), u AS (
        UPDATE runs r SET status = 'running', lease_owner = v_owner, lease_epoch = r.lease_epoch + 1,
                          attempts = r.attempts + 1,
                          recoveries = r.recoveries + (r.status = 'running')::int,
                          faults = r.faults + (r.status = 'running')::int,
                          lease_expires_at = now() + v_lease,
                          started_at = coalesce(r.started_at, clock_timestamp()), updated_at = now()
          FROM c WHERE r.id = c.id
        RETURNING r.seq, agentloop_run_json(r) AS j
    )
    SELECT coalesce(jsonb_agg(j ORDER BY seq), '[]'::jsonb) INTO v_claimed FROM u;
    IF jsonb_array_length(v_claimed) = v_n AND v_n > 0 THEN
        -- Every slot filled: the caller claims again when a slot frees; no timer needed.
        RETURN jsonb_build_object('runs', v_adopted || v_claimed, 'nextExpiryMs', NULL, 'queuedLeft', false);
    END IF;
    RETURN jsonb_build_object(
        'runs', v_adopted || v_claimed,
        'nextExpiryMs', (SELECT (extract(epoch FROM (min(lease_expires_at) - now())) * 1000)::bigint
                           FROM runs WHERE status IN ('queued', 'running') AND status = 'running'
                            AND lease_owner IS DISTINCT FROM v_owner),
        'queuedLeft', EXISTS (SELECT 1 FROM runs WHERE status IN ('queued', 'running') AND status = 'queued'));
END $$;

-- Lease renewal of every run a worker executes, in one statement (SPEC §5 "Lease"): per run
-- `ok`, `cancel` (renewed; cancellation requested), `busy` (its row is locked right now —
-- normally by this worker's own step, which extends the lease itself; never waited for) or
-- `lost`. p = {owner, leaseMs, runs: [{runId, epoch}]}.
CREATE FUNCTION agentloop_renew(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_owner text := p ->> 'owner';
    v_lease interval := make_interval(secs => (p ->> 'leaseMs')::bigint / 1000.0);
    w record;
    v_cancel boolean;
    v_out jsonb := '{}'::jsonb;
BEGIN
    FOR w IN SELECT (e ->> 'runId')::uuid AS id, (e ->> 'epoch')::bigint AS epoch
               FROM jsonb_array_elements(p -> 'runs') e LOOP
        PERFORM 1 FROM runs WHERE id = w.id AND lease_owner = v_owner AND lease_epoch = w.epoch
                              AND status = 'running' FOR UPDATE SKIP LOCKED;
        IF FOUND THEN
            UPDATE runs SET lease_expires_at = now() + v_lease WHERE id = w.id
            RETURNING cancel_requested_at IS NOT NULL INTO v_cancel;
            v_out := v_out || jsonb_build_object(w.id::text, CASE WHEN v_cancel THEN 'cancel' ELSE 'ok' END);
        ELSIF EXISTS (SELECT 1 FROM runs WHERE id = w.id AND lease_owner = v_owner AND lease_epoch = w.epoch
                                           AND status = 'running') THEN
            v_out := v_out || jsonb_build_object(w.id::text, 'busy');
        ELSE
            v_out := v_out || jsonb_build_object(w.id::text, 'lost');
        END IF;
    END LOOP;
    RETURN v_out;
END $$;

-- Slice start (SPEC §6 steps 1-2), fenced: creates (or after a recovery re-opens) the step row
-- `run:{run}:step:{n}`; operations a dead attempt left `dispatched` become `uncertain` and block
-- the run; otherwise loads the model context, records its size on step, run and thread, and
-- returns what the slice needs: {step, run, metadata, context, open (unanswered calls of the
-- run's last tool-call message), approvals, operations}. `{lost: true}` without the lease;
-- `{ended: "blocked", run}` when blocked. p = {runId, threadId, owner, epoch, leaseMs,
-- stepSequence, model, toolTokens, contextLimit}.
CREATE FUNCTION agentloop_slice_start(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_run uuid := (p ->> 'runId')::uuid;
    v_thread uuid := (p ->> 'threadId')::uuid;
    t threads;
    r runs;
    s run_steps;
    v_context jsonb;
    v_tokens int;
    v_open jsonb;
    v_seq bigint;
BEGIN
    SELECT * INTO t FROM threads WHERE id = v_thread FOR NO KEY UPDATE;
    r := agentloop_fence(p);
    IF r.id IS NULL THEN
        RETURN '{"lost": true}'::jsonb;
    END IF;
    UPDATE operations SET status = 'uncertain', updated_at = now() WHERE run_id = v_run AND status = 'dispatched';
    IF EXISTS (SELECT 1 FROM operations WHERE run_id = v_run AND status = 'uncertain') THEN
        INSERT INTO run_steps (run_id, sequence, idempotency_key, status, attempt, lease_epoch, worker_id, model)
        VALUES (v_run, (p ->> 'stepSequence')::int, 'run:' || v_run || ':step:' || (p ->> 'stepSequence'),
                'running', r.attempts, r.lease_epoch, r.lease_owner, p ->> 'model')
        ON CONFLICT (idempotency_key) DO UPDATE SET status = 'running', attempt = EXCLUDED.attempt
        RETURNING * INTO s;
        r := agentloop_end_run(v_run, s.id, '{"status": "blocked"}'::jsonb);
        PERFORM agentloop_notify(ARRAY[v_thread]);
        RETURN jsonb_build_object('ended', 'blocked', 'run', agentloop_run_json(r));
    END IF;
    v_context := agentloop_context(v_thread);
    v_tokens := least((v_context ->> 'tokens')::bigint + coalesce((p ->> 'toolTokens')::bigint, 0), 2147483647)::int;
    INSERT INTO run_steps (run_id, sequence, idempotency_key, status, attempt, lease_epoch, worker_id, model, context_tokens)
    VALUES (v_run, (p ->> 'stepSequence')::int, 'run:' || v_run || ':step:' || (p ->> 'stepSequence'),
            'running', r.attempts, r.lease_epoch, r.lease_owner, p ->> 'model', v_tokens)
    ON CONFLICT (idempotency_key) DO UPDATE
        SET status = 'running', attempt = EXCLUDED.attempt, lease_epoch = EXCLUDED.lease_epoch,
            worker_id = EXCLUDED.worker_id, model = EXCLUDED.model, started_at = clock_timestamp(),
            finished_at = NULL, error_code = NULL, error_message = NULL, context_tokens = EXCLUDED.context_tokens
    RETURNING * INTO s;
    UPDATE runs SET context_tokens = v_tokens, context_limit = (p ->> 'contextLimit')::int,
                    lease_expires_at = now() + make_interval(secs => (p ->> 'leaseMs')::bigint / 1000.0)
     WHERE id = v_run RETURNING * INTO r;
    -- The `run` event and the context size in one update of the thread.
    UPDATE threads SET context_tokens = v_tokens, last_event_sequence = last_event_sequence + 1
     WHERE id = v_thread RETURNING last_event_sequence INTO v_seq;
    INSERT INTO thread_events (thread_id, sequence, kind, payload) VALUES (v_thread, v_seq, 'run', agentloop_run_json(r));
    v_open := agentloop_open_calls(v_thread, v_run);
    PERFORM agentloop_notify(ARRAY[v_thread]);
    RETURN jsonb_build_object(
        'step', jsonb_build_object('id', s.id, 'sequence', s.sequence),
        'run', agentloop_run_json(r),
        'metadata', t.metadata,
        'context', v_context,
        'open', v_open,
        'approvals', CASE WHEN v_open IS NULL THEN '[]'::jsonb ELSE
            (SELECT coalesce(jsonb_agg(agentloop_approval_json(a) ORDER BY a.created_at, a.tool_call_id), '[]'::jsonb)
               FROM tool_approvals a WHERE a.run_id = v_run) END,
        'operations', CASE WHEN v_open IS NULL THEN '[]'::jsonb ELSE
            (SELECT coalesce(jsonb_agg(agentloop_operation_json(o) ORDER BY o.created_at), '[]'::jsonb)
               FROM operations o WHERE o.run_id = v_run) END);
END $$;

-- A checkpoint (SPEC §6 steps 5-7): everything a slice commits after a model answer or a tool
-- result, in one fenced transaction. p = {commitId, runId, threadId, owner, epoch, leaseMs,
-- stepId, messages?, operations? ([{action: "dispatch", key, toolCallId, toolName, arguments} |
-- {action: "finish", key, status: completed|failed|uncertain, result}]), approvals?
-- ([{toolCallId, toolName, arguments, parameters, messageSequence}]), approvalTimeoutMs?,
-- snapshot? ({summary, tokenEstimate, identities, previous: {fromSequence, toSequence}?,
-- event}), events? ([{kind, payload}]), context? ({tokens, limit}), usage? ({modelCalls,
-- toolCalls, promptTokens, completionTokens}: deltas), end? (see agentloop_end_run)}.
-- Returns {messages: [{sequence, timestamp}], status, cancelRequested, snapshotVersion?}, or
-- {lost: true}; a retry with the same commitId returns the first result.
CREATE FUNCTION agentloop_commit(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_run uuid := (p ->> 'runId')::uuid;
    v_thread uuid := (p ->> 'threadId')::uuid;
    v_step bigint := (p ->> 'stepId')::bigint;
    v_usage jsonb := coalesce(p -> 'usage', '{}'::jsonb);
    r runs;
    o jsonb;
    e jsonb;
    a tool_approvals;
    v_msgs jsonb;
    v_result jsonb;
    v_min bigint;
    v_max bigint;
    v_version int;
BEGIN
    PERFORM 1 FROM threads WHERE id = v_thread FOR NO KEY UPDATE;
    -- After the thread lock, so a retry queues behind a first attempt still executing.
    SELECT * INTO r FROM runs WHERE id = v_run FOR NO KEY UPDATE;
    IF r.last_commit ->> 'id' = p ->> 'commitId' THEN
        RETURN (r.last_commit -> 'result') || '{"replayed": true}'::jsonb;
    END IF;
    IF r.status IS DISTINCT FROM 'running' OR r.lease_owner IS DISTINCT FROM p ->> 'owner'
       OR r.lease_epoch IS DISTINCT FROM (p ->> 'epoch')::bigint THEN
        RETURN '{"lost": true}'::jsonb;
    END IF;

    FOR o IN SELECT value FROM jsonb_array_elements(coalesce(p -> 'operations', '[]'::jsonb)) LOOP
        IF o ->> 'action' = 'dispatch' THEN
            INSERT INTO operations (key, run_id, thread_id, tool_call_id, tool_name, arguments, status,
                                    lease_epoch, dispatches, dispatched_at)
            VALUES (o ->> 'key', v_run, v_thread, o ->> 'toolCallId', o ->> 'toolName',
                    coalesce(o -> 'arguments', '{}'::jsonb), 'dispatched', r.lease_epoch, 1, now())
            ON CONFLICT (key) DO UPDATE
                SET status = 'dispatched', lease_epoch = EXCLUDED.lease_epoch, arguments = EXCLUDED.arguments,
                    dispatches = operations.dispatches + 1, dispatched_at = now(), updated_at = now()
                WHERE operations.status = 'prepared' AND operations.run_id = EXCLUDED.run_id;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'operation % is neither new nor prepared: it cannot be dispatched', o ->> 'key';
            END IF;
            DELETE FROM operations WHERE key IN (
                SELECT key FROM operations WHERE run_id = v_run AND status IN ('completed', 'failed')
                 ORDER BY created_at
                 LIMIT greatest((SELECT count(*) FROM operations WHERE run_id = v_run) - 64, 0));
        ELSIF o ->> 'action' = 'finish' THEN
            UPDATE operations SET status = o ->> 'status', result = o ->> 'result',
                                  finished_at = CASE WHEN o ->> 'status' IN ('completed', 'failed') THEN now() END,
                                  updated_at = now()
             WHERE key = o ->> 'key' AND run_id = v_run AND status = 'dispatched';
        ELSE
            RAISE EXCEPTION 'unknown operation action %', o ->> 'action';
        END IF;
    END LOOP;

    v_msgs := agentloop_append(v_thread, v_run, v_step, coalesce(p -> 'messages', '[]'::jsonb));

    FOR a IN INSERT INTO tool_approvals (id, run_id, thread_id, message_sequence, tool_call_id, tool_name,
                                         arguments, parameters, deadline_at)
             SELECT gen_random_uuid(), v_run, v_thread, (x ->> 'messageSequence')::bigint, x ->> 'toolCallId',
                    x ->> 'toolName', coalesce(x -> 'arguments', '{}'::jsonb), coalesce(x -> 'parameters', '{}'::jsonb),
                    now() + make_interval(secs => coalesce((p ->> 'approvalTimeoutMs')::bigint, 86400000) / 1000.0)
               FROM jsonb_array_elements(coalesce(p -> 'approvals', '[]'::jsonb)) x
             ON CONFLICT (run_id, tool_call_id) DO NOTHING
             RETURNING * LOOP
        PERFORM agentloop_journal(v_thread, 'approval', agentloop_approval_json(a));
    END LOOP;

    IF p ? 'snapshot' AND jsonb_typeof(p -> 'snapshot') = 'object' THEN
        SELECT min(sequence), max(sequence) INTO v_min, v_max FROM messages
         WHERE thread_id = v_thread
           AND timestamp_ms IN (SELECT x::bigint FROM jsonb_array_elements_text(p -> 'snapshot' -> 'identities') x);
        IF p -> 'snapshot' -> 'previous' IS NOT NULL AND jsonb_typeof(p -> 'snapshot' -> 'previous') = 'object' THEN
            v_min := least(v_min, (p -> 'snapshot' -> 'previous' ->> 'fromSequence')::bigint);
            v_max := greatest(v_max, (p -> 'snapshot' -> 'previous' ->> 'toSequence')::bigint);
        END IF;
        IF v_min IS NOT NULL THEN
            SELECT coalesce(max(version), 0) + 1 INTO v_version FROM context_snapshots WHERE thread_id = v_thread;
            INSERT INTO context_snapshots (thread_id, version, summary, from_sequence, to_sequence, token_estimate, run_id)
            VALUES (v_thread, v_version, p -> 'snapshot' ->> 'summary', v_min, v_max,
                    (p -> 'snapshot' ->> 'tokenEstimate')::int, v_run);
        END IF;
        IF jsonb_typeof(p -> 'snapshot' -> 'event') = 'object' THEN
            PERFORM agentloop_journal(v_thread, 'compaction',
                                      (p -> 'snapshot' -> 'event') || jsonb_build_object('snapshotVersion', v_version));
        END IF;
    END IF;

    FOR e IN SELECT value FROM jsonb_array_elements(coalesce(p -> 'events', '[]'::jsonb)) LOOP
        PERFORM agentloop_journal(v_thread, e ->> 'kind', e -> 'payload');
    END LOOP;

    IF jsonb_typeof(p -> 'context') = 'object' THEN
        IF v_step IS NOT NULL THEN
            UPDATE run_steps SET context_tokens = (p -> 'context' ->> 'tokens')::int WHERE id = v_step;
        END IF;
        UPDATE threads SET context_tokens = (p -> 'context' ->> 'tokens')::int WHERE id = v_thread;
    END IF;

    IF jsonb_array_length(v_msgs) > 0 THEN
        UPDATE threads SET streaming_message = NULL WHERE id = v_thread AND streaming_message IS NOT NULL;
    END IF;
    v_usage := v_usage || jsonb_build_object('progress', jsonb_array_length(v_msgs) > 0);
    v_result := jsonb_build_object(
        'messages', (SELECT coalesce(jsonb_agg(jsonb_build_object('sequence', m -> 'sequence', 'timestamp', m -> 'timestamp')), '[]'::jsonb)
                       FROM jsonb_array_elements(v_msgs) m),
        'status', r.status,
        'cancelRequested', r.cancel_requested_at IS NOT NULL,
        'snapshotVersion', v_version,
        'snapshotFrom', CASE WHEN v_version IS NOT NULL THEN v_min END,
        'snapshotTo', CASE WHEN v_version IS NOT NULL THEN v_max END);

    IF jsonb_typeof(p -> 'end') = 'object' THEN
        r := agentloop_end_run(v_run, v_step, p -> 'end', v_usage,
                               jsonb_build_object('id', p ->> 'commitId', 'result', v_result));
        v_result := jsonb_set(v_result, '{status}', to_jsonb(r.status));
    ELSE
        IF v_step IS NOT NULL AND v_usage - 'progress' <> '{}'::jsonb THEN
            UPDATE run_steps SET model_calls = model_calls + coalesce((v_usage ->> 'modelCalls')::int, 0),
                                 tool_calls = tool_calls + coalesce((v_usage ->> 'toolCalls')::int, 0),
                                 prompt_tokens = prompt_tokens + coalesce((v_usage ->> 'promptTokens')::bigint, 0),
                                 completion_tokens = completion_tokens + coalesce((v_usage ->> 'completionTokens')::bigint, 0)
             WHERE id = v_step;
        END IF;
        -- The one update of the run: lease, usage, progress, context size, the commit record.
        UPDATE runs SET lease_expires_at = now() + make_interval(secs => (p ->> 'leaseMs')::bigint / 1000.0),
                        tool_calls_used = tool_calls_used + coalesce((v_usage ->> 'toolCalls')::int, 0),
                        prompt_tokens = prompt_tokens + coalesce((v_usage ->> 'promptTokens')::bigint, 0),
                        completion_tokens = completion_tokens + coalesce((v_usage ->> 'completionTokens')::bigint, 0),
                        faults = CASE WHEN (v_usage ->> 'progress')::boolean THEN 0 ELSE faults END,
                        context_tokens = coalesce((p -> 'context' ->> 'tokens')::int, context_tokens),
                        context_limit = CASE WHEN jsonb_typeof(p -> 'context') = 'object'
                                             THEN (p -> 'context' ->> 'limit')::int ELSE context_limit END,
                        last_commit = jsonb_build_object('id', p ->> 'commitId', 'result', v_result)
         WHERE id = v_run;
    END IF;
    PERFORM agentloop_notify(ARRAY[v_thread]);
    RETURN v_result;
END $$;

-- The end of a slice that never got to its step row, or a run ended by the worker before any
-- model call (abandoned, budget, model not configured, cancelled while queued): the same as a
-- commit with only `end`. Kept as a name for readability in the worker.

-- Streaming flush (SPEC §6 step 4): one transaction for the partial answers of ALL the slices a
-- worker is streaming. Per item whose lease still holds: one `streaming` journal event
-- {runId, offset, delta[, reasoningOffset, reasoningDelta]} (offsets in UTF-16 code units of
-- the partial text before the delta; offset 0 restarts it) and, when `snapshot` is given, the
-- whole partial as `threads.streaming_message = {runId, content, reasoning, eventSequence}`
-- (the window adds the deltas journaled after eventSequence). Thread rows are locked in id
-- order and nothing is locked after them. p = {owner, items: [{runId, epoch, threadId, offset,
-- delta, reasoningOffset?, reasoningDelta?, snapshot?: {content, reasoning}}]}. Returns
-- {lost: [runId...]}.
CREATE FUNCTION agentloop_stream(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    it record;
    v_seq bigint;
    v_threads uuid[] := '{}';
    v_lost jsonb := '[]'::jsonb;
    v_payload jsonb;
BEGIN
    PERFORM 1 FROM threads
     WHERE id IN (SELECT (x ->> 'threadId')::uuid FROM jsonb_array_elements(p -> 'items') x)
     ORDER BY id FOR NO KEY UPDATE;
    FOR it IN SELECT x, (x ->> 'runId')::uuid AS run_id, (x ->> 'threadId')::uuid AS thread_id
                FROM jsonb_array_elements(p -> 'items') x LOOP
        IF EXISTS (SELECT 1 FROM runs WHERE id = it.run_id AND status = 'running' AND lease_owner = p ->> 'owner'
                                         AND lease_epoch = (it.x ->> 'epoch')::bigint) THEN
            v_payload := jsonb_build_object('runId', it.run_id, 'offset', it.x -> 'offset', 'delta', coalesce(it.x -> 'delta', '""'::jsonb));
            IF it.x ? 'reasoningDelta' THEN
                v_payload := v_payload || jsonb_build_object('reasoningOffset', it.x -> 'reasoningOffset',
                                                             'reasoningDelta', it.x -> 'reasoningDelta');
            END IF;
            v_seq := agentloop_journal(it.thread_id, 'streaming', v_payload);
            IF jsonb_typeof(it.x -> 'snapshot') = 'object' THEN
                UPDATE threads SET streaming_message = (it.x -> 'snapshot')
                                   || jsonb_build_object('runId', it.run_id, 'eventSequence', v_seq)
                 WHERE id = it.thread_id;
            END IF;
            v_threads := v_threads || it.thread_id;
        ELSE
            v_lost := v_lost || to_jsonb(it.run_id);
        END IF;
    END LOOP;
    PERFORM agentloop_notify(v_threads);
    RETURN jsonb_build_object('lost', v_lost);
END $$;

-- Approval expiry sweep (workers): rejects with reason `expired` the pending approvals whose
-- deadline passed, for at most p.limit runs (threads locked with SKIP LOCKED, so sweepers and
-- deciders never wait on each other), finishing each batch left without a pending call.
-- Returns {expired, nextDeadlineMs}.
CREATE FUNCTION agentloop_expire_approvals(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    d record;
    a tool_approvals;
    n int := 0;
    v_threads uuid[] := '{}';
BEGIN
    FOR d IN SELECT DISTINCT run_id, thread_id FROM tool_approvals
              WHERE status = 'pending' AND deadline_at < now() LIMIT coalesce((p ->> 'limit')::int, 100) LOOP
        PERFORM 1 FROM threads WHERE id = d.thread_id FOR NO KEY UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        PERFORM 1 FROM runs WHERE id = d.run_id FOR UPDATE;
        FOR a IN UPDATE tool_approvals SET status = 'expired', reason = 'expired', decided_at = now()
                  WHERE run_id = d.run_id AND status = 'pending' AND deadline_at < now() RETURNING * LOOP
            PERFORM agentloop_journal(d.thread_id, 'approval', agentloop_approval_json(a));
            n := n + 1;
        END LOOP;
        PERFORM agentloop_finish_batch(d.run_id);
        v_threads := v_threads || d.thread_id;
    END LOOP;
    PERFORM agentloop_notify(v_threads);
    RETURN jsonb_build_object(
        'expired', n,
        'nextDeadlineMs', (SELECT (extract(epoch FROM (min(deadline_at) - now())) * 1000)::bigint
                             FROM tool_approvals WHERE status = 'pending'));
END $$;

---------------------------------------------------------------------------------------------
-- API commands (each one transaction; locks: thread, then runs, then approvals/operations)
---------------------------------------------------------------------------------------------

-- The thread's active run, locked (lock order step 2). NULL fields when there is none.
CREATE FUNCTION agentloop_lock_active(p_thread uuid) RETURNS runs LANGUAGE plpgsql AS $$
DECLARE
    a runs;
BEGIN
    SELECT * INTO a FROM runs
     WHERE thread_id = p_thread AND status IN ('queued', 'running', 'waiting_approval', 'blocked') FOR UPDATE;
    RETURN a;
END $$;

-- The model a new run of thread t uses: the request's, else the thread's, else the server's
-- default; 400 no_model without one, 409 model_not_configured when the server does not
-- configure it (p.models lists the configured ids).
CREATE FUNCTION agentloop_pick_model(t threads, p jsonb) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_model text := coalesce(p ->> 'model', t.model, p ->> 'defaultModel');
BEGIN
    IF v_model IS NULL THEN
        PERFORM agentloop_refuse(400, 'no_model', 'no model is configured on this server');
    END IF;
    IF jsonb_typeof(p -> 'models') = 'array' AND NOT (p -> 'models') ? v_model THEN
        PERFORM agentloop_refuse(409, 'model_not_configured',
            format('model %s is not configured on this server (configured: %s); change the thread''s model or pass "model"',
                   v_model, (SELECT string_agg(x, ', ') FROM jsonb_array_elements_text(p -> 'models') x)));
    END IF;
    RETURN v_model;
END $$;

-- Inserts a run of thread t, journals it and wakes the scheduler when it is queued.
CREATE FUNCTION agentloop_insert_run(t threads, p_principal uuid, p_status text, p_model text, p_max_steps int,
                                     p_command text, p_input jsonb, p_kind text, p_source uuid) RETURNS runs
LANGUAGE plpgsql AS $$
DECLARE
    r runs;
BEGIN
    INSERT INTO runs (id, thread_id, principal_id, status, command_id, model, max_steps, queued_at, input, kind,
                      source_thread_id)
    VALUES (gen_random_uuid(), t.id, p_principal, p_status, p_command, p_model, p_max_steps,
            CASE WHEN p_status = 'queued' THEN now() END, p_input, p_kind, p_source)
    RETURNING * INTO r;
    PERFORM agentloop_journal(t.id, 'run', agentloop_run_json(r));
    IF p_status = 'queued' THEN
        PERFORM agentloop_wake('queued:' || r.id);
    END IF;
    RETURN r;
END $$;

-- POST /api/threads/{id}/chat (SPEC §4, §11). p = {principalId, threadId, commandId?,
-- fingerprint, content, tokenEstimate, byteSize, multitask? (reject|enqueue|interrupt; else the
-- thread's metadata.multitask, else reject), maxSteps, model?, defaultModel?, models}.
-- Receipt first (an identical retry replays the stored response; a different body is 409
-- idempotency_conflict), then thread, then its active run. Returns {run, message}.
CREATE FUNCTION agentloop_chat(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_principal uuid := (p ->> 'principalId')::uuid;
    v_key text := p ->> 'commandId';
    t threads;
    a runs;
    r runs;
    v_policy text;
    v_model text;
    v_status text;
    v_message jsonb := 'null'::jsonb;
    v_input jsonb;
    v_response jsonb;
    v_fingerprint text;
BEGIN
    IF v_key IS NOT NULL THEN
        INSERT INTO command_receipts (principal_id, command_id, fingerprint)
        VALUES (v_principal, v_key, p ->> 'fingerprint') ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            SELECT fingerprint, response INTO v_fingerprint, v_response FROM command_receipts
             WHERE principal_id = v_principal AND command_id = v_key;
            IF v_response IS NOT NULL AND v_fingerprint = p ->> 'fingerprint' THEN
                RETURN v_response;
            END IF;
            PERFORM agentloop_refuse(409, 'idempotency_conflict',
                                     'this idempotency key was already used with a different request');
        END IF;
    END IF;
    t := agentloop_lock_thread((p ->> 'threadId')::uuid, v_principal);
    a := agentloop_lock_active(t.id);
    v_policy := coalesce(p ->> 'multitask',
                         CASE WHEN t.metadata ->> 'multitask' IN ('reject', 'enqueue', 'interrupt')
                              THEN t.metadata ->> 'multitask' END,
                         'reject');
    v_model := agentloop_pick_model(t, p);
    IF a.id IS NOT NULL AND v_policy = 'interrupt' THEN
        PERFORM agentloop_cancel(a.id);
        a := agentloop_lock_active(t.id);
    END IF;
    IF a.id IS NULL THEN
        v_status := 'queued';
    ELSIF a.status = 'waiting_approval' THEN
        PERFORM agentloop_refuse(409, 'approval_required',
            format('run %s is waiting for a tool approval; approve or reject it first', a.id));
    ELSIF v_policy = 'reject' THEN
        PERFORM agentloop_refuse(409, 'run_active',
            format('run %s is still %s; wait for it, cancel it, or send it to be queued (multitask: enqueue)', a.id, a.status));
    ELSE
        v_status := 'pending';
    END IF;
    IF v_status = 'queued' THEN
        v_message := agentloop_append(t.id, NULL, NULL, jsonb_build_array(jsonb_build_object(
            'role', 'user', 'content', p -> 'content', 'tokenEstimate', p -> 'tokenEstimate',
            'byteSize', p -> 'byteSize'))) -> 0;
    ELSE
        v_input := jsonb_build_object('content', p -> 'content', 'tokenEstimate', p -> 'tokenEstimate',
                                      'byteSize', p -> 'byteSize');
    END IF;
    r := agentloop_insert_run(t, v_principal, v_status, v_model, (p ->> 'maxSteps')::int, v_key, v_input, 'agent', NULL);
    v_response := jsonb_build_object('run', agentloop_run_json(r), 'message', v_message);
    IF v_key IS NOT NULL THEN
        UPDATE command_receipts SET response = v_response, thread_id = t.id, run_id = r.id
         WHERE principal_id = v_principal AND command_id = v_key;
    END IF;
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN v_response;
END $$;

-- The owner-scoped thread of run p_run (unlocked read of an immutable column), else 404.
CREATE FUNCTION agentloop_thread_of_run(p_run uuid, p_principal uuid) RETURNS uuid LANGUAGE plpgsql AS $$
DECLARE
    v_thread uuid;
BEGIN
    SELECT r.thread_id INTO v_thread FROM runs r JOIN threads t ON t.id = r.thread_id
     WHERE r.id = p_run AND t.owner_id = p_principal AND t.deleted_at IS NULL;
    IF NOT FOUND THEN
        PERFORM agentloop_refuse(404, 'not_found', 'not found');
    END IF;
    RETURN v_thread;
END $$;

-- POST /api/runs/{id}/cancel. p = {principalId, runId}. Returns the run.
CREATE FUNCTION agentloop_cancel_run(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_principal uuid := (p ->> 'principalId')::uuid;
    v_thread uuid := agentloop_thread_of_run((p ->> 'runId')::uuid, v_principal);
    r runs;
BEGIN
    PERFORM agentloop_lock_thread(v_thread, v_principal);
    PERFORM agentloop_lock_active(v_thread);
    r := agentloop_cancel((p ->> 'runId')::uuid);
    PERFORM agentloop_notify(ARRAY[v_thread]);
    RETURN agentloop_run_json(r);
END $$;

-- Cancels every open run of a locked thread: pending ones first (newest first), so cancelling
-- the active run promotes nothing. Returns the runs' JSON.
CREATE FUNCTION agentloop_cancel_all(p_thread uuid) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid;
    v_out jsonb := '[]'::jsonb;
BEGIN
    PERFORM agentloop_lock_active(p_thread);
    FOR v_id IN SELECT id FROM runs
                 WHERE thread_id = p_thread
                   AND status IN ('pending', 'queued', 'running', 'waiting_approval', 'blocked')
                 ORDER BY (status = 'pending') DESC, seq DESC LOOP
        v_out := v_out || agentloop_run_json(agentloop_cancel(v_id));
    END LOOP;
    RETURN v_out;
END $$;

-- POST /api/threads/{id}/cancel. p = {principalId, threadId}. Returns {runs}.
CREATE FUNCTION agentloop_cancel_thread(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
    v_runs jsonb := agentloop_cancel_all(t.id);
BEGIN
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN jsonb_build_object('runs', v_runs);
END $$;

-- DELETE /api/threads/{id}: cancels its runs (and approvals), marks it deleted and journals
-- `thread_deleted` for open live clients. p = {principalId, threadId}.
CREATE FUNCTION agentloop_delete_thread(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
BEGIN
    PERFORM agentloop_cancel_all(t.id);
    UPDATE threads SET deleted_at = now(), updated_at = now() WHERE id = t.id;
    PERFORM agentloop_journal(t.id, 'thread_deleted', jsonb_build_object('threadId', t.id));
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN jsonb_build_object('threadId', t.id);
END $$;

-- POST /api/approvals/{id}/approve|reject: a compare-and-set on the pending approval; the
-- decision that leaves no pending call in the batch appends the declined results and requeues
-- the SAME run. p = {principalId, approvalId, decision: approve|reject, arguments? (already
-- validated against the stored schema), reason?}. Returns {approval, run}; 409
-- approval_decided when someone (or the deadline, or a cancellation) decided first.
CREATE FUNCTION agentloop_decide(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_principal uuid := (p ->> 'principalId')::uuid;
    cur tool_approvals;
    a tool_approvals;
    r runs;
    v_args jsonb := CASE WHEN jsonb_typeof(p -> 'arguments') IN ('object') THEN p -> 'arguments' END;
BEGIN
    SELECT x.* INTO cur FROM tool_approvals x JOIN threads t ON t.id = x.thread_id
     WHERE x.id = (p ->> 'approvalId')::uuid AND t.owner_id = v_principal AND t.deleted_at IS NULL;
    IF NOT FOUND THEN
        PERFORM agentloop_refuse(404, 'not_found', 'not found');
    END IF;
    PERFORM agentloop_lock_thread(cur.thread_id, v_principal);
    PERFORM 1 FROM runs WHERE id = cur.run_id FOR UPDATE;
    IF p ->> 'decision' = 'approve' THEN
        UPDATE tool_approvals SET status = 'approved',
                                  approved_arguments = coalesce(v_args, arguments),
                                  arguments_edited = v_args IS NOT NULL AND v_args <> arguments,
                                  decided_by = v_principal, decided_at = now()
         WHERE id = cur.id AND status = 'pending' RETURNING * INTO a;
    ELSE
        UPDATE tool_approvals SET status = 'rejected', reason = nullif(btrim(p ->> 'reason'), ''),
                                  decided_by = v_principal, decided_at = now()
         WHERE id = cur.id AND status = 'pending' RETURNING * INTO a;
    END IF;
    IF a.id IS NULL THEN
        SELECT * INTO a FROM tool_approvals WHERE id = cur.id;
        PERFORM agentloop_refuse(409, 'approval_decided', format('approval %s is already %s', a.id, a.status));
    END IF;
    PERFORM agentloop_journal(a.thread_id, 'approval', agentloop_approval_json(a));
    r := agentloop_finish_batch(a.run_id);
    PERFORM agentloop_notify(ARRAY[a.thread_id]);
    RETURN jsonb_build_object('approval', agentloop_approval_json(a), 'run', agentloop_run_json(r));
END $$;

-- POST /api/runs/{id}/operations/{key}/resolve (SPEC §7): only while the run is `blocked` (and
-- unchanged since p.expectedUpdatedAt, when given) and the operation `uncertain`; else 409
-- stale_resolve. completed/failed append the call's result; retry puts it back to `prepared`
-- (dispatched again under the same key by the next slice). When no uncertain operation is left
-- the SAME run is requeued. p = {principalId, runId, key, outcome, result?, reason?,
-- expectedUpdatedAt?}. Returns {operation, run}.
CREATE FUNCTION agentloop_resolve(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_principal uuid := (p ->> 'principalId')::uuid;
    v_run uuid := (p ->> 'runId')::uuid;
    v_thread uuid := agentloop_thread_of_run(v_run, v_principal);
    v_outcome text := p ->> 'outcome';
    r runs;
    op operations;
    v_open jsonb;
BEGIN
    PERFORM agentloop_lock_thread(v_thread, v_principal);
    SELECT * INTO r FROM runs WHERE id = v_run FOR UPDATE;
    SELECT * INTO op FROM operations WHERE key = p ->> 'key' AND run_id = v_run FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM agentloop_refuse(404, 'not_found', 'not found');
    END IF;
    IF r.status IN ('completed', 'failed', 'cancelled') AND op.status = 'uncertain' AND v_outcome <> 'retry' THEN
        -- The run ended with the outcome unknown: the resolve records what happened (the call's
        -- history already says the outcome was unknown); nothing is requeued.
        UPDATE operations SET status = v_outcome,
                              result = CASE v_outcome WHEN 'completed' THEN coalesce(p ->> 'result', 'completed (confirmed by the user)')
                                                      ELSE coalesce('failed: ' || (p ->> 'reason'), 'failed (confirmed by the user)') END,
                              resolution = v_outcome, resolved_by = v_principal, resolved_at = now(), finished_at = now(),
                              updated_at = now()
         WHERE key = op.key RETURNING * INTO op;
        RETURN jsonb_build_object('operation', agentloop_operation_json(op), 'run', agentloop_run_json(r));
    END IF;
    IF r.status <> 'blocked' THEN
        PERFORM agentloop_refuse(409, 'stale_resolve', format('the run is %s, not blocked', r.status));
    END IF;
    IF p ->> 'expectedUpdatedAt' IS NOT NULL
       AND abs(extract(epoch FROM ((p ->> 'expectedUpdatedAt')::timestamptz - r.updated_at))) >= 0.001 THEN
        PERFORM agentloop_refuse(409, 'stale_resolve', 'the run changed since it was read');
    END IF;
    IF op.status <> 'uncertain' THEN
        PERFORM agentloop_refuse(409, 'stale_resolve', format('the operation is %s, not uncertain', op.status));
    END IF;
    UPDATE operations SET
        status = CASE v_outcome WHEN 'completed' THEN 'completed' WHEN 'failed' THEN 'failed' ELSE 'prepared' END,
        result = CASE v_outcome
                     WHEN 'completed' THEN coalesce(p ->> 'result', 'completed (outcome confirmed by the user after an interruption)')
                     WHEN 'failed' THEN coalesce('failed: ' || (p ->> 'reason'),
                                                 'failed (the user confirmed the call did not take effect after an interruption)')
                 END,
        resolution = v_outcome, resolved_by = v_principal, resolved_at = now(), finished_at = now(), updated_at = now()
     WHERE key = op.key RETURNING * INTO op;
    IF v_outcome <> 'retry' THEN
        v_open := agentloop_open_calls(v_thread, v_run);
        IF v_open IS NOT NULL AND NOT (v_open -> 'answered') ? op.tool_call_id
           AND EXISTS (SELECT 1 FROM jsonb_array_elements(v_open -> 'message' -> 'toolCalls') c
                        WHERE c ->> 'id' = op.tool_call_id) THEN
            PERFORM agentloop_append(v_thread, v_run, (v_open -> 'message' ->> 'stepId')::bigint,
                jsonb_build_array(jsonb_build_object('role', 'tool', 'content', to_jsonb(op.result),
                                                     'toolCallId', op.tool_call_id,
                                                     'tokenEstimate', 4 + length(op.result) / 4,
                                                     'byteSize', octet_length(op.result) + 2)));
        END IF;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM operations WHERE run_id = v_run AND status = 'uncertain') THEN
        UPDATE runs SET status = 'queued', error_code = NULL, error_message = NULL, queued_at = now(), updated_at = now()
         WHERE id = v_run RETURNING * INTO r;
        PERFORM agentloop_wake('queued:' || v_run);
    ELSE
        UPDATE runs SET error_message = agentloop_blocker_message(v_run), updated_at = now()
         WHERE id = v_run RETURNING * INTO r;
    END IF;
    PERFORM agentloop_journal(v_thread, 'run', agentloop_run_json(r));
    PERFORM agentloop_notify(ARRAY[v_thread]);
    RETURN jsonb_build_object('operation', agentloop_operation_json(op), 'run', agentloop_run_json(r));
END $$;

-- Branch operations (SPEC §3): refused while the thread has an active run.
CREATE FUNCTION agentloop_ensure_idle(p_thread uuid) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    a runs := agentloop_lock_active(p_thread);
BEGIN
    IF a.id IS NULL THEN
        RETURN;
    ELSIF a.status = 'waiting_approval' THEN
        PERFORM agentloop_refuse(409, 'approval_required',
            format('run %s is waiting for a tool approval; decide it or cancel the run first', a.id));
    ELSE
        PERFORM agentloop_refuse(409, 'run_active',
            format('run %s is still %s; wait for it or cancel it first', a.id, a.status));
    END IF;
END $$;

-- Deactivates the given active rows (never deletes), keeps message_count authoritative,
-- supersedes snapshots covering them, journals `messages_deactivated {sequences}`.
CREATE FUNCTION agentloop_deactivate(p_thread uuid, p_sequences bigint[]) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_done jsonb;
    v_n int;
    v_first bigint;
BEGIN
    WITH d AS (
        UPDATE messages SET active = false
         WHERE thread_id = p_thread AND active AND sequence = ANY(p_sequences) RETURNING sequence
    )
    SELECT coalesce(jsonb_agg(sequence ORDER BY sequence), '[]'::jsonb), count(*), min(sequence)
      INTO v_done, v_n, v_first FROM d;
    IF v_n > 0 THEN
        UPDATE threads SET message_count = message_count - v_n, updated_at = now() WHERE id = p_thread;
        UPDATE context_snapshots SET superseded_at = now()
         WHERE thread_id = p_thread AND superseded_at IS NULL AND to_sequence >= v_first;
        PERFORM agentloop_journal(p_thread, 'messages_deactivated', jsonb_build_object('sequences', v_done));
    END IF;
    RETURN v_done;
END $$;

-- The active message at p_sequence (404 when none).
CREATE FUNCTION agentloop_active_at(p_thread uuid, p_sequence bigint) RETURNS messages LANGUAGE plpgsql AS $$
DECLARE
    m messages;
BEGIN
    SELECT * INTO m FROM messages WHERE thread_id = p_thread AND active AND sequence = p_sequence;
    IF NOT FOUND THEN
        PERFORM agentloop_refuse(404, 'not_found', 'not found');
    END IF;
    RETURN m;
END $$;

-- The sequences of the tool group containing m: an assistant tool-call message and its
-- contiguous results; a plain message is its own group.
CREATE FUNCTION agentloop_tool_group(m messages) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
    c messages;
    v_stop bigint;
BEGIN
    IF m.role = 'tool' THEN
        SELECT * INTO c FROM messages
         WHERE thread_id = m.thread_id AND active AND sequence < m.sequence AND role <> 'tool'
         ORDER BY sequence DESC LIMIT 1;
        IF NOT FOUND OR c.role <> 'assistant' OR c.tool_calls IS NULL THEN
            RETURN ARRAY[m.sequence];
        END IF;
    ELSIF m.role = 'assistant' AND m.tool_calls IS NOT NULL THEN
        c := m;
    ELSE
        RETURN ARRAY[m.sequence];
    END IF;
    SELECT min(sequence) INTO v_stop FROM messages
     WHERE thread_id = c.thread_id AND active AND sequence > c.sequence AND role <> 'tool';
    RETURN ARRAY[c.sequence] || ARRAY(
        SELECT sequence FROM messages
         WHERE thread_id = c.thread_id AND active AND sequence > c.sequence
           AND (v_stop IS NULL OR sequence < v_stop) AND role = 'tool'
         ORDER BY sequence);
END $$;

-- POST /api/threads/{id}/messages/{sequence}/edit. p = {principalId, threadId, sequence,
-- content, tokenEstimate, byteSize, maxSteps, model?, defaultModel?, models}.
-- Returns {run, message, deactivated}.
CREATE FUNCTION agentloop_edit(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_principal uuid := (p ->> 'principalId')::uuid;
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, v_principal);
    m messages;
    v_model text;
    v_done jsonb;
    v_message jsonb;
    r runs;
BEGIN
    PERFORM agentloop_ensure_idle(t.id);
    m := agentloop_active_at(t.id, (p ->> 'sequence')::bigint);
    IF m.role <> 'user' THEN
        PERFORM agentloop_refuse(400, 'not_a_user_message', 'only user messages can be edited');
    END IF;
    v_model := agentloop_pick_model(t, p);
    v_done := agentloop_deactivate(t.id, ARRAY(SELECT sequence FROM messages
                                                WHERE thread_id = t.id AND active AND sequence >= m.sequence));
    v_message := agentloop_append(t.id, NULL, NULL, jsonb_build_array(jsonb_build_object(
        'role', 'user', 'content', p -> 'content', 'tokenEstimate', p -> 'tokenEstimate', 'byteSize', p -> 'byteSize'))) -> 0;
    r := agentloop_insert_run(t, v_principal, 'queued', v_model, (p ->> 'maxSteps')::int, NULL, NULL, 'agent', NULL);
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN jsonb_build_object('run', agentloop_run_json(r), 'message', v_message, 'deactivated', v_done);
END $$;

-- POST /api/threads/{id}/messages/{sequence}/regenerate: for a user message everything after
-- it, else its whole tool group and everything after, becomes inactive; a run is enqueued.
-- p = {principalId, threadId, sequence, maxSteps, model?, defaultModel?, models}.
CREATE FUNCTION agentloop_regenerate(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_principal uuid := (p ->> 'principalId')::uuid;
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, v_principal);
    m messages;
    v_from bigint;
    v_model text;
    v_done jsonb;
    r runs;
BEGIN
    PERFORM agentloop_ensure_idle(t.id);
    m := agentloop_active_at(t.id, (p ->> 'sequence')::bigint);
    v_model := agentloop_pick_model(t, p);
    v_from := CASE WHEN m.role = 'user' THEN m.sequence + 1 ELSE (agentloop_tool_group(m))[1] END;
    v_done := agentloop_deactivate(t.id, ARRAY(SELECT sequence FROM messages
                                                WHERE thread_id = t.id AND active AND sequence >= v_from));
    r := agentloop_insert_run(t, v_principal, 'queued', v_model, (p ->> 'maxSteps')::int, NULL, NULL, 'agent', NULL);
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN jsonb_build_object('run', agentloop_run_json(r), 'deactivated', v_done);
END $$;

-- DELETE /api/threads/{id}/messages/{sequence}: deactivates the message with its whole tool
-- group. p = {principalId, threadId, sequence}. Returns {deactivated}.
CREATE FUNCTION agentloop_delete_message(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
    m messages;
    v_done jsonb;
BEGIN
    PERFORM agentloop_ensure_idle(t.id);
    m := agentloop_active_at(t.id, (p ->> 'sequence')::bigint);
    v_done := agentloop_deactivate(t.id, agentloop_tool_group(m));
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN jsonb_build_object('deactivated', v_done);
END $$;

-- Inserts a thread owned by p_owner and journals its `thread` event.
CREATE FUNCTION agentloop_insert_thread(p_owner uuid, p_title text, p_model text, p_metadata jsonb, p_parent uuid)
RETURNS threads LANGUAGE plpgsql AS $$
DECLARE
    t threads;
BEGIN
    INSERT INTO threads (id, owner_id, title, model, metadata, parent_thread_id)
    VALUES (gen_random_uuid(), p_owner, p_title, p_model, coalesce(p_metadata, '{}'::jsonb), p_parent)
    RETURNING * INTO t;
    PERFORM agentloop_journal(t.id, 'thread', agentloop_thread_json(t));
    RETURN t;
END $$;

-- POST /api/threads/{id}/compact (SPEC §8): a child thread (parentThreadId = this one) and a
-- `compaction` run on it; the source thread is left untouched. p = {principalId, threadId,
-- defaultModel?, models}. Returns {thread, run}.
CREATE FUNCTION agentloop_compact(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_principal uuid := (p ->> 'principalId')::uuid;
    s threads := agentloop_lock_thread((p ->> 'threadId')::uuid, v_principal);
    c threads;
    r runs;
BEGIN
    c := agentloop_insert_thread(v_principal,
                                 CASE WHEN s.title = '' THEN 'compacted' ELSE s.title || ' (compacted)' END,
                                 s.model, s.metadata, s.id);
    r := agentloop_insert_run(c, v_principal, 'queued', agentloop_pick_model(s, p - 'model'), 1, NULL, NULL,
                              'compaction', s.id);
    SELECT * INTO c FROM threads WHERE id = c.id;
    PERFORM agentloop_notify(ARRAY[c.id]);
    RETURN jsonb_build_object('thread', agentloop_thread_json(c), 'run', agentloop_run_json(r));
END $$;

-- POST /v1/chat/completions: a hidden thread (metadata.stateless) with the request's messages
-- and a one-slice run. p = {principalId, model, messages}. Returns {threadId, run}.
CREATE FUNCTION agentloop_stateless(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_insert_thread((p ->> 'principalId')::uuid, 'stateless', p ->> 'model',
                                         '{"stateless": true}'::jsonb, NULL);
    r runs;
BEGIN
    PERFORM agentloop_append(t.id, NULL, NULL, p -> 'messages');
    r := agentloop_insert_run(t, (p ->> 'principalId')::uuid, 'queued', p ->> 'model', 1, NULL, NULL, 'agent', NULL);
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN jsonb_build_object('threadId', t.id, 'run', agentloop_run_json(r));
END $$;

-- A thread's model context and metadata (read only; manual compaction reads its source).
-- p = {threadId}. Returns agentloop_context(...) || {metadata}.
CREATE FUNCTION agentloop_read_context(p jsonb) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT agentloop_context(t.id) || jsonb_build_object('metadata', t.metadata)
      FROM threads t WHERE t.id = (p ->> 'threadId')::uuid
$$;

-- POST /api/threads. p = {principalId, title, model?, metadata}. Returns the thread.
CREATE FUNCTION agentloop_create_thread(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_insert_thread((p ->> 'principalId')::uuid, coalesce(p ->> 'title', ''), p ->> 'model',
                                         coalesce(p -> 'metadata', '{}'::jsonb), NULL);
BEGIN
    SELECT * INTO t FROM threads WHERE id = t.id;
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN agentloop_thread_json(t);
END $$;

-- PATCH /api/threads/{id}: changes the given fields (others untouched) and journals `thread`.
-- p = {principalId, threadId, title?, model?, metadata?}. Returns the thread.
CREATE FUNCTION agentloop_update_thread(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
BEGIN
    UPDATE threads SET title = coalesce(p ->> 'title', title),
                       model = coalesce(p ->> 'model', model),
                       metadata = CASE WHEN jsonb_typeof(p -> 'metadata') = 'object' THEN p -> 'metadata' ELSE metadata END,
                       updated_at = now()
     WHERE id = t.id RETURNING * INTO t;
    PERFORM agentloop_journal(t.id, 'thread', agentloop_thread_json(t));
    SELECT * INTO t FROM threads WHERE id = t.id;
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN agentloop_thread_json(t);
END $$;

-- A known outcome is never thrown away: when a worker got the answer of a dispatched call but
-- could not commit it in time (its lease was lost, or the database was away longer than the
-- lease), it records the outcome on the operation row it dispatched (matched by the fencing
-- token stored there), without the lease: the outcome is a fact, not a step of the run. A run
-- that is `blocked` with no uncertain operation left is then requeued, as after a resolve.
-- p = {runId, threadId, key, epoch, status: completed|failed, result}. Returns {recorded}.
CREATE FUNCTION agentloop_record_outcome(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_run uuid := (p ->> 'runId')::uuid;
    v_thread uuid := (p ->> 'threadId')::uuid;
    r runs;
BEGIN
    PERFORM 1 FROM threads WHERE id = v_thread FOR NO KEY UPDATE;
    SELECT * INTO r FROM runs WHERE id = v_run FOR UPDATE;
    UPDATE operations SET status = p ->> 'status', result = p ->> 'result', finished_at = now(), updated_at = now()
     WHERE key = p ->> 'key' AND run_id = v_run AND lease_epoch = (p ->> 'epoch')::bigint
       AND status IN ('dispatched', 'uncertain') AND resolution IS NULL;
    IF NOT FOUND THEN
        RETURN '{"recorded": false}'::jsonb;
    END IF;
    IF r.status = 'blocked' AND NOT EXISTS (SELECT 1 FROM operations WHERE run_id = v_run AND status = 'uncertain') THEN
        UPDATE runs SET status = 'queued', error_code = NULL, error_message = NULL, queued_at = now(), updated_at = now()
         WHERE id = v_run RETURNING * INTO r;
        PERFORM agentloop_journal(v_thread, 'run', agentloop_run_json(r));
        PERFORM agentloop_wake('queued:' || v_run);
        PERFORM agentloop_notify(ARRAY[v_thread]);
    END IF;
    RETURN '{"recorded": true}'::jsonb;
END $$;
