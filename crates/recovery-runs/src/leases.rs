//! Leases: the service owns each run's lock. A lease names its holder (client name, host, pid),
//! lives for a TTL renewed by heartbeat, and while it is live this process holds the run's
//! `flock`, so neither another collector (a Python process included) nor another replica can
//! write the output. An expired lease is swept (its `flock` released); an operator may take a run
//! over, which is audited.
//!
//! Invariants: the `flock` is taken before the database grants a lease and released after the
//! database forgets it, so a granted lease always has its lock; lease operations of one process
//! are serialised; a heartbeat or release under a lease id that no longer holds the run fails.

use crate::clock::Clock;
use recovery_sidecar::{LockError, RunLock};
use recovery_store::{AuditEntry, Lease, Store, StoreError};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::sync::Mutex;

/// Why a lease operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("run {} is held by {} (host {}, pid {}) until {}", .0.run_id, .0.holder, .0.host, .0.pid, .0.expires_at)]
    Held(Box<Lease>),
    #[error(transparent)]
    Locked(#[from] LockError),
    #[error("lease {lease_id} does not hold run {run_id} (expired, released or taken over)")]
    NotHolder { run_id: String, lease_id: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Who asks for a run, for how long, and which lock files guard it.
#[derive(Debug, Clone)]
pub struct LeaseRequest {
    pub run_id: String,
    pub holder: String,
    pub host: String,
    pub pid: i64,
    pub ttl: time::Duration,
    /// The run lock (and checkpoint lock) paths.
    pub lock_paths: Vec<PathBuf>,
}

#[derive(Debug)]
struct Held {
    lease_id: String,
    _lock: RunLock,
}

/// This process's leases.
#[derive(Debug, Clone)]
pub struct Leases {
    store: Store,
    clock: Arc<dyn Clock>,
    replica: String,
    held: Arc<Mutex<HashMap<String, Held>>>,
}

impl Leases {
    pub fn new(store: Store, clock: Arc<dyn Clock>, replica: impl Into<String>) -> Self {
        Self {
            store,
            clock,
            replica: replica.into(),
            held: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    pub fn replica(&self) -> &str {
        &self.replica
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
    pub async fn acquire(&self, request: &LeaseRequest) -> Result<Lease, LeaseError> {
        let mut held = self.held.lock().await;
        let lease = self.lease_for(request, recovery_sidecar::new_id());
        let now = self.clock.now_text();
        if let Some(current) = held.get(&request.run_id) {
            // This process holds the lock: the run is free only if its lease expired.
            let existing = self.store.get_lease(&request.run_id).await?;
            if let Some(existing) =
                existing.filter(|l| l.expires_at > now && l.lease_id == current.lease_id)
            {
                return Err(LeaseError::Held(Box::new(existing)));
            }
            let granted = self.store.try_acquire_lease(&lease, &now).await?;
            if granted.lease_id != lease.lease_id {
                return Err(LeaseError::Held(Box::new(granted)));
            }
            if let Some(entry) = held.get_mut(&request.run_id) {
                entry.lease_id = lease.lease_id.clone();
            }
            return Ok(lease);
        }
        let lock = RunLock::acquire(request.lock_paths.clone())?;
        let granted = self.store.try_acquire_lease(&lease, &now).await?;
        if granted.lease_id != lease.lease_id {
            // Another replica's live lease: keep out (our lock is released on drop).
            return Err(LeaseError::Held(Box::new(granted)));
        }
        held.insert(
            request.run_id.clone(),
            Held {
                lease_id: lease.lease_id.clone(),
                _lock: lock,
            },
        );
        Ok(lease)
    }

    /// Renews a live lease for another TTL.
    pub async fn heartbeat(
        &self,
        run_id: &str,
        lease_id: &str,
        ttl: time::Duration,
    ) -> Result<Lease, LeaseError> {
        let mut held = self.held.lock().await;
        let now = self.clock.now();
        let renewed = self
            .store
            .renew_lease(
                run_id,
                lease_id,
                &recovery_sidecar::format_rfc3339(now),
                &recovery_sidecar::format_rfc3339(now + ttl),
            )
            .await?;
        if !renewed || held.get(run_id).is_none_or(|h| h.lease_id != lease_id) {
            if held.get(run_id).is_some_and(|h| h.lease_id == lease_id) {
                held.remove(run_id);
            }
            return Err(LeaseError::NotHolder {
                run_id: run_id.to_owned(),
                lease_id: lease_id.to_owned(),
            });
        }
        self.store
            .get_lease(run_id)
            .await?
            .ok_or(LeaseError::NotHolder {
                run_id: run_id.to_owned(),
                lease_id: lease_id.to_owned(),
            })
    }

    /// Ends a lease: the database forgets it, then the `flock` is released.
    pub async fn release(&self, run_id: &str, lease_id: &str) -> Result<(), LeaseError> {
        let mut held = self.held.lock().await;
        let released = self.store.release_lease(run_id, lease_id).await?;
        if held.get(run_id).is_some_and(|h| h.lease_id == lease_id) {
            held.remove(run_id);
        }
        if released {
            Ok(())
        } else {
            Err(LeaseError::NotHolder {
                run_id: run_id.to_owned(),
                lease_id: lease_id.to_owned(),
            })
        }
    }

    /// The run's recorded lease (live or expired-but-not-yet-swept).
    pub async fn holder(&self, run_id: &str) -> Result<Option<Lease>, LeaseError> {
        Ok(self.store.get_lease(run_id).await?)
    }

    /// Whether `lease_id` holds the run now.
    pub async fn is_live(&self, run_id: &str, lease_id: &str) -> Result<bool, LeaseError> {
        let now = self.clock.now_text();
        Ok(self
            .store
            .get_lease(run_id)
            .await?
            .is_some_and(|l| l.lease_id == lease_id && l.expires_at > now))
    }

    /// Releases the locks of leases that expired (or that another replica took over); returns
    /// the expired leases it ended.
    pub async fn sweep(&self) -> Result<Vec<Lease>, LeaseError> {
        let mut held = self.held.lock().await;
        let now = self.clock.now_text();
        let mut ended = Vec::new();
        let runs: Vec<String> = held.keys().cloned().collect();
        for run_id in runs {
            let lease_id = held
                .get(&run_id)
                .map(|h| h.lease_id.clone())
                .unwrap_or_default();
            match self.store.get_lease(&run_id).await? {
                Some(lease) if lease.lease_id == lease_id && lease.expires_at > now => {}
                Some(lease) if lease.lease_id == lease_id => {
                    self.store.release_lease(&run_id, &lease_id).await?;
                    held.remove(&run_id);
                    self.audit("system", "lease.expired", &run_id, serde_json::json!({"holder": lease.holder, "host": lease.host, "pid": lease.pid, "expired_at": lease.expires_at})).await?;
                    ended.push(lease);
                }
                _ => {
                    held.remove(&run_id);
                }
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
    ) -> Result<(Lease, Option<Lease>), LeaseError> {
        let mut held = self.held.lock().await;
        let lease = self.lease_for(request, recovery_sidecar::new_id());
        if !held.contains_key(&request.run_id) {
            let lock = RunLock::acquire(request.lock_paths.clone())?;
            held.insert(
                request.run_id.clone(),
                Held {
                    lease_id: lease.lease_id.clone(),
                    _lock: lock,
                },
            );
        }
        let previous = self.store.replace_lease(&lease).await?;
        if let Some(entry) = held.get_mut(&request.run_id) {
            entry.lease_id = lease.lease_id.clone();
        }
        self.audit(
            actor,
            "lease.takeover",
            &request.run_id,
            serde_json::json!({
                "reason": reason,
                "previous_holder": previous.as_ref().map(|p| &p.holder),
                "previous_lease_id": previous.as_ref().map(|p| &p.lease_id),
                "new_holder": lease.holder,
            }),
        )
        .await?;
        Ok((lease, previous))
    }

    /// Releases every lease this process holds (graceful shutdown).
    pub async fn release_all(&self) -> Result<usize, LeaseError> {
        let mut held = self.held.lock().await;
        let count = held.len();
        for (run_id, entry) in held.drain() {
            self.store.release_lease(&run_id, &entry.lease_id).await?;
        }
        Ok(count)
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
