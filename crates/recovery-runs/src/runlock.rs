//! One writer per run: the critical section every change to a run's files and rows happens in.
//!
//! A [`LockedRun`] is handed out only by [`RunLocks::lock`], and every mutating operation of the
//! registry takes one, so a mutation without the lock does not compile. Holding it means, in this
//! order of acquisition:
//! 1. this process's per-run mutex (keyed by the resolved `<stem>_run.lock` path, so aliases of
//!    one output share it): concurrent requests of this service queue, FIFO;
//! 2. with PostgreSQL, a session advisory lock named after that path: replicas sharing the
//!    database queue too;
//! 3. the run's `flock`: the one a live lease of ours already holds (shared with the lease, so a
//!    lease that ends mid-section frees the lock when the section ends; a lease whose lock file
//!    was removed or replaced is ended first, as its `flock` excludes nobody), or one taken for
//!    the duration. A `flock` held elsewhere (a Python collector, another service process) refuses
//!    with [`RunLockError::Locked`], except on PostgreSQL when that holder is another replica's
//!    live lease: then the advisory lock already excludes it; and a shared section on
//!    PostgreSQL waits (at most 3 s) for another replica's shared sections, which hold the
//!    advisory lock beside it and the `flock` for that replica, to let the `flock` go.
//!
//! A [`SharedRun`] is the same section in shared mode, for work that only reads the run's files
//! and appends to a journal (a validation that reuses or resumes across operational drift):
//! shared sections of one run run side by side, never beside an exclusive one; they hold the
//! run's `flock` together (one taken for the first, released with the last), and each journal's
//! appends go through its group commit ([`crate::groupcommit`]), so a journal still has one
//! writer.
//!
//! A run being created ([`RunLocks::lock_creating`]) first takes its directory's creation lock
//! (this process's mutex and, with PostgreSQL, an advisory lock, both keyed by the directory):
//! two outputs of one directory may share files (`q.jsonl` and `q_failures.jsonl`, which is the
//! first one's failures sidecar), and their creates each check that the other's files are no
//! run's before writing their own, so they run one after the other (hostile review 55, F6: both
//! were created, and two runs wrote one file).
//!
//! Invariants: the per-run lock is the outermost lock but for a create's directory lock, which
//! is taken before it and only by creates; no lock is taken while waiting for it except the
//! ones above in that order; no process-wide mutex is held across IO (the shared
//! `flock` map is held only to take or release a `flock`, a non-blocking call); dropping a
//! section releases everything it took.

use crate::leases::Leases;
use recovery_sidecar::{LockError, RunLock, SidecarPaths};
use recovery_store::{AdvisoryLock, Backend, Store, StoreError};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

/// Why a run could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum RunLockError {
    /// Another process owns the run's `flock`.
    #[error(transparent)]
    Locked(#[from] LockError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("background lock work failed: {0}")]
    Join(String),
    /// Ending a lease whose lock file was displaced failed (the database).
    #[error(transparent)]
    Lease(Box<crate::leases::LeaseError>),
}

/// How long a shared section on PostgreSQL waits for other replicas' shared sections of the run
/// to let its `flock` go (see [`RunLocks::wait_for_other_replicas`]).
const REPLICA_SECTIONS_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// This process's per-run locks (entries vanish once nobody holds or waits for them).
#[derive(Debug, Clone, Default)]
pub struct LocalRunLocks {
    locks: Arc<Mutex<HashMap<PathBuf, Weak<RwLock<()>>>>>,
}

impl LocalRunLocks {
    fn entry(&self, run_lock: &Path) -> Arc<RwLock<()>> {
        let mut locks = self
            .locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(lock) = locks.get(run_lock).and_then(Weak::upgrade) {
            return lock;
        }
        locks.retain(|_, weak| weak.strong_count() > 0);
        let lock = Arc::new(RwLock::new(()));
        locks.insert(run_lock.to_owned(), Arc::downgrade(&lock));
        lock
    }

    /// Waits for this process's lock of the run whose lock file is `run_lock`, exclusively.
    pub async fn lock(&self, run_lock: &Path) -> OwnedRwLockWriteGuard<()> {
        self.entry(run_lock).write_owned().await
    }

