"""Typed results. Each dataclass parses only the fields the service answers and keeps the whole
answer in ``raw``, so a field a newer service adds is readable before this client knows it.

Parsing is lenient about absence (a missing optional field is ``None`` or empty) and never
raises on an unknown field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Approval",
    "AttemptExtension",
    "ClassifyDecision",
    "Coverage",
    "DriftEvent",
    "DriftPage",
    "Lease",
    "LeaseHolder",
    "LeaseStatus",
    "LegacyImported",
    "Manifest",
    "PendingRejudge",
    "Plan",
    "PlanCompletion",
    "PlanEntry",
    "ReindexReport",
    "Rejudgment",
    "Resubmit",
    "RunCreated",
    "RunPage",
    "RunRecord",
    "RunView",
    "ValidateResult",
]

Raw = dict[str, Any]


def _raw(data: Mapping[str, Any]) -> Raw:
    return dict(data)


def _str(data: Mapping[str, Any], key: str, default: str = "") -> str:
    value = data.get(key)
    return value if isinstance(value, str) else default


def _opt_str(data: Mapping[str, Any], key: str) -> str | None:
    value = data.get(key)
    return value if isinstance(value, str) else None


def _int(data: Mapping[str, Any], key: str, default: int = 0) -> int:
    value = data.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _opt_int(data: Mapping[str, Any], key: str) -> int | None:
    value = data.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _opt_float(data: Mapping[str, Any], key: str) -> float | None:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _bool(data: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = data.get(key)
    return value if isinstance(value, bool) else default


def _str_list(data: Mapping[str, Any], key: str) -> list[str]:
    value = data.get(key)
    return [str(v) for v in value] if isinstance(value, list) else []


def _mapping(data: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    value = data.get(key)
    return value if isinstance(value, Mapping) else None


def _dicts(data: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    value = data.get(key)
    if not isinstance(value, list):
        return []
    return [item for item in value if isinstance(item, Mapping)]


@dataclass(frozen=True)
class PendingRejudge:
    """An open judge-only re-judgment recorded in the manifest."""

    operation_id: str
    predecessor_failure_id: str
    predecessor_sha256: str
    admitted_at: float | None
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PendingRejudge:
        return cls(
            operation_id=_str(data, "operation_id"),
            predecessor_failure_id=_str(data, "predecessor_failure_id"),
            predecessor_sha256=_str(data, "predecessor_sha256"),
            admitted_at=_opt_float(data, "admitted_at"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class Manifest:
    """A run manifest (schema 2), as the seed's ``RunManifest`` holds it."""

    run_id: str
    schema_version: int
    selection_policy: str
    source_digest: str
    materialized_digest: str
    config_digest: str
    legacy_import: bool
    identity_overridden: bool
    max_rollout_attempts: int | None
    retry_terminal_timeouts: bool
    next_attempt: dict[str, int]
    pending_rejudge: dict[str, PendingRejudge]
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        next_attempt = _mapping(data, "next_attempt") or {}
        pending = _mapping(data, "pending_rejudge") or {}
        return cls(
            run_id=_str(data, "run_id"),
            schema_version=_int(data, "schema_version", 2),
            selection_policy=_str(data, "selection_policy", "latest_allocated"),
            source_digest=_str(data, "source_digest"),
            materialized_digest=_str(data, "materialized_digest"),
            config_digest=_str(data, "config_digest"),
            legacy_import=_bool(data, "legacy_import"),
            identity_overridden=_bool(data, "identity_overridden"),
            max_rollout_attempts=_opt_int(data, "max_rollout_attempts"),
            retry_terminal_timeouts=_bool(data, "retry_terminal_timeouts"),
            next_attempt={
                str(k): v
                for k, v in next_attempt.items()
                if isinstance(v, int) and not isinstance(v, bool)
            },
            pending_rejudge={
                str(k): PendingRejudge.from_dict(v)
                for k, v in pending.items()
                if isinstance(v, Mapping)
            },
            raw=_raw(data),
        )


