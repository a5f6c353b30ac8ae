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

/// One journal line as `T`, its JSON read as CPython's `json.loads` reads it (decisions §1): of
/// a key given twice, the last value counts. serde's derived readers refuse a repeated field,
/// or a first value of the wrong type before they see the second (hostile reviews 47 and 48),
/// so a line they refuse is read again through a [`Value`], which keeps the last; when that
/// fails too, the direct reading's error is the answer. A well-formed line is parsed directly.
pub fn parse_line<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, serde_json::Error> {
    serde_json::from_slice::<T>(bytes).or_else(|direct| {
        serde_json::from_slice::<Value>(bytes)
            .and_then(serde_json::from_value)
            .map_err(|_| direct)
    })
}

/// Why an attempt-extension line adds nothing (decisions §6: `extend_attempts` N >= 1; and
/// attempts are numbered in signed 64 bits), as every reader of the journal says it.
pub const EXTENSION_REFUSED: &str =
    "extend_attempts must be an integer from 1 to 9223372036854775807";

/// Why a journal whose lines are each readable adds up to no cap: never a guessed one.
pub const EXTENSIONS_OVERFLOW: &str =
    "the extensions up to this line add up past 9223372036854775807 attempts";

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
    let mut total = 0i64;
    let mut bad: Option<JournalError> = None;
    let summary = scan_jsonl::<std::convert::Infallible>(reader, path, |record| {
        let added = record
            .value
            .get("extend_attempts")
            .and_then(Value::as_i64)
            .filter(|n| *n >= 1)
            .ok_or(EXTENSION_REFUSED)
            .and_then(|n| total.checked_add(n).ok_or(EXTENSIONS_OVERFLOW));
        match added {
            Ok(sum) => total = sum,
            Err(message) => {
                bad.get_or_insert(JournalError::Invalid {
                    path: path.to_owned(),
                    line: record.line,
                    message: message.into(),
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
    // Non-negative: every added value is >= 1.
    Ok(total.unsigned_abs())
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

/// The longest approval id a line may carry (the service's ids are 32 hex digits; an API call
/// names at most 256 bytes, so a longer one could never be revoked).
pub const APPROVAL_ID_MAX: usize = 256;

impl ApprovalLine {
    /// One journal line (without its `\n`) read as an approval: a whole line of the format, its
    /// id 1 to [`APPROVAL_ID_MAX`] bytes, its indices non-negative; anything else is why not.
    pub fn parse(line: &[u8]) -> Result<Self, String> {
        let approval = parse_line::<Self>(line).map_err(|e| e.to_string())?;
        if approval.approval_id.is_empty() || approval.approval_id.len() > APPROVAL_ID_MAX {
            return Err(format!(
                "approval_id: must be 1 to {APPROVAL_ID_MAX} bytes (a longer or empty one could never be revoked)"
            ));
        }
        if approval.task_index < 0 || approval.rollout_index < 0 || approval.attempt_index < 0 {
            return Err("task_index, rollout_index, attempt_index: must not be negative".into());
        }
        Ok(approval)
    }

    /// The attempt the approval names.
    pub fn triple(&self) -> ApprovalTriple {
        (self.task_index, self.rollout_index, self.attempt_index)
    }
}

/// An approvals journal as every reader reads it (the plan, reindex; revocation removes the
/// lines of an id by [`ApprovalLine::parse`] too), so the plan honours exactly the approvals
/// the service lists and revokes (hostile reviews 39-41: readers that differed reopened masked
/// answers the list never showed).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApprovalJournal {
    /// The approvals in file order: of each id, its first whole line ([`ApprovalLine::parse`]).
    pub approvals: Vec<ApprovalLine>,
    /// Lines that approve nothing: (1-based line number, why). Blank lines are not among them.
    pub unreadable: Vec<(u64, String)>,
}

impl ApprovalJournal {
    /// Reads the journal's newline-terminated lines (each without its `\n`; an unterminated
    /// last line may be a write in progress, and is no line yet).
    pub fn of_lines<'a>(lines: impl IntoIterator<Item = &'a [u8]>) -> Self {
        let mut journal = Self::default();
        let mut ids = std::collections::HashSet::new();
        for (number, line) in (1u64..).zip(lines) {
            if crate::rows::is_blank(line) {
                continue;
            }
            match ApprovalLine::parse(line) {
                Ok(approval) if !ids.insert(approval.approval_id.clone()) => {
                    journal.unreadable.push((
                        number,
                        format!(
                            "approval_id {:?} is an earlier line's: this one approves nothing",
                            approval.approval_id
                        ),
                    ));
                }
                Ok(approval) => journal.approvals.push(approval),
                Err(why) => journal.unreadable.push((number, why)),
            }
        }
        journal
    }
}

/// `load_rerun_masked_approvals`: (task index, rollout index, attempt index) of every approval
/// in `<stem>_rerun_masked.jsonl` ([`ApprovalJournal`]); a read error ends the journal there.
pub fn rerun_masked_approvals(reader: impl Read) -> BTreeSet<ApprovalTriple> {
    let mut lines = Vec::new();
    let mut reader = BufReader::new(reader);
    loop {
        let mut line = Vec::new();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if line.pop() != Some(b'\n') {
            break;
        }
        lines.push(line);
    }
    ApprovalJournal::of_lines(lines.iter().map(Vec::as_slice))
        .approvals
        .iter()
        .map(ApprovalLine::triple)
        .collect()
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
