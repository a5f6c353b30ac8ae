"""Exceptions: one class per stable error code of the service, all under :class:`RecoveryError`.

Every error body the service sends is ``{code, message, details}``. :func:`error_from_response`
maps each known ``code`` to its subclass; an unknown code (a newer service) becomes a plain
:class:`RecoveryError` that still carries the code, message, details and HTTP status.

No exception ever holds a credential: messages come from the service (which builds them from
names, paths and digests) or from this client (method, path, status), never from headers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .models import LeaseHolder

__all__ = [
    "CLIENT_CODES",
    "ERROR_CLASSES",
    "ConflictError",
    "ForbiddenError",
    "HeadersTooLargeError",
    "IdentityError",
    "IncompleteEvaluationError",
    "InternalError",
    "InvalidRequestError",
    "LeaseLostError",
    "LeaseNotHeldError",
    "ManifestUnreadableError",
    "MethodNotAllowedError",
    "NoManifestError",
    "NotEligibleError",
    "NotFoundError",
    "OverloadedError",
    "PathRefusedError",
    "PayloadTooLargeError",
    "RecoveryConnectionError",
    "RecoveryError",
    "RequestTimeoutError",
    "ResumeRefusedError",
    "RowsInvalidError",
    "RunExistsError",
    "RunFilesInvalidError",
    "RunLockedError",
    "RunSupersededError",
    "SemanticKey",
    "UnauthenticatedError",
    "UriTooLongError",
    "error_from_response",
]


class RecoveryError(Exception):
    """An error answered by the service (or raised by this client about the service).

    ``code`` is the service's stable snake_case code, ``message`` its human text, ``details``
    its structured context, ``status`` the HTTP status (``None`` for client-side errors such as
    a lost connection or a lost lease).
    """

    def __init__(
        self,
        code: str,
        message: str,
        details: Mapping[str, Any] | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details: dict[str, Any] = dict(details or {})
        self.status = status

    def __str__(self) -> str:
        where = f"HTTP {self.status}, " if self.status is not None else ""
        return f"{self.message} ({where}{self.code})"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(code={self.code!r}, status={self.status!r}, "
            f"message={self.message!r})"
        )


class ConfigError(RecoveryError):
    """What the Python module raises as ``ConfigError``: a run whose inputs, identity or saved
    files do not allow it to go on (a refused resume, no or an unreadable manifest, invalid
    rows or run files, an identity that cannot be computed). Code that caught the module's
    ``ConfigError`` catches these with it."""


class InvalidRequestError(RecoveryError):
    """422 ``invalid_request``: the body or a parameter is malformed (the message names it)."""


class UnauthenticatedError(RecoveryError):
    """401 ``unauthenticated``: no bearer token, or one the service does not know."""


class ForbiddenError(RecoveryError):
    """403 ``forbidden``: the caller's role may not do this."""


class NotFoundError(RecoveryError):
    """404 ``not_found``: no such run, approval, lease, re-judgment or endpoint."""


class PathRefusedError(RecoveryError):
    """422 ``path_refused``: the output path is outside the service's roots or unusable."""


class RunExistsError(RecoveryError):
    """409 ``run_exists``: the output already has a manifest; ``run_id`` names its run."""

    @property
    def run_id(self) -> str | None:
        value = self.details.get("run_id")
        return value if isinstance(value, str) else None


class RunSupersededError(RecoveryError):
    """409 ``run_superseded``: another run owns this run's output now (``superseded_by``)."""

    @property
    def superseded_by(self) -> str | None:
        value = self.details.get("superseded_by")
        return value if isinstance(value, str) else None


@dataclass(frozen=True)
class SemanticKey:
    """One configuration key a refused resume names, with the classifier's reason."""

    key: str
    key_class: str
    reason: str
    segment: str | None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SemanticKey:
        segment = data.get("segment")
        return cls(
            key=str(data.get("key", "")),
            key_class=str(data.get("class", "semantic")),
            reason=str(data.get("reason", "")),
            segment=segment if isinstance(segment, str) else None,
        )


class ResumeRefusedError(ConfigError):
    """409 ``resume_refused``: the saved identity does not verify against the current run.

    ``semantic_keys`` lists the semantic configuration keys that changed (each with its
    ``reason``), ``keys`` their dotted names, ``reasons`` key -> reason, and ``mismatches`` the
    mismatch codes (``semantic_configuration``, ``source_dataset``,
    ``current_materialized_inputs``, ``previously_overridden``, ...).
    """

    @property
    def semantic_keys(self) -> list[SemanticKey]:
        raw = self.details.get("semantic_keys")
        if not isinstance(raw, list):
            return []
        return [SemanticKey.from_dict(item) for item in raw if isinstance(item, Mapping)]

    @property
    def keys(self) -> list[str]:
        return [k.key for k in self.semantic_keys]

    @property
    def reasons(self) -> dict[str, str]:
        return {k.key: k.reason for k in self.semantic_keys}

    @property
    def mismatches(self) -> list[str]:
        raw = self.details.get("mismatches")
        return [str(m) for m in raw] if isinstance(raw, list) else []


