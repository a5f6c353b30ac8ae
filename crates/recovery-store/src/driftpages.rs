//! Rendered drift pages kept between requests: dashboards ask for the same pages again and
//! again, and a page of 1,000 events costs about 2 ms of CPU to build (the database's scan and
//! JSON, read and laid out again) where answering it again costs the one small query below.
//!
//! Invariants:
//! - the drift history only grows: events are inserted, never changed or deleted, and every
//!   event inserted draws the next recorded position in the transaction that inserts it, in
//!   commit order on both backends (migrations 0009 and 0010); a database made again draws a new
//!   epoch. So `(epoch, highest position)` names exactly the events a reader can see, and a page
//!   of a filter is a function of it;
//! - a page is kept with the version read by the statement that built it (one snapshot), and
//!   answered again only while a fresh read of the version is equal. That read goes to the
//!   database, so on PostgreSQL another replica's insert is seen as at once as the page query
//!   itself would see it: a kept page is never older than a fresh one would be;
//! - bounded by the bytes of the pages kept ([`MAX_BYTES`]), least recently useful first out.

use crate::{DriftFilter, RenderedDriftPage};
use std::sync::Arc;

/// Bytes of rendered pages kept at most (a page of 1,000 events is about 400 KB).
const MAX_BYTES: u64 = 32 << 20;
/// Pages the cache expects to hold (its table is sized for it; it holds more or fewer by weight).
const EXPECTED_PAGES: usize = 256;

/// Which drift history a page was read in: the recorded order's epoch and highest position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DriftVersion {
    pub(crate) epoch: String,
    pub(crate) head: i64,
}

#[derive(Debug, Clone)]
struct KeptPage {
    version: DriftVersion,
    page: Arc<RenderedDriftPage>,
}

/// A kept page weighs its JSON text.
#[derive(Debug, Clone)]
struct ByBytes;

impl quick_cache::Weighter<DriftFilter, KeptPage> for ByBytes {
    fn weight(&self, _filter: &DriftFilter, kept: &KeptPage) -> u64 {
        kept.page.events_json.len() as u64 + 64
    }
}

/// The kept pages, by filter.
#[derive(Debug)]
pub(crate) struct DriftPages {
    pages: quick_cache::sync::Cache<DriftFilter, KeptPage, ByBytes>,
}

impl Default for DriftPages {
    fn default() -> Self {
        Self {
            pages: quick_cache::sync::Cache::with_weighter(EXPECTED_PAGES, MAX_BYTES, ByBytes),
        }
    }
}

impl DriftPages {
    /// The page of `filter` kept at `current`, the history's version just read.
    pub(crate) fn get(
        &self,
        filter: &DriftFilter,
        current: &DriftVersion,
    ) -> Option<Arc<RenderedDriftPage>> {
        self.pages
            .get(filter)
            .filter(|kept| &kept.version == current)
            .map(|kept| kept.page)
    }

    /// Keeps `page`, built by one statement that read the history at `version`.
    pub(crate) fn keep(
        &self,
        filter: DriftFilter,
        version: DriftVersion,
        page: Arc<RenderedDriftPage>,
    ) {
        self.pages.insert(filter, KeptPage { version, page });
    }
}
