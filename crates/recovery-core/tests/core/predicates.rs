//! Row predicates: both outcomes of every rule, the 0.25 boundary, an early recovered fault in a
//! long window, stage-dependent OOM; and no row of arbitrary JSON makes any predicate panic.

use proptest::prelude::*;
use recovery_core::failure::{
    ClassificationPolicy, FailureClass, FailureStage, KindStatus, kind_status,
};
use recovery_core::plan::{RowVerdict, classify_row};
use recovery_core::predicates::*;
use serde_json::{Value, json};

fn policy() -> ClassificationPolicy {
    ClassificationPolicy::default()
}

fn call(category: Option<&str>, status: Option<i64>, started_at: f64, duration_ms: f64) -> Value {
    json!({"error_category": category, "status_code": status, "started_at": started_at, "duration_ms": duration_ms})
}

fn timeout_row(calls: Vec<Value>, elapsed: Option<f64>, answered: bool) -> Value {
    let mut row = json!({"_ng_failure_class": "agent_timeout", "_ng_failure_terminal": false, "_ng_collected_model_calls": calls});
    if let Some(e) = elapsed {
        row["elapsed_seconds"] = json!(e);
    }
    if answered {
        row["_ng_failure_partial_response"] =
            json!({"output": [{"type": "message"}], "status": "incomplete"});
    }
    row
}

#[test]
fn a_call_is_a_server_fault_only_on_eligible_evidence() {
    let p = policy();
    let table: Vec<(&str, Value, bool)> = vec![
        (
            "upstream_error category",
            call(Some("upstream_error"), None, 0.0, 1.0),
            true,
        ),
        (
            "connection category",
            call(Some("connection"), None, 0.0, 1.0),
            true,
        ),
        ("HTTP 503", call(None, Some(503), 0.0, 1.0), true),
        ("HTTP 429", call(None, Some(429), 0.0, 1.0), true),
        (
            "HTTP 504 is a timeout",
            call(None, Some(504), 0.0, 1.0),
            false,
        ),
        (
            "HTTP 408 is a timeout",
            call(None, Some(408), 0.0, 1.0),
            false,
        ),
        (
            "HTTP 400 is the model's",
            call(None, Some(400), 0.0, 1.0),
            false,
        ),
        (
            "timeout category",
            call(Some("timeout"), None, 0.0, 1.0),
            false,
        ),
        (
            "timeout category with a 500 status",
            call(Some("timeout"), Some(500), 0.0, 1.0),
            false,
        ),
        ("cancelled", call(Some("cancelled"), None, 0.0, 1.0), false),
        (
            "truncated stream",
            call(Some("stream_truncated"), None, 0.0, 1.0),
            false,
        ),
        ("a clean call", call(None, Some(200), 0.0, 1.0), false),
        (
            "a material failure event",
            json!({"failure_events": [{"failure_kind": "model_server_error"}]}),
            true,
        ),
        (
            "a timeout failure event",
            json!({"failure_events": [{"failure_kind": "transport_timeout"}]}),
            false,
        ),
        (
            "an upstream status",
            json!({"upstream_status_code": 502}),
            true,
        ),
    ];
    for (name, call, expected) in table {
        let row = json!({"_ng_collected_model_calls": [call]});
        let calls = captured_model_calls(&row);
        assert_eq!(is_server_fault_call(&calls[0], &p), expected, "{name}");
    }
}

#[test]
fn captured_calls_come_from_the_projection_then_the_capture_then_the_trajectory() {
    let projection = json!({"_ng_collected_model_calls": [{"status_code": 500, "duration_ms": 5}], "ng_model_call_capture": {"calls": [{}, {}]}});
    assert_eq!(captured_model_calls(&projection).len(), 1);
    let capture = json!({"ng_model_call_capture": {"calls": [{"status_code": 502, "latency_total_ms": 40, "started_at": 10.5}]}, "ng_trajectory": {"model_calls": [{}]}});
    let calls = captured_model_calls(&capture);
    assert_eq!(
        (
            calls[0].status_code,
            calls[0].duration_ms,
            calls[0].started_at
        ),
        (Some(502), Some(40.0), Some(10.5))
    );
    let trajectory = json!({"ng_trajectory": {"model_calls": [{"started_at": 1, "duration_ms": 2, "response_metadata": {"error_category": "connection"}}]}});
    assert_eq!(
        captured_model_calls(&trajectory)[0]
            .error_category
            .as_deref(),
        Some("connection")
    );
    assert!(captured_model_calls(&json!({"reward": 1})).is_empty());
}

