"""``guard_run``: the one call a collector makes before collecting."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .client import RecoveryClient
from .errors import RunExistsError
from .lease import LeaseKeeper, LostCallback
from .models import Plan, PlanEntry, ValidateResult

__all__ = ["RunGuard", "guard_run"]


@dataclass
class RunGuard:
    """What :func:`guard_run` yields: the run, the resume verdict and the held lease."""

    client: RecoveryClient
    run_id: str
    output_path: str
    #: ``True`` when this call created the run (a fresh start).
    created: bool
    #: The validate answer: ``reuse``, ``resume_with_drift`` (journalled), ``overridden``...
    verdict: ValidateResult
    lease: LeaseKeeper

    @property
    def outcome(self) -> str:
        return self.verdict.outcome

    @property
    def operational_keys(self) -> list[str]:
        return self.verdict.operational_keys

    @property
    def lease_id(self) -> str:
        return self.lease.lease_id

    def check(self) -> None:
        """Raise ``LeaseLostError`` if the run's lease was lost: stop writing."""
        self.lease.check()

    def reserve(self, rollout_ids: Sequence[str]) -> dict[str, int]:
        """Reserve the next execution number of each rollout (under the held lease)."""
        self.lease.check()
        return self.client.reserve_attempts(self.run_id, self.lease_id, rollout_ids)

    def plan(self, **kwargs: Any) -> Plan:
        """The run's plan (``state``, ``limit``, ``cursor`` as :meth:`RecoveryClient.plan`)."""
        return self.client.plan(self.run_id, **kwargs)

    def iter_plan(self, *, state: str | None = None) -> Iterator[PlanEntry]:
        """Every rollout of the run's plan (optionally of one state)."""
        return self.client.iter_plan(self.run_id, state=state)


@contextmanager
def guard_run(
    client: RecoveryClient,
    output_path: str | os.PathLike[str],
    config: Mapping[str, Any],
    global_config: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    source_path: str | os.PathLike[str],
    environment: Mapping[str, str] | None = None,
    *,
    holder: str | None = None,
    host: str | None = None,
    pid: int | None = None,
    ttl_seconds: int | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    allow_unsafe: bool = False,
    max_rollout_attempts: int | None = None,
    retry_terminal_timeouts: bool | None = None,
    lease_wait: float = 0.0,
    renew_fraction: float = 1 / 3,
    on_lease_lost: LostCallback | None = None,
    ready_wait: float = 300.0,
) -> Iterator[RunGuard]:
    """Find or create the run of ``output_path``, take its lease, validate the resume and
    yield a :class:`RunGuard`, holding the lease until the block ends.

    - No run at the output: it is created from ``rows`` (a fresh start; the verdict is
      ``reuse`` of the empty run). A concurrent creator's run is adopted (``run_exists``).
    - A run exists: the lease is taken (waiting up to ``lease_wait`` seconds for a live lease
      of another holder, e.g. a killed collector's, to expire) and validate answers ``reuse``
      or ``resume_with_drift`` (the operational keys are journalled).
    - A refused resume raises ``ResumeRefusedError`` (its ``keys`` and ``reasons`` name the
      semantic keys that changed) after releasing the lease; so does every other error.
    - First it waits up to ``ready_wait`` seconds for the service to be ready (a service
      started beside the collector, or restarted, reindexes before it answers runs:
      :meth:`RecoveryClient.wait_until_ready`); ``0`` does not wait.
    """
    if ready_wait > 0:
        client.wait_until_ready(ready_wait)
    output = os.fspath(output_path)
    source = os.fspath(source_path)
    created = False
    record = client.find_run(output)
    if record is not None:
        run_id = record.run_id
    else:
        try:
            run_id = client.create_run(
                output,
                source,
                config,
                global_config,
                rows,
                environment=environment,
                max_rollout_attempts=max_rollout_attempts,
                retry_terminal_timeouts=retry_terminal_timeouts,
            ).run_id
            created = True
        except RunExistsError as error:
            run_id = error.run_id or _imported_legacy(client, output, error, allow_unsafe)
    with client.lease(
        run_id,
        holder,
        host=host,
        pid=pid,
        ttl_seconds=ttl_seconds,
        checkpoint_dir=checkpoint_dir,
        renew_fraction=renew_fraction,
        on_lost=on_lease_lost,
        wait=lease_wait,
    ) as lease:
        verdict = client.validate(
            run_id,
            config,
            global_config,
            source,
            rows,
            environment=environment,
            lease_id=lease.lease_id,
            allow_unsafe=allow_unsafe,
            retry_terminal_timeouts=retry_terminal_timeouts,
        )
        yield RunGuard(
            client=client,
            run_id=run_id,
            output_path=output,
            created=created,
            verdict=verdict,
            lease=lease,
        )


def _imported_legacy(
    client: RecoveryClient, output: str, refused: RunExistsError, allow_unsafe: bool
) -> str:
    """The run of an output whose saved outcomes have no manifest: imported as a legacy run
    when the caller accepted an unverified identity (``allow_unsafe``, as the Python module's
    ``allow_unsafe_resume`` does), else the refusal stands. A concurrent importer's run is
    adopted."""
    if not allow_unsafe:
        raise refused
    try:
        return client.import_legacy(output).run_id
    except RunExistsError as error:
        if error.run_id is None:
            raise
        return error.run_id
