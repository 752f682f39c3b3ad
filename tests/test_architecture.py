"""The import contracts of ``.importlinter`` hold (``lint-imports``, a kept library), and an
upward import, a new import circle or a part importing what it must not know fails the suite."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO, subprocess_env

LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]
CONTRACTS = len(re.findall(r"^\[importlinter:contract:", (REPO / ".importlinter").read_text(), re.M))


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = subprocess_env()
    env["PYTHONPATH"] = str(root)  # grimp reads the llmtrain found first on the path
    return subprocess.run(LINT + ["--config", str(REPO / ".importlinter"), "--no-cache"], capture_output=True,
                          text=True, cwd=root, env=env, timeout=300)


def _broken(stdout: str) -> list[str]:
    """The names of the broken contracts, in the file's order (lint-imports wraps long names over
    lines, under a line of dashes after the count of files analysed)."""
    listing = " ".join(stdout.split(" dependencies.")[-1].split("Contracts:")[0].split("\n", 2)[2].split())
    # A contract with ignore_imports says how many after its verdict: "BROKEN (3 ignored imports)".
    return [name for name, verdict in re.findall(r"(.+?) (KEPT|BROKEN)(?: \(\d+ ignored imports?\))?(?: |$)", listing)
            if verdict == "BROKEN"]


def _with_line(tmp_path: Path, module: str, line: str) -> Path:
    shutil.copytree(REPO / "llmtrain", tmp_path / "llmtrain", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "llmtrain" / module
    path.write_text(path.read_text() + f"\n\ndef _added():\n    {line}  # noqa: F401\n")
    return tmp_path


def test_import_contracts_hold():
    proc = _lint(REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert CONTRACTS >= 11 and f"{CONTRACTS} kept, 0 broken" in proc.stdout


def test_a_deliberate_circle_breaks_the_layers_the_cycle_and_the_schema_contracts(tmp_path):
    # config.schema -> trainer closes a circle (trainer imports config), points upward, and
    # makes the schema import more than common. Layers contracts follow indirect imports, so the
    # parts whose modules reach the schema break too.
    proc = _lint(_with_line(tmp_path, "config/schema.py", "from llmtrain import trainer"))
    assert proc.returncode == 1, proc.stdout[-4000:]
    broken = _broken(proc.stdout)
    assert f"{CONTRACTS - len(broken)} kept, {len(broken)} broken" in proc.stdout
    assert broken[0].startswith("Parts: commands -> trainer"), broken
    assert "No import cycles between sibling modules of any package" in broken
    assert any(name.startswith("config: the schema at the bottom") for name in broken), broken
    assert not any(name.startswith(("common:", "data never", "objectives never")) for name in broken), broken
    assert "llmtrain.config.schema -> llmtrain.trainer" in proc.stdout


def test_data_that_imports_an_engine_breaks_its_independence(tmp_path):
    proc = _lint(_with_line(tmp_path, "data/order.py", "from llmtrain.engine import base"))
    assert proc.returncode == 1, proc.stdout[-4000:]
    broken = _broken(proc.stdout)
    assert f"{CONTRACTS - 2} kept, 2 broken" in proc.stdout, broken
    assert broken[0].startswith("Parts: commands -> trainer"), broken
    assert broken[1].startswith("data never imports models, engines"), broken
    assert "llmtrain.data.order -> llmtrain.engine.base" in proc.stdout


# Keep the bar for new code: the three places that outgrew their rooms (issue 57) were cut back to
# these sizes; a module or function past them is split where it is added, not later.
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 750, 100


def test_no_module_or_function_outgrows_its_room():
    import ast

    too_long = []
    for path in sorted((REPO / "llmtrain").rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        name = path.relative_to(REPO).as_posix()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(source.splitlines())} lines (module)")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {lines} lines (function)")
    assert not too_long, (f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function; split them: "
                          + "; ".join(too_long))
