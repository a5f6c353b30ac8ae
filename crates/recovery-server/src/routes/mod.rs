//! HTTP handlers, grouped by resource.

pub mod audit;
pub mod leases;
pub mod ops;
pub mod query;
pub mod runs;
pub mod system;
