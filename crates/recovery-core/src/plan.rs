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
//! - the index keeps a few facts per outcome, never the rows, so files of any size stream through.

use crate::facts::RowFacts;
use crate::failure::{ClassificationPolicy, FailureClass, FailureStage};
use crate::manifest::RunManifest;
use crate::predicates as p;
use crate::rows::{
    ATTEMPT_INDEX_KEY, JsonlRecord, ROLLOUT_INDEX_KEY, RUN_ID_KEY, RowError, TASK_INDEX_KEY,
    failure_record_problems, logical_rollout_id, sidecar_failure_class,
};
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

/// The attempt cap when a manifest saved none (`_DEFAULT_MAX_ROLLOUT_ATTEMPTS`).
pub const DEFAULT_MAX_ROLLOUT_ATTEMPTS: u64 = 3;

/// Everything one row's predicates say, as `POST /classify` answers it.
#[derive(Debug, Clone, PartialEq, Serialize)]
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
    } else if row.mask_sample.truthy() {
        RowVerdict::KeepMasked
    } else if row.is_judge_failure() && row.has_saved_generation() {
        RowVerdict::Rejudge
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

fn truthy(value: Option<&Value>) -> bool {
    value.is_some_and(crate::identity::truthy)
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
    #[error("{artifact} line {line}: attempt indices must be non-negative integers.")]
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
}

/// Which saved file a row came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
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

/// One expected rollout of the materialized inventory.
#[derive(Debug, Clone, PartialEq)]
pub struct Expected {
    pub rollout_id: String,
    pub task_index: Option<Value>,
    pub rollout_index: Option<Value>,
}

/// The facts kept of one saved outcome.
#[derive(Debug, Clone)]
struct Outcome {
    artifact: Artifact,
    line: u64,
    fingerprint: [u8; 32],
    failure_class: Option<String>,
    decision: RowDecision,
    masked: bool,
    has_reward: bool,
    counts_as_zero: bool,
    reuse_cached_deliverable: bool,
    migrated_invalid_judge: bool,
}

/// Options of a run that change how its outcomes count.
#[derive(Debug, Clone, Default)]
pub struct IndexOptions {
    /// Sidecar lines up to this 1-based line number no longer count toward the budget.
    pub resubmit_offset: u64,
}

/// Saved outcomes of one run, indexed by (rollout, attempt).
#[derive(Debug)]
pub struct RunIndex<'a> {
    manifest: &'a RunManifest,
    policy: &'a ClassificationPolicy,
    options: IndexOptions,
    expected: Vec<Expected>,
    positions: HashMap<String, usize>,
    latest: HashMap<String, i64>,
    outcomes: HashMap<(String, i64), Outcome>,
    /// Per rollout: the newest attempt with a saved outcome (so a plan never scans outcomes).
    newest_outcome: HashMap<String, i64>,
    /// Per rollout: the longest observed elapsed time of its failures.
    longest_failure: HashMap<String, f64>,
    counted: HashMap<String, u64>,
    counted_only_with_opt_in: HashMap<String, u64>,
    legacy_counts: HashMap<String, i64>,
    warnings: Vec<String>,
}

