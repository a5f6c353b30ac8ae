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
//!    lease that ends mid-section frees the lock when the section ends), or one taken for the
//!    duration. A `flock` held elsewhere (a Python collector, another service process) refuses
//!    with [`RunLockError::Locked`], except on PostgreSQL when that holder is another replica's
//!    live lease: then the advisory lock already excludes it.
//!
//! Invariants: the per-run mutex is the outermost lock and no lock is taken while waiting for it
//! except the ones above in that order; no process-wide mutex is held across IO; dropping a
//! [`LockedRun`] releases everything it took.

use crate::leases::Leases;
use recovery_sidecar::{LockError, RunLock, SidecarPaths};
use recovery_store::{AdvisoryLock, Backend, Store, StoreError};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use tokio::sync::OwnedMutexGuard;

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
}

/// This process's per-run mutexes (entries vanish once nobody holds or waits for them).
#[derive(Debug, Clone, Default)]
pub struct LocalRunLocks {
    mutexes: Arc<Mutex<HashMap<PathBuf, Weak<tokio::sync::Mutex<()>>>>>,
}

impl LocalRunLocks {
    /// Waits for this process's mutex of the run whose lock file is `run_lock`.
    pub async fn lock(&self, run_lock: &Path) -> OwnedMutexGuard<()> {
        let mutex = {
            let mut mutexes = self
                .mutexes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            mutexes.retain(|_, weak| weak.strong_count() > 0);
            match mutexes.get(run_lock).and_then(Weak::upgrade) {
                Some(mutex) => mutex,
                None => {
                    let mutex = Arc::new(tokio::sync::Mutex::new(()));
                    mutexes.insert(run_lock.to_owned(), Arc::downgrade(&mutex));
                    mutex
                }
            }
        };
        mutex.lock_owned().await
    }
}

/// How the run's `flock` is held during a section.
#[derive(Debug)]
enum Flock {
    /// Our live lease's lock, shared for the section.
    Lease(#[allow(dead_code)] Arc<RunLock>),
    /// Taken for the section only.
    Section(#[allow(dead_code)] RunLock),
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
    _local: OwnedMutexGuard<()>,
}

impl LockedRun {
    /// The companions of the locked run's output.
    pub fn paths(&self) -> &SidecarPaths {
        &self.paths
    }
}

/// A run's rows locked against this service's writers (the per-run mutex and, on PostgreSQL,
/// the advisory lock) without its `flock`: enough to bring the database up to date with files
/// that are read, never written (reindex, adoption), even while a Python collector owns the run.
#[derive(Debug)]
pub struct RowsGuard {
    _advisory: AdvisoryLock,
    _local: OwnedMutexGuard<()>,
}

/// Hands out [`LockedRun`]s.
#[derive(Debug, Clone)]
pub struct RunLocks {
    store: Store,
    leases: Leases,
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
        Self { store, leases }
    }

    pub fn leases(&self) -> &Leases {
        &self.leases
    }

    /// Enters the run's critical section (see the module doc); waits for this process's and other
    /// replicas' sections, refuses when another process owns the `flock`.
    pub async fn lock(&self, paths: &SidecarPaths) -> Result<LockedRun, RunLockError> {
        let local = self.leases.local().lock(&paths.run_lock).await;
        let advisory = self
            .store
            .advisory_lock(advisory_key(&paths.run_lock))
            .await?;
        let flock = match self.leases.held_lock(&paths.run_lock) {
            Some(lock) => Flock::Lease(lock),
            None => {
                let run_lock = paths.run_lock.clone();
                let taken =
                    tokio::task::spawn_blocking(move || RunLock::for_output(&run_lock, None))
                        .await
                        .map_err(|e| RunLockError::Join(e.to_string()))?;
                match taken {
                    Ok(lock) => Flock::Section(lock),
                    Err(LockError::Owned(path)) => {
                        if self.other_replica_holds(&paths.output).await? {
                            Flock::OtherReplica
                        } else {
                            return Err(LockError::Owned(path).into());
                        }
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        };
        Ok(LockedRun {
            paths: paths.clone(),
            _flock: flock,
            _advisory: advisory,
            _local: local,
        })
    }

    /// Locks a run's rows only (see [`RowsGuard`]).
    pub async fn lock_rows(&self, paths: &SidecarPaths) -> Result<RowsGuard, RunLockError> {
        let local = self.leases.local().lock(&paths.run_lock).await;
        let advisory = self
            .store
            .advisory_lock(advisory_key(&paths.run_lock))
            .await?;
        Ok(RowsGuard {
            _advisory: advisory,
            _local: local,
        })
    }

    /// Whether, on PostgreSQL, a live lease of another replica holds this run lock.
    async fn other_replica_holds(&self, output: &Path) -> Result<bool, StoreError> {
        if self.store.backend() != Backend::Postgres {
            return Ok(false);
        }
        self.leases.other_replica_holds(output).await
    }
}
