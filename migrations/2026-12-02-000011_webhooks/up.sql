-- Issue 12 (part 2): webhooks on run state.
-- Additive only: three new tables, new functions and one AFTER trigger on `runs`; no existing
-- function is replaced.
--
-- Outbox. A run's status is only ever changed in SQL (the step functions of
-- 2026-12-01-000005_durable_core and later). An AFTER UPDATE OF status trigger on `runs` inserts
-- one `webhook_deliveries` row per matching webhook of the run's principal, in the transaction
-- of the transition, whatever function made it: a transition that commits has its deliveries,
-- one that rolls back has none. The trigger's WHEN clause lets every other update (lease
-- renewals, checkpoints that keep the status, `queued`/`running` transitions) skip it without
-- calling a function; a subscribed transition of a principal without webhooks costs one probe
-- of `webhooks_by_principal` on a table that is usually tiny. Only when rows were inserted does
-- the trigger `pg_notify('agentloop_webhooks', '')` (one per transaction: PostgreSQL folds
-- identical notifications) so an idle worker sends them at once.
--
-- Delivery. Workers claim due rows (`status = 'pending' AND next_attempt_at <= now()`) with
-- FOR UPDATE SKIP LOCKED; the claim pushes `next_attempt_at` forward by a lease (the request's
-- timeout plus a margin) and opens an attempt row, so a worker that dies mid-request leaves a
-- row that is due again when the lease ends (at-least-once; the same `webhook-id`, "msg_" + the
-- delivery id). The outcome closes the attempt and either ends the delivery (`delivered`, or
-- `failed` after the last attempt) or schedules the next one (backoff computed by the worker).
-- Lock order: a delivery row, then its attempt rows; nothing else is locked.

