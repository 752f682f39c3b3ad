#!/usr/bin/env bash
# Fresh machine -> virtual environment with llmtrain and its test tools -> the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests start several processes on the same cores: one OpenMP thread each (as CI does).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
LLMTRAIN_EXTRAS="[dev,tracking]" . scripts/setup_venv.sh
python -m pytest -q "$@"
