//! Leases: the service owns each run's lock. A lease names its holder (client name, host, pid),
//! lives for a TTL renewed by heartbeat, and while it is live this process holds the run's
//! `flock`, so neither another collector (a Python process included) nor another replica can
//! write the output. An expired lease is swept (its `flock` released); an operator may take a run
//! over, which is audited.
//!
//! Invariants: the `flock` is taken before the database grants a lease and released after the
//! database forgets it, so a granted lease always has its lock; lease operations on one run run
//! inside that run's per-run mutex (the one [`crate::RunLocks`] uses), and the map of held locks is
//! locked only for map changes, never across IO; a lease found expired is ended (its `flock`
//! released) before anyone is told it expired; a heartbeat or release under a lease id that no
//! longer holds the run fails; a lease whose lock file was removed or replaced locks the file
//! now at the path before anything runs under it (the files in place stay locked throughout),
//! or ends when another process holds that file. A lease id is told once, to the collector it
//! is granted to ([`Granted`]); everything else, in memory and in the database, keeps its
//! [`lease_digest`], and an id presented by a caller is digested as it comes in.

use crate::clock::Clock;
use crate::runlock::LocalRunLocks;
use recovery_sidecar::{LockError, RunLock};
use recovery_store::{AuditEntry, Lease, Store, StoreError, lease_digest};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// How long a replica waits for another to let go of a run's `flock` after the database ended
/// that replica's lease (a takeover, a release or an expiry elsewhere): each replica lets go
/// at its next lease sweep (every second), so two sweeps and a margin.
pub const HANDOFF_WAIT: std::time::Duration = std::time::Duration::from_secs(3);
const HANDOFF_POLL: std::time::Duration = std::time::Duration::from_millis(25);

/// Why a lease operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("run {} is held by {} (host {}, pid {}) until {}", .0.run_id, .0.holder, .0.host, .0.pid, .0.expires_at)]
    Held(Box<Lease>),
    /// The checkpoint directory asked for is locked by another run's lease of this service:
    /// two runs never share one.
    #[error("checkpoint_dir {}: Another collector owns this checkpoint directory (run {}, held by {}); each run needs its own checkpoint directory", .checkpoint_dir.display(), .lease.run_id, .lease.holder)]
    CheckpointInUse {
        checkpoint_dir: PathBuf,
        lease: Box<Lease>,
    },
    /// The checkpoint directory asked for is locked by a process outside this service (a
    /// Python collector).
    #[error("checkpoint_dir {}: Another collector owns this checkpoint directory. Wait for it to stop, or give this run its own checkpoint directory.", .checkpoint_dir.display())]
    CheckpointLocked { checkpoint_dir: PathBuf },
    #[error(transparent)]
    Locked(#[from] LockError),
    #[error("the lease presented does not hold run {run_id} (expired, released or taken over)")]
    NotHolder { run_id: String, lease_id: String },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("background lock work failed: {0}")]
    Join(String),
    /// Another run took the run's output over (found once its `flock` was held).
    #[error("run {run_id} was superseded by run {successor}, which owns its output now")]
    Superseded { run_id: String, successor: String },
}

/// A lease just granted: its record (which keeps the digest of its id) and the id itself, the
/// holder's proof of ownership, told to the holder only.
#[derive(Debug, Clone)]
pub struct Granted {
    pub lease: Lease,
    pub lease_id: String,
}

impl Granted {
    /// A fresh lease id, and the record of `lease` under its digest.
    fn new(lease: impl FnOnce(String) -> Lease) -> Self {
        let lease_id = recovery_sidecar::new_id();
        Self {
            lease: lease(lease_digest(&lease_id)),
            lease_id,
        }
    }
}

/// Who asks for a run, for how long, and which lock files guard it.
#[derive(Debug, Clone)]
pub struct LeaseRequest {
    /// Who asks, as authenticated (the audit's actor; `holder` is what the client calls itself).
    pub actor: String,
    pub run_id: String,
    pub holder: String,
    pub host: String,
    pub pid: i64,
    pub ttl: time::Duration,
    /// The run lock (first) and optionally the checkpoint lock.
    pub lock_paths: Vec<PathBuf>,
}

impl LeaseRequest {
    /// The run's `<stem>_run.lock`, which names the per-run mutex.
    fn run_lock(&self) -> PathBuf {
        self.lock_paths.first().cloned().unwrap_or_default()
    }
}

/// The directory of a checkpoint lock file.
fn directory_of(lock: PathBuf) -> PathBuf {
    lock.parent().map(Path::to_path_buf).unwrap_or(lock)
}

/// What [`Leases::end_if_expired`] found.
enum Ending {
    /// Not ours, or ours and live.
    Live,
    /// Ours and expired: ended now.
    Expired(Box<Lease>),
    /// Ours locally, but the database no longer records it: forgotten now.
    Gone,
    /// Ours and live, but its lock file was removed or replaced and another process holds the
    /// new one: ended now, as its exclusion no longer holds.
    Displaced,
}

/// What [`Leases::retake`] did.
enum Retake {
    /// The files now at the lock paths are locked for the lease.
    Retaken,
    /// Another call took them again first.
    InPlace,
    /// Another process holds a new file (or it cannot be locked): the lease must end.
    Refused,
}

