-- Spill files of rows the store once refused (see store/writer.rs): each spill's id is
-- recorded in the transaction that writes its rows, so a replay cut short is never doubled.
CREATE TABLE replayed_spills (
    id      TEXT PRIMARY KEY,
    time    REAL NOT NULL
);
