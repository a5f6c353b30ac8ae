-- An approval id is unique within its run, not across runs: two runs' journals may carry the
-- same hand-written id, and each run's plan honours its own line; keyed by id alone, the second
-- run's approval was never recorded, so it could be neither listed nor revoked (hostile review
-- 41). SQLite cannot change a primary key in place: the table is made again.
CREATE TABLE approvals_per_run (
    approval_id TEXT NOT NULL,
    run_id TEXT NOT NULL,
    at TEXT NOT NULL,
    by_actor TEXT NOT NULL,
    reason TEXT NOT NULL,
    task_index BIGINT NOT NULL,
    rollout_index BIGINT NOT NULL,
    attempt_index BIGINT NOT NULL,
    consumed_by_attempt BIGINT,
    revoked_at TEXT,
    PRIMARY KEY (run_id, approval_id)
);
INSERT INTO approvals_per_run (approval_id, run_id, at, by_actor, reason, task_index, rollout_index,
    attempt_index, consumed_by_attempt, revoked_at)
SELECT approval_id, run_id, at, by_actor, reason, task_index, rollout_index, attempt_index,
    consumed_by_attempt, revoked_at FROM approvals;
DROP TABLE approvals;
ALTER TABLE approvals_per_run RENAME TO approvals;
CREATE INDEX approvals_by_run ON approvals (run_id, at);
