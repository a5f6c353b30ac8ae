"""The files beside an output, named as the Python module ``nemo_gym.rollouts.rollout_recovery``
names them (and as the service writes them: see the main README's "Files beside an output"), so
code moving to the service keeps its ``*_path_for`` calls.

``D/<stem>.<ext>`` has its companions at ``D/<stem><suffix>``, ``<stem>`` as ``PurePath.stem``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "config_identity_path_for",
    "coverage_path_for",
    "failures_path_for",
    "manifest_path_for",
    "materialized_path_for",
    "resume_drift_path_for",
    "run_lock_path_for",
]


def _companion(path: str | os.PathLike[str], suffix: str) -> Path:
    path = Path(path)
    return path.with_name(path.stem + suffix)


def manifest_path_for(output: str | os.PathLike[str]) -> Path:
    """``<stem>_manifest.json``: the run manifest."""
    return _companion(output, "_manifest.json")


def config_identity_path_for(manifest_path: str | os.PathLike[str]) -> Path:
    """The normalized configuration identity a manifest's ``config_digest`` was taken from,
    saved beside it (``<stem>_manifest_identity.json``)."""
    return _companion(manifest_path, "_identity.json")


def resume_drift_path_for(manifest_path: str | os.PathLike[str]) -> Path:
    """One line per resume that proceeded across operational configuration drift, naming the
    keys (``<stem>_manifest_resume_drift.jsonl``)."""
    return _companion(manifest_path, "_resume_drift.jsonl")


def run_lock_path_for(output: str | os.PathLike[str]) -> Path:
    """The run's stable lock file, named on the resolved output path so that aliases share it;
    never unlink it while another process may hold it open."""
    return _companion(Path(output).resolve(), "_run.lock")


def materialized_path_for(output: str | os.PathLike[str]) -> Path:
    """``<stem>_materialized_inputs.jsonl``: the run's materialized inputs."""
    return _companion(output, "_materialized_inputs.jsonl")


def failures_path_for(output: str | os.PathLike[str]) -> Path:
    """``<stem>_failures.jsonl``: the failures sidecar."""
    return _companion(output, "_failures.jsonl")


def coverage_path_for(output: str | os.PathLike[str]) -> Path:
    """``<stem>_coverage.json``: the coverage snapshot the service writes when a lease is
    granted and released."""
    return _companion(output, "_coverage.json")
