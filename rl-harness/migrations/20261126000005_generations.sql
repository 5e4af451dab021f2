-- Issue 19: the validation generations `trainer.log_val_generations` asks for (prompt, response,
-- score at each validation), shown by `harness show RUN --generations`.
CREATE TABLE generations (
    id          INTEGER PRIMARY KEY,
    run_id      INTEGER NOT NULL REFERENCES runs (id),
    step        INTEGER NOT NULL,
    data_source TEXT NOT NULL,
    prompt      TEXT NOT NULL,
    response    TEXT NOT NULL,
    score       REAL
);
CREATE INDEX generations_run_step ON generations (run_id, step);
