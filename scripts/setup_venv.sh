#!/usr/bin/env bash
# Sourced by install_and_train.sh and install_and_test.sh: create and activate $VENV (default
# .venv) and install llmtrain with the extras in $LLMTRAIN_EXTRAS (e.g. "[dev]"). An environment
# variable, not $1: a script sourced without arguments sees its caller's arguments.
# torch is pinned first ($TORCH_VERSION, default 2.13.0): an unpinned torch resolves to the newest
# CUDA build. On PyPI the pin too is the CUDA build on a standard Linux x86-64 machine (several GB);
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu installs PyTorch's CPU build instead (on a
# GPU machine, the index of your CUDA: https://pytorch.org/get-started/locally/). Unset, pip uses
# its own configuration (PyPI, or the index or wheel folder your pip.conf names).
# Each phase prints a line; pip shows what it downloads and installs (minutes on a fresh machine).
VENV="${VENV:-.venv}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
echo "setup_venv: creating the virtual environment $VENV"
python3 -m venv "$VENV"
. "$VENV/bin/activate"
echo "setup_venv: upgrading pip"
python -m pip install -q --upgrade pip
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  echo "setup_venv: installing torch $TORCH_VERSION from $TORCH_INDEX_URL"
  python -m pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
else
  echo "setup_venv: installing torch $TORCH_VERSION from pip's configured index (PyPI's is the CUDA build" \
       "on Linux x86-64; TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu gets the CPU build)"
  python -m pip install "torch==$TORCH_VERSION"
fi
# -W ignore: numpy arrives with llmtrain's dependencies, after this check, and torch warns that it
# is missing ("Failed to initialize NumPy"), which means nothing here.
python -W ignore -c 'import torch; print(f"setup_venv: torch {torch.__version__} installed (" + (f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build") + ")")'
echo "setup_venv: installing llmtrain${LLMTRAIN_EXTRAS:- (no extras)} and its dependencies"
python -m pip install ".${LLMTRAIN_EXTRAS:-}"
echo "setup_venv: done; $VENV is active"