#[derive(Debug)]
struct Held {
    lease_id: String,
    run_lock: PathBuf,
    /// Shared with critical sections that run under this lease.
    lock: Arc<RunLock>,
}

/// This process's leases.
#[derive(Debug, Clone)]
pub struct Leases {
    store: Store,
    clock: Arc<dyn Clock>,
    replica: String,
    local: LocalRunLocks,
    held: Arc<Mutex<HashMap<String, Held>>>,
    /// One retake of a displaced lock file at a time (see [`Self::retake`]).
    retaking: Arc<tokio::sync::Mutex<()>>,
    /// No other process grants leases in this database (see [`Self::among_replicas`]).
    sole_process: bool,
}

fn not_holder(run_id: &str, lease_id: &str) -> LeaseError {
    LeaseError::NotHolder {
        run_id: run_id.to_owned(),
        lease_id: lease_id.to_owned(),
    }
}

impl Leases {
    pub fn new(store: Store, clock: Arc<dyn Clock>, replica: impl Into<String>) -> Self {
        Self {
            // One process serves an SQLite file (the store's owner lock): every lease is ours.
            sole_process: store.backend() == recovery_store::Backend::Sqlite,
            store,
            clock,
            replica: replica.into(),
            local: LocalRunLocks::default(),
            held: Arc::new(Mutex::new(HashMap::new())),
            retaking: Arc::default(),
        }
    }

    /// These leases share their database with other processes' (replicas on one PostgreSQL
    /// database, or several instances in one process standing in for them): a live lease is
    /// ours only when it names this replica.
    pub fn among_replicas(mut self) -> Self {
        self.sole_process = false;
        self
    }

    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// Whether other processes grant leases from this database too (replicas on PostgreSQL):
    /// then a live lease whose locks nobody holds is one whose replica stopped, and a running
    /// replica takes it again ([`Self::adopt_live`]) rather than ending it.
    pub fn shares_database(&self) -> bool {
        !self.sole_process
    }

    /// Whether a live lease was granted by this process (see [`Self::shares_database`]).
    pub fn is_ours(&self, lease: &Lease) -> bool {
        self.was_ours(lease)
    }

    /// Whether this process holds a run's locks under a lease.
    pub fn holds(&self, run_id: &str) -> bool {
        self.held_entry(run_id).is_some()
    }

    /// The per-run mutexes shared with [`crate::RunLocks`].
    pub fn local(&self) -> &LocalRunLocks {
        &self.local
    }

    fn held(&self) -> MutexGuard<'_, HashMap<String, Held>> {
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn held_entry(&self, run_id: &str) -> Option<(String, PathBuf)> {
        self.held()
            .get(run_id)
            .map(|h| (h.lease_id.clone(), h.run_lock.clone()))
    }

    /// Whether our lease's lock files on `run_id` are still the files it locked.
    fn lock_in_place(&self, run_id: &str) -> bool {
        self.held().get(run_id).is_none_or(|h| h.lock.is_in_place())
    }

    /// The `flock` a lease of ours holds on this run lock, if any.
    pub fn held_lock(&self, run_lock: &Path) -> Option<Arc<RunLock>> {
        self.held()
            .values()
            .find(|h| h.run_lock == run_lock)
            .map(|h| h.lock.clone())
    }

    /// When the lock files of our lease on the run whose lock is `run_lock` were removed or
    /// replaced: takes the files now at their paths for the lease when they are free (audited
    /// `lease.lock_retaken`), else ends the lease (audited `lease.lock_displaced`). Call inside
    /// the run's mutex: a critical section does before it runs under the lease's `flock`, so no
    /// change is made under a lock that no longer excludes anyone.
    pub async fn end_if_displaced(&self, run_lock: &Path) -> Result<(), LeaseError> {
        let run_id = self
            .held()
            .iter()
            .find(|(_, h)| h.run_lock == run_lock)
            .map(|(run_id, _)| run_id.clone());
        if let Some(run_id) = run_id {
            self.end_if_expired(&run_id).await?;
        }
        Ok(())
    }

    /// Another run's live lease of ours that holds one of `paths` (a checkpoint directory's
    /// lock, shared by two runs' requests): its `flock` would refuse the request, unless its
    /// file was replaced meanwhile, which must not let a second lease in beside it.
    /// Answers that run and the shared path.
    fn other_lease_on(&self, request: &LeaseRequest) -> Option<(String, PathBuf)> {
        self.held().iter().find_map(|(run_id, h)| {
            if **run_id == request.run_id {
                return None;
            }
            h.lock
                .paths()
                .find(|held| request.lock_paths.iter().any(|p| p.as_path() == *held))
                .map(|shared| (run_id.clone(), shared.to_owned()))
        })
    }

    /// Refuses a request whose lock files another run's lease of ours holds (see
    /// [`Self::other_lease_on`]), naming that lease and, for a checkpoint directory's lock,
    /// the directory.
    async fn refuse_shared_locks(&self, request: &LeaseRequest) -> Result<(), LeaseError> {
        let Some((other, shared)) = self.other_lease_on(request) else {
            return Ok(());
        };
        let Some(lease) = self.store.get_lease(&other).await? else {
            return Ok(());
        };
        if shared == request.run_lock() {
            return Err(LeaseError::Held(Box::new(lease)));
        }
        Err(LeaseError::CheckpointInUse {
            checkpoint_dir: directory_of(shared),
            lease: Box::new(lease),
        })
    }

