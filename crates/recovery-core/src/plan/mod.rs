//! The attempt budget and the per-rollout resume plan (facts §11, §13, §16; decisions §7-§8):
//! from the materialized inventory, saved results and failures, the manifest, approvals and the
//! classification policy, one state per expected rollout, and the coverage snapshot.
//!
//! Invariants:
//! - selection is `latest_allocated`: a rollout's current attempt is the greatest reserved or
//!   saved attempt index; older outcomes stay in the files but never count again;
//! - a counted failure is counted once per (rollout, attempt): a failure row that was possibly
//!   delivered and is not terminal (with `retry_terminal_timeouts`, terminal timeouts too), and a
//!   masked result infrastructure left unmeasured; sidecar lines up to the resubmit offset no
//!   longer count; the cap is the saved cap (or the default) plus the extension;
//! - a saved answer is never sampled again: answered deadlines and zero-counted failures are
//!   final, a masked kept answer waits for an operator's approval of exactly that attempt;
//! - the index keeps a few facts per outcome, never the rows, so files of any size stream through;
//!   an outcome's line is read again only when a second outcome of the same attempt arrives;
//! - the index is built once and grows with appended outcomes ([`RunIndex::add`]); what depends
//!   on the manifest, the budget and the approvals is decided when a [`PlanView`] is taken.
//!
//! - [`index`]: the index of saved outcomes and the plan views over it;
//! - [`read`]: reading inventories and outcome files into an index, on several threads.

mod index;
mod read;

pub use index::{
    Disposition, Expected, LineAt, LineSource, MemoryLines, OutcomeCheck, OutcomeRow, PlanSummary,
    PlanView, Reservations, RunIndex,
};
pub use read::{JsonlMark, OutcomesError, index_outcomes, read_inventory};

use crate::facts::RowFacts;
use crate::failure::{ClassificationPolicy, FailureClass, FailureStage};
use crate::manifest::RunManifest;
use crate::predicates as p;
use crate::rows::RowError;
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;

/// The attempt cap when a manifest saved none (`_DEFAULT_MAX_ROLLOUT_ATTEMPTS`).
pub const DEFAULT_MAX_ROLLOUT_ATTEMPTS: u64 = 3;

/// Everything one row's predicates say, as `POST /classify` answers it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RowDecision {
    pub is_failure_row: bool,
    pub failure_kind: Option<String>,
    pub failure_stage: Option<FailureStage>,
    pub responsibility: FailureClass,
    pub applied_class: Option<FailureClass>,
    pub terminal: bool,
    pub terminal_with_timeout_opt_in: bool,
    pub delivery: Option<p::Delivery>,
    pub has_saved_generation: bool,
    pub holds_response: bool,
    pub keeps_partial_response: bool,
    pub keeps_saved_answer: bool,
    pub has_recorded_grade: bool,
    pub has_unclassified_execution_failure: bool,
    pub is_infrastructure_agent_timeout: bool,
    pub is_answered_agent_deadline: bool,
    pub sandbox_or_tool_fault: bool,
    pub material_model_call_faults: bool,
    pub server_fault_calls: usize,
    pub captured_calls: usize,
    pub masked_infrastructure_kind: Option<String>,
    pub masked_kept_answer_kind: Option<String>,
    pub observed_elapsed: Option<f64>,
    /// What resume does with this row as the latest attempt of its rollout.
    pub verdict: RowVerdict,
}

/// What resume does with a row, read on its own (the budget decides between retry and
/// exhaustion in the plan).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum RowVerdict {
    /// A scored result: kept, never rerun.
    Keep,
    /// The model's final result (answered deadline, counted as zero): never sampled again.
    ModelFinal,
    /// A judge failure with the real answer saved: re-judge the saved answer only.
    Rejudge,
    /// Retried within the attempt budget.
    Retry,
    /// Gated on resume.
    Terminal,
    /// A masked result kept as the result.
    KeepMasked,
    /// A masked kept answer without a grade: rerun only with an operator's approval.
    NeedsApproval,
    /// An intentional omission.
    Omitted,
}

/// Classifies one saved row.
pub fn classify_row(
    row: &Value,
    policy: &ClassificationPolicy,
    retry_terminal_timeouts: bool,
) -> RowDecision {
    classify_facts(&RowFacts::from_value(row), policy, retry_terminal_timeouts)
}

