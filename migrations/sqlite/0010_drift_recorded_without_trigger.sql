-- The recorded order (migration 0009) is assigned by the statement that inserts drift events
-- (`record_new_drift_sqlite` in recovery-store), no longer by a trigger: a trigger fired per row
-- more than halved the rows SQLite inserted per second (reindex of 1M journal lines). The rule
-- is unchanged: numbered inside the inserting transaction, before the insert, only for events
-- the table lacks, in the order they are given; SQLite has one writer, so that is commit order.
-- PostgreSQL keeps its trigger (concurrent writers number under its advisory lock).
DROP TRIGGER drift_events_recorded;
