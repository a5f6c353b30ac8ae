//! The row predicates of `nemo_gym.rollouts.rollout_recovery` (facts §15, decisions §7), as pure
//! functions over saved result and failure rows.
//!
//! Invariants: any JSON value is accepted as a row (a non-object simply has none of the fields);
//! nothing panics; a saved answer is never treated as re-runnable; timeouts, cancellations and
//! truncated streams never establish time spent on infrastructure. Field names the reference does
//! not publish are those of decisions §7.

use crate::failure::{ClassificationPolicy, FailureClass, FailureStage, HttpEvidence, shared_name};
use serde_json::Value;

/// `AGENT_TIMEOUT_FAULT_SHARE`: server-faulted calls owning this share of the window make an
/// agent timeout the evaluation's failure.
pub const AGENT_TIMEOUT_FAULT_SHARE: f64 = 0.25;
/// `COLLECTED_MODEL_CALLS_KEY`: a collector projection's captured calls.
pub const COLLECTED_MODEL_CALLS_KEY: &str = "_ng_collected_model_calls";
/// Applied responsibility class on a result.
pub const APPLIED_CLASS_KEY: &str = "_ng_failure_class_applied";
/// A collector projection's own kept-answer flag.
pub const KEEPS_SAVED_ANSWER_KEY: &str = "_ng_keeps_saved_answer";
/// The verifier's durable record of a completed grading.
pub const RECORDED_GRADE_KEY: &str = "_ng_recorded_grade";
/// Failure events of a row and the selected one.
pub const FAILURE_EVENTS_KEY: &str = "ng_failure_events";
pub const SELECTED_FAILURE_KEY: &str = "_ng_selected_failure_id";
/// Kinds whose masked result is graded again from the saved answer (`_MASKED_REGRADE_KINDS`).
pub const MASKED_REGRADE_KINDS: &[&str] =
    &["judge_failed", "judge_unparseable", "agent_route_failed"];

fn get<'v>(row: &'v Value, key: &str) -> Option<&'v Value> {
    row.as_object()?.get(key).filter(|v| !v.is_null())
}

fn get_str<'v>(row: &'v Value, key: &str) -> Option<&'v str> {
    get(row, key)?.as_str()
}

fn truthy(value: Option<&Value>) -> bool {
    value.is_some_and(crate::identity::truthy)
}

/// A JSON number as `f64` (booleans are not numbers here).
fn number(value: Option<&Value>) -> Option<f64> {
    match value? {
        Value::Number(n) => n.to_string().parse().ok(),
        _ => None,
    }
}

