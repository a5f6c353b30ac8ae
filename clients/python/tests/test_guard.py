"""``guard_run`` through a collector's life: create, killed mid-run, resume (reuse), resume
across an operational change (journalled drift), refused across a semantic change."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from collections import Counter
from pathlib import Path

import pytest

import collector as example
from rollout_recovery_client import (
    RecoveryClient,
    ResumeRefusedError,
    RunExistsError,
    RunRecord,
    guard_run,
)
from support import (
    Service,
    bundle,
    collector_command,
    collector_env,
    input_rows,
    new_output,
    read_jsonl,
    run_collector,
    wait_until,
    write_tasks,
)

PORT_KEY = "servers.agent.responses_api_agents.simple_agent.sandbox_port"
TEMPERATURE_KEY = "collection.responses_create_params.temperature"
TASKS = 40


def _complete_lines(path: Path) -> int:
    return len(read_jsonl(path))


def test_guard_creates_a_fresh_run_and_holds_its_lease(client: RecoveryClient, root: Path) -> None:
    output, source = new_output(root, "fresh")
    config, tree = bundle(limit=2)
    rows = input_rows(2)
    with guard_run(client, output, config, tree, rows, source, holder="fresh-collector") as guard:
        assert guard.created
        assert guard.outcome == "reuse"
        assert guard.operational_keys == []
        holder = client.lease_holder(guard.run_id).holder
        assert holder is not None
        assert holder.holder == "fresh-collector"
        assert guard.reserve(["0-0", "1-0"]) == {"0-0": 0, "1-0": 0}
        assert [e.state for e in guard.iter_plan()] == ["missing", "missing"]
        assert guard.plan(limit=1).state_counts == {"missing": 2}
        run_id = guard.run_id
    assert client.lease_holder(run_id).holder is None
    # Guarding the same output again finds the run instead of creating one.
    with guard_run(client, output, config, tree, rows, source) as again:
        assert not again.created
        assert again.run_id == run_id
        assert again.outcome == "reuse"


def test_guard_imports_an_output_without_a_manifest_only_with_allow_unsafe(
    client: RecoveryClient, root: Path
) -> None:
    """A NeMo Gym output from before manifests (materialized inputs and saved results) is
    imported as a legacy run when the collector accepts an unverified identity, as the Python
    module's ``allow_unsafe_resume`` does; the saved answer is kept (gap review 34)."""
    output, source = new_output(root, "legacy")
    config, tree = bundle(limit=2)
    rows = input_rows(2)
    materialized = output.with_name(output.stem + "_materialized_inputs.jsonl")
    materialized.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    saved: dict[str, object] = {"_ng_task_index": 0, "_ng_rollout_index": 0, "reward": 1.0}
    saved["response"] = {"output": [{"type": "message"}], "status": "completed"}
    output.write_text(json.dumps(saved) + "\n", encoding="utf-8")
    with (
        pytest.raises(RunExistsError) as refused,
        guard_run(client, output, config, tree, rows, source),
    ):
        pass
    assert refused.value.run_id is None
    assert "import_legacy" in str(refused.value)
    with guard_run(
        client, output, config, tree, rows, source, allow_unsafe=True, retry_terminal_timeouts=True
    ) as guard:
        assert guard.outcome == "overridden"
        assert [e.state for e in guard.iter_plan()] == ["scored", "missing"]
        assert guard.reserve(["1-0"]) == {"1-0": 0}
    manifest = client.get_run(guard.run_id).manifest
    assert manifest is not None
    assert manifest.raw["legacy_import"] is True
    # The opt-in reaches a run guard_run did not create (hostile review 35: it was dropped).
    assert manifest.raw["retry_terminal_timeouts"] is True


