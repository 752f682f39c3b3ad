#!/usr/bin/env bash
# The GPU benchmark (scripts/bench/gpu.py): one line per configuration, ~8 minutes on one H200.
#   bash scripts/bench/gpu.sh              # every configuration on 1 GPU
#   bash scripts/bench/gpu.sh --nproc 8    # 8 GPUs of this node (adds ring / Ulysses context parallel)
#   bash scripts/bench/gpu.sh --dry-run    # the same code path on CPU with tiny shapes (well under a minute)
# Runs in the checkout's .venv (VENV to use another) unless a virtual environment is active.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ -z "${VIRTUAL_ENV:-}" ]]; then
    VENV="${VENV:-$ROOT/.venv}"
    if [[ ! -x "$VENV/bin/python" ]]; then
        echo "gpu.sh: no virtual environment at $VENV: run 'bash scripts/install_and_test.sh' (or set VENV)" >&2
        exit 2
    fi
    PY="$VENV/bin/python"
else
    PY="$VIRTUAL_ENV/bin/python"
fi
cd "$ROOT"
exec "$PY" scripts/bench/gpu.py "$@"
