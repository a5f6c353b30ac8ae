-- The order drift events were recorded in, for clients that follow the history while it is
-- written. Events commit out of (at, event_id) order (their time is taken before the journal
-- append; a collector's journal reindexed later carries older times), so a time cursor passes
-- events that commit behind it. A sequence number is in commit order only because every
-- transaction that inserts drift events first takes one transaction-scoped advisory lock (the
-- store does), so no two of them draw numbers at once and each commits before the next draws.
-- `ON CONFLICT DO NOTHING` inserts fire no row trigger, so a replayed event keeps its place.
CREATE TABLE drift_recorded (
    seq BIGSERIAL PRIMARY KEY,
    at TEXT NOT NULL,
    event_id TEXT NOT NULL
);
INSERT INTO drift_recorded (at, event_id) SELECT at, event_id FROM drift_events ORDER BY at, event_id;
-- Which numbering this is: a database made again (dropped, then rebuilt from the journals by
-- reindex) numbers the same events differently, and a follower's cursor must not be read in it.
CREATE TABLE drift_recorded_epoch (epoch TEXT NOT NULL);
INSERT INTO drift_recorded_epoch (epoch) VALUES (substr(md5(random()::text || clock_timestamp()::text), 1, 16));
CREATE FUNCTION drift_events_recorded() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO drift_recorded (at, event_id) VALUES (NEW.at, NEW.event_id);
    RETURN NULL;
END
$$;
CREATE TRIGGER drift_events_recorded AFTER INSERT ON drift_events
    FOR EACH ROW EXECUTE FUNCTION drift_events_recorded();
