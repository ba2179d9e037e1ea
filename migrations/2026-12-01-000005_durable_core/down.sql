-- Development only (migrations/README.md): drops the write-path functions and new columns.
DO $$
DECLARE f record;
BEGIN
    FOR f IN SELECT p.oid::regprocedure AS sig FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
              WHERE n.nspname = current_schema() AND p.proname LIKE 'agentloop\_%' LOOP
        EXECUTE 'DROP FUNCTION ' || f.sig || ' CASCADE';
    END LOOP;
END $$;
DROP INDEX IF EXISTS thread_events_streaming;
ALTER TABLE messages DROP COLUMN IF EXISTS stopped;
ALTER TABLE runs DROP COLUMN IF EXISTS faults;
ALTER TABLE runs DROP COLUMN IF EXISTS last_commit;
