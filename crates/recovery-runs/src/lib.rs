//! Runs as the service keeps them: every change to a run happens inside its critical section
//! ([`LockedRun`]); every event is written to its sidecar (fsync) first and to the database
//! second; each line's id derives from the line, so [`Registry::reindex`] (also run at start-up
//! and on demand) brings the database up to date idempotently after a crash between the two
//! writes, also with lines Python collectors wrote. Leases are the database's record of who holds
//! a run, backed by the run's `flock` held by this process.
//!
//! - [`background`]: blocking work at a lower priority than the async workers.
//! - [`cache`]: derived state of files cached by file identity (a warm validate reads nothing).
//! - [`events`]: the sidecar lines (drift journal, approvals, attempt extensions, resubmits).
//! - [`groupcommit`]: journal appends of concurrent callers in one write and one fdatasync.
//! - [`registry`]: recording events, manifests and identities; reindex.
//! - [`leases`]: acquire, heartbeat, release, expiry sweep and operator takeover.
//! - [`operations`]: the run-level operations (create, validate, reserve, re-judgments,
//!   approvals, extend, resubmit, replace), each over a locked run.
//! - [`plans`]: resume plans indexed once per run and caught up with appended outcomes.
//! - [`runfiles`]: reading a run's files into the core's inputs.
//! - [`runlock`]: the per-run critical section ([`LockedRun`]) every mutation happens in.

pub mod approvals;
pub mod background;
pub mod cache;
pub mod clock;
pub mod events;
pub mod groupcommit;
pub mod leases;
pub mod operations;
pub mod plans;
pub mod registry;
pub mod runfiles;
pub mod runlock;

pub use clock::{Clock, ManualClock, SystemClock};
pub use events::{ApprovalLine, DriftLine, ExtensionLine};
pub use leases::{Granted, LeaseError, LeaseRequest, Leases};
pub use operations::OpError;
pub use registry::{Registry, RegistryError, ReindexReport, record_matches_manifest};
pub use runfiles::RunFilesError;
pub use runlock::{LocalRunLocks, LockedRun, RunLockError, RunLocks, RunSection, SharedRun};