#[test]
fn faulted_calls_own_the_window_at_a_quarter_of_it_or_as_the_last_call() {
    let p = policy();
    let clean = |t: f64| call(None, Some(200), t, 1000.0);
    let table: Vec<(&str, Value, bool)> = vec![
        (
            "the last call faulted",
            timeout_row(
                vec![clean(0.0), call(Some("upstream_error"), None, 1.0, 10.0)],
                Some(100.0),
                false,
            ),
            true,
        ),
        (
            "faults exactly 25% of the window",
            timeout_row(
                vec![
                    call(Some("upstream_error"), None, 0.0, 25_000.0),
                    clean(30.0),
                ],
                Some(100.0),
                false,
            ),
            true,
        ),
        (
            "faults just under 25%",
            timeout_row(
                vec![
                    call(Some("upstream_error"), None, 0.0, 24_999.0),
                    clean(30.0),
                ],
                Some(100.0),
                false,
            ),
            false,
        ),
        (
            "an early recovered fault in a long window",
            timeout_row(
                vec![
                    call(Some("connection"), None, 0.0, 2_000.0),
                    clean(5.0),
                    clean(60.0),
                ],
                Some(600.0),
                false,
            ),
            false,
        ),
        (
            "no elapsed: the span of the calls is the window",
            timeout_row(
                vec![call(Some("upstream_error"), None, 0.0, 3_000.0), clean(3.0)],
                None,
                false,
            ),
            true,
        ),
        (
            "no faulted call",
            timeout_row(vec![clean(0.0), clean(1.0)], Some(10.0), false),
            false,
        ),
        (
            "timeouts never establish time spent on infrastructure",
            timeout_row(
                vec![call(Some("timeout"), None, 0.0, 90_000.0)],
                Some(100.0),
                false,
            ),
            false,
        ),
    ];
    for (name, row, expected) in table {
        assert_eq!(material_model_call_faults(&row, &p), expected, "{name}");
    }
}

#[test]
fn agent_timeouts_are_infrastructure_only_with_a_material_server_fault_or_sandbox_fault() {
    let p = policy();
    let faulted_last = timeout_row(
        vec![call(Some("upstream_error"), None, 0.0, 10.0)],
        Some(100.0),
        true,
    );
    let clean = timeout_row(vec![call(None, Some(200), 0.0, 10.0)], Some(100.0), true);
    let mut sandbox_seed_oom = clean.clone();
    sandbox_seed_oom["ng_failure_events"] =
        json!([{"failure_id": "e1", "failure_kind": "provider_oom_killed", "stage": "seed"}]);
    let mut sandbox_agent_oom = clean.clone();
    sandbox_agent_oom["ng_failure_events"] =
        json!([{"failure_id": "e1", "failure_kind": "provider_oom_killed", "stage": "agent"}]);
    let mut session_in_cleanup = clean.clone();
    session_in_cleanup["ng_failure_events"] =
        json!([{"failure_id": "e1", "failure_kind": "session_lost", "stage": "cleanup"}]);
    let mut session_lost = clean.clone();
    session_lost["ng_failure_events"] =
        json!([{"failure_id": "e1", "failure_kind": "session_lost", "stage": "agent"}]);
    let not_a_timeout = json!({"_ng_failure_class": "agent_run_error", "_ng_collected_model_calls": [{"error_category": "upstream_error"}]});
    let table = [
        ("last call faulted", &faulted_last, true, false),
        ("clean timeout with an answer", &clean, false, true),
        (
            "seed OOM is the evaluation's",
            &sandbox_seed_oom,
            true,
            false,
        ),
        (
            "agent OOM stays the model's",
            &sandbox_agent_oom,
            false,
            true,
        ),
        (
            "cleanup lies outside the window",
            &session_in_cleanup,
            false,
            true,
        ),
        ("lost session during the agent", &session_lost, true, false),
        ("not an agent timeout", &not_a_timeout, false, false),
    ];
    for (name, row, infrastructure, answered) in table {
        assert_eq!(
            is_infrastructure_agent_timeout(row, &p),
            infrastructure,
            "{name}: infrastructure"
        );
        assert_eq!(
            is_answered_agent_deadline(row, &p),
            answered,
            "{name}: answered deadline"
        );
    }
    let unanswered = timeout_row(vec![], Some(10.0), false);
    assert!(
        !is_answered_agent_deadline(&unanswered, &p),
        "a timeout that kept no answer keeps its retry policy"
    );
    let legacy = json!({"_ng_failure_class": "timeout_exceeded", "response": {"output": [{}], "status": "incomplete"}});
    assert!(
        is_answered_agent_deadline(&legacy, &p),
        "timeout_exceeded is the legacy name of agent_timeout"
    );
}

