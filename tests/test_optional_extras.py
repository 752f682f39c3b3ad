"""llmtrain without its optional extras (``eval``, ``tracking``, ``slurm``): the command line works
and prints no warning about them, and a feature that needs one is refused in one line naming the
extra to install, exit status 2, before anything is written. The packages are hidden from a
fresh interpreter (``sys.modules[name] = None``: every ``import name`` fails, as when it is not
installed; Hydra's plugin scan then finds hydra-submitit-launcher's folder but loads nothing
from it, as in a venv without it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST, subprocess_env

RUNNER = ("import runpy, sys\n"
          "for name in sys.argv[1].split(','):\n"
          "    sys.modules[name] = None  # as if not installed\n"
          "module = sys.argv[2]\n"
          "sys.argv = [module, *sys.argv[3:]]\n"
          "runpy.run_module(module, run_name='__main__', alter_sys=True)\n")
SLURM = ["hydra_plugins.hydra_submitit_launcher", "submitit"]


def _without(hidden: list[str], module: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUNNER, ",".join(hidden), module, *args], capture_output=True,
                          text=True, cwd=cwd, env=subprocess_env(), timeout=600)


def test_without_the_slurm_extra_the_cli_runs_and_says_nothing_of_plugins(tmp_path):
    """A plain ``pip install .`` once printed Hydra's "Error importing
    'hydra_plugins.llmtrain_launcher.launchers' ... buggy" on every command."""
    helped = _without(SLURM, "llmtrain", ["--help"], tmp_path)
    assert helped.returncode == 0 and "+recipe=" in helped.stdout, helped.stderr[-2000:]
    trained = _without(SLURM, "llmtrain", [*FAST, "trainer.max_steps=2", "trainer.eval_every=0",
                                          f"run_dir={tmp_path / 'run'}"], tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step_2").is_dir()
    for output in (helped.stderr, trained.stderr):
        assert "llmtrain_launcher" not in output and "Plugin is incompatible" not in output, output[-2000:]


@pytest.mark.parametrize("hidden, module, args, extra", [
    (SLURM, "llmtrain", ["-m", "hydra/launcher=slurm_local", "trainer.max_steps=1"], "slurm"),
    (["lm_eval"], "llmtrain.evaluate", ["RUN", "tasks=[hh_local]"], "eval"),
    (["lm_eval"], "llmtrain", ["trainer.eval_tasks=[hh_local]"], "eval"),
    (["tensorboard"], "llmtrain", ["tracker.backends=[tensorboard]"], "tracking"),
    (["mlflow"], "llmtrain", ["tracker.backends=[mlflow]"], "tracking"),
    (["torchao"], "llmtrain", ["trainer.optimizer=adamw_8bit"], "lowbit"),
], ids=["slurm-launcher", "evaluate", "in-loop-eval", "tensorboard", "mlflow", "adamw-8bit"])
def test_a_feature_whose_extra_is_missing_is_one_line_naming_it(tmp_path, hidden, module, args, extra):
    run_dir = tmp_path / "run"
    args = [str(tmp_path) if a == "RUN" else a for a in args]
    if module == "llmtrain":
        args = [*FAST, *args, f"run_dir={run_dir}"]
    proc = _without(hidden, module, args, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f'pip install "llmtrain[{extra}]"' in lines[0], proc.stderr[-3000:]
    assert not run_dir.exists()
