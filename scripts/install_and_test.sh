#!/usr/bin/env bash
# Fresh machine -> virtual environment with llmtrain and its test tools -> the test suite.
# torch is pinned first: an unpinned torch resolves to a multi-GB CUDA build. On a GPU machine,
# install the torch build for your CUDA instead (https://pytorch.org/get-started/locally/).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
python -m pip install -q ".[dev]"
python -m pytest -q "$@"
