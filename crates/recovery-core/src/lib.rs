//! Pure core of rollout-recovery: everything that decides, nothing that does IO beyond reading a
//! [`std::io::Read`]. No async, no clocks, no randomness: callers pass run ids and timestamps in.
//!
//! - [`canonical`]: CPython-exact canonical JSON and digests.
//! - [`materialized`]: streaming digest of a materialized-inputs JSONL stream.
//! - [`pretty`]: the pretty JSON CPython's `json.dumps(indent=2)` writes (manifests, identities).
//! - [`manifest`]: `RunManifest` and `PendingRejudge`, read strictly, written like Python.
//! - [`identity`]: configuration identity (current redacted form and legacy forms).
//! - [`drift`]: differing keys and their semantic / operational class.
//! - [`verdict`]: the `validate_resume` decision table as a pure function.
//! - [`errors`]: `IncompleteEvaluationError` and its exit codes.

pub mod canonical;
pub mod drift;
pub mod errors;
pub mod identity;
pub mod manifest;
pub mod materialized;
pub mod pretty;
pub mod verdict;
