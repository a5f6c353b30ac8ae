"""Every error class, provoked for real against the service, and the code -> class mapping."""

from __future__ import annotations

import copy
import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rollout_recovery_client import (
    ERROR_CLASSES,
    NO_RETRY,
    ConflictError,
    HeadersTooLargeError,
    IdentityError,
    InternalError,
    InvalidRequestError,
    LeaseNotHeldError,
    ManifestUnreadableError,
    MethodNotAllowedError,
    NoManifestError,
    NotEligibleError,
    NotFoundError,
    OverloadedError,
    PathRefusedError,
    PayloadTooLargeError,
    RecoveryClient,
    RecoveryError,
    RequestTimeoutError,
    ResumeRefusedError,
    RetryPolicy,
    RowsInvalidError,
    RunExistsError,
    RunFilesInvalidError,
    RunLockedError,
    RunSupersededError,
    UriTooLongError,
)
from rollout_recovery_client.errors import error_from_response
from support import (
    RunSpec,
    Service,
    append_jsonl,
    bundle,
    input_rows,
    make_run,
    masked_row,
    new_output,
    result_row,
)


def _assert_error(error: RecoveryError, code: str, status: int) -> None:
    assert error.code == code
    assert error.status == status
    assert error.message
    assert isinstance(error.details, dict)
    assert code in str(error)
    assert type(error) is ERROR_CLASSES[code]


def test_invalid_request(client: RecoveryClient, new_run: Callable[..., RunSpec]) -> None:
    spec = new_run()
    with pytest.raises(InvalidRequestError) as caught:
        client.plan(spec.run_id, limit=5000)
    _assert_error(caught.value, "invalid_request", 422)
    assert "limit" in caught.value.message
    with pytest.raises(InvalidRequestError, match="state"):
        client.plan(spec.run_id, state="bogus")


def test_not_found(client: RecoveryClient) -> None:
    with pytest.raises(NotFoundError) as caught:
        client.get_run("0" * 32)
    _assert_error(caught.value, "not_found", 404)


def test_path_refused(client: RecoveryClient) -> None:
    config, tree = bundle()
    with pytest.raises(PathRefusedError) as caught:
        client.create_run("/etc/out.jsonl", "/etc/hostname", config, tree, input_rows(1))
    _assert_error(caught.value, "path_refused", 422)
    assert "outside the allowed roots" in caught.value.message


def test_run_exists_names_the_run(client: RecoveryClient, new_run: Callable[..., RunSpec]) -> None:
    spec = new_run()
    with pytest.raises(RunExistsError) as caught:
        client.create_run(spec.output, spec.source, spec.config, spec.global_config, spec.rows)
    _assert_error(caught.value, "run_exists", 409)
    assert caught.value.run_id == spec.run_id