def test_create_kill_resume_drift_refuse(client: RecoveryClient, service: Service) -> None:
    directory = service.root / f"collector-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    source = write_tasks(directory, TASKS)
    output = directory / "out.jsonl"
    args = ("--delay", "0.03", "--ttl", "2", "--lease-wait", "20", "--batch", "2")

    # 1. Create: the collector starts a fresh run; kill it once it has written some rows.
    first = subprocess.Popen(
        collector_command(service.url, output, source, *args, "--holder", "first"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=collector_env(),
    )
    try:
        wait_until(lambda: _complete_lines(output) >= 5, timeout=30, what="5 saved rollouts")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == -signal.SIGKILL
    before = output.read_bytes()
    saved_before = read_jsonl(output)
    finished_before = {(r["_ng_task_index"], r["_ng_rollout_index"]) for r in saved_before}
    assert 5 <= len(finished_before) < TASKS, "killed mid-run"
    run = client.find_run(output)
    assert run is not None
    holder = client.lease_holder(run.run_id).holder
    assert holder is not None, "the killed collector's lease is still live"
    assert holder.holder == "first"

    # 2. Resume: the same bundle is reused; it waits out the dead lease, skips what finished.
    code, events, stderr = run_collector(service.url, output, source, *args, "--holder", "second")
    assert code == 0, stderr
    verdict = next(e for e in events if e["event"] == "verdict")
    assert verdict["outcome"] == "reuse"
    assert verdict["created"] is False
    assert verdict["run_id"] == run.run_id
    first_round = next(e for e in events if e["event"] == "round")
    assert first_round["skipped_finished"] == len(finished_before)
    assert first_round["pending"] == TASKS - len(finished_before)
    rerun = {e["rollout_id"] for e in events if e["event"] == "rollout"}
    assert rerun.isdisjoint({f"{t}-{r}" for t, r in finished_before}), "finished ones skipped"

    after = output.read_bytes()
    assert after.startswith(before[: before.rfind(b"\n") + 1]), "saved rows are never rewritten"
    results = read_jsonl(output)
    per_rollout = Counter((r["_ng_task_index"], r["_ng_rollout_index"]) for r in results)
    assert len(per_rollout) == TASKS
    assert set(per_rollout.values()) == {1}, "no rollout was saved twice"
    assert all(r["_ng_run_id"] == run.run_id for r in results)
    done = next(e for e in events if e["event"] == "done")
    assert done["exit_code"] == 0
    assert done["state_counts"] == {"scored": TASKS}

    # 3. An operational change (the sandbox port): resumes, journalled as drift.
    namespace = example.parse_args(
        ["--output", str(output), "--source", str(source), "--sandbox-port", "8001"]
    )
    rows = example.materialize(example.read_tasks(source), namespace.repeats)
    config, tree = example.bundle(namespace, TASKS)
    with guard_run(client, output, config, tree, rows, source, holder="third") as guard:
        assert guard.outcome == "resume_with_drift"
        assert guard.operational_keys == [PORT_KEY]
        event_id = guard.verdict.drift_event_id
        assert event_id is not None
    drift = client.drift(run_id=run.run_id)
    assert [e.event_id for e in drift.events] == [event_id]
    assert drift.events[0].operational_keys == [PORT_KEY]
    assert event_id in {e.event_id for e in client.iter_drift(key=PORT_KEY)}
    journal = output.with_name("out_manifest_resume_drift.jsonl").read_text().splitlines()
    assert len(journal) == 1
    assert PORT_KEY in journal[0]

    # 4. A semantic change (the temperature): refused, naming the key; the lease is released.
    namespace = example.parse_args(
        ["--output", str(output), "--source", str(source), "--temperature", "0.9"]
    )
    config, tree = example.bundle(namespace, TASKS)
    with (
        pytest.raises(ResumeRefusedError) as caught,
        guard_run(client, output, config, tree, rows, source, holder="fourth"),
    ):
        pytest.fail("a refused resume never enters the block")
    assert caught.value.keys == [TEMPERATURE_KEY]
    assert caught.value.reasons[TEMPERATURE_KEY] == "listed_key"
    assert TEMPERATURE_KEY in caught.value.message
    assert client.lease_holder(run.run_id).holder is None

    # The example collector exits 1 on the same refusal and names the key.
    code, events, _ = run_collector(service.url, output, source, "--temperature", "0.9")
    assert code == 1
    refused = next(e for e in events if e["event"] == "refused")
    assert refused["keys"] == [TEMPERATURE_KEY]
    assert output.read_bytes() == after, "a refused resume writes nothing"


class _LateClient(RecoveryClient):
    """Sees no run at the output, as a collector racing another one's create does."""

    def find_run(self, output_path: str | os.PathLike[str]) -> RunRecord | None:
        return None


def test_guard_adopts_a_run_created_concurrently(service: Service) -> None:
    output, source = new_output(service.root, "race")
    config, tree = bundle(limit=1)
    rows = input_rows(1)
    with service.client() as winner:
        created = winner.create_run(output, source, config, tree, rows)
    with _LateClient(service.url) as late, guard_run(late, output, config, tree, rows, source) as g:
        assert not g.created, "run_exists: the other collector's run is adopted"
        assert g.run_id == created.run_id
        assert g.outcome == "reuse"
