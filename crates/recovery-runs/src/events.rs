//! The sidecar lines of decisions §6, each carrying an id so that the database can be rebuilt
//! from them. Lines never hold configuration values: drift lines name keys and digests only.

use serde::{Deserialize, Serialize};

/// `<stem>_manifest_resume_drift.jsonl`: one line per resume across operational drift.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriftLine {
    pub id: String,
    pub at: String,
    pub run_id: String,
    pub saved_config_digest: String,
    pub current_config_digest: String,
    /// Sorted.
    pub operational_keys: Vec<String>,
}

/// `<stem>_rerun_masked.jsonl`: one line per approval of a masked rerun.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalLine {
    pub approval_id: String,
    pub at: String,
    pub by: String,
    pub reason: String,
    pub task_index: i64,
    pub rollout_index: i64,
    pub attempt_index: i64,
}

/// `<stem>_attempt_extension.jsonl`: one line per `--extend-attempts`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtensionLine {
    pub id: String,
    pub at: String,
    pub extend_attempts: i64,
    pub by: String,
    pub reason: String,
}

/// The id of the resubmit recorded on a given line of `<stem>_resubmit_offset` (that file holds
/// bare integers, so its line number is its identity).
pub fn resubmit_id(run_id: &str, line: usize) -> String {
    format!("{run_id}-resubmit-{line}")
}
