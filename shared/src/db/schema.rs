//! Diesel table definitions mirroring `migrations/` (kept by hand; a change here goes with a
//! migration).

diesel::table! {
    principals (id) {
        id -> Uuid,
        name -> Text,
        created_at -> Timestamptz,
    }
}

diesel::table! {
    api_keys (id) {
        id -> Uuid,
        principal_id -> Uuid,
        key_hash -> Bytea,
        key_prefix -> Text,
        created_at -> Timestamptz,
        revoked_at -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    threads (id) {
        id -> Uuid,
        owner_id -> Uuid,
        title -> Text,
        model -> Nullable<Text>,
        metadata -> Jsonb,
        parent_thread_id -> Nullable<Uuid>,
        message_count -> Int4,
        last_sequence -> Int8,
        last_timestamp_ms -> Int8,
        last_event_sequence -> Int8,
        context_tokens -> Nullable<Int4>,
        streaming_message -> Nullable<Jsonb>,
        created_at -> Timestamptz,
        updated_at -> Timestamptz,
        deleted_at -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    messages (id) {
        id -> Int8,
        thread_id -> Uuid,
        sequence -> Int8,
        timestamp_ms -> Int8,
        role -> Text,
        content -> Jsonb,
        tool_calls -> Nullable<Jsonb>,
        tool_call_id -> Nullable<Text>,
        reasoning -> Nullable<Text>,
        run_id -> Nullable<Uuid>,
        step_id -> Nullable<Int8>,
        token_estimate -> Int4,
        byte_size -> Int4,
        active -> Bool,
        created_at -> Timestamptz,
        stopped -> Bool,
        finish_reason -> Nullable<Text>,
    }
}

diesel::table! {
    runs (id) {
        id -> Uuid,
        seq -> Int8,
        thread_id -> Uuid,
        principal_id -> Uuid,
        status -> Text,
        command_id -> Nullable<Text>,
        model -> Text,
        max_steps -> Int4,
        steps_used -> Int4,
        tool_calls_used -> Int4,
        prompt_tokens -> Int8,
        completion_tokens -> Int8,
        context_tokens -> Nullable<Int4>,
        context_limit -> Nullable<Int4>,
        lease_owner -> Nullable<Text>,
        lease_epoch -> Int8,
        lease_expires_at -> Nullable<Timestamptz>,
        attempts -> Int4,
        recoveries -> Int4,
        error_code -> Nullable<Text>,
        error_message -> Nullable<Text>,
        cancel_requested_at -> Nullable<Timestamptz>,
        created_at -> Timestamptz,
        queued_at -> Nullable<Timestamptz>,
        started_at -> Nullable<Timestamptz>,
        finished_at -> Nullable<Timestamptz>,
        updated_at -> Timestamptz,
        input -> Nullable<Jsonb>,
        kind -> Text,
        source_thread_id -> Nullable<Uuid>,
        faults -> Int4,
        last_commit -> Nullable<Jsonb>,
    }
}

diesel::table! {
    run_steps (id) {
        id -> Int8,
        run_id -> Uuid,
        sequence -> Int4,
        idempotency_key -> Text,
        status -> Text,
        attempt -> Int4,
        lease_epoch -> Int8,
        worker_id -> Text,
        model -> Text,
        model_calls -> Int4,
        tool_calls -> Int4,
        prompt_tokens -> Int8,
        completion_tokens -> Int8,
        context_tokens -> Nullable<Int4>,
        error_code -> Nullable<Text>,
        error_message -> Nullable<Text>,
        started_at -> Timestamptz,
        finished_at -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    thread_events (thread_id, sequence) {
        thread_id -> Uuid,
        sequence -> Int8,
        kind -> Text,
        payload -> Jsonb,
        created_at -> Timestamptz,
    }
}

diesel::table! {
    command_receipts (principal_id, command_id) {
        principal_id -> Uuid,
        command_id -> Text,
        fingerprint -> Text,
        thread_id -> Nullable<Uuid>,
        run_id -> Nullable<Uuid>,
        response -> Nullable<Jsonb>,
        created_at -> Timestamptz,
    }
}

diesel::table! {
    context_snapshots (id) {
        id -> Int8,
        thread_id -> Uuid,
        version -> Int4,
        summary -> Text,
        from_sequence -> Int8,
        to_sequence -> Int8,
        token_estimate -> Int4,
        run_id -> Nullable<Uuid>,
        superseded_at -> Nullable<Timestamptz>,
        created_at -> Timestamptz,
    }
}

diesel::table! {
    tool_approvals (id) {
        id -> Uuid,
        run_id -> Uuid,
        thread_id -> Uuid,
        message_sequence -> Int8,
        tool_call_id -> Text,
        tool_name -> Text,
        arguments -> Jsonb,
        parameters -> Jsonb,
        status -> Text,
        approved_arguments -> Nullable<Jsonb>,
        arguments_edited -> Bool,
        reason -> Nullable<Text>,
        decided_by -> Nullable<Uuid>,
        deadline_at -> Timestamptz,
        created_at -> Timestamptz,
        decided_at -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    operations (key) {
        key -> Text,
        run_id -> Uuid,
        thread_id -> Uuid,
        tool_call_id -> Text,
        tool_name -> Text,
        arguments -> Jsonb,
        status -> Text,
        result -> Nullable<Text>,
        resolution -> Nullable<Text>,
        resolved_by -> Nullable<Uuid>,
        dispatches -> Int4,
        lease_epoch -> Int8,
        created_at -> Timestamptz,
        updated_at -> Timestamptz,
        dispatched_at -> Nullable<Timestamptz>,
        finished_at -> Nullable<Timestamptz>,
        resolved_at -> Nullable<Timestamptz>,
    }
}

diesel::joinable!(api_keys -> principals (principal_id));
diesel::joinable!(messages -> threads (thread_id));
diesel::joinable!(runs -> threads (thread_id));
diesel::joinable!(run_steps -> runs (run_id));
diesel::joinable!(thread_events -> threads (thread_id));
diesel::joinable!(tool_approvals -> runs (run_id));
diesel::joinable!(operations -> runs (run_id));

diesel::allow_tables_to_appear_in_same_query!(
    principals, api_keys, threads, messages, runs, run_steps, thread_events, command_receipts, context_snapshots,
    tool_approvals, operations,
);
