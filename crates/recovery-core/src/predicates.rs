//! The row predicates of `nemo_gym.rollouts.rollout_recovery` (facts §15, decisions §7), as pure
//! functions over saved result and failure rows.
//!
//! Each predicate is a method of [`RowFacts`] (what a row says, extracted once); the functions
//! over a `serde_json::Value` row are the seed's signatures. Invariants: any JSON value is
//! accepted as a row; nothing panics; a saved answer is never treated as re-runnable; timeouts,
//! cancellations and truncated streams never establish time spent on infrastructure. Field names
//! the reference does not publish are those of decisions §7.

use crate::facts::{CallFacts, Json, ResponseFacts, RowFacts};
use crate::failure::{
    ClassificationPolicy, FailureClass, FailureStage, HttpEvidence, KindStatus, kind_status,
    shared_name,
};
use serde_json::Value;

/// `AGENT_TIMEOUT_FAULT_SHARE`: server-faulted calls owning this share of the window make an
/// agent timeout the evaluation's failure.
pub const AGENT_TIMEOUT_FAULT_SHARE: f64 = 0.25;
/// `COLLECTED_MODEL_CALLS_KEY`: a collector projection's captured calls.
pub const COLLECTED_MODEL_CALLS_KEY: &str = "_ng_collected_model_calls";
/// Kinds whose masked result is graded again from the saved answer (`_MASKED_REGRADE_KINDS`).
pub const MASKED_REGRADE_KINDS: &[&str] =
    &["judge_failed", "judge_unparseable", "agent_route_failed"];
/// Legacy labels that stay retryable under `retry_terminal_timeouts`.
pub const RETRYABLE_UNDER_TIMEOUT_OPT_IN: &[&str] = &[
    "timeout_exceeded",
    "agent_timeout",
    "reference_missing",
    "eval_missing",
    "transport_ineligible",
];

/// One captured model call, reduced to the facts a server fault is read from.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct CapturedCall {
    pub status_code: Option<i64>,
    pub upstream_status_code: Option<i64>,
    pub error_category: Option<String>,
    pub failure_events: Vec<CallFailureEvent>,
    /// UTC Unix seconds.
    pub started_at: Option<f64>,
    pub duration_ms: Option<f64>,
}

/// A failure-report event of one call.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct CallFailureEvent {
    pub failure_kind: Option<String>,
    pub http_status: Option<i64>,
}

/// How far a failed request got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Delivery {
    NotSent,
    PossiblyDelivered,
    Delivered,
}

/// Which source the captured calls come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallSource {
    Projection,
    Capture,
    Trajectory,
}

fn reduce_call(call: &CallFacts, source: CallSource) -> CapturedCall {
    let (status, upstream, category) = match source {
        CallSource::Trajectory => match &call.metadata {
            Some((s, u, c)) => (s, u, c),
            None => (&Json::Absent, &Json::Absent, &Json::Absent),
        },
        _ => (
            &call.status_code,
            &call.upstream_status_code,
            &call.error_category,
        ),
    };
    let duration = match source {
        CallSource::Capture => call
            .duration_ms
            .as_number()
            .or_else(|| call.latency_total_ms.as_number()),
        _ => call.duration_ms.as_number(),
    };
    CapturedCall {
        status_code: status.as_int(),
        upstream_status_code: upstream.as_int(),
        error_category: category.as_str().map(str::to_owned),
        failure_events: call
            .failure_events
            .iter()
            .map(|e| CallFailureEvent {
                failure_kind: e.failure_kind.as_str().map(str::to_owned),
                http_status: e.http_status.as_int(),
            })
            .collect(),
        started_at: call.started_at.as_number(),
        duration_ms: duration,
    }
}

/// Python's `float(str)` for the forms that matter (surrounding whitespace, `inf`, `nan`, `_`).
fn python_float(text: &str) -> Option<f64> {
    let trimmed = text.trim();
    if trimmed.is_empty()
        || trimmed.starts_with('_')
        || trimmed.ends_with('_')
        || trimmed.contains("__")
    {
        return None;
    }
    let cleaned: String = trimmed.chars().filter(|&c| c != '_').collect();
    let lower = cleaned.to_ascii_lowercase();
    match lower.trim_start_matches(['+', '-']) {
        "inf" | "infinity" | "nan" => lower.parse().ok(),
        _ if cleaned
            .chars()
            .all(|c| c.is_ascii_digit() || ".eE+-".contains(c)) =>
        {
            cleaned.parse().ok()
        }
        _ => None,
    }
}

