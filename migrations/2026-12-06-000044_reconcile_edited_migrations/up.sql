-- Databases first migrated by an earlier commit converge on the schema of a fresh one
-- (acceptance probe M, M-1). Eleven migrations were edited after they were first committed
-- (000020, 21, 22, 23, 26, 29, 31, 36, 37, 39, 42), and the runner records only versions: a
-- database that applied a migration before its edit kept the older SQL for good — on a database
-- from one window main's workers ran an `ask` tool without approval (000039: no per-row TTL), on
-- another a keyed /v1 request's run was cancelled and its paid answer lost (000036), on a third
-- the tool-call limit restarted per hand-back (000042). Which objects differ was found by
-- building, with psql, the schema of every commit before each such edit, migrating it with this
-- release's later migrations, and comparing `pg_dump --schema-only` with a fresh database: two
-- columns, three functions left over under an old signature, and fifteen functions whose text
-- differs. Here they are as a fresh database has them (the function texts are
-- `pg_get_functiondef` of a fresh database at 000043); on a fresh database every statement
-- leaves things as they are. From now on the runner records each migration's checksum and stops
-- on a migration changed after it was applied (agentloop_shared::db, migrations/README.md).
ALTER TABLE runs ADD COLUMN IF NOT EXISTS outages integer NOT NULL DEFAULT 0;
-- commit
ALTER TABLE worker_tool_policies ADD COLUMN IF NOT EXISTS ttl_ms bigint NOT NULL DEFAULT 30000;
-- commit
DROP FUNCTION IF EXISTS agentloop_check_effects(uuid, bigint, jsonb);
DROP FUNCTION IF EXISTS agentloop_effects_from(uuid, bigint);
DROP FUNCTION IF EXISTS agentloop_openai_release(uuid);

CREATE OR REPLACE FUNCTION agentloop_outage_fault(p_outages integer, p_outage integer)
 RETURNS integer
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$
    SELECT CASE WHEN p_outage > 0 AND (p_outages + p_outage) % 10 = 0 THEN 1 ELSE 0 END
$function$;

CREATE OR REPLACE FUNCTION agentloop_effects_in(p_thread uuid, p_sequences bigint[])
 RETURNS text
 LANGUAGE sql
 STABLE
AS $function$
    SELECT string_agg(DISTINCT o.tool_name, ', ' ORDER BY o.tool_name)
      FROM operations o
     WHERE o.thread_id = p_thread AND o.status IN ('dispatched', 'completed', 'uncertain')
       AND EXISTS (SELECT 1 FROM messages m
                    WHERE m.run_id = o.run_id AND m.thread_id = p_thread AND m.sequence = ANY(p_sequences)
                      AND (m.tool_call_id = o.tool_call_id
                           OR (m.tool_calls IS NOT NULL
                               AND m.tool_calls @> jsonb_build_array(jsonb_build_object('id', o.tool_call_id)))))
$function$;

CREATE OR REPLACE FUNCTION agentloop_active_from(p_thread uuid, p_from bigint)
 RETURNS bigint[]
 LANGUAGE sql
 STABLE
AS $function$
    SELECT coalesce(array_agg(sequence), '{}') FROM messages WHERE thread_id = p_thread AND active AND sequence >= p_from
$function$;

CREATE OR REPLACE FUNCTION agentloop_check_effects(p_thread uuid, p_sequences bigint[], p jsonb)
 RETURNS void
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_tools text;
BEGIN
    IF coalesce((p ->> 'repeatEffects')::boolean, false) THEN
        RETURN;
    END IF;
    v_tools := agentloop_effects_in(p_thread, p_sequences);
    IF v_tools IS NOT NULL THEN
        PERFORM agentloop_refuse(409, 'effects_in_branch',
            'the messages this takes out of the conversation hold tool calls that took effect or may have (' || v_tools
            || '): they are not undone, and the model, no longer seeing them, may make them again; send repeatEffects: true to go ahead');
    END IF;
END $function$;

CREATE OR REPLACE FUNCTION agentloop_activate_branch(p jsonb)
 RETURNS jsonb
 LANGUAGE plpgsql