#[test]
fn the_selected_failure_event_supplies_kind_and_stage() {
    let row = json!({
        "failure_kind": "verifier_error",
        "ng_failure_events": [
            {"failure_id": "a", "failure_kind": "session_lost", "stage": "seed"},
            {"failure_id": "b", "failure_kind": "agent_timeout", "stage": "agent"}
        ],
        "_ng_selected_failure_id": "b"
    });
    assert_eq!(row_failure_kind(&row).as_deref(), Some("agent_timeout"));
    assert_eq!(failure_stage(&row), Some(FailureStage::Agent));
    let missing = json!({"failure_kind": "verifier_error", "ng_failure_events": [], "_ng_selected_failure_id": "zz"});
    assert_eq!(
        row_failure_kind(&missing),
        None,
        "a selected event that is missing names no kind"
    );
    let unselected = json!({"failure_kind": "verifier_error", "ng_failure_events": [{"failure_id": "a", "stage": "seed"}]});
    assert_eq!(
        row_failure_kind(&unselected).as_deref(),
        Some("verifier_error")
    );
    assert_eq!(
        failure_stage(&unselected),
        None,
        "recovered observations never supply the final stage"
    );
    let record = json!({"_ng_failure_class": "x", "_ng_failure_record": {"failure": {"failure_kind": "provider_oom_killed", "stage": "seed"}}});
    assert_eq!(
        (row_failure_kind(&record).as_deref(), failure_stage(&record)),
        (Some("provider_oom_killed"), Some(FailureStage::Seed))
    );
}

#[test]
fn saved_generation_and_kept_answers_follow_their_rules() {
    let table: Vec<(&str, Value, bool, bool, bool)> = vec![
        // (name, row, has_saved_generation, holds_response, keeps_saved_answer)
        (
            "output items",
            json!({"response": {"output": [{"type": "message"}]}}),
            true,
            true,
            true,
        ),
        (
            "completed with empty output",
            json!({"response": {"output": [], "status": "completed"}}),
            true,
            true,
            true,
        ),
        (
            "placeholder without output or status",
            json!({"response": {"output": []}}),
            false,
            true,
            false,
        ),
        ("empty mapping", json!({"response": {}}), false, true, false),
        (
            "diagnostic error object",
            json!({"response": {"error": "boom"}}),
            false,
            true,
            false,
        ),
        (
            "no-generation marker",
            json!({"response": {"output": [{}], "status": "completed", "metadata": {"ng_no_generation": true}}}),
            false,
            true,
            false,
        ),
        (
            "partial response without output",
            json!({"_ng_failure_partial_response": {"output": []}}),
            false,
            true,
            true,
        ),
        (
            "partial response rejected as failed",
            json!({"_ng_failure_partial_response": {"output": [{}], "status": "failed"}}),
            false,
            true,
            false,
        ),
        (
            "diagnostic producer response",
            json!({"_ng_failure_response": {"output": [{}], "status": "completed"}}),
            false,
            false,
            false,
        ),
        (
            "projection flag wins",
            json!({"response": {"output": [{}]}, "_ng_keeps_saved_answer": false}),
            true,
            true,
            false,
        ),
        (
            "no response at all",
            json!({"reward": 1.0}),
            false,
            false,
            false,
        ),
    ];
    for (name, row, generation, holds, keeps) in table {
        assert_eq!(
            has_saved_generation(&row),
            generation,
            "{name}: has_saved_generation"
        );
        assert_eq!(holds_response(&row), holds, "{name}: holds_response");
        assert_eq!(
            keeps_saved_answer(&row),
            keeps,
            "{name}: keeps_saved_answer"
        );
    }
    assert!(keeps_partial_response(
        &json!({"_ng_failure_partial_response": {}})
    ));
    assert!(!keeps_partial_response(
        &json!({"_ng_failure_partial_response": null})
    ));
    assert!(has_recorded_grade(
        &json!({"_ng_recorded_grade": {"score": 0}})
    ));
    assert!(!has_recorded_grade(&json!({"_ng_recorded_grade": null})));
    assert!(!has_recorded_grade(&json!({"_ng_recorded_grade": 1})));
}

