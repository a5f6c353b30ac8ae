#!/usr/bin/env python3
"""An example collector: writes rollouts beside an output as a NeMo Gym collector does, and
resumes after being killed, running only what is not finished.

    python examples/collector.py --url http://127.0.0.1:8787 \\
        --output /data/runs/exp/out.jsonl --source /data/runs/data/train.jsonl

Files beside the output ``D/<stem>.jsonl`` (the service creates the manifest, its identity, the
materialized inputs, the empty output and failures files; this collector appends outcomes):

- ``<stem>.jsonl``: one completed result per line (``reward`` + ``response``),
- ``<stem>_failures.jsonl``: one failure row per line (``_ng_failure_class`` ...).

It never writes the old draft journal ``<stem>_attempts.jsonl`` (the service refuses a run that
has one): execution numbers are reserved through the service, in the manifest, before each
rollout is dispatched.

The "model" is simulated: a rollout sleeps ``--delay`` seconds and scores
``reward = (task_index % 2)``; with ``--fail-every N`` the first ``--fail-attempts`` attempts
(default 1) of every N-th task fail with a retryable ``agent_run_error``, retried in the same
run (``--max-rounds``) within the run's attempt cap.

Exit code: 0 complete, else the completion check's 75 / 1 / 76 (``IncompleteEvaluationError``);
1 when the resume is refused (the semantic keys are printed) or the service refuses the run.
Progress lines go to stdout as JSON (``{"event": ...}``), for people and tests alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollout_recovery_client import (
    LeaseLostError,
    RecoveryClient,
    RecoveryError,
    ResumeRefusedError,
    RunGuard,
    exit_code,
    guard_run,
)

#: Plan states this collector runs (again). ``judge_recoverable`` needs a judge: not simulated.
RUNNABLE = frozenset({"missing", "retryable", "approved_rerun"})


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}, sort_keys=True), flush=True)


def companion(output: Path, suffix: str) -> Path:
    """``D/<stem><suffix>`` beside ``D/<stem>.<ext>`` (Python's ``Path.stem``)."""
    return output.with_name(output.stem + suffix)


def prepare_append(path: Path) -> None:
    """Repair a torn final line (a process killed mid-write) before appending, like the
    collector's store: a complete JSON tail gets its newline, anything else is cut off."""
    if not path.exists():
        return
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    tail = data[cut:]
    try:
        json.loads(tail)
    except ValueError:
        with path.open("r+b") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
        emit("repaired", path=str(path), removed_bytes=len(tail))
        return
    with path.open("ab") as f:
        f.write(b"\n")
        f.flush()
        os.fsync(f.fileno())


def append_line(path: Path, row: Mapping[str, Any]) -> None:
    """One compact JSON line, written with one ``write`` and made durable before returning."""
    line = (json.dumps(row, separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_tasks(source: Path) -> list[dict[str, Any]]:
    tasks = []
    for line in source.read_text(encoding="utf-8").splitlines():
        if line.strip():
            value = json.loads(line)
            tasks.append(value if isinstance(value, dict) else {"input": value})
    return tasks


def materialize(tasks: Sequence[Mapping[str, Any]], repeats: int) -> list[dict[str, Any]]:
    """The expanded input rows: one per (task, repeat), routed to the agent server."""
    return [
        {
            **task,
            "agent_ref": {"name": "agent"},
            "_ng_task_index": task_index,
            "_ng_rollout_index": rollout_index,
        }
        for task_index, task in enumerate(tasks)
        for rollout_index in range(repeats)
    ]


def bundle(args: argparse.Namespace, tasks: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The collection settings and the server configuration tree the service classifies:
    the sandbox port is operational (a resume across it is journalled), the sampling
    temperature semantic (a resume across it is refused)."""
    config: dict[str, Any] = {
        "limit": tasks,
        "num_repeats": args.repeats,
        "responses_create_params": {"temperature": args.temperature},
    }
    global_config: dict[str, Any] = {
        "policy": {"responses_api_models": {"vllm_model": {"model": args.model, "port": 9001}}},
        "agent": {
            "responses_api_agents": {
                "simple_agent": {
                    "sandbox_port": args.sandbox_port,
                    "model_server": {"type": "responses_api_models", "name": "policy"},
                }
            }
        },
    }
    return config, global_config


def run_rollout(
    row: Mapping[str, Any], attempt: int, run_id: str, args: argparse.Namespace
) -> tuple[bool, dict[str, Any]]:
    """Simulate one rollout: (succeeded, the row to save)."""
    time.sleep(args.delay)
    task_index = int(row["_ng_task_index"])
    stamped = {
        "_ng_task_index": task_index,
        "_ng_rollout_index": row["_ng_rollout_index"],
        "_ng_attempt_index": attempt,
        "_ng_run_id": run_id,
    }
    if args.fail_every and task_index % args.fail_every == 0 and attempt < args.fail_attempts:
        message = f"simulated agent crash (attempt {attempt})"
        return False, {
            **row,
            **stamped,
            "_ng_failure_class": "agent_run_error",
            "_ng_failure_terminal": False,
            "_ng_failure_message": message,
            "error": message,
        }
    return True, {
        **stamped,
        "reward": float(task_index % 2),
        "response": {
            "output": [{"type": "message", "content": f"answer {task_index}"}],
            "status": "completed",
        },
    }


def collect(guard: RunGuard, rows: Sequence[Mapping[str, Any]], args: argparse.Namespace) -> None:
    output = Path(guard.output_path)
    results, failures = output, companion(output, "_failures.jsonl")
    prepare_append(results)
    prepare_append(failures)
    by_id = {f"{r['_ng_task_index']}-{r['_ng_rollout_index']}": r for r in rows}
    for round_number in range(1, args.max_rounds + 1):
        entries = list(guard.iter_plan())
        pending = [e for e in entries if e.state in RUNNABLE]
        emit(
            "round",
            round=round_number,
            pending=len(pending),
            skipped_finished=sum(1 for e in entries if e.state in ("scored", "model_final")),
        )
        if not pending:
            return
        for start in range(0, len(pending), args.batch):
            batch = pending[start : start + args.batch]
            # Reserve before dispatch: a kill after this leaves a reserved attempt without an
            # outcome, which the plan reports as missing and a resume runs again.
            attempts = guard.reserve([e.rollout_id for e in batch])
            for entry in batch:
                guard.check()
                attempt = attempts[entry.rollout_id]
                ok, saved = run_rollout(by_id[entry.rollout_id], attempt, guard.run_id, args)
                append_line(results if ok else failures, saved)
                emit("rollout", rollout_id=entry.rollout_id, attempt=attempt, ok=ok)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--url", default=os.environ.get("RR_URL", "http://127.0.0.1:8787"))
    parser.add_argument(
        "--token-env", default="RR_TOKEN", help="environment variable holding the bearer token"
    )
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--source", required=True, type=Path)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.3)
    parser.add_argument("--model", default="m")
    parser.add_argument("--sandbox-port", type=int, default=8000)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds per rollout")
    parser.add_argument("--fail-every", type=int, default=0)
    parser.add_argument("--fail-attempts", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4, help="rollouts reserved at once")
    parser.add_argument("--max-rounds", type=int, default=3)
    parser.add_argument("--holder", default=None)
    parser.add_argument("--ttl", type=int, default=None, help="lease TTL seconds")
    parser.add_argument(
        "--lease-wait",
        type=float,
        default=0.0,
        help="seconds to wait for a live lease (a killed collector's) to expire",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    token = os.environ.get(args.token_env) or None
    tasks = read_tasks(args.source)
    rows = materialize(tasks, args.repeats)
    config, global_config = bundle(args, len(tasks))
    try:
        with (
            RecoveryClient(args.url, token) as client,
            guard_run(
                client,
                args.output,
                config,
                global_config,
                rows,
                args.source,
                holder=args.holder,
                ttl_seconds=args.ttl,
                lease_wait=args.lease_wait,
            ) as guard,
        ):
            emit(
                "verdict",
                run_id=guard.run_id,
                created=guard.created,
                outcome=guard.outcome,
                operational_keys=guard.operational_keys,
            )
            collect(guard, rows, args)
            plan = guard.plan(limit=1)
            code = exit_code(plan)
            emit(
                "done",
                exit_code=code,
                state_counts=plan.state_counts,
                message=plan.completion.message if plan.completion else None,
            )
            return code
    except ResumeRefusedError as refused:
        emit("refused", keys=refused.keys, reasons=refused.reasons, message=refused.message)
        print(f"resume refused: {refused.message}", file=sys.stderr)
        return 1
    except LeaseLostError as lost:
        # Another holder owns the run now; what was saved stays valid and a resume continues.
        emit("lease_lost", message=lost.message)
        return 75
    except RecoveryError as error:
        emit("error", code=error.code, message=error.message)
        print(f"rollout-recovery: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
