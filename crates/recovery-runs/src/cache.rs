//! Derived state of files, cached by file identity, so a warm `validate` reads no file it has
//! read before: the source dataset's SHA-256, the saved materialized inputs' digest and server
//! references, the saved identity.
//!
//! Invariants: an entry is keyed by the path and the file's identity (device, inode, size,
//! modification and change times in nanoseconds) taken *before* the file is read, and is kept only
//! when the identity is unchanged after the read, so a file changed during or after a read is read
//! again (an atomic replace changes the inode; an in-place write changes size or times). File
//! times move in coarse ticks, so a same-size rewrite within one tick keeps them: as git does with
//! its index, a file changed within [`SETTLE`] of its read is "racy" and not cached. Callers of
//! one path wait for each other (one read of a 1 GB file, not one per caller); callers of
//! different paths never do. Blocking: call from blocking threads.

use recovery_core::identity::RowReferences;
use serde_json::Value;
use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

/// What identifies a file's content without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    device: u64,
    inode: u64,
    size: u64,
    modified_ns: i128,
    changed_ns: i128,
}

impl FileIdentity {
    /// The identity of the file at `path` (symlinks followed).
    pub fn of(path: &Path) -> std::io::Result<Self> {
        let m = std::fs::metadata(path)?;
        Ok(Self {
            device: m.dev(),
            inode: m.ino(),
            size: m.size(),
            modified_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
            changed_ns: i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec()),
        })
    }
}

/// How long after its last change a file's identity is trusted to name its content.
pub const SETTLE: std::time::Duration = std::time::Duration::from_secs(2);

impl FileIdentity {
    /// Whether the file changed so recently (or in the future) that a same-size rewrite in the
    /// same timestamp tick could go unseen.
    pub(crate) fn is_racy(&self) -> bool {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i128);
        let settled = now - SETTLE.as_nanos() as i128;
        self.modified_ns.max(self.changed_ns) > settled
    }
}

type Slot<T> = Arc<Mutex<Option<(FileIdentity, T)>>>;

/// One kind of derived value per path.
#[derive(Debug)]
pub struct FileCache<T> {
    slots: Mutex<HashMap<PathBuf, Slot<T>>>,
}

impl<T> Default for FileCache<T> {
    fn default() -> Self {
        Self {
            slots: Mutex::new(HashMap::new()),
        }
    }
}

impl<T: Clone> FileCache<T> {
    /// The value derived from the file at `path`: cached while the file's identity holds,
    /// else computed by `derive` (and cached when the file did not change meanwhile). A file
    /// that cannot be stat'ed is derived every time (its error is `derive`'s to report).
    pub fn get<E>(&self, path: &Path, derive: impl FnOnce(&Path) -> Result<T, E>) -> Result<T, E> {
        let Ok(before) = FileIdentity::of(path) else {
            return derive(path);
        };
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
            slots.entry(path.to_owned()).or_default().clone()
        };
        let mut entry = slot.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((identity, value)) = entry.as_ref()
            && *identity == before
        {
            return Ok(value.clone());
        }
        let value = derive(path)?;
        if !before.is_racy() && FileIdentity::of(path).is_ok_and(|after| after == before) {
            *entry = Some((before, value.clone()));
        }
        Ok(value)
    }

    /// The cached value for the file at `path` when its identity still holds (one `stat`, never
    /// a read; `None` when it would have to be derived, or another caller is deriving it).
    pub fn peek(&self, path: &Path) -> Option<T> {
        let now = FileIdentity::of(path).ok()?;
        let slot = {
            let slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
            slots.get(path)?.clone()
        };
        let entry = slot.try_lock().ok()?;
        entry
            .as_ref()
            .filter(|(identity, _)| *identity == now)
            .map(|(_, value)| value.clone())
    }
}

/// Values derived from a request's contents, keyed by the SHA-256 of those contents: the most
/// recent few are kept (a fleet of collectors restarting with one configuration computes its
/// identity once). Blocking: call from blocking threads.
#[derive(Debug)]
pub struct Recent<T> {
    entries: Mutex<std::collections::VecDeque<([u8; 32], Arc<T>)>>,
    capacity: usize,
}

impl<T> Recent<T> {
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: Mutex::new(std::collections::VecDeque::with_capacity(capacity)),
            capacity,
        }
    }

    /// The value for `key` when it is among the recent ones.
    pub fn peek(&self, key: &[u8; 32]) -> Option<Arc<T>> {
        let entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, value)| value.clone())
    }

    /// The value for `key`, derived (outside the lock: concurrent misses each derive) when it is
    /// not among the recent ones.
    pub fn get_or_try<E>(
        &self,
        key: [u8; 32],
        derive: impl FnOnce() -> Result<T, E>,
    ) -> Result<Arc<T>, E> {
        {
            let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(i) = entries.iter().position(|(k, _)| *k == key) {
                let entry = entries.remove(i).expect("present");
                let value = entry.1.clone();
                entries.push_front(entry);
                return Ok(value);
            }
        }
        let value = Arc::new(derive()?);
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        entries.retain(|(k, _)| *k != key);
        entries.push_front((key, value.clone()));
        entries.truncate(self.capacity);
        Ok(value)
    }
}

/// The saved materialized inputs as a resume compares them.
#[derive(Debug, Clone)]
pub struct MaterializedFacts {
    pub digest: String,
    pub references: Arc<RowReferences>,
}

/// Every cache a registry keeps.
#[derive(Debug)]
pub struct RunCaches {
    /// SHA-256 of source datasets.
    pub sources: FileCache<String>,
    /// Digest and server references of saved materialized inputs.
    pub materialized: FileCache<MaterializedFacts>,
    /// Saved identities (`None`: present but not JSON).
    pub identities: FileCache<Option<Arc<Value>>>,
    /// Saved manifests as read (every validate reads the run's; profiled at 6% of the CPU of a
    /// validate answering `reuse` when it was read and parsed each time). A write replaces the
    /// file, so its identity changes.
    pub manifests: FileCache<recovery_core::verdict::SavedManifest>,
    /// Resume plans, indexed once per run and caught up with appended outcomes.
    pub plans: crate::plans::PlanCache,
    /// Current identities of recent validations, by their configuration, environment and rows.
    pub current_identities: Recent<recovery_core::identity::ConfigurationIdentity>,
    /// Digests and server references of rows recent validations sent, by the rows' texts.
    pub sent_rows: Recent<MaterializedFacts>,
}

impl Default for RunCaches {
    fn default() -> Self {
        Self {
            sources: FileCache::default(),
            materialized: FileCache::default(),
            identities: FileCache::default(),
            manifests: FileCache::default(),
            plans: crate::plans::PlanCache::default(),
            current_identities: Recent::new(64),
            sent_rows: Recent::new(16),
        }
    }
}
