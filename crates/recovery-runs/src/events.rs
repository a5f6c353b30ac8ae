//! The sidecar lines of decisions §6, written with exactly the documented fields, so Python
//! collectors write and read the same lines. A line's database id is derived from the run, the
//! journal, the line's byte offset and its bytes ([`line_id`]), so lines written by anyone index
//! the same way and replays are idempotent. Lines never hold configuration values: drift lines
//! name keys and digests only.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The stable id of a journal line: 32 hex digits of SHA-256 over the run id, the journal's kind,
/// the line's byte offset and its bytes.
pub fn line_id(run_id: &str, journal: &str, offset: u64, bytes: &[u8]) -> String {
    let mut hasher = Sha256::new();
    hasher.update(format!("{run_id}\n{journal}\n{offset}\n").as_bytes());
    hasher.update(bytes);
    let digest = hasher.finalize();
    recovery_core::canonical::hex(&digest[..16])
}

/// Journal kinds named in [`line_id`].
pub const DRIFT_JOURNAL: &str = "resume_drift";
pub const EXTENSION_JOURNAL: &str = "attempt_extension";

/// `<stem>_manifest_resume_drift.jsonl`: one line per resume across operational drift.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriftLine {
    /// Lines written by earlier versions of this service carried their id; read, never written.
    #[serde(default, skip_serializing)]
    pub id: Option<String>,
    pub at: String,
    pub run_id: String,
    pub saved_config_digest: String,
    pub current_config_digest: String,
    /// Sorted.
    pub operational_keys: Vec<String>,
}

/// `<stem>_rerun_masked.jsonl`: its line format lives with its reader in the core.
pub use recovery_core::journals::ApprovalLine;

/// `<stem>_attempt_extension.jsonl`: one line per `--extend-attempts`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtensionLine {
    /// As [`DriftLine::id`].
    #[serde(default, skip_serializing)]
    pub id: Option<String>,
    /// The plan counts a line by its `extend_attempts` alone, so the record of it is never
    /// refused for its other fields: each reads as [`any_as_text`] (hostile reviews 49, 50).
    #[serde(default, deserialize_with = "any_as_text")]
    pub at: String,
    pub extend_attempts: i64,
    #[serde(default, deserialize_with = "any_as_text")]
    pub by: String,
    #[serde(default, deserialize_with = "any_as_text")]
    pub reason: String,
}

/// A text field of a hand-written line: missing or null reads as empty, a string as itself, any
/// other value as its JSON text.
fn any_as_text<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    Ok(match serde_json::Value::deserialize(deserializer)? {
        serde_json::Value::Null => String::new(),
        serde_json::Value::String(text) => text,
        other => other.to_string(),
    })
}

/// The id of the resubmit recorded on a given line of `<stem>_resubmit_offset` (that file holds
/// bare integers, so its line number is its identity).
pub fn resubmit_id(run_id: &str, line: usize) -> String {
    format!("{run_id}-resubmit-{line}")
}