def test_run_superseded_names_the_successor(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    old = new_run()
    new = client.create_run(
        old.output, old.source, old.config, old.global_config, old.rows, replace=True
    )
    assert new.replaced, "the old sidecars were moved aside"
    with pytest.raises(RunSupersededError) as caught:
        client.get_run(old.run_id)
    _assert_error(caught.value, "run_superseded", 409)
    assert caught.value.superseded_by == new.run_id


def test_resume_refused_names_keys_and_reasons(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run()
    changed = copy.deepcopy(spec.config)
    changed["responses_create_params"]["temperature"] = 0.9
    with pytest.raises(ResumeRefusedError) as caught:
        client.validate(spec.run_id, changed, spec.global_config, spec.source)
    refused = caught.value
    _assert_error(refused, "resume_refused", 409)
    assert refused.keys == ["collection.responses_create_params.temperature"]
    assert refused.reasons == {"collection.responses_create_params.temperature": "listed_key"}
    assert refused.semantic_keys[0].key_class == "semantic"
    assert refused.mismatches == ["semantic_configuration"]
    assert "temperature" in refused.message
    # Changed inputs are refused with a mismatch and no semantic key.
    with pytest.raises(ResumeRefusedError) as rows_changed:
        client.validate(spec.run_id, spec.config, spec.global_config, spec.source, spec.rows[:1])
    assert rows_changed.value.mismatches == ["current_materialized_inputs"]
    assert rows_changed.value.keys == []


def test_no_manifest(client: RecoveryClient, new_run: Callable[..., RunSpec]) -> None:
    spec = new_run()
    spec.companion("_manifest.json").unlink()
    with pytest.raises(NoManifestError) as caught:
        client.validate(spec.run_id, spec.config, spec.global_config, spec.source)
    _assert_error(caught.value, "no_manifest", 409)


def test_manifest_unreadable(client: RecoveryClient, new_run: Callable[..., RunSpec]) -> None:
    spec = new_run()
    spec.companion("_manifest.json").write_text("{")
    with pytest.raises(ManifestUnreadableError) as caught:
        client.plan(spec.run_id)
    _assert_error(caught.value, "manifest_unreadable", 422)


def test_identity_error(client: RecoveryClient, root: Path) -> None:
    output, source = new_output(root, "identity")
    config, tree = bundle()
    rows = [{"agent_ref": {"name": "missing"}, "_ng_task_index": 0, "_ng_rollout_index": 0}]
    with pytest.raises(IdentityError) as caught:
        client.create_run(output, source, config, tree, rows)
    _assert_error(caught.value, "identity_error", 422)
    assert caught.value.kind == "missing_server"
    assert "missing" in caught.value.message


def test_rows_invalid(client: RecoveryClient, new_run: Callable[..., RunSpec]) -> None:
    spec = new_run()
    spec.output.write_text("{not json\n")
    with pytest.raises(RowsInvalidError) as caught:
        client.plan(spec.run_id)
    _assert_error(caught.value, "rows_invalid", 422)


def test_run_files_invalid(client: RecoveryClient, new_run: Callable[..., RunSpec]) -> None:
    spec = new_run()
    spec.companion("_attempts.jsonl").write_text("")
    with pytest.raises(RunFilesInvalidError) as caught:
        client.plan(spec.run_id)
    _assert_error(caught.value, "run_files_invalid", 409)
    assert "_attempts.jsonl" in caught.value.message


def test_run_locked_names_the_holder(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run()
    lease = client.acquire_lease(spec.run_id, "first", ttl_seconds=30, host="h1", pid=7)
    try:
        with pytest.raises(RunLockedError) as caught:
            client.acquire_lease(spec.run_id, "second", ttl_seconds=30)
        _assert_error(caught.value, "run_locked", 423)
        holder = caught.value.holder
        assert holder is not None
        assert (holder.holder, holder.host, holder.pid) == ("first", "h1", 7)
        with pytest.raises(RunLockedError):
            client.validate(spec.run_id, spec.config, spec.global_config, spec.source)
    finally:
        client.release_lease(spec.run_id, lease.lease_id)


def test_run_locked_by_another_process_has_no_holder(
    client: RecoveryClient, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run()
    # A Python collector holding the run's flock, as the seed's run_lock does.
    with spec.companion("_run.lock").open("a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert client.lease_holder(spec.run_id).locked_outside_service is True
        with pytest.raises(RunLockedError) as caught:
            client.acquire_lease(spec.run_id, "second", ttl_seconds=30)
        _assert_error(caught.value, "run_locked", 423)
        assert caught.value.holder is None
        assert "Another collector owns" in caught.value.message


def test_lease_not_held(client: RecoveryClient, new_run: Callable[..., RunSpec]) -> None:
    spec = new_run()
    lease = client.acquire_lease(spec.run_id, "c", ttl_seconds=30)
    client.release_lease(spec.run_id, lease.lease_id)
    with pytest.raises(LeaseNotHeldError) as caught:
        client.heartbeat(spec.run_id, lease.lease_id)
    _assert_error(caught.value, "lease_not_held", 409)
    # The service echoes the lease id (the holder's secret) in this message; the client blanks it.
    assert lease.lease_id not in str(caught.value)
    with pytest.raises(LeaseNotHeldError):
        client.reserve_attempts(spec.run_id, lease.lease_id, ["0-0"])
    with pytest.raises(LeaseNotHeldError):
        client.release_lease(spec.run_id, lease.lease_id)


def test_not_eligible_says_why(client: RecoveryClient, new_run: Callable[..., RunSpec]) -> None:
    spec = new_run(tasks=2)
    lease = client.acquire_lease(spec.run_id, "c", ttl_seconds=30)
    client.reserve_attempts(spec.run_id, lease.lease_id, ["0-0", "1-0"])
    client.release_lease(spec.run_id, lease.lease_id)
    append_jsonl(spec.output, [result_row(spec.run_id, 0), masked_row(spec.run_id, 1)])
    with pytest.raises(NotEligibleError) as caught:
        client.create_approval(spec.run_id, 0, 0, 0, "scored results are never rerun")
    _assert_error(caught.value, "not_eligible", 409)
    assert caught.value.state == "scored"
    assert caught.value.reason
    assert caught.value.latest_attempt == 0
    with pytest.raises(NotEligibleError, match="latest attempt"):
        client.create_approval(spec.run_id, 1, 0, 3, "not the latest attempt")
    # A scored answer and a masked one awaiting approval are not reserved again: nothing is.
    lease = client.acquire_lease(spec.run_id, "c", ttl_seconds=30)
    with pytest.raises(NotEligibleError) as refused:
        client.reserve_attempts(spec.run_id, lease.lease_id, ["0-0", "1-0"])
    _assert_error(refused.value, "not_eligible", 409)
    assert [(r, s) for r, s, _ in refused.value.not_runnable] == [
        ("0-0", "scored"),
        ("1-0", "awaiting_approval"),
    ]
    manifest = client.get_run(spec.run_id).manifest
    assert manifest is not None
    assert manifest.next_attempt == {"0-0": 1, "1-0": 1}
    client.release_lease(spec.run_id, lease.lease_id)


def test_conflict(client: RecoveryClient, new_run: Callable[..., RunSpec]) -> None:
    spec = new_run(tasks=2)
    lease = client.acquire_lease(spec.run_id, "c", ttl_seconds=30)
    client.reserve_attempts(spec.run_id, lease.lease_id, ["1-0"])
    client.release_lease(spec.run_id, lease.lease_id)
    append_jsonl(spec.output, [masked_row(spec.run_id, 1)])
    approval = client.create_approval(spec.run_id, 1, 0, 0, "lost artifact")
    client.revoke_approval(spec.run_id, approval.approval_id)
    with pytest.raises(ConflictError) as caught:
        client.revoke_approval(spec.run_id, approval.approval_id)
    _assert_error(caught.value, "conflict", 409)


def test_method_not_allowed(client: RecoveryClient) -> None:
    with pytest.raises(MethodNotAllowedError) as caught:
        client.request("PUT", "/runs")
    _assert_error(caught.value, "method_not_allowed", 405)


def test_payload_too_large(limits_service: Service) -> None:
    with limits_service.client(retry=NO_RETRY) as c:
        spec_output, source = new_output(limits_service.root, "big")
        config, tree = bundle()
        rows = [{**row, "padding": "x" * 1000} for row in input_rows(2000)]
        with pytest.raises(PayloadTooLargeError) as caught:
            c.create_run(spec_output, source, config, tree, rows)
    _assert_error(caught.value, "payload_too_large", 413)


def test_uri_too_long(client: RecoveryClient, root: Path) -> None:
    with pytest.raises(UriTooLongError) as caught:
        client.find_run(root / ("x" * 9000) / "out.jsonl")
    _assert_error(caught.value, "uri_too_long", 414)


def test_headers_too_large(service: Service) -> None:
    # The one header a caller controls is the user agent: make it larger than the service reads.
    with (
        RecoveryClient(service.url, user_agent="a" * 70_000, retry=NO_RETRY) as c,
        pytest.raises(HeadersTooLargeError) as caught,
    ):
        c.list_runs()
    _assert_error(caught.value, "headers_too_large", 431)


def test_request_timeout(limits_service: Service) -> None:
    output, _ = new_output(limits_service.root, "slow")
    source = output.with_name("huge.jsonl")
    config, tree = bundle()
    caught: RequestTimeoutError | None = None
    # A sparse source (no disk used) whose hashing takes longer than the 1 s the service allows;
    # ten times larger again if this binary hashes it in time (a release build).
    for size in (120_000_000, 1_200_000_000):
        with source.open("wb") as f:
            f.truncate(size)
        try:
            with limits_service.client(retry=NO_RETRY) as c:
                c.create_run(output, source, config, tree, input_rows(1))
        except RequestTimeoutError as error:
            caught = error
            break
        output, _ = new_output(limits_service.root, "slow")
        source = output.with_name("huge.jsonl")
    assert caught is not None
    _assert_error(caught, "request_timeout", 408)


def test_internal(
    client: RecoveryClient, service: Service, new_run: Callable[..., RunSpec]
) -> None:
    spec = new_run()
    # The service's own failure, never the request's: its leases table is set aside by hand for
    # one call (a damaged database), then put back. (Every kind of file planted beside a run is
    # refused as a path, 422, so none serves here.)
    database = sqlite3.connect(service.data_dir / "rollout-recovery.db", isolation_level=None)
    database.execute("PRAGMA busy_timeout = 10000")
    database.execute("ALTER TABLE leases RENAME TO leases_aside")
    try:
        with pytest.raises(InternalError) as caught:
            client.acquire_lease(spec.run_id, "c", ttl_seconds=30)
    finally:
        database.execute("ALTER TABLE leases_aside RENAME TO leases")
        database.close()
    _assert_error(caught.value, "internal", 500)
    # Put back, the database serves again.
    lease = client.acquire_lease(spec.run_id, "c", ttl_seconds=30)
    client.release_lease(spec.run_id, lease.lease_id)


def test_overloaded_carries_retry_after(client: RecoveryClient, service: Service) -> None:
    spec = make_run(client, service.root, tasks=20_000, name="overload")
    # Not indexed yet: the burst's plans wait on the one cold build, holding the plan queue.
    errors: list[OverloadedError] = []
    answered: list[int] = []
    lock = threading.Lock()
    # The service builds plans on one thread per core with four per core queued: send more
    # than that at once.
    burst = 12 * len(os.sched_getaffinity(0)) + 8
    start = threading.Barrier(burst)

    def plan_once() -> None:
        with service.client(retry=NO_RETRY) as c:
            start.wait()
            try:
                c.plan(spec.run_id, limit=1)
                with lock:
                    answered.append(200)
            except OverloadedError as error:
                with lock:
                    errors.append(error)

    threads = [threading.Thread(target=plan_once) for _ in range(burst)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors, f"{burst} concurrent plans saturate the plan queue"
    _assert_error(errors[0], "overloaded", 503)
    assert errors[0].retry_after == 1.0
    assert answered, "the queued ones are answered"

    # With retries (honouring Retry-After), every one of them is answered in the end.
    results: list[int] = []
    slept: list[float] = []
    start2 = threading.Barrier(12)

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(seconds)

    def plan_retrying() -> None:
        policy = RetryPolicy(max_attempts=12, max_retry_after=1.0, sleep=sleep)
        with service.client(retry=policy) as c:
            start2.wait()
            results.append(len(c.plan(spec.run_id, limit=1).entries))

    threads = [threading.Thread(target=plan_retrying) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [1] * 12
    assert all(s <= 1.0 for s in slept), "a retry waits Retry-After, capped by the policy"
    assert set(slept) <= {1.0}, "after the Retry-After the service sent"


def test_unknown_codes_map_to_the_base_class() -> None:
    error = error_from_response(
        418,
        {"code": "teapot_brewing", "message": "short and stout", "details": {"spout": 1}},
        method="GET",
        path="/x",
    )
    assert type(error) is RecoveryError
    assert (error.code, error.message, error.details, error.status) == (
        "teapot_brewing",
        "short and stout",
        {"spout": 1},
        418,
    )
    bodyless = error_from_response(431, None, method="GET", path="/x", text="")
    assert type(bodyless) is RecoveryError
    assert bodyless.code == "http_431"
    assert set(ERROR_CLASSES) >= {
        "invalid_request",
        "unauthenticated",
        "forbidden",
        "not_found",
        "path_refused",
        "run_exists",
        "run_superseded",
        "resume_refused",
        "no_manifest",
        "manifest_unreadable",
        "identity_error",
        "rows_invalid",
        "run_files_invalid",
        "run_locked",
        "lease_not_held",
        "not_eligible",
        "conflict",
        "method_not_allowed",
        "payload_too_large",
        "overloaded",
        "internal",
    }


def test_every_documented_code_has_a_class(client: RecoveryClient) -> None:
    documented = client.openapi()["components"]["schemas"]["ErrorCode"]["enum"]
    missing = [code for code in documented if code not in ERROR_CLASSES]
    assert missing == []
