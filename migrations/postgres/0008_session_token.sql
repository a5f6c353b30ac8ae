-- A console session belongs to the token that opened it: a domain-separated SHA-256 of the
-- token's SHA-256 (never the token), compared with the configured tokens' on every request, so a
-- rotated or removed token signs its sessions out.
ALTER TABLE console_sessions ADD COLUMN token_fingerprint TEXT;
