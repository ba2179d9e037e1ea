-- Development databases only (production never runs down.sql). Nothing to undo: a fresh
-- database already had every object this migration (re)states.
SELECT 1;
