-- The user turn of a `pending` run (multitask `enqueue`/`interrupt`): kept on the run and
-- appended to canonical history only when the run is promoted, so an earlier run never sees a
-- later turn in its context and the transcript stays in conversation order.
ALTER TABLE runs ADD COLUMN input jsonb;
