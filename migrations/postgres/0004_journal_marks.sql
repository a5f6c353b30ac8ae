-- How far each append-only journal has been indexed: a reindex reads a journal from its mark when
-- the file is the same one (device and inode), so a restart reads only what was appended since.
CREATE TABLE journal_marks (
    path TEXT PRIMARY KEY,
    device BIGINT NOT NULL,
    inode BIGINT NOT NULL,
    indexed_to BIGINT NOT NULL
);
