"""The fast tier (``python -m pytest -m "not slow"``, docs/development.md): every test module keeps
at least one test in it, so no part of the package goes unchecked in the inner loop; the ``slow``
marker is for multi-process launches and long runs only (a fast test that launches several
processes fails: ``conftest.cores_for``)."""

from __future__ import annotations

import subprocess
import sys

from conftest import COLLECTED_TIERS, REPO, assert_ok, subprocess_env


def _fast_modules_collected_apart() -> set[str]:
    """The test files with a test in ``-m "not slow"``, from a collection of their own."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow",
                           "-p", "no:cacheprovider", "tests"],
                          capture_output=True, text=True, env=subprocess_env(), cwd=REPO, timeout=600)
    assert_ok(proc)
    return {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}


def test_every_test_module_has_a_test_in_the_fast_tier():
    modules = {f"tests/{path.name}" for path in (REPO / "tests").glob("test_*.py")}
    if COLLECTED_TIERS.keys() >= modules:  # this session collected every file (the suite, either tier)
        fast = {path for path, has_fast in COLLECTED_TIERS.items() if has_fast}
    else:  # a run of some files only
        fast = _fast_modules_collected_apart()
    assert "tests/test_fast_tier.py" in fast
    # A module whose tests all launch several processes gets a cheap in-process test of its part.
    assert sorted(modules - fast) == [], "modules with no test outside the slow tier"
