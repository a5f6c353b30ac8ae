//! Attempt budget, resume plan and coverage: facts §17 scenarios 16-27, 35-39, 43 and 46-48
//! expressed over saved rows.

use recovery_core::facts::IdentityFacts;
use recovery_core::failure::ClassificationPolicy;
use recovery_core::journals::{attempt_extension, rerun_masked_approvals, resubmit_offset};
use recovery_core::manifest::RunManifest;
use recovery_core::plan::{
    Artifact, Budget, IndexOptions, JsonlMark, MemoryLines, OutcomesError, PlanError, PlanState,
    PlanSummary, PlanView, ResumePlan, RunIndex, index_outcomes,
};
use serde_json::{Value, json};
use std::collections::BTreeSet;

const RUN: &str = "0123456789abcdef0123456789abcdef";

#[derive(Clone)]
struct Run {
    manifest: RunManifest,
    inventory: Vec<Value>,
    failures: Vec<Value>,
    results: Vec<Value>,
    offset: u64,
    results_offset: u64,
}

impl Run {
    fn new(tasks: i64) -> Self {
        let inventory = (0..tasks)
            .map(|t| json!({"_ng_task_index": t, "_ng_rollout_index": 0, "q": format!("task {t}")}))
            .collect();
        Self {
            manifest: RunManifest::create(RUN, "s", "m", "c", Some(3)),
            inventory,
            failures: vec![],
            results: vec![],
            offset: 0,
            results_offset: 0,
        }
    }

    fn reserve(mut self, task: i64, next: u64) -> Self {
        self.manifest.next_attempt.insert(format!("{task}-0"), next);
        self
    }

    fn cap(mut self, cap: u64) -> Self {
        self.manifest.max_rollout_attempts = Some(cap);
        self
    }

    /// Saves an outcome (reserving its attempt first, as a collector must) in the failures
    /// sidecar or the results file.
    fn saved(mut self, artifact: Artifact, task: i64, attempt: i64, extra: Value) -> Self {
        let reserved = self
            .manifest
            .next_attempt
            .get(&format!("{task}-0"))
            .copied()
            .unwrap_or(0);
        self = self.reserve(task, reserved.max(attempt as u64 + 1));
        let row = merge(outcome(task, attempt), extra);
        match artifact {
            Artifact::Failures => self.failures.push(row),
            Artifact::Results => self.results.push(row),
        }
        self
    }

    fn failure(self, task: i64, attempt: i64, extra: Value) -> Self {
        self.saved(Artifact::Failures, task, attempt, extra)
    }

    fn result(self, task: i64, attempt: i64, extra: Value) -> Self {
        self.saved(Artifact::Results, task, attempt, extra)
    }

    fn plan(
        &self,
        budget: Budget,
        approvals: &BTreeSet<(i64, i64, i64)>,
    ) -> Result<ResumePlan, PlanError> {
        self.with_view(budget, approvals, |view| view.plan())
    }

