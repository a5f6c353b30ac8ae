"""The exit-code helper: the seed's ``IncompleteEvaluationError`` rule, computed from a plan,
agreeing with the service's own completion check on real runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from rollout_recovery_client import (
    RESERVABLE_STATES,
    IncompleteEvaluationError,
    NotEligibleError,
    RecoveryClient,
    check_complete,
    exit_code,
    has_only_intentional_gaps,
    incomplete_error,
)
from support import RunSpec, append_jsonl, failure_row, masked_row, result_row


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        ({"scored": 3}, 0),
        ({"scored": 2, "model_final": 1}, 0),
        ({"scored": 2, "omitted": 1}, 0),  # only intentional gaps beside completed ones
        ({"omitted": 2}, 76),  # omissions alone invent nothing: not complete, nothing to run
        ({"scored": 1, "missing": 2}, 75),
        ({"scored": 1, "retryable": 1, "exhausted": 1}, 75),
        ({"scored": 1, "judge_recoverable": 1}, 75),
        ({"scored": 1, "approved_rerun": 1}, 75),
        ({"missing": 3}, 1),
        ({"retryable": 1, "terminal": 1}, 1),
        ({"scored": 1, "exhausted": 2}, 76),
        ({"scored": 1, "masked": 1}, 76),
        ({"scored": 1, "terminal": 1}, 76),
        ({"scored": 1, "awaiting_approval": 1}, 76),
        ({"terminal": 1}, 76),
    ],
)
def test_exit_codes(counts: dict[str, int], expected: int) -> None:
    assert exit_code(counts) == expected
    error = incomplete_error(counts)
    assert (error is None) == (expected == 0)
    if error is not None:
        assert error.exit_code == expected
        with pytest.raises(IncompleteEvaluationError):
            check_complete(counts)
    else:
        check_complete(counts)


def test_seed_error_semantics() -> None:
    assert IncompleteEvaluationError("x").exit_code == 75
    assert IncompleteEvaluationError("x", made_progress=False).exit_code == 1
    assert IncompleteEvaluationError("x", retryable=False).exit_code == 76
    assert IncompleteEvaluationError("x", retryable=False, made_progress=False).exit_code == 76
    assert has_only_intentional_gaps(3, 2, 1)
    assert not has_only_intentional_gaps(3, 0, 3)
    assert not has_only_intentional_gaps(3, 1, 1)


def _omission(run_id: str, task: int) -> dict[str, Any]:
    return failure_row(
        run_id,
        task,
        terminal=True,
        _ng_failure_class="skipped",
        _ng_omitted=True,
        _ng_failure_message="omitted on purpose",
    )


@pytest.mark.parametrize(
    ("name", "results", "failures"),
    [
        ("nothing saved", [], []),
        ("partial", [("result", 0)], []),
        ("complete", [("result", 0), ("result", 1), ("result", 2)], []),
        ("awaiting approval", [("result", 0), ("masked", 1), ("result", 2)], []),
        ("terminal", [("result", 0), ("result", 1)], [("terminal", 2)]),
        ("intentional gaps", [("result", 0), ("result", 1)], [("omission", 2)]),
        ("retryable", [("result", 0), ("result", 1)], [("failure", 2)]),
    ],
)
def test_agrees_with_the_service(
    client: RecoveryClient,
    new_run: Callable[..., RunSpec],
    name: str,
    results: Sequence[tuple[str, int]],
    failures: Sequence[tuple[str, int]],
) -> None:
    spec = new_run(tasks=3, name=name.replace(" ", "-"))
    lease = client.acquire_lease(spec.run_id, "c", ttl_seconds=30)
    client.reserve_attempts(spec.run_id, lease.lease_id, ["0-0", "1-0", "2-0"])
    client.release_lease(spec.run_id, lease.lease_id)
    shapes = {
        "result": lambda t: result_row(spec.run_id, t),
        "masked": lambda t: masked_row(spec.run_id, t),
        "failure": lambda t: failure_row(spec.run_id, t),
        "terminal": lambda t: failure_row(spec.run_id, t, terminal=True),
        "omission": lambda t: _omission(spec.run_id, t),
    }
    append_jsonl(spec.output, [shapes[kind](t) for kind, t in results])
    append_jsonl(spec.failures, [shapes[kind](t) for kind, t in failures])
    plan = client.plan(spec.run_id, limit=1)
    assert plan.completion is not None
    assert exit_code(plan) == plan.completion.exit_code, (name, plan.state_counts)
    assert plan.completion.complete == (plan.completion.exit_code == 0)
    error = incomplete_error(plan)
    if error is None:
        assert plan.completion.exit_code == 0
    else:
        assert error.message == plan.completion.message


def test_reservable_states_are_the_plan_entries_with_a_next_attempt(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    """A collector reserving every rollout in ``RESERVABLE_STATES`` is never refused, and one
    in any other state (here a judge-recoverable failure, re-judged rather than run again, and
    a scored answer) is: the set is what the service reserves."""
    spec = new_run(tasks=5, name="reservable")
    lease = client.acquire_lease(spec.run_id, "c", ttl_seconds=30)
    client.reserve_attempts(spec.run_id, lease.lease_id, ["0-0", "1-0", "2-0", "3-0"])
    append_jsonl(spec.output, [result_row(spec.run_id, 0), masked_row(spec.run_id, 3)])
    append_jsonl(
        spec.failures,
        [
            failure_row(
                spec.run_id,
                1,
                _ng_failure_class="judge_failed",
                response={"output": [{"type": "message"}], "status": "completed"},
            ),
            failure_row(spec.run_id, 2),
        ],
    )
    entries = list(client.iter_plan(spec.run_id))
    states = {e.rollout_id: e.state for e in entries}
    assert set(states.values()) >= {"scored", "judge_recoverable", "retryable", "missing"}
    for entry in entries:
        assert (entry.next_attempt is not None) == (entry.state in RESERVABLE_STATES), entry
    reservable = [e.rollout_id for e in entries if e.state in RESERVABLE_STATES]
    assert set(client.reserve_attempts(spec.run_id, lease.lease_id, reservable)) == set(reservable)
    for state in ("scored", "judge_recoverable"):
        (rollout,) = [r for r, s in states.items() if s == state]
        with pytest.raises(NotEligibleError):
            client.reserve_attempts(spec.run_id, lease.lease_id, [rollout])
    client.release_lease(spec.run_id, lease.lease_id)
