-- Core schema of agentloop (SPEC §3). Every timestamp is timestamptz and every lease or
-- deadline is computed by the database clock (now()).

CREATE TABLE principals (
    id          uuid PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- API keys are stored as SHA-256 digests; the clear key is shown once at creation.
CREATE TABLE api_keys (
    id            uuid PRIMARY KEY,
    principal_id  uuid NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
    key_hash      bytea NOT NULL UNIQUE,
    key_prefix    text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    revoked_at    timestamptz
);

CREATE TABLE threads (
    id                   uuid PRIMARY KEY,
    owner_id             uuid NOT NULL REFERENCES principals (id),
    title                text NOT NULL DEFAULT '',
    model                text,
    metadata             jsonb NOT NULL DEFAULT '{}'::jsonb,
    parent_thread_id     uuid REFERENCES threads (id) ON DELETE SET NULL,
    -- Number of active canonical messages (authoritative; never computed by counting rows).
    message_count        integer NOT NULL DEFAULT 0,
    -- Highest message sequence ever allocated (gap-free cursor; inactive rows keep theirs).
    last_sequence        bigint NOT NULL DEFAULT 0,
    -- Highest message timestamp identity (ms since epoch), for max(now_ms, last + 1).
    last_timestamp_ms    bigint NOT NULL DEFAULT 0,
    -- Highest thread_events sequence (gap-free journal cursor).
    last_event_sequence  bigint NOT NULL DEFAULT 0,
    context_tokens       integer,
    -- The uncommitted partial assistant message of the running slice, never history.
    streaming_message    jsonb,
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now(),
    deleted_at           timestamptz
);
CREATE INDEX threads_owner_recent ON threads (owner_id, updated_at DESC, id DESC) WHERE deleted_at IS NULL;

CREATE TABLE messages (
    id              bigserial PRIMARY KEY,
    thread_id       uuid NOT NULL REFERENCES threads (id) ON DELETE CASCADE,
    sequence        bigint NOT NULL,
    timestamp_ms    bigint NOT NULL,
    role            text NOT NULL CHECK (role IN ('system', 'developer', 'user', 'assistant', 'tool')),
    content         jsonb NOT NULL,
    tool_calls      jsonb,
    tool_call_id    text,
    reasoning       text,
    run_id          uuid,
    step_id         bigint,
    token_estimate  integer NOT NULL DEFAULT 0,
    byte_size       integer NOT NULL DEFAULT 0,
    active          boolean NOT NULL DEFAULT true,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT messages_thread_sequence UNIQUE (thread_id, sequence),
    CONSTRAINT messages_thread_timestamp UNIQUE (thread_id, timestamp_ms)
);
CREATE INDEX messages_active_by_sequence ON messages (thread_id, sequence) WHERE active;
CREATE INDEX messages_by_run ON messages (run_id) WHERE run_id IS NOT NULL;

CREATE TABLE runs (
    id                   uuid PRIMARY KEY,
    -- Stable FIFO/claim order key.
    seq                  bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
    thread_id            uuid NOT NULL REFERENCES threads (id) ON DELETE CASCADE,
    principal_id         uuid NOT NULL REFERENCES principals (id),
    status               text NOT NULL CHECK (status IN ('pending', 'queued', 'running', 'waiting_approval',
                                                         'blocked', 'completed', 'failed', 'cancelled')),
    command_id           text,
    model                text NOT NULL,
    max_steps            integer NOT NULL DEFAULT 250 CHECK (max_steps >= 1),
    steps_used           integer NOT NULL DEFAULT 0,
    tool_calls_used      integer NOT NULL DEFAULT 0,
    prompt_tokens        bigint NOT NULL DEFAULT 0,
    completion_tokens    bigint NOT NULL DEFAULT 0,
    context_tokens       integer,
    context_limit        integer,
    lease_owner          text,
    lease_epoch          bigint NOT NULL DEFAULT 0,
    lease_expires_at     timestamptz,
    attempts             integer NOT NULL DEFAULT 0,
    recoveries           integer NOT NULL DEFAULT 0,
    error_code           text,
    error_message        text,
    cancel_requested_at  timestamptz,
    created_at           timestamptz NOT NULL DEFAULT now(),
    queued_at            timestamptz,
    started_at           timestamptz,
    finished_at          timestamptz,
    updated_at           timestamptz NOT NULL DEFAULT now()
);
-- At most one active run per thread (SPEC §4).
CREATE UNIQUE INDEX runs_one_active_per_thread ON runs (thread_id)
    WHERE status IN ('queued', 'running', 'waiting_approval', 'blocked');
-- Claim: queued runs and running runs whose lease expired, in seq order; partial, so the claim
-- stays an index scan however many terminal runs accumulate. The lease index serves the
-- worker's earliest-expiry timer.
CREATE INDEX runs_claimable ON runs (seq) WHERE status IN ('queued', 'running');
CREATE INDEX runs_running_lease ON runs (lease_expires_at) WHERE status = 'running';
CREATE INDEX runs_pending_fifo ON runs (thread_id, seq) WHERE status = 'pending';
CREATE INDEX runs_by_thread ON runs (thread_id, seq DESC);

CREATE TABLE run_steps (
    id                 bigserial PRIMARY KEY,
    run_id             uuid NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    sequence           integer NOT NULL,
    -- 'run:{run_id}:step:{sequence}' (SPEC §3).
    idempotency_key    text NOT NULL UNIQUE,
    status             text NOT NULL CHECK (status IN ('running', 'completed', 'requeued', 'failed',
                                                       'cancelled', 'interrupted', 'waiting_approval')),
    attempt            integer NOT NULL,
    lease_epoch        bigint NOT NULL,
    worker_id          text NOT NULL,
    model              text NOT NULL,
    model_calls        integer NOT NULL DEFAULT 0,
    tool_calls         integer NOT NULL DEFAULT 0,
    prompt_tokens      bigint NOT NULL DEFAULT 0,
    completion_tokens  bigint NOT NULL DEFAULT 0,
    context_tokens     integer,
    error_code         text,
    error_message      text,
    started_at         timestamptz NOT NULL DEFAULT now(),
    finished_at        timestamptz,
    CONSTRAINT run_steps_run_sequence UNIQUE (run_id, sequence)
);

-- Per-thread outgoing journal for SSE/long-poll resume (SPEC §10).
CREATE TABLE thread_events (
    thread_id   uuid NOT NULL REFERENCES threads (id) ON DELETE CASCADE,
    sequence    bigint NOT NULL,
    kind        text NOT NULL,
    payload     jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (thread_id, sequence)
);

-- Idempotent commands (SPEC §11): (principal, command id) -> original result.
CREATE TABLE command_receipts (
    principal_id  uuid NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
    command_id    text NOT NULL,
    fingerprint   text NOT NULL,
    thread_id     uuid,
    run_id        uuid,
    response      jsonb,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (principal_id, command_id)
);
CREATE INDEX command_receipts_created ON command_receipts (created_at);
