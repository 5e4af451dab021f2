-- Pushing to the remote tracker exactly once (see tracker.rs).
-- A metrics batch posted whose answer is not recorded yet: metrics.id of its last row. The next
-- push asks the server whether that row landed before it sends the batch again.
ALTER TABLE tracker_runs ADD COLUMN inflight_upto INTEGER;
-- The process pushing this run now, and until when (Unix seconds) its lease holds.
ALTER TABLE tracker_runs ADD COLUMN sync_owner TEXT;
ALTER TABLE tracker_runs ADD COLUMN sync_until REAL;
