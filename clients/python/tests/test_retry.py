"""Retries: only where safe, with exponential backoff, honouring ``Retry-After``.

The decisions are checked with a scripted transport (to script a lost answer or a 503 on a
call the real service would never answer so) and against the real service (an unreachable port,
real 409/422/423 answers that must not be retried).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from rollout_recovery_client import (
    LeaseNotHeldError,
    OverloadedError,
    RecoveryClient,
    RecoveryConnectionError,
    RecoveryError,
    ResumeRefusedError,
    RetryPolicy,
    RunLockedError,
    StartingError,
)
from rollout_recovery_client.errors import parse_retry_after
from support import RunSpec, Service, free_port


@dataclass
class Script:
    """Answers requests from a list of steps; records what was sent and what was slept."""

    steps: list[Callable[[httpx.Request], httpx.Response]]
    requests: list[httpx.Request] = field(default_factory=list)
    sleeps: list[float] = field(default_factory=list)

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        step = self.steps.pop(0) if len(self.steps) > 1 else self.steps[0]
        return step(request)

    def client(self, **policy: float | int) -> RecoveryClient:
        retry = RetryPolicy(sleep=self.sleeps.append, jitter=0, **policy)  # type: ignore[arg-type]
        return RecoveryClient(
            "http://service.test", transport=httpx.MockTransport(self.handle), retry=retry
        )


def answer(
    status: int, body: object = None, **headers: str
) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(status, json=body, headers=headers)


def overloaded(retry_after: str | None = "1") -> Callable[[httpx.Request], httpx.Response]:
    headers = {"retry-after": retry_after} if retry_after is not None else {}
    body = {"code": "overloaded", "message": "saturated", "details": {}}
    return lambda request: httpx.Response(503, json=body, headers=headers)


def lost_answer(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadError("connection reset by peer", request=request)


def refused_connection(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


PLAN = {
    "run_id": "r",
    "cap": 3,
    "state_counts": {"missing": 1},
    "coverage": {},
    "warnings": [],
    "completion": {"complete": False, "exit_code": 1},
    "entries": [],
}
LEASE = {"lease_id": "l", "run_id": "r", "holder": "h", "expires_at": "2030-01-01T00:00:00Z"}


def test_get_503_is_retried_honouring_retry_after() -> None:
    script = Script([overloaded("2"), overloaded("1"), answer(200, PLAN)])
    with script.client() as c:
        assert c.plan("r").state_counts == {"missing": 1}
    assert len(script.requests) == 3
    assert script.sleeps == [2.0, 1.0]


def test_a_starting_service_is_waited_for_like_an_overloaded_one() -> None:
    body = {"code": "starting", "message": "reindexing", "details": {}}
    starting = lambda request: httpx.Response(503, json=body, headers={"retry-after": "1"})  # noqa: E731
    script = Script([starting, starting, answer(200, PLAN)])
    with script.client() as c:
        assert c.plan("r").state_counts == {"missing": 1}
    assert script.sleeps == [1.0, 1.0]
    with Script([starting]).client(max_attempts=1) as c, pytest.raises(StartingError) as raised:
        c.plan("r")
    assert raised.value.retry_after == 1.0
    # Refused before anything was read or written: a call that changes a run is sent again too.
    script = Script([starting, answer(200, {"lease_id": "l"})])
    with script.client() as c:
        assert c.request("POST", "/runs/r/attempts/extend", json={"extend_attempts": 1}) == {
            "lease_id": "l"
        }
    assert len(script.requests) == 2


def test_503_without_retry_after_backs_off_exponentially() -> None:
    script = Script([overloaded(None)] * 3 + [answer(200, PLAN)])
    with script.client(initial_backoff=0.1, multiplier=2, max_backoff=0.3) as c:
        c.plan("r")
    assert script.sleeps == pytest.approx([0.1, 0.2, 0.3])


def test_retry_after_is_capped_and_attempts_are_bounded() -> None:
    script = Script([overloaded("3600")])
    with (
        script.client(max_attempts=3, max_retry_after=0.5) as c,
        pytest.raises(OverloadedError) as caught,
    ):
        c.plan("r")
    assert len(script.requests) == 3
    assert script.sleeps == [0.5, 0.5]
    assert caught.value.retry_after == 3600


def test_classify_and_heartbeat_are_idempotent() -> None:
    script = Script([overloaded(), answer(200, {"decisions": [{"verdict": "keep"}]})])
    with script.client() as c:
        assert [d.verdict for d in c.classify([{}])] == ["keep"]
    script = Script([lost_answer, answer(200, LEASE)])
    with script.client() as c:
        assert c.heartbeat("r", "l").holder == "h"
    assert len(script.requests) == 2


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.validate("r", {}, {}, "/s"),
        lambda c: c.acquire_lease("r", "h"),
        lambda c: c.reserve_attempts("r", "l", ["0-0"]),
        lambda c: c.create_run("/o", "/s", {}, {}),
        lambda c: c.release_lease("r", "l"),
    ],
    ids=["validate", "acquire", "reserve", "create", "release"],
)
def test_changes_are_not_replayed_after_the_answer_is_lost(
    call: Callable[[RecoveryClient], object],
) -> None:
    script = Script([lost_answer, answer(200, {})])
    with script.client() as c, pytest.raises(RecoveryConnectionError) as caught:
        call(c)
    assert len(script.requests) == 1, "sent once: a replay could journal or reserve twice"
    assert isinstance(caught.value.__cause__, httpx.ReadError)
    assert caught.value.code == "connection_error"


def test_changes_are_not_retried_on_503() -> None:
    script = Script([overloaded(), answer(200, {})])
    with script.client() as c, pytest.raises(OverloadedError):
        c.validate("r", {}, {}, "/s")
    assert len(script.requests) == 1


def test_a_connection_never_made_is_retried_for_every_call() -> None:
    created = {"run_id": "r", "output_path": "/o", "manifest": {}, "replaced": []}
    script = Script([refused_connection, refused_connection, answer(201, created)])
    with script.client() as c:
        assert c.create_run("/o", "/s", {}, {}).run_id == "r"
    assert len(script.requests) == 3


@pytest.mark.parametrize(
    ("status", "code"),
    [(409, "resume_refused"), (422, "invalid_request"), (423, "run_locked"), (500, "internal")],
)
def test_other_errors_are_never_retried(status: int, code: str) -> None:
    script = Script([answer(status, {"code": code, "message": code, "details": {}})])
    with script.client() as c, pytest.raises(RecoveryError) as caught:
        c.plan("r")
    assert len(script.requests) == 1
    assert caught.value.code == code
    assert caught.value.status == status


def test_parse_retry_after() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None


def test_unreachable_service_is_retried_then_reported() -> None:
    sleeps: list[float] = []
    port = free_port()  # nothing listens there
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.01, jitter=0, sleep=sleeps.append)
    with (
        RecoveryClient(f"http://127.0.0.1:{port}", retry=policy) as c,
        pytest.raises(RecoveryConnectionError) as caught,
    ):
        c.list_runs()
    assert sleeps == [0.01, 0.02]
    assert caught.value.status is None
    assert "3 attempt(s)" in caught.value.message
    assert isinstance(caught.value.__cause__, httpx.ConnectError)


@pytest.fixture
def counted(service: Service) -> Iterator[tuple[RecoveryClient, list[float]]]:
    sleeps: list[float] = []
    with service.client(retry=RetryPolicy(sleep=sleeps.append)) as c:
        yield c, sleeps


def test_real_409_422_423_are_not_retried(
    counted: tuple[RecoveryClient, list[float]], new_run: Callable[..., RunSpec]
) -> None:
    c, sleeps = counted
    spec = new_run()
    changed = {**spec.config, "limit": 99}
    with pytest.raises(ResumeRefusedError):
        c.validate(spec.run_id, changed, spec.global_config, spec.source)
    with pytest.raises(LeaseNotHeldError):
        c.heartbeat(spec.run_id, "no-such-lease")
    lease = c.acquire_lease(spec.run_id, "a", ttl_seconds=30)
    with pytest.raises(RunLockedError):
        c.acquire_lease(spec.run_id, "b", ttl_seconds=30)
    with pytest.raises(Exception, match="limit"):
        c.plan(spec.run_id, limit=0)
    c.release_lease(spec.run_id, lease.lease_id)
    assert sleeps == [], "nothing was retried"
