#!/usr/bin/env bash
# Fresh machine -> virtual environment with llmtrain and its test tools -> the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
LLMTRAIN_EXTRAS="[dev]" . scripts/setup_venv.sh
python -m pytest -q "$@"