/// Classifies the facts of one saved row.
pub fn classify_facts(
    row: &RowFacts,
    policy: &ClassificationPolicy,
    retry_terminal_timeouts: bool,
) -> RowDecision {
    let is_failure_row = row.is_failure_row();
    let calls = row.captured_model_calls();
    let server_fault_calls = calls
        .iter()
        .filter(|c| p::is_server_fault_call(c, policy))
        .count();
    let masked_infrastructure_kind = row.masked_infrastructure_kind(policy).map(str::to_owned);
    let masked_kept_answer_kind = row.masked_kept_answer_kind(policy).map(str::to_owned);
    let terminal = row.is_terminal_failure(false);
    let terminal_with_timeout_opt_in = row.is_terminal_failure(true);
    let (infrastructure_timeout, answered) = row.timeout_verdicts(&calls, policy);
    let verdict = if row.is_omission() {
        RowVerdict::Omitted
    } else if is_failure_row {
        if row.failure_counts_as_zero.truthy() || answered {
            RowVerdict::ModelFinal
        } else if row.is_judge_failure() && row.has_saved_generation() {
            RowVerdict::Rejudge
        } else if row.is_terminal_failure(retry_terminal_timeouts)
            || (row.has_unclassified_execution_failure() && row.holds_response())
        {
            RowVerdict::Terminal
        } else {
            RowVerdict::Retry
        }
    } else if masked_infrastructure_kind.is_some() {
        RowVerdict::Retry
    } else if masked_kept_answer_kind.is_some() {
        RowVerdict::NeedsApproval
    } else if row.is_judge_failure() && row.has_saved_generation() {
        // A judge failure on a saved answer is re-judged, masked or not (facts §16): the
        // masked-regrade kinds are graded again from the answer, never kept as a dead end.
        RowVerdict::Rejudge
    } else if row.mask_sample.truthy() {
        RowVerdict::KeepMasked
    } else {
        RowVerdict::Keep
    };
    RowDecision {
        is_failure_row,
        failure_kind: row.row_failure_kind().map(str::to_owned),
        failure_stage: row.failure_stage(),
        responsibility: row.responsibility(policy),
        applied_class: row.applied_failure_class(),
        terminal,
        terminal_with_timeout_opt_in,
        delivery: is_failure_row.then(|| row.delivery()),
        has_saved_generation: row.has_saved_generation(),
        holds_response: row.holds_response(),
        keeps_partial_response: row.keeps_partial_response(),
        keeps_saved_answer: row.keeps_saved_answer(),
        has_recorded_grade: row.has_recorded_grade(),
        has_unclassified_execution_failure: row.has_unclassified_execution_failure(),
        is_infrastructure_agent_timeout: infrastructure_timeout,
        is_answered_agent_deadline: answered,
        sandbox_or_tool_fault: row.sandbox_or_tool_fault(policy),
        material_model_call_faults: row.material_faults_with(&calls, policy),
        server_fault_calls,
        captured_calls: calls.len(),
        masked_infrastructure_kind,
        masked_kept_answer_kind,
        observed_elapsed: row.observed_elapsed(),
        verdict,
    }
}

/// Why saved outcomes cannot be indexed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Row(#[from] RowError),
    #[error("Duplicate logical rollout id '{0}' in materialized inputs.")]
    DuplicateRollout(String),
    #[error("Run manifest reserves attempts for unknown rollouts: {0:?}.")]
    UnknownReservations(Vec<String>),
    #[error(
        "{artifact} line {line}: rollout '{rollout}' is not in this run's materialized inputs."
    )]
    NotInInventory {
        artifact: Artifact,
        line: u64,
        rollout: String,
    },
    #[error(
        "{artifact} line {line}: attempt indices must be integers from 0 to 2^63 - 1 (9223372036854775807)."
    )]
    BadAttempt { artifact: Artifact, line: u64 },
    #[error("{artifact} line {line}: rollout '{rollout}' has mismatched {field}.")]
    MismatchedIndex {
        artifact: Artifact,
        line: u64,
        rollout: String,
        field: &'static str,
    },
    #[error("{artifact} line {line}: saved outcome belongs to a different run.")]
    DifferentRun { artifact: Artifact, line: u64 },
    #[error(
        "{artifact} line {line}: invalid saved failure record for rollout attempt ('{rollout}', {attempt}): {problems}"
    )]
    InvalidFailureRecord {
        artifact: Artifact,
        line: u64,
        rollout: String,
        attempt: i64,
        problems: String,
    },
    #[error(
        "{artifact} line {line}: saved failure record is inconsistent with its envelope for rollout attempt ('{rollout}', {attempt})."
    )]
    InconsistentFailureRecord {
        artifact: Artifact,
        line: u64,
        rollout: String,
        attempt: i64,
    },
    #[error(
        "{artifact} line {line}: saved outcome ('{rollout}', {attempt}) has no reserved attempt in the run manifest."
    )]
    Unreserved {
        artifact: Artifact,
        line: u64,
        rollout: String,
        attempt: i64,
    },
    #[error(
        "{artifact} line {line}: Conflicting outcomes for rollout attempt ('{rollout}', {attempt})."
    )]
    Conflict {
        artifact: Artifact,
        line: u64,
        rollout: String,
        attempt: i64,
    },
    #[error("{artifact} line {line}: Outcome in the wrong artifact.")]
    WrongArtifact { artifact: Artifact, line: u64 },
    /// A saved line could not be read back to compare two outcomes of one attempt.
    #[error("{artifact} line {line}: cannot read a saved outcome again: {message}")]
    Unreadable {
        artifact: Artifact,
        line: u64,
        message: String,
    },
}

