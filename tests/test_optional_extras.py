"""llmtrain without its optional extras (``eval``, ``tracking``, ``slurm``, ``lowbit``, ``s3``, ``verifiers``): the command
line works and prints no warning about them, and every feature that needs one is refused in one
line naming the extra to install, exit status 2, before anything is written or built (the ``dev``
extra installs them all, so only hiding them shows this). The packages are hidden from a
fresh interpreter (``sys.modules[name] = None``: every ``import name`` fails, as when it is not
installed; Hydra's plugin scan then finds hydra-submitit-launcher's folder but loads nothing
from it, as in a venv without it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST, REPO, subprocess_env

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


# Every feature that needs an extra: (hidden packages, module run, its arguments, the extra).
CASES = {
    "slurm-launcher": (SLURM, "llmtrain", ["-m", "hydra/launcher=slurm_local", "trainer.max_steps=1"], "slurm"),
    "evaluate": (["lm_eval"], "llmtrain.evaluate", ["RUN", "tasks=[hh_local]"], "eval"),
    "in-loop-eval": (["lm_eval"], "llmtrain", ["trainer.eval_tasks=[hh_local]"], "eval"),
    "tensorboard": (["tensorboard"], "llmtrain", ["tracker.backends=[tensorboard]"], "tracking"),
    "mlflow": (["mlflow"], "llmtrain", ["tracker.backends=[mlflow]"], "tracking"),
    "adamw-8bit": (["torchao"], "llmtrain", ["trainer.optimizer=adamw_8bit"], "lowbit"),
    "qlora": (["torchao"], "llmtrain", ["+peft=qlora"], "lowbit"),
    # Refused for torchao before the check of float8 matmuls (which this CPU lacks).
    "fp8": (["torchao"], "llmtrain", ["engine=torch", "recipe.fp8=true"], "lowbit"),
    # Refused before any request to the store (none is running here).
    "s3": (["s3fs"], "llmtrain", ["data=tokens", "data.path=s3://bucket/tokens"], "s3"),
    "verifiers": (["verifiers"], "llmtrain", ["objective=grpo", "data=prompts", "data.path=q.jsonl",
                                              "rollout.environment=verifiers:gsm8k", "reward.functions=[]",
                                              "rollout.max_completion_length=16"], "verifiers"),
}

# Each require_extra(...) call in llmtrain/ (file, its module argument, its feature argument as
# written) -> the cases above that reach it. A new feature behind an extra fails
# test_every_require_extra_call_has_a_case until it is added here with a case.
CALL_SITES = {
    ("llmtrain/__main__.py", "'hydra_plugins.hydra_submitit_launcher'", "arg"): ["slurm-launcher"],
    ("llmtrain/evaluate.py", "'lm_eval'", "'python -m llmtrain.evaluate'"): ["evaluate"],
    ("llmtrain/evaluation/in_loop.py", "'lm_eval'", "'trainer.eval_tasks'"): ["in-loop-eval"],
    ("llmtrain/planning/preflight.py", "backend", "f'tracker.backends={list(tr.backends)}'"): ["tensorboard", "mlflow"],
    ("llmtrain/planning/preflight.py", "'torchao'", "'trainer.optimizer=adamw_8bit'"): ["adamw-8bit"],
    ("llmtrain/planning/preflight.py", "'torchao'", "f'{peft_label(cfg)} (model.quantize=nf4)'"): ["qlora"],
    ("llmtrain/planning/preflight.py", "'torchao'", "'recipe.fp8=true'"): ["fp8"],
    ("llmtrain/data/remote.py", "'s3fs'", "f'{field}={value}'"): ["s3"],
    ("llmtrain/planning/preflight.py", "'verifiers'", "f'rollout.environment={environment}'"): ["verifiers"],
}


def test_every_require_extra_call_has_a_case():
    found = set()
    for path in sorted((REPO / "llmtrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require_extra":
                module, _, feature = (ast.unparse(a) for a in node.args[:3])
                found.add((str(path.relative_to(REPO)), module, feature))
    assert found == set(CALL_SITES), "require_extra calls without a case (add them to CALL_SITES and CASES): " \
        f"{sorted(found - set(CALL_SITES))}; listed but gone: {sorted(set(CALL_SITES) - found)}"
    assert {case for cases in CALL_SITES.values() for case in cases} == set(CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_a_feature_whose_extra_is_missing_is_one_line_naming_it(tmp_path, case):
    hidden, module, args, extra = CASES[case]
    run_dir = tmp_path / "run"
    args = [str(tmp_path) if a == "RUN" else a for a in args]
    if module == "llmtrain":
        args = [*FAST, *args, f"run_dir={run_dir}"]
    proc = _without(hidden, module, args, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert f'pip install "llmtrain[{extra}]" (in a clone: pip install ".[{extra}]")' in lines[0], lines[0]
    assert not run_dir.exists()
    # Refused while the config is checked: before the tokenizer, the data or the model are read.
    assert "start-up: tokenizer" not in proc.stdout, proc.stdout[-2000:]
