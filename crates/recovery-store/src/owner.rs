//! One service process per SQLite file. The process that opens an SQLite database takes an
//! exclusive `flock` on `<database>-service.lock` beside it (the database's path resolved, so
//! a link names the same lock; a database file with hard links is refused) and keeps it while any store of that
//! file is open in the process; another process is refused with [`StoreError::InUse`] instead of
//! running a second, disagreeing authority over the same runs and leases (several replicas need
//! PostgreSQL). Stores of one file within one process share one owner, hence one row cache
//! ([`crate::rowcache`]), so what one of them writes the others never answer stale.

use crate::StoreError;
use crate::records::{Lease, RunRecord};
use crate::rowcache::RowCache;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, Weak};

/// What the stores of one database share in this process.
#[derive(Debug)]
pub(crate) struct Owner {
    /// The `flock` of an SQLite file (released when the last store of it goes).
    lock: Option<fd_lock::RwLock<File>>,
    pub(crate) runs: RowCache<RunRecord>,
    pub(crate) leases: RowCache<Lease>,
}

impl Owner {
    /// Nothing shared, nothing cached (PostgreSQL: replicas write the same rows).
    pub(crate) fn uncached() -> Arc<Self> {
        Arc::new(Self {
            lock: None,
            runs: RowCache::new(false),
            leases: RowCache::new(false),
        })
    }

    /// The owner of the SQLite database at `url` in this process: the existing one, or a new
    /// one once this process holds the file's lock.
    pub(crate) fn of_sqlite(url: &str) -> Result<Arc<Self>, StoreError> {
        let Some(lock_path) = lock_path(url)? else {
            // An in-memory database is this store's alone.
            return Ok(Arc::new(Self::cached(None)));
        };
        static OWNERS: Mutex<Vec<(PathBuf, Weak<Owner>)>> = Mutex::new(Vec::new());
        let mut owners = OWNERS.lock().unwrap_or_else(PoisonError::into_inner);
        owners.retain(|(_, owner)| owner.strong_count() > 0);
        if let Some(owner) = owners
            .iter()
            .find(|(path, _)| *path == lock_path)
            .and_then(|(_, owner)| owner.upgrade())
        {
            return Ok(owner);
        }
        let owner = Arc::new(Self::cached(Some(take_lock(&lock_path)?)));
        owners.push((lock_path, Arc::downgrade(&owner)));
        Ok(owner)
    }

    fn cached(lock: Option<fd_lock::RwLock<File>>) -> Self {
        Self {
            lock,
            runs: RowCache::new(true),
            leases: RowCache::new(true),
        }
    }
}

impl Drop for Owner {
    /// Unlocks before the file closes: a process forked meanwhile holds a copy of the
    /// descriptor until it execs, and closing alone would leave the database locked that long
    /// (see `recovery_sidecar::RunLock`).
    fn drop(&mut self) {
        if let Some(guard) = self.lock.as_mut().and_then(|lock| lock.try_write().ok()) {
            drop(guard);
        }
    }
}

/// `<database>-service.lock` beside the database file an `sqlite:` URL names, `None` for an
/// in-memory database. The file's path is resolved first (a symbolic link to the database, or
/// to its directory, names the same database, hence the same lock); a database file with
/// several names (hard links) is refused, as no name-based lock can cover them all (and
/// SQLite's own journal would differ per name: its documentation warns of corruption).
fn lock_path(url: &str) -> Result<Option<PathBuf>, StoreError> {
    let Some(rest) = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
    else {
        return Ok(None);
    };
    let path = rest.split('?').next().unwrap_or_default();
    if path.is_empty() || path == ":memory:" || url.contains("mode=memory") {
        return Ok(None);
    }
    // The file SQLite will open, as the driver reads the URL (percent-decoded): a lock named
    // from the URL's text would miss `%2D` spelling `-`.
    let options = <sqlx::sqlite::SqliteConnectOptions as std::str::FromStr>::from_str(url)?;
    let path = options.get_filename();
    let Some(name) = path.file_name() else {
        return Ok(None);
    };
    let resolved = match std::fs::canonicalize(path) {
        Ok(resolved) => resolved,
        // Not created yet: its directory resolved, the name kept.
        Err(_) => match path.parent().filter(|p| !p.as_os_str().is_empty()) {
            Some(parent) => parent
                .canonicalize()
                .unwrap_or_else(|_| parent.to_owned())
                .join(name),
            None => std::env::current_dir().unwrap_or_default().join(name),
        },
    };
    if let Ok(metadata) = std::fs::metadata(&resolved)
        && std::os::unix::fs::MetadataExt::nlink(&metadata) > 1
    {
        return Err(StoreError::HardLinked(resolved.display().to_string()));
    }
    let mut lock = resolved.into_os_string();
    lock.push("-service.lock");
    Ok(Some(PathBuf::from(lock)))
}

fn take_lock(path: &Path) -> Result<fd_lock::RwLock<File>, StoreError> {
    let io = |source| StoreError::Lock {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .open(path)
        .map_err(io)?;
    let mut lock = fd_lock::RwLock::new(file);
    match lock.try_write() {
        // The guard would unlock when dropped; the lock lives as long as the file instead.
        Ok(guard) => std::mem::forget(guard),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
            return Err(StoreError::InUse(path.display().to_string()));
        }
        Err(e) => return Err(io(e)),
    }
    Ok(lock)
}
