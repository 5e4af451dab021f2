-- The sweep process that claimed a trial ("pid@host"): a second sweep of the same file skips
-- the trials a live one holds (see sweep.rs, claim_trial).
ALTER TABLE trials ADD COLUMN owner TEXT;