    /// Waits for this process's lock of the run, shared with other readers.
    pub async fn read(&self, run_lock: &Path) -> OwnedRwLockReadGuard<()> {
        self.entry(run_lock).read_owned().await
    }

    /// [`Self::read`], and whether it had to wait (for a change of the run to end: what the
    /// reader looked up before may have changed meanwhile).
    pub async fn read_noting_wait(&self, run_lock: &Path) -> (OwnedRwLockReadGuard<()>, bool) {
        let entry = self.entry(run_lock);
        match entry.clone().try_read_owned() {
            Ok(guard) => (guard, false),
            Err(_) => (entry.read_owned().await, true),
        }
    }
}

/// Where a section takes the run's lock file.
#[derive(Debug, Clone, Copy)]
enum Place {
    /// In the run's directory as it is (every section of an existing run).
    RunDirectory,
    /// In the output's directory, made when missing (a run being created).
    MakingDirectory,
}

/// How the run's `flock` is held during a section.
#[derive(Debug)]
enum Flock {
    /// Our live lease's lock, shared for the section.
    Lease(#[allow(dead_code)] Arc<RunLock>),
    /// Taken for the section only.
    Section(#[allow(dead_code)] RunLock),
    /// Taken for the shared sections of this run, released with the last of them.
    Shared(#[allow(dead_code)] SharedFlock),
    /// Another replica's live lease holds it; the advisory lock excludes that replica.
    OtherReplica,
}

/// A run locked for changes. Fields drop in order: the `flock`, the advisory lock, then the
/// per-run mutex, so the next waiter of this process finds the run free.
#[derive(Debug)]
pub struct LockedRun {
    paths: SidecarPaths,
    _flock: Flock,
    _advisory: AdvisoryLock,
    _local: OwnedRwLockWriteGuard<()>,
    /// A create's directory lock, released last.
    _creating: Option<RowsGuard>,
}

/// A run locked in shared mode: its files are read and its journals appended to (through
/// [`crate::groupcommit`]), never rewritten. Drops in the same order as [`LockedRun`].
#[derive(Debug)]
pub struct SharedRun {
    paths: SidecarPaths,
    _flock: Flock,
    _advisory: AdvisoryLock,
    _local: OwnedRwLockReadGuard<()>,
}

impl SharedRun {
    /// The companions of the locked run's output.
    pub fn paths(&self) -> &SidecarPaths {
        &self.paths
    }
}

/// A section in either mode: what journal appends need.
pub trait RunSection: Send + Sync {
    fn paths(&self) -> &SidecarPaths;
}

impl RunSection for LockedRun {
    fn paths(&self) -> &SidecarPaths {
        &self.paths
    }
}

impl RunSection for SharedRun {
    fn paths(&self) -> &SidecarPaths {
        &self.paths
    }
}

type SharedFlocks = Arc<Mutex<HashMap<PathBuf, Weak<RunLock>>>>;

/// A `flock` shared by the shared sections of one run. It is released under the map's mutex, so
/// the next shared section either finds it held or takes it after it was released, never while
/// it is being released.
#[derive(Debug)]
struct SharedFlock {
    map: SharedFlocks,
    lock: Option<Arc<RunLock>>,
}

impl Drop for SharedFlock {
    fn drop(&mut self) {
        let _map = self
            .map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.lock.take();
    }
}

impl LockedRun {
    /// The companions of the locked run's output.
    pub fn paths(&self) -> &SidecarPaths {
        &self.paths
    }

    /// Whether this section took the run's `flock` itself: then no other process holds it, so
    /// a lease the database records for another holder has lost its process (a crash): the
    /// lease is an orphan.
    pub fn took_the_flock(&self) -> bool {
        matches!(self._flock, Flock::Section(_) | Flock::Shared(_))
    }
}

/// A run's rows locked against this service's writers (the per-run mutex and, on PostgreSQL,
/// the advisory lock) without its `flock`: enough to bring the database up to date with files
/// that are read, never written (reindex, adoption), even while a Python collector owns the run.
#[derive(Debug)]
pub struct RowsGuard {
    _advisory: AdvisoryLock,
    _local: OwnedRwLockWriteGuard<()>,
}

/// Hands out [`LockedRun`]s and [`SharedRun`]s.
#[derive(Debug, Clone)]
pub struct RunLocks {
    store: Store,
    leases: Leases,
    shared_flocks: SharedFlocks,
}

/// The key of the creation lock of an output's directory: a name in it that no run's lock
/// file has (those end in `_run.lock`), so it is never a run's key.
fn creation_key(paths: &SidecarPaths) -> PathBuf {
    paths
        .run_lock
        .parent()
        .unwrap_or(Path::new("/"))
        .join(".rollout-recovery creating runs")
}

/// The advisory lock key of a run: the first 8 bytes of SHA-256 of its lock path.
fn advisory_key(run_lock: &Path) -> i64 {
    let digest = Sha256::digest(run_lock.as_os_str().as_encoded_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

impl RunLocks {
    pub fn new(store: Store, leases: Leases) -> Self {
        Self {
            store,
            leases,
            shared_flocks: SharedFlocks::default(),
        }
    }

    pub fn leases(&self) -> &Leases {
        &self.leases
    }

    /// Enters the run's critical section (see the module doc); waits for this process's and other
    /// replicas' sections, refuses when another process owns the `flock`.
    pub async fn lock(&self, paths: &SidecarPaths) -> Result<LockedRun, RunLockError> {
        self.lock_making(paths, Place::RunDirectory).await
    }

    /// [`Self::lock`] for a run being created: its output's directory is made when missing.
    /// Every other section takes the lock in the run's directory as it is: a run whose
    /// directory was moved or removed is refused (`DirectoryGone`), never given a new one
    /// (hostile review 45: a call on such a run made the directory, and the run moved back
    /// landed inside it).
    /// A create also holds its directory's creation lock (see the module doc), taken first.
    pub async fn lock_creating(&self, paths: &SidecarPaths) -> Result<LockedRun, RunLockError> {
        let creating = self.lock_key(&creation_key(paths)).await?;
        let mut run = self.lock_making(paths, Place::MakingDirectory).await?;
        run._creating = Some(creating);
        Ok(run)
    }

    async fn lock_making(
        &self,
        paths: &SidecarPaths,
        place: Place,
    ) -> Result<LockedRun, RunLockError> {
        let RowsGuard { _advisory, _local } = self.lock_key(&paths.run_lock).await?;
        let flock = self.flock(paths, false, place).await?;
        Ok(LockedRun {
            paths: paths.clone(),
            _flock: flock,
            _advisory,
            _local,
            _creating: None,
        })
    }

    /// This process's lock of `key` and, with PostgreSQL, the advisory lock named after it.
    async fn lock_key(&self, key: &Path) -> Result<RowsGuard, RunLockError> {
        let local = self.leases.local().lock(key).await;
        let advisory = self.store.advisory_lock(advisory_key(key)).await?;
        Ok(RowsGuard {
            _advisory: advisory,
            _local: local,
        })
    }

    /// Enters the run's section in shared mode (see [`SharedRun`]).
    pub async fn lock_shared(&self, paths: &SidecarPaths) -> Result<SharedRun, RunLockError> {
        let local = self.leases.local().read(&paths.run_lock).await;
        let advisory = self
            .store
            .advisory_lock_shared(advisory_key(&paths.run_lock))
            .await?;
        let flock = self.flock(paths, true, Place::RunDirectory).await?;
        Ok(SharedRun {
            paths: paths.clone(),
            _flock: flock,
            _advisory: advisory,
            _local: local,
        })
    }

    /// The run's `flock` for a section: our lease's, the one shared sections hold, or a new one.
    async fn flock(
        &self,
        paths: &SidecarPaths,
        shared: bool,
        place: Place,
    ) -> Result<Flock, RunLockError> {
        if let Some(lock) = self.leases.held_lock(&paths.run_lock) {
            if lock.is_in_place() {
                return Ok(Flock::Lease(lock));
            }
            // The lease's lock file was removed or replaced: the file now at the path is taken
            // for the lease when it is free; when another process holds it, the lease ends and
            // the section locks that file as any section without a lease does.
            drop(lock);
            self.leases
                .end_if_displaced(&paths.run_lock)
                .await
                .map_err(|e| RunLockError::Lease(Box::new(e)))?;
            // The new file was free and is now locked for the lease: the section runs under it.
            if let Some(lock) = self.leases.held_lock(&paths.run_lock)
                && lock.is_in_place()
            {
                return Ok(Flock::Lease(lock));
            }
        }
        match self.take_flock(paths, shared, place).await? {
            Ok(flock) => Ok(flock),
            Err(LockError::Owned(path)) => {
                if self.other_replica_holds(&paths.output).await? {
                    return Ok(Flock::OtherReplica);
                }
                if shared && self.store.backend() == Backend::Postgres {
                    if let Some(flock) = self.wait_for_other_replicas(paths).await? {
                        return Ok(flock);
                    }
                }
                Err(LockError::Owned(path).into())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Takes the run's `flock` for a section (shared: the one this process's shared sections of
    /// the run hold together, taken for the first), without waiting.
    async fn take_flock(
        &self,
        paths: &SidecarPaths,
        shared: bool,
        place: Place,
    ) -> Result<Result<Flock, LockError>, RunLockError> {
        let (run_lock, map) = (paths.run_lock.clone(), self.shared_flocks.clone());
        if shared {
            // Another shared section holds the run's flock: share it, no file work.
            let flocks = map
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(lock) = flocks.get(&run_lock).and_then(Weak::upgrade) {
                drop(flocks);
                return Ok(Ok(Flock::Shared(SharedFlock {
                    map,
                    lock: Some(lock),
                })));
            }
        }
        tokio::task::spawn_blocking(move || {
            let take = |run_lock: &Path| match place {
                Place::MakingDirectory => RunLock::for_output(run_lock, None),
                Place::RunDirectory => {
                    RunLock::acquire_in_existing_directories([run_lock.to_owned()])
                }
            };
            if !shared {
                return take(&run_lock).map(Flock::Section);
            }
            let mut flocks = map
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let lock = match flocks.get(&run_lock).and_then(Weak::upgrade) {
                Some(lock) => lock,
                None => {
                    let lock = Arc::new(take(&run_lock)?);
                    flocks.retain(|_, weak| weak.strong_count() > 0);
                    flocks.insert(run_lock, Arc::downgrade(&lock));
                    lock
                }
            };
            drop(flocks);
            Ok(Flock::Shared(SharedFlock {
                map,
                lock: Some(lock),
            }))
        })
        .await
        .map_err(|e| RunLockError::Join(e.to_string()))
    }

    /// A shared section on PostgreSQL that found the run's `flock` held: shared sections of
    /// several replicas hold the advisory lock together, but each replica's hold the `flock` for
    /// it, so another replica's sections (a validation's moment) hold it now. Tries again, at
    /// growing intervals (a `flock` tells no waiter when it is let go, and a blocking `flock`
    /// would hold a thread for as long as an outside process keeps it), for at most
    /// [`REPLICA_SECTIONS_WAIT`]; `None` when it is still held then (a process outside the
    /// service, which the caller refuses as ever).
    async fn wait_for_other_replicas(
        &self,
        paths: &SidecarPaths,
    ) -> Result<Option<Flock>, RunLockError> {
        let deadline = tokio::time::Instant::now() + REPLICA_SECTIONS_WAIT;
        let mut pause = std::time::Duration::from_millis(1);
        while tokio::time::Instant::now() < deadline {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(std::time::Duration::from_millis(20));
            match self.take_flock(paths, true, Place::RunDirectory).await? {
                Ok(flock) => return Ok(Some(flock)),
                Err(LockError::Owned(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(None)
    }

    /// Locks a run's rows only (see [`RowsGuard`]).
    pub async fn lock_rows(&self, paths: &SidecarPaths) -> Result<RowsGuard, RunLockError> {
        self.lock_key(&paths.run_lock).await
    }

    /// Whether, on PostgreSQL, a live lease of another replica holds this run lock.
    async fn other_replica_holds(&self, output: &Path) -> Result<bool, StoreError> {
        if self.store.backend() != Backend::Postgres {
            return Ok(false);
        }
        self.leases.other_replica_holds(output).await
    }
}
