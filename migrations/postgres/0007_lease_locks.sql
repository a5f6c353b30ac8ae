-- The lock files a lease holds (the run's lock, and a checkpoint directory's when asked for),
-- so a service that restarts takes them again for the leases still live, instead of leaving
-- their collectors without the locks they were promised.
CREATE TABLE lease_locks (
    run_id TEXT NOT NULL,
    lease_id TEXT NOT NULL,
    lock_path TEXT NOT NULL,
    PRIMARY KEY (run_id, lease_id, lock_path)
);
