"""``RecoveryClient``: one method per operation of the rollout-recovery service."""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import httpx

from .environment import referenced_environment
from .errors import (
    LeaseLostError,
    OverloadedError,
    RecoveryConnectionError,
    RecoveryError,
    StartingError,
    error_from_response,
    parse_retry_after,
)
from .models import (
    Approval,
    AttemptExtension,
    ClassifyDecision,
    DriftEvent,
    DriftPage,
    Lease,
    LeaseStatus,
    LegacyImported,
    OutcomeCheck,
    Plan,
    PlanEntry,
    ReindexReport,
    Rejudgment,
    Resubmit,
    RunCreated,
    RunPage,
    RunRecord,
    RunView,
    ValidateResult,
    Validation,
    ValidationPage,
)
from .retry import RetryPolicy

if TYPE_CHECKING:
    from .lease import LeaseKeeper, LostCallback

__all__ = ["DEFAULT_TIMEOUT", "RecoveryClient"]

logger = logging.getLogger("rollout_recovery_client")

#: Seconds a request may take by default (a validate hashes the source: allow for large ones).
DEFAULT_TIMEOUT = 60.0

_JSON = Mapping[str, Any]


def _positive_int(name: str, value: int) -> int:
    """``value`` when it is a whole number of at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: {value!r} is not a whole number of at least 1")
    return value


def _segment(value: str, name: str = "run_id") -> str:
    """A path segment, percent-encoded (ids come from the service, but never trust a path);
    an empty one (which would name another route) is refused with ``ValueError``."""
    from urllib.parse import quote

    if not isinstance(value, str):
        raise TypeError(f"{name}: {value!r} is not a string")
    if not value:
        raise ValueError(f"{name}: must not be empty")
    return quote(value, safe="")


def _time(name: str, value: str | datetime | None) -> str | None:
    """A drift time bound as the service reads it (RFC 3339): a string as given, a datetime
    with its offset; a naive datetime is refused (its zone would be a guess)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"{name}: {value!r} has no time zone (use tzinfo=timezone.utc)")
        return value.isoformat()
    raise TypeError(f"{name}: {value!r} is neither an RFC 3339 string nor a datetime")


