"""Helpers shared by the tests: starting the real service, run bundles, row shapes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rollout_recovery_client import RecoveryClient

PACKAGE_DIR = Path(__file__).resolve().parents[1]
EXAMPLE_COLLECTOR = PACKAGE_DIR / "examples" / "collector.py"

OPERATOR_TOKEN = "secret-op-token-0123456789"
COLLECTOR_TOKEN = "secret-col-token-0123456789"
VIEWER_TOKEN = "secret-v-token-0123456789"
TOKENS = (OPERATOR_TOKEN, COLLECTOR_TOKEN, VIEWER_TOKEN)


def binary() -> Path:
    """The service binary: ``$RR_BIN``, else ``../../target/debug/rollout-recovery`` from the
    package directory."""
    configured = os.environ.get("RR_BIN")
    path = (
        Path(configured)
        if configured
        else PACKAGE_DIR / ".." / ".." / "target" / "debug" / "rollout-recovery"
    )
    return path.resolve()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_until(
    condition: Callable[[], bool], *, timeout: float, interval: float = 0.02, what: str = ""
) -> None:
    """Poll ``condition`` until it holds, failing after ``timeout`` seconds (a bounded wait for
    a state, never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(interval)


@dataclass
class Service:
    """One running ``rollout-recovery serve``."""

    url: str
    data_dir: Path
    process: subprocess.Popen[bytes]
    log: Path
    tokens: tuple[str, ...] = ()

    @property
    def root(self) -> Path:
        return self.data_dir / "runs"

    def client(self, token: str | None = None, **kwargs: Any) -> RecoveryClient:
        return RecoveryClient(self.url, token, **kwargs)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, *, graceful: bool = True) -> None:
        if self.process.poll() is None and not graceful:
            self.process.kill()
            self.process.wait(timeout=15)
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)


def start_service(
    data_dir: Path, *extra: str, tokens: Sequence[str] = (), port: int | None = None
) -> Service:
    """Start the binary on a free loopback port (or ``port``, to start a stopped service again
    where its clients look for it) and wait for ``GET /readyz`` (start-up done)."""
    exe = binary()
    if not exe.exists():
        raise RuntimeError(f"the service binary {exe} does not exist (set RR_BIN)")
    data_dir.mkdir(parents=True, exist_ok=True)
    last = ""
    given = port
    for _ in range(3):
        port = given or free_port()
        log = data_dir / f"service-{port}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [
                    str(exe),
                    "serve",
                    "--bind",
                    f"127.0.0.1:{port}",
                    "--data-dir",
                    str(data_dir),
                    *extra,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "RR_LOG": os.environ.get("RR_LOG", "warn")},
            )
        service = Service(f"http://127.0.0.1:{port}", data_dir, process, log, tuple(tokens))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{service.url}/readyz", timeout=1).status_code == 200:
                    return service
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        last = service.log_text()
        service.stop()
        if "in use" not in last.lower():
            break
    raise RuntimeError(f"the service did not become ready:\n{last}")


