"""Set-up the benchmarks share: the checkout's llmtrain first on the path, where the data sets
are, one ``python -m llmtrain`` run launched and timed (wall clock and its processes' CPU time)
with its per-step records, and the order of modes within a round (flipped every round, so
drift on a shared machine hits every mode alike).

Import it first in a benchmark (``import benchlib``: this folder is on the path when a script
of it runs), before anything imports llmtrain.
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, TypeVar

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the checkout's llmtrain, not an installed copy
# The data sets the benchmarks read (Tiny Shakespeare, Alpaca, HH-RLHF, ...): LLMTRAIN_BENCH_DATA,
# else the developers' shared folder beside the checkout.
DATA = Path(os.environ.get("LLMTRAIN_BENCH_DATA", REPO.parent / "shared" / "data"))

T = TypeVar("T")


def sum_questions(path: Path, count: int = 400) -> Path:
    """Write ``count`` seeded two-digit sum questions to ``path`` as ``data=prompts`` JSON lines
    (``question``, and an ``answer`` the gsm8k reward reads: ``#### N``); returns ``path``."""
    rng = random.Random(0)
    lines = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        lines.append(json.dumps({"question": f"What is {a} + {b}? Answer with the number.", "answer": f"#### {a + b}"}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def children_cpu_s() -> float:
    """CPU seconds (user + system) of every finished child process of this one so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def alternating(modes: Sequence[T], round_index: int) -> list[T]:
    """``modes`` in order on even rounds and reversed on odd ones."""
    return list(modes) if round_index % 2 == 0 else list(reversed(modes))


@dataclass
class Launched:
    """One finished run: ``wall_s`` and ``cpu_s`` (seconds, all its processes), its
    ``metrics.jsonl`` records and its captured output."""

    wall_s: float
    cpu_s: float
    records: list[dict]
    stdout: str
    stderr: str

    def steps(self, warmup: int = 0) -> list[dict]:
        """The training-step records (those with ``train/step_time_s``) after the first ``warmup``."""
        return [r for r in self.records if "train/step_time_s" in r][warmup:]


def launch(overrides: Sequence[str], run_dir: Path, nproc: int = 1, env: dict | None = None,
           what: str = "run") -> Launched:
    """``python -m llmtrain OVERRIDES run_dir=RUN_DIR`` (under torchrun for ``nproc`` > 1) from the
    checkout, one OpenMP thread per process unless ``OMP_NUM_THREADS`` says otherwise, offline.

    Raises:
        SystemExit: the run failed (``what`` and the tail of its stderr).
    """
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [sys.executable])
    environment = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1",
                       HF_DATASETS_OFFLINE="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
                       PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    environment.update(env or {})
    cpu, started = children_cpu_s(), time.perf_counter()
    proc = subprocess.run(launcher + ["-m", "llmtrain", *overrides, f"run_dir={run_dir}"], capture_output=True,
                          text=True, cwd=REPO, env=environment)
    wall, cpu = time.perf_counter() - started, children_cpu_s() - cpu
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}): {' '.join(overrides)}\n{proc.stderr[-3000:]}")
    metrics = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return Launched(wall, cpu, records, proc.stdout, proc.stderr)
