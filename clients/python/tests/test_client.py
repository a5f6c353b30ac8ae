"""Every client method against the real service, and the typed results it answers."""

from __future__ import annotations

import copy
import json
import queue
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from rollout_recovery_client import (
    Approval,
    ConfigError,
    Manifest,
    OutcomeRefusedError,
    Plan,
    RecoveryClient,
    ResumeRefusedError,
    RetryPolicy,
    RunCreated,
    RunView,
    config_identity_path_for,
    coverage_path_for,
    failures_path_for,
    manifest_path_for,
    materialized_path_for,
    referenced_environment,
    resume_drift_path_for,
    run_lock_path_for,
)
from support import (
    RunSpec,
    Service,
    append_jsonl,
    binary,
    bundle,
    failure_row,
    free_port,
    input_rows,
    make_run,
    masked_row,
    new_output,
    result_row,
    start_service,
)


def test_system_endpoints(client: RecoveryClient) -> None:
    assert client.healthz() is True
    assert client.readyz() is True
    doc = client.openapi()
    assert doc["info"]["title"] == "rollout-recovery"
    assert "/runs/{run_id}/validate" in doc["paths"]
    assert "rollout_recovery_http_requests_total" in client.metrics()


def test_wait_until_ready_waits_for_a_service_that_is_not_up_yet(tmp_path: Path) -> None:
    port = free_port()
    with RecoveryClient(f"http://127.0.0.1:{port}") as early:
        with pytest.raises(TimeoutError):
            early.wait_until_ready(timeout=0.2, interval=0.05)
        # A listener that accepts and never answers (a stopped service): the wait ends at its
        # own timeout, not after the client's request timeout (hostile review 51, N5). The
        # property is about which bound ends the wait, so it is checked against that bound.
        request_timeout = 60.0
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen()
            url = f"http://127.0.0.1:{silent.getsockname()[1]}"
            with RecoveryClient(url, timeout=request_timeout) as hung:
                started = time.monotonic()
                with pytest.raises(TimeoutError):
                    hung.wait_until_ready(timeout=0.5, interval=0.05)
                assert time.monotonic() - started < request_timeout
        process = subprocess.Popen(
            [str(binary()), "serve", "--bind", f"127.0.0.1:{port}", "--data-dir", str(tmp_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            early.wait_until_ready(timeout=60, interval=0.02)
            assert early.readyz() is True
            assert early.list_runs().runs == []
        finally:
            process.terminate()
            process.wait(timeout=30)


def test_create_get_find_and_list_runs(client: RecoveryClient, root: Path) -> None:
    output, source = new_output(root, "create")
    config, global_config = bundle()
    rows = [{"agent_ref": {"name": "agent"}, "_ng_task_index": 0, "_ng_rollout_index": 0}]
    created = client.create_run(output, source, config, global_config, rows, max_rollout_attempts=5)
    assert isinstance(created, RunCreated)
    assert len(created.run_id) == 32
    assert created.output_path == str(output)
    assert created.manifest is not None
    assert created.manifest.run_id == created.run_id
    assert created.manifest.max_rollout_attempts == 5
    assert created.config_digest == created.manifest.config_digest
    assert created.raw["run_id"] == created.run_id
    # The service made the files a collector appends to, beside the output.
    assert output.exists()
    assert output.with_name("out_failures.jsonl").exists()
    assert output.with_name("out_manifest.json").exists()

    view = client.get_run(created.run_id)
    assert isinstance(view, RunView)
    assert view.run_id == created.run_id
    assert view.run.output_path == str(output)
    assert view.lease is None
    assert view.saved_cap == 5
    assert view.effective_cap == 5
    assert isinstance(view.manifest, Manifest)
    assert view.manifest.schema_version == 2
    assert view.manifest.selection_policy == "latest_allocated"

    found = client.find_run(output)
    assert found is not None
    assert found.run_id == created.run_id
    assert client.find_run(root / "nothing-here" / "out.jsonl") is None

    page = client.list_runs(limit=1)
    assert len(page.runs) == 1
    ids = [r.run_id for r in client.iter_runs(page_size=1)]
    assert created.run_id in ids
    assert len(ids) == len(set(ids)), "paging repeats no run"


def test_validate_reuse_drift_and_override(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run()
    reuse = client.validate(spec.run_id, spec.config, spec.global_config, spec.source, spec.rows)
    assert reuse.outcome == "reuse"
    assert reuse.reuse
    assert reuse.rows_compared is True
    assert reuse.operational_keys == []
    assert reuse.drift_event_id is None

    drifted_tree = copy.deepcopy(spec.global_config)
    drifted_tree["agent"]["responses_api_agents"]["simple_agent"]["sandbox_port"] = 8001
    drift = client.validate(spec.run_id, spec.config, drifted_tree, spec.source)
    assert drift.drifted
    assert drift.rows_compared is False
    assert drift.operational_keys == [
        "servers.agent.responses_api_agents.simple_agent.sandbox_port"
    ]
    assert drift.drift_event_id
    assert drift.config_digest != reuse.config_digest

    changed = copy.deepcopy(spec.config)
    changed["responses_create_params"]["temperature"] = 0.9
    overridden = client.validate(
        spec.run_id, changed, spec.global_config, spec.source, allow_unsafe=True
    )
    assert overridden.outcome == "overridden"
    assert overridden.manifest is not None
    assert overridden.manifest.identity_overridden is True
    assert [k.rsplit(".", 2)[-2:] for k in overridden.semantic_keys] == [
        ["responses_create_params", "temperature"]
    ]

    # The service recorded the three, newest first, with the keys each was answered with.
    recorded = list(client.iter_validations(spec.run_id, page_size=1))
    assert [v.outcome for v in recorded] == ["overridden", "resume_with_drift", "reuse"]
    assert recorded[1].operational_keys == drift.operational_keys
    assert recorded[0].semantic_keys == overridden.semantic_keys
    assert len({v.event_id for v in recorded}) == 3, "paging repeats no validation"
    first = client.validations(spec.run_id, limit=2)
    assert [v.event_id for v in first.validations] == [v.event_id for v in recorded[:2]]
    assert first.next_cursor is not None


@pytest.mark.parametrize(
    ("tree", "sent"),
    [
        ({"p": "${oc.env:NG_PROMPT,d}"}, {"NG_PROMPT": "A"}),
        ({"p": "${oc.env:'NG_PROMPT',d}"}, {"NG_PROMPT": "A"}),
        ({"p": '${oc.env:"NG_PROMPT",d}'}, {"NG_PROMPT": "A"}),
        ({"p": "x\\${oc.env:NG_PROMPT,d}"}, {}),
        ({"p": "x\\\\${oc.env:NG_PROMPT,d}"}, {"NG_PROMPT": "A"}),
        ({"p": ["${oc.env:HOME}/cache"]}, {"HOME": "/h"}),
        ({"OPENAI_API_KEY": "${oc.env:OPENAI_API_KEY}"}, {}),
        ({"m": {"api_key": "${oc.env:PLAIN}"}}, {}),
        ({"h": {"X-Auth": "Bearer ${oc.env:PLAIN}"}}, {}),
        ({"secrets": {"openai": "${oc.env:PLAIN}"}}, {}),
        ({"env": [{"name": "HF_TOKEN", "value": "${oc.env:PLAIN}"}]}, {}),
        ({"cmd": "run API_KEY=${oc.env:PLAIN} --home ${oc.env:HOME}"}, {"HOME": "/h"}),
        ({"url": "postgres://u:${oc.env:PLAIN}@h/${oc.env:HOME}"}, {"HOME": "/h"}),
    ],
)
def test_referenced_environment_sends_what_is_resolved_and_nothing_redacted(
    tree: dict[str, Any], sent: dict[str, str]
) -> None:
    """Quoted names and an escaped backslash before a live reference are sent (hostile review
    35: they were missed, so a change went unnoticed); what the service redacts before it
    resolves is not (it sent secrets under ``api_key`` and in ``Bearer ...``)."""
    environ = {"NG_PROMPT": "A", "HOME": "/h", "PLAIN": "sk-secret", "OPENAI_API_KEY": "sk"}
    assert referenced_environment(tree, environ=environ) == sent


def test_environment_a_configuration_names_is_sent_so_a_changed_value_is_refused(
    client: RecoveryClient, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``${oc.env:NAME,default}`` took its default when nothing was sent, so a resume after
    NAME changed was reused (gap review 34); the client now sends what the tree names."""
    monkeypatch.setenv("RR_CLIENT_TEST_PROMPT", "grade strictly")
    monkeypatch.setenv("RR_CLIENT_TEST_API_KEY", "sk-never-sent")
    output, source = new_output(root, "env")
    config, tree = bundle()
    agent = tree["agent"]["responses_api_agents"]["simple_agent"]
    agent["review_prompt"] = "${oc.env:RR_CLIENT_TEST_PROMPT,default prompt}"
    agent["api_key"] = "${oc.env:RR_CLIENT_TEST_API_KEY}"
    assert referenced_environment(config, tree) == {"RR_CLIENT_TEST_PROMPT": "grade strictly"}
    rows = input_rows(1)
    run_id = client.create_run(output, source, config, tree, rows).run_id
    assert client.validate(run_id, config, tree, source, rows).outcome == "reuse"
    monkeypatch.setenv("RR_CLIENT_TEST_PROMPT", "grade leniently")
    with pytest.raises(ResumeRefusedError) as refused:
        client.validate(run_id, config, tree, source, rows)
    assert [k.rsplit(".", 1)[-1] for k in refused.value.keys] == ["review_prompt"]
    # Caught where code caught the Python module's ConfigError.
    assert isinstance(refused.value, ConfigError)
    # An explicit mapping is sent as it is (here: the value the run was created with).
    again = client.validate(
        run_id, config, tree, source, rows, environment={"RR_CLIENT_TEST_PROMPT": "grade strictly"}
    )
    assert again.outcome == "reuse"


def test_path_helpers_name_the_files_the_service_writes(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    """The Python module's ``*_path_for`` names, kept for code moving to the service."""
    spec = new_run(tasks=1)
    manifest = manifest_path_for(spec.output)
    assert manifest.is_file()
    assert config_identity_path_for(manifest).is_file()
    assert materialized_path_for(spec.output).is_file()
    assert failures_path_for(spec.output).is_file()
    lease = client.acquire_lease(spec.run_id, "paths", ttl_seconds=30)
    assert run_lock_path_for(spec.output).is_file()
    assert coverage_path_for(spec.output).is_file()
    drifted = copy.deepcopy(spec.global_config)
    drifted["agent"]["responses_api_agents"]["simple_agent"]["sandbox_port"] = 8123
    client.validate(spec.run_id, spec.config, drifted, spec.source, lease_id=lease.lease_id)
    assert resume_drift_path_for(manifest).read_text(encoding="utf-8").count("\n") == 1
    client.release_lease(spec.run_id, lease.lease_id)


def test_lease_operations(client: RecoveryClient, new_run: Callable[..., RunSpec]) -> None:
    spec = new_run()
    lease = client.acquire_lease(spec.run_id, "collector-a", ttl_seconds=30, host="node-7", pid=42)
    assert lease.run_id == spec.run_id
    assert lease.holder == "collector-a"
    assert lease.lease_id not in repr(lease), "the lease id is the holder's secret"

    status = client.lease_holder(spec.run_id)
    assert status.holder is not None
    assert (status.holder.holder, status.holder.host, status.holder.pid) == (
        "collector-a",
        "node-7",
        42,
    )
    assert status.locked_outside_service is False
    assert client.get_run(spec.run_id).lease is not None

    renewed = client.heartbeat(spec.run_id, lease.lease_id, ttl_seconds=60)
    assert renewed.lease_id == lease.lease_id
    assert renewed.expires_at > lease.expires_at

    taken = client.takeover_lease(spec.run_id, "operator-b", "collector-a is stuck", ttl_seconds=30)
    assert taken.lease_id != lease.lease_id
    holder = client.lease_holder(spec.run_id).holder
    assert holder is not None
    assert holder.holder == "operator-b"

    client.release_lease(spec.run_id, taken.lease_id)
    assert client.lease_holder(spec.run_id).holder is None


def test_reserve_extend_and_resubmit(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run(tasks=2)
    lease = client.acquire_lease(spec.run_id, "c", ttl_seconds=30)
    assert client.reserve_attempts(spec.run_id, lease.lease_id, ["0-0", "1-0"]) == {
        "0-0": 0,
        "1-0": 0,
    }
    assert client.reserve_attempts(spec.run_id, lease.lease_id, ["0-0"]) == {"0-0": 1}
    manifest = client.get_run(spec.run_id).manifest
    assert manifest is not None
    assert manifest.next_attempt == {"0-0": 2, "1-0": 1}
    client.release_lease(spec.run_id, lease.lease_id)

    extension = client.extend_attempts(spec.run_id, 2, "provider outage")
    assert extension.extend_attempts == 2
    assert extension.run_id == spec.run_id
    assert extension.reason == "provider outage"
    view = client.get_run(spec.run_id)
    assert (view.saved_cap, view.attempt_extension, view.effective_cap) == (3, 2, 5)
    assert client.plan(spec.run_id).cap == 5

    append_jsonl(spec.failures, [failure_row(spec.run_id, 1)])
    resubmit = client.resubmit(spec.run_id, "start the budget over")
    assert resubmit.run_id == spec.run_id
    assert resubmit.line_offset == 1


def test_an_outcome_line_is_checked_before_it_is_saved(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run(tasks=2)
    lease = client.acquire_lease(spec.run_id, "c", ttl_seconds=30)
    client.reserve_attempts(spec.run_id, lease.lease_id, ["0-0"])
    row = result_row(spec.run_id, 0)
    line = json.dumps(row, separators=(",", ":"))
    checked = client.check_outcome(spec.run_id, line)
    assert (checked.artifact, checked.rollout_id, checked.attempt, checked.disposition) == (
        "results",
        "0-0",
        0,
        "new",
    )
    failure = client.check_outcome(spec.run_id, json.dumps(failure_row(spec.run_id, 0)).encode())
    assert (failure.artifact, failure.disposition) == ("failures", "new")
    with pytest.raises(OutcomeRefusedError) as refused:
        client.check_outcome(spec.run_id, json.dumps(result_row(spec.run_id, 1)))
    assert refused.value.reason == "unreserved"
    assert refused.value.status == 422
    append_jsonl(spec.output, [row])
    assert client.check_outcome(spec.run_id, line + "\n").disposition == "already_saved"
    with pytest.raises(OutcomeRefusedError) as conflict:
        client.check_outcome(spec.run_id, json.dumps({**row, "reward": 0.0}))
    assert conflict.value.reason == "conflicting_outcomes"
    client.release_lease(spec.run_id, lease.lease_id)


def test_rejudgment_admit_reopen_and_close(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run(tasks=1)
    lease = client.acquire_lease(spec.run_id, "c", ttl_seconds=30)
    client.reserve_attempts(spec.run_id, lease.lease_id, ["0-0"])
    answer = {"output": [{"type": "message"}], "status": "completed"}
    (line,) = append_jsonl(
        spec.failures,
        [failure_row(spec.run_id, 0, _ng_failure_class="judge_failed", response=answer)],
    )
    assert client.plan(spec.run_id).entries[0].state == "judge_recoverable"

    admitted = client.admit_rejudgment(spec.run_id, lease.lease_id, "0-0", 0, "failure-1", line)
    assert admitted.already_open is False
    assert admitted.attempt_key == "0-0-a0"
    assert admitted.predecessor_failure_id == "failure-1"
    assert len(admitted.predecessor_sha256) == 64
    manifest = client.get_run(spec.run_id).manifest
    assert manifest is not None
    assert manifest.pending_rejudge["0-0-a0"].operation_id == admitted.operation_id

    again = client.admit_rejudgment(
        spec.run_id, lease.lease_id, "0-0", 0, "failure-1", (line + "\n").encode()
    )
    assert again.already_open is True
    assert again.operation_id == admitted.operation_id

    # The re-judged outcome: the same attempt, naming the line it grades again.
    append_jsonl(spec.output, [result_row(spec.run_id, 0, _ng_rejudge=admitted.marker())])
    assert client.plan(spec.run_id).entries[0].state == "scored"
    client.close_rejudgment(spec.run_id, admitted.operation_id, lease.lease_id, "graded")
    manifest = client.get_run(spec.run_id).manifest
    assert manifest is not None
    assert manifest.pending_rejudge == {}
    client.release_lease(spec.run_id, lease.lease_id)


def _plan_fixture(client: RecoveryClient, spec: RunSpec) -> None:
    """Task 0 scored, task 1 masked with a kept answer (awaiting approval), task 2 failed
    (retryable), task 3 never dispatched (missing)."""
    lease = client.acquire_lease(spec.run_id, "c", ttl_seconds=30)
    client.reserve_attempts(spec.run_id, lease.lease_id, ["0-0", "1-0", "2-0"])
    client.release_lease(spec.run_id, lease.lease_id)
    append_jsonl(spec.output, [result_row(spec.run_id, 0), masked_row(spec.run_id, 1)])
    append_jsonl(spec.failures, [failure_row(spec.run_id, 2)])


def test_plan_pages_and_filters(client: RecoveryClient, new_run: Callable[..., RunSpec]) -> None:
    spec = new_run(tasks=4)
    _plan_fixture(client, spec)
    plan = client.plan(spec.run_id)
    assert isinstance(plan, Plan)
    assert plan.state_counts == {"scored": 1, "awaiting_approval": 1, "retryable": 1, "missing": 1}
    assert [e.state for e in plan.entries] == [
        "scored",
        "awaiting_approval",
        "retryable",
        "missing",
    ]
    retryable = plan.entries[2]
    assert (retryable.rollout_id, retryable.next_attempt, retryable.counted_failures) == (
        "2-0",
        1,
        1,
    )
    assert retryable.failure_kind == "agent_run_error"
    assert plan.coverage.expected == 4
    assert plan.coverage.successful == 2
    assert plan.completion is not None
    assert plan.completion.exit_code == 75
    assert plan.next_cursor is None
    assert {"entries", "coverage", "budget_message", "warnings"} <= set(plan.raw)

    only = client.plan(spec.run_id, state="retryable")
    assert [e.rollout_id for e in only.entries] == ["2-0"]
    assert only.state_counts == plan.state_counts, "counts are over the whole run"

    first = client.plan(spec.run_id, limit=1)
    assert len(first.entries) == 1
    assert first.next_cursor is not None
    second = client.plan(spec.run_id, limit=1, cursor=first.next_cursor)
    assert second.entries[0].rollout_id == "1-0"

    assert [e.rollout_id for e in client.iter_plan(spec.run_id, page_size=1)] == [
        "0-0",
        "1-0",
        "2-0",
        "3-0",
    ]
    assert [e.rollout_id for e in client.iter_plan(spec.run_id, state="missing")] == ["3-0"]


def test_classify(client: RecoveryClient) -> None:
    decisions = client.classify(
        [failure_row("r", 0), result_row("r", 0)], retry_terminal_timeouts=False
    )
    assert [d.verdict for d in decisions] == ["retry", "keep"]
    failure, result = decisions
    assert failure.is_failure_row
    assert failure.failure_kind == "agent_run_error"
    assert failure.responsibility == "model"
    assert result.keeps_saved_answer
    assert "has_saved_generation" in result.raw


def test_drift_pages_filters_and_iterator(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run()
    key = "servers.agent.responses_api_agents.simple_agent.sandbox_port"
    event_ids = []
    for port in (8001, 8002, 8003):
        tree = copy.deepcopy(spec.global_config)
        tree["agent"]["responses_api_agents"]["simple_agent"]["sandbox_port"] = port
        verdict = client.validate(spec.run_id, spec.config, tree, spec.source)
        event_ids.append(verdict.drift_event_id)

    page = client.drift(run_id=spec.run_id, limit=2)
    assert [e.event_id for e in page.events] == event_ids[:2]
    assert page.next_cursor is not None
    events = list(client.iter_drift(run_id=spec.run_id, page_size=1))
    assert [e.event_id for e in events] == event_ids
    assert all(e.operational_keys == [key] for e in events)
    assert all(e.run_id == spec.run_id for e in events)
    assert events[0].saved_config_digest != events[0].current_config_digest

    across = [e.event_id for e in client.iter_drift(key=key, page_size=2)]
    assert set(event_ids) <= set(across)
    filtered = client.drift(run_id=spec.run_id, key="no.such.key")
    assert filtered.events == []
    assert client.drift(from_="2999-01-01T00:00:00Z").events == []
    since = list(client.iter_drift(run_id=spec.run_id, from_=events[1].at))
    assert [e.event_id for e in since] == event_ids[1:]
    # The journal beside the manifest holds one line per resume across drift.
    journal = spec.companion("_manifest_resume_drift.jsonl").read_text().splitlines()
    assert len(journal) == 3

    # Following in recorded order: what is there, then only what is recorded since.
    followed, cursor = client.drift_since(run_id=spec.run_id, page_size=2)
    assert [e.event_id for e in followed] == event_ids
    assert client.drift_since(cursor, run_id=spec.run_id) == ([], cursor)
    tree = copy.deepcopy(spec.global_config)
    tree["agent"]["responses_api_agents"]["simple_agent"]["sandbox_port"] = 8004
    later = client.validate(spec.run_id, spec.config, tree, spec.source).drift_event_id
    new, _ = client.drift_since(cursor, run_id=spec.run_id)
    assert [e.event_id for e in new] == [later]
    assert next(client.follow_drift(cursor, run_id=spec.run_id)).event_id == later
    # At most max_events, whatever the page size: the rest follows from the cursor.
    for page_size in (1, 100):
        bounded, partway = client.drift_since(run_id=spec.run_id, page_size=page_size, max_events=2)
        assert [e.event_id for e in bounded] == event_ids[:2]
        rest, _ = client.drift_since(partway, run_id=spec.run_id)
        assert [e.event_id for e in rest] == [*event_ids[2:], later]
    bad_counts: list[Any] = [0, -1, True, 1.5]
    for bad in bad_counts:
        with pytest.raises(ValueError, match="max_events"):
            client.drift_since(run_id=spec.run_id, max_events=bad)
    bad_intervals: list[Any] = [0, -1, float("nan"), float("inf"), True]
    for bad in bad_intervals:
        with pytest.raises(ValueError, match="interval"):
            client.follow_drift(interval=bad)


def test_bad_arguments_are_refused_before_any_request() -> None:
    # Nothing listens on port 1: an argument that reached the network would raise
    # RecoveryConnectionError instead of the error asserted.
    client = RecoveryClient("http://127.0.0.1:1", retry=RetryPolicy(max_attempts=1))
    naive = datetime(2026, 1, 1)
    cases: list[tuple[str, type[Exception], str, Callable[[], object]]] = [
        (
            "one string of ids",
            TypeError,
            "rollout_ids",
            lambda: client.reserve_attempts("r", "l", "0-0"),
        ),
        ("an empty run id", ValueError, "run_id", lambda: client.get_run("")),
        ("an empty run id to drift", ValueError, "run_id", lambda: client.drift(run_id="")),
        ("a run id that is no string", TypeError, "run_id", lambda: client.plan(7)),  # type: ignore[arg-type]
        (
            "an empty approval id",
            ValueError,
            "approval_id",
            lambda: client.revoke_approval("r", ""),
        ),
        ("a limit of 0", ValueError, "limit", lambda: client.drift(limit=0)),
        ("a limit that is a bool", ValueError, "limit", lambda: client.drift(limit=True)),
        ("a naive datetime", ValueError, "from_", lambda: client.drift(from_=naive)),
        ("a naive upper bound", ValueError, "to", lambda: list(client.iter_drift(to=naive))),
        ("a naive bound to follow", ValueError, "from_", lambda: client.follow_drift(from_=naive)),
        (
            "a page size of 0",
            ValueError,
            "page_size",
            lambda: list(client.iter_plan("r", page_size=0)),
        ),
        (
            "a page size of -1",
            ValueError,
            "page_size",
            lambda: list(client.iter_runs(page_size=-1)),
        ),
        (
            "a drift page size",
            ValueError,
            "page_size",
            lambda: list(client.iter_drift(page_size=0)),
        ),
        ("a time of another type", TypeError, "from_", lambda: client.drift(from_=1.5)),  # type: ignore[arg-type]
    ]
    for case, error, name, call in cases:
        with pytest.raises(error) as refused:
            call()
        assert name in str(refused.value), f"{case}: {refused.value}"


def test_drift_takes_aware_datetimes(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run()
    tree = copy.deepcopy(spec.global_config)
    tree["agent"]["responses_api_agents"]["simple_agent"]["sandbox_port"] = 8011
    event_id = client.validate(spec.run_id, spec.config, tree, spec.source).drift_event_id
    [event] = client.drift(run_id=spec.run_id).events
    assert event.event_id == event_id
    at = datetime.fromisoformat(event.at.replace("Z", "+00:00"))
    later = at.astimezone(timezone(timedelta(hours=5)))
    assert [e.event_id for e in client.drift(run_id=spec.run_id, from_=later).events] == [event_id]
    assert client.drift(run_id=spec.run_id, to=later).events == []


def test_a_drift_follower_outlives_a_restart_and_resumes_from_its_cursor(tmp_path: Path) -> None:
    service = start_service(tmp_path / "svc")
    port = int(service.url.rsplit(":", 1)[1])
    try:
        client = service.client()
        spec = make_run(client, service.root, name="follow")
        tree = copy.deepcopy(spec.global_config)

        def record(port_value: int) -> str:
            tree["agent"]["responses_api_agents"]["simple_agent"]["sandbox_port"] = port_value
            verdict = client.validate(spec.run_id, spec.config, tree, spec.source)
            assert verdict.drift_event_id is not None
            return verdict.drift_event_id

        first = record(8101)
        follower = client.follow_drift(interval=0.05, run_id=spec.run_id)
        assert next(follower).event_id == first
        # The service goes away (kill -9) while the follower waits for the next event; it
        # keeps asking, and takes the event recorded once the service is back.
        service.stop(graceful=False)
        taken: queue.Queue[str] = queue.Queue()
        waiting = threading.Thread(target=lambda: taken.put(next(follower).event_id), daemon=True)
        waiting.start()
        service = start_service(tmp_path / "svc", port=port)
        second = record(8102)
        assert taken.get(timeout=60) == second
        # Its cursor is where to start again: the page it had not finished with (the second
        # event: at least once), then what was recorded after, never the first event.
        third = record(8103)
        again = client.follow_drift(follower.cursor, interval=0.05, run_id=spec.run_id)
        assert [next(again).event_id, next(again).event_id] == [second, third]
    finally:
        service.stop()


def test_approvals_create_list_revoke(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run(tasks=4)
    _plan_fixture(client, spec)
    approval = client.create_approval(spec.run_id, 1, 0, 0, "the verifier lost the artifact")
    assert isinstance(approval, Approval)
    assert (approval.task_index, approval.rollout_index, approval.attempt_index) == (1, 0, 0)
    assert approval.active
    assert client.plan(spec.run_id, state="approved_rerun").entries[0].next_attempt == 1

    listed = client.list_approvals(spec.run_id)
    assert [a.approval_id for a in listed] == [approval.approval_id]

    client.revoke_approval(spec.run_id, approval.approval_id)
    (revoked,) = client.list_approvals(spec.run_id)
    assert revoked.revoked_at is not None
    assert not revoked.active
    assert client.plan(spec.run_id).state_counts.get("awaiting_approval") == 1


def test_reindex_and_raw_request(client: RecoveryClient, new_run: Callable[..., RunSpec]) -> None:
    spec = new_run()
    report = client.reindex()
    assert report.manifests >= 1
    assert "drift_inserted" in report.raw
    raw = client.request("GET", f"/runs/{spec.run_id}")
    assert raw["run"]["run_id"] == spec.run_id
    assert client.request("GET", "/healthz") == "ok"


def test_results_keep_unknown_fields(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run()
    view = client.get_run(spec.run_id)
    assert set(view.raw) >= {"run", "manifest", "lease", "saved_cap"}
    assert view.manifest is not None
    assert view.manifest.raw["pending_rejudge"] == {}


def test_repr_hides_the_token(service: Service) -> None:
    with RecoveryClient(service.url, "very-secret-token-value") as c:
        assert "very-secret-token-value" not in repr(c)
        assert "token=<set>" in repr(c)


def test_lease_holder_appears_while_held(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run()
    with client.lease(spec.run_id, "watcher", ttl_seconds=30) as held:
        status = client.lease_holder(spec.run_id)
        assert status.holder is not None
        assert status.holder.holder == "watcher"
        assert held.ttl == 30
    assert client.lease_holder(spec.run_id).holder is None
