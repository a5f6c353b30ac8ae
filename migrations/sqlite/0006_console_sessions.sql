-- Operators' console sessions: the SHA-256 of a random session id (the cookie holds the id, the
-- database never), who signed in with which role, and until when.
CREATE TABLE console_sessions (
    session_hash TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    role TEXT NOT NULL,
    created_at TEXT NOT NULL,
    expires_at TEXT NOT NULL
);
CREATE INDEX console_sessions_by_expiry ON console_sessions (expires_at);