#[test]
fn terminal_failures_and_the_timeout_opt_in() {
    let table = [
        (
            json!({"_ng_failure_class": "timeout_exceeded", "_ng_failure_terminal": true}),
            true,
            false,
        ),
        (
            json!({"_ng_failure_class": "agent_timeout", "_ng_failure_terminal": true}),
            true,
            false,
        ),
        (
            json!({"_ng_failure_class": "reference_missing", "_ng_failure_terminal": true}),
            true,
            false,
        ),
        (
            json!({"_ng_failure_class": "skipped", "_ng_failure_terminal": false}),
            false,
            true,
        ),
        (
            json!({"_ng_failure_class": "agent_run_error", "_ng_failure_terminal": true}),
            true,
            true,
        ),
        (
            json!({"_ng_failure_class": "agent_run_error"}),
            false,
            false,
        ),
    ];
    for (row, default, opt_in) in table {
        assert_eq!(is_terminal_failure(&row, false), default, "{row}");
        assert_eq!(
            is_terminal_failure(&row, true),
            opt_in,
            "{row} with retry_terminal_timeouts"
        );
    }
}

#[test]
fn unclassified_execution_failures_depend_on_delivery_and_a_held_response() {
    let record = |delivery: &str, kind: Option<&str>| {
        let mut failure = json!({"failure_reason": "x", "terminal": false});
        if let Some(kind) = kind {
            failure["failure_kind"] = json!(kind);
        }
        json!({"_ng_failure_class": "agent_request_failed", "_ng_failure_record": {"delivery": delivery, "source": "collector", "failure": failure}})
    };
    let with_response = |mut row: Value| {
        row["_ng_failure_partial_response"] = json!({"output": []});
        row
    };
    let table = [
        ("not sent", record("not_sent", None), false),
        (
            "possibly delivered, nothing kept",
            record("possibly_delivered", None),
            false,
        ),
        (
            "possibly delivered, a response kept",
            with_response(record("possibly_delivered", None)),
            true,
        ),
        ("delivered", record("delivered", None), true),
        (
            "a named cause",
            record("delivered", Some("transport_peer_drop")),
            false,
        ),
        ("not a failure row", json!({"reward": 1.0}), false),
    ];
    for (name, row, expected) in table {
        assert_eq!(has_unclassified_execution_failure(&row), expected, "{name}");
    }
}

