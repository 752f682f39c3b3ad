"""Shared helpers: compose configs in-process, run the CLI in subprocesses, read metrics."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
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


# ------------------------------------------------------------ sharing the cores between workers
# The suite runs as two pytest-xdist workers on 2 cores (README: ``pytest -n 2``), with one
# OpenMP thread per process: two one-process tests then use both cores where one left the
# second idle. A test that starts several processes (a 2-rank launch fills both cores, a
# GRPO launch takes 7-10 GB a rank) or that times its own processes (kills at a step, hang
# timeouts) has the machine to itself: it holds an exclusive lock on a file both workers
# open, every other test holds it shared. Exclusive holders: ``run_cli`` and ``run_scenarios``
# with ``nproc`` > 1 (for the launch), tests marked ``slow`` (for the test) and modules marked
# ``slow`` with ``pytestmark`` (for the whole module, module fixtures included). Without
# xdist there is one worker and no lock.
_NO_LOCK, _SHARED, _EXCLUSIVE = 0, 1, 2


class _CoreLock:
    """A flock held shared or exclusive, never lowered by a nested request."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.mode = _NO_LOCK

    @contextlib.contextmanager
    def hold(self, mode: int):
        before = self.mode
        requested, test = time.time(), os.environ.get("PYTEST_CURRENT_TEST", "")
        self._set(max(mode, before))
        acquired = time.time()
        try:
            yield
        finally:
            self._set(before)
            if _LOCK_LOG and mode > before:
                # Where the suite's wall clock goes: a launch holding the machine alone is serial.
                with open(_LOCK_LOG, "a") as log:
                    log.write(f"{os.environ.get('PYTEST_XDIST_WORKER', '')}\t{mode}\t{requested:.2f}\t{acquired:.2f}"
                              f"\t{time.time():.2f}\t{test}\n")

    def _set(self, mode: int) -> None:
        if mode != self.mode:
            # Linux converts a flock by dropping it first: two workers upgrading at once cannot
            # deadlock, one of them waits for the other's launch.
            fcntl.flock(self.fd, {_NO_LOCK: fcntl.LOCK_UN, _SHARED: fcntl.LOCK_SH, _EXCLUSIVE: fcntl.LOCK_EX}[mode])
            self.mode = mode


_LOCK_LOG = os.environ.get("LLMTRAIN_TEST_LOCK_LOG")  # a path: each hold's request, grant and release times
_core_lock = None
if os.environ.get("PYTEST_XDIST_TESTRUNUID"):
    _core_lock = _CoreLock(Path(tempfile.gettempdir()) / f"llmtrain-tests-{os.environ['PYTEST_XDIST_TESTRUNUID']}.lock")


def _holding(mode: int):
    """Context holding the workers' core lock in ``mode`` (nothing without xdist)."""
    return _core_lock.hold(mode) if _core_lock else contextlib.nullcontext()


def machine_alone():
    """Context: no other test runs on this machine's cores meanwhile (under xdist)."""
    return _holding(_EXCLUSIVE)


def cores_for(nproc: int):
    """Context for a launch of ``nproc`` processes: the machine alone for several, else a
    share of it (a module fixture launches before its first test takes one)."""
    return _holding(_EXCLUSIVE if nproc > 1 else _SHARED)


def _module_marked_slow(module) -> bool:
    marks = getattr(module, "pytestmark", [])
    return any(m.name == "slow" for m in (marks if isinstance(marks, list) else [marks]))


@pytest.fixture(scope="module", autouse=True)
def _module_cores(request):
    with _holding(_EXCLUSIVE if _module_marked_slow(request.module) else _NO_LOCK):
        yield


@pytest.fixture(autouse=True)
def _test_cores(request):
    with _holding(_EXCLUSIVE if request.node.get_closest_marker("slow") else _SHARED):
        yield


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
    with cores_for(nproc):
        return subprocess.run(cmd + overrides, capture_output=True, text=True, timeout=timeout,
                              env=env or subprocess_env(), cwd=cwd or REPO)


def run_scenarios(runs: dict[str, list[str]], nproc: int, root: Path, timeout: int = 900,
                  envs: dict[str, dict[str, str]] | None = None) -> dict[str, Path]:
    """Train every ``name -> overrides`` run in one torchrun launch of ``nproc`` processes
    (``tests/scenarios.py``), each with the environment variables ``envs[name]`` (if any) set for
    it alone; returns ``name -> run_dir`` (under ``root``)."""
    spec = [[str(root / name), overrides, (envs or {}).get(name, {})] for name, overrides in runs.items()]
    (root / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / "tests" / "scenarios.py"), str(root / "spec.json")]
    with cores_for(nproc):
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
