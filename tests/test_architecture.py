"""The import layers of ``.importlinter`` hold (``lint-imports``, a kept library), and a new
import circle or an upward import fails the suite."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO, subprocess_env

LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = subprocess_env()
    env["PYTHONPATH"] = str(root)  # grimp reads the llmtrain found first on the path
    return subprocess.run(LINT + ["--config", str(REPO / ".importlinter"), "--no-cache"], capture_output=True,
                          text=True, cwd=root, env=env, timeout=300)


def test_import_layers_and_no_cycles_hold():
    proc = _lint(REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 kept, 0 broken" in proc.stdout


def test_a_deliberate_circle_breaks_both_contracts(tmp_path):
    shutil.copytree(REPO / "llmtrain", tmp_path / "llmtrain", ignore=shutil.ignore_patterns("__pycache__"))
    config = tmp_path / "llmtrain" / "config.py"
    # config -> trainer closes a circle (trainer imports config) and points upward.
    config.write_text(config.read_text() + "\n\ndef _circle():\n    from llmtrain import trainer  # noqa: F401\n")
    proc = _lint(tmp_path)
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert "0 kept, 2 broken" in proc.stdout
    assert "llmtrain.config -> llmtrain.trainer" in proc.stdout