impl PlanError {
    /// A stable snake_case name of the rule refused (an API's `details.reason`).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Row(RowError::InvalidIdentity(_)) => "invalid_identity",
            Self::Row(RowError::NoIdentity) => "no_identity",
            Self::DuplicateRollout(_) => "duplicate_rollout",
            Self::UnknownReservations(_) => "unknown_reservations",
            Self::NotInInventory { .. } => "not_in_inventory",
            Self::BadAttempt { .. } => "bad_attempt",
            Self::MismatchedIndex { .. } => "mismatched_index",
            Self::DifferentRun { .. } => "different_run",
            Self::InvalidFailureRecord { .. } => "invalid_failure_record",
            Self::InconsistentFailureRecord { .. } => "inconsistent_failure_record",
            Self::Unreserved { .. } => "unreserved",
            Self::Conflict { .. } => "conflicting_outcomes",
            Self::WrongArtifact { .. } => "wrong_artifact",
            Self::Unreadable { .. } => "unreadable",
        }
    }
}

/// Which saved file a row came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Artifact {
    Results,
    Failures,
}

impl std::fmt::Display for Artifact {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Results => "results",
            Self::Failures => "failures sidecar",
        })
    }
}

/// Options of a run that change how its outcomes count.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexOptions {
    /// Sidecar lines up to this 1-based line number no longer count toward the budget.
    pub resubmit_offset: u64,
    /// Results-file lines up to this 1-based line number no longer count either (masked
    /// infrastructure results saved before the last resubmit).
    pub resubmit_results_offset: u64,
}

/// What changes a run's attempt cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// The cap when the manifest saved none (service configuration, default 3).
    pub default_cap: u64,
    /// Attempts explicit recoveries added (`--extend-attempts`).
    pub extension: u64,
}

impl Default for Budget {
    fn default() -> Self {
        Self {
            default_cap: DEFAULT_MAX_ROLLOUT_ATTEMPTS,
            extension: 0,
        }
    }
}

impl Budget {
    /// Cap = saved cap (or the default) + extension.
    pub fn cap(&self, manifest: &RunManifest) -> u64 {
        manifest
            .max_rollout_attempts
            .unwrap_or(self.default_cap)
            .saturating_add(self.extension)
    }
}

/// One rollout's state on resume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, serde::Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum PlanState {
    Scored,
    ModelFinal,
    JudgeRecoverable,
    Retryable,
    Exhausted,
    Terminal,
    Missing,
    Masked,
    Omitted,
    AwaitingApproval,
    ApprovedRerun,
}

/// The plan for one expected rollout.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PlanEntry {
    pub rollout_id: String,
    pub task_index: Option<Value>,
    pub rollout_index: Option<Value>,
    pub state: PlanState,
    pub reason: String,
    pub latest_attempt: Option<i64>,
    /// The execution number a resume uses (runnable states only).
    pub next_attempt: Option<i64>,
    pub counted_failures: u64,
    pub reuse_cached_deliverable: bool,
    /// Longest observed elapsed seconds among the rollout's failures (`dispatch_longest_first`).
    pub longest_failure_elapsed: Option<f64>,
    pub latest_artifact: Option<Artifact>,
    pub latest_line: Option<u64>,
    pub failure_kind: Option<String>,
    pub responsibility: Option<FailureClass>,
}

/// The coverage snapshot (`<stem>_coverage.json`, facts §11.7), fields in the Python order.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Coverage {
    pub schema_version: u32,
    pub selection_policy: String,
    pub run_id: String,
    pub expected: u64,
    pub successful: u64,
    pub measured: u64,
    pub masked: u64,
    pub unscored: u64,
    pub failed: u64,
    pub intentionally_omitted: u64,
    pub unknown: u64,
    pub never_dispatched: u64,
    pub attempts: u64,
    pub counted_failures: u64,
    pub attempts_exhausted: u64,
    pub max_rollout_attempts: u64,
    pub retry_terminal_timeouts: bool,
    pub completion_fraction: f64,
    pub complete: bool,
    pub reconciled: bool,
    pub identity_verified: bool,
    pub scored: u64,
    pub failures_counted_as_zero: u64,
}

