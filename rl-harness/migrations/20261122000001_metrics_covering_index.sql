-- The compare aggregates (last, best, value at a step) read only run_id, key, step and value:
-- with value in the index they never touch the table.
DROP INDEX IF EXISTS metrics_run_key_step;
CREATE INDEX metrics_run_key_step_value ON metrics (run_id, key, step, value);
