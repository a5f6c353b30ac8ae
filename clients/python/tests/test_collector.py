"""The example collector end to end, and its exit codes (0 / 75 / 76) against the plan."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

from rollout_recovery_client import RecoveryClient, exit_code
from support import Service, read_jsonl, run_collector, write_tasks


def _fresh(service: Service, tasks: int) -> tuple[Path, Path]:
    directory = service.root / f"e2e-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    return directory / "out.jsonl", write_tasks(directory, tasks)


def test_collects_retries_and_completes(client: RecoveryClient, service: Service) -> None:
    output, source = _fresh(service, 12)
    code, events, stderr = run_collector(service.url, output, source, "--fail-every", "3")
    assert code == 0, stderr
    verdict = events[0]
    assert (verdict["event"], verdict["created"], verdict["outcome"]) == ("verdict", True, "reuse")
    rounds = [e for e in events if e["event"] == "round"]
    assert [r["pending"] for r in rounds] == [12, 4, 0]

    # Files beside the output, as a collector leaves them.
    names = {p.name for p in output.parent.iterdir()}
    assert {
        "out.jsonl",
        "out_failures.jsonl",
        "out_manifest.json",
        "out_manifest_identity.json",
        "out_materialized_inputs.jsonl",
        "out_run.lock",
    } <= names
    assert "out_attempts.jsonl" not in names, "the old draft journal is never written"
    results = read_jsonl(output)
    failures = read_jsonl(output.with_name("out_failures.jsonl"))
    assert len(results) == 12
    assert Counter(r["_ng_task_index"] for r in results) == Counter(range(12))
    assert sorted(f["_ng_task_index"] for f in failures) == [0, 3, 6, 9]
    assert all(f["_ng_attempt_index"] == 0 for f in failures)
    retried = {r["_ng_task_index"]: r["_ng_attempt_index"] for r in results}
    assert [retried[t] for t in (0, 3, 6, 9)] == [1, 1, 1, 1]
    assert len(read_jsonl(output.with_name("out_materialized_inputs.jsonl"))) == 12

    run = client.find_run(output)
    assert run is not None
    plan = client.plan(run.run_id)
    assert plan.state_counts == {"scored": 12}
    assert plan.coverage.complete
    assert exit_code(plan) == 0
    assert plan.completion is not None
    assert plan.completion.exit_code == 0

    # Running it again on the complete output runs nothing and writes nothing.
    before = output.read_bytes()
    code, events, stderr = run_collector(service.url, output, source, "--fail-every", "3")
    assert code == 0, stderr
    assert next(e for e in events if e["event"] == "round")["pending"] == 0
    assert not [e for e in events if e["event"] == "rollout"]
    assert output.read_bytes() == before


def test_exit_75_when_retryable_work_remains(client: RecoveryClient, service: Service) -> None:
    output, source = _fresh(service, 6)
    code, events, _ = run_collector(
        service.url, output, source, "--fail-every", "2", "--max-rounds", "1"
    )
    assert code == 75
    done = next(e for e in events if e["event"] == "done")
    assert done["state_counts"] == {"scored": 3, "retryable": 3}
    run = client.find_run(output)
    assert run is not None
    plan = client.plan(run.run_id, limit=1)
    assert plan.completion is not None
    assert plan.completion.exit_code == 75 == exit_code(plan)
    # A resume finishes the work.
    code, _, stderr = run_collector(service.url, output, source, "--fail-every", "2")
    assert code == 0, stderr


def test_exit_76_when_only_exhausted_failures_remain(
    client: RecoveryClient, service: Service
) -> None:
    output, source = _fresh(service, 4)
    code, events, _ = run_collector(
        service.url,
        output,
        source,
        "--fail-every",
        "2",
        "--fail-attempts",
        "99",
        "--max-rounds",
        "5",
    )
    assert code == 76
    done = next(e for e in events if e["event"] == "done")
    assert done["state_counts"] == {"scored": 2, "exhausted": 2}
    assert "2/4 samples completed" in done["message"]
    failures = read_jsonl(output.with_name("out_failures.jsonl"))
    assert len(failures) == 6, "two rollouts failed up to the cap of 3"
