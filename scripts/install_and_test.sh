#!/usr/bin/env bash
# Fresh machine -> virtual environment with llmtrain and its test tools -> the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests start several processes on the same cores: one OpenMP thread each (as CI does).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
LLMTRAIN_EXTRAS="[dev,tracking]" . scripts/setup_venv.sh
# verifiers (tests/test_verifiers_env.py) without its optional heavy requirements: see
# tests/verifiers-requirements.txt for why.
python -m pip install -q --no-deps "verifiers==0.3.1"
python -m pip install -q -r tests/verifiers-requirements.txt
# Two pytest-xdist workers, a test file each at a time (its module fixtures run once): one-process
# tests run side by side, a test that starts several processes has the cores to itself
# (tests/conftest.py: machine_alone). LLMTRAIN_TEST_WORKERS=0 runs in this process alone.
python -m pytest -q -n "${LLMTRAIN_TEST_WORKERS:-2}" --dist loadfile "$@"
