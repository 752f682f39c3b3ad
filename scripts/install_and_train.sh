#!/usr/bin/env bash
# Fresh machine -> virtual environment with llmtrain -> the main job on the embedded default
# (a tiny Llama-style model on the Python standard library's source; no download).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_venv.sh
python -m llmtrain "$@"