    /// Takes the request's lock files, once no other run's lease of ours holds one of them
    /// ([`Self::refuse_shared_locks`]); a checkpoint lock another process holds is refused
    /// naming the directory.
    async fn take_locks(&self, request: &LeaseRequest) -> Result<RunLock, LeaseError> {
        self.refuse_shared_locks(request).await?;
        let (run_lock, paths) = (request.run_lock(), request.lock_paths.clone());
        let taken = tokio::task::spawn_blocking(move || RunLock::acquire_for_run(run_lock, paths))
            .await
            .map_err(|e| LeaseError::Join(e.to_string()))?;
        match taken {
            Err(LockError::Owned(path)) if path != request.run_lock() => {
                Err(LeaseError::CheckpointLocked {
                    checkpoint_dir: directory_of(path),
                })
            }
            taken => Ok(taken?),
        }
    }

    /// Whether the run recorded for `output` has a live lease granted by another replica.
    pub async fn other_replica_holds(&self, output: &Path) -> Result<bool, StoreError> {
        let Some(run) = self
            .store
            .find_run_by_output(&output.display().to_string())
            .await?
        else {
            return Ok(false);
        };
        let now = self.clock.now_text();
        Ok(self
            .store
            .get_lease(&run.run_id)
            .await?
            .is_some_and(|l| l.expires_at > now && l.replica != self.replica))
    }

    fn lease_for(&self, request: &LeaseRequest, lease_id: String) -> Lease {
        let now = self.clock.now();
        Lease {
            run_id: request.run_id.clone(),
            lease_id,
            holder: request.holder.clone(),
            host: request.host.clone(),
            pid: request.pid,
            acquired_at: recovery_sidecar::format_rfc3339(now),
            renewed_at: recovery_sidecar::format_rfc3339(now),
            expires_at: recovery_sidecar::format_rfc3339(now + request.ttl),
            replica: self.replica.clone(),
        }
    }

    /// Takes the run: its `flock` first, then the database lease (granted only when none is
    /// live). Another live holder is reported with who it is.
    pub async fn acquire(&self, request: &LeaseRequest) -> Result<Granted, LeaseError> {
        let _run = self.local.lock(&request.run_lock()).await;
        self.end_if_expired(&request.run_id).await?;
        let granting = Granted::new(|digest| self.lease_for(request, digest));
        let lease = &granting.lease;
        let now = self.clock.now_text();
        if let Some((current, _)) = self.held_entry(&request.run_id) {
            // This process holds the lock under a live lease (an expired one was just ended).
            return match self.store.get_lease(&request.run_id).await? {
                Some(existing) if existing.lease_id == current => {
                    Err(LeaseError::Held(Box::new(existing)))
                }
                _ => {
                    // The database forgot our lease (taken over elsewhere): grant afresh.
                    self.refuse_superseded(&request.run_id).await?;
                    let granted = self.store.try_acquire_lease(lease, &now).await?;
                    if granted.lease_id != lease.lease_id {
                        self.held().remove(&request.run_id);
                        return Err(LeaseError::Held(Box::new(granted)));
                    }
                    if let Some(entry) = self.held().get_mut(&request.run_id) {
                        entry.lease_id = lease.lease_id.clone();
                    }
                    self.record_locks(request, lease).await?;
                    self.audit_acquired(request, lease).await?;
                    Ok(granting)
                }
            };
        }
        let lock = match self.take_locks(request).await {
            Err(refused) if self.replica_may_hold(&refused) => {
                // Another replica holds the run's flock: for a live lease, which is named as
                // any holder is (hostile review 33: it read as a process outside the service);
                // for one that expired, until that replica's sweep lets go.
                match self.store.get_lease(&request.run_id).await? {
                    Some(live) if live.expires_at > now => {
                        return Err(LeaseError::Held(Box::new(live)));
                    }
                    Some(_) => self.wait_for_handoff(request).await?,
                    None => return Err(refused),
                }
            }
            taken => taken?,
        };
        self.refuse_superseded(&request.run_id).await?;
        let granted = self.store.try_acquire_lease(lease, &now).await?;
        if granted.lease_id != lease.lease_id && !self.was_ours(&granted) {
            // Another replica's live lease, and its flock is free: that replica stopped, not
            // the collector. The lease stays its collector's (taken here), the newcomer waits.
            return Err(self.adopt_granted(request, granted, lock).await?);
        }
        if granted.lease_id != lease.lease_id {
            // A live lease of ours, yet we hold the flock its holder would hold: that holder is
            // gone (a crash or a kill); the lease is an orphan and is replaced, audited.
            self.store.replace_lease(lease).await?;
            self.audit("system", "lease.orphaned", &request.run_id, serde_json::json!({"holder": granted.holder, "host": granted.host, "pid": granted.pid, "replica": granted.replica, "why": "no process held the run's flock"})).await?;
            tracing::warn!(run_id = %request.run_id, holder = %granted.holder, "replaced a lease whose process is gone");
        }
        self.held().insert(
            request.run_id.clone(),
            Held {
                lease_id: lease.lease_id.clone(),
                run_lock: request.run_lock(),
                lock: Arc::new(lock),
            },
        );
        self.record_locks(request, lease).await?;
        self.audit_acquired(request, lease).await?;
        Ok(granting)
    }

