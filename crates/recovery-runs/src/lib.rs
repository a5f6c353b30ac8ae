//! Runs as the service keeps them: every event is written to its sidecar (fsync) first and to the
//! database second; sidecar lines carry ids, so [`Registry::reindex`] (also run at start-up)
//! brings the database up to date idempotently after a crash between the two writes. Leases are
//! the database's record of who holds a run, backed by the run's `flock` held by this process.
//!
//! - [`events`]: the sidecar lines (drift journal, approvals, attempt extensions, resubmits).
//! - [`registry`]: recording events, manifests and identities; reindex.
//! - [`leases`]: acquire, heartbeat, release, expiry sweep and operator takeover.
//! - [`runlock`]: the per-run critical section ([`LockedRun`]) every mutation happens in.

pub mod clock;
pub mod events;
pub mod leases;
pub mod registry;
pub mod runlock;

pub use clock::{Clock, ManualClock, SystemClock};
pub use events::{ApprovalLine, DriftLine, ExtensionLine};
pub use leases::{LeaseError, LeaseRequest, Leases};
pub use registry::{Registry, RegistryError, ReindexReport};
pub use runlock::{LocalRunLocks, LockedRun, RunLockError, RunLocks};