def _opt_manifest(data: Mapping[str, Any], key: str) -> Manifest | None:
    value = _mapping(data, key)
    return Manifest.from_dict(value) if value is not None else None


@dataclass(frozen=True)
class RunRecord:
    """A run as the service's database records it."""

    run_id: str
    output_path: str
    source_digest: str
    materialized_digest: str
    config_digest: str
    legacy_import: bool
    identity_overridden: bool
    max_rollout_attempts: int | None
    created_at: str | None
    updated_at: str | None
    superseded_by: str | None
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunRecord:
        return cls(
            run_id=_str(data, "run_id"),
            output_path=_str(data, "output_path"),
            source_digest=_str(data, "source_digest"),
            materialized_digest=_str(data, "materialized_digest"),
            config_digest=_str(data, "config_digest"),
            legacy_import=_bool(data, "legacy_import"),
            identity_overridden=_bool(data, "identity_overridden"),
            max_rollout_attempts=_opt_int(data, "max_rollout_attempts"),
            created_at=_opt_str(data, "created_at"),
            updated_at=_opt_str(data, "updated_at"),
            superseded_by=_opt_str(data, "superseded_by"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class LegacyImported:
    """The answer to ``POST /runs/import_legacy``: the run the saved outcomes now belong to."""

    run_id: str
    output_path: str
    manifest: Manifest | None
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LegacyImported:
        return cls(
            run_id=_str(data, "run_id"),
            output_path=_str(data, "output_path"),
            manifest=_opt_manifest(data, "manifest"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class RunCreated:
    """The answer to ``POST /runs``."""

    run_id: str
    output_path: str
    source_digest: str
    materialized_digest: str
    config_digest: str
    legacy_config_digest: str | None
    manifest: Manifest | None
    replaced: list[str]
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunCreated:
        return cls(
            run_id=_str(data, "run_id"),
            output_path=_str(data, "output_path"),
            source_digest=_str(data, "source_digest"),
            materialized_digest=_str(data, "materialized_digest"),
            config_digest=_str(data, "config_digest"),
            legacy_config_digest=_opt_str(data, "legacy_config_digest"),
            manifest=_opt_manifest(data, "manifest"),
            replaced=_str_list(data, "replaced"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class RunPage:
    """One page of ``GET /runs`` (newest first)."""

    runs: list[RunRecord]
    next_cursor: str | None
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunPage:
        return cls(
            runs=[RunRecord.from_dict(r) for r in _dicts(data, "runs")],
            next_cursor=_opt_str(data, "next_cursor"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a run (the public view: never the lease id)."""

    holder: str
    host: str | None
    pid: int | None
    acquired_at: str | None
    renewed_at: str | None
    expires_at: str | None
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LeaseHolder:
        return cls(
            holder=_str(data, "holder"),
            host=_opt_str(data, "host"),
            pid=_opt_int(data, "pid"),
            acquired_at=_opt_str(data, "acquired_at"),
            renewed_at=_opt_str(data, "renewed_at"),
            expires_at=_opt_str(data, "expires_at"),
            raw=_raw(data),
        )


def _opt_holder(data: Mapping[str, Any], key: str) -> LeaseHolder | None:
    value = _mapping(data, key)
    return LeaseHolder.from_dict(value) if value is not None else None


@dataclass(frozen=True)
class RunView:
    """``GET /runs/{id}``: the record, the manifest on disk, the live holder and the caps."""

    run: RunRecord
    manifest: Manifest | None
    manifest_problem: str | None
    lease: LeaseHolder | None
    saved_cap: int | None
    attempt_extension: int | None
    effective_cap: int | None
    raw: Raw = field(repr=False)

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunView:
        return cls(
            run=RunRecord.from_dict(_mapping(data, "run") or {}),
            manifest=_opt_manifest(data, "manifest"),
            manifest_problem=_opt_str(data, "manifest_problem"),
            lease=_opt_holder(data, "lease"),
            saved_cap=_opt_int(data, "saved_cap"),
            attempt_extension=_opt_int(data, "attempt_extension"),
            effective_cap=_opt_int(data, "effective_cap"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class ValidateResult:
    """The verdict of ``POST /runs/{id}/validate`` when a resume is allowed.

    ``outcome`` is ``reuse``, ``resume_with_drift`` (``operational_keys`` were journalled as
    ``drift_event_id``), ``overridden`` or ``import_legacy``. A refusal is never a result: it
    raises :class:`~rollout_recovery_client.errors.ResumeRefusedError`.
    """

    outcome: str
    run_id: str
    message: str | None
    operational_keys: list[str]
    drift_event_id: str | None
    config_digest: str
    manifest: Manifest | None
    raw: Raw = field(repr=False)
    #: The semantic keys an ``overridden`` resume accepted (empty for every other outcome).
    semantic_keys: list[str] = field(default_factory=list)
    #: Whether the rows sent were compared with the saved materialized inputs (``False`` when
    #: none were sent: the saved ones were taken as current).
    rows_compared: bool = False

    @property
    def reuse(self) -> bool:
        return self.outcome == "reuse"

    @property
    def drifted(self) -> bool:
        return self.outcome == "resume_with_drift"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ValidateResult:
        return cls(
            outcome=_str(data, "outcome"),
            run_id=_str(data, "run_id"),
            message=_opt_str(data, "message"),
            operational_keys=_str_list(data, "operational_keys"),
            drift_event_id=_opt_str(data, "drift_event_id"),
            config_digest=_str(data, "config_digest"),
            manifest=_opt_manifest(data, "manifest"),
            raw=_raw(data),
            semantic_keys=_str_list(data, "semantic_keys"),
            rows_compared=data.get("rows_compared") is True,
        )


@dataclass(frozen=True)
class Lease:
    """A granted lease. ``lease_id`` is the holder's proof of ownership: it is kept out of
    ``repr`` so logging a lease never leaks it."""

    lease_id: str = field(repr=False)
    run_id: str = ""
    holder: str = ""
    expires_at: str = ""
    raw: Raw = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Lease:
        return cls(
            lease_id=_str(data, "lease_id"),
            run_id=_str(data, "run_id"),
            holder=_str(data, "holder"),
            expires_at=_str(data, "expires_at"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class LeaseStatus:
    """``GET /runs/{id}/lease``: the live holder (or ``None``) and whether a process outside the
    service holds the run's ``flock``."""

    run_id: str
    holder: LeaseHolder | None
    locked_outside_service: bool
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LeaseStatus:
        return cls(
            run_id=_str(data, "run_id"),
            holder=_opt_holder(data, "holder"),
            locked_outside_service=_bool(data, "locked_outside_service"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class AttemptExtension:
    """An attempt extension (``--extend-attempts``) recorded for a run."""

    event_id: str
    run_id: str
    at: str | None
    by: str | None
    reason: str | None
    extend_attempts: int
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AttemptExtension:
        return cls(
            event_id=_str(data, "event_id"),
            run_id=_str(data, "run_id"),
            at=_opt_str(data, "at"),
            by=_opt_str(data, "by"),
            reason=_opt_str(data, "reason"),
            extend_attempts=_int(data, "extend_attempts"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class OutcomeCheck:
    """What the plan would make of an outcome line a collector is about to save."""

    #: ``failures`` (its ``_ng_failure_class`` is not null) or ``results``: where it goes.
    artifact: str
    #: The logical rollout id and attempt it is an outcome of (``None`` for evidence).
    rollout_id: str | None
    attempt: int | None
    #: ``new``, ``already_saved``, ``rejudges``, ``rejudged_already``, ``migrates``,
    #: ``superseded_by_migration`` or ``evidence``.
    disposition: str
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OutcomeCheck:
        return cls(
            artifact=_str(data, "artifact"),
            rollout_id=_opt_str(data, "rollout_id"),
            attempt=_opt_int(data, "attempt"),
            disposition=_str(data, "disposition"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class Resubmit:
    """A resubmit: failures before ``line_offset`` in the failures sidecar no longer count."""

    event_id: str
    run_id: str
    at: str | None
    by: str | None
    line_offset: int | None
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Resubmit:
        return cls(
            event_id=_str(data, "event_id"),
            run_id=_str(data, "run_id"),
            at=_opt_str(data, "at"),
            by=_opt_str(data, "by"),
            line_offset=_opt_int(data, "line_offset"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class Rejudgment:
    """A judge-only re-judgment. ``already_open`` is true when the service answered the open
    re-judgment of the same predecessor (200) rather than admitting a new one (201)."""

    operation_id: str
    run_id: str
    attempt_key: str
    admitted_at: str | None
    predecessor_failure_id: str
    predecessor_sha256: str
    closed_at: str | None
    outcome: str | None
    already_open: bool
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, already_open: bool = False) -> Rejudgment:
        return cls(
            operation_id=_str(data, "operation_id"),
            run_id=_str(data, "run_id"),
            attempt_key=_str(data, "attempt_key"),
            admitted_at=_opt_str(data, "admitted_at"),
            predecessor_failure_id=_str(data, "predecessor_failure_id"),
            predecessor_sha256=_str(data, "predecessor_sha256"),
            closed_at=_opt_str(data, "closed_at"),
            outcome=_opt_str(data, "outcome"),
            already_open=already_open,
            raw=_raw(data),
        )

    def marker(self) -> dict[str, str]:
        """The ``_ng_rejudge`` value the re-judged outcome carries: saved for the same attempt
        with it, the outcome takes the judge failure's place in the plan."""
        return {
            "operation_id": self.operation_id,
            "predecessor_failure_id": self.predecessor_failure_id,
            "predecessor_sha256": self.predecessor_sha256,
        }


@dataclass(frozen=True)
class Approval:
    """An operator's approval to rerun exactly one masked attempt."""

    approval_id: str
    run_id: str
    at: str | None
    by: str | None
    reason: str | None
    task_index: int | None
    rollout_index: int | None
    attempt_index: int | None
    consumed_by_attempt: int | None
    revoked_at: str | None
    raw: Raw = field(repr=False)

    @property
    def active(self) -> bool:
        return self.revoked_at is None and self.consumed_by_attempt is None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Approval:
        return cls(
            approval_id=_str(data, "approval_id"),
            run_id=_str(data, "run_id"),
            at=_opt_str(data, "at"),
            by=_opt_str(data, "by"),
            reason=_opt_str(data, "reason"),
            task_index=_opt_int(data, "task_index"),
            rollout_index=_opt_int(data, "rollout_index"),
            attempt_index=_opt_int(data, "attempt_index"),
            consumed_by_attempt=_opt_int(data, "consumed_by_attempt"),
            revoked_at=_opt_str(data, "revoked_at"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class PlanEntry:
    """One rollout of a resume plan: its state, why, and the attempt a resume runs next."""

    rollout_id: str
    task_index: int | None
    rollout_index: int | None
    state: str
    reason: str
    latest_attempt: int | None
    next_attempt: int | None
    counted_failures: int
    reuse_cached_deliverable: bool
    longest_failure_elapsed: float | None
    latest_artifact: str | None
    latest_line: int | None
    failure_kind: str | None
    responsibility: str | None
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanEntry:
        return cls(
            rollout_id=_str(data, "rollout_id"),
            task_index=_opt_int(data, "task_index"),
            rollout_index=_opt_int(data, "rollout_index"),
            state=_str(data, "state"),
            reason=_str(data, "reason"),
            latest_attempt=_opt_int(data, "latest_attempt"),
            next_attempt=_opt_int(data, "next_attempt"),
            counted_failures=_int(data, "counted_failures"),
            reuse_cached_deliverable=_bool(data, "reuse_cached_deliverable"),
            longest_failure_elapsed=_opt_float(data, "longest_failure_elapsed"),
            latest_artifact=_opt_str(data, "latest_artifact"),
            latest_line=_opt_int(data, "latest_line"),
            failure_kind=_opt_str(data, "failure_kind"),
            responsibility=_opt_str(data, "responsibility"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class Coverage:
    """The coverage snapshot (the fields of ``<stem>_coverage.json``)."""

    run_id: str
    expected: int
    successful: int
    measured: int
    masked: int
    unscored: int
    failed: int
    intentionally_omitted: int
    unknown: int
    never_dispatched: int
    attempts: int
    counted_failures: int
    attempts_exhausted: int
    max_rollout_attempts: int | None
    retry_terminal_timeouts: bool
    completion_fraction: float | None
    complete: bool
    reconciled: bool
    identity_verified: bool
    scored: int
    failures_counted_as_zero: int
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Coverage:
        return cls(
            run_id=_str(data, "run_id"),
            expected=_int(data, "expected"),
            successful=_int(data, "successful"),
            measured=_int(data, "measured"),
            masked=_int(data, "masked"),
            unscored=_int(data, "unscored"),
            failed=_int(data, "failed"),
            intentionally_omitted=_int(data, "intentionally_omitted"),
            unknown=_int(data, "unknown"),
            never_dispatched=_int(data, "never_dispatched"),
            attempts=_int(data, "attempts"),
            counted_failures=_int(data, "counted_failures"),
            attempts_exhausted=_int(data, "attempts_exhausted"),
            max_rollout_attempts=_opt_int(data, "max_rollout_attempts"),
            retry_terminal_timeouts=_bool(data, "retry_terminal_timeouts"),
            completion_fraction=_opt_float(data, "completion_fraction"),
            complete=_bool(data, "complete"),
            reconciled=_bool(data, "reconciled"),
            identity_verified=_bool(data, "identity_verified", True),
            scored=_int(data, "scored"),
            failures_counted_as_zero=_int(data, "failures_counted_as_zero"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class PlanCompletion:
    """The service's completion check: ``exit_code`` 0, 75, 1 or 76."""

    complete: bool
    exit_code: int
    message: str | None
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanCompletion:
        return cls(
            complete=_bool(data, "complete"),
            exit_code=_int(data, "exit_code"),
            message=_opt_str(data, "message"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class Plan:
    """``GET /runs/{id}/plan``: the whole run's summary and one page of rollouts."""

    run_id: str
    cap: int
    state_counts: dict[str, int]
    coverage: Coverage
    budget_message: str | None
    warnings: list[str]
    completion: PlanCompletion | None
    entries: list[PlanEntry]
    next_cursor: str | None
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        counts = _mapping(data, "state_counts") or {}
        completion = _mapping(data, "completion")
        return cls(
            run_id=_str(data, "run_id"),
            cap=_int(data, "cap"),
            state_counts={
                str(k): v
                for k, v in counts.items()
                if isinstance(v, int) and not isinstance(v, bool)
            },
            coverage=Coverage.from_dict(_mapping(data, "coverage") or {}),
            budget_message=_opt_str(data, "budget_message"),
            warnings=_str_list(data, "warnings"),
            completion=PlanCompletion.from_dict(completion) if completion is not None else None,
            entries=[PlanEntry.from_dict(e) for e in _dicts(data, "entries")],
            next_cursor=_opt_str(data, "next_cursor"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class DriftEvent:
    """One resume that crossed operational drift (a journal line: keys and digests only)."""

    event_id: str
    run_id: str
    at: str
    saved_config_digest: str
    current_config_digest: str
    operational_keys: list[str]
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DriftEvent:
        return cls(
            event_id=_str(data, "event_id"),
            run_id=_str(data, "run_id"),
            at=_str(data, "at"),
            saved_config_digest=_str(data, "saved_config_digest"),
            current_config_digest=_str(data, "current_config_digest"),
            operational_keys=_str_list(data, "operational_keys"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class DriftPage:
    """One page of drift events (oldest first)."""

    events: list[DriftEvent]
    next_cursor: str | None
    raw: Raw = field(repr=False)
    follow_cursor: str | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DriftPage:
        return cls(
            events=[DriftEvent.from_dict(e) for e in _dicts(data, "events")],
            next_cursor=_opt_str(data, "next_cursor"),
            raw=_raw(data),
            follow_cursor=_opt_str(data, "follow_cursor"),
        )


@dataclass(frozen=True)
class Validation:
    """One recorded validation of a run: its answer, keys and digests, never values."""

    event_id: str
    run_id: str | None
    output_path: str
    at: str
    outcome: str
    message: str
    reasons: list[str]
    semantic_keys: list[str]
    operational_keys: list[str]
    saved_config_digest: str | None
    current_config_digest: str | None
    client: str | None
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Validation:
        return cls(
            event_id=_str(data, "event_id"),
            run_id=_opt_str(data, "run_id"),
            output_path=_str(data, "output_path"),
            at=_str(data, "at"),
            outcome=_str(data, "outcome"),
            message=_str(data, "message"),
            reasons=_str_list(data, "reasons"),
            semantic_keys=_str_list(data, "semantic_keys"),
            operational_keys=_str_list(data, "operational_keys"),
            saved_config_digest=_opt_str(data, "saved_config_digest"),
            current_config_digest=_opt_str(data, "current_config_digest"),
            client=_opt_str(data, "client"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class ValidationPage:
    """One page of ``GET /runs/{id}/validations`` (newest first)."""

    validations: list[Validation]
    next_cursor: str | None
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ValidationPage:
        return cls(
            validations=[Validation.from_dict(v) for v in _dicts(data, "validations")],
            next_cursor=_opt_str(data, "next_cursor"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class ClassifyDecision:
    """What every predicate says of one row, and what resume does with it (``verdict``)."""

    verdict: str
    is_failure_row: bool
    failure_kind: str | None
    failure_stage: str | None
    responsibility: str | None
    terminal: bool
    delivery: str | None
    keeps_saved_answer: bool
    has_recorded_grade: bool
    masked_infrastructure_kind: str | None
    masked_kept_answer_kind: str | None
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClassifyDecision:
        return cls(
            verdict=_str(data, "verdict"),
            is_failure_row=_bool(data, "is_failure_row"),
            failure_kind=_opt_str(data, "failure_kind"),
            failure_stage=_opt_str(data, "failure_stage"),
            responsibility=_opt_str(data, "responsibility"),
            terminal=_bool(data, "terminal"),
            delivery=_opt_str(data, "delivery"),
            keeps_saved_answer=_bool(data, "keeps_saved_answer"),
            has_recorded_grade=_bool(data, "has_recorded_grade"),
            masked_infrastructure_kind=_opt_str(data, "masked_infrastructure_kind"),
            masked_kept_answer_kind=_opt_str(data, "masked_kept_answer_kind"),
            raw=_raw(data),
        )


@dataclass(frozen=True)
class ReindexReport:
    """What a reindex found and inserted."""

    manifests: int
    runs: int
    drift_inserted: int
    superseded: list[Any]
    unreadable: list[Any]
    raw: Raw = field(repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReindexReport:
        superseded = data.get("superseded")
        unreadable = data.get("unreadable")
        return cls(
            manifests=_int(data, "manifests"),
            runs=_int(data, "runs"),
            drift_inserted=_int(data, "drift_inserted"),
            superseded=list(superseded) if isinstance(superseded, list) else [],
            unreadable=list(unreadable) if isinstance(unreadable, list) else [],
            raw=_raw(data),
        )
