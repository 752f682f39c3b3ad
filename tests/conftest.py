"""Shared helpers: compose configs in-process, run the CLI in subprocesses, read metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
if SHARED_DATA.is_dir():
    # Where the local evaluation tasks find their files (llmtrain.evaluation.local_tasks), as a
    # user's LLMTRAIN_DATA_DIR names the folder they downloaded them to; subprocesses inherit it.
    os.environ.setdefault("LLMTRAIN_DATA_DIR", str(SHARED_DATA))

# Small, fast settings shared by the multi-process tests (tiny model, short blocks). 327975 bytes:
# the first 11 stdlib files whole, the text max_bytes=300000 read when it capped whole files.
FAST = ["tracker=none", "tracker.report=false", "trainer.progress_bar=false", "data.max_bytes=327975", "data.seq_len=64",
        "trainer.eval_every=0", "trainer.eval_samples=8",
        # Tests compare numbers against references computed in fp32: the default (auto) would pick
        # bf16 on a CPU with AMX. Tests of bf16 and of auto say so after FAST.
        "trainer.precision=fp32"]


def subprocess_env() -> dict:
    env = dict(os.environ)
    # A test that ran wandb in this process left its service's address here; a child inheriting it
    # joins that long-lived service, which still holds the run id of a run the test killed, and
    # the resumed run is refused ("run ID ... is in use").
    env.pop("WANDB_SERVICE", None)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_SILENT="true",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def run_cli(overrides: list[str], nproc: int = 1, launcher: str = "torchrun", timeout: int = 600,
            env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m llmtrain`` (one process) or under torchrun / accelerate with ``nproc``."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "llmtrain"]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "llmtrain"]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines=1",
               f"--num_processes={nproc}", "--main_process_port=0", "--mixed_precision=no",
               "--dynamo_backend=no", "-m", "llmtrain"]
    return subprocess.run(cmd + overrides, capture_output=True, text=True, timeout=timeout,
                          env=env or subprocess_env(), cwd=cwd or REPO)


def run_scenarios(runs: dict[str, list[str]], nproc: int, root: Path, timeout: int = 900) -> dict[str, Path]:
    """Train every ``name -> overrides`` run in one torchrun launch of ``nproc`` processes
    (``tests/scenarios.py``); returns ``name -> run_dir`` (under ``root``)."""
    spec = [[str(root / name), overrides] for name, overrides in runs.items()]
    (root / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / "tests" / "scenarios.py"), str(root / "spec.json")]
    assert_ok(subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=subprocess_env(), cwd=REPO))
    return {name: root / name for name in runs}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_rows(run_dir: Path, steps: int) -> list[dict]:
    """The ``train/loss`` rows of ``run_dir/metrics.jsonl``, checked to be steps 1..``steps`` once each."""
    rows = [r for r in read_metrics(run_dir) if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    return rows


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-8000:]}"


def make_cfg(overrides: list[str]):
    """Compose the shipped config in-process, as ``python -m llmtrain OVERRIDES`` would, with
    ``trainer.precision=fp32`` unless the overrides set it (as FAST pins it)."""
    from llmtrain.config.compose import compose

    pin = [] if any(o.startswith("trainer.precision=") for o in overrides) else ["trainer.precision=fp32"]
    return compose(pin + list(overrides))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not present")
    return SHARED_DATA
