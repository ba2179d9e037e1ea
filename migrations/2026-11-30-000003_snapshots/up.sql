-- Versioned, non-destructive context summaries (SPEC §3, §8; seed 000 "Context accounting and
-- compaction"). A snapshot covers exactly the canonical rows from_sequence..to_sequence; the
-- model context is: leading instructions + the latest live snapshot's summary + active rows
-- after to_sequence. A branch operation that deactivates covered rows supersedes the snapshot.
CREATE TABLE context_snapshots (
    id              bigserial PRIMARY KEY,
    thread_id       uuid NOT NULL REFERENCES threads (id) ON DELETE CASCADE,
    version         integer NOT NULL,
    summary         text NOT NULL,
    from_sequence   bigint NOT NULL,
    to_sequence     bigint NOT NULL,
    token_estimate  integer NOT NULL,
    run_id          uuid,
    superseded_at   timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT context_snapshots_thread_version UNIQUE (thread_id, version)
);
CREATE INDEX context_snapshots_live ON context_snapshots (thread_id, version DESC) WHERE superseded_at IS NULL;

-- What a run does: 'agent' (the tool loop) or 'compaction' (manual compaction into a child
-- thread, summarising source_thread_id).
ALTER TABLE runs ADD COLUMN kind text NOT NULL DEFAULT 'agent' CHECK (kind IN ('agent', 'compaction'));
ALTER TABLE runs ADD COLUMN source_thread_id uuid REFERENCES threads (id) ON DELETE SET NULL;