class NoManifestError(ConfigError):
    """409 ``no_manifest``: the saved run has no manifest."""


class ManifestUnreadableError(ConfigError):
    """422 ``manifest_unreadable``: the manifest or materialized inputs cannot be read."""


class IdentityError(ConfigError):
    """422 ``identity_error``: the configuration has no identity (``kind`` says why)."""

    @property
    def kind(self) -> str | None:
        value = self.details.get("kind")
        return value if isinstance(value, str) else None


class RowsInvalidError(ConfigError):
    """422 ``rows_invalid``: saved rows cannot be planned or classified."""


class OutcomeRefusedError(ConfigError):
    """422 ``outcome_refused``: a line checked before it is saved would stop the plan.

    ``reason`` names the rule (``not_in_inventory``, ``bad_attempt``, ``unreserved``,
    ``conflicting_outcomes``, ``different_run``, ``malformed_json``, ...). Nothing was written.
    """

    @property
    def reason(self) -> str | None:
        value = self.details.get("reason")
        return value if isinstance(value, str) else None


class RunFilesInvalidError(ConfigError):
    """409 ``run_files_invalid``: the run's files contradict its manifest."""


class RunLockedError(RecoveryError):
    """423 ``run_locked``: another client holds the run's lease, or another process its lock.

    ``holder`` is the lease holder the service named (``None`` when a process outside the
    service holds the run's ``flock``).
    """

    @property
    def holder(self) -> LeaseHolder | None:
        raw = self.details.get("holder")
        return LeaseHolder.from_dict(raw) if isinstance(raw, Mapping) else None


class LeaseNotHeldError(RecoveryError):
    """409 ``lease_not_held``: the lease presented does not hold the run (expired, released or
    taken over)."""


class NotEligibleError(RecoveryError):
    """409 ``not_eligible``: the attempt is not eligible for a masked-rerun approval, or (from
    ``reserve_attempts``) rollouts the plan does not run again were asked for, and nothing was
    reserved.

    For an approval, ``state``, ``reason`` and ``latest_attempt`` are the rollout's plan entry as
    the service saw it; for a reservation, ``not_runnable`` lists each refused rollout as
    ``(rollout_id, state, reason)``.
    """

    @property
    def not_runnable(self) -> list[tuple[str, str, str]]:
        raw = self.details.get("not_runnable")
        if not isinstance(raw, list):
            return []
        return [
            (str(e.get("rollout_id")), str(e.get("state")), str(e.get("reason")))
            for e in raw
            if isinstance(e, Mapping)
        ]

    @property
    def state(self) -> str | None:
        value = self.details.get("state")
        return value if isinstance(value, str) else None

    @property
    def reason(self) -> str | None:
        value = self.details.get("reason")
        return value if isinstance(value, str) else None

    @property
    def latest_attempt(self) -> int | None:
        value = self.details.get("latest_attempt")
        return value if isinstance(value, int) and not isinstance(value, bool) else None


class ConflictError(RecoveryError):
    """409 ``conflict``: the approval was used or revoked, or a re-judgment is open for another
    predecessor."""


class MethodNotAllowedError(RecoveryError):
    """405 ``method_not_allowed``: the route exists, but not with this method."""


class PayloadTooLargeError(RecoveryError):
    """413 ``payload_too_large``: the body exceeds the service's ``--body-limit-mb``."""


class UriTooLongError(RecoveryError):
    """414 ``uri_too_long``: the request target is longer than the service reads."""


class HeadersTooLargeError(RecoveryError):
    """431 ``headers_too_large``: the request headers are larger than the service reads."""


class RequestTimeoutError(RecoveryError):
    """408 ``request_timeout``: the request took longer than the service allows."""


class CursorExpiredError(RecoveryError):
    """410 ``cursor_expired``: a drift follow cursor from another numbering of the history (the
    database was made again or restored from an older backup): follow again without a cursor
    and drop the event ids already seen."""