#[test]
fn masked_results_split_into_infrastructure_kept_answers_and_results() {
    let p = policy();
    let masked = |kind: Option<&str>, answer: bool, grade: bool| {
        let mut row = json!({"mask_sample": true, "reward": 0.0});
        if let Some(kind) = kind {
            row["failure_kind"] = json!(kind);
        }
        if answer {
            row["response"] = json!({"output": [{"type": "message"}], "status": "completed"});
        }
        if grade {
            row["_ng_recorded_grade"] = json!({"verdict": "fail"});
        }
        row
    };
    let table: Vec<(&str, Value, Option<&str>, Option<&str>)> = vec![
        (
            "evaluation-side kind, no answer",
            masked(Some("session_lost"), false, false),
            Some("session_lost"),
            None,
        ),
        (
            "evaluation-side kind, kept answer",
            masked(Some("verifier_error"), true, false),
            None,
            Some("verifier_error"),
        ),
        (
            "kept answer with a grade",
            masked(Some("verifier_error"), true, true),
            None,
            None,
        ),
        (
            "graded again: judge_failed",
            masked(Some("judge_failed"), false, false),
            None,
            None,
        ),
        (
            "graded again: judge_unparseable",
            masked(Some("judge_unparseable"), false, false),
            None,
            None,
        ),
        (
            "graded again: agent_route_failed",
            masked(Some("agent_route_failed"), false, false),
            None,
            None,
        ),
        (
            "a transport verify call",
            masked(Some("transport_unreachable"), false, false),
            None,
            None,
        ),
        (
            "model-side kind",
            masked(Some("agent_run_error"), false, false),
            None,
            None,
        ),
        (
            "unregistered kind",
            masked(Some("sandbox_gone"), false, false),
            None,
            None,
        ),
        (
            "namespaced kind",
            masked(Some("gdpval:reference_missing"), false, false),
            None,
            None,
        ),
        ("no kind", masked(None, false, false), None, None),
        (
            "not masked",
            json!({"failure_kind": "session_lost", "reward": 0.0}),
            None,
            None,
        ),
        (
            "a failure row",
            json!({"mask_sample": true, "failure_kind": "session_lost", "_ng_failure_class": "session_lost"}),
            None,
            None,
        ),
    ];
    for (name, row, infrastructure, kept) in table {
        assert_eq!(
            masked_infrastructure_kind(&row, &p).as_deref(),
            infrastructure,
            "{name}: infrastructure"
        );
        assert_eq!(
            masked_kept_answer_kind(&row, &p).as_deref(),
            kept,
            "{name}: kept answer"
        );
    }
    let mut applied_model = masked(Some("session_lost"), false, false);
    applied_model["_ng_failure_class_applied"] = json!("model");
    assert_eq!(
        masked_infrastructure_kind(&applied_model, &p),
        None,
        "an applied class wins over configuration"
    );
}

#[test]
fn the_default_policy_classifies_kinds_with_stage_dependent_oom() {
    let p = policy();
    assert_eq!(p.classify("session_lost", None), FailureClass::Evaluation);
    assert_eq!(p.classify("agent_run_error", None), FailureClass::Model);
    assert_eq!(
        p.classify("timeout_exceeded", None),
        FailureClass::Model,
        "legacy label maps to agent_timeout"
    );
    assert_eq!(
        p.classify("provider_oom_killed", Some(FailureStage::Agent)),
        FailureClass::Model
    );
    assert_eq!(
        p.classify("provider_oom_killed", Some(FailureStage::Seed)),
        FailureClass::Evaluation
    );
    assert_eq!(
        p.classify("provider_oom_killed", None),
        FailureClass::Unknown
    );
    assert_eq!(
        p.classify("gdpval:reference_missing", None),
        FailureClass::Unknown
    );
    assert_eq!(
        p.classify("transport_made_up", None),
        FailureClass::Unknown,
        "prefixes assign no responsibility"
    );
    assert_eq!(kind_status("session_lost"), KindStatus::Registered);
    assert_eq!(kind_status("gdpval:eval_missing"), KindStatus::Namespaced);
    assert_eq!(kind_status("transient"), KindStatus::Unregistered);
    assert_eq!(kind_status("Bad Kind\n"), KindStatus::Invalid);
    let unknown_applied =
        json!({"_ng_failure_class_applied": "unknown", "failure_kind": "session_lost"});
    assert_eq!(
        applied_failure_class(&unknown_applied),
        Some(FailureClass::Unknown)
    );
    assert_eq!(
        responsibility(&unknown_applied, &p),
        FailureClass::Unknown,
        "explicit unknown is preserved"
    );
}

