-- The run store: runs, their metrics, checkpoints and events; sweeps and their trials;
-- the outbox of records waiting for the remote tracker. Times are Unix seconds (REAL).

CREATE TABLE sweeps (
    id          TEXT PRIMARY KEY,          -- <name>-<hash of base config and search space>
    name        TEXT NOT NULL,
    spec        TEXT NOT NULL,             -- the sweep file's [sweep] table, JSON
    file        TEXT NOT NULL,             -- the sweep file as given
    created     REAL NOT NULL
);

CREATE TABLE runs (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    name            TEXT NOT NULL,
    project         TEXT NOT NULL,
    status          TEXT NOT NULL CHECK (status IN ('queued', 'running', 'finished', 'failed', 'killed')),
    config          TEXT NOT NULL,         -- the resolved config, JSON
    git_commit      TEXT,
    git_dirty       INTEGER,
    host            TEXT NOT NULL,
    pid             INTEGER,
    seed            INTEGER NOT NULL,
    run_dir         TEXT NOT NULL,
    created         REAL NOT NULL,
    started         REAL,
    ended           REAL,
    heartbeat       REAL,
    heartbeat_s     REAL NOT NULL,
    sweep_id        TEXT REFERENCES sweeps (id),
    trial_id        TEXT,
    resumed_from    INTEGER,               -- the checkpoint step of the latest resume
    error           TEXT
);
CREATE INDEX runs_sweep ON runs (sweep_id);

CREATE TABLE metrics (
    id          INTEGER PRIMARY KEY,       -- stable rowid: the tracker's cursor
    run_id      INTEGER NOT NULL REFERENCES runs (id),
    step        INTEGER NOT NULL,
    key         TEXT NOT NULL,
    value       REAL,                      -- NULL is NaN (SQLite stores NaN as NULL)
    wall_time   REAL NOT NULL
);
CREATE INDEX metrics_run_key_step ON metrics (run_id, key, step);

CREATE TABLE checkpoints (
    run_id      INTEGER NOT NULL REFERENCES runs (id),
    step        INTEGER NOT NULL,
    path        TEXT NOT NULL,
    created     REAL NOT NULL,
    PRIMARY KEY (run_id, step)
);

CREATE TABLE trials (
    sweep_id    TEXT NOT NULL REFERENCES sweeps (id),
    trial_id    TEXT NOT NULL,             -- hash of the trial's parameters
    idx         INTEGER NOT NULL,          -- position in the sweep's order
    params      TEXT NOT NULL,             -- JSON object key.path -> value
    state       TEXT NOT NULL CHECK (state IN ('pending', 'running', 'finished', 'failed')),
    run_id      INTEGER REFERENCES runs (id),
    error       TEXT,
    PRIMARY KEY (sweep_id, trial_id)
);

CREATE TABLE events (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id      INTEGER REFERENCES runs (id),
    time        REAL NOT NULL,
    kind        TEXT NOT NULL,             -- error, resume, config_change, tracker, signal, ...
    message     TEXT NOT NULL
);
CREATE INDEX events_run ON events (run_id);

-- Records for the remote tracker, pushed in id order per run; metrics are not copied here:
-- each run's metrics are pushed by rowid past tracker_runs.metric_cursor.
CREATE TABLE outbox (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id      INTEGER NOT NULL REFERENCES runs (id),
    kind        TEXT NOT NULL,             -- create, params, status
    payload     TEXT NOT NULL,             -- JSON
    created     REAL NOT NULL,
    attempts    INTEGER NOT NULL DEFAULT 0,
    last_error  TEXT,
    done        REAL                       -- when it was accepted (or given up as permanent)
);
CREATE INDEX outbox_pending ON outbox (done, run_id, id);

CREATE TABLE tracker_runs (
    run_id          INTEGER PRIMARY KEY REFERENCES runs (id),
    uri             TEXT NOT NULL,
    experiment_id   TEXT,
    remote_run_id   TEXT,
    metric_cursor   INTEGER NOT NULL DEFAULT 0  -- metrics.rowid already pushed
);