class OverloadedError(RecoveryError):
    """503 ``overloaded``: heavy work is saturated; ``retry_after`` is the service's advice."""

    def __init__(
        self,
        code: str,
        message: str,
        details: Mapping[str, Any] | None = None,
        status: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(code, message, details, status)
        self.retry_after = retry_after


class StartingError(OverloadedError):
    """503 ``starting``: the service listens while its start-up reindex runs and answers runs
    only once it is done (``GET /readyz`` 200); an :class:`OverloadedError` too, since both mean
    retry after ``retry_after``."""


class InternalError(RecoveryError):
    """500 ``internal``: the service failed (nothing was half-written; see its log)."""


class RecoveryConnectionError(RecoveryError):
    """The service could not be reached (after the retries the policy allows).

    ``code`` is ``connection_error``; the underlying ``httpx`` exception is ``__cause__``.
    """


class LeaseLostError(RecoveryError):
    """A lease this client held was lost while a collector worked under it.

    Raised by :meth:`LeaseKeeper.check`, at the next call on the client that held the lease,
    and on leaving the lease's block when the loss was never reported otherwise. ``code`` is
    ``lease_lost``; ``cause`` is the error the renewal got (``LeaseNotHeldError`` when another
    holder took the run over), if any.
    """

    def __init__(
        self,
        message: str,
        *,
        run_id: str,
        cause: BaseException | None = None,
    ) -> None:
        super().__init__("lease_lost", message, {"run_id": run_id}, None)
        self.run_id = run_id
        self.cause = cause


class IncompleteEvaluationError(RuntimeError):
    """Saved partial results are valid, but the evaluation still has unfinished work.

    Mirrors the seed's ``IncompleteEvaluationError(message, retryable=True, made_progress=True,
    failure_kind=None)``: ``exit_code = (75 if made_progress else 1) if retryable else 76``.
    """

    EXIT_PARTIAL = 75
    EXIT_NO_PROGRESS = 1
    EXIT_NOT_RETRYABLE = 76

    def __init__(
        self,
        message: str,
        retryable: bool = True,
        made_progress: bool = True,
        failure_kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.made_progress = made_progress
        self.failure_kind = failure_kind

    @property
    def exit_code(self) -> int:
        if not self.retryable:
            return self.EXIT_NOT_RETRYABLE
        return self.EXIT_PARTIAL if self.made_progress else self.EXIT_NO_PROGRESS


#: Every code the service documents (plus the limit codes newer builds answer), to its class.
ERROR_CLASSES: dict[str, type[RecoveryError]] = {
    "invalid_request": InvalidRequestError,
    "cursor_expired": CursorExpiredError,
    "unauthenticated": UnauthenticatedError,
    "forbidden": ForbiddenError,
    "not_found": NotFoundError,
    "path_refused": PathRefusedError,
    "run_exists": RunExistsError,
    "run_superseded": RunSupersededError,
    "resume_refused": ResumeRefusedError,
    "no_manifest": NoManifestError,
    "manifest_unreadable": ManifestUnreadableError,
    "identity_error": IdentityError,
    "rows_invalid": RowsInvalidError,
    "outcome_refused": OutcomeRefusedError,
    "run_files_invalid": RunFilesInvalidError,
    "run_locked": RunLockedError,
    "lease_not_held": LeaseNotHeldError,
    "not_eligible": NotEligibleError,
    "conflict": ConflictError,
    "method_not_allowed": MethodNotAllowedError,
    "payload_too_large": PayloadTooLargeError,
    "uri_too_long": UriTooLongError,
    "headers_too_large": HeadersTooLargeError,
    "request_timeout": RequestTimeoutError,
    "overloaded": OverloadedError,
    "starting": StartingError,
    "internal": InternalError,
}

#: Codes this client raises itself (never sent by the service).
CLIENT_CODES = ("connection_error", "lease_lost", "invalid_response")


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date); ``None`` if absent
    or unreadable."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        import email.utils
        import time

        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds)


def error_from_response(
    status: int,
    body: Any,
    *,
    method: str,
    path: str,
    retry_after: str | None = None,
    text: str = "",
) -> RecoveryError:
    """The exception for an error answer: its code's class, else the base class.

    A body that is not ``{code, message, details}`` (a proxy's page, a bodyless 431) becomes a
    :class:`RecoveryError` with code ``http_<status>``.
    """
    if isinstance(body, Mapping) and isinstance(body.get("code"), str):
        code = body["code"]
        message = body.get("message")
        message = message if isinstance(message, str) else f"{method} {path} failed"
        details = body.get("details")
        details = details if isinstance(details, Mapping) else {}
    else:
        code = f"http_{status}"
        snippet = " ".join(text.split())[:200]
        message = f"{method} {path} answered HTTP {status}" + (f": {snippet}" if snippet else "")
        details = {}
    cls = ERROR_CLASSES.get(code, RecoveryError)
    if issubclass(cls, OverloadedError):
        return cls(code, message, details, status, retry_after=parse_retry_after(retry_after))
    return cls(code, message, details, status)