/// A candidate elapsed value converted like Python's `float()`.
fn elapsed_candidate(value: &Json) -> Option<f64> {
    let seconds = match value {
        Json::Int(_) | Json::Float(_) => value.as_number(),
        Json::Bool(b) => Some(if *b { 1.0 } else { 0.0 }),
        Json::Str(s) => python_float(s),
        _ => None,
    }?;
    (seconds > 0.0 && !seconds.is_nan()).then_some(seconds)
}

fn marked_no_generation(response: &ResponseFacts) -> bool {
    response.no_generation == Json::Bool(true)
}

/// A response object that counts as generation: at least one output item or a status.
fn is_generation(response: &ResponseFacts) -> bool {
    !marked_no_generation(response)
        && (matches!(response.output, Json::List { empty: false })
            || matches!(&response.status, Json::Str(s) if !s.is_empty()))
}

impl RowFacts {
    /// `captured_model_calls`: the collector's projection when the row is one, else
    /// `ng_model_call_capture.calls`, else `ng_trajectory.model_calls`, in capture order.
    pub fn captured_model_calls(&self) -> Vec<CapturedCall> {
        let (calls, source) = if let Some(calls) = self.collected_calls.list() {
            (calls, CallSource::Projection)
        } else if let Some(calls) = self.capture_calls.as_ref().and_then(|c| c.list()) {
            (calls, CallSource::Capture)
        } else if let Some(calls) = self.trajectory_calls.as_ref().and_then(|c| c.list()) {
            (calls, CallSource::Trajectory)
        } else {
            return Vec::new();
        };
        calls.iter().map(|c| reduce_call(c, source)).collect()
    }

    /// `observed_elapsed`: the first of `elapsed_seconds` and `response.metadata.elapsed_seconds`
    /// that converts to a float > 0.
    pub fn observed_elapsed(&self) -> Option<f64> {
        elapsed_candidate(&self.elapsed_seconds).or_else(|| {
            self.response
                .object()
                .and_then(|r| elapsed_candidate(&r.elapsed_seconds))
        })
    }

    /// `_material_model_call_faults` over already captured calls.
    fn material_faults(&self, calls: &[CapturedCall], policy: &ClassificationPolicy) -> bool {
        let faulted: Vec<bool> = calls
            .iter()
            .map(|c| is_server_fault_call(c, policy))
            .collect();
        if faulted.last() == Some(&true) {
            return true;
        }
        let fault_seconds: f64 = calls
            .iter()
            .zip(&faulted)
            .filter(|(_, f)| **f)
            .filter_map(|(c, _)| c.duration_ms)
            .sum::<f64>()
            / 1000.0;
        if fault_seconds <= 0.0 {
            return false;
        }
        self.call_window(calls).is_some_and(|window| {
            window > 0.0 && fault_seconds >= AGENT_TIMEOUT_FAULT_SHARE * window
        })
    }

    /// The attempt's window: its recorded elapsed time, else the span of its captured calls.
    fn call_window(&self, calls: &[CapturedCall]) -> Option<f64> {
        if let Some(elapsed) = self.observed_elapsed() {
            return Some(elapsed);
        }
        let start = calls
            .iter()
            .filter_map(|c| c.started_at)
            .fold(f64::INFINITY, f64::min);
        let end = calls
            .iter()
            .filter_map(|c| Some(c.started_at? + c.duration_ms.unwrap_or(0.0) / 1000.0))
            .fold(f64::NEG_INFINITY, f64::max);
        (start.is_finite() && end.is_finite() && end > start).then_some(end - start)
    }

    /// `_material_model_call_faults`: server-faulted calls own the window.
    pub fn material_model_call_faults(&self, policy: &ClassificationPolicy) -> bool {
        self.material_faults(&self.captured_model_calls(), policy)
    }

