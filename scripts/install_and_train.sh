#!/usr/bin/env bash
# Fresh machine -> virtual environment with llmtrain -> the main job on the embedded default
# (a tiny Llama-style model on the Python standard library's source; no download).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
python -m pip install -q .
python -m llmtrain "$@"
