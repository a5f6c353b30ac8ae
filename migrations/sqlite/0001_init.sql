-- rollout-recovery store, SQLite form. Times are fixed-width RFC 3339 UTC text (text order is
-- time order); JSON lists are text; booleans are 0/1 integers (one decoding on both backends). Rows mirror sidecar lines by their ids, so inserts are
-- idempotent and a reindex can replay the sidecars.
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY,
    output_path TEXT NOT NULL UNIQUE,
    source_digest TEXT NOT NULL,
    materialized_digest TEXT NOT NULL,
    config_digest TEXT NOT NULL,
    legacy_import BIGINT NOT NULL DEFAULT 0,
    identity_overridden BIGINT NOT NULL DEFAULT 0,
    max_rollout_attempts BIGINT,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);

CREATE TABLE resume_events (
    event_id TEXT PRIMARY KEY,
    run_id TEXT,
    output_path TEXT NOT NULL,
    at TEXT NOT NULL,
    outcome TEXT NOT NULL,
    message TEXT NOT NULL,
    reasons TEXT NOT NULL,
    semantic_keys TEXT NOT NULL,
    operational_keys TEXT NOT NULL,
    saved_config_digest TEXT,
    current_config_digest TEXT,
    client TEXT
);
CREATE INDEX resume_events_by_run ON resume_events (run_id, at);

CREATE TABLE drift_events (
    event_id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    at TEXT NOT NULL,
    saved_config_digest TEXT NOT NULL,
    current_config_digest TEXT NOT NULL,
    operational_keys TEXT NOT NULL
);
CREATE INDEX drift_events_by_time ON drift_events (at, event_id);
CREATE INDEX drift_events_by_run ON drift_events (run_id, at, event_id);

CREATE TABLE drift_event_keys (
    event_id TEXT NOT NULL,
    key TEXT NOT NULL,
    PRIMARY KEY (event_id, key)
);
CREATE INDEX drift_event_keys_by_key ON drift_event_keys (key, event_id);

CREATE TABLE approvals (
    approval_id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    at TEXT NOT NULL,
    by_actor TEXT NOT NULL,
    reason TEXT NOT NULL,
    task_index BIGINT NOT NULL,
    rollout_index BIGINT NOT NULL,
    attempt_index BIGINT NOT NULL,
    consumed_by_attempt BIGINT,
    revoked_at TEXT
);
CREATE INDEX approvals_by_run ON approvals (run_id, at);

CREATE TABLE attempt_extensions (
    event_id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    at TEXT NOT NULL,
    by_actor TEXT NOT NULL,
    reason TEXT NOT NULL,
    extend_attempts BIGINT NOT NULL
);

CREATE TABLE resubmits (
    event_id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    at TEXT NOT NULL,
    by_actor TEXT NOT NULL,
    line_offset BIGINT NOT NULL
);

CREATE TABLE rejudgments (
    operation_id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    attempt_key TEXT NOT NULL,
    admitted_at TEXT NOT NULL,
    predecessor_failure_id TEXT NOT NULL,
    predecessor_sha256 TEXT NOT NULL,
    closed_at TEXT,
    outcome TEXT
);

CREATE TABLE leases (
    run_id TEXT PRIMARY KEY,
    lease_id TEXT NOT NULL,
    holder TEXT NOT NULL,
    host TEXT NOT NULL,
    pid BIGINT NOT NULL,
    acquired_at TEXT NOT NULL,
    renewed_at TEXT NOT NULL,
    expires_at TEXT NOT NULL,
    replica TEXT NOT NULL
);

CREATE TABLE audit_log (
    audit_id TEXT PRIMARY KEY,
    at TEXT NOT NULL,
    actor TEXT NOT NULL,
    action TEXT NOT NULL,
    run_id TEXT,
    details TEXT NOT NULL
);
CREATE INDEX audit_log_by_time ON audit_log (at, audit_id);