impl Coverage {
    /// The CLI completion check: an incomplete evaluation is an [`IncompleteEvaluationError`]
    /// naming `successful/expected`.
    ///
    /// [`IncompleteEvaluationError`]: crate::errors::IncompleteEvaluationError
    pub fn check_complete(&self) -> Result<(), crate::errors::IncompleteEvaluationError> {
        if self.complete {
            return Ok(());
        }
        let mut error = crate::errors::IncompleteEvaluationError::new(format!(
            "{}/{} samples completed; saved partial results are valid and a resume continues them.",
            self.successful, self.expected
        ));
        error.made_progress = self.successful > 0;
        Err(error)
    }
}

/// How a run stands at the collector's completion check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// Every rollout has its final result.
    Complete,
    /// The only gaps are intentional omissions beside completed rollouts
    /// (`has_only_intentional_gaps`).
    OnlyIntentionalGaps { omitted: u64 },
}

/// The collector's completion check over a plan's states: complete when every rollout has its
/// final result (`scored` or `model_final`), accepted when the only gaps are omissions beside
/// completed rollouts (`has_only_intentional_gaps`), else an [`IncompleteEvaluationError`]
/// whose exit code is 75 (progress, a resume can go on), 1 (no progress) or 76 (nothing a
/// resume can run: terminal, exhausted, masked or awaiting an operator), and whose message
/// counts what is not complete.
///
/// [`IncompleteEvaluationError`]: crate::errors::IncompleteEvaluationError
pub fn completion(
    state_counts: &BTreeMap<PlanState, u64>,
) -> Result<Completion, crate::errors::IncompleteEvaluationError> {
    let count = |state| state_counts.get(&state).copied().unwrap_or(0);
    let expected: u64 = state_counts.values().sum();
    let completed = count(PlanState::Scored) + count(PlanState::ModelFinal);
    let omitted = count(PlanState::Omitted);
    if completed == expected {
        return Ok(Completion::Complete);
    }
    if p::has_only_intentional_gaps(expected, completed, omitted) {
        return Ok(Completion::OnlyIntentionalGaps { omitted });
    }
    let runnable = [
        PlanState::Missing,
        PlanState::Retryable,
        PlanState::ApprovedRerun,
        PlanState::JudgeRecoverable,
    ];
    let gaps: Vec<String> = state_counts
        .iter()
        .filter(|(state, n)| **n > 0 && !matches!(state, PlanState::Scored | PlanState::ModelFinal))
        .map(|(state, n)| format!("{n} {}", state.label()))
        .collect();
    let retryable = runnable.iter().any(|state| count(*state) > 0);
    // Exit 76 says a resume alone cannot help: the message says what can.
    let next = if retryable {
        "saved partial results are valid and a resume continues them"
    } else {
        "saved partial results are valid, but a resume has nothing to run: approve masked reruns, \
         extend attempts or resubmit first"
    };
    let mut error = crate::errors::IncompleteEvaluationError::new(format!(
        "{completed}/{expected} samples completed ({}); {next}.",
        gaps.join(", ")
    ));
    error.retryable = retryable;
    error.made_progress = completed > 0;
    Err(error)
}

impl PlanState {
    /// The state's name as the API spells it, for messages.
    pub fn label(self) -> &'static str {
        match self {
            Self::Scored => "scored",
            Self::ModelFinal => "model_final",
            Self::JudgeRecoverable => "judge_recoverable",
            Self::Retryable => "retryable",
            Self::Exhausted => "exhausted",
            Self::Terminal => "terminal",
            Self::Missing => "missing",
            Self::Masked => "masked",
            Self::Omitted => "omitted",
            Self::AwaitingApproval => "awaiting_approval",
            Self::ApprovedRerun => "approved_rerun",
        }
    }
}

/// The resume plan of a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResumePlan {
    pub run_id: String,
    pub cap: u64,
    pub entries: Vec<PlanEntry>,
    pub coverage: Coverage,
    /// "Retry budget exhausted for N rollout(s) at the cap of M counted failures." when any.
    pub budget_message: Option<String>,
    pub warnings: Vec<String>,
}

impl ResumePlan {
    /// Runnable entries in dispatch order: inventory order, or with `longest_first` by descending
    /// longest failure time (ties keep inventory order).
    pub fn dispatch_order(&self, longest_first: bool) -> Vec<&PlanEntry> {
        let mut runnable: Vec<&PlanEntry> = self
            .entries
            .iter()
            .filter(|e| e.next_attempt.is_some())
            .collect();
        if longest_first {
            runnable.sort_by(|a, b| {
                b.longest_failure_elapsed
                    .unwrap_or(0.0)
                    .total_cmp(&a.longest_failure_elapsed.unwrap_or(0.0))
            });
        }
        runnable
    }

    /// How many rollouts are in each state.
    pub fn state_counts(&self) -> BTreeMap<PlanState, u64> {
        let mut counts = BTreeMap::new();
        for entry in &self.entries {
            *counts.entry(entry.state).or_default() += 1;
        }
        counts
    }
}
