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
# second idle. Two locks on files both workers open decide what runs beside what:
# - a one-process test holds the core lock shared;
# - a 2-rank launch (``run_cli`` and ``run_scenarios`` with ``nproc=2``) holds the launch lock
#   exclusive and the core lock shared: never two launches at once (four ranks on two cores),
#   but a one-process test beside it. With the machine to themselves, launches held it 65% of
#   the suite's wall clock while the CPUs ran 1.45 cores on average; sharing took the suite
#   from 38 min 13 s to 37 min 42 s (the two ranks keep both cores busier than that average
#   suggested: most of the serial time left is the ``alone`` tests below);
# - the machine alone (core lock exclusive): launches of more than 2 ranks, memory-heavy ones
#   (``run_scenarios(..., alone=True)``; no launch needs it since the bounded GRPO head: the GRPO
#   and distillation 2-rank launches take 2.7-2.9 GB in all), tests that time their own
#   processes (hang timeouts: marked ``alone``, for the test) and modules marked ``alone`` with
#   ``pytestmark`` (the whole module, module fixtures included). A kill at a step needs no
#   machine alone: rank 0 stalls on entering the next step (``test_resume.stalled_after``), so
#   the kill lands there however busy the cores are. In-process tests (the TRL comparisons) and
#   ``mp.spawn`` workers (``with cores_for(2)``) are never alone.
# - a one-rank run beside a vLLM server (marked ``server``) holds what a 2-rank launch does: the
#   trainer and the server mostly take turns (the server samples while the trainer waits, then the
#   trainer trains), so a one-process test fits beside them; they held the machine alone until
#   the suite's 13 min of real-vLLM tests left the second core idle most of that time.
# Without xdist there is one worker and no lock. Levels only rise within a nested hold.
# ``alone`` is scheduling only; ``slow`` is the tier (``-m "not slow"``: the fast tier, in-process
# tests and one-process runs) and takes no lock of its own, so the full suite schedules as before.
_NO_LOCK, _SHARED, _LAUNCH, _EXCLUSIVE = 0, 1, 2, 3
# mode -> (core lock, launch lock)
_FLOCKS = {_NO_LOCK: (fcntl.LOCK_UN, fcntl.LOCK_UN), _SHARED: (fcntl.LOCK_SH, fcntl.LOCK_UN),
           _LAUNCH: (fcntl.LOCK_SH, fcntl.LOCK_EX), _EXCLUSIVE: (fcntl.LOCK_EX, fcntl.LOCK_UN)}


class _CoreLock:
    """The workers' two flocks (cores, launches), held in one of the modes above, never lowered
    by a nested request."""

    def __init__(self, core_path: Path, launch_path: Path):
        self.fds = [os.open(path, os.O_RDWR | os.O_CREAT, 0o644) for path in (core_path, launch_path)]
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
        if mode == self.mode:
            return
        (core_now, launch_now), (core, launch) = _FLOCKS[self.mode], _FLOCKS[mode]
        core_fd, launch_fd = self.fds
        # The launch lock is released before the core lock changes and taken after it: a worker
        # waiting for the launch lock holds the core lock shared, so taking the core lock while
        # holding the launch lock could wait on that worker. Linux converts a flock by dropping
        # it first: two workers upgrading the core lock at once cannot deadlock either.
        if launch != launch_now and launch_now != fcntl.LOCK_UN:
            fcntl.flock(launch_fd, fcntl.LOCK_UN)
        if core != core_now:
            fcntl.flock(core_fd, core)
        if launch != launch_now and launch != fcntl.LOCK_UN:
            fcntl.flock(launch_fd, launch)
        self.mode = mode


_LOCK_LOG = os.environ.get("LLMTRAIN_TEST_LOCK_LOG")  # a path: each hold's request, grant and release times
_core_lock = None
if os.environ.get("PYTEST_XDIST_TESTRUNUID"):
    _lock_files = Path(tempfile.gettempdir()) / f"llmtrain-tests-{os.environ['PYTEST_XDIST_TESTRUNUID']}"
    _core_lock = _CoreLock(_lock_files.with_suffix(".lock"), _lock_files.with_suffix(".launch.lock"))


def _holding(mode: int):
    """Context holding the workers' locks in ``mode`` (nothing without xdist)."""
    return _core_lock.hold(mode) if _core_lock else contextlib.nullcontext()


def machine_alone():
    """Context: no other test runs on this machine's cores meanwhile (under xdist)."""
    return _holding(_EXCLUSIVE)


def cores_for(nproc: int, alone: bool = False):
    """Context for a launch of ``nproc`` processes: a share of the cores for one; for 2, no other
    launch but a one-process test beside it; the machine alone for more, or when ``alone``
    (a launch that needs the memory); a module fixture launches before its first test takes one.
    A launch of several processes belongs to the ``slow`` tier: from a fast test it fails."""
    if nproc > 1 and _item is not None and not _item.get_closest_marker("slow"):
        pytest.fail(f"{_item.nodeid} launches {nproc} processes: mark it @pytest.mark.slow (the fast tier runs "
                    "in-process tests and one-process runs only)", pytrace=False)
    if alone or nproc > 2:
        return _holding(_EXCLUSIVE)
    return _holding(_LAUNCH if nproc == 2 else _SHARED)


