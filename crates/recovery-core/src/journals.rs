//! The small per-run journals that change a run's attempt budget (decisions §6), parsed from a
//! [`Read`]: attempt extensions, masked-rerun approvals and the resubmit offset.
//!
//! Invariants: an unreadable extension line stops the run (never guess a cap); an unreadable
//! approval line approves nothing (a saved answer is never sampled again by default); a malformed
//! resubmit-offset line is an error.

use crate::rows::{JsonlError, scan_jsonl};
use serde_json::Value;
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read};

/// Why a journal cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("{path} line {line}: {message}")]
    Invalid {
        path: String,
        line: u64,
        message: String,
    },
    #[error(transparent)]
    Jsonl(#[from] JsonlError),
    #[error("reading {path} failed: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// `load_attempt_extension`: the attempts explicit recoveries added to every rollout's cap (the
/// sum of `extend_attempts` over `<stem>_attempt_extension.jsonl`).
pub fn attempt_extension(reader: impl Read, path: &str) -> Result<u64, JournalError> {
    let mut total = 0u64;
    let mut bad: Option<JournalError> = None;
    let summary = scan_jsonl::<std::convert::Infallible>(reader, path, |record| {
        match record
            .value
            .get("extend_attempts")
            .and_then(Value::as_u64)
            .filter(|n| *n >= 1)
        {
            Some(n) => total = total.saturating_add(n),
            None => {
                bad.get_or_insert(JournalError::Invalid {
                    path: path.to_owned(),
                    line: record.line,
                    message: "extend_attempts must be an integer >= 1".into(),
                });
            }
        }
        Ok(())
    })?;
    if let Some(error) = bad {
        return Err(error);
    }
    if let Some(torn) = summary.torn_tail {
        return Err(JournalError::Invalid {
            path: path.to_owned(),
            line: torn.line,
            message: "incomplete final line".into(),
        });
    }
    Ok(total)
}

/// An approved masked rerun: exactly the attempt it names.
pub type ApprovalTriple = (i64, i64, i64);

/// `<stem>_rerun_masked.jsonl`: one line per approval of a masked rerun (decisions §6). Every
/// field is required; fields it does not know are ignored.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ApprovalLine {
    pub approval_id: String,
    pub at: String,
    pub by: String,
    pub reason: String,
    pub task_index: i64,
    pub rollout_index: i64,
    pub attempt_index: i64,
}

impl ApprovalLine {
    /// The attempt the approval names; `None` for a negative index (it approves nothing).
    pub fn triple(&self) -> Option<ApprovalTriple> {
        let triple = (self.task_index, self.rollout_index, self.attempt_index);
        (triple.0 >= 0 && triple.1 >= 0 && triple.2 >= 0).then_some(triple)
    }
}

/// `load_rerun_masked_approvals`: (task index, rollout index, attempt index) of every readable
/// approval in `<stem>_rerun_masked.jsonl`; a line that is not a whole [`ApprovalLine`] approves
/// nothing, so the plan honours exactly the approvals the service lists, revokes and reindexes
/// (a hand-written `{task_index, rollout_index, attempt_index}` line approved a rerun that the
/// list did not show: hostile review 39).
pub fn rerun_masked_approvals(reader: impl Read) -> BTreeSet<ApprovalTriple> {
    let mut approvals = BTreeSet::new();
    let mut lines = BufReader::new(reader);
    let mut line = Vec::new();
    loop {
        line.clear();
        match lines.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return approvals,
            Ok(_) => {}
        }
        if let Some(triple) = serde_json::from_slice::<ApprovalLine>(&line)
            .ok()
            .and_then(|approval| approval.triple())
        {
            approvals.insert(triple);
        }
    }
}

/// `load_resubmit_offset`: the failures-sidecar line count at the last resubmit (the last line
/// of `<stem>_resubmit_offset`); 0 when none.
pub fn resubmit_offset(reader: impl Read, path: &str) -> Result<u64, JournalError> {
    let mut offset = 0u64;
    for (number, line) in BufReader::new(reader).lines().enumerate() {
        let line = line.map_err(|source| JournalError::Io {
            path: path.to_owned(),
            source,
        })?;
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        offset = text.parse().map_err(|_| JournalError::Invalid {
            path: path.to_owned(),
            line: number as u64 + 1,
            message: format!("{text:?} is not a line count"),
        })?;
    }
    Ok(offset)
}