def bundle(
    *, sandbox_port: int = 8000, temperature: float = 0.3, limit: int = 1
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collection settings and server tree as the main README's first session sends them."""
    config: dict[str, Any] = {
        "limit": limit,
        "responses_create_params": {"temperature": temperature},
    }
    global_config: dict[str, Any] = {
        "policy": {"responses_api_models": {"vllm_model": {"model": "m", "port": 9001}}},
        "agent": {
            "responses_api_agents": {
                "simple_agent": {
                    "sandbox_port": sandbox_port,
                    "model_server": {"type": "responses_api_models", "name": "policy"},
                }
            }
        },
    }
    return config, global_config


def input_rows(tasks: int, repeats: int = 1) -> list[dict[str, Any]]:
    return [
        {"agent_ref": {"name": "agent"}, "_ng_task_index": t, "_ng_rollout_index": r}
        for t in range(tasks)
        for r in range(repeats)
    ]


def result_row(run_id: str, task: int, attempt: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "_ng_task_index": task,
        "_ng_rollout_index": 0,
        "_ng_attempt_index": attempt,
        "_ng_run_id": run_id,
        "reward": 1.0,
        "response": {"output": [{"type": "message"}], "status": "completed"},
        **extra,
    }


def masked_row(run_id: str, task: int, attempt: int = 0) -> dict[str, Any]:
    """A masked result that kept an answer without a grade: awaits an operator's approval."""
    return result_row(
        run_id, task, attempt, reward=0.0, mask_sample=True, failure_kind="verifier_error"
    )


def failure_row(
    run_id: str, task: int, attempt: int = 0, *, terminal: bool = False, **extra: Any
) -> dict[str, Any]:
    return {
        "agent_ref": {"name": "agent"},
        "_ng_task_index": task,
        "_ng_rollout_index": 0,
        "_ng_attempt_index": attempt,
        "_ng_run_id": run_id,
        "_ng_failure_class": "agent_run_error",
        "_ng_failure_terminal": terminal,
        "_ng_failure_message": "boom",
        "error": "boom",
        **extra,
    }


def append_jsonl(path: Path, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Append rows as compact lines; answers the lines as written (without newline)."""
    lines = [json.dumps(r, separators=(",", ":")) for r in rows]
    with path.open("a", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)
    return lines


@dataclass
class RunSpec:
    """A run created for a test, with everything needed to validate it again."""

    run_id: str
    output: Path
    source: Path
    config: dict[str, Any]
    global_config: dict[str, Any]
    rows: list[dict[str, Any]]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def failures(self) -> Path:
        return self.output.with_name(self.output.stem + "_failures.jsonl")

    def companion(self, suffix: str) -> Path:
        return self.output.with_name(self.output.stem + suffix)


def new_output(root: Path, name: str = "run") -> tuple[Path, Path]:
    """A fresh output path and a one-line source dataset under the service's root."""
    directory = root / f"{name}-{uuid.uuid4().hex[:8]}"
    directory.mkdir(parents=True)
    source = directory / "train.jsonl"
    source.write_text('{"question": "1+1?"}\n', encoding="utf-8")
    return directory / "out.jsonl", source


def make_run(client: RecoveryClient, root: Path, *, tasks: int = 3, name: str = "run") -> RunSpec:
    output, source = new_output(root, name)
    config, global_config = bundle(limit=tasks)
    rows = input_rows(tasks)
    created = client.create_run(output, source, config, global_config, rows)
    return RunSpec(created.run_id, output, source, config, global_config, rows)


def collector_command(url: str, output: Path, source: Path, *args: str) -> list[str]:
    """The example collector as a subprocess command line."""
    import sys

    return [
        sys.executable,
        str(EXAMPLE_COLLECTOR),
        "--url",
        url,
        "--output",
        str(output),
        "--source",
        str(source),
        *args,
    ]


def collector_env() -> dict[str, str]:
    """The environment for the example collector: the package importable from ``src`` even
    when it is not installed."""
    src = str(PACKAGE_DIR / "src")
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{path}" if path else src}


def run_collector(
    url: str, output: Path, source: Path, *args: str, timeout: float = 60
) -> tuple[int, list[dict[str, Any]], str]:
    """Run the example collector to its end: (exit code, its JSON events, stderr)."""
    done = subprocess.run(
        collector_command(url, output, source, *args),
        capture_output=True,
        env=collector_env(),
        timeout=timeout,
        check=False,
    )
    return done.returncode, events(done.stdout.decode()), done.stderr.decode()


def events(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def write_tasks(directory: Path, count: int) -> Path:
    """A source dataset of ``count`` tasks."""
    source = directory / "train.jsonl"
    source.write_text("".join(f'{{"question": "{i}+{i}?"}}\n' for i in range(count)))
    return source


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a JSONL file (a torn final line is left out)."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    lines = text.split("\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]
