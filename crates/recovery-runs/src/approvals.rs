//! How the approvals the database records follow the run's approvals journal.
//!
//! The plan reads the journal (decisions §6), never the database, so every reader that shows
//! or changes approvals makes the database's records agree with the journal by this one rule:
//! the list (in memory, read-only), a revocation (for its id) and a reindex (every change).
//! Hostile reviews 39-44 found, one after another, readers that decided on their own and
//! disagreed with the plan.
//!
//! Invariant: a used approval stays used while its line names the attempt it was used for;
//! any other difference between a line and its record is the line's to decide.

use recovery_core::journals::ApprovalLine;
use recovery_store::Approval;

/// One change that brings the recorded approvals to what the journal says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Follow {
    /// A journal line the database has no record of (a Python collector's, an operator's).
    Insert(Approval),
    /// A record its journal line now says otherwise: revoked and written again, edited in
    /// place, or used and now naming another attempt (it approves that one, unused).
    Restore(Approval),
    /// An open record whose line the journal no longer holds: it approves nothing (a
    /// revocation rewrites the journal first; a line removed by hand is revoked too).
    Revoke(String),
}

/// The changes that make `recorded` (a run's approvals in the database) agree with `journal`
/// (the approvals its readable journal holds, as [`ApprovalJournal`] reads them).
///
/// [`ApprovalJournal`]: recovery_core::journals::ApprovalJournal
pub fn follow_journal(
    run_id: &str,
    recorded: &[Approval],
    journal: Vec<ApprovalLine>,
) -> Vec<Follow> {
    let journalled: std::collections::HashSet<&str> =
        journal.iter().map(|l| l.approval_id.as_str()).collect();
    let revoked = recorded
        .iter()
        .filter(|a| {
            a.consumed_by_attempt.is_none()
                && a.revoked_at.is_none()
                && !journalled.contains(a.approval_id.as_str())
        })
        .map(|a| Follow::Revoke(a.approval_id.clone()))
        .collect::<Vec<_>>();
    let mut follows: Vec<Follow> = journal
        .into_iter()
        .filter_map(|line| {
            let line = record_of(run_id, line);
            match recorded.iter().find(|a| a.approval_id == line.approval_id) {
                None => Some(Follow::Insert(line)),
                Some(record) if differs(record, &line) => Some(Follow::Restore(line)),
                Some(_) => None,
            }
        })
        .collect();
    follows.extend(revoked);
    follows
}

/// Whether a record is to be restored as its journal line says (see [`Follow::Restore`]);
/// `Store::restore_approval` applies the same condition.
fn differs(record: &Approval, line: &Approval) -> bool {
    let same_attempt = record.triple() == line.triple();
    if record.consumed_by_attempt.is_some() {
        return !same_attempt;
    }
    record.revoked_at.is_some()
        || !same_attempt
        || record.at != line.at
        || record.by != line.by
        || record.reason != line.reason
}

/// An approval line as the database records it: open, unused.
pub fn record_of(run_id: &str, line: ApprovalLine) -> Approval {
    Approval {
        approval_id: line.approval_id,
        run_id: run_id.to_owned(),
        at: line.at,
        by: line.by,
        reason: line.reason,
        task_index: line.task_index,
        rollout_index: line.rollout_index,
        attempt_index: line.attempt_index,
        consumed_by_attempt: None,
        revoked_at: None,
    }
}