impl<'a> RunIndex<'a> {
    /// Starts an index over the materialized rows (in file order).
    pub fn new(
        manifest: &'a RunManifest,
        inventory: impl IntoIterator<Item = Value>,
        policy: &'a ClassificationPolicy,
        options: IndexOptions,
    ) -> Result<Self, PlanError> {
        let mut expected = Vec::new();
        let mut positions = HashMap::new();
        for row in inventory {
            let rollout_id = logical_rollout_id(&row)?;
            if positions
                .insert(rollout_id.clone(), expected.len())
                .is_some()
            {
                return Err(PlanError::DuplicateRollout(rollout_id));
            }
            expected.push(Expected {
                rollout_id,
                task_index: row.get(TASK_INDEX_KEY).cloned(),
                rollout_index: row.get(ROLLOUT_INDEX_KEY).cloned(),
            });
        }
        let unknown: Vec<String> = manifest
            .next_attempt
            .keys()
            .filter(|k| !positions.contains_key(*k))
            .cloned()
            .collect();
        if !unknown.is_empty() {
            return Err(PlanError::UnknownReservations(unknown));
        }
        let latest = manifest
            .next_attempt
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(k, n)| (k.clone(), i64::try_from(*n).unwrap_or(i64::MAX) - 1))
            .collect();
        Ok(Self {
            manifest,
            policy,
            options,
            expected,
            positions,
            latest,
            outcomes: HashMap::new(),
            newest_outcome: HashMap::new(),
            longest_failure: HashMap::new(),
            counted: HashMap::new(),
            counted_only_with_opt_in: HashMap::new(),
            legacy_counts: HashMap::new(),
            warnings: Vec::new(),
        })
    }

    /// Notes collected while indexing (tolerated legacy duplicates).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The expected rollouts in inventory order.
    pub fn expected(&self) -> &[Expected] {
        &self.expected
    }

    /// Indexes one saved outcome. Feed the failures sidecar first, then the results file, each in
    /// file order.
    pub fn add(&mut self, artifact: Artifact, record: &JsonlRecord) -> Result<(), PlanError> {
        let row = &record.value;
        let line = record.line;
        let legacy = self.manifest.legacy_import && row.get(RUN_ID_KEY).is_none();
        let rollout = logical_rollout_id(row)?;
        let Some(&position) = self.positions.get(&rollout) else {
            return Err(PlanError::NotInInventory {
                artifact,
                line,
                rollout,
            });
        };
        let fingerprint = crate::canonical::canonical_value(row)
            .map(|text| sha2_fingerprint(text.as_bytes()))
            .unwrap_or_else(|_| sha2_fingerprint(row.to_string().as_bytes()));
        let explicit = match row.get(ATTEMPT_INDEX_KEY) {
            None => None,
            Some(Value::Number(n)) => match n.as_i64() {
                Some(a) if a >= 0 => Some(a),
                _ => return Err(PlanError::BadAttempt { artifact, line }),
            },
            Some(_) => return Err(PlanError::BadAttempt { artifact, line }),
        };
        let attempt = if legacy {
            // Untagged legacy rows are numbered in arrival order; a reused explicit index whose
            // payload differs moves past what this rollout has seen.
            let count = self.legacy_counts.get(&rollout).copied().unwrap_or(0);
            let mut attempt = explicit.unwrap_or(count);
            if self
                .outcomes
                .get(&(rollout.clone(), attempt))
                .is_some_and(|o| o.fingerprint != fingerprint)
            {
                attempt = count.max(attempt + 1);
            }
            self.legacy_counts
                .insert(rollout.clone(), count.max(attempt + 1));
            attempt
        } else {
            explicit.unwrap_or(0)
        };
        let expected = &self.expected[position];
        for (field, value) in [
            (TASK_INDEX_KEY, &expected.task_index),
            (ROLLOUT_INDEX_KEY, &expected.rollout_index),
        ] {
            if row.get(field) != value.as_ref() {
                return Err(PlanError::MismatchedIndex {
                    artifact,
                    line,
                    rollout,
                    field,
                });
            }
        }
        let failure_class =
            row.get("_ng_failure_class")
                .filter(|v| !v.is_null())
                .map(|v| match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                });
        if !legacy && (artifact == Artifact::Results) == failure_class.is_some() {
            return Err(PlanError::WrongArtifact { artifact, line });
        }
        let key = (rollout.clone(), attempt);
        if artifact == Artifact::Results
            && let Some(previous) = self.outcomes.get(&key)
            && previous.migrated_invalid_judge
            && truthy(row.get("invalid_judge_response"))
        {
            // A crash between the sidecar copy and the main-file rewrite of the invalid-judge
            // migration leaves both; the marked sidecar copy supersedes.
            self.warnings.push(format!(
                "{artifact} line {line}: superseded by the invalid-judge migration"
            ));
            return Ok(());
        }
        if row.get(RUN_ID_KEY).and_then(Value::as_str) != Some(self.manifest.run_id.as_str())
            && !legacy
        {
            return Err(PlanError::DifferentRun { artifact, line });
        }
        if let Some(record_value) = row.get("_ng_failure_record") {
            let problems = failure_record_problems(record_value);
            if !problems.is_empty() {
                return Err(PlanError::InvalidFailureRecord {
                    artifact,
                    line,
                    rollout,
                    attempt,
                    problems: problems.join("; "),
                });
            }
            let episode = &record_value["episode_id"];
            let consistent = record_value["run_id"].as_str() == Some(self.manifest.run_id.as_str())
                && episode["rollout_id"].as_str() == Some(rollout.as_str())
                && episode["attempt"].as_i64() == Some(attempt)
                && failure_class == sidecar_failure_class(record_value)
                && truthy(row.get("_ng_failure_terminal"))
                    == (record_value["failure"]["terminal"] == Value::Bool(true));
            if !consistent {
                return Err(PlanError::InconsistentFailureRecord {
                    artifact,
                    line,
                    rollout,
                    attempt,
                });
            }
        }
        let reserved = self
            .manifest
            .next_attempt
            .get(&rollout)
            .copied()
            .unwrap_or(0);
        if !legacy && u64::try_from(attempt).map_or(true, |a| a >= reserved) {
            return Err(PlanError::Unreserved {
                artifact,
                line,
                rollout,
                attempt,
            });
        }
        if let Some(previous) = self.outcomes.get(&key) {
            if previous.fingerprint != fingerprint {
                return Err(PlanError::Conflict {
                    artifact,
                    line,
                    rollout,
                    attempt,
                });
            }
            return Ok(());
        }
        let decision = classify_row(row, self.policy, self.manifest.retry_terminal_timeouts);
        let counts_now = artifact != Artifact::Failures || line > self.options.resubmit_offset;
        if counts_now && failure_class.is_some() && decision.delivery != Some(p::Delivery::NotSent)
        {
            if !decision.terminal {
                *self.counted.entry(rollout.clone()).or_default() += 1;
            } else if !decision.terminal_with_timeout_opt_in {
                *self
                    .counted_only_with_opt_in
                    .entry(rollout.clone())
                    .or_default() += 1;
            }
        }
        if counts_now && decision.masked_infrastructure_kind.is_some() {
            *self.counted.entry(rollout.clone()).or_default() += 1;
        }
        let latest = self.latest.entry(rollout.clone()).or_insert(attempt);
        *latest = (*latest).max(attempt);
        let newest = self
            .newest_outcome
            .entry(rollout.clone())
            .or_insert(attempt);
        *newest = (*newest).max(attempt);
        if failure_class.is_some()
            && let Some(elapsed) = decision.observed_elapsed
        {
            let longest = self
                .longest_failure
                .entry(rollout.clone())
                .or_insert(elapsed);
            *longest = longest.max(elapsed);
        }
        self.outcomes.insert(
            key,
            Outcome {
                artifact,
                line,
                fingerprint,
                failure_class,
                masked: truthy(row.get("mask_sample")),
                has_reward: p::has_numeric_reward(row),
                counts_as_zero: truthy(row.get("_ng_failure_counts_as_zero")),
                reuse_cached_deliverable: truthy(row.get("reuse_cached_deliverable")),
                migrated_invalid_judge: row.get("_ng_migrated_invalid_judge_response")
                    == Some(&Value::Bool(true))
                    && row.get("_ng_failure_class").and_then(Value::as_str)
                        == Some("judge_invalid"),
                decision,
            },
        );
        Ok(())
    }

    /// Counted failures of a rollout under the run's timeout opt-in.
    fn failure_count(&self, rollout: &str) -> u64 {
        let base = self.counted.get(rollout).copied().unwrap_or(0);
        if self.manifest.retry_terminal_timeouts {
            base + self
                .counted_only_with_opt_in
                .get(rollout)
                .copied()
                .unwrap_or(0)
        } else {
            base
        }
    }

    /// The resume plan: one state per expected rollout, and the coverage snapshot.
    pub fn plan(&self, budget: &Budget, approvals: &BTreeSet<(i64, i64, i64)>) -> ResumePlan {
        let cap = budget.cap(self.manifest);
        let mut entries = Vec::with_capacity(self.expected.len());
        for expected in &self.expected {
            entries.push(self.entry(expected, cap, approvals));
        }
        let coverage = self.coverage(cap, &entries);
        let exhausted = entries
            .iter()
            .filter(|e| e.state == PlanState::Exhausted)
            .count();
        let budget_message = (exhausted > 0).then(|| {
            format!(
                "Retry budget exhausted for {exhausted} rollout(s) at the cap of {cap} counted failures. \
                 They will not be dispatched with this cap."
            )
        });
        ResumePlan {
            run_id: self.manifest.run_id.clone(),
            cap,
            entries,
            coverage,
            budget_message,
            warnings: self.warnings.clone(),
        }
    }

    fn entry(
        &self,
        expected: &Expected,
        cap: u64,
        approvals: &BTreeSet<(i64, i64, i64)>,
    ) -> PlanEntry {
        let id = &expected.rollout_id;
        let latest = self.latest.get(id).copied();
        let counted = self.failure_count(id);
        let reserved = self.manifest.next_attempt.get(id).copied();
        let next = reserved.map_or_else(
            || latest.map_or(0, |l| l + 1),
            |n| i64::try_from(n).unwrap_or(i64::MAX),
        );
        let outcome = latest.and_then(|l| self.outcomes.get(&(id.clone(), l)));
        let within_budget = |state_if_ok: PlanState| {
            if counted < cap {
                state_if_ok
            } else {
                PlanState::Exhausted
            }
        };
        let (state, reason) = match (latest, outcome) {
            (None, _) => (
                PlanState::Missing,
                "never dispatched: resume starts it from its input".to_owned(),
            ),
            (Some(_), None) => (
                within_budget(PlanState::Missing),
                "the latest reserved attempt saved no outcome: resume runs it again".to_owned(),
            ),
            (Some(attempt), Some(outcome)) => match outcome.decision.verdict {
                RowVerdict::Omitted => (PlanState::Omitted, "intentionally omitted".to_owned()),
                RowVerdict::Keep => (
                    PlanState::Scored,
                    "a completed result: kept, never rerun".to_owned(),
                ),
                RowVerdict::ModelFinal => (
                    PlanState::ModelFinal,
                    if outcome.counts_as_zero {
                        "the evaluated model's failure, counted as zero: never sampled again"
                            .to_owned()
                    } else {
                        "the agent ran out of its own deadline and kept its answer: never sampled again".to_owned()
                    },
                ),
                RowVerdict::Rejudge => (
                    PlanState::JudgeRecoverable,
                    "the judge failed on a saved answer: re-judge it only".to_owned(),
                ),
                RowVerdict::Terminal => (
                    PlanState::Terminal,
                    if outcome.decision.terminal || outcome.decision.terminal_with_timeout_opt_in {
                        "a terminal failure: gated on resume".to_owned()
                    } else {
                        "a failure naming no cause holds a response: rerunning could replace a saved answer".to_owned()
                    },
                ),
                RowVerdict::KeepMasked => (
                    PlanState::Masked,
                    "a masked result: retained, not measured".to_owned(),
                ),
                RowVerdict::NeedsApproval => {
                    let triple = (
                        crate::rows::index(expected.task_index.as_ref()).unwrap_or(-1),
                        crate::rows::index(expected.rollout_index.as_ref()).unwrap_or(-1),
                        attempt,
                    );
                    if approvals.contains(&triple) {
                        (
                            PlanState::ApprovedRerun,
                            "an operator approved rerunning this masked attempt".to_owned(),
                        )
                    } else {
                        (
                            PlanState::AwaitingApproval,
                            format!(
                                "masked ({}) with a kept answer and no grade: rerun only with an operator's approval",
                                outcome
                                    .decision
                                    .masked_kept_answer_kind
                                    .as_deref()
                                    .unwrap_or("unknown")
                            ),
                        )
                    }
                }
                RowVerdict::Retry => (
                    within_budget(PlanState::Retryable),
                    match &outcome.decision.masked_infrastructure_kind {
                        Some(kind) => format!(
                            "masked by infrastructure ({kind}) without a saved answer: retried within the cap"
                        ),
                        None => format!(
                            "a retryable failure ({}): retried within the cap",
                            outcome.failure_class.as_deref().unwrap_or("unknown")
                        ),
                    },
                ),
            },
        };
        let runnable = matches!(
            state,
            PlanState::Missing | PlanState::Retryable | PlanState::ApprovedRerun
        );
        PlanEntry {
            rollout_id: id.clone(),
            task_index: expected.task_index.clone(),
            rollout_index: expected.rollout_index.clone(),
            state,
            reason,
            latest_attempt: latest,
            next_attempt: runnable.then_some(next),
            counted_failures: counted,
            reuse_cached_deliverable: runnable && self.reuse_cached_deliverable(id),
            longest_failure_elapsed: self.longest_failure_elapsed(id),
            latest_artifact: outcome.map(|o| o.artifact),
            latest_line: outcome.map(|o| o.line),
            failure_kind: outcome.and_then(|o| o.decision.failure_kind.clone()),
            responsibility: outcome
                .filter(|o| o.failure_class.is_some() || o.masked)
                .map(|o| o.decision.responsibility),
        }
    }

    /// The newest recorded outcome carries `reuse_cached_deliverable` and is not an omission.
    fn reuse_cached_deliverable(&self, id: &str) -> bool {
        self.newest_outcome
            .get(id)
            .and_then(|attempt| self.outcomes.get(&(id.to_owned(), *attempt)))
            .is_some_and(|o| {
                o.reuse_cached_deliverable && o.decision.verdict != RowVerdict::Omitted
            })
    }

    fn longest_failure_elapsed(&self, id: &str) -> Option<f64> {
        self.longest_failure.get(id).copied()
    }

    /// The disposition of a rollout's latest attempt (`success`, `failure`, `omitted`, `unknown`).
    fn disposition(&self, id: &str) -> (&'static str, Option<&Outcome>) {
        let Some(latest) = self.latest.get(id) else {
            return ("unknown", None);
        };
        match self.outcomes.get(&(id.to_owned(), *latest)) {
            None => ("unknown", None),
            Some(o) if o.decision.verdict == RowVerdict::Omitted => ("omitted", Some(o)),
            Some(o) if o.failure_class.is_some() => ("failure", Some(o)),
            Some(o) => ("success", Some(o)),
        }
    }

    fn coverage(&self, cap: u64, entries: &[PlanEntry]) -> Coverage {
        let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
        let (mut masked, mut unscored) = (0, 0);
        for expected in &self.expected {
            let (disposition, outcome) = self.disposition(&expected.rollout_id);
            *counts.entry(disposition).or_default() += 1;
            if disposition == "success"
                && let Some(o) = outcome
            {
                if !o.has_reward {
                    unscored += 1;
                } else if o.masked {
                    masked += 1;
                }
            }
        }
        let count = |k: &str| counts.get(k).copied().unwrap_or(0);
        let expected = self.expected.len() as u64;
        let successful = count("success");
        let dispatched: HashSet<&String> = self.latest.keys().collect();
        let attempts = self
            .latest
            .iter()
            .map(|(id, latest)| {
                let reserved = self.manifest.next_attempt.get(id).copied().unwrap_or(0);
                reserved.max(u64::try_from(*latest).unwrap_or(0) + 1)
            })
            .sum();
        let failures_counted_as_zero = entries
            .iter()
            .filter(|e| e.state == PlanState::ModelFinal)
            .count() as u64;
        let measured = successful - masked - unscored;
        Coverage {
            schema_version: 2,
            selection_policy: crate::manifest::SELECTION_POLICY.to_owned(),
            run_id: self.manifest.run_id.clone(),
            expected,
            successful,
            measured,
            masked,
            unscored,
            failed: count("failure"),
            intentionally_omitted: count("omitted"),
            unknown: count("unknown"),
            never_dispatched: expected - dispatched.len() as u64,
            attempts,
            counted_failures: self
                .expected
                .iter()
                .map(|e| self.failure_count(&e.rollout_id))
                .sum(),
            attempts_exhausted: entries
                .iter()
                .filter(|e| e.state == PlanState::Exhausted)
                .count() as u64,
            max_rollout_attempts: cap,
            retry_terminal_timeouts: self.manifest.retry_terminal_timeouts,
            completion_fraction: if expected == 0 {
                1.0
            } else {
                successful as f64 / expected as f64
            },
            complete: successful == expected,
            reconciled: count("unknown") == 0,
            identity_verified: !(self.manifest.legacy_import || self.manifest.identity_overridden),
            scored: measured + failures_counted_as_zero,
            failures_counted_as_zero,
        }
    }
}

fn sha2_fingerprint(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes).into()
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
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