#[test]
fn a_saved_policy_is_read_strictly_and_never_silently_defaulted() {
    let default = ClassificationPolicy::default();
    let text = serde_json::to_vec(&default).expect("serialise");
    assert_eq!(
        ClassificationPolicy::from_json(&text).expect("round trip"),
        default
    );
    let mut custom: Value = serde_json::from_slice(&text).expect("json");
    custom["kinds"]["gdpval:reference_missing"] = json!("evaluation");
    let custom = ClassificationPolicy::from_json(&serde_json::to_vec(&custom).expect("json"))
        .expect("custom");
    assert_eq!(
        custom.classify("gdpval:reference_missing", None),
        FailureClass::Evaluation
    );
    for bad in [&b"{"[..], b"{}", b"[]", br#"{"schema_version": 1}"#] {
        assert!(
            ClassificationPolicy::from_json(bad).is_err(),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
    let mut wrong: Value = serde_json::from_slice(&text).expect("json");
    wrong["kinds"]["x"] = json!("blame-someone");
    assert!(ClassificationPolicy::from_json(&serde_json::to_vec(&wrong).expect("json")).is_err());
    let mut extra: Value = serde_json::from_slice(&text).expect("json");
    extra["surprise"] = json!(1);
    assert!(ClassificationPolicy::from_json(&serde_json::to_vec(&extra).expect("json")).is_err());
}

#[test]
fn observed_elapsed_takes_the_first_positive_number() {
    let table = [
        (json!({"elapsed_seconds": 5}), Some(5.0)),
        (json!({"elapsed_seconds": "7.5"}), Some(7.5)),
        (
            json!({"elapsed_seconds": 0, "response": {"metadata": {"elapsed_seconds": 3.0}}}),
            Some(3.0),
        ),
        (
            json!({"elapsed_seconds": "soon", "response": {"metadata": {"elapsed_seconds": -1}}}),
            None,
        ),
        (json!({}), None),
    ];
    for (row, expected) in table {
        assert_eq!(observed_elapsed(&row), expected, "{row}");
    }
}

#[test]
fn intentional_gaps_need_completed_work_beside_them() {
    assert!(has_only_intentional_gaps(5, 3, 2));
    assert!(!has_only_intentional_gaps(5, 0, 5));
    assert!(!has_only_intentional_gaps(5, 3, 1));
    assert!(matches_failure_class(
        &json!({"_ng_failure_class": "timeout_exceeded"}),
        &["agent_timeout"]
    ));
    assert!(matches_failure_class(
        &json!({"failure_kind": "judge_failed"}),
        &["judge_failed"]
    ));
    assert!(!matches_failure_class(
        &json!({"failure_kind": "judge_failed"}),
        &["verifier_error"]
    ));
}

#[test]
fn a_row_verdict_summarises_what_resume_does_with_it() {
    let p = policy();
    let table = [
        (
            json!({"reward": 1.0, "response": {"output": [{}]}}),
            RowVerdict::Keep,
        ),
        (
            json!({"_ng_failure_class": "agent_run_error", "_ng_failure_counts_as_zero": true}),
            RowVerdict::ModelFinal,
        ),
        (
            json!({"_ng_failure_class": "judge_failed", "response": {"output": [{}], "status": "completed"}}),
            RowVerdict::Rejudge,
        ),
        (
            json!({"_ng_failure_class": "agent_run_error", "_ng_failure_terminal": true}),
            RowVerdict::Terminal,
        ),
        (
            json!({"_ng_failure_class": "transport_peer_drop"}),
            RowVerdict::Retry,
        ),
        (
            json!({"_ng_failure_class": "skipped", "_ng_failure_terminal": true, "_ng_omitted": true}),
            RowVerdict::Omitted,
        ),
        (
            json!({"mask_sample": true, "reward": 0.0, "failure_kind": "agent_run_error"}),
            RowVerdict::KeepMasked,
        ),
        (
            json!({"mask_sample": true, "reward": 0.0, "failure_kind": "session_lost"}),
            RowVerdict::Retry,
        ),
        (
            json!({"mask_sample": true, "reward": 0.0, "failure_kind": "session_lost", "response": {"status": "completed"}}),
            RowVerdict::NeedsApproval,
        ),
    ];
    for (row, expected) in table {
        assert_eq!(classify_row(&row, &p, false).verdict, expected, "{row}");
    }
}

fn arbitrary_json() -> impl Strategy<Value = Value> {
    let keys = prop::sample::select(vec![
        "_ng_failure_class",
        "_ng_failure_terminal",
        "_ng_failure_record",
        "failure",
        "failure_kind",
        "delivery",
        "response",
        "output",
        "status",
        "metadata",
        "ng_no_generation",
        "mask_sample",
        "reward",
        "elapsed_seconds",
        "_ng_collected_model_calls",
        "ng_model_call_capture",
        "calls",
        "ng_trajectory",
        "model_calls",
        "started_at",
        "duration_ms",
        "error_category",
        "status_code",
        "failure_events",
        "ng_failure_events",
        "_ng_selected_failure_id",
        "failure_id",
        "stage",
        "_ng_failure_partial_response",
        "_ng_recorded_grade",
        "_ng_keeps_saved_answer",
        "_ng_failure_class_applied",
        "_ng_omitted",
        "response_metadata",
        "http_status",
        "latency_total_ms",
    ]);
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        prop::sample::select(vec![
            "agent_timeout",
            "session_lost",
            "upstream_error",
            "seed",
            "agent",
            "delivered",
            "not_sent",
            "completed",
            "failed",
            "evaluation",
            "x"
        ])
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(5, 64, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((keys.clone(), inner), 0..6).prop_map(|e| Value::Object(
                e.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
            )),
        ]
    })
}

