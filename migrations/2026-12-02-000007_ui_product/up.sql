-- The web UI as a product (issue 11): branches, automatic titles, delete with undo, full-text
-- search. Every function here is NEW (nothing of 000005 is replaced); the ones that change a
-- thread's messages follow the write path of docs/architecture.md §4: one call, one
-- transaction, the lock order thread -> runs, refusals as SQLSTATE AL<status>.

---------------------------------------------------------------------------------------------
-- Branches (SPEC §3: rows are never rewritten except `active`)
---------------------------------------------------------------------------------------------

-- A saved alternative continuation of a thread after message `parent_sequence` (0: the start):
-- the active rows after the parent when the user left that alternative (by edit, regenerate or
-- switching to another one). The alternative the thread shows now is not stored: it is the
-- active rows after the parent. `first_sequence` identifies an alternative (its first row).
CREATE TABLE message_branches (
    thread_id        uuid NOT NULL REFERENCES threads (id) ON DELETE CASCADE,
    parent_sequence  bigint NOT NULL,
    first_sequence   bigint NOT NULL,
    sequences        bigint[] NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (thread_id, parent_sequence, first_sequence)
);

-- The fork point (parent sequence) whose current alternative starts at active message
-- p_sequence: the highest recorded parent in [previous active sequence, p_sequence). The range
-- (not an equality) keeps a fork findable after its parent row was deleted. NULL when none.
CREATE FUNCTION agentloop_fork_of(p_thread uuid, p_sequence bigint) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT max(b.parent_sequence) FROM message_branches b
     WHERE b.thread_id = p_thread AND b.parent_sequence < p_sequence
       AND b.parent_sequence >= coalesce((SELECT max(sequence) FROM messages
                                            WHERE thread_id = p_thread AND active AND sequence < p_sequence), 0)
$$;

-- Saves the thread's current alternative after the active row before p_from (the rows about to
-- be replaced by an edit or a regenerate): `{parentSequence, firstSequence}` or NULL when
-- nothing is active from p_from on. The thread is locked by the caller.
CREATE FUNCTION agentloop_save_branch(p_thread uuid, p_from bigint) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_parent bigint := coalesce((SELECT max(sequence) FROM messages
                                  WHERE thread_id = p_thread AND active AND sequence < p_from), 0);
    v_seqs bigint[];
BEGIN
    v_seqs := ARRAY(SELECT sequence FROM messages WHERE thread_id = p_thread AND active AND sequence > v_parent
                     ORDER BY sequence);
    IF cardinality(v_seqs) = 0 THEN
        RETURN NULL;
    END IF;
    -- A parent deleted since the fork keeps its record: reuse the fork found by range.
    v_parent := coalesce(agentloop_fork_of(p_thread, v_seqs[1]), v_parent);
    INSERT INTO message_branches (thread_id, parent_sequence, first_sequence, sequences)
    VALUES (p_thread, v_parent, v_seqs[1], v_seqs)
    ON CONFLICT (thread_id, parent_sequence, first_sequence) DO UPDATE SET sequences = excluded.sequences;
    RETURN jsonb_build_object('parentSequence', v_parent, 'firstSequence', v_seqs[1]);
END $$;

-- The start of the rows an edit (user message at p.sequence) or a regenerate (from p.sequence)
-- replaces, as agentloop_edit / agentloop_regenerate compute it.
CREATE FUNCTION agentloop_branch_start(p_thread uuid, p_sequence bigint, p_edit boolean) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    m messages := agentloop_active_at(p_thread, p_sequence);
BEGIN
    IF p_edit OR m.role <> 'user' THEN
        RETURN CASE WHEN p_edit THEN m.sequence ELSE (agentloop_tool_group(m))[1] END;
    END IF;
    RETURN m.sequence + 1;
END $$;

