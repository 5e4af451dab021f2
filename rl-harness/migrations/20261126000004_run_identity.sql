-- Issue #18, items 6, 7 and 13.
-- The store's identity: written into every run folder and checkpoint it owns, so a resume can
-- refuse a checkpoint another store's run wrote into a shared runs folder.
CREATE TABLE store_meta (
    key     TEXT PRIMARY KEY,
    value   TEXT NOT NULL
);
INSERT INTO store_meta (key, value) VALUES ('store_id', lower(hex(randomblob(16))));
-- The checksums of a checkpoint's files (JSON: relative path -> {bytes, sha256}), the same as
-- its harness.json holds, checked on resume.
ALTER TABLE checkpoints ADD COLUMN manifest TEXT;
-- The pids of a `--nproc-per-node` run's ranks (space-separated): the run lives while its
-- launcher or any rank does.
ALTER TABLE runs ADD COLUMN rank_pids TEXT;
