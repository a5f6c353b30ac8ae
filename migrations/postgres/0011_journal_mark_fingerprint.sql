-- What a journal held just before its mark: the SHA-256 of up to 4,096 bytes ending at
-- `indexed_to`. A reindex reads from the mark only when those bytes are unchanged, so a journal
-- rewritten in place (same inode, as long as the mark or longer) is read again from its start
-- instead of from the middle of a line. Marks taken before this column existed have none and
-- are read again from the start once (inserting known events is a no-op).
ALTER TABLE journal_marks ADD COLUMN before_mark TEXT;
