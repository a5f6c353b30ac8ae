"""The collector's completion check, computed from a plan as the service computes it.

A run is complete when every rollout has its final result (``scored`` or ``model_final``), or
when the only gaps are intentional omissions beside completed rollouts
(``has_only_intentional_gaps``). Otherwise it is an :class:`IncompleteEvaluationError` with

- ``retryable``: some rollout is in a state a resume runs (``missing``, ``retryable``,
  ``approved_rerun``, ``judge_recoverable``);
- ``made_progress``: at least one rollout is complete;

and its ``exit_code`` is ``(75 if made_progress else 1) if retryable else 76``: 75 asks the
scheduler to run again, 1 is an ordinary failure with nothing to build on, 76 says a resume
cannot help (only ``exhausted``, ``terminal``, ``masked`` or ``awaiting_approval`` gaps remain).
"""

from __future__ import annotations

from collections.abc import Mapping

from .errors import IncompleteEvaluationError
from .models import Plan

__all__ = [
    "COMPLETED_STATES",
    "PLAN_STATES",
    "RESERVABLE_STATES",
    "RUNNABLE_STATES",
    "check_complete",
    "exit_code",
    "has_only_intentional_gaps",
    "incomplete_error",
]

#: Every plan state, in the service's order.
PLAN_STATES = (
    "scored",
    "model_final",
    "judge_recoverable",
    "retryable",
    "exhausted",
    "terminal",
    "missing",
    "masked",
    "omitted",
    "awaiting_approval",
    "approved_rerun",
)
#: States whose rollout has its final result.
COMPLETED_STATES = frozenset({"scored", "model_final"})
#: States a resume makes progress on: a judge-recoverable rollout by a re-judgment of its saved
#: answer, the others by a new execution (``RESERVABLE_STATES``).
RUNNABLE_STATES = frozenset({"missing", "retryable", "approved_rerun", "judge_recoverable"})
#: States ``reserve_attempts`` gives an execution number to (the plan entries with a
#: ``next_attempt``); a batch naming a rollout in any other state is refused whole
#: (``NotEligibleError``).
RESERVABLE_STATES = frozenset({"missing", "retryable", "approved_rerun"})


def has_only_intentional_gaps(expected: int, completed: int, intentionally_omitted: int) -> bool:
    """Accept omissions only alongside completed tasks, without inventing scores."""
    return completed > 0 and completed + intentionally_omitted == expected


def _counts(plan: Plan | Mapping[str, int]) -> Mapping[str, int]:
    return plan.state_counts if isinstance(plan, Plan) else plan


def incomplete_error(plan: Plan | Mapping[str, int]) -> IncompleteEvaluationError | None:
    """``None`` when the run is complete, else the error a collector raises (or exits with)."""
    counts = _counts(plan)
    expected = sum(counts.values())
    completed = sum(counts.get(state, 0) for state in COMPLETED_STATES)
    omitted = counts.get("omitted", 0)
    if completed == expected:
        return None
    if has_only_intentional_gaps(expected, completed, omitted):
        return None
    order = {state: i for i, state in enumerate(PLAN_STATES)}
    gaps = ", ".join(
        f"{n} {state}"
        for state, n in sorted(counts.items(), key=lambda kv: order.get(kv[0], len(order)))
        if n > 0 and state not in COMPLETED_STATES
    )
    retryable = any(counts.get(state, 0) > 0 for state in RUNNABLE_STATES)
    # Exit 76 says a resume alone cannot help: the message says what can (as the service's).
    next_step = (
        "saved partial results are valid and a resume continues them"
        if retryable
        else "saved partial results are valid, but a resume has nothing to run: approve masked "
        "reruns, extend attempts or resubmit first"
    )
    return IncompleteEvaluationError(
        f"{completed}/{expected} samples completed ({gaps}); {next_step}.",
        retryable=retryable,
        made_progress=completed > 0,
    )


def exit_code(plan: Plan | Mapping[str, int]) -> int:
    """What a collector exits with: 0 complete, 75 progress a resume continues, 1 no progress,
    76 nothing a resume can run."""
    error = incomplete_error(plan)
    return 0 if error is None else error.exit_code


def check_complete(plan: Plan | Mapping[str, int]) -> None:
    """Raise :class:`IncompleteEvaluationError` unless the run is complete."""
    error = incomplete_error(plan)
    if error is not None:
        raise error
