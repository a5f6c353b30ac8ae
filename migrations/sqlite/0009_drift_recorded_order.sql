-- The order drift events were recorded in, for clients that follow the history while it is
-- written. Events commit out of (at, event_id) order (their time is taken before the journal
-- append; a collector's journal reindexed later carries older times), so a time cursor passes
-- events that commit behind it. A sequence assigned at insert is in commit order: SQLite has
-- one writer, the trigger runs inside the inserting transaction, and AUTOINCREMENT never reuses
-- a number. `ON CONFLICT DO NOTHING` inserts fire no trigger, so a replayed event keeps its place.
CREATE TABLE drift_recorded (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at TEXT NOT NULL,
    event_id TEXT NOT NULL
);
INSERT INTO drift_recorded (at, event_id) SELECT at, event_id FROM drift_events ORDER BY at, event_id;
-- Which numbering this is: a database made again (deleted, then rebuilt from the journals by
-- reindex) numbers the same events differently, and a follower's cursor must not be read in it.
CREATE TABLE drift_recorded_epoch (epoch TEXT NOT NULL);
INSERT INTO drift_recorded_epoch (epoch) VALUES (lower(hex(randomblob(8))));
CREATE TRIGGER drift_events_recorded AFTER INSERT ON drift_events BEGIN
    INSERT INTO drift_recorded (at, event_id) VALUES (NEW.at, NEW.event_id);
END;
