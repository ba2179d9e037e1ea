-- As in 000011.
CREATE OR REPLACE FUNCTION agentloop_webhook_deliveries(p jsonb) RETURNS jsonb LANGUAGE sql STABLE AS $$
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