CREATE TABLE webhooks (
    id            uuid PRIMARY KEY,
    principal_id  uuid NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
    url           text NOT NULL,
    -- Event types: run.completed, run.failed, run.cancelled, run.waiting_approval, run.blocked.
    events        text[] NOT NULL,
    description   text NOT NULL DEFAULT '',
    -- The signing secret: `v1:<base64(nonce || AES-256-GCM ciphertext)>` under WEBHOOK_SECRETS_KEY
    -- (additional data: the webhook id), or `plain:whsec_...` when no key is configured.
    secret        text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX webhooks_by_principal ON webhooks (principal_id, created_at);

CREATE TABLE webhook_deliveries (
    id               uuid PRIMARY KEY,
    -- No foreign keys at all: the trigger's insert must never wait for or fail on a webhook
    -- being deleted at that moment (a foreign-key check would make the run's transition fail),
    -- and a delivery outlives a purged thread (hidden threads of the OpenAI endpoint are deleted
    -- as soon as their run ends). A delivery whose webhook is gone is deleted by the next claim
    -- that meets it (agentloop_webhook_claim) or with its webhook (agentloop_webhook_delete).
    webhook_id       uuid NOT NULL,
    principal_id     uuid NOT NULL,
    event_type       text NOT NULL,
    run_id           uuid NOT NULL,
    thread_id        uuid NOT NULL,
    -- The event as sent (Standard Webhooks shape: {type, timestamp, data}).
    payload          jsonb NOT NULL,
    status           text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'delivered', 'failed')),
    -- Attempts started (claims), including one a dead worker never finished.
    attempts         integer NOT NULL DEFAULT 0,
    -- Pending: when it is due (the next try, or the end of the current attempt's lease).
    next_attempt_at  timestamptz,
    lease_owner      text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';
CREATE INDEX webhook_deliveries_by_webhook ON webhook_deliveries (webhook_id, created_at DESC, id);
-- Retention of ended deliveries.
CREATE INDEX webhook_deliveries_finished ON webhook_deliveries (finished_at) WHERE status <> 'pending';

CREATE TABLE webhook_attempts (
    delivery_id    uuid NOT NULL REFERENCES webhook_deliveries (id) ON DELETE CASCADE,
    attempt        integer NOT NULL,
    worker         text NOT NULL,
    started_at     timestamptz NOT NULL DEFAULT now(),
    finished_at    timestamptz,
    duration_ms    integer,
    status_code    integer,
    -- The start of the receiver's answer (at most 1 KiB, read while it streams in).
    response_body  text,
    error          text,
    PRIMARY KEY (delivery_id, attempt)
);

-- The trigger function (see the header). Payload `data`: the run as a receiver needs it to act
-- without a call back (it may still GET /api/runs/{id} for more).
CREATE FUNCTION agentloop_webhooks_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_type text := 'run.' || NEW.status;
    v_count int;
BEGIN
    INSERT INTO webhook_deliveries (id, webhook_id, principal_id, event_type, run_id, thread_id, payload, next_attempt_at)
    SELECT gen_random_uuid(), w.id, w.principal_id, v_type, NEW.id, NEW.thread_id,
           jsonb_build_object(
               'type', v_type,
               'timestamp', now(),
               'data', jsonb_strip_nulls(jsonb_build_object(
                   'runId', NEW.id,
                   'threadId', NEW.thread_id,
                   'status', NEW.status,
                   'kind', NEW.kind,
                   'model', NEW.model,
                   'errorCode', NEW.error_code,
                   'errorMessage', NEW.error_message,
                   'stepsUsed', NEW.steps_used,
                   'toolCallsUsed', NEW.tool_calls_used,
                   'usage', jsonb_build_object('promptTokens', NEW.prompt_tokens, 'completionTokens', NEW.completion_tokens),
                   'createdAt', NEW.created_at,
                   'startedAt', NEW.started_at,
                   'finishedAt', NEW.finished_at))),
           now()
      FROM webhooks w
     WHERE w.principal_id = NEW.principal_id AND v_type = ANY (w.events);
    GET DIAGNOSTICS v_count = ROW_COUNT;
    IF v_count > 0 THEN
        PERFORM pg_notify('agentloop_webhooks', '');
    END IF;
    RETURN NULL;
END $$;

-- A webhook as the api shows it (never the secret).
CREATE FUNCTION agentloop_webhook_json(w webhooks) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object('id', w.id, 'url', w.url, 'events', to_jsonb(w.events),
                              'description', w.description, 'createdAt', w.created_at)
$$;

-- POST /api/webhooks. p = {principalId, id, url, events, description, secret (stored form),
-- max (webhooks per principal)}. Serialised per principal (agentloop_lock_principal) so the
-- bound holds across api processes: 429 `too_many_webhooks`. Returns the webhook.
CREATE FUNCTION agentloop_webhook_create(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_principal uuid := (p ->> 'principalId')::uuid;
    v_max int := coalesce((p ->> 'max')::int, 20);
    w webhooks;
BEGIN
    PERFORM agentloop_lock_principal(v_principal);
    IF (SELECT count(*) FROM webhooks WHERE principal_id = v_principal) >= v_max THEN
        PERFORM agentloop_refuse(429, 'too_many_webhooks',
            format('at most %s webhooks per principal; delete one first', v_max));
    END IF;
    INSERT INTO webhooks (id, principal_id, url, events, description, secret)
    VALUES ((p ->> 'id')::uuid, v_principal, p ->> 'url',
            ARRAY(SELECT jsonb_array_elements_text(p -> 'events')), coalesce(p ->> 'description', ''), p ->> 'secret')
    RETURNING * INTO w;
    RETURN agentloop_webhook_json(w);
END $$;

-- DELETE /api/webhooks/{id}: the webhook and its deliveries (pending ones are never sent).
-- p = {principalId, id}. 404 when not the caller's. Returns {deleted: true}.
CREATE FUNCTION agentloop_webhook_delete(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM webhooks WHERE id = (p ->> 'id')::uuid AND principal_id = (p ->> 'principalId')::uuid;
    IF NOT FOUND THEN
        PERFORM agentloop_refuse(404, 'not_found', 'no such webhook');
    END IF;
    DELETE FROM webhook_deliveries WHERE webhook_id = (p ->> 'id')::uuid;
    RETURN '{"deleted": true}'::jsonb;
END $$;

-- GET /api/webhooks[/{id}]: p = {principalId, id?}. Returns {webhooks: [...]} (oldest first),
-- or the one webhook (null when not the caller's).
CREATE FUNCTION agentloop_webhooks_read(p jsonb) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN p ? 'id' THEN
        (SELECT agentloop_webhook_json(w) FROM webhooks w
          WHERE w.id = (p ->> 'id')::uuid AND w.principal_id = (p ->> 'principalId')::uuid)
    ELSE
        jsonb_build_object('webhooks', coalesce((
            SELECT jsonb_agg(agentloop_webhook_json(w) ORDER BY w.created_at, w.id) FROM webhooks w
             WHERE w.principal_id = (p ->> 'principalId')::uuid), '[]'::jsonb))
    END
$$;

-- GET /api/webhooks/{id}/deliveries: p = {principalId, webhookId, limit, status?}. Newest first,
-- each with its attempts (oldest first). Null when the webhook is not the caller's.
CREATE FUNCTION agentloop_webhook_deliveries(p jsonb) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN NOT EXISTS (SELECT 1 FROM webhooks WHERE id = (p ->> 'webhookId')::uuid
                                                          AND principal_id = (p ->> 'principalId')::uuid)
    THEN NULL ELSE jsonb_build_object('deliveries', coalesce((
        SELECT jsonb_agg(jsonb_build_object(
                   'id', d.id,
                   'webhookId', d.webhook_id,
                   'messageId', 'msg_' || replace(d.id::text, '-', ''),
                   'eventType', d.event_type,
                   'runId', d.run_id,
                   'threadId', d.thread_id,
                   'status', d.status,
                   'attempts', d.attempts,
                   'nextAttemptAt', CASE WHEN d.status = 'pending' THEN d.next_attempt_at END,
                   'createdAt', d.created_at,
                   'finishedAt', d.finished_at,
                   'payload', d.payload,
                   'attemptLog', coalesce((
                       SELECT jsonb_agg(jsonb_build_object(
                                  'attempt', a.attempt, 'startedAt', a.started_at, 'finishedAt', a.finished_at,
                                  'durationMs', a.duration_ms, 'statusCode', a.status_code,
                                  'responseBody', a.response_body, 'error', a.error) ORDER BY a.attempt)
                         FROM webhook_attempts a WHERE a.delivery_id = d.id), '[]'::jsonb))
               ORDER BY d.created_at DESC, d.id)
          FROM (SELECT * FROM webhook_deliveries
                 WHERE webhook_id = (p ->> 'webhookId')::uuid
                   AND (NOT p ? 'status' OR status = p ->> 'status')
                 ORDER BY created_at DESC, id LIMIT coalesce((p ->> 'limit')::int, 50)) d), '[]'::jsonb))
    END
$$;

-- A worker's claim of due deliveries, at most p.limit, oldest due first, skipping rows other
-- transactions hold. p = {worker, limit, leaseMs, maxAttempts}. A delivery whose webhook is
-- gone is deleted. A delivery whose attempts are used up (the last one's worker died) fails instead. Each claimed row gets attempts + 1,
-- next_attempt_at = now() + lease and an open attempt row; an earlier attempt left open (its
-- worker died) is closed with an error saying so. Returns {deliveries: [{id, attempt, url,
-- secret, webhookId, eventType, payload}], nextDueMs (ms until the earliest pending row is due,
-- its lease included; null when none)}.
CREATE FUNCTION agentloop_webhook_claim(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_worker text := p ->> 'worker';
    v_lease interval := make_interval(secs => (p ->> 'leaseMs')::bigint / 1000.0);
    v_max int := coalesce((p ->> 'maxAttempts')::int, 8);
    v_out jsonb := '[]'::jsonb;
    d record;
BEGIN
    FOR d IN
        SELECT wd.id, wd.attempts, wd.event_type, wd.payload, w.id AS webhook_id, w.url, w.secret
          FROM webhook_deliveries wd LEFT JOIN webhooks w ON w.id = wd.webhook_id
         WHERE wd.status = 'pending' AND wd.next_attempt_at <= now()
         ORDER BY wd.next_attempt_at
         LIMIT coalesce((p ->> 'limit')::int, 1)
           FOR UPDATE OF wd SKIP LOCKED
    LOOP
        IF d.webhook_id IS NULL THEN
            -- Inserted by a transition that raced the deletion of its webhook.
            DELETE FROM webhook_deliveries WHERE id = d.id;
            CONTINUE;
        END IF;
        UPDATE webhook_attempts
           SET finished_at = now(), error = 'no outcome recorded: the worker sending it stopped (its lease expired)'
         WHERE delivery_id = d.id AND finished_at IS NULL;
        IF d.attempts >= v_max THEN
            UPDATE webhook_deliveries SET status = 'failed', next_attempt_at = NULL, lease_owner = NULL,
                   finished_at = now(), updated_at = now()
             WHERE id = d.id;
            CONTINUE;
        END IF;
        UPDATE webhook_deliveries SET attempts = d.attempts + 1, next_attempt_at = now() + v_lease,
               lease_owner = v_worker, updated_at = now()
         WHERE id = d.id;
        INSERT INTO webhook_attempts (delivery_id, attempt, worker) VALUES (d.id, d.attempts + 1, v_worker);
        v_out := v_out || jsonb_build_object('id', d.id, 'attempt', d.attempts + 1, 'webhookId', d.webhook_id,
                                             'url', d.url, 'secret', d.secret, 'eventType', d.event_type,
                                             'payload', d.payload);
    END LOOP;
    RETURN jsonb_build_object(
        'deliveries', v_out,
        'nextDueMs', (SELECT greatest((extract(epoch FROM (min(next_attempt_at) - now())) * 1000)::bigint, 0)
                        FROM webhook_deliveries WHERE status = 'pending'));
END $$;

-- The outcome of one attempt. p = {id, attempt, ok, statusCode?, responseBody?, error?,
-- durationMs, retryInMs, maxAttempts}. Closes the attempt row; a success ends the delivery
-- (whichever attempt it was, while it is pending); a failure schedules the next attempt
-- (now() + retryInMs) or fails the delivery after the last one — only if this attempt is still
-- the delivery's latest (a worker that outlived its lease changes nothing but its attempt row).
-- Returns {status} (the delivery's status afterwards; null when it is gone).
CREATE FUNCTION agentloop_webhook_finish(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := (p ->> 'id')::uuid;
    v_attempt int := (p ->> 'attempt')::int;
    v_ok boolean := coalesce((p ->> 'ok')::boolean, false);
    v_max int := coalesce((p ->> 'maxAttempts')::int, 8);
    v_status text;
BEGIN
    SELECT status INTO v_status FROM webhook_deliveries WHERE id = v_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN '{"status": null}'::jsonb;
    END IF;
    UPDATE webhook_attempts
       SET finished_at = now(), duration_ms = (p ->> 'durationMs')::int, status_code = (p ->> 'statusCode')::int,
           response_body = p ->> 'responseBody', error = p ->> 'error'
     WHERE delivery_id = v_id AND attempt = v_attempt;
    IF v_ok THEN
        UPDATE webhook_deliveries SET status = 'delivered', next_attempt_at = NULL, lease_owner = NULL,
               finished_at = now(), updated_at = now()
         WHERE id = v_id AND status = 'pending'
        RETURNING status INTO v_status;
    ELSE
        UPDATE webhook_deliveries
           SET status = CASE WHEN attempts >= v_max THEN 'failed' ELSE 'pending' END,
               next_attempt_at = CASE WHEN attempts >= v_max THEN NULL
                                      ELSE now() + make_interval(secs => (p ->> 'retryInMs')::bigint / 1000.0) END,
               finished_at = CASE WHEN attempts >= v_max THEN now() END,
               lease_owner = NULL, updated_at = now()
         WHERE id = v_id AND status = 'pending' AND attempts = v_attempt
        RETURNING status INTO v_status;
    END IF;
    RETURN jsonb_build_object('status', (SELECT status FROM webhook_deliveries WHERE id = v_id));
END $$;

-- Retention: deletes at most p.limit deliveries (with their attempts) that ended more than
-- p.hours ago. Returns {deleted}.
CREATE FUNCTION agentloop_prune_webhook_deliveries(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    n int;
BEGIN
    DELETE FROM webhook_deliveries WHERE id IN (
        SELECT id FROM webhook_deliveries
         WHERE status <> 'pending' AND finished_at < now() - make_interval(hours => (p ->> 'hours')::int)
         ORDER BY finished_at LIMIT coalesce((p ->> 'limit')::int, 1000)
           FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN jsonb_build_object('deleted', n);
END $$;

-- Last: the trigger (a brief SHARE ROW EXCLUSIVE lock on runs; nothing slow after it).
CREATE TRIGGER runs_webhooks_outbox AFTER UPDATE OF status ON runs
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          AND NEW.status IN ('completed', 'failed', 'cancelled', 'waiting_approval', 'blocked'))
    EXECUTE FUNCTION agentloop_webhooks_outbox();
