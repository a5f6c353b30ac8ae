-- Drift rows keyed in the order every query reads them. An event's id derives from its journal
-- line, which holds its time, so (at, event_id) is as unique as event_id, and (key, at,
-- event_id) as (event_id, key): the primary keys become those, and the indexes they replace go.
ALTER TABLE drift_events DROP CONSTRAINT drift_events_pkey;
ALTER TABLE drift_events ADD PRIMARY KEY (at, event_id);
DROP INDEX drift_events_by_time;

UPDATE drift_event_keys k SET at = d.at FROM drift_events d WHERE k.at IS NULL AND d.event_id = k.event_id;
DELETE FROM drift_event_keys WHERE at IS NULL;
ALTER TABLE drift_event_keys ALTER COLUMN at SET NOT NULL;
ALTER TABLE drift_event_keys DROP CONSTRAINT drift_event_keys_pkey;
ALTER TABLE drift_event_keys ADD PRIMARY KEY (key, at, event_id);
DROP INDEX drift_event_keys_by_key;
DROP INDEX drift_event_keys_by_key_time;
