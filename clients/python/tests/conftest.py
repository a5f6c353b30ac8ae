"""Fixtures: the real service binary, started once per session (three configurations)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollout_recovery_client import RecoveryClient, RetryPolicy
from support import (
    COLLECTOR_TOKEN,
    OPERATOR_TOKEN,
    TOKENS,
    VIEWER_TOKEN,
    RunSpec,
    Service,
    make_run,
    start_service,
)


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """An unauthenticated loopback service (``--lease-ttl-secs 2`` so an abandoned lease of a
    killed collector ends quickly)."""
    running = start_service(tmp_path_factory.mktemp("rr-open"), "--lease-ttl-secs", "2")
    yield running
    running.stop()


@pytest.fixture(scope="session")
def auth_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A service with an operator, a collector and a viewer token."""
    args: list[str] = []
    for role, name, token in (
        ("operator", "op", OPERATOR_TOKEN),
        ("collector", "col", COLLECTOR_TOKEN),
        ("viewer", "v", VIEWER_TOKEN),
    ):
        args += ["--token", f"{role}:{name}:{token}"]
    running = start_service(tmp_path_factory.mktemp("rr-auth"), *args, tokens=TOKENS)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def limits_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A service with tight limits: 1 MiB bodies, 1 s requests."""
    running = start_service(
        tmp_path_factory.mktemp("rr-limits"),
        "--body-limit-mb",
        "1",
        "--request-timeout-secs",
        "1",
    )
    yield running
    # A timed-out request's work goes on in the service after its 408 and holds up a graceful
    # shutdown until it ends (a finding reported with this client): do not wait for it.
    running.stop(graceful=False)


FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.05, max_backoff=0.2)


@pytest.fixture
def client(service: Service) -> Iterator[RecoveryClient]:
    with service.client(retry=FAST_RETRY) as c:
        yield c


@pytest.fixture
def operator(auth_service: Service) -> Iterator[RecoveryClient]:
    with auth_service.client(OPERATOR_TOKEN, retry=FAST_RETRY) as c:
        yield c


@pytest.fixture
def collector(auth_service: Service) -> Iterator[RecoveryClient]:
    with auth_service.client(COLLECTOR_TOKEN, retry=FAST_RETRY) as c:
        yield c


@pytest.fixture
def viewer(auth_service: Service) -> Iterator[RecoveryClient]:
    with auth_service.client(VIEWER_TOKEN, retry=FAST_RETRY) as c:
        yield c


@pytest.fixture
def new_run(client: RecoveryClient, service: Service) -> Callable[..., RunSpec]:
    """Create a fresh run on the open service: ``new_run(tasks=3)``."""

    def make(tasks: int = 3, name: str = "run") -> RunSpec:
        return make_run(client, service.root, tasks=tasks, name=name)

    return make


@pytest.fixture
def root(service: Service) -> Path:
    return service.root