    /// `request` with the lock files the run's current lease records added after its own.
    async fn with_previous_locks(
        &self,
        request: &LeaseRequest,
    ) -> Result<LeaseRequest, LeaseError> {
        let mut extended = request.clone();
        if let Some(previous) = self.store.get_lease(&request.run_id).await? {
            for path in self
                .store
                .lease_locks(&request.run_id, &previous.lease_id)
                .await?
            {
                let path = PathBuf::from(path);
                if !extended.lock_paths.contains(&path) {
                    extended.lock_paths.push(path);
                }
            }
        }
        Ok(extended)
    }

    /// Whether a lock the request asked for, found held by another process, may be another
    /// replica's (the run's own lock or its lease's checkpoint lock), among replicas sharing
    /// the database.
    fn replica_may_hold(&self, refused: &LeaseError) -> bool {
        self.shares_database()
            && matches!(
                refused,
                LeaseError::Locked(LockError::Owned(_)) | LeaseError::CheckpointLocked { .. }
            )
    }

    /// Takes a run over from the replica holding its `flock` for a lease recorded in the
    /// database: that lease is replaced by `lease` first (so the replica lets go at its next
    /// sweep), then the locks are taken once it has. A run no lease records is held by a
    /// process outside the service: refused as before. When the replica does not let go in
    /// time, the new lease is ended again and the takeover refused; the previous one stays
    /// ended (hostile review 33: a takeover at the replica without the lock always failed).
    async fn take_over_from_replica(
        &self,
        request: &LeaseRequest,
        lease: &Lease,
        refused: LeaseError,
        replaced: &mut Option<Option<Lease>>,
    ) -> Result<RunLock, LeaseError> {
        if self.store.get_lease(&request.run_id).await?.is_none() {
            return Err(refused);
        }
        *replaced = Some(self.store.replace_lease(lease).await?);
        match self.wait_for_handoff(request).await {
            Ok(lock) => Ok(lock),
            Err(e) => {
                self.store
                    .release_lease(&request.run_id, &lease.lease_id)
                    .await?;
                Err(e)
            }
        }
    }