    /// Indexes the run and hands its plan view to `look`.
    fn with_view<T>(
        &self,
        budget: Budget,
        approvals: &BTreeSet<(i64, i64, i64)>,
        look: impl FnOnce(&PlanView<'_>) -> T,
    ) -> Result<T, PlanError> {
        let inventory = self.inventory.iter().map(|row| {
            IdentityFacts::from_line(row.to_string().as_bytes())
                .expect("row")
                .expect("object")
        });
        let mut index = RunIndex::new(
            &self.manifest,
            inventory,
            ClassificationPolicy::default(),
            IndexOptions {
                resubmit_offset: self.offset,
                resubmit_results_offset: self.results_offset,
            },
        )?;
        let reservations = index.reservations(&self.manifest)?;
        let text = |rows: &[Value]| -> String { rows.iter().map(|r| format!("{r}\n")).collect() };
        let (failures, results) = (text(&self.failures), text(&self.results));
        let mut source = MemoryLines {
            failures: failures.as_bytes(),
            results: results.as_bytes(),
        };
        for (artifact, text) in [
            (Artifact::Failures, &failures),
            (Artifact::Results, &results),
        ] {
            index_outcomes(
                &mut index,
                &reservations,
                artifact,
                text.as_bytes(),
                JsonlMark::default(),
                "rows",
                2,
                &mut source,
            )
            .map_err(|e| match e {
                OutcomesError::Plan { error, .. } => error,
                other => panic!("{other}"),
            })?;
        }
        Ok(look(&index.view(
            &self.manifest,
            &reservations,
            &budget,
            approvals,
        )))
    }

    fn default_plan(&self) -> ResumePlan {
        self.plan(Budget::default(), &BTreeSet::new())
            .expect("plan")
    }
}

fn outcome(task: i64, attempt: i64) -> Value {
    json!({"_ng_task_index": task, "_ng_rollout_index": 0, "_ng_attempt_index": attempt, "_ng_run_id": RUN})
}

fn merge(mut base: Value, extra: Value) -> Value {
    if let (Value::Object(b), Value::Object(e)) = (&mut base, extra) {
        b.extend(e);
    }
    base
}

fn scored() -> Value {
    json!({"reward": 1.0, "response": {"output": [{"type": "message"}], "status": "completed"}})
}

fn failed(class: &str) -> Value {
    json!({"_ng_failure_class": class, "_ng_failure_terminal": false, "error": "x"})
}

fn states(plan: &ResumePlan) -> Vec<PlanState> {
    plan.entries.iter().map(|e| e.state).collect()
}

#[test]
fn scenario_16_an_interrupted_lazy_dispatch_resumes_the_unfinished_rollouts() {
    let run = Run::new(3).reserve(1, 1).result(0, 0, scored());
    let plan = run.default_plan();
    assert_eq!(
        states(&plan),
        [PlanState::Scored, PlanState::Missing, PlanState::Missing]
    );
    let order: Vec<(&str, Option<i64>)> = plan
        .dispatch_order(false)
        .iter()
        .map(|e| (e.rollout_id.as_str(), e.next_attempt))
        .collect();
    assert_eq!(order, [("1-0", Some(1)), ("2-0", Some(0))]);
    assert_eq!(plan.coverage.never_dispatched, 1);
}

#[test]
fn scenario_18_reservations_alone_are_not_failures() {
    let run = (0..4).fold(Run::new(4), |run, t| run.reserve(t, 3));
    let plan = run.default_plan();
    assert_eq!(
        (
            plan.coverage.unknown,
            plan.coverage.counted_failures,
            plan.coverage.successful,
            plan.coverage.failed
        ),
        (4, 0, 0, 0)
    );
    assert!(
        plan.entries
            .iter()
            .all(|e| e.state == PlanState::Missing && e.next_attempt == Some(3))
    );
}

#[test]
fn scenario_19_unscored_completions_setup_failures_and_terminal_failures_are_counted_apart() {
    let run = Run::new(3)
        .result(0, 0, json!({"mask_sample": true}))
        .failure(1, 0, failed("environment_server_failed"))
        .result(
            1,
            1,
            json!({"reward": 0.0, "response": {"output": [], "status": "completed"}}),
        )
        .failure(
            2,
            0,
            json!({"_ng_failure_class": "agent_run_error", "_ng_failure_terminal": true}),
        );
    let c = run.default_plan().coverage;
    assert_eq!(
        (c.successful, c.measured, c.unscored, c.failed),
        (2, 1, 1, 1)
    );
    let error = c.check_complete().expect_err("incomplete");
    assert!(
        error.to_string().contains("2/3 samples completed"),
        "{error}"
    );
}

#[test]
fn scenario_20_only_delivered_non_terminal_failures_count() {
    for delivery in ["not_sent", "possibly_delivered", "delivered"] {
        for terminal in [false, true] {
            let record = json!({"schema_version": 1, "episode_id": {"rollout_id": "0-0", "attempt": 0}, "run_id": RUN, "source": "collector",
                "delivery": delivery, "failure": {"failure_reason": "boom", "terminal": terminal, "failure_kind": "transport_peer_drop"}, "http_status": null, "exception_type": null});
            let run = Run::new(1).cap(1).failure(0, 0, json!({"_ng_failure_class": "transport_peer_drop", "_ng_failure_terminal": terminal, "_ng_failure_record": record}));
            let plan = run.default_plan();
            let counted = delivery != "not_sent" && !terminal;
            assert_eq!(
                plan.coverage.counted_failures,
                u64::from(counted),
                "{delivery} terminal={terminal}"
            );
            let pending = !terminal && delivery == "not_sent";
            assert_eq!(
                plan.entries[0].state == PlanState::Retryable,
                pending,
                "{delivery} terminal={terminal}"
            );
        }
    }
}

#[test]
fn scenario_21_exhaustion_depends_on_the_cap() {
    let run = || {
        Run::new(6)
            .reserve(4, 1)
            .result(0, 0, scored())
            .failure(1, 0, failed("agent_run_error"))
            .failure(2, 0, json!({"_ng_failure_class": "timeout_exceeded", "_ng_failure_terminal": true}))
            .failure(3, 0, json!({"_ng_failure_class": "skipped", "_ng_failure_terminal": true, "_ng_omitted": true}))
    };
    for (cap, exhausted) in [(1, 1), (2, 0)] {
        let plan = run().cap(cap).default_plan();
        let c = &plan.coverage;
        assert_eq!(
            (
                c.failed,
                c.unknown,
                c.never_dispatched,
                c.attempts,
                c.intentionally_omitted
            ),
            (2, 2, 1, 5, 1),
            "cap {cap}"
        );
        assert_eq!(c.attempts_exhausted, exhausted, "cap {cap}");
        assert_eq!(plan.budget_message.is_some(), exhausted > 0);
    }
}

#[test]
fn scenario_22_repeated_kill_shaped_failures_exhaust_the_cap() {
    let run = Run::new(3)
        .cap(2)
        .failure(0, 0, failed("kill_shaped"))
        .failure(1, 0, failed("kill_shaped"))
        .failure(0, 1, failed("kill_shaped"))
        .failure(1, 1, failed("kill_shaped"))
        .result(2, 0, scored());
    let plan = run.default_plan();
    let c = &plan.coverage;
    assert_eq!(
        (c.attempts, c.attempts_exhausted, c.max_rollout_attempts),
        (5, 2, 2)
    );
    let message = plan.budget_message.expect("message");
    assert!(
        message.contains("Retry budget exhausted for 2 rollout(s) at the cap of 2"),
        "{message}"
    );
}

#[test]
fn scenario_23_the_newest_reserved_attempt_wins() {
    let run = Run::new(1).reserve(0, 2).result(0, 0, scored());
    let plan = run.default_plan();
    assert_eq!(
        plan.coverage.successful, 0,
        "a newer reservation supersedes the older success"
    );
    assert_eq!(
        (plan.entries[0].state, plan.entries[0].next_attempt),
        (PlanState::Missing, Some(2))
    );
    let run = run.result(
        0,
        2,
        json!({"reward": 0.0, "response": {"output": [], "status": "completed"}}),
    );
    let plan = run.default_plan();
    assert_eq!(
        (
            plan.entries[0].state,
            plan.entries[0].latest_attempt,
            plan.coverage.successful
        ),
        (PlanState::Scored, Some(2), 1)
    );
}

#[test]
fn scenario_24_and_25_invalid_outcomes_are_refused() {
    let conflict = Run::new(1).result(0, 0, scored()).result(
        0,
        0,
        json!({"reward": 0.5, "response": {"status": "completed"}}),
    );
    assert!(matches!(
        conflict.plan(Budget::default(), &BTreeSet::new()),
        Err(PlanError::Conflict { .. })
    ));
    let duplicate = Run::new(1).result(0, 0, scored()).result(0, 0, scored());
    assert!(
        duplicate.plan(Budget::default(), &BTreeSet::new()).is_ok(),
        "the same payload twice is one outcome"
    );
    let mut unreserved = Run::new(1);
    unreserved.results.push(merge(outcome(0, 0), scored()));
    let error = unreserved
        .plan(Budget::default(), &BTreeSet::new())
        .expect_err("unreserved");
    assert!(error.to_string().contains("no reserved attempt"), "{error}");
    let mut foreign = Run::new(1).reserve(0, 1);
    foreign.results.push(merge(
        merge(outcome(0, 0), scored()),
        json!({"_ng_run_id": "other"}),
    ));
    assert!(
        foreign
            .plan(Budget::default(), &BTreeSet::new())
            .expect_err("foreign")
            .to_string()
            .contains("different run")
    );
    let record = |run_id: &str, rollout: &str, attempt: i64, terminal: bool, kind: &str| {
        json!({"episode_id": {"rollout_id": rollout, "attempt": attempt}, "run_id": run_id, "source": "environment", "delivery": "delivered",
            "failure": {"failure_reason": "x", "terminal": terminal, "failure_kind": kind}})
    };
    for (name, record) in [
        ("run id", record("other", "0-0", 0, false, "session_lost")),
        ("rollout id", record(RUN, "1-0", 0, false, "session_lost")),
        ("attempt", record(RUN, "0-0", 3, false, "session_lost")),
        ("terminal flag", record(RUN, "0-0", 0, true, "session_lost")),
        (
            "failure kind",
            record(RUN, "0-0", 0, false, "verifier_error"),
        ),
    ] {
        let run = Run::new(2).failure(0, 0, json!({"_ng_failure_class": "session_lost", "_ng_failure_terminal": false, "_ng_failure_record": record}));
        let error = run
            .plan(Budget::default(), &BTreeSet::new())
            .expect_err(name);
        assert!(
            error.to_string().contains("inconsistent"),
            "{name}: {error}"
        );
    }
    let wrong = Run::new(1).result(0, 0, failed("agent_run_error"));
    assert!(matches!(
        wrong.plan(Budget::default(), &BTreeSet::new()),
        Err(PlanError::WrongArtifact { .. })
    ));
    let mut stranger = Run::new(1).reserve(0, 1);
    stranger
        .results
        .push(json!({"_ng_task_index": 9, "_ng_rollout_index": 0, "_ng_run_id": RUN}));
    assert!(
        stranger
            .plan(Budget::default(), &BTreeSet::new())
            .expect_err("stranger")
            .to_string()
            .contains("not in this run's materialized inputs")
    );
}

#[test]
fn scenario_27_legacy_rows_are_numbered_in_arrival_order() {
    let mut run = Run::new(2);
    run.manifest = RunManifest::import_legacy(RUN, "m");
    let untagged = |task: i64, extra: Value| {
        merge(
            json!({"_ng_task_index": task, "_ng_rollout_index": 0, "_ng_attempt_index": 0}),
            extra,
        )
    };
    run.results.push(untagged(0, failed("transient")));
    run.results.push(untagged(0, scored()));
    let plan = run.default_plan();
    assert_eq!(
        (plan.entries[0].state, plan.entries[0].latest_attempt),
        (PlanState::Scored, Some(1))
    );
    assert_eq!(plan.coverage.attempts, 2);
    assert!(!plan.coverage.identity_verified);
}

#[test]
fn scenario_36_a_drained_budget_leaves_everything_never_dispatched() {
    let c = Run::new(3).default_plan().coverage;
    assert_eq!((c.attempts, c.never_dispatched, c.complete), (0, 3, false));
}

#[test]
fn scenario_37_terminal_timeouts_retry_only_with_the_opt_in() {
    let run = || {
        Run::new(1).cap(1).failure(
            0,
            0,
            json!({"_ng_failure_class": "timeout_exceeded", "_ng_failure_terminal": true}),
        )
    };
    let plan = run().default_plan();
    assert_eq!(
        (plan.entries[0].state, plan.coverage.attempts_exhausted),
        (PlanState::Terminal, 0)
    );
    let mut opted = run();
    opted.manifest.retry_terminal_timeouts = true;
    let plan = opted.default_plan();
    assert!(plan.coverage.retry_terminal_timeouts);
    assert_eq!(
        (plan.entries[0].state, plan.coverage.attempts_exhausted),
        (PlanState::Exhausted, 1)
    );
    // An exhausted rollout is not retried, and its reason says so (it said "retried within
    // the cap").
    assert_eq!(plan.entries[0].next_attempt, None);
    assert!(
        plan.entries[0]
            .reason
            .ends_with(": counted failures 1 of a cap of 1, used up; extend the attempts to retry"),
        "{}",
        plan.entries[0].reason
    );
    let plan = opted
        .plan(
            Budget {
                default_cap: 3,
                extension: 1,
            },
            &BTreeSet::new(),
        )
        .expect("plan");
    assert_eq!(
        (
            plan.entries[0].state,
            plan.entries[0].next_attempt,
            plan.cap
        ),
        (PlanState::Retryable, Some(1), 2)
    );
}

#[test]
fn scenario_38_longest_failures_dispatch_first() {
    let run = Run::new(3)
        .failure(
            0,
            0,
            merge(failed("agent_run_error"), json!({"elapsed_seconds": 5})),
        )
        .failure(
            1,
            0,
            merge(failed("agent_run_error"), json!({"elapsed_seconds": 20})),
        )
        .failure(
            2,
            0,
            merge(failed("agent_run_error"), json!({"elapsed_seconds": 10})),
        );
    let plan = run.default_plan();
    let order: Vec<&str> = plan
        .dispatch_order(true)
        .iter()
        .map(|e| e.rollout_id.as_str())
        .collect();
    assert_eq!(order, ["1-0", "2-0", "0-0"]);
    let natural: Vec<&str> = plan
        .dispatch_order(false)
        .iter()
        .map(|e| e.rollout_id.as_str())
        .collect();
    assert_eq!(natural, ["0-0", "1-0", "2-0"]);
}

#[test]
fn scenario_39_a_cached_deliverable_is_reused_only_from_the_newest_outcome() {
    let cached = merge(
        failed("agent_run_error"),
        json!({"reuse_cached_deliverable": true}),
    );
    let plan = Run::new(1).failure(0, 0, cached.clone()).default_plan();
    assert!(plan.entries[0].reuse_cached_deliverable);
    let plan = Run::new(1)
        .failure(0, 0, cached.clone())
        .reserve(0, 3)
        .default_plan();
    assert!(
        plan.entries[0].reuse_cached_deliverable,
        "an unknown newer reservation carries no new decision"
    );
    assert_eq!(plan.entries[0].next_attempt, Some(3));
    let plan = Run::new(1)
        .failure(0, 0, cached.clone())
        .failure(0, 1, failed("agent_run_error"))
        .default_plan();
    assert!(
        !plan.entries[0].reuse_cached_deliverable,
        "a newer failure without the flag drops it"
    );
}

#[test]
fn scenario_43_the_completion_check_names_the_fraction_and_exit_code() {
    let plan = Run::new(3)
        .result(0, 0, scored())
        .result(1, 0, scored())
        .default_plan();
    let error = plan.coverage.check_complete().expect_err("incomplete");
    assert!(error.to_string().contains("2/3"));
    assert_eq!(error.exit_code(), 75);
    let complete = Run::new(1).result(0, 0, scored()).default_plan();
    assert!(complete.coverage.check_complete().is_ok());
    let none = Run::new(2).default_plan();
    assert_eq!(
        none.coverage
            .check_complete()
            .expect_err("none")
            .exit_code(),
        1,
        "no progress"
    );
}

#[test]
fn scenario_46_masked_infrastructure_results_retry_within_the_cap() {
    let masked = |kind: &str| json!({"mask_sample": true, "reward": 0.0, "failure_kind": kind});
    let plan = Run::new(1)
        .result(0, 0, masked("session_lost"))
        .default_plan();
    assert_eq!(
        (
            plan.entries[0].state,
            plan.entries[0].next_attempt,
            plan.coverage.counted_failures
        ),
        (PlanState::Retryable, Some(1), 1)
    );
    let plan = Run::new(1)
        .cap(1)
        .result(0, 0, masked("session_lost"))
        .default_plan();
    assert_eq!(
        plan.entries[0].state,
        PlanState::Exhausted,
        "the masked row counts one failed attempt"
    );
    for kind in [
        "judge_failed",
        "judge_unparseable",
        "agent_route_failed",
        "transport_unreachable",
        "agent_run_error",
        "custom",
        "ns:kind",
    ] {
        let plan = Run::new(1).result(0, 0, masked(kind)).default_plan();
        assert_eq!(
            plan.entries[0].state,
            PlanState::Masked,
            "{kind} stays the result"
        );
    }
    let answered = merge(
        masked("session_lost"),
        json!({"response": {"output": [{}], "status": "completed"}}),
    );
    assert_eq!(
        Run::new(1).result(0, 0, answered).default_plan().entries[0].state,
        PlanState::AwaitingApproval
    );
    let graded = merge(
        masked("session_lost"),
        json!({"response": {"output": [{}], "status": "completed"}, "_ng_recorded_grade": {"v": 0}}),
    );
    assert_eq!(
        Run::new(1).result(0, 0, graded).default_plan().entries[0].state,
        PlanState::Masked
    );
}

#[test]
fn scenario_47_answered_deadlines_are_final_and_infrastructure_timeouts_retry() {
    let timeout = |category: &str| {
        json!({"_ng_failure_class": "agent_timeout", "_ng_failure_terminal": false, "elapsed_seconds": 100,
            "_ng_failure_partial_response": {"output": [{"type": "message"}], "status": "incomplete"},
            "_ng_collected_model_calls": [{"error_category": null, "started_at": 0, "duration_ms": 1000}, {"error_category": category, "started_at": 50, "duration_ms": 100}]})
    };
    let plan = Run::new(1)
        .failure(0, 0, timeout("rate_limit"))
        .default_plan();
    assert_eq!(
        (
            plan.entries[0].state,
            plan.coverage.failures_counted_as_zero
        ),
        (PlanState::ModelFinal, 1)
    );
    let plan = Run::new(1)
        .failure(0, 0, timeout("upstream_error"))
        .default_plan();
    assert_eq!(plan.entries[0].state, PlanState::Retryable);
}

#[test]
fn scenario_48_an_approval_reopens_exactly_the_attempt_it_names() {
    let masked = json!({"mask_sample": true, "reward": 0.0, "failure_kind": "verifier_error", "response": {"output": [{}], "status": "completed"}});
    let mut run = Run::new(4);
    run.inventory[3] = json!({"_ng_task_index": 3, "_ng_rollout_index": 0});
    let run = run.result(3, 1, masked.clone());
    let whole = json!({"approval_id": "a1", "at": "2026-01-01T00:00:00Z", "by": "alice", "reason": "judge crashed", "task_index": 3, "rollout_index": 0, "attempt_index": 1, "note": "fields a reader does not know are ignored"});
    assert_eq!(
        rerun_masked_approvals(format!("{whole}\n").as_bytes()),
        BTreeSet::from([(3, 0, 1)])
    );
    // Each of these approves nothing: a line that is not a whole approval of the service's
    // format (hostile review 39: a hand-written triple without an id approved a rerun that the
    // approvals list, revocation and reindex never saw).
    let mut unreadable = vec!["not json".to_owned(), "[3, 0, 2]".to_owned()];
    for field in [
        "approval_id",
        "at",
        "by",
        "reason",
        "task_index",
        "rollout_index",
        "attempt_index",
    ] {
        let mut line = whole.clone();
        line["attempt_index"] = json!(2);
        line.as_object_mut().expect("object").remove(field);
        unreadable.push(line.to_string());
    }
    for (field, value) in [
        ("rollout_index", json!("0")),
        ("attempt_index", json!(-1)),
        ("attempt_index", json!(2.0)),
        ("approval_id", json!(7)),
        // An id no revocation could name (hostile review 40).
        ("approval_id", json!("")),
        ("approval_id", json!("a".repeat(257))),
    ] {
        let mut line = whole.clone();
        line["attempt_index"] = json!(2);
        line[field] = value;
        unreadable.push(line.to_string());
    }
    for line in &unreadable {
        assert_eq!(
            rerun_masked_approvals(format!("{line}\n").as_bytes()),
            BTreeSet::new(),
            "{line} approves nothing"
        );
    }
    // A later line reusing an id, and an unterminated last line (a write in progress),
    // approve nothing either (hostile review 40: the plan honoured both, the list neither).
    let mut reused = whole.clone();
    reused["task_index"] = json!(2);
    let mut torn = whole.clone();
    torn["approval_id"] = json!("a9");
    torn["attempt_index"] = json!(3);
    assert_eq!(
        rerun_masked_approvals(format!("{whole}\n{reused}\n{torn}").as_bytes()),
        BTreeSet::from([(3, 0, 1)]),
        "only the first line of an id, and only whole lines, approve"
    );
    let journal = format!("{whole}\n{}\n", unreadable.join("\n"));
    let approvals = rerun_masked_approvals(journal.as_bytes());
    assert_eq!(
        approvals,
        BTreeSet::from([(3, 0, 1)]),
        "unreadable lines approve nothing"
    );
    let plan = run.plan(Budget::default(), &approvals).expect("plan");
    assert_eq!(
        (plan.entries[3].state, plan.entries[3].next_attempt),
        (PlanState::ApprovedRerun, Some(2))
    );
    let later = run.result(3, 2, masked);
    let plan = later.plan(Budget::default(), &approvals).expect("plan");
    assert_eq!(
        plan.entries[3].state,
        PlanState::AwaitingApproval,
        "a later attempt is never reopened by it"
    );
}

#[test]
fn the_budget_reads_extensions_and_the_resubmit_offset() {
    let extensions = "{\"at\":\"t\",\"extend_attempts\":2,\"by\":\"op\",\"reason\":\"r\"}\n\n{\"extend_attempts\":1}\n";
    assert_eq!(
        attempt_extension(extensions.as_bytes(), "x").expect("sum"),
        3
    );
    for bad in [
        "{\"extend_attempts\":0}\n",
        "{\"extend_attempts\":\"2\"}\n",
        "{\"extend_attempts\":2}\n{\"extend_",
        "nope\n",
        // Attempts are numbered in signed 64 bits: a line past it, or lines adding up past
        // it, give no cap rather than a clamped one (hostile review 50, F3).
        "{\"extend_attempts\":9223372036854775808}\n",
        "{\"extend_attempts\":18446744073709551615}\n",
        "{\"extend_attempts\":9223372036854775807}\n{\"extend_attempts\":1}\n",
    ] {
        assert!(
            attempt_extension(bad.as_bytes(), "x").is_err(),
            "{bad:?} must stop the run"
        );
    }
    assert_eq!(
        attempt_extension(
            "{\"extend_attempts\":9223372036854775807}\n".as_bytes(),
            "x"
        )
        .expect("the largest extension"),
        9_223_372_036_854_775_807
    );
    assert_eq!(
        resubmit_offset("3\n7\n".as_bytes(), "x").expect("offset"),
        7
    );
    assert_eq!(resubmit_offset("".as_bytes(), "x").expect("offset"), 0);
    assert!(resubmit_offset("3\nseven\n".as_bytes(), "x").is_err());
    let mut run = Run::new(1)
        .cap(2)
        .failure(0, 0, failed("agent_run_error"))
        .failure(0, 1, failed("agent_run_error"));
    assert_eq!(run.default_plan().entries[0].state, PlanState::Exhausted);
    run.offset = 2;
    let plan = run.default_plan();
    assert_eq!(
        (
            plan.entries[0].state,
            plan.entries[0].counted_failures,
            plan.entries[0].next_attempt
        ),
        (PlanState::Retryable, 0, Some(2))
    );
}

#[test]
fn plan_states_cover_zero_counted_judge_recoverable_and_unclassified_failures() {
    let run = Run::new(4)
        .failure(0, 0, merge(failed("agent_run_error"), json!({"_ng_failure_counts_as_zero": true})))
        .failure(1, 0, merge(failed("judge_failed"), json!({"response": {"output": [{}], "status": "completed"}})))
        .failure(2, 0, json!({"_ng_failure_class": "agent_request_failed", "_ng_failure_terminal": false,
            "_ng_failure_partial_response": {"output": []},
            "_ng_failure_record": {"episode_id": {"rollout_id": "2-0", "attempt": 0}, "run_id": RUN, "source": "collector", "delivery": "possibly_delivered", "failure": {"failure_reason": "x", "terminal": false}}}))
        .result(3, 0, merge(scored(), json!({"failure_kind": "judge_unparseable"})));
    let plan = run.default_plan();
    assert_eq!(
        states(&plan),
        [
            PlanState::ModelFinal,
            PlanState::JudgeRecoverable,
            PlanState::Terminal,
            PlanState::JudgeRecoverable
        ]
    );
    let c = &plan.coverage;
    assert_eq!(
        c.expected,
        c.successful + c.failed + c.intentionally_omitted + c.unknown
    );
    assert_eq!(c.successful, c.measured + c.masked + c.unscored);
}

/// A re-judged outcome names the line it re-judges (`_ng_rejudge.predecessor_sha256`: the
/// SHA-256 of that line's exact bytes, as the admission took it) and takes its place as the
/// attempt's outcome, in either file and whichever file is read first; naming another line, or
/// a predecessor that was no judge failure, is the conflict it always was.
#[test]
fn a_rejudged_outcome_takes_the_place_of_the_judge_failure_it_names() {
    let answer = json!({"response": {"output": [{}], "status": "completed"}});
    let judge_failed = merge(failed("judge_failed"), answer.clone());
    let line = |task: i64, payload: &Value| merge(outcome(task, 0), payload.clone()).to_string();
    let sha = |text: &str| recovery_core::canonical::sha256_hex(text.as_bytes());
    let rejudge = |of: &str| json!({"_ng_rejudge": {"operation_id": "0".repeat(32), "predecessor_failure_id": "f-1", "predecessor_sha256": of}});
    let unparseable = merge(scored(), json!({"failure_kind": "judge_unparseable"}));
    let failed_again = merge(judge_failed.clone(), rejudge(&sha(&line(1, &unparseable))));
    let run = Run::new(4)
        // The sidecar's judge failure, graded again: a scored result.
        .failure(0, 0, judge_failed.clone())
        .result(
            0,
            0,
            merge(scored(), rejudge(&sha(&line(0, &judge_failed)))),
        )
        // A result whose grade failed, graded again and failed again: the sidecar (read first)
        // holds the successor, the results file its predecessor.
        .failure(1, 0, failed_again.clone())
        .result(1, 0, unparseable.clone())
        // Re-judged with the answer kept as a masked result.
        .failure(2, 0, judge_failed.clone())
        .result(
            2,
            0,
            merge(
                merge(scored(), json!({"mask_sample": true})),
                rejudge(&sha(&line(2, &judge_failed))),
            ),
        )
        // Not re-judged yet.
        .failure(3, 0, judge_failed.clone());
    let plan = run.default_plan();
    assert_eq!(
        states(&plan),
        [
            PlanState::Scored,
            PlanState::JudgeRecoverable,
            PlanState::Masked,
            PlanState::JudgeRecoverable
        ]
    );
    assert_eq!(
        (plan.coverage.successful, plan.entries[0].latest_attempt),
        (2, Some(0))
    );
    // The one that failed again, graded a third time: it names the second.
    let third = run.clone().result(
        1,
        0,
        merge(scored(), rejudge(&sha(&line(1, &failed_again)))),
    );
    assert_eq!(third.default_plan().entries[1].state, PlanState::Scored);
    // Naming a line that is not the attempt's outcome, or re-judging a scored result.
    for (predecessor, successor) in [
        (
            judge_failed.clone(),
            merge(scored(), rejudge(&"a".repeat(64))),
        ),
        (
            scored(),
            merge(
                json!({"reward": 0.0, "response": {"status": "completed"}}),
                rejudge(&sha(&line(0, &scored()))),
            ),
        ),
    ] {
        let artifact_of = |p: &Value| p.get("_ng_failure_class").is_some();
        let mut run = Run::new(1);
        run = if artifact_of(&predecessor) {
            run.failure(0, 0, predecessor)
        } else {
            run.result(0, 0, predecessor)
        };
        let run = run.result(0, 0, successor);
        assert!(matches!(
            run.plan(Budget::default(), &BTreeSet::new()),
            Err(PlanError::Conflict { .. })
        ));
    }
}

#[test]
fn inventory_problems_are_refused() {
    let mut run = Run::new(2);
    run.inventory[1] = run.inventory[0].clone();
    assert!(matches!(
        run.plan(Budget::default(), &BTreeSet::new()),
        Err(PlanError::DuplicateRollout(_))
    ));
    let run = Run::new(1).reserve(5, 1);
    assert!(matches!(
        run.plan(Budget::default(), &BTreeSet::new()),
        Err(PlanError::UnknownReservations(_))
    ));
    let mut run = Run::new(1);
    run.inventory[0] = json!({"_ng_rollout_id": "task-a1"});
    assert!(
        run.plan(Budget::default(), &BTreeSet::new())
            .expect_err("suffix")
            .to_string()
            .contains("reserved attempt suffix")
    );
    run.inventory[0] = json!({"q": 1});
    assert!(
        run.plan(Budget::default(), &BTreeSet::new())
            .expect_err("no id")
            .to_string()
            .contains("requires a rollout id")
    );
}

// --- issue 9: the seed's semantics where they were decided differently -----------------------

/// Item 2: `_ng_omitted_rollout` stand-ins and `_ng_unrouted_run_error` rows are evidence (facts
/// §14.4): no reader counts them as a failure or an attempt, so they neither fail the plan for
/// lacking a reservation nor become a rollout's latest attempt.
#[test]
fn item_2_evidence_rows_are_skipped_before_the_latest_attempt_is_picked() {
    let mut run = Run::new(3).result(0, 0, scored());
    let stand_in = |task: i64, extra: Value| {
        merge(
            json!({"_ng_task_index": task, "_ng_rollout_index": 0, "_ng_run_id": RUN, "_ng_failure_class": "skipped", "_ng_failure_terminal": true, "_ng_omitted_rollout": true}),
            extra,
        )
    };
    // A never-started rollout's stand-in: no attempt was reserved for it.
    run.failures.push(stand_in(1, json!({})));
    // An unrouted run error for an attempt of task 0 that was never reserved either.
    run.failures.push(stand_in(
        0,
        json!({"_ng_attempt_index": 1, "_ng_unrouted_run_error": "agent /run failed", "_ng_failure_class": "agent_run_error", "_ng_failure_terminal": false}),
    ));
    let plan = run.default_plan();
    assert_eq!(
        states(&plan),
        [PlanState::Scored, PlanState::Missing, PlanState::Missing]
    );
    assert_eq!(plan.entries[0].latest_attempt, Some(0));
    assert_eq!(
        (
            plan.coverage.attempts,
            plan.coverage.counted_failures,
            plan.coverage.failed
        ),
        (1, 0, 0)
    );
}

/// Item 3: a resubmit resets every counted failure, masked infrastructure results (saved in
/// the results file) included.
#[test]
fn item_3_a_resubmit_resets_masked_infrastructure_results_too() {
    let masked = json!({"mask_sample": true, "reward": 0.0, "failure_kind": "verifier_error"});
    let mut run = Run::new(1)
        .cap(3)
        .result(0, 0, masked.clone())
        .result(0, 1, masked.clone())
        .result(0, 2, masked);
    assert_eq!(run.default_plan().entries[0].state, PlanState::Exhausted);
    // The resubmit records both files' line counts.
    run.offset = run.failures.len() as u64;
    run.results_offset = run.results.len() as u64;
    let plan = run.default_plan();
    assert_eq!(
        (
            plan.entries[0].state,
            plan.entries[0].counted_failures,
            plan.entries[0].next_attempt
        ),
        (PlanState::Retryable, 0, Some(3))
    );
}

/// Item 7: `has_only_intentional_gaps` decides completion: omissions are accepted only beside
/// completed rollouts, and a masked result is not a completed one (the message counts it).
#[test]
fn item_7_completion_follows_has_only_intentional_gaps_and_never_counts_masked_as_completed() {
    use recovery_core::plan::{Completion, completion};
    let omitted =
        json!({"_ng_failure_class": "skipped", "_ng_failure_terminal": true, "_ng_omitted": true});
    let only_omitted = Run::new(2)
        .failure(0, 0, omitted.clone())
        .failure(1, 0, omitted.clone())
        .default_plan();
    let error = completion(&only_omitted.state_counts()).expect_err("nothing completed");
    assert_eq!(error.exit_code(), 76, "{error}");
    assert!(
        error.message.starts_with("0/2 samples completed"),
        "{error}"
    );
    let beside = Run::new(2)
        .result(0, 0, scored())
        .failure(1, 0, omitted)
        .default_plan();
    assert_eq!(
        completion(&beside.state_counts()).expect("accepted"),
        Completion::OnlyIntentionalGaps { omitted: 1 }
    );
    let masked = Run::new(2)
        .result(0, 0, scored())
        .result(1, 0, json!({"mask_sample": true, "reward": 0.0}))
        .default_plan();
    let error = completion(&masked.state_counts()).expect_err("a masked result");
    assert_eq!(error.exit_code(), 76);
    assert!(
        error
            .message
            .starts_with("1/2 samples completed (1 masked)"),
        "{error}"
    );
    assert!(
        error.message.contains("a resume has nothing to run"),
        "exit 76 never promises that a resume continues: {error}"
    );
    let runnable = Run::new(2).result(0, 0, scored()).default_plan();
    let error = completion(&runnable.state_counts()).expect_err("one to run");
    assert_eq!(error.exit_code(), 75);
    assert!(
        error.message.ends_with("a resume continues them."),
        "{error}"
    );
}

/// Item 8: a masked `judge_*` result that kept its answer is re-judged (facts §16:
/// `judge_recoverable`), not kept as the dead end `masked`.
#[test]
fn item_8_masked_judge_failures_that_kept_an_answer_are_judge_recoverable() {
    for kind in ["judge_failed", "judge_unparseable"] {
        let plan = Run::new(1)
            .result(
                0,
                0,
                json!({"mask_sample": true, "reward": 0.0, "failure_kind": kind, "response": {"output": [{"type": "message"}], "status": "completed"}}),
            )
            .default_plan();
        assert_eq!(plan.entries[0].state, PlanState::JudgeRecoverable, "{kind}");
    }
    let no_answer = Run::new(1)
        .result(
            0,
            0,
            json!({"mask_sample": true, "reward": 0.0, "failure_kind": "judge_failed"}),
        )
        .default_plan();
    assert_eq!(
        no_answer.entries[0].state,
        PlanState::Masked,
        "nothing to re-judge"
    );
}

/// A large inventory is decided in parts on several threads and the parts merged: its summary
/// counts exactly what a small inventory of the same pattern counts (decided in one part), a
/// hundred times over, and each state's positions are every rollout in that state, in order.
#[test]
fn a_large_inventory_summarized_in_parts_counts_as_a_small_one_scaled() {
    // A delivered, non-terminal failure: counted against the cap.
    let counted = |t: i64, a: i64| {
        let record = json!({"schema_version": 1, "episode_id": {"rollout_id": format!("{t}-0"), "attempt": a}, "run_id": RUN, "source": "collector",
            "delivery": "delivered", "failure": {"failure_reason": "boom", "terminal": false, "failure_kind": "transport_peer_drop"}, "http_status": null, "exception_type": null});
        json!({"_ng_failure_class": "transport_peer_drop", "_ng_failure_terminal": false, "_ng_failure_record": record})
    };
    let pattern = |tasks: i64| {
        (0..tasks).fold(Run::new(tasks), |run, t| match t % 6 {
            0 => run.result(t, 0, scored()),
            1 => run.failure(t, 0, counted(t, 0)),
            2 => (0..3).fold(run, |run, a| run.failure(t, a, counted(t, a))),
            3 => run.reserve(t, 2),
            4 => run.result(t, 0, json!({"response": {"output": []}})),
            _ => run,
        })
    };
    let summary = |tasks: i64| -> (PlanSummary, ResumePlan) {
        let run = pattern(tasks);
        let none = BTreeSet::new();
        let summary = run
            .with_view(Budget::default(), &none, |view| view.summary())
            .expect("summary");
        (summary, run.default_plan())
    };
    let ((small, _), (large, large_plan)) = (summary(300), summary(30_000));
    let scaled = [
        "expected",
        "successful",
        "measured",
        "masked",
        "unscored",
        "failed",
        "intentionally_omitted",
        "unknown",
        "never_dispatched",
        "attempts",
        "counted_failures",
        "attempts_exhausted",
        "scored",
        "failures_counted_as_zero",
    ];
    let (small_coverage, large_coverage) = (
        serde_json::to_value(&small.coverage).expect("json"),
        serde_json::to_value(&large.coverage).expect("json"),
    );
    for field in scaled {
        assert_eq!(
            large_coverage[field].as_u64().map(|n| n as f64),
            small_coverage[field].as_u64().map(|n| n as f64 * 100.0),
            "{field}"
        );
    }
    assert!(
        small.coverage.counted_failures > 0 && small.coverage.attempts_exhausted > 0,
        "the pattern counts failures and exhausts rollouts: {small_coverage}"
    );
    assert!(small.state_counts.len() >= 4, "{:?}", small.state_counts);
    for (state, count) in &small.state_counts {
        assert_eq!(
            large.state_counts.get(state),
            Some(&(count * 100)),
            "{state:?}"
        );
        let (positions, more) = large.positions(Some(*state), None, usize::MAX);
        let in_state: Vec<usize> = large_plan
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.state == *state)
            .map(|(p, _)| p)
            .collect();
        assert!(!more);
        assert!(
            positions == in_state,
            "{state:?}: every rollout in the state, in order ({} positions, {} rollouts)",
            positions.len(),
            in_state.len()
        );
    }
}

/// A plan keeps one `IdentityFacts` per rollout and one `OutcomeRow` per outcome line in flight:
/// the rare JSON values they may hold are boxed, so the common row costs a few words, not
/// several inline `Value`s (a 100k-rollout plan's peak memory fell by a sixth with this).
#[test]
fn the_facts_kept_per_rollout_and_per_outcome_line_stay_small() {
    let value = std::mem::size_of::<Value>();
    let identity = std::mem::size_of::<IdentityFacts>();
    let outcome = std::mem::size_of::<recovery_core::plan::OutcomeRow>();
    assert!(
        identity < value,
        "IdentityFacts is {identity} bytes, more than one inline Value ({value})"
    );
    assert!(
        outcome <= 3 * value,
        "OutcomeRow is {outcome} bytes, more than three inline Values ({value} each)"
    );
}