proptest! {
    #[test]
    fn no_row_of_arbitrary_json_makes_a_predicate_panic(row in arbitrary_json(), opt_in in any::<bool>()) {
        let p = policy();
        let decision = classify_row(&row, &p, opt_in);
        // The summary agrees with the predicates it is built from.
        prop_assert_eq!(decision.is_answered_agent_deadline, is_answered_agent_deadline(&row, &p));
        prop_assert!(!(decision.masked_infrastructure_kind.is_some() && decision.masked_kept_answer_kind.is_some()));
        let _ = (captured_model_calls(&row), observed_elapsed(&row), failure_stage(&row), row_failure_kind(&row));
    }
}

proptest! {
    #[test]
    fn facts_read_from_bytes_equal_facts_read_from_a_parsed_value(row in arbitrary_json(), pretty in any::<bool>()) {
        use recovery_core::facts::RowFacts;
        let text = if pretty { serde_json::to_string_pretty(&row) } else { serde_json::to_string(&row) }.expect("serialise");
        let from_bytes = RowFacts::from_line(text.as_bytes()).expect("valid JSON");
        if row.is_object() {
            prop_assert_eq!(from_bytes, Some(RowFacts::from_value(&row)));
        } else {
            prop_assert_eq!(from_bytes, None);
        }
    }
}

#[test]
fn a_whole_file_is_classified_in_order_with_counts() {
    use recovery_core::classify::classify_jsonl;
    use recovery_core::rows::JsonlError;
    let rows = [
        json!({"_ng_failure_class": "session_lost"}),
        json!({"_ng_failure_class": "agent_run_error", "_ng_failure_terminal": true}),
        json!({"reward": 1.0, "response": {"output": [{}]}}),
    ];
    let mut text: String = rows.iter().map(|r| format!("{r}\n\n")).collect();
    text.push_str("{\"_ng_failure_class\":");
    let mut seen = Vec::new();
    for threads in [1, 2] {
        seen.clear();
        let summary = classify_jsonl(
            text.as_bytes(),
            "f.jsonl",
            threads,
            &policy(),
            false,
            |line, d| seen.push((line, d.verdict)),
        )
        .expect("classified");
        assert_eq!(
            seen,
            [
                (1, RowVerdict::Retry),
                (3, RowVerdict::Terminal),
                (5, RowVerdict::Keep)
            ]
        );
        assert_eq!((summary.rows, summary.torn_tail_line), (3, Some(7)));
        assert_eq!(
            summary.by_responsibility.get(&FailureClass::Evaluation),
            Some(&1)
        );
        assert_eq!(summary.by_kind.get("agent_run_error"), Some(&1));
    }
    let malformed = format!("{}\n{{oops\n", rows[0]);
    assert!(matches!(
        classify_jsonl(
            malformed.as_bytes(),
            "f.jsonl",
            2,
            &policy(),
            false,
            |_, _| {}
        ),
        Err(JsonlError::Malformed { line: 2, .. })
    ));
    assert!(matches!(
        classify_jsonl("[]\n".as_bytes(), "f.jsonl", 1, &policy(), false, |_, _| {}),
        Err(JsonlError::NotAnObject { line: 1, .. })
    ));
}