    /// The event the row selects as its final failure, when it selects one (`Some(None)`:
    /// selected but missing).
    fn selected_event(&self) -> Option<Option<&crate::facts::EventFacts>> {
        let selected = self.selected_failure_id.as_str()?;
        Some(
            self.failure_events
                .list()
                .unwrap_or_default()
                .iter()
                .find(|e| e.failure_id.as_str() == Some(selected)),
        )
    }

    /// The row's own kind: a result's `failure_kind`, a canonical record's kind (which may be
    /// absent), else the routing alias `_ng_failure_class`.
    pub fn row_own_kind(&self) -> Option<&str> {
        if let Some(kind) = self.failure_kind.as_str() {
            return Some(kind);
        }
        if let Some(failure) = self
            .failure_record
            .object()
            .and_then(|r| r.failure.as_ref())
        {
            return failure.failure_kind.as_str();
        }
        self.failure_class.as_str()
    }

    /// `_row_failure_kind`: the selected failure event's kind when the row selects one (`None`
    /// when that event is missing), else the row's own.
    pub fn row_failure_kind(&self) -> Option<&str> {
        match self.selected_event() {
            Some(event) => event.and_then(|e| e.failure_kind.as_str()),
            None => self.row_own_kind(),
        }
    }

    /// `failure_stage`: the stage of the selected final context; recovered observations never
    /// supply it.
    pub fn failure_stage(&self) -> Option<FailureStage> {
        let stage = match self.selected_event() {
            Some(event) => event.and_then(|e| e.stage.as_str()),
            None => self
                .failure_record
                .object()
                .and_then(|r| r.failure.as_ref())
                .and_then(|f| f.stage.as_str()),
        };
        stage.and_then(FailureStage::parse)
    }

    /// `_sandbox_or_tool_fault`: an eligible sandbox/session or tool-server event classified
    /// evaluation-side; cleanup and verification lie outside the agent's execution window.
    pub fn sandbox_or_tool_fault(&self, policy: &ClassificationPolicy) -> bool {
        self.failure_events
            .list()
            .unwrap_or_default()
            .iter()
            .any(|event| {
                let stage = event.stage.as_str().and_then(FailureStage::parse);
                let Some(kind) = event.failure_kind.as_str() else {
                    return false;
                };
                !matches!(
                    stage,
                    Some(FailureStage::Cleanup | FailureStage::Verification)
                ) && policy.sandbox_or_tool_kinds.iter().any(|k| k == kind)
                    && policy.classify(kind, stage) == FailureClass::Evaluation
            })
    }

    fn names_agent_timeout(&self) -> bool {
        self.row_failure_kind()
            .is_some_and(|k| shared_name(k) == "agent_timeout")
    }

    fn infrastructure_timeout_with(
        &self,
        calls: &[CapturedCall],
        policy: &ClassificationPolicy,
    ) -> bool {
        self.names_agent_timeout()
            && (self.sandbox_or_tool_fault(policy)
                || (calls.iter().any(|c| is_server_fault_call(c, policy))
                    && self.material_faults(calls, policy)))
    }

    /// `is_infrastructure_agent_timeout`: an `agent_timeout` whose window held a recorded
    /// server-side fault.
    pub fn is_infrastructure_agent_timeout(&self, policy: &ClassificationPolicy) -> bool {
        self.infrastructure_timeout_with(&self.captured_model_calls(), policy)
    }

    fn answered_deadline_with(
        &self,
        calls: &[CapturedCall],
        policy: &ClassificationPolicy,
    ) -> bool {
        self.names_agent_timeout()
            && (self.has_saved_generation() || self.keeps_partial_response())
            && !self.infrastructure_timeout_with(calls, policy)
    }

    /// `is_answered_agent_deadline`: the agent ran out of its own deadline and kept its answer.
    pub fn is_answered_agent_deadline(&self, policy: &ClassificationPolicy) -> bool {
        self.answered_deadline_with(&self.captured_model_calls(), policy)
    }

    /// `has_saved_generation`: retained response data, including a completed response with
    /// empty output.
    pub fn has_saved_generation(&self) -> bool {
        self.response.object().is_some_and(is_generation)
    }

    /// `holds_response`: a full or partial response object, usable or not.
    pub fn holds_response(&self) -> bool {
        self.response.object().is_some() || self.partial_response.object().is_some()
    }