-- POST /api/threads/{id}/messages/{sequence}/edit with the replaced rows kept as a branch: locks
-- the thread, refuses while a run is active (as agentloop_edit does), saves the current
-- alternative, then applies agentloop_edit (same arguments, same result).
CREATE FUNCTION agentloop_edit_branching(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
BEGIN
    PERFORM agentloop_ensure_idle(t.id);
    PERFORM agentloop_save_branch(t.id, agentloop_branch_start(t.id, (p ->> 'sequence')::bigint, true));
    RETURN agentloop_edit(p);
END $$;

-- POST .../regenerate with the replaced rows kept as a branch (see agentloop_edit_branching).
CREATE FUNCTION agentloop_regenerate_branching(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads := agentloop_lock_thread((p ->> 'threadId')::uuid, (p ->> 'principalId')::uuid);
BEGIN
    PERFORM agentloop_ensure_idle(t.id);
    PERFORM agentloop_save_branch(t.id, agentloop_branch_start(t.id, (p ->> 'sequence')::bigint, false));
    RETURN agentloop_regenerate(p);
END $$;

-- POST /api/threads/{id}/messages/{sequence}/branches/activate: shows alternative
-- p.firstSequence of the fork whose current alternative starts at active message p.sequence.
-- The current alternative is saved and deactivated (agentloop_deactivate: message_count,
-- snapshots, `messages_deactivated`), the chosen one's rows are reactivated and its record
-- removed (it is current now), and `branch_switched {parentSequence, activated, deactivated}`
-- is journaled. Refused while a run is active (409 run_active / approval_required); 404 when
-- the message or the alternative does not exist. p = {principalId, threadId, sequence,
-- firstSequence}. Returns {parentSequence, activated, deactivated}.
CREATE FUNCTION agentloop_activate_branch(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
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
END $$;

---------------------------------------------------------------------------------------------
-- Titles and delete with undo
---------------------------------------------------------------------------------------------

-- Automatic title (worker, after the first answer of a thread). Without p.title it only reads:
-- {needed: true} while the thread is untitled (and not deleted), else {needed: false}. With
-- p.title it sets the title only while the thread is still untitled, so a rename always wins
-- and a repeated call changes nothing; clears the api's `metadata.autoTitle` marker; journals
-- `thread`. p = {threadId, title?}. Returns {needed} or {set}.
CREATE FUNCTION agentloop_auto_title(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads;
BEGIN
    IF coalesce(p ->> 'title', '') = '' THEN
        RETURN jsonb_build_object('needed', EXISTS (SELECT 1 FROM threads WHERE id = (p ->> 'threadId')::uuid
                                                                        AND deleted_at IS NULL AND title = ''));
    END IF;
    SELECT * INTO t FROM threads WHERE id = (p ->> 'threadId')::uuid AND deleted_at IS NULL FOR NO KEY UPDATE;
    IF NOT FOUND OR t.title <> '' THEN
        RETURN '{"set": false}'::jsonb;
    END IF;
    UPDATE threads SET title = left(p ->> 'title', 500), metadata = metadata - 'autoTitle'
     WHERE id = t.id RETURNING * INTO t;
    PERFORM agentloop_journal(t.id, 'thread', agentloop_thread_json(t));
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN '{"set": true}'::jsonb;
END $$;

-- POST /api/threads/{id}/restore: undoes a delete within p.windowMs of it (the thread and its
-- history come back; runs the delete cancelled stay cancelled). 404 when the thread is not the
-- caller's, not deleted, or deleted longer ago. p = {principalId, threadId, windowMs}.
-- Returns the thread.
CREATE FUNCTION agentloop_restore_thread(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    t threads;
BEGIN
    SELECT * INTO t FROM threads
     WHERE id = (p ->> 'threadId')::uuid AND owner_id = (p ->> 'principalId')::uuid
       AND deleted_at IS NOT NULL AND deleted_at > now() - make_interval(secs => (p ->> 'windowMs')::double precision / 1000)
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        PERFORM agentloop_refuse(404, 'not_found', 'no deleted thread to restore (the undo window may have passed)');
    END IF;
    UPDATE threads SET deleted_at = NULL, updated_at = now() WHERE id = t.id RETURNING * INTO t;
    PERFORM agentloop_journal(t.id, 'thread', agentloop_thread_json(t));
    PERFORM agentloop_notify(ARRAY[t.id]);
    RETURN agentloop_thread_json(t);
END $$;

---------------------------------------------------------------------------------------------
-- Full-text search over titles and message text
---------------------------------------------------------------------------------------------

-- The searchable text of message content: a string, or the `text` of its text parts.
CREATE FUNCTION agentloop_search_text(c jsonb) RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE jsonb_typeof(c)
        WHEN 'string' THEN c #>> '{}'
        WHEN 'array' THEN (SELECT string_agg(e ->> 'text', ' ') FROM jsonb_array_elements(c) e
                            WHERE jsonb_typeof(e) = 'object' AND e ->> 'type' = 'text')
        ELSE '' END
$$;

-- The 'simple' configuration (no stemming: any language; the api adds prefix matching).
-- Only the conversation's own words: active user and assistant rows.
CREATE INDEX messages_search ON messages USING gin (to_tsvector('simple', agentloop_search_text(content)))
    WHERE active AND role IN ('user', 'assistant');
CREATE INDEX threads_search ON threads USING gin (to_tsvector('simple', title)) WHERE deleted_at IS NULL;

---------------------------------------------------------------------------------------------
-- Reads (called on the api's read pool; no locks)
---------------------------------------------------------------------------------------------

-- The alternatives of the fork whose current alternative starts at active message p_sequence:
-- {parentSequence, index (1-based, of the shown one), count, branches: [{firstSequence, active,
-- messages, preview, createdAt}]} in the order they were made (first sequence), or NULL when
-- the message starts no alternative.
CREATE FUNCTION agentloop_branches_of(p_thread uuid, p_sequence bigint) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_parent bigint := agentloop_fork_of(p_thread, p_sequence);
    v_list jsonb;
BEGIN
    IF v_parent IS NULL OR NOT EXISTS (SELECT 1 FROM messages WHERE thread_id = p_thread AND active
                                                              AND sequence = p_sequence) THEN
        RETURN NULL;
    END IF;
    SELECT jsonb_agg(x ORDER BY (x ->> 'firstSequence')::bigint) INTO v_list FROM (
        SELECT jsonb_build_object('firstSequence', b.first_sequence, 'active', false,
                                  'messages', cardinality(b.sequences), 'createdAt', m.created_at,
                                  'preview', left(agentloop_search_text(m.content), 120)) AS x
          FROM message_branches b
          LEFT JOIN messages m ON m.thread_id = b.thread_id AND m.sequence = b.first_sequence
         WHERE b.thread_id = p_thread AND b.parent_sequence = v_parent
        UNION ALL
        SELECT jsonb_build_object('firstSequence', m.sequence, 'active', true,
                                  'messages', (SELECT count(*) FROM messages WHERE thread_id = p_thread AND active
                                                                             AND sequence > v_parent),
                                  'createdAt', m.created_at, 'preview', left(agentloop_search_text(m.content), 120))
          FROM messages m WHERE m.thread_id = p_thread AND m.sequence = p_sequence
    ) s;
    RETURN jsonb_build_object(
        'parentSequence', v_parent,
        'count', jsonb_array_length(v_list),
        'index', (SELECT i FROM jsonb_array_elements(v_list) WITH ORDINALITY e(x, i) WHERE (x ->> 'active')::boolean),
        'branches', v_list);
END $$;

-- Branch switchers of the active messages with sequences in [p_from, p_to]: [{sequence, index,
-- count}] for each message that starts an alternative. Index range scans over the forks whose
-- parent lies in the range (and the one just before it).
CREATE FUNCTION agentloop_branch_marks(p_thread uuid, p_from bigint, p_to bigint) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    WITH forks AS (
        SELECT b.parent_sequence, count(*) AS saved,
               count(*) FILTER (WHERE b.first_sequence < (SELECT min(sequence) FROM messages
                                                           WHERE thread_id = p_thread AND active
                                                             AND sequence > b.parent_sequence)) AS before
          FROM message_branches b
         WHERE b.thread_id = p_thread AND b.parent_sequence < p_to
           AND b.parent_sequence >= coalesce((SELECT max(sequence) FROM messages
                                               WHERE thread_id = p_thread AND active AND sequence < p_from), 0)
         GROUP BY b.parent_sequence
    ), marks AS (
        SELECT (SELECT min(sequence) FROM messages WHERE thread_id = p_thread AND active
                                                    AND sequence > f.parent_sequence) AS sequence,
               f.saved, f.before
          FROM forks f
    )
    SELECT coalesce(jsonb_agg(jsonb_build_object('sequence', sequence, 'index', before + 1, 'count', saved + 1)
                              ORDER BY sequence), '[]'::jsonb)
      FROM marks WHERE sequence BETWEEN p_from AND p_to
$$;

-- Search of one principal's threads: titles and active user/assistant message text matching
-- tsquery p.query ('simple' configuration). p = {principalId, query, limit}. Returns
-- {threads: [{id, title, updatedAt}], messages: [{threadId, title, sequence, role, snippet,
-- createdAt}]}; snippets mark matches with U+0002 ... U+0003.
CREATE FUNCTION agentloop_search(p jsonb) RETURNS jsonb LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_owner uuid := (p ->> 'principalId')::uuid;
    q tsquery := to_tsquery('simple', p ->> 'query');
    v_limit int := least(greatest(coalesce((p ->> 'limit')::int, 20), 1), 100);
    v_threads jsonb;
    v_messages jsonb;
BEGIN
    SELECT coalesce(jsonb_agg(x ORDER BY u DESC), '[]'::jsonb) INTO v_threads FROM (
        SELECT jsonb_build_object('id', t.id, 'title', t.title, 'updatedAt', t.updated_at) AS x, t.updated_at AS u
          FROM threads t
         WHERE t.owner_id = v_owner AND t.deleted_at IS NULL AND to_tsvector('simple', t.title) @@ q
           AND NOT coalesce((t.metadata ->> 'stateless')::boolean, false)
         ORDER BY t.updated_at DESC LIMIT v_limit) s;
    SELECT coalesce(jsonb_agg(x ORDER BY c DESC), '[]'::jsonb) INTO v_messages FROM (
        SELECT jsonb_build_object('threadId', t.id, 'title', t.title, 'sequence', m.sequence, 'role', m.role,
                                  'createdAt', m.created_at,
                                  'snippet', ts_headline('simple', agentloop_search_text(m.content), q,
                                      'StartSel=' || chr(2) || ', StopSel=' || chr(3) || ', MaxWords=24, MinWords=8, MaxFragments=1')) AS x,
               m.created_at AS c
          FROM messages m JOIN threads t ON t.id = m.thread_id
         WHERE m.active AND m.role IN ('user', 'assistant')
           AND to_tsvector('simple', agentloop_search_text(m.content)) @@ q
           AND t.owner_id = v_owner AND t.deleted_at IS NULL
           AND NOT coalesce((t.metadata ->> 'stateless')::boolean, false)
         ORDER BY m.created_at DESC LIMIT v_limit) s;
    RETURN jsonb_build_object('threads', v_threads, 'messages', v_messages);
END $$;

-- What the run inspector shows besides the run and its steps (GET /api/runs/{id}):
-- {liveness, toolCalls, toolCallsTotal, compactions}.
-- liveness = {state, sinceMs?, expiresInMs?, serverTime}: `unclaimed` (queued longer than
-- p_unclaimed_ms without a worker claiming it), `lease_stale` (running, but its lease was not
-- renewed for longer than two renewal intervals: the worker may be gone; recovery starts when the
-- lease expires), `lease_expired` (running with an expired lease: waiting for a worker to claim
-- it again), else `ok`; `sinceMs` is how long the condition lasts.
-- toolCalls = the run's last 300 calls in order: {id, name, arguments (first 2,000 chars),
-- stepId, requestedAt, finishedAt, durationMs, result (first 300 chars), resultSequence,
-- ledger (operation status or null), dispatches, approval (status or null)}; durations run from
-- the checkpoint of the call message to the commit of its result.
-- compactions = snapshots the run wrote: {version, fromSequence, toSequence, tokens, createdAt}.
CREATE FUNCTION agentloop_run_inspect(p_run uuid, p_lease_ms bigint, p_renew_ms bigint, p_unclaimed_ms bigint)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    r runs;
    v_now timestamptz := clock_timestamp();
    v_ms bigint;
    v_live jsonb;
    v_calls jsonb;
    v_total bigint;
    v_compactions jsonb;
BEGIN
    SELECT * INTO r FROM runs WHERE id = p_run;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    v_live := jsonb_build_object('state', 'ok');
    IF r.status = 'queued' AND r.queued_at IS NOT NULL THEN
        v_ms := (extract(epoch FROM v_now - r.queued_at) * 1000)::bigint;
        IF v_ms > p_unclaimed_ms THEN
            v_live := jsonb_build_object('state', 'unclaimed', 'sinceMs', v_ms);
        END IF;
    ELSIF r.status = 'running' AND r.lease_expires_at IS NOT NULL THEN
        v_ms := (extract(epoch FROM r.lease_expires_at - v_now) * 1000)::bigint;
        IF v_ms < 0 THEN
            v_live := jsonb_build_object('state', 'lease_expired', 'sinceMs', -v_ms);
        ELSIF p_lease_ms - v_ms > 2 * p_renew_ms THEN
            v_live := jsonb_build_object('state', 'lease_stale', 'sinceMs', p_lease_ms - v_ms, 'expiresInMs', v_ms);
        END IF;
    END IF;
    v_live := v_live || jsonb_build_object('serverTime', v_now);

    WITH rm AS (
        SELECT * FROM messages WHERE run_id = p_run
    ), calls AS (
        SELECT m.sequence, m.step_id, m.created_at, c.ord, c.call
          FROM rm m CROSS JOIN LATERAL jsonb_array_elements(m.tool_calls) WITH ORDINALITY AS c(call, ord)
         WHERE m.role = 'assistant' AND jsonb_typeof(m.tool_calls) = 'array'
    ), numbered AS (
        SELECT calls.*, count(*) OVER () AS total, row_number() OVER (ORDER BY sequence DESC, ord DESC) AS back
          FROM calls
    )
    SELECT coalesce(jsonb_agg(jsonb_build_object(
               'id', n.call ->> 'id', 'name', n.call #>> '{function,name}',
               'arguments', left(n.call #>> '{function,arguments}', 2000),
               'stepId', n.step_id, 'requestedAt', n.created_at, 'finishedAt', res.created_at,
               'durationMs', (extract(epoch FROM res.created_at - n.created_at) * 1000)::bigint,
               'result', left(agentloop_search_text(res.content), 300), 'resultSequence', res.sequence,
               'ledger', o.status, 'dispatches', o.dispatches, 'approval', a.status)
             ORDER BY n.sequence, n.ord), '[]'::jsonb),
           coalesce(max(n.total), 0)
      INTO v_calls, v_total
      FROM numbered n
      LEFT JOIN LATERAL (SELECT * FROM rm WHERE rm.role = 'tool' AND rm.tool_call_id = n.call ->> 'id'
                          ORDER BY rm.sequence LIMIT 1) res ON true
      LEFT JOIN operations o ON o.run_id = p_run AND o.tool_call_id = n.call ->> 'id'
      LEFT JOIN LATERAL (SELECT status FROM tool_approvals WHERE run_id = p_run AND tool_call_id = n.call ->> 'id'
                          ORDER BY created_at DESC LIMIT 1) a ON true
     WHERE n.back <= 300;

    SELECT coalesce(jsonb_agg(jsonb_build_object('version', version, 'fromSequence', from_sequence,
                                                 'toSequence', to_sequence, 'tokens', token_estimate,
                                                 'createdAt', created_at) ORDER BY version), '[]'::jsonb)
      INTO v_compactions FROM context_snapshots WHERE run_id = p_run;
    RETURN jsonb_build_object('liveness', v_live, 'toolCalls', v_calls, 'toolCallsTotal', v_total,
                              'compactions', v_compactions);
END $$;
