-- Reverts 000042.
DROP FUNCTION IF EXISTS agentloop_slot_wanted(jsonb);