AS $function$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
    m messages;
    v_parent bigint;
    v_target bigint := (p ->> 'firstSequence')::bigint;
    b message_branches;
    v_current bigint[];
    v_done jsonb;
    v_activated jsonb;
    v_n int;
BEGIN
    PERFORM agentloop_ensure_idle(t.id);
    m := agentloop_active_at(t.id, (p ->> 'sequence')::bigint);
    v_parent := agentloop_fork_of(t.id, m.sequence);
    IF v_parent IS NULL THEN
        PERFORM agentloop_refuse(404, 'not_found', 'this message has no other branch');
    END IF;
    IF v_target = m.sequence THEN
        RETURN jsonb_build_object('parentSequence', v_parent, 'activated', '[]'::jsonb, 'deactivated', '[]'::jsonb);
    END IF;
    SELECT * INTO b FROM message_branches
     WHERE thread_id = t.id AND parent_sequence = v_parent AND first_sequence = v_target FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM agentloop_refuse(404, 'not_found', format('no branch starting at message %s here', v_target));
    END IF;
    v_current := ARRAY(SELECT sequence FROM messages WHERE thread_id = t.id AND active AND sequence > v_parent
                        ORDER BY sequence);
    PERFORM agentloop_check_effects(t.id, ARRAY(SELECT unnest(v_current) EXCEPT SELECT unnest(b.sequences)), p);
    INSERT INTO message_branches (thread_id, parent_sequence, first_sequence, sequences)
    VALUES (t.id, v_parent, v_current[1], v_current)
    ON CONFLICT (thread_id, parent_sequence, first_sequence) DO UPDATE SET sequences = excluded.sequences;
    v_done := agentloop_deactivate(t.id, v_current);
    WITH a AS (
        UPDATE messages SET active = true
         WHERE thread_id = t.id AND NOT active AND sequence = ANY(b.sequences) RETURNING sequence
    )
    SELECT coalesce(jsonb_agg(sequence ORDER BY sequence), '[]'::jsonb), count(*) INTO v_activated, v_n FROM a;
    UPDATE threads SET message_count = message_count + v_n, updated_at = now() WHERE id = t.id;
    DELETE FROM message_branches WHERE thread_id = t.id AND parent_sequence = v_parent AND first_sequence = v_target;
    PERFORM agentloop_journal(t.id, 'branch_switched', jsonb_build_object(
        'parentSequence', v_parent, 'activated', v_activated, 'deactivated', v_done));
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN jsonb_build_object('parentSequence', v_parent, 'activated', v_activated, 'deactivated', v_done);
END $function$;

CREATE OR REPLACE FUNCTION agentloop_commit_group(p jsonb)
 RETURNS jsonb
 LANGUAGE plpgsql
 SET lock_timeout TO '250ms'
AS $function$
DECLARE
    v_item jsonb;
    v_out jsonb[] := '{}';
BEGIN
    FOR v_item IN SELECT value FROM jsonb_array_elements(p -> 'items') WITH ORDINALITY ORDER BY ordinality LOOP
        v_out := v_out || agentloop_commit(v_item);
    END LOOP;
    RETURN to_jsonb(v_out);
END $function$;

CREATE OR REPLACE FUNCTION agentloop_delete_message(p jsonb)
 RETURNS jsonb
 LANGUAGE plpgsql
AS $function$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
    m messages;
    v_group bigint[];
    v_done jsonb;
BEGIN
    m := agentloop_active_at(t.id, (p ->> 'sequence')::bigint);
    PERFORM agentloop_ensure_idle(t.id);
    v_group := agentloop_tool_group(m);
    PERFORM agentloop_check_effects(t.id, v_group, p);
    v_done := agentloop_deactivate(t.id, v_group);
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN jsonb_build_object('deactivated', v_done);
END $function$;

CREATE OR REPLACE FUNCTION agentloop_edit_branching(p jsonb)
 RETURNS jsonb
 LANGUAGE plpgsql
AS $function$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
    v_from bigint;
BEGIN
    -- A message that does not exist is 404 before a busy thread's 409 (acceptance probe F).
    v_from := agentloop_branch_start(t.id, (p ->> 'sequence')::bigint, true);
    PERFORM agentloop_ensure_idle(t.id);
    PERFORM agentloop_check_effects(t.id, agentloop_active_from(t.id, v_from), p);
    PERFORM agentloop_save_branch(t.id, v_from);
    RETURN agentloop_edit(p);