    /// The run's locks, once the replica holding them for a lease the database ended (taken
    /// over, released or expired elsewhere) has let go: it does at its next lease sweep. Polled,
    /// as nothing tells a waiter when a `flock` is released; at most [`HANDOFF_WAIT`].
    async fn wait_for_handoff(&self, request: &LeaseRequest) -> Result<RunLock, LeaseError> {
        let deadline = tokio::time::Instant::now() + HANDOFF_WAIT;
        loop {
            match self.take_locks(request).await {
                Err(refused)
                    if self.replica_may_hold(&refused)
                        && tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(HANDOFF_POLL).await;
                }
                taken => return taken,
            }
        }
    }

    /// After a lease another replica holds the locks of was released here: waits until that
    /// replica has let go of `paths` (at its next sweep), so that a collector started after
    /// the release finds the run free (hostile review 33: the lock stayed held up to 5 s).
    /// Read from the kernel's lock table without taking the locks; at most [`HANDOFF_WAIT`]
    /// (a process outside the service that took a file meanwhile keeps it).
    async fn wait_until_let_go(&self, paths: Vec<PathBuf>) {
        let deadline = tokio::time::Instant::now() + HANDOFF_WAIT;
        while tokio::time::Instant::now() < deadline {
            let probe = paths.clone();
            let held = tokio::task::spawn_blocking(move || {
                probe.iter().any(|p| {
                    recovery_sidecar::flock_held_elsewhere(p)
                        .ok()
                        .flatten()
                        .unwrap_or(false)
                })
            })
            .await
            .unwrap_or(false);
            if !held {
                return;
            }
            tokio::time::sleep(HANDOFF_POLL).await;
        }
    }

    /// Refuses a run another run took the output of. Checked with the run's `flock` held: a
    /// replacement supersedes the run while it holds that `flock`, so a request that passed the
    /// route's check just before a replacement is refused here, rather than leasing the old
    /// run and holding the new run's lock with it (hostile review 33).
    async fn refuse_superseded(&self, run_id: &str) -> Result<(), LeaseError> {
        match self
            .store
            .get_run(run_id)
            .await?
            .and_then(|r| r.superseded_by)
        {
            Some(successor) => Err(LeaseError::Superseded {
                run_id: run_id.to_owned(),
                successor: self.store.current_owner(&successor).await?,
            }),
            None => Ok(()),
        }
    }

    async fn audit_expired(&self, lease: &Lease) -> Result<(), StoreError> {
        self.audit(
            "system",
            "lease.expired",
            &lease.run_id,
            serde_json::json!({"holder": lease.holder, "host": lease.host, "pid": lease.pid, "expired_at": lease.expires_at}),
        )
        .await
    }

    async fn audit_acquired(
        &self,
        request: &LeaseRequest,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        self.audit(
            &request.actor,
            "lease.acquired",
            &request.run_id,
            serde_json::json!({"holder": lease.holder, "host": lease.host, "pid": lease.pid, "expires_at": lease.expires_at}),
        )
        .await
    }

    /// Keeps `granted`, a live lease of a replica that stopped, for its collector under `lock`
    /// (the run's flock, just taken), as [`Self::adopt_live`] would; returns the refusal for
    /// the request that found it. Audited `lease.adopted`.
    async fn adopt_granted(
        &self,
        request: &LeaseRequest,
        granted: Lease,
        lock: RunLock,
    ) -> Result<LeaseError, LeaseError> {
        let now = self.clock.now_text();
        if !self
            .store
            .adopt_lease(&granted.run_id, &granted.lease_id, &self.replica, &now)
            .await?
        {
            // Ended or expired meanwhile: the requester may ask again (the lock goes now).
            return Ok(LeaseError::Held(Box::new(granted)));
        }
        self.held().insert(
            request.run_id.clone(),
            Held {
                lease_id: granted.lease_id.clone(),
                run_lock: request.run_lock(),
                lock: Arc::new(lock),
            },
        );
        self.audit(
            "system",
            "lease.adopted",
            &granted.run_id,
            serde_json::json!({"holder": granted.holder, "host": granted.host, "pid": granted.pid, "previous_replica": granted.replica, "expires_at": granted.expires_at}),
        )
        .await?;
        tracing::info!(run_id = %granted.run_id, holder = %granted.holder, previous_replica = %granted.replica, "a stopped replica's live lease taken here");
        let adopted = Lease {
            replica: self.replica.clone(),
            ..granted
        };
        Ok(LeaseError::Held(Box::new(adopted)))
    }

    /// Records which lock files a granted lease holds, so a restarted service takes them again.
    async fn record_locks(&self, request: &LeaseRequest, lease: &Lease) -> Result<(), LeaseError> {
        let paths: Vec<String> = request
            .lock_paths
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        Ok(self
            .store
            .record_lease_locks(&request.run_id, &lease.lease_id, &paths)
            .await?)
    }

    /// Takes again the locks of every live lease whose locks nobody holds: those this service
    /// held before it stopped (a restart, a crash, a kill) or a replica that stopped held. The
    /// collector holding the lease keeps it, renews it here, and no other collector gets the
    /// run meanwhile. A lease of ours whose locks another process took in between (a collector
    /// that did not wait) is ended (see [`Self::end_lost`]); another live replica's is left to
    /// it. Returns the leases taken again.
    /// `confined` tells whether a recorded lock path still names a file under the service's
    /// roots through no symbolic link (the roots or the directories may have changed while the
    /// service was down); a lease with any other lock path is not taken again.
    pub async fn adopt_live(
        &self,
        confined: impl Fn(&Path) -> bool,
    ) -> Result<Vec<Lease>, LeaseError> {
        let mut adopted = Vec::new();
        for lease in self.store.live_leases(&self.clock.now_text()).await? {
            if self.held_entry(&lease.run_id).is_some() {
                continue;
            }
            let paths: Vec<PathBuf> = self
                .store
                .lease_locks(&lease.run_id, &lease.lease_id)
                .await?
                .into_iter()
                .map(PathBuf::from)
                .collect();
            if let Some(moved) = paths.iter().find(|p| !confined(p)) {
                tracing::warn!(run_id = %lease.run_id, lock = %moved.display(), "a live lease's lock is no longer under the roots; not taken again");
                if self.was_ours(&lease) {
                    self.end_lost(
                        &lease,
                        "its lock file is no longer under the service's roots",
                    )
                    .await?;
                }
                continue;
            }
            // The run's own lock sorts first in the request, but not necessarily by name.
            let Some(run_lock) = paths
                .iter()
                .find(|p| p.to_string_lossy().ends_with("_run.lock"))
                .cloned()
            else {
                continue;
            };
            let _run = self.local.lock(&run_lock).await;
            let taking = paths.clone();
            // A run directory removed meanwhile is not made again: the run's files are gone.
            let lock = match tokio::task::spawn_blocking(move || {
                RunLock::acquire_in_existing_directories(taking)
            })
            .await
            .map_err(|e| LeaseError::Join(e.to_string()))?
            {
                Ok(lock) => lock,
                Err(LockError::Owned(_)) if self.was_ours(&lease) => {
                    self.end_lost(
                        &lease,
                        "another process took the run's lock while the service was down",
                    )
                    .await?;
                    continue;
                }
                Err(LockError::Owned(_)) => continue,
                Err(e) => {
                    tracing::warn!(run_id = %lease.run_id, error = %e, "a live lease's locks could not be taken again");
                    // Its lock path is no lock file now (a link, FIFO or directory): the lease
                    // excludes nobody, so it is not reported live with the run unusable.
                    if self.was_ours(&lease) {
                        self.end_lost(&lease, "its lock file could not be taken again")
                            .await?;
                    }
                    continue;
                }
            };
            let now = self.clock.now_text();
            if !self
                .store
                .adopt_lease(&lease.run_id, &lease.lease_id, &self.replica, &now)
                .await?
            {
                continue;
            }
            self.held().insert(
                lease.run_id.clone(),
                Held {
                    lease_id: lease.lease_id.clone(),
                    run_lock,
                    lock: Arc::new(lock),
                },
            );
            self.audit(
                "system",
                "lease.adopted",
                &lease.run_id,
                serde_json::json!({"holder": lease.holder, "host": lease.host, "pid": lease.pid, "previous_replica": lease.replica, "expires_at": lease.expires_at}),
            )
            .await?;
            adopted.push(lease);
        }
        Ok(adopted)
    }

    /// Ends the leases of ours that expired while the service was down (a sweep ends those
    /// that expire while it runs), audited `lease.expired` as a sweep audits them (hostile
    /// review 33: their rows stayed and no audit said they ended). Call at the start, before
    /// any lease is granted; returns them.
    pub async fn end_expired_while_down(&self) -> Result<Vec<Lease>, LeaseError> {
        let mut ended = Vec::new();
        for lease in self
            .store
            .expired_leases(None, &self.clock.now_text())
            .await?
        {
            if !self.was_ours(&lease) || self.held_entry(&lease.run_id).is_some() {
                continue;
            }
            // Conditional: a replica ending the same lease meanwhile audits it instead.
            if self
                .store
                .release_lease(&lease.run_id, &lease.lease_id)
                .await?
            {
                self.audit_expired(&lease).await?;
                ended.push(lease);
            }
        }
        Ok(ended)
    }

    /// Renews a live lease for another TTL; `lease_id` as its holder presents it.
    pub async fn heartbeat(
        &self,
        run_id: &str,
        lease_id: &str,
        ttl: impl Into<Option<time::Duration>>,
    ) -> Result<Lease, LeaseError> {
        let ttl = ttl.into();
        let digest = lease_digest(lease_id);
        let lease_id = digest.as_str();
        let Some((held_id, run_lock)) = self.held_entry(run_id) else {
            return self.renew_for_live_replica(run_id, lease_id, ttl).await;
        };
        let _run = self.local.lock(&run_lock).await;
        if held_id != lease_id || !matches!(self.end_if_expired(run_id).await?, Ending::Live) {
            return Err(not_holder(run_id, lease_id));
        }
        let renewed = self.renew(run_id, lease_id, ttl).await;
        if matches!(renewed, Err(LeaseError::NotHolder { .. })) {
            self.forget(run_id, lease_id);
        }
        renewed
    }

    /// Renews, for a heartbeat that reached this replica, a live lease that another running
    /// replica granted and holds the run's flock for (the caller tried to take a free one here
    /// first): the lease's exclusion is that replica's flock, so renewing its record is all a
    /// heartbeat does. On SQLite, or for a lease of ours we no longer hold, it is not held.
    async fn renew_for_live_replica(
        &self,
        run_id: &str,
        lease_id: &str,
        ttl: Option<time::Duration>,
    ) -> Result<Lease, LeaseError> {
        let now = self.clock.now_text();
        let live_elsewhere = self.store.get_lease(run_id).await?.is_some_and(|lease| {
            lease.lease_id == lease_id && lease.expires_at > now && !self.was_ours(&lease)
        });
        if !live_elsewhere {
            return Err(not_holder(run_id, lease_id));
        }
        self.renew(run_id, lease_id, ttl).await
    }

    /// Renews `lease_id` in the database for `ttl` (by default the lifetime it has).
    async fn renew(
        &self,
        run_id: &str,
        lease_id: &str,
        ttl: Option<time::Duration>,
    ) -> Result<Lease, LeaseError> {
        let now = self.clock.now();
        // Without a lifetime the lease keeps the one it was granted (or last renewed) with.
        let ttl = match ttl {
            Some(ttl) => ttl,
            None => self
                .store
                .get_lease(run_id)
                .await?
                .and_then(|lease| lifetime(&lease))
                .ok_or_else(|| not_holder(run_id, lease_id))?,
        };
        let renewed = self
            .store
            .renew_lease(
                run_id,
                lease_id,
                &recovery_sidecar::format_rfc3339(now),
                &recovery_sidecar::format_rfc3339(now + ttl),
            )
            .await?;
        if !renewed {
            return Err(not_holder(run_id, lease_id));
        }
        self.store
            .get_lease(run_id)
            .await?
            .ok_or_else(|| not_holder(run_id, lease_id))
    }

    /// Drops our `flock` of a run if it is held under `lease_id`.
    fn forget(&self, run_id: &str, lease_id: &str) {
        let mut held = self.held();
        if held.get(run_id).is_some_and(|h| h.lease_id == lease_id) {
            held.remove(run_id);
        }
    }

    /// Whether a live lease recorded in the database was granted by this service: its replica
    /// (on SQLite, one process serves the file, so every lease is).
    fn was_ours(&self, lease: &Lease) -> bool {
        self.sole_process || lease.replica == self.replica
    }

    /// Ends a lease of ours whose locks could not be taken again at the start (another process
    /// took the run lock while the service was down, a collector that did not wait; or the lock
    /// path is no lock file under the roots now): its exclusion is gone, so it is not reported
    /// live; its holder's next renewal is refused as it would be anyway. Audited `lease.lost`
    /// with `why`.
    async fn end_lost(&self, lease: &Lease, why: &str) -> Result<(), LeaseError> {
        self.store
            .release_lease(&lease.run_id, &lease.lease_id)
            .await?;
        self.audit("system", "lease.lost", &lease.run_id, serde_json::json!({"holder": lease.holder, "host": lease.host, "pid": lease.pid, "why": why})).await?;
        tracing::warn!(run_id = %lease.run_id, holder = %lease.holder, why, "a live lease's locks could not be taken again at the start; lease ended");
        Ok(())
    }

    /// Ends a lease (`lease_id` as its holder presents it) for `actor`: the database forgets
    /// it, then the `flock` is released. Audited `lease.released`.
    pub async fn release(
        &self,
        actor: &str,
        run_id: &str,
        lease_id: &str,
    ) -> Result<(), LeaseError> {
        let digest = lease_digest(lease_id);
        let lease_id = digest.as_str();
        let _run = match self.held_entry(run_id) {
            Some((_, run_lock)) => Some(self.local.lock(&run_lock).await),
            None => None,
        };
        // Another replica's lease: the files it holds, to see them let go.
        let elsewhere = if self.shares_database() && self.held_entry(run_id).is_none() {
            self.store.lease_locks(run_id, lease_id).await?
        } else {
            Vec::new()
        };
        let ended = self.store.end_lease(run_id, lease_id).await?;
        self.forget(run_id, lease_id);
        let Some(lease) = ended else {
            return Err(not_holder(run_id, lease_id));
        };
        let details =
            serde_json::json!({"holder": lease.holder, "host": lease.host, "pid": lease.pid});
        self.audit(actor, "lease.released", run_id, details).await?;
        if !elsewhere.is_empty() {
            self.wait_until_let_go(elsewhere.into_iter().map(PathBuf::from).collect())
                .await;
        }
        Ok(())
    }

    /// Ends our lease of a run when it has expired (or was taken over by another replica):
    /// the database forgets it, then its `flock` is released. Call inside the run's mutex.
    /// Returns whether a lease was ended.
    async fn end_if_expired(&self, run_id: &str) -> Result<Ending, LeaseError> {
        let Some((lease_id, _)) = self.held_entry(run_id) else {
            return Ok(Ending::Live);
        };
        let now = self.clock.now_text();
        match self.store.get_lease(run_id).await? {
            Some(lease) if lease.lease_id == lease_id && lease.expires_at > now => {
                if self.lock_in_place(run_id) {
                    return Ok(Ending::Live);
                }
                match self.retake(run_id, &lease_id).await? {
                    Retake::InPlace => return Ok(Ending::Live),
                    Retake::Retaken => {
                        self.audit("system", "lease.lock_retaken", run_id, serde_json::json!({"holder": lease.holder, "host": lease.host, "pid": lease.pid})).await?;
                        tracing::warn!(run_id, holder = %lease.holder, "the run's lock file was removed or replaced under a live lease; the new file is locked for the lease");
                        return Ok(Ending::Live);
                    }
                    Retake::Refused => {}
                }
                // Shared sections of one run may find the displacement together: the one whose
                // release ended the lease audits it.
                let ended = self.store.release_lease(run_id, &lease_id).await?;
                self.forget(run_id, &lease_id);
                if !ended {
                    return Ok(Ending::Gone);
                }
                self.audit("system", "lease.lock_displaced", run_id, serde_json::json!({"holder": lease.holder, "host": lease.host, "pid": lease.pid})).await?;
                tracing::warn!(run_id, holder = %lease.holder, "the run's lock file was removed or replaced under a live lease; lease ended");
                Ok(Ending::Displaced)
            }
            Some(lease) if lease.lease_id == lease_id => {
                self.store.release_lease(run_id, &lease_id).await?;
                self.forget(run_id, &lease_id);
                self.audit_expired(&lease).await?;
                tracing::info!(run_id, holder = %lease.holder, "lease expired; run lock released");
                Ok(Ending::Expired(Box::new(lease)))
            }
            _ => {
                self.forget(run_id, &lease_id);
                Ok(Ending::Gone)
            }
        }
    }

    /// Locks, for our lease `lease_id` on `run_id`, the files now at its displaced lock paths
    /// (a lock file removed or replaced under the lease, by a cleanup or a copy), so the lease
    /// keeps excluding everyone and never lapses while nobody else took the run; the files in
    /// place stay locked throughout. Refused when another process holds a new file. One at a
    /// time: calls that find the displacement together take the files once.
    async fn retake(&self, run_id: &str, lease_id: &str) -> Result<Retake, LeaseError> {
        let _one = self.retaking.lock().await;
        let old = self
            .held()
            .get(run_id)
            .filter(|h| h.lease_id == lease_id)
            .map(|h| h.lock.clone());
        let Some(old) = old else {
            return Ok(Retake::Refused);
        };
        let retaken = tokio::task::spawn_blocking(move || old.retake_displaced())
            .await
            .map_err(|e| LeaseError::Join(e.to_string()))?;
        match retaken {
            Ok(None) => Ok(Retake::InPlace),
            Ok(Some(lock)) => {
                match self.held().get_mut(run_id) {
                    Some(held) if held.lease_id == lease_id => held.lock = Arc::new(lock),
                    // The lease was forgotten meanwhile: its locks go with it.
                    _ => return Ok(Retake::Refused),
                }
                Ok(Retake::Retaken)
            }
            Err(e) => {
                tracing::info!(run_id, error = %e, "a displaced lock file could not be taken again for its lease");
                Ok(Retake::Refused)
            }
        }
    }

    /// The run's live lease, after ending ours if it expired (so a lease reported gone has
    /// released its `flock`).
    pub async fn holder(&self, run_id: &str) -> Result<Option<Lease>, LeaseError> {
        if let Some((_, run_lock)) = self.held_entry(run_id) {
            let _run = self.local.lock(&run_lock).await;
            self.end_if_expired(run_id).await?;
        }
        let now = self.clock.now_text();
        Ok(self
            .store
            .get_lease(run_id)
            .await?
            .filter(|l| l.expires_at > now))
    }

    /// Ends the leases of ours that expired (or that another replica took over); returns the
    /// expired leases it ended.
    pub async fn sweep(&self) -> Result<Vec<Lease>, LeaseError> {
        let runs: Vec<(String, PathBuf)> = self
            .held()
            .iter()
            .map(|(run_id, h)| (run_id.clone(), h.run_lock.clone()))
            .collect();
        let mut ended = Vec::new();
        for (run_id, run_lock) in runs {
            let _run = self.local.lock(&run_lock).await;
            if let Ending::Expired(lease) = self.end_if_expired(&run_id).await? {
                ended.push(*lease);
            }
        }
        Ok(ended)
    }

    /// An operator takes a run over for a new holder: the previous lease ends at once. Audited.
    pub async fn takeover(
        &self,
        actor: &str,
        reason: &str,
        request: &LeaseRequest,
    ) -> Result<(Granted, Option<Lease>), LeaseError> {
        let _run = self.local.lock(&request.run_lock()).await;
        // A lease of ours whose lock file was displaced first locks the file now at the path
        // (or ends when another process holds it): the new holder's lock is never kept on a
        // file nobody else opens.
        self.end_if_expired(&request.run_id).await?;
        // The new holder keeps every lock the previous lease held (its checkpoint directory's
        // too: hostile review 35, a takeover at another replica let it go), recorded so that
        // a restart takes them all again.
        let request = &self.with_previous_locks(request).await?;
        let granting = Granted::new(|digest| self.lease_for(request, digest));
        let lease = &granting.lease;
        // `Some` once the lease was replaced in the database (taken from another replica).
        let mut replaced = None;
        if self.held_entry(&request.run_id).is_none() {
            let lock = match self.take_locks(request).await {
                Err(refused) if self.replica_may_hold(&refused) => {
                    self.take_over_from_replica(request, lease, refused, &mut replaced)
                        .await?
                }
                taken => taken?,
            };
            if let Err(superseded) = self.refuse_superseded(&request.run_id).await {
                if replaced.is_some() {
                    self.store
                        .release_lease(&request.run_id, &lease.lease_id)
                        .await?;
                }
                return Err(superseded);
            }
            self.held().insert(
                request.run_id.clone(),
                Held {
                    lease_id: lease.lease_id.clone(),
                    run_lock: request.run_lock(),
                    lock: Arc::new(lock),
                },
            );
        } else {
            self.refuse_superseded(&request.run_id).await?;
        }
        let previous = match replaced {
            Some(ended) => ended,
            None => self.store.replace_lease(lease).await?,
        };
        if let Some(entry) = self.held().get_mut(&request.run_id) {
            entry.lease_id = lease.lease_id.clone();
        }
        self.record_locks(request, lease).await?;
        self.audit(
            actor,
            "lease.takeover",
            &request.run_id,
            serde_json::json!({
                "reason": reason,
                "previous_holder": previous.as_ref().map(|p| &p.holder),
                "new_holder": lease.holder,
            }),
        )
        .await?;
        Ok((granting, previous))
    }

    /// How many leases this process holds.
    pub fn held_count(&self) -> usize {
        self.held().len()
    }

    /// Releases every lease this process holds.
    pub async fn release_all(&self) -> Result<usize, LeaseError> {
        let drained: Vec<(String, Held)> = self.held().drain().collect();
        for (run_id, entry) in &drained {
            self.store.release_lease(run_id, &entry.lease_id).await?;
        }
        Ok(drained.len())
    }

    async fn audit(
        &self,
        actor: &str,
        action: &str,
        run_id: &str,
        details: serde_json::Value,
    ) -> Result<(), StoreError> {
        self.store
            .insert_audit(&AuditEntry {
                audit_id: recovery_sidecar::new_id(),
                at: self.clock.now_text(),
                actor: actor.to_owned(),
                action: action.to_owned(),
                run_id: Some(run_id.to_owned()),
                details,
            })
            .await
    }
}

/// How long a lease was granted (or last renewed) for: its expiry minus its renewal.
fn lifetime(lease: &Lease) -> Option<time::Duration> {
    let at = |text: &str| {
        time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339).ok()
    };
    Some(at(&lease.expires_at)? - at(&lease.renewed_at)?).filter(|d| d.is_positive())
}
