#!/usr/bin/env bash
# Sourced by install_and_train.sh and install_and_test.sh: create and activate $VENV (default
# .venv) and install llmtrain with the extras in $LLMTRAIN_EXTRAS (e.g. "[dev]"). An environment
# variable, not $1: a script sourced without arguments sees its caller's arguments.
# torch is pinned first: an unpinned torch resolves to a multi-GB CUDA build. On a GPU machine,
# install the torch build for your CUDA instead (https://pytorch.org/get-started/locally/).
VENV="${VENV:-.venv}"
python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
python -m pip install -q ".${LLMTRAIN_EXTRAS:-}"