    /// `keeps_partial_response`: a native cleanup's partial response, even without output.
    pub fn keeps_partial_response(&self) -> bool {
        self.partial_response
            .object()
            .is_some_and(|p| !marked_no_generation(p) && p.status.as_str() != Some("failed"))
    }

    /// `_keeps_saved_answer`: a projection's own flag, else a generation or partial response.
    pub fn keeps_saved_answer(&self) -> bool {
        match self.keeps_saved_answer {
            Json::Bool(flag) => flag,
            _ => self.has_saved_generation() || self.keeps_partial_response(),
        }
    }

    /// `has_recorded_grade`: the verifier finished grading this failed attempt.
    pub fn has_recorded_grade(&self) -> bool {
        self.recorded_grade.is_object()
    }

    /// A failure row's delivery (`_ng_failure_record.delivery`; no record: possibly delivered).
    pub fn delivery(&self) -> Delivery {
        match self
            .failure_record
            .object()
            .and_then(|r| r.delivery.as_str())
        {
            Some("not_sent") => Delivery::NotSent,
            Some("delivered") => Delivery::Delivered,
            _ => Delivery::PossiblyDelivered,
        }
    }

    /// A failure outcome (routed to the failures sidecar).
    pub fn is_failure_row(&self) -> bool {
        self.failure_class.is_present()
    }

    /// `has_unclassified_execution_failure`: a selected route failure names no owned cause that
    /// permits running the agent again.
    pub fn has_unclassified_execution_failure(&self) -> bool {
        if !self.is_failure_row() || self.row_failure_kind().is_some() {
            return false;
        }
        match self.delivery() {
            Delivery::NotSent => false,
            Delivery::PossiblyDelivered => self.holds_response(),
            Delivery::Delivered => true,
        }
    }

    /// `is_terminal_failure(record, retry_terminal_timeouts)`.
    pub fn is_terminal_failure(&self, retry_terminal_timeouts: bool) -> bool {
        let stamped = self.failure_terminal.truthy();
        if !retry_terminal_timeouts {
            return stamped;
        }
        match self.failure_class.as_str() {
            Some(class) if RETRYABLE_UNDER_TIMEOUT_OPT_IN.contains(&class) => false,
            Some("skipped") => true,
            _ => stamped,
        }
    }

    /// `applied_failure_class`: a class already applied to the result.
    pub fn applied_failure_class(&self) -> Option<FailureClass> {
        self.failure_class_applied
            .as_str()
            .and_then(FailureClass::parse)
    }

    /// `matches_failure_class(record, classes)`.
    pub fn matches_failure_class(&self, classes: &[&str]) -> bool {
        let record_kind = self
            .failure_record
            .object()
            .and_then(|r| r.failure.as_ref())
            .and_then(|f| f.failure_kind.as_str());
        [
            self.failure_kind.as_str(),
            record_kind,
            self.failure_class.as_str(),
        ]
        .into_iter()
        .flatten()
        .any(|name| classes.contains(&name) || classes.contains(&shared_name(name)))
    }

    /// The responsibility of a row's failure: an applied class first, else the policy's class of
    /// its selected kind at its stage.
    pub fn responsibility(&self, policy: &ClassificationPolicy) -> FailureClass {
        if let Some(applied) = self.applied_failure_class() {
            return applied;
        }
        self.row_failure_kind()
            .map_or(FailureClass::Unknown, |kind| {
                policy.classify(kind, self.failure_stage())
            })
    }

    /// `_masked_evaluation_side_kind`.
    pub fn masked_evaluation_side_kind(&self, policy: &ClassificationPolicy) -> Option<&str> {
        if !self.mask_sample.truthy()
            || self.is_failure_row()
            || self.omitted.truthy()
            || self.omitted_rollout.truthy()
            || self.rejudge.is_present()
        {
            return None;
        }
        let kind = self.failure_kind.as_str()?;
        if kind_status(kind) != KindStatus::Registered
            || MASKED_REGRADE_KINDS.contains(&kind)
            || kind.starts_with("transport_")
        {
            return None;
        }
        let class = self
            .applied_failure_class()
            .unwrap_or_else(|| policy.classify(kind, self.failure_stage()));
        (class == FailureClass::Evaluation).then_some(kind)
    }

