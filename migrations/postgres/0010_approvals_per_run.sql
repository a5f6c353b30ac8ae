-- An approval id is unique within its run, not across runs: two runs' journals may carry the
-- same hand-written id, and each run's plan honours its own line; keyed by id alone, the second
-- run's approval was never recorded, so it could be neither listed nor revoked (hostile review
-- 41).
ALTER TABLE approvals DROP CONSTRAINT approvals_pkey;
ALTER TABLE approvals ADD PRIMARY KEY (run_id, approval_id);
