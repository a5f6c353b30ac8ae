#!/usr/bin/env bash
# CI of the Python client: install what is missing, lint, format check, type check, tests.
#
#   clients/python/ci.sh            # from anywhere; RR_BIN=/path/to/rollout-recovery to choose
#                                   # the service binary (default ../../target/debug/...)
#   PYTHON=/path/to/venv/bin/python clients/python/ci.sh
#
# Every step runs; the script exits non-zero when any of them failed. It never builds the
# service: the binary must exist already.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
PYTHON="${PYTHON:-python3}"
export RR_BIN="${RR_BIN:-$here/../../target/debug/rollout-recovery}"

if [[ ! -x "$RR_BIN" ]]; then
    echo "ci.sh: the service binary $RR_BIN does not exist or is not executable" >&2
    echo "ci.sh: build it (cargo build -p rollout-recovery) or point RR_BIN at one" >&2
    exit 2
fi

have() {
    # The package importable as installed (not only from ./src) and the dev tools present.
    (cd / && "$PYTHON" - <<'PY' 2>/dev/null
import importlib.util, sys
sys.exit(0 if all(importlib.util.find_spec(m) for m in
    ("rollout_recovery_client", "httpx", "pytest", "mypy", "ruff")) else 1)
PY
    )
}

if ! have; then
    echo "== installing the client with its dev tools (pip install -e .[dev])"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check -e ".[dev]" \
        || "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-build-isolation -e ".[dev]" \
        || { echo "ci.sh: cannot install the client and its dev tools" >&2; exit 2; }
fi

failed=()
step() {
    local name="$1"
    shift
    echo "== $name: $*"
    if ! "$@"; then
        failed+=("$name")
    fi
}

step "ruff check" "$PYTHON" -m ruff check src tests examples
step "ruff format" "$PYTHON" -m ruff format --check src tests examples
step "mypy" "$PYTHON" -m mypy --strict src tests examples
step "pytest" "$PYTHON" -m pytest -q -p no:cacheprovider tests

if ((${#failed[@]})); then
    echo "ci.sh: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "ci.sh: all checks passed"