    /// `masked_infrastructure_kind`: masked by infrastructure, no saved answer: retried.
    pub fn masked_infrastructure_kind(&self, policy: &ClassificationPolicy) -> Option<&str> {
        self.masked_evaluation_side_kind(policy)
            .filter(|_| !self.keeps_saved_answer())
    }

    /// `masked_kept_answer_kind`: masked, kept answer, no grade: rerun only when approved.
    pub fn masked_kept_answer_kind(&self, policy: &ClassificationPolicy) -> Option<&str> {
        self.masked_evaluation_side_kind(policy)
            .filter(|_| self.keeps_saved_answer() && !self.has_recorded_grade())
    }

    /// Whether the reward is a JSON number (never a bool).
    pub fn has_numeric_reward(&self) -> bool {
        self.reward.is_number()
    }

    /// An intentional omission (`_ng_omitted`, or a terminal `skipped`).
    pub fn is_omission(&self) -> bool {
        self.omitted.truthy()
            || (self.failure_class.as_str() == Some("skipped") && self.failure_terminal.truthy())
    }

    /// A judge failure of any spelling.
    pub fn is_judge_failure(&self) -> bool {
        self.matches_failure_class(&["judge_failed", "judge_unparseable", "judge_invalid"])
    }

    /// Answered-deadline and infrastructure-timeout verdicts sharing one capture of the calls.
    pub(crate) fn timeout_verdicts(
        &self,
        calls: &[CapturedCall],
        policy: &ClassificationPolicy,
    ) -> (bool, bool) {
        (
            self.infrastructure_timeout_with(calls, policy),
            self.answered_deadline_with(calls, policy),
        )
    }

    pub(crate) fn material_faults_with(
        &self,
        calls: &[CapturedCall],
        policy: &ClassificationPolicy,
    ) -> bool {
        self.material_faults(calls, policy)
    }
}

/// `is_server_fault_call(call)`: eligible recorded failures of one call classify
/// evaluation-side. Timeout, cancellation and truncated-stream evidence is not eligible.
pub fn is_server_fault_call(call: &CapturedCall, policy: &ClassificationPolicy) -> bool {
    if let Some(category) = &call.error_category
        && policy.server_fault_categories.contains(category)
    {
        return true;
    }
    let http_fault = |status: Option<i64>| {
        status.and_then(|s| policy.http_evidence(s)) == Some(HttpEvidence::Evaluation)
    };
    let timeout_category = call
        .error_category
        .as_ref()
        .is_some_and(|c| policy.non_material_categories.contains(c));
    if !timeout_category && (http_fault(call.status_code) || http_fault(call.upstream_status_code))
    {
        return true;
    }
    call.failure_events.iter().any(|event| {
        event
            .failure_kind
            .as_ref()
            .is_some_and(|k| policy.material_call_kinds.contains(k))
            || http_fault(event.http_status)
    })
}

/// `captured_model_calls(row)`.
pub fn captured_model_calls(row: &Value) -> Vec<CapturedCall> {
    RowFacts::from_value(row).captured_model_calls()
}

/// `observed_elapsed(record)`.
pub fn observed_elapsed(row: &Value) -> Option<f64> {
    RowFacts::from_value(row).observed_elapsed()
}

/// `_material_model_call_faults(row)`.
pub fn material_model_call_faults(row: &Value, policy: &ClassificationPolicy) -> bool {
    RowFacts::from_value(row).material_model_call_faults(policy)
}

/// `_row_failure_kind(row)`.
pub fn row_failure_kind(row: &Value) -> Option<String> {
    RowFacts::from_value(row)
        .row_failure_kind()
        .map(str::to_owned)
}

/// The row's own kind (see [`RowFacts::row_own_kind`]).
pub fn row_own_kind(row: &Value) -> Option<String> {
    RowFacts::from_value(row).row_own_kind().map(str::to_owned)
}

/// `failure_stage(row)`.
pub fn failure_stage(row: &Value) -> Option<FailureStage> {
    RowFacts::from_value(row).failure_stage()
}

