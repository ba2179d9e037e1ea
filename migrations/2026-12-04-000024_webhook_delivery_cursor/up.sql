-- GET /api/webhooks/{id}/deliveries pages with a cursor (it listed the newest 200 at most, and
-- older deliveries could not be read at all). p = {principalId, webhookId, limit, status?,
-- before?: {atMicros, id}}: the deliveries after `before` in the list's order (newest first,
-- then id), and `nextCursor` (`<createdAt µs since epoch>_<id>` of the last one, the cursor
-- format of GET /api/threads) when the page is full. Served by webhook_deliveries_by_webhook
-- (webhook_id, created_at DESC, id). Null when the webhook is not the caller's.
CREATE OR REPLACE FUNCTION agentloop_webhook_deliveries(p jsonb) RETURNS jsonb LANGUAGE sql STABLE AS $$
    WITH after_cursor AS (
        SELECT timestamptz 'epoch' + (p -> 'before' ->> 'atMicros')::bigint * interval '1 microsecond' AS at,
               (p -> 'before' ->> 'id')::uuid AS id
    ), page AS (
        SELECT * FROM webhook_deliveries
         WHERE webhook_id = (p ->> 'webhookId')::uuid
           AND (NOT p ? 'status' OR status = p ->> 'status')
           -- The range on created_at is an index condition; the rest filters the one instant.
           AND (NOT p ? 'before'
                OR created_at <= (SELECT at FROM after_cursor)
                   AND (created_at < (SELECT at FROM after_cursor) OR id > (SELECT id FROM after_cursor)))
         ORDER BY created_at DESC, id LIMIT coalesce((p ->> 'limit')::int, 50)
    ), last AS (
        SELECT created_at, id FROM page ORDER BY created_at, id DESC LIMIT 1
    )
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
          FROM page d), '[]'::jsonb),
        'nextCursor', CASE WHEN (SELECT count(*) FROM page) = coalesce((p ->> 'limit')::int, 50)
                           THEN (SELECT (extract(epoch FROM created_at) * 1e6)::bigint::text || '_' || id::text FROM last) END)
    END
$$;