END $function$;

CREATE OR REPLACE FUNCTION agentloop_end_run(p_run uuid, p_step bigint, p_end jsonb, p_usage jsonb DEFAULT '{}'::jsonb, p_last_commit jsonb DEFAULT NULL::jsonb)
 RETURNS runs
 LANGUAGE plpgsql
AS $function$
DECLARE
    r runs;
    v_end text := p_end ->> 'status';
    v_status text;
    v_step_status text;
    v_code text := p_end ->> 'code';
    v_message text := p_end ->> 'message';
    v_steps int := CASE WHEN p_step IS NULL THEN 0 ELSE 1 END;
    v_faults int := 0;
    v_outage int := 0;
    a tool_approvals;
    v_partial jsonb;
BEGIN
    SELECT * INTO r FROM runs WHERE id = p_run;
    IF v_end IN ('waiting_approval', 'waiting_authorization') AND r.cancel_requested_at IS NOT NULL THEN
        v_end := 'cancelled';
    END IF;
    IF v_end IN ('cancelled', 'interrupted', 'handback', 'failed', 'blocked') THEN
        UPDATE operations SET status = 'uncertain', updated_at = now() WHERE run_id = p_run AND status = 'dispatched';
        IF r.cancel_requested_at IS NOT NULL AND EXISTS (SELECT 1 FROM operations WHERE run_id = p_run AND status = 'uncertain') THEN
            -- The user asked for the end (cancel, interrupt, thread deleted): it ends
            -- `cancelled`; an uncertain operation stays `uncertain` (resolvable for the record)
            -- and its call's result says the outcome is unknown (agentloop_close_dangling).
            v_end := 'cancelled';
            v_code := NULL;
            v_message := NULL;
        ELSIF EXISTS (SELECT 1 FROM operations WHERE run_id = p_run AND status = 'uncertain') THEN
            v_end := 'blocked';
            v_code := 'operation_uncertain';
            v_message := agentloop_blocker_message(p_run);
        END IF;
    END IF;
    CASE v_end
        WHEN 'completed' THEN v_status := 'completed'; v_step_status := 'completed';
        WHEN 'requeued' THEN v_status := 'queued'; v_step_status := 'requeued';
        WHEN 'interrupted' THEN v_status := 'queued'; v_step_status := 'interrupted'; v_steps := 0;
        WHEN 'handback' THEN v_status := 'queued'; v_step_status := 'interrupted'; v_steps := 0;
            -- An outage (`fault: false`) says nothing about the run (4. above).
            v_outage := CASE WHEN (p_end ->> 'fault')::boolean IS FALSE THEN 1 ELSE 0 END;
            v_faults := 1 - v_outage;
        WHEN 'failed' THEN v_status := 'failed'; v_step_status := 'failed';
        WHEN 'cancelled' THEN v_status := 'cancelled'; v_step_status := 'cancelled';
        WHEN 'waiting_approval' THEN v_status := 'waiting_approval'; v_step_status := 'waiting_approval';
        WHEN 'waiting_authorization' THEN v_status := 'waiting_authorization'; v_step_status := 'waiting_authorization';
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
                    faults = CASE WHEN (p_usage ->> 'progress')::boolean THEN 0 ELSE faults END + v_faults
                             + agentloop_outage_fault(outages, v_outage),
                    outages = outages + v_outage,
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
        PERFORM agentloop_mcp_cancel_authorizations(p_run);
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
END $function$;

CREATE OR REPLACE FUNCTION agentloop_import(p jsonb)
 RETURNS jsonb
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_principal uuid := (p ->> 'principalId')::uuid;
    v_key text := p ->> 'commandId';
    v_fingerprint text;
    v_response jsonb;
    v_now bigint := (extract(epoch FROM clock_timestamp()) * 1000)::bigint;
    v_count int := coalesce(jsonb_array_length(p -> 'messages'), 0);
    v_last bigint;
    t threads;