class RecoveryClient:
    """A client of one rollout-recovery service.

    ``url`` is the service's base URL (``http://127.0.0.1:8787``), ``token`` a bearer token
    (``None`` for an unauthenticated loopback service), ``timeout`` seconds per request (or an
    ``httpx.Timeout``), ``retry`` the :class:`RetryPolicy` (see :mod:`.retry` for what is
    retried: only what is safe). The token is sent as ``Authorization: Bearer``, and never
    appears in ``repr``, logs or exception messages.

    Use it as a context manager (or call :meth:`close`) to close its connections.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        *,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        user_agent: str = "rollout-recovery-client/0.1",
        _shares_transport: bool = False,
    ) -> None:
        self._url = url.rstrip("/")
        self._token = token
        self._timeout = timeout
        self._retry = retry if retry is not None else RetryPolicy()
        self._transport = transport
        self._user_agent = user_agent
        self._shares_transport = _shares_transport
        headers = {"user-agent": user_agent, "accept": "application/json"}
        if token is not None:
            headers["authorization"] = f"Bearer {token}"
        self._http = httpx.Client(
            base_url=self._url, headers=headers, timeout=timeout, transport=transport
        )
        self._lost_lock = threading.Lock()
        self._lost: list[LeaseLostError] = []

    # -- plumbing -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._url

    @property
    def retry_policy(self) -> RetryPolicy:
        return self._retry

    def __repr__(self) -> str:
        auth = "token=<set>" if self._token is not None else "token=None"
        return f"RecoveryClient(url={self._url!r}, {auth})"

    def __enter__(self) -> RecoveryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        # A clone given its original's transport leaves closing it to the original.
        if not self._shares_transport:
            self._http.close()

    def clone(
        self,
        *,
        retry: RetryPolicy | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> RecoveryClient:
        """A client of the same service with the same credentials and connections of its own
        (for another thread; the lease keeper renews through one)."""
        return RecoveryClient(
            self._url,
            self._token,
            timeout if timeout is not None else self._timeout,
            retry=retry if retry is not None else self._retry,
            transport=self._transport,
            user_agent=self._user_agent,
            _shares_transport=self._transport is not None,
        )

    def _note_lost(self, error: LeaseLostError) -> None:
        """A lease keeper of this client lost its lease: the next call raises ``error``."""
        with self._lost_lock:
            self._lost.append(error)

    def _forget_lost(self, error: LeaseLostError) -> None:
        with self._lost_lock:
            self._lost = [e for e in self._lost if e is not error]

    def _raise_lost(self) -> None:
        with self._lost_lock:
            if not self._lost:
                return
            error = self._lost.pop(0)
        from .lease import acknowledge

        acknowledge(error)
        raise error

    def _send(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        idempotent: bool | None = None,
        check_leases: bool = True,
        secret: str | None = None,
        retry_starting: bool = True,
    ) -> httpx.Response:
        """Send one request (retrying what is safe) and answer its success, or raise.

        ``secret`` (a lease id the body carries) is blanked out of an error's message: the
        service echoes the lease id in ``lease_not_held`` messages, and exceptions get logged.
        """
        if check_leases:
            self._raise_lost()
        if idempotent is None:
            idempotent = method in ("GET", "HEAD")
        query = {k: v for k, v in (params or {}).items() if v is not None}
        policy = self._retry
        attempt = 0
        while True:
            attempt += 1
            can_retry = attempt < policy.max_attempts
            try:
                response = self._http.request(
                    method,
                    path,
                    json=json,
                    params=query or None,
                )
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # Nothing reached the service: safe to send again, whatever the call.
                if can_retry:
                    delay = policy.delay(attempt, None)
                    logger.debug("%s %s: cannot connect, retry in %.2fs", method, path, delay)
                    policy.sleep(delay)
                    continue
                raise RecoveryConnectionError(
                    "connection_error",
                    f"{method} {path}: cannot connect to {self._url} "
                    f"({type(exc).__name__}) after {attempt} attempt(s)",
                ) from exc
            except httpx.TransportError as exc:
                if idempotent and can_retry:
                    delay = policy.delay(attempt, None)
                    logger.debug(
                        "%s %s: %s, retry in %.2fs", method, path, type(exc).__name__, delay
                    )
                    policy.sleep(delay)
                    continue
                raise RecoveryConnectionError(
                    "connection_error",
                    f"{method} {path}: the answer was lost ({type(exc).__name__}) "
                    f"after {attempt} attempt(s)",
                ) from exc
            status = response.status_code
            logger.debug("%s %s -> %d", method, path, status)
            if status < 400:
                return response
            try:
                body: Any = response.json()
            except ValueError:
                body = None
            error = error_from_response(
                status,
                body,
                method=method,
                path=path,
                retry_after=response.headers.get("retry-after"),
                text=response.text if body is None else "",
            )
            # A 503 `starting` was refused before anything was read or written (the service
            # is reindexing at start-up): as safe to send again as a refused connection.
            starting = retry_starting and isinstance(error, StartingError)
            if (idempotent or starting) and can_retry and status in policy.retry_statuses:
                delay = policy.delay(
                    attempt, parse_retry_after(response.headers.get("retry-after"))
                )
                logger.debug(
                    "%s %s: %d %s, retry in %.2fs", method, path, status, error.code, delay
                )
                policy.sleep(delay)
                continue
            if secret and secret in error.message:
                error.message = error.message.replace(secret, "<lease id>")
                error.args = (error.message,)
            raise error

    def _json(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        idempotent: bool | None = None,
        secret: str | None = None,
    ) -> Any:
        response = self._send(
            method, path, json=json, params=params, idempotent=idempotent, secret=secret
        )
        try:
            return response.json()
        except ValueError as exc:
            raise RecoveryError(
                "invalid_response",
                f"{method} {path} answered {response.status_code} without a JSON body",
                status=response.status_code,
            ) from exc

    def _object(self, method: str, path: str, **kwargs: Any) -> _JSON:
        data = self._json(method, path, **kwargs)
        if not isinstance(data, Mapping):
            raise RecoveryError(
                "invalid_response", f"{method} {path} answered {type(data).__name__}, not an object"
            )
        return data

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        idempotent: bool | None = None,
    ) -> Any:
        """Any endpoint, for routes this client does not know yet: the parsed JSON answer (or
        ``None`` for an empty one); errors raise like every other method."""
        response = self._send(method.upper(), path, json=json, params=params, idempotent=idempotent)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    # -- system -------------------------------------------------------------------------

    def healthz(self) -> bool:
        """Whether the process answers ``GET /healthz``."""
        return self._send("GET", "/healthz").status_code == 200

    def readyz(self) -> bool:
        """Whether the service is ready: its start-up reindex is done and the database answers
        (``GET /readyz``; a 503, ``starting`` or a database down, is ``False``)."""
        try:
            self._send("GET", "/readyz", idempotent=False, retry_starting=False)
        except RecoveryError as error:
            if error.status == 503:
                return False
            raise
        return True

    def wait_until_ready(self, timeout: float = 300.0, interval: float = 0.5) -> None:
        """Wait until the service is ready (``GET /readyz`` 200), through a service that is not
        listening yet or is still reindexing at start-up (503 ``starting``); a collector
        started beside the service calls this first. Raises ``TimeoutError`` after ``timeout``
        seconds (a service that stays down, or a start-up longer than that)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self._url} was not ready within {timeout} s")
            try:
                # Each probe bounded by the time left: a service that hangs (stopped, or its
                # host gone) ends the wait at `timeout`, not the client's request timeout.
                if self._http.get("/readyz", timeout=left).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(min(interval, max(deadline - time.monotonic(), 0)))

    def openapi(self) -> dict[str, Any]:
        """The service's OpenAPI document."""
        return dict(self._object("GET", "/openapi.json"))

    def metrics(self) -> str:
        """The Prometheus metrics text."""
        return self._send("GET", "/metrics").text

    def reindex(self) -> ReindexReport:
        """Bring the database up to date with the files (operator)."""
        return ReindexReport.from_dict(self._object("POST", "/reindex"))

    # -- runs ---------------------------------------------------------------------------

    def create_run(
        self,
        output_path: str | os.PathLike[str],
        source_path: str | os.PathLike[str],
        config: Mapping[str, Any],
        global_config: Mapping[str, Any],
        rows: Sequence[Mapping[str, Any]] | None = None,
        *,
        environment: Mapping[str, str] | None = None,
        max_rollout_attempts: int | None = None,
        retry_terminal_timeouts: bool | None = None,
        replace: bool = False,
    ) -> RunCreated:
        """Create a run (``POST /runs``): its manifest, saved identity and materialized inputs
        (``rows``; when ``None`` the materialized-inputs file beside the output is used).

        ``environment`` defaults to the variables the configuration's ``${oc.env:...}``
        references name, as this process has them (:func:`referenced_environment`); pass a
        mapping to send exactly that.

        Raises ``RunExistsError`` (its ``run_id`` names the run) when a manifest exists.
        """
        body: dict[str, Any] = {
            "output_path": os.fspath(output_path),
            "source_path": os.fspath(source_path),
            "config": dict(config),
            "global_config": dict(global_config),
        }
        if rows is not None:
            body["rows"] = [dict(r) for r in rows]
        if environment is None:
            environment = referenced_environment(config, global_config)
        if environment:
            body["environment"] = dict(environment)
        if max_rollout_attempts is not None:
            body["max_rollout_attempts"] = max_rollout_attempts
        if retry_terminal_timeouts is not None:
            body["retry_terminal_timeouts"] = retry_terminal_timeouts
        if replace:
            body["replace"] = True
        return RunCreated.from_dict(self._object("POST", "/runs", json=body))

    def import_legacy(self, output_path: str | os.PathLike[str]) -> LegacyImported:
        """Import the saved outcomes of an output without a manifest (a NeMo Gym output from
        before manifests) as a legacy run (``POST /runs/import_legacy``), as the Python module's
        resume with ``allow_unsafe_resume`` does: its identity cannot be verified, so every
        later validate needs ``allow_unsafe=True``. ``RunExistsError`` names the run when a
        manifest is there (another caller imported it first)."""
        body = {"output_path": os.fspath(output_path), "allow_unsafe": True}
        return LegacyImported.from_dict(self._object("POST", "/runs/import_legacy", json=body))

    def get_run(self, run_id: str) -> RunView:
        """One run: record, manifest, live holder and caps (``RunSupersededError`` when
        another run owns its output now)."""
        return RunView.from_dict(self._object("GET", f"/runs/{_segment(run_id)}"))

    def find_run(self, output_path: str | os.PathLike[str]) -> RunRecord | None:
        """The run recorded for an output path (adopting the run its files hold), or ``None``."""
        data = self._object("GET", "/runs", params={"output_path": os.fspath(output_path)})
        page = RunPage.from_dict(data)
        return page.runs[0] if page.runs else None

    def list_runs(self, *, limit: int | None = None, cursor: str | None = None) -> RunPage:
        """One page of runs, newest first."""
        return RunPage.from_dict(
            self._object("GET", "/runs", params={"limit": limit, "cursor": cursor})
        )

    def iter_runs(self, *, page_size: int | None = None) -> Iterator[RunRecord]:
        """Every run, newest first, across pages."""
        size = None if page_size is None else _positive_int("page_size", page_size)
        cursor: str | None = None
        while True:
            page = self.list_runs(limit=size, cursor=cursor)
            yield from page.runs
            if page.next_cursor is None or not page.runs:
                return
            cursor = page.next_cursor

    def validate(
        self,
        run_id: str,
        config: Mapping[str, Any],
        global_config: Mapping[str, Any],
        source_path: str | os.PathLike[str],
        rows: Sequence[Mapping[str, Any]] | None = None,
        *,
        environment: Mapping[str, str] | None = None,
        lease_id: str | None = None,
        allow_unsafe: bool = False,
        retry_terminal_timeouts: bool | None = None,
    ) -> ValidateResult:
        """The pre-flight before (re)starting a run: reuse, resume across operational drift
        (journalled), ``overridden``; a refusal raises ``ResumeRefusedError`` naming the
        semantic keys. Not retried after it was sent: a replay would journal a drift twice.
        ``environment`` defaults as :meth:`create_run`'s does. ``retry_terminal_timeouts=True``
        opts the run in to retrying terminal timeouts (sent as the collection setting in
        ``config``; the manifest keeps it for every later resume)."""
        if retry_terminal_timeouts:
            config = {**config, "retry_terminal_timeouts": True}
        body: dict[str, Any] = {
            "config": dict(config),
            "global_config": dict(global_config),
            "source_path": os.fspath(source_path),
        }
        if rows is not None:
            body["rows"] = [dict(r) for r in rows]
        if environment is None:
            environment = referenced_environment(config, global_config)
        if environment:
            body["environment"] = dict(environment)
        if lease_id is not None:
            body["lease_id"] = lease_id
        if allow_unsafe:
            body["allow_unsafe"] = True
        return ValidateResult.from_dict(
            self._object("POST", f"/runs/{_segment(run_id)}/validate", json=body, secret=lease_id)
        )

    # -- leases -------------------------------------------------------------------------

    def validations(
        self, run_id: str, *, limit: int | None = None, cursor: str | None = None
    ) -> ValidationPage:
        """One page of a run's recorded validations, newest first."""
        params = {"limit": limit, "cursor": cursor}
        path = f"/runs/{_segment(run_id)}/validations"
        return ValidationPage.from_dict(self._object("GET", path, params=params))

    def iter_validations(
        self, run_id: str, *, page_size: int | None = None
    ) -> Iterator[Validation]:
        """Every recorded validation of a run, newest first, across pages."""
        size = None if page_size is None else _positive_int("page_size", page_size)
        cursor: str | None = None
        while True:
            page = self.validations(run_id, limit=size, cursor=cursor)
            yield from page.validations
            if page.next_cursor is None or not page.validations:
                return
            cursor = page.next_cursor

    def acquire_lease(
        self,
        run_id: str,
        holder: str,
        *,
        host: str | None = None,
        pid: int | None = None,
        ttl_seconds: int | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
    ) -> Lease:
        """Take a run's lease (and with it the run's lock); ``RunLockedError`` names the
        current holder."""
        body: dict[str, Any] = {
            "holder": holder,
            "host": host if host is not None else socket.gethostname(),
            "pid": pid if pid is not None else os.getpid(),
        }
        if ttl_seconds is not None:
            body["ttl_seconds"] = ttl_seconds
        if checkpoint_dir is not None:
            body["checkpoint_dir"] = os.fspath(checkpoint_dir)
        return Lease.from_dict(self._object("POST", f"/runs/{_segment(run_id)}/lease", json=body))

    def heartbeat(self, run_id: str, lease_id: str, *, ttl_seconds: int | None = None) -> Lease:
        """Renew a live lease (``LeaseNotHeldError`` when it expired or was taken over)."""
        body: dict[str, Any] = {"lease_id": lease_id}
        if ttl_seconds is not None:
            body["ttl_seconds"] = ttl_seconds
        return Lease.from_dict(
            self._object(
                "POST",
                f"/runs/{_segment(run_id)}/lease/heartbeat",
                json=body,
                idempotent=True,
                secret=lease_id,
            )
        )

    def release_lease(self, run_id: str, lease_id: str) -> None:
        """Release a lease (and the run's lock)."""
        self._release(run_id, lease_id, check_leases=True)

    def _release_quietly(self, run_id: str, lease_id: str) -> None:
        """Release without raising a pending lost lease first (the keeper's exit path)."""
        self._release(run_id, lease_id, check_leases=False)

    def _release(self, run_id: str, lease_id: str, *, check_leases: bool) -> None:
        self._send(
            "DELETE",
            f"/runs/{_segment(run_id)}/lease",
            json={"lease_id": lease_id},
            check_leases=check_leases,
            secret=lease_id,
        )

    def takeover_lease(
        self,
        run_id: str,
        holder: str,
        reason: str,
        *,
        host: str | None = None,
        pid: int | None = None,
        ttl_seconds: int | None = None,
    ) -> Lease:
        """Take a run over for a new holder, ending the current lease at once (operator,
        audited)."""
        body: dict[str, Any] = {
            "holder": holder,
            "host": host if host is not None else socket.gethostname(),
            "pid": pid if pid is not None else os.getpid(),
            "reason": reason,
        }
        if ttl_seconds is not None:
            body["ttl_seconds"] = ttl_seconds
        return Lease.from_dict(
            self._object("POST", f"/runs/{_segment(run_id)}/lease/takeover", json=body)
        )

    def lease_holder(self, run_id: str) -> LeaseStatus:
        """Who holds a run (without the lease id)."""
        return LeaseStatus.from_dict(self._object("GET", f"/runs/{_segment(run_id)}/lease"))

    def lease(
        self,
        run_id: str,
        holder: str | None = None,
        *,
        host: str | None = None,
        pid: int | None = None,
        ttl_seconds: int | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        renew_fraction: float = 1 / 3,
        on_lost: LostCallback | None = None,
        wait: float = 0.0,
    ) -> LeaseKeeper:
        """A context manager owning ``run_id`` for its block: acquires (waiting up to ``wait``
        seconds while another holder's lease is live), renews in a background thread every
        ``renew_fraction`` of the TTL, releases on exit (also on exception). When a renewal
        finds the lease lost, ``on_lost`` is called at once (from the renewal thread) and
        ``LeaseLostError`` is raised at this client's next call and by ``check()``."""
        from .lease import LeaseKeeper

        return LeaseKeeper(
            self,
            run_id,
            holder=holder,
            host=host,
            pid=pid,
            ttl_seconds=ttl_seconds,
            checkpoint_dir=checkpoint_dir,
            renew_fraction=renew_fraction,
            on_lost=on_lost,
            wait=wait,
        )

    # -- attempts -----------------------------------------------------------------------

    def reserve_attempts(
        self, run_id: str, lease_id: str, rollout_ids: Sequence[str]
    ) -> dict[str, int]:
        """Durably reserve the next execution number of each rollout before dispatch (lease
        holder): rollout id -> execution number."""
        if isinstance(rollout_ids, (str, bytes)):
            # A string is a sequence of characters: never reserve "0", "-", "0" for "0-0".
            raise TypeError("rollout_ids: a list of rollout ids, not one string")
        data = self._object(
            "POST",
            f"/runs/{_segment(run_id)}/attempts/reserve",
            json={"lease_id": lease_id, "rollout_ids": list(rollout_ids)},
            secret=lease_id,
        )
        attempts = data.get("attempts")
        if not isinstance(attempts, Mapping):
            return {}
        return {
            str(k): v for k, v in attempts.items() if isinstance(v, int) and not isinstance(v, bool)
        }

    def check_outcome(self, run_id: str, line: str | bytes) -> OutcomeCheck:
        """Check an outcome line before appending it (the module's ``check_outcome``): the
        file it goes in, its rollout and attempt, and what the plan would make of it; raises
        ``OutcomeRefusedError`` (``.reason``) when reading it from the file would stop the plan.
        ``line`` is the line exactly as it will be written (its final newline optional).
        Writes nothing."""
        text = line.decode("utf-8") if isinstance(line, bytes) else line
        return OutcomeCheck.from_dict(
            self._object(
                "POST",
                f"/runs/{_segment(run_id)}/outcomes/check",
                json={"line": text},
            )
        )

    def extend_attempts(self, run_id: str, extend_attempts: int, reason: str) -> AttemptExtension:
        """Add attempts to every rollout's cap (operator; 1-100)."""
        return AttemptExtension.from_dict(
            self._object(
                "POST",
                f"/runs/{_segment(run_id)}/attempts/extend",
                json={"extend_attempts": extend_attempts, "reason": reason},
            )
        )

    def resubmit(self, run_id: str, reason: str) -> Resubmit:
        """Reset the failure budget (operator; the run must have no live lease)."""
        return Resubmit.from_dict(
            self._object(
                "POST", f"/runs/{_segment(run_id)}/attempts/resubmit", json={"reason": reason}
            )
        )

    # -- re-judgments -------------------------------------------------------------------

    def admit_rejudgment(
        self,
        run_id: str,
        lease_id: str,
        rollout_id: str,
        attempt: int,
        predecessor_failure_id: str,
        predecessor_line: str | bytes,
    ) -> Rejudgment:
        """Admit a judge-only re-judgment of a reserved attempt whose failure line
        (``predecessor_line``, byte for byte) is in the failures sidecar. Admitting the same
        predecessor again answers the open one (``already_open``)."""
        line = (
            predecessor_line.decode("utf-8")
            if isinstance(predecessor_line, bytes)
            else predecessor_line
        )
        response = self._send(
            "POST",
            f"/runs/{_segment(run_id)}/rejudgments",
            json={
                "lease_id": lease_id,
                "rollout_id": rollout_id,
                "attempt": attempt,
                "predecessor_failure_id": predecessor_failure_id,
                "predecessor_line": line,
            },
            secret=lease_id,
        )
        return Rejudgment.from_dict(response.json(), already_open=response.status_code == 200)

    def close_rejudgment(self, run_id: str, operation_id: str, lease_id: str, outcome: str) -> None:
        """Close a re-judgment once its outcome (``graded``, ``failed``, ...) is saved."""
        self._send(
            "POST",
            f"/runs/{_segment(run_id)}/rejudgments/{_segment(operation_id, 'operation_id')}/close",
            json={"lease_id": lease_id, "outcome": outcome},
            secret=lease_id,
        )

    # -- plan and classification --------------------------------------------------------

    def plan(
        self,
        run_id: str,
        *,
        state: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Plan:
        """The resume plan: counts per state, coverage and completion over the whole run, and
        one page (``limit`` 1-1000) of rollouts, optionally of one ``state``."""
        return Plan.from_dict(
            self._object(
                "GET",
                f"/runs/{_segment(run_id)}/plan",
                params={"state": state, "limit": limit, "cursor": cursor},
            )
        )

    def iter_plan(
        self, run_id: str, *, state: str | None = None, page_size: int | None = None
    ) -> Iterator[PlanEntry]:
        """Every rollout of the plan (optionally of one ``state``), in inventory order."""
        size = None if page_size is None else _positive_int("page_size", page_size)
        cursor: str | None = None
        while True:
            page = self.plan(run_id, state=state, limit=size, cursor=cursor)
            yield from page.entries
            if page.next_cursor is None or not page.entries:
                return
            cursor = page.next_cursor

    def classify(
        self,
        rows: Sequence[Mapping[str, Any]],
        *,
        policy: Mapping[str, Any] | None = None,
        retry_terminal_timeouts: bool | None = None,
    ) -> list[ClassifyDecision]:
        """Every predicate's answer and the resume verdict of each row (retried on 503: it is a
        pure function of its body)."""
        body: dict[str, Any] = {"rows": [dict(r) for r in rows]}
        if policy is not None:
            body["policy"] = dict(policy)
        if retry_terminal_timeouts is not None:
            body["retry_terminal_timeouts"] = retry_terminal_timeouts
        data = self._object("POST", "/classify", json=body, idempotent=True)
        decisions = data.get("decisions")
        if not isinstance(decisions, list):
            return []
        return [ClassifyDecision.from_dict(d) for d in decisions if isinstance(d, Mapping)]

    # -- drift --------------------------------------------------------------------------

    def drift(
        self,
        *,
        run_id: str | None = None,
        from_: str | datetime | None = None,
        to: str | datetime | None = None,
        key: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
        order: str | None = None,
    ) -> DriftPage:
        """One page of resumes that crossed operational drift (oldest first), across runs or of
        one ``run_id``, filtered by time (RFC 3339, ``from_`` inclusive, ``to`` exclusive) and
        drifted ``key``. ``order="recorded"`` pages in the order the service recorded them and
        answers a ``follow_cursor`` (see ``drift_since``)."""
        params = {
            "from": _time("from_", from_),
            "to": _time("to", to),
            "key": key,
            "limit": None if limit is None else _positive_int("limit", limit),
            "cursor": cursor,
            "order": order,
        }
        if run_id is not None:
            return DriftPage.from_dict(
                self._object("GET", f"/runs/{_segment(run_id)}/drift", params=params)
            )
        return DriftPage.from_dict(self._object("GET", "/drift", params=params))

    def iter_drift(
        self,
        *,
        run_id: str | None = None,
        from_: str | datetime | None = None,
        to: str | datetime | None = None,
        key: str | None = None,
        page_size: int | None = None,
    ) -> Iterator[DriftEvent]:
        """Every drift event matching the filters, following ``next_cursor`` across pages."""
        size = None if page_size is None else _positive_int("page_size", page_size)
        cursor: str | None = None
        while True:
            page = self.drift(run_id=run_id, from_=from_, to=to, key=key, limit=size, cursor=cursor)
            yield from page.events
            if page.next_cursor is None or not page.events:
                return
            cursor = page.next_cursor

    def drift_since(
        self,
        cursor: str | None = None,
        *,
        run_id: str | None = None,
        from_: str | datetime | None = None,
        to: str | datetime | None = None,
        key: str | None = None,
        page_size: int | None = None,
        max_events: int | None = None,
    ) -> tuple[list[DriftEvent], str]:
        """The matching drift events recorded after ``cursor`` (every one when ``None``), in
        the order the service recorded them, and the cursor to pass next time: called again
        and again, it answers each event exactly once, whatever other runs write meanwhile.
        ``max_events`` answers at most that many (the cursor then points after the last one,
        so nothing is skipped): a bound on memory for a first call over a long history."""
        size = 100 if page_size is None else _positive_int("page_size", page_size)
        bound = None if max_events is None else _positive_int("max_events", max_events)
        events: list[DriftEvent] = []
        while True:
            limit = size if bound is None else min(size, bound - len(events))
            page = self.drift(
                run_id=run_id,
                from_=from_,
                to=to,
                key=key,
                limit=limit,
                cursor=cursor,
                order="recorded",
            )
            events.extend(page.events)
            if page.follow_cursor is None:
                raise RecoveryError(
                    "invalid_response",
                    "the service answered no follow_cursor (a release without order=recorded)",
                )
            cursor = page.follow_cursor
            if page.next_cursor is None or (bound is not None and len(events) >= bound):
                return events, cursor

    def follow_drift(
        self,
        cursor: str | None = None,
        *,
        interval: float = 2.0,
        run_id: str | None = None,
        from_: str | datetime | None = None,
        to: str | datetime | None = None,
        key: str | None = None,
    ) -> DriftFollower:
        """Every matching drift event, then each one recorded later, as it is recorded: an
        iterator without end that asks every ``interval`` seconds while nothing is new and
        while the service cannot be reached (a restart). Its ``cursor`` is where to start
        again (``follow_drift(follower.cursor)``): at least once, so drop a repeated
        ``event_id``."""
        if (
            isinstance(interval, bool)
            or not isinstance(interval, (int, float))
            or not math.isfinite(interval)
            or interval <= 0
        ):
            raise ValueError(f"interval: {interval!r} is not a positive number of seconds")
        return DriftFollower(
            self,
            cursor,
            interval=float(interval),
            # Checked now, not at the first page.
            filters={
                "run_id": run_id,
                "from_": _time("from_", from_),
                "to": _time("to", to),
                "key": key,
            },
        )

    # -- approvals ----------------------------------------------------------------------

    def create_approval(
        self,
        run_id: str,
        task_index: int,
        rollout_index: int,
        attempt_index: int,
        reason: str,
    ) -> Approval:
        """Approve rerunning exactly one masked attempt that kept an answer without a grade
        (operator); ``NotEligibleError`` says why another attempt is not eligible."""
        return Approval.from_dict(
            self._object(
                "POST",
                f"/runs/{_segment(run_id)}/approvals",
                json={
                    "task_index": task_index,
                    "rollout_index": rollout_index,
                    "attempt_index": attempt_index,
                    "reason": reason,
                },
            )
        )

    def list_approvals(self, run_id: str) -> list[Approval]:
        """A run's approvals, with their use and revocation."""
        data = self._json("GET", f"/runs/{_segment(run_id)}/approvals")
        if not isinstance(data, list):
            return []
        return [Approval.from_dict(a) for a in data if isinstance(a, Mapping)]

    def revoke_approval(self, run_id: str, approval_id: str) -> None:
        """Revoke an approval before an attempt uses it (operator; ``ConflictError`` when it
        was used or revoked already)."""
        self._send(
            "DELETE", f"/runs/{_segment(run_id)}/approvals/{_segment(approval_id, 'approval_id')}"
        )


class DriftFollower(Iterator[DriftEvent]):
    """The iterator ``RecoveryClient.follow_drift`` answers.

    ``cursor`` moves past a page only once every event of it was taken and the next one is
    asked for, so a consumer that saves ``cursor`` after handling each event and starts again
    from it after a crash sees every event at least once (a page handled in part comes again).
    """

    def __init__(
        self,
        client: RecoveryClient,
        cursor: str | None,
        *,
        interval: float,
        filters: Mapping[str, str | None],
    ) -> None:
        self.cursor = cursor
        self._client = client
        self._interval = interval
        self._filters = dict(filters)
        self._pending: list[DriftEvent] = []
        self._after_pending: str | None = None

    def __iter__(self) -> DriftFollower:
        return self

    def __next__(self) -> DriftEvent:
        while not self._pending:
            if self._after_pending is not None:
                self.cursor, self._after_pending = self._after_pending, None
            try:
                events, after = self._client.drift_since(
                    self.cursor,
                    run_id=self._filters.get("run_id"),
                    from_=self._filters.get("from_"),
                    to=self._filters.get("to"),
                    key=self._filters.get("key"),
                    max_events=1,
                )
            except (RecoveryConnectionError, OverloadedError):
                time.sleep(self._interval)
                continue
            if events:
                self._pending, self._after_pending = events, after
            else:
                self.cursor = after
                time.sleep(self._interval)
        return self._pending.pop(0)