/// A JSON integer (never a bool or float).
fn integer(value: Option<&Value>) -> Option<i64> {
    match value? {
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

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

/// `captured_model_calls(row)`: the collector's projection when the row is one, else
/// `ng_model_call_capture.calls`, else `ng_trajectory.model_calls`, in capture order.
pub fn captured_model_calls(row: &Value) -> Vec<CapturedCall> {
    if let Some(Value::Array(calls)) = get(row, COLLECTED_MODEL_CALLS_KEY) {
        return calls
            .iter()
            .map(|c| reduce_call(c, c, &["duration_ms"]))
            .collect();
    }
    if let Some(Value::Array(calls)) =
        get(row, "ng_model_call_capture").and_then(|c| get(c, "calls"))
    {
        return calls
            .iter()
            .map(|c| reduce_call(c, c, &["duration_ms", "latency_total_ms"]))
            .collect();
    }
    if let Some(Value::Array(calls)) = get(row, "ng_trajectory").and_then(|t| get(t, "model_calls"))
    {
        return calls
            .iter()
            .map(|c| {
                let metadata = get(c, "response_metadata").unwrap_or(&Value::Null);
                reduce_call(c, metadata, &["duration_ms"])
            })
            .collect();
    }
    Vec::new()
}

fn reduce_call(call: &Value, status_source: &Value, duration_keys: &[&str]) -> CapturedCall {
    let events = match get(call, "failure_events") {
        Some(Value::Array(events)) => events
            .iter()
            .map(|e| CallFailureEvent {
                failure_kind: get_str(e, "failure_kind").map(str::to_owned),
                http_status: integer(get(e, "http_status")),
            })
            .collect(),
        _ => Vec::new(),
    };
    CapturedCall {
        status_code: integer(get(status_source, "status_code")),
        upstream_status_code: integer(get(status_source, "upstream_status_code")),
        error_category: get_str(status_source, "error_category").map(str::to_owned),
        failure_events: events,
        started_at: number(get(call, "started_at")),
        duration_ms: duration_keys.iter().find_map(|k| number(get(call, k))),
    }
}

/// `is_server_fault_call(call)`: eligible recorded failures of one call classify
/// evaluation-side. Timeout, cancellation and truncated-stream evidence is not eligible.
pub fn is_server_fault_call(call: &CapturedCall, policy: &ClassificationPolicy) -> bool {
    if let Some(category) = &call.error_category {
        if policy.server_fault_categories.contains(category) {
            return true;
        }
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

/// `observed_elapsed(record)`: the first of `elapsed_seconds` and `response.metadata.elapsed_seconds`
/// that converts to a float > 0 (numbers or numeric strings, like Python's `float()`).
pub fn observed_elapsed(row: &Value) -> Option<f64> {
    let candidates = [
        get(row, "elapsed_seconds"),
        get(row, "response")
            .and_then(|r| get(r, "metadata"))
            .and_then(|m| get(m, "elapsed_seconds")),
    ];
    candidates.into_iter().flatten().find_map(|candidate| {
        let value = match candidate {
            Value::Number(n) => n.to_string().parse::<f64>().ok(),
            Value::Bool(b) => Some(if *b { 1.0 } else { 0.0 }),
            Value::String(s) => python_float(s),
            _ => None,
        }?;
        (value > 0.0 && !value.is_nan()).then_some(value)
    })
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
    match cleaned.to_ascii_lowercase().trim_start_matches(['+', '-']) {
        "inf" | "infinity" | "nan" => cleaned.to_ascii_lowercase().parse().ok(),
        _ => cleaned.parse().ok().filter(|_| {
            cleaned
                .chars()
                .all(|c| c.is_ascii_digit() || ".eE+-".contains(c))
        }),
    }
}

/// The window of an attempt: its recorded elapsed time, else the span of its captured calls.
fn call_window(row: &Value, calls: &[CapturedCall]) -> Option<f64> {
    if let Some(elapsed) = observed_elapsed(row) {
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

/// `_material_model_call_faults(row)`: server-faulted calls own the window: the agent's last call
/// faulted, or faulted calls took at least [`AGENT_TIMEOUT_FAULT_SHARE`] of it.
pub fn material_model_call_faults(row: &Value, policy: &ClassificationPolicy) -> bool {
    let calls = captured_model_calls(row);
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
    call_window(row, &calls)
        .is_some_and(|window| window > 0.0 && fault_seconds >= AGENT_TIMEOUT_FAULT_SHARE * window)
}

/// One recorded failure event of a row (`ng_failure_events`).
#[derive(Debug, Clone, PartialEq)]
pub struct FailureEvent {
    pub failure_id: Option<String>,
    pub failure_kind: Option<String>,
    pub stage: Option<FailureStage>,
    pub http_status: Option<i64>,
}

fn failure_events(row: &Value) -> Vec<FailureEvent> {
    match get(row, FAILURE_EVENTS_KEY) {
        Some(Value::Array(events)) => events
            .iter()
            .map(|e| FailureEvent {
                failure_id: get_str(e, "failure_id").map(str::to_owned),
                failure_kind: get_str(e, "failure_kind").map(str::to_owned),
                stage: get_str(e, "stage").and_then(FailureStage::parse),
                http_status: integer(get(e, "http_status")),
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The event the row selects as its final failure, when it selects one (`Some(None)`: selected
/// but missing).
fn selected_event(row: &Value) -> Option<Option<FailureEvent>> {
    let selected = get_str(row, SELECTED_FAILURE_KEY)?;
    Some(
        failure_events(row)
            .into_iter()
            .find(|e| e.failure_id.as_deref() == Some(selected)),
    )
}

/// The canonical failure record's `failure` mapping, when the row has one.
fn record_failure(row: &Value) -> Option<&Value> {
    get(row, "_ng_failure_record").and_then(|r| get(r, "failure"))
}

/// The row's own kind: a result's `failure_kind`, a canonical record's kind (which may be
/// absent), else the routing alias `_ng_failure_class`.
pub fn row_own_kind(row: &Value) -> Option<String> {
    if let Some(kind) = get_str(row, "failure_kind") {
        return Some(kind.to_owned());
    }
    if let Some(failure) = record_failure(row) {
        return get_str(failure, "failure_kind").map(str::to_owned);
    }
    get_str(row, "_ng_failure_class").map(str::to_owned)
}

/// `_row_failure_kind(row)`: the selected failure event's kind when the row selects one (`None`
/// when that event is missing), else the row's own.
pub fn row_failure_kind(row: &Value) -> Option<String> {
    match selected_event(row) {
        Some(event) => event.and_then(|e| e.failure_kind),
        None => row_own_kind(row),
    }
}

/// `failure_stage(row)`: the stage of the selected final context; recovered observations never
/// supply it.
pub fn failure_stage(row: &Value) -> Option<FailureStage> {
    match selected_event(row) {
        Some(event) => event.and_then(|e| e.stage),
        None => record_failure(row)
            .and_then(|f| get_str(f, "stage"))
            .and_then(FailureStage::parse),
    }
}

/// `_sandbox_or_tool_fault(row)`: an eligible sandbox/session or tool-server event classified
/// evaluation-side. Cleanup and verification lie outside the agent's execution window.
pub fn sandbox_or_tool_fault(row: &Value, policy: &ClassificationPolicy) -> bool {
    failure_events(row).iter().any(|event| {
        let eligible_stage = !matches!(
            event.stage,
            Some(FailureStage::Cleanup | FailureStage::Verification)
        );
        let Some(kind) = &event.failure_kind else {
            return false;
        };
        eligible_stage
            && policy.sandbox_or_tool_kinds.contains(kind)
            && policy.classify(kind, event.stage) == FailureClass::Evaluation
    })
}

fn names_agent_timeout(row: &Value) -> bool {
    row_failure_kind(row).is_some_and(|k| shared_name(&k) == "agent_timeout")
}

/// `is_infrastructure_agent_timeout(row)`: an `agent_timeout` whose window held a recorded
/// server-side fault: the evaluation's failure.
pub fn is_infrastructure_agent_timeout(row: &Value, policy: &ClassificationPolicy) -> bool {
    names_agent_timeout(row)
        && (sandbox_or_tool_fault(row, policy)
            || (captured_model_calls(row)
                .iter()
                .any(|c| is_server_fault_call(c, policy))
                && material_model_call_faults(row, policy)))
}

/// `is_answered_agent_deadline(row)`: the agent ran out of its own deadline and kept its answer:
/// the evaluated model's final result, never run again.
pub fn is_answered_agent_deadline(row: &Value, policy: &ClassificationPolicy) -> bool {
    names_agent_timeout(row)
        && (has_saved_generation(row) || keeps_partial_response(row))
        && !is_infrastructure_agent_timeout(row, policy)
}

fn marked_no_generation(response: &Value) -> bool {
    get(response, "metadata").and_then(|m| get(m, "ng_no_generation")) == Some(&Value::Bool(true))
}

/// Whether a response object counts as generation: at least one output item or a status.
fn is_generation(response: &Value) -> bool {
    let Value::Object(_) = response else {
        return false;
    };
    if marked_no_generation(response) {
        return false;
    }
    let has_output =
        matches!(get(response, "output"), Some(Value::Array(items)) if !items.is_empty());
    let has_status = matches!(get(response, "status"), Some(Value::String(s)) if !s.is_empty());
    has_output || has_status
}

/// `has_saved_generation(row)`: retained response data, including a completed response with
/// empty output; a diagnostic error object, an empty mapping, a placeholder and a
/// no-generation response are not.
pub fn has_saved_generation(row: &Value) -> bool {
    get(row, "response").is_some_and(is_generation)
}

/// `holds_response(row)`: the row keeps a full or partial response object, usable or not.
pub fn holds_response(row: &Value) -> bool {
    get(row, "response").is_some_and(Value::is_object)
        || get(row, "_ng_failure_partial_response").is_some_and(Value::is_object)
}

/// `keeps_partial_response(row)`: a native cleanup's partial response, even without output; an
/// agent-stage response the outcome policy rejected as failed is diagnostic only.
pub fn keeps_partial_response(row: &Value) -> bool {
    get(row, "_ng_failure_partial_response").is_some_and(|partial| {
        partial.is_object()
            && !marked_no_generation(partial)
            && get_str(partial, "status") != Some("failed")
    })
}

/// `_keeps_saved_answer(row)`: a collector projection's own flag, else a retained generation or
/// native partial response.
pub fn keeps_saved_answer(row: &Value) -> bool {
    match get(row, KEEPS_SAVED_ANSWER_KEY) {
        Some(Value::Bool(flag)) => *flag,
        _ => has_saved_generation(row) || keeps_partial_response(row),
    }
}

/// `has_recorded_grade(row)`: the verifier finished grading this failed attempt.
pub fn has_recorded_grade(row: &Value) -> bool {
    get(row, RECORDED_GRADE_KEY).is_some_and(Value::is_object)
}

/// How far a failed request got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Delivery {
    NotSent,
    PossiblyDelivered,
    Delivered,
}

/// A failure row's delivery (`_ng_failure_record.delivery`; absent record: possibly delivered).
pub fn delivery(row: &Value) -> Delivery {
    match get(row, "_ng_failure_record").and_then(|r| get_str(r, "delivery")) {
        Some("not_sent") => Delivery::NotSent,
        Some("delivered") => Delivery::Delivered,
        _ => Delivery::PossiblyDelivered,
    }
}

/// Whether the row is a failure outcome (routed to the failures sidecar).
pub fn is_failure_row(row: &Value) -> bool {
    get(row, "_ng_failure_class").is_some()
}

/// `has_unclassified_execution_failure(row)`: a selected route failure names no owned cause
/// that permits running the agent again. A possibly delivered request permits a fresh run only
/// while the row keeps no full or partial response.
pub fn has_unclassified_execution_failure(row: &Value) -> bool {
    if !is_failure_row(row) || row_failure_kind(row).is_some() {
        return false;
    }
    match delivery(row) {
        Delivery::NotSent => false,
        Delivery::PossiblyDelivered => holds_response(row),
        Delivery::Delivered => true,
    }
}

/// `is_terminal_failure(record, retry_terminal_timeouts)`: whether a persisted failure is gated
/// on resume. Under the opt-in, timeouts and repairable environment faults stay retryable and a
/// skipped sample stays terminal.
pub fn is_terminal_failure(row: &Value, retry_terminal_timeouts: bool) -> bool {
    let stamped = truthy(get(row, "_ng_failure_terminal"));
    if !retry_terminal_timeouts {
        return stamped;
    }
    match get_str(row, "_ng_failure_class") {
        Some(
            "timeout_exceeded"
            | "agent_timeout"
            | "reference_missing"
            | "eval_missing"
            | "transport_ineligible",
        ) => false,
        Some("skipped") => true,
        _ => stamped,
    }
}

/// `applied_failure_class(row)`: a class already applied to the result (an explicit `unknown`
/// is kept over later configuration).
pub fn applied_failure_class(row: &Value) -> Option<FailureClass> {
    get_str(row, APPLIED_CLASS_KEY).and_then(FailureClass::parse)
}

/// `matches_failure_class(record, classes)`: the shared failure name or the retained producer
/// routing name is one of `classes`.
pub fn matches_failure_class(row: &Value, classes: &[&str]) -> bool {
    let names = [
        get_str(row, "failure_kind"),
        record_failure(row).and_then(|f| get_str(f, "failure_kind")),
        get_str(row, "_ng_failure_class"),
    ];
    names
        .into_iter()
        .flatten()
        .any(|name| classes.contains(&name) || classes.contains(&shared_name(name)))
}

/// The responsibility of a row's failure: an applied class first, else the policy's class of
/// its selected kind at its stage.
pub fn responsibility(row: &Value, policy: &ClassificationPolicy) -> FailureClass {
    if let Some(applied) = applied_failure_class(row) {
        return applied;
    }
    row_failure_kind(row).map_or(FailureClass::Unknown, |kind| {
        policy.classify(&kind, failure_stage(row))
    })
}

/// `_masked_evaluation_side_kind(row)`: the evaluation-side kind of a masked result not set aside
/// for another owner (not a failure row, omitted stand-in or re-judgment; registered,
/// evaluation-side, not graded again from the saved answer, not a `transport_*` verify call).
pub fn masked_evaluation_side_kind(row: &Value, policy: &ClassificationPolicy) -> Option<String> {
    if !truthy(get(row, "mask_sample"))
        || is_failure_row(row)
        || truthy(get(row, "_ng_omitted"))
        || truthy(get(row, "_ng_omitted_rollout"))
        || get(row, "_ng_rejudge").is_some()
    {
        return None;
    }
    let kind = get_str(row, "failure_kind")?;
    if crate::failure::kind_status(kind) != crate::failure::KindStatus::Registered
        || MASKED_REGRADE_KINDS.contains(&kind)
        || kind.starts_with("transport_")
    {
        return None;
    }
    let class =
        applied_failure_class(row).unwrap_or_else(|| policy.classify(kind, failure_stage(row)));
    (class == FailureClass::Evaluation).then(|| kind.to_owned())
}

/// `masked_infrastructure_kind(row)`: the kind of a masked result that infrastructure left
/// unmeasured and that holds no saved answer: retried within the attempt cap.
pub fn masked_infrastructure_kind(row: &Value, policy: &ClassificationPolicy) -> Option<String> {
    masked_evaluation_side_kind(row, policy).filter(|_| !keeps_saved_answer(row))
}

/// `masked_kept_answer_kind(row)`: the kind of a masked evaluation-side result rejected only for
/// its saved answer and without a recorded grade: eligible for an operator-approved rerun.
pub fn masked_kept_answer_kind(row: &Value, policy: &ClassificationPolicy) -> Option<String> {
    masked_evaluation_side_kind(row, policy)
        .filter(|_| keeps_saved_answer(row) && !has_recorded_grade(row))
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
    matches!(get(row, "reward"), Some(Value::Number(_)))
}