BEGIN
    IF v_key IS NOT NULL THEN
        INSERT INTO command_receipts (principal_id, command_id, fingerprint)
        VALUES (v_principal, v_key, p ->> 'fingerprint') ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            SELECT fingerprint, response INTO v_fingerprint, v_response FROM command_receipts
             WHERE principal_id = v_principal AND command_id = v_key;
            IF v_response IS NOT NULL AND v_fingerprint = p ->> 'fingerprint' THEN
                RETURN v_response || '{"replayed": true}'::jsonb;
            END IF;
            PERFORM agentloop_refuse(409, 'idempotency_conflict',
                                     'this idempotency key was already used with a different request');
        END IF;
    END IF;
    INSERT INTO threads (id, owner_id, title, model, metadata, created_at)
    VALUES (gen_random_uuid(), v_principal, coalesce(p ->> 'title', ''), p ->> 'model',
            coalesce(p -> 'metadata', '{}'::jsonb), coalesce((p ->> 'createdAt')::timestamptz, now()))
    RETURNING * INTO t;
    WITH src AS (
        -- The api fills every row's time (missing ones from their neighbours); a row without
        -- one still gets a valid identity.
        SELECT e.m, e.ord, coalesce((e.m ->> 'timestamp')::bigint, v_now) AS ts
          FROM jsonb_array_elements(p -> 'messages') WITH ORDINALITY AS e(m, ord)
    ), mono AS (
        SELECT m, ord, ord + max(ts - ord) OVER (ORDER BY ord ROWS UNBOUNDED PRECEDING) AS ts FROM src
    ), ins AS (
        INSERT INTO messages (thread_id, sequence, timestamp_ms, role, content, tool_calls, tool_call_id,
                              reasoning, token_estimate, byte_size, stopped, finish_reason, created_at)
        SELECT t.id, ord, ts, m ->> 'role', coalesce(m -> 'content', '""'::jsonb),
               nullif(m -> 'toolCalls', 'null'::jsonb), m ->> 'toolCallId', m ->> 'reasoning',
               coalesce((m ->> 'tokenEstimate')::int, 0),
               coalesce((m ->> 'byteSize')::int, octet_length((m -> 'content')::text)),
               coalesce((m ->> 'stopped')::boolean, false), left(m ->> 'finishReason', 64),
               coalesce((m ->> 'createdAt')::timestamptz, to_timestamp(ts / 1000.0))
          FROM mono
        RETURNING timestamp_ms
    )
    SELECT max(timestamp_ms) INTO v_last FROM ins;
    UPDATE threads SET last_sequence = v_count, message_count = v_count, last_timestamp_ms = coalesce(v_last, 0),
                       updated_at = now()
     WHERE id = t.id RETURNING * INTO t;
    PERFORM agentloop_journal(t.id, 'thread', agentloop_thread_json(t));
    SELECT * INTO t FROM threads WHERE id = t.id;
    v_response := jsonb_build_object('thread', agentloop_thread_json(t), 'messages', v_count, 'format', p ->> 'format',
                                     'repairs', coalesce(p -> 'repairs', '[]'::jsonb));
    IF v_key IS NOT NULL THEN
        UPDATE command_receipts SET response = v_response, thread_id = t.id
         WHERE principal_id = v_principal AND command_id = v_key;
    END IF;
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN v_response;
END $function$;

CREATE OR REPLACE FUNCTION agentloop_openai_sweep(p jsonb)
 RETURNS jsonb
 LANGUAGE plpgsql
AS $function$
DECLARE
    q record;
    v_purged int := 0;
    v_pending int := 0;
    v_threads uuid[] := '{}';
