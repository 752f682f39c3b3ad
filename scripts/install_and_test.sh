#!/usr/bin/env bash
# Fresh machine -> virtual environment with llmtrain and its test tools -> the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_venv.sh "[dev]"
python -m pytest -q "$@"
