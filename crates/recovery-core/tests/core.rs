//! The one integration-test binary of `recovery-core`.

#[path = "core/support.rs"]
mod support;

#[path = "core/canonical.rs"]
mod canonical;
#[path = "core/drift.rs"]
mod drift;
#[path = "core/errors.rs"]
mod errors;
#[path = "core/identity.rs"]
mod identity;
#[path = "core/manifest.rs"]
mod manifest;
#[path = "core/materialized.rs"]
mod materialized;
#[path = "core/omegaconf.rs"]
mod omegaconf;
#[path = "core/plan.rs"]
mod plan;
#[path = "core/predicates.rs"]
mod predicates;
#[path = "core/rows.rs"]
mod rows;
#[path = "core/verdict.rs"]
mod verdict;