_item = None  # the test being set up or run: cores_for keeps multi-process launches out of the fast tier
# test file (tests/test_x.py) -> whether it has a test outside the slow tier, recorded from this
# session's collection before -m/-k select (tests/test_fast_tier.py reads it).
COLLECTED_TIERS: dict[str, bool] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        path = item.path.relative_to(REPO).as_posix()
        COLLECTED_TIERS[path] = COLLECTED_TIERS.get(path, False) or not item.get_closest_marker("slow")


# test file -> [seconds of setup + call + teardown, tests]: summed from every worker's reports (the
# controller of -n 2 receives them all), printed at the end of a run beside --durations' slowest
# tests. A module's launches shared through a module fixture count where its first test needs them;
# setup includes the waits for the core locks (below).
_MODULE_SECONDS: dict[str, list] = {}


def pytest_runtest_logreport(report):
    seconds = _MODULE_SECONDS.setdefault(report.nodeid.split("::")[0], [0.0, 0])
    seconds[0] += report.duration
    seconds[1] += report.when == "call"


def pytest_terminal_summary(terminalreporter):
    """Seconds spent per test module, the slowest first: the per-module figures that
    docs/development.md reports. With ``LLMTRAIN_MODULE_TIMES=path`` all modules also go to a
    JSON file (``{module: [seconds, tests]}``) to compare two runs."""
    if not _MODULE_SECONDS or hasattr(terminalreporter.config, "workerinput"):
        return
    ranked = sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1][0])
    terminalreporter.write_sep("=", f"seconds per test module (slowest 25 of {len(ranked)}, all workers)")
    for module, (seconds, tests) in ranked[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}s {tests:5d} tests  {module}")
    terminalreporter.write_line(f"{sum(s for s, _ in _MODULE_SECONDS.values()):8.1f}s in all")
    if os.environ.get("LLMTRAIN_MODULE_TIMES"):
        Path(os.environ["LLMTRAIN_MODULE_TIMES"]).write_text(json.dumps(dict(ranked), indent=1))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    global _item
    _item = item  # before its fixtures, so a module fixture's launch counts against the test that needs it


def _module_marked_alone(module) -> bool:
    marks = getattr(module, "pytestmark", [])
    return any(m.name == "alone" for m in (marks if isinstance(marks, list) else [marks]))


@pytest.fixture(scope="module", autouse=True)
def _module_cores(request):
    with _holding(_EXCLUSIVE if _module_marked_alone(request.module) else _NO_LOCK):
        yield


@pytest.fixture(autouse=True)
def _test_cores(request):
    node = request.node
    with _holding(_EXCLUSIVE if node.get_closest_marker("alone") else
                  _LAUNCH if node.get_closest_marker("server") else _SHARED):
        yield


def live_processes_in(sessions: set[int]) -> list[int]:
    """Live processes (zombies left out: they hold nothing but their exit status) whose session or
    process group is one of ``sessions``, read from /proc by the tests themselves: the census that
    checks llmtrain's own stopping of its children (llmtrain.common.children) does not use it."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "stat").read_text()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
            if fields[0] not in "ZX" and {int(fields[2]), int(fields[3])} & sessions:
                found.append(int(entry.name))
    return found


def subprocess_env() -> dict:
    env = dict(os.environ)
    # A test that ran wandb in this process left its service's address here; a child inheriting it
    # joins that long-lived service, which still holds the run id of a run the test killed, and
    # the resumed run is refused ("run ID ... is in use").
    env.pop("WANDB_SERVICE", None)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_SILENT="true",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def sigint_as_in_a_terminal() -> None:
    """A child's SIGINT as a terminal's foreground job gets it (``preexec_fn``): a suite run in
    the background (``nohup``, ``&`` without job control) ignores SIGINT, its children inherit
    that, and llmtrain keeps a SIGINT its parent ignores (``interrupt.watch_sigint``), so the
    Ctrl-C tests would test nothing."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


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
                  envs: dict[str, dict[str, str]] | None = None, alone: bool = False,
                  logs: bool = False) -> dict[str, Path]:
    """Train every ``name -> overrides`` run in one torchrun launch of ``nproc`` processes
    (``tests/scenarios.py``), each with the environment variables ``envs[name]`` (if any) set for
    it alone; returns ``name -> run_dir`` (under ``root``). ``alone``: the launch needs the
    machine's memory, no one-process test runs beside it (:func:`cores_for`). ``logs``: each run's
    log lines are kept for :func:`scenario_log`."""
    spec = [[str(root / name), overrides, (envs or {}).get(name, {})] for name, overrides in runs.items()]
    (root / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / "tests" / "scenarios.py"), str(root / "spec.json")]
    env = subprocess_env()
    if logs:
        env["LLMTRAIN_SCENARIO_LOGS"] = "1"
    with cores_for(nproc, alone):
        assert_ok(subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO))
    return {name: root / name for name in runs}


def scenario_log(run_dir: Path) -> str:
    """What llmtrain logged in one run of a ``run_scenarios(..., logs=True)`` launch, every rank's
    lines (rank 0's first): the lines ``python -m llmtrain`` prints at INFO and up."""
    files = sorted(Path(run_dir).parent.glob(f"{Path(run_dir).name}.rank*.log"))
    assert files, f"no log of {run_dir}: run_scenarios(..., logs=True) keeps them"
    return "".join(f.read_text() for f in files)


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
