"""``client.lease(...)``: acquire, background renewal, release, and detecting a lost lease."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest

from rollout_recovery_client import (
    LeaseLostError,
    LeaseNotHeldError,
    RecoveryClient,
    RecoveryConnectionError,
    RunLockedError,
)
from rollout_recovery_client.lease import parse_time
from support import RunSpec, Service, wait_until


def test_acquires_and_releases(client: RecoveryClient, new_run: Callable[..., RunSpec]) -> None:
    spec = new_run()
    with client.lease(spec.run_id, "collector-a", ttl_seconds=30) as lease:
        assert lease.lease_id
        assert lease.lease_id not in repr(lease)
        holder = client.lease_holder(spec.run_id).holder
        assert holder is not None
        assert holder.holder == "collector-a"
        # Holding the lease is what lets this client reserve.
        assert client.reserve_attempts(spec.run_id, lease.lease_id, ["0-0"]) == {"0-0": 0}
    assert client.lease_holder(spec.run_id).holder is None
    with pytest.raises(LeaseNotHeldError):
        client.heartbeat(spec.run_id, lease.lease_id)


def test_releases_on_exception(client: RecoveryClient, new_run: Callable[..., RunSpec]) -> None:
    spec = new_run()
    with pytest.raises(KeyError), client.lease(spec.run_id, "crashing", ttl_seconds=30):
        raise KeyError("the collector failed")
    assert client.lease_holder(spec.run_id).holder is None


def test_renews_in_the_background(client: RecoveryClient, new_run: Callable[..., RunSpec]) -> None:
    spec = new_run()
    with client.lease(spec.run_id, "renewing", ttl_seconds=1) as lease:
        first = client.lease_holder(spec.run_id).holder
        assert first is not None
        # Three renewals at a third of the TTL: the lease outlived its first TTL.
        wait_until(lambda: lease.renewals >= 3, timeout=10, what="three renewals")
        now = client.lease_holder(spec.run_id).holder
        assert now is not None, "still held after its first TTL passed"
        assert now.holder == "renewing"
        assert now.acquired_at == first.acquired_at
        renewed, acquired = parse_time(now.renewed_at), parse_time(now.acquired_at)
        assert renewed is not None
        assert acquired is not None
        assert renewed - acquired >= 1.0
        assert not lease.lost
        lease.check()


def test_default_ttl_comes_from_the_grant(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run()
    with client.lease(spec.run_id, "defaults") as lease:  # the service runs with a 2 s TTL
        assert lease.ttl == 2
        wait_until(lambda: lease.renewals >= 4, timeout=10, what="renewals past the TTL")
        holder = client.lease_holder(spec.run_id).holder
        assert holder is not None
        assert holder.holder == "defaults"


def test_loss_by_takeover_is_reported_at_once(
    client: RecoveryClient, service: Service, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run()
    lost = threading.Event()
    seen: list[LeaseLostError] = []

    def on_lost(error: LeaseLostError) -> None:
        seen.append(error)
        lost.set()

    with (
        service.client() as operator,
        client.lease(spec.run_id, "victim", ttl_seconds=1, on_lost=on_lost) as lease,
    ):
        taken = operator.takeover_lease(spec.run_id, "operator", "the collector hangs")
        assert lost.wait(10), "the renewal after the takeover reports the loss"
        assert lease.lost
        assert isinstance(seen[0].cause, LeaseNotHeldError)
        assert seen[0].run_id == spec.run_id
        # The next call on the client that held the lease raises, once.
        with pytest.raises(LeaseLostError):
            client.get_run(spec.run_id)
        assert client.get_run(spec.run_id).run_id == spec.run_id
        # check() keeps saying so: a collector must stop writing.
        with pytest.raises(LeaseLostError):
            lease.check()
        holder = client.lease_holder(spec.run_id).holder
        assert holder is not None
        assert holder.holder == "operator"
    # Leaving the block does not release the new holder's lease (nor raise again).
    holder = client.lease_holder(spec.run_id).holder
    assert holder is not None
    assert holder.holder == "operator"
    client.release_lease(spec.run_id, taken.lease_id)


def test_unreported_loss_raises_on_exit(
    client: RecoveryClient, service: Service, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run()
    lost = threading.Event()
    with (
        service.client() as operator,
        pytest.raises(LeaseLostError) as caught,
        client.lease(spec.run_id, "victim", ttl_seconds=1, on_lost=lambda _: lost.set()),
    ):
        operator.takeover_lease(spec.run_id, "operator", "take it")
        assert lost.wait(10)
    assert caught.value.code == "lease_lost"
    assert caught.value.status is None
    # The loss was reported by the exit: the client's next call is not interrupted.
    assert client.lease_holder(spec.run_id).holder is not None


def test_waits_for_an_abandoned_lease(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run()
    client.acquire_lease(spec.run_id, "killed-collector", ttl_seconds=1)  # never renewed
    with pytest.raises(RunLockedError) as caught, client.lease(spec.run_id, "impatient"):
        pass
    assert caught.value.holder is not None
    assert caught.value.holder.holder == "killed-collector"
    with client.lease(spec.run_id, "patient", ttl_seconds=30, wait=10) as lease:
        holder = client.lease_holder(spec.run_id).holder
        assert holder is not None
        assert holder.holder == "patient"
        assert lease.lease_id


def test_rejects_bad_arguments(client: RecoveryClient) -> None:
    with pytest.raises(ValueError, match="renew_fraction"):
        client.lease("run", renew_fraction=1.5)
    with pytest.raises(ValueError, match="ttl_seconds"):
        client.lease("run", ttl_seconds=0)


def test_parse_time() -> None:
    assert parse_time("1970-01-01T00:00:01Z") == 1.0
    assert parse_time("1970-01-01T00:00:01.500000000Z") == 1.5
    assert parse_time("garbage") is None
    assert parse_time(None) is None


def test_unreachable_service_loses_the_lease_at_its_expiry() -> None:
    """Renewals that cannot reach the service are retried until the lease's expiry; then the
    lease counts as lost (another holder may own the run by now)."""
    grant = {"lease_id": "l", "run_id": "r", "holder": "h", "expires_at": "2030-01-01T00:00:00Z"}
    heartbeats: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/heartbeat"):
            heartbeats.append(request)
            raise httpx.ConnectError("connection refused", request=request)
        if request.method == "POST":
            return httpx.Response(201, json=grant)
        return httpx.Response(204)

    lost = threading.Event()
    transport = httpx.MockTransport(handle)
    with RecoveryClient("http://service.test", transport=transport) as c:
        started = time.monotonic()
        with (
            pytest.raises(LeaseLostError) as caught,
            c.lease("r", "h", ttl_seconds=1, on_lost=lambda _: lost.set()),
        ):
            assert lost.wait(10)
            elapsed = time.monotonic() - started
    assert elapsed >= 1.0, "not before the lease expired"
    assert len(heartbeats) >= 2, "renewals were retried meanwhile"
    assert isinstance(caught.value.cause, RecoveryConnectionError)