/// `_sandbox_or_tool_fault(row)`.
pub fn sandbox_or_tool_fault(row: &Value, policy: &ClassificationPolicy) -> bool {
    RowFacts::from_value(row).sandbox_or_tool_fault(policy)
}

/// `is_infrastructure_agent_timeout(row)`.
pub fn is_infrastructure_agent_timeout(row: &Value, policy: &ClassificationPolicy) -> bool {
    RowFacts::from_value(row).is_infrastructure_agent_timeout(policy)
}

/// `is_answered_agent_deadline(row)`.
pub fn is_answered_agent_deadline(row: &Value, policy: &ClassificationPolicy) -> bool {
    RowFacts::from_value(row).is_answered_agent_deadline(policy)
}

/// `has_saved_generation(row)`.
pub fn has_saved_generation(row: &Value) -> bool {
    RowFacts::from_value(row).has_saved_generation()
}

/// `holds_response(row)`.
pub fn holds_response(row: &Value) -> bool {
    RowFacts::from_value(row).holds_response()
}

/// `keeps_partial_response(row)`.
pub fn keeps_partial_response(row: &Value) -> bool {
    RowFacts::from_value(row).keeps_partial_response()
}

/// `_keeps_saved_answer(row)`.
pub fn keeps_saved_answer(row: &Value) -> bool {
    RowFacts::from_value(row).keeps_saved_answer()
}

/// `has_recorded_grade(row)`.
pub fn has_recorded_grade(row: &Value) -> bool {
    RowFacts::from_value(row).has_recorded_grade()
}

/// A failure row's delivery.
pub fn delivery(row: &Value) -> Delivery {
    RowFacts::from_value(row).delivery()
}

/// Whether the row is a failure outcome.
pub fn is_failure_row(row: &Value) -> bool {
    RowFacts::from_value(row).is_failure_row()
}

/// `has_unclassified_execution_failure(row)`.
pub fn has_unclassified_execution_failure(row: &Value) -> bool {
    RowFacts::from_value(row).has_unclassified_execution_failure()
}

/// `is_terminal_failure(record, retry_terminal_timeouts)`.
pub fn is_terminal_failure(row: &Value, retry_terminal_timeouts: bool) -> bool {
    RowFacts::from_value(row).is_terminal_failure(retry_terminal_timeouts)
}

/// `applied_failure_class(row)`.
pub fn applied_failure_class(row: &Value) -> Option<FailureClass> {
    RowFacts::from_value(row).applied_failure_class()
}

/// `matches_failure_class(record, classes)`.
pub fn matches_failure_class(row: &Value, classes: &[&str]) -> bool {
    RowFacts::from_value(row).matches_failure_class(classes)
}

/// The responsibility of a row's failure.
pub fn responsibility(row: &Value, policy: &ClassificationPolicy) -> FailureClass {
    RowFacts::from_value(row).responsibility(policy)
}

/// `_masked_evaluation_side_kind(row)`.
pub fn masked_evaluation_side_kind(row: &Value, policy: &ClassificationPolicy) -> Option<String> {
    RowFacts::from_value(row)
        .masked_evaluation_side_kind(policy)
        .map(str::to_owned)
}

/// `masked_infrastructure_kind(row)`.
pub fn masked_infrastructure_kind(row: &Value, policy: &ClassificationPolicy) -> Option<String> {
    RowFacts::from_value(row)
        .masked_infrastructure_kind(policy)
        .map(str::to_owned)
}

/// `masked_kept_answer_kind(row)`.
pub fn masked_kept_answer_kind(row: &Value, policy: &ClassificationPolicy) -> Option<String> {
    RowFacts::from_value(row)
        .masked_kept_answer_kind(policy)
        .map(str::to_owned)
}

/// `has_only_intentional_gaps(expected, completed, intentionally_omitted)`: omissions are
/// accepted only alongside completed tasks, without inventing scores.
pub fn has_only_intentional_gaps(
    expected: u64,
    completed: u64,
    intentionally_omitted: u64,
) -> bool {
    completed > 0 && completed + intentionally_omitted == expected
}

/// Whether a row's reward is a JSON number (never a bool).
pub fn has_numeric_reward(row: &Value) -> bool {
    RowFacts::from_value(row).has_numeric_reward()
}