BEGIN
    -- p.spareMs: leases that expired less than this long ago are left (the caller's database
    -- outage ended recently: the apis renew them now).
    FOR q IN SELECT thread_id, command_id, created_at FROM openai_requests
              WHERE expires_at < now() - make_interval(secs => coalesce((p ->> 'spareMs')::bigint, 0) / 1000.0)
              ORDER BY expires_at LIMIT coalesce((p ->> 'limit')::int, 100) LOOP
        PERFORM 1 FROM threads WHERE id = q.thread_id FOR NO KEY UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        -- A keyed request whose api is gone (dead or paused past its lease): its run goes on
        -- for the resend, as when its client goes away, up to the request's own bound (600 s,
        -- MAX_WAIT); looked at again in 5 s. A resend attaches to it, or gets its outcome from
        -- the thread once it ended (verification probe G: the sweep cut keyed runs).
        IF q.command_id IS NOT NULL AND q.created_at > now() - interval '600 seconds'
           AND EXISTS (SELECT 1 FROM runs WHERE thread_id = q.thread_id
                        AND status IN ('pending', 'queued', 'running', 'waiting_approval', 'waiting_authorization', 'blocked')) THEN
            UPDATE openai_requests SET expires_at = now() + interval '5 seconds' WHERE thread_id = q.thread_id;
            CONTINUE;
        END IF;
        IF agentloop_openai_release(q.thread_id, false) THEN
            v_purged := v_purged + 1;
        ELSE
            v_pending := v_pending + 1;
            v_threads := v_threads || q.thread_id;
        END IF;
    END LOOP;
    PERFORM agentloop_notify(v_threads);
    RETURN jsonb_build_object(
        'purged', v_purged, 'pending', v_pending,
        'nextExpiryMs', (SELECT greatest((extract(epoch FROM (min(expires_at) - now())) * 1000)::bigint, 0)
                           FROM openai_requests WHERE expires_at >= now()));
END $function$;

CREATE OR REPLACE FUNCTION agentloop_publish_tool_policy(p jsonb)
 RETURNS jsonb
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_key text := p ->> 'workerKey';
    v_ttl interval := make_interval(secs => coalesce((p ->> 'ttlMs')::bigint, 30000) / 1000.0);
BEGIN
    IF coalesce((p ->> 'leaving')::boolean, false) THEN
        DELETE FROM worker_tool_policies WHERE worker_key = v_key;
        RETURN '{"others": []}'::jsonb;
    END IF;
    INSERT INTO worker_tool_policies (worker_key, policy, seen_at, ttl_ms)
    VALUES (v_key, p -> 'policy', now(), (extract(epoch FROM v_ttl) * 1000)::bigint)
    ON CONFLICT (worker_key) DO UPDATE SET policy = excluded.policy, seen_at = excluded.seen_at, ttl_ms = excluded.ttl_ms;
    DELETE FROM worker_tool_policies WHERE seen_at < now() - make_interval(secs => ttl_ms / 1000.0);
    RETURN jsonb_build_object('others', coalesce((SELECT jsonb_agg(policy ORDER BY worker_key) FROM worker_tool_policies
                                                   WHERE worker_key <> v_key), '[]'::jsonb));
END $function$;

CREATE OR REPLACE FUNCTION agentloop_regenerate_branching(p jsonb)
 RETURNS jsonb
 LANGUAGE plpgsql
AS $function$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
    v_from bigint;
BEGIN
    -- A message that does not exist is 404 before a busy thread's 409 (acceptance probe F).
    v_from := agentloop_branch_start(t.id, (p ->> 'sequence')::bigint, false);
    PERFORM agentloop_ensure_idle(t.id);
    PERFORM agentloop_check_effects(t.id, agentloop_active_from(t.id, v_from), p);
    PERFORM agentloop_save_branch(t.id, v_from);
    RETURN agentloop_regenerate(p);
END $function$;

CREATE OR REPLACE FUNCTION agentloop_slice_start(p jsonb)
 RETURNS jsonb
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
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
        'step', jsonb_build_object('id', s.id, 'sequence', s.sequence, 'toolCalls', s.tool_calls),
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
END $function$;

CREATE OR REPLACE FUNCTION agentloop_slice_start_group(p jsonb)
 RETURNS jsonb
 LANGUAGE plpgsql
 SET lock_timeout TO '250ms'
AS $function$
DECLARE
    v_item jsonb;
    v_out jsonb[] := '{}';
BEGIN
    FOR v_item IN SELECT value FROM jsonb_array_elements(p -> 'items') WITH ORDINALITY ORDER BY ordinality LOOP
        v_out := v_out || agentloop_slice_start(v_item);
    END LOOP;
    RETURN to_jsonb(v_out);
END $function$;
