-- A key filter is driven by the key index in time order: each key row carries its event's time.
ALTER TABLE drift_event_keys ADD COLUMN at TEXT;
UPDATE drift_event_keys SET at = (SELECT d.at FROM drift_events d WHERE d.event_id = drift_event_keys.event_id);
CREATE INDEX drift_event_keys_by_key_time ON drift_event_keys (key, at, event_id);
