//! Read-through caches of the rows every request looks up (a run's record, its lease), for a
//! database this process alone writes: an SQLite file belongs to one service process, which
//! holds its lock (`owner.rs`), and the stores of the file within the process share one cache.
//! On PostgreSQL, where replicas write the same rows, nothing is cached.
//!
//! Invariants:
//! - every write of a cached table goes through a [`crate::Store`] method that calls
//!   [`RowCache::forget`] (or [`RowCache::forget_all`]) once its statement has run, whatever its
//!   result;
//! - a lookup fills the cache only when no write was forgotten since the lookup began (the
//!   generation it read first is still current), so a row read before a write can never be
//!   kept after it;
//! - absent rows are cached too (most runs have no lease), and the cache is bounded: past
//!   [`MAX_ROWS`] it starts again empty.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Rows kept at most (one per run id); a run's record or lease is a few hundred bytes.
const MAX_ROWS: usize = 10_000;

#[derive(Debug)]
pub(crate) struct RowCache<V> {
    enabled: bool,
    inner: Mutex<Inner<V>>,
}

#[derive(Debug)]
struct Inner<V> {
    rows: HashMap<String, Option<V>>,
    /// Counts forgotten writes.
    generation: u64,
}

impl<V: Clone> RowCache<V> {
    /// A cache that keeps rows only when `enabled` (the database is this process's alone).
    pub(crate) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            inner: Mutex::new(Inner {
                rows: HashMap::new(),
                generation: 0,
            }),
        }
    }

    fn inner(&self) -> MutexGuard<'_, Inner<V>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The cached row of `key` (`Some(None)`: known to be absent), or where a lookup that
    /// may fill it starts (the generation to hand to [`Self::fill`]).
    pub(crate) fn get(&self, key: &str) -> Result<Option<V>, u64> {
        let inner = self.inner();
        match inner.rows.get(key) {
            Some(row) if self.enabled => Ok(row.clone()),
            _ => Err(inner.generation),
        }
    }

    /// Keeps what a lookup that started at generation `since` read, unless a write was
    /// forgotten meanwhile.
    pub(crate) fn fill(&self, key: &str, row: Option<V>, since: u64) {
        if !self.enabled {
            return;
        }
        let mut inner = self.inner();
        if inner.generation != since {
            return;
        }
        if inner.rows.len() >= MAX_ROWS {
            inner.rows.clear();
        }
        inner.rows.insert(key.to_owned(), row);
    }

    /// Forgets `key` after a write of its row.
    pub(crate) fn forget(&self, key: &str) {
        let mut inner = self.inner();
        inner.generation += 1;
        inner.rows.remove(key);
    }

    /// Forgets every row after a write that may touch several.
    pub(crate) fn forget_all(&self) {
        let mut inner = self.inner();
        inner.generation += 1;
        inner.rows.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::RowCache;

    #[test]
    fn a_row_read_before_a_write_is_never_kept_after_it() {
        let cache = RowCache::<u32>::new(true);
        let since = cache.get("run").expect_err("empty");
        // A write lands (and is forgotten) while the lookup is under way.
        cache.forget("run");
        cache.fill("run", Some(1), since);
        assert_eq!(cache.get("run"), Err(1), "the stale row was not kept");
        let since = cache.get("run").expect_err("still empty");
        cache.fill("run", Some(2), since);
        assert_eq!(cache.get("run"), Ok(Some(2)));
    }

    #[test]
    fn absent_rows_are_kept_and_forgotten_like_present_ones() {
        let cache = RowCache::<u32>::new(true);
        let since = cache.get("run").expect_err("empty");
        cache.fill("run", None, since);
        assert_eq!(cache.get("run"), Ok(None));
        cache.forget_all();
        assert!(cache.get("run").is_err());
    }

    #[test]
    fn a_disabled_cache_keeps_nothing() {
        let cache = RowCache::<u32>::new(false);
        let since = cache.get("run").expect_err("empty");
        cache.fill("run", Some(1), since);
        assert!(cache.get("run").is_err());
    }
}
