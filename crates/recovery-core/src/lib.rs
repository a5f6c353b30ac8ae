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
//! - [`failure`]: failure vocabulary and the responsibility policy (data).
//! - [`facts`]: what the predicates read of a row, extracted in one pass (bytes or value).
//! - [`predicates`]: the seed's row predicates over saved rows.
//! - [`rows`]: logical rollout ids, streaming JSONL reading, failure-record shape.
//! - [`journals`]: attempt extensions, masked-rerun approvals, resubmit offset.
//! - [`plan`]: attempt budget, per-rollout resume plan and coverage snapshot.
//! - [`classify`]: streaming classification of a whole results or failures file.

pub mod canonical;
pub mod classify;
pub mod drift;
pub mod errors;
pub mod facts;
pub mod failure;
pub mod identity;
pub mod journals;
pub mod manifest;
pub mod materialized;
mod pipeline;
pub mod plan;
pub mod predicates;
pub mod pretty;
pub mod rows;
pub mod verdict;
