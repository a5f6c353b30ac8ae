"""Roles on a service with tokens, and tokens never leaking from the client."""

from __future__ import annotations

import logging

import pytest

from rollout_recovery_client import (
    ForbiddenError,
    LeaseLostError,
    LeaseNotHeldError,
    RecoveryClient,
    RecoveryError,
    UnauthenticatedError,
    guard_run,
)
from support import (
    COLLECTOR_TOKEN,
    OPERATOR_TOKEN,
    TOKENS,
    VIEWER_TOKEN,
    Service,
    bundle,
    input_rows,
    new_output,
)


def test_no_token_and_unknown_token_are_unauthenticated(auth_service: Service) -> None:
    with auth_service.client() as anonymous, pytest.raises(UnauthenticatedError) as caught:
        anonymous.list_runs()
    assert caught.value.status == 401
    with auth_service.client("not-a-token-the-service-knows") as stranger:
        with pytest.raises(UnauthenticatedError) as unknown:
            stranger.list_runs()
        assert "not-a-token-the-service-knows" not in str(unknown.value)
        assert "not-a-token-the-service-knows" not in repr(unknown.value)
        # Liveness needs no token.
        assert stranger.healthz()


def test_collector_owns_runs_but_does_not_operate(
    auth_service: Service,
    collector: RecoveryClient,
    operator: RecoveryClient,
    viewer: RecoveryClient,
) -> None:
    output, source = new_output(auth_service.root, "roles")
    config, tree = bundle(limit=2)
    rows = input_rows(2)
    with guard_run(collector, output, config, tree, rows, source, holder="col") as guard:
        assert guard.created
        assert guard.outcome == "reuse"
        assert guard.reserve(["0-0"]) == {"0-0": 0}
        run_id = guard.run_id
        with pytest.raises(ForbiddenError) as forbidden:
            collector.takeover_lease(run_id, "col", "mine now")
        assert forbidden.value.status == 403
        assert "operator" in forbidden.value.message
        for call in (
            lambda: collector.extend_attempts(run_id, 1, "more"),
            lambda: collector.create_approval(run_id, 0, 0, 0, "rerun"),
            lambda: collector.reindex(),
            lambda: collector.create_run(output, source, config, tree, rows, replace=True),
        ):
            with pytest.raises(ForbiddenError):
                call()
        # The viewer reads everything, changes nothing.
        assert viewer.get_run(run_id).run_id == run_id
        assert viewer.plan(run_id).state_counts == {"missing": 2}
        assert viewer.list_approvals(run_id) == []
        assert viewer.drift(run_id=run_id).events == []
        assert [
            d.verdict
            for d in viewer.classify([{"reward": 1.0, "response": {"status": "completed"}}])
        ]
        with pytest.raises(ForbiddenError):
            viewer.validate(run_id, config, tree, source)
        with pytest.raises(ForbiddenError):
            viewer.acquire_lease(run_id, "v")
    # The operator takes the run over from the collector.
    with (
        pytest.raises(LeaseLostError) as lost,
        guard_run(collector, output, config, tree, rows, source, holder="col") as guard,
    ):
        taken = operator.takeover_lease(run_id, "op", "maintenance", ttl_seconds=30)
        holder = viewer.lease_holder(run_id).holder
        assert holder is not None
        assert holder.holder == "op"
    # The collector learnt it on leaving its block (the release found the lease gone).
    assert lost.value.run_id == run_id
    assert guard.lease_id not in str(lost.value)
    assert isinstance(lost.value.cause, LeaseNotHeldError)
    assert guard.lease_id not in lost.value.cause.message
    operator.release_lease(run_id, taken.lease_id)
    assert operator.extend_attempts(run_id, 1, "provider outage").extend_attempts == 1
    assert operator.reindex().manifests >= 1


def test_tokens_never_reach_repr_errors_or_logs(
    auth_service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []
    for token in (*TOKENS, "wrong-token-0123456789abcdef"):
        with RecoveryClient(auth_service.url, token) as c:
            seen.append(repr(c))
            try:
                c.get_run("no-such-run")
            except RecoveryError as error:
                seen += [str(error), repr(error), error.message, str(error.details)]
            try:
                c.reindex()
            except RecoveryError as error:
                seen += [str(error), repr(error)]
    seen += [record.getMessage() for record in caplog.records]
    assert any("no run no-such-run" in text for text in seen), "errors were seen"
    assert caplog.records, "the client and httpx logged at DEBUG"
    for token in (OPERATOR_TOKEN, COLLECTOR_TOKEN, VIEWER_TOKEN, "wrong-token-0123456789abcdef"):
        assert not [text for text in seen if token in text]
