"""No process outlives its run (issue 61): after every ending, nothing is left of the processes a
run started (their sessions hold no live process) and none of their ``/dev/shm`` files remain.

The children are stand-ins (tests/standin_vllm.py) shaped like vLLM's API server, its engine core
and a worker (one process group, a ``/dev/shm`` file held by the engine), started through the
real code: :class:`~llmtrain.rollout.vllm_engine.VLLMEngine` with ``rollout.vllm_python`` pointing
at the stand-in, and :class:`~llmtrain.evaluation.in_loop.TaskEvals` with the stand-in as its
command. Two levels:

* in-process (fast tier): the close/stop logic for each ending of a child (its leader killed, its
  engine killed, its worker killed, a normal close), the one-line error for a server that died,
  a rerun's stop of a killed run's leftovers (never of a pid the system gave to another process),
  and the error naming who holds a fixed port;
* GRPO runs of the CLI on the stand-in server (``slow``), one per ending: a normal end, a raised
  error, SIGTERM, Ctrl-C, SIGKILL of the trainer, SIGKILL of the server's leader and of its
  worker, and a rerun after the trainer and its server's leader were both killed.

Real vLLM cases: tests/test_grpo_vllm.py (where the vLLM environment exists).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import standin_vllm
from conftest import FAST, REPO, cores_for, live_processes_in, sigint_as_in_a_terminal, subprocess_env

SHM = Path("/dev/shm")
FIXTURES = "tests.grpo_fixtures"


# ---- the census ------------------------------------------------------------------------------------
def _live(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] not in "ZX"  # a zombie holds nothing but its status


class Census:
    """The stand-in processes of one test (each writes ``ROLE PID`` to a file of the test)."""

    def __init__(self, folder: Path):
        self.file = folder / "pids.txt"
        self.env = {"STANDIN_PIDS": str(self.file)}
        self.sessions: set[int] = set()  # the trainers' own sessions (a CLI run is started in one)

    def roles(self) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {}
        if self.file.is_file():
            for line in self.file.read_text().splitlines():
                role, pid = line.split()
                found.setdefault(role, []).append(int(pid))
        return found

    def pid(self, role: str, timeout_s: float = 60) -> int:
        """The first process of ``role`` (waiting up to ``timeout_s`` seconds for it to start)."""
        deadline = time.monotonic() + timeout_s
        while role not in self.roles():
            assert time.monotonic() < deadline, f"no {role} started: {self.roles()}"
            time.sleep(0.05)
        return self.roles()[role][0]

    def left(self, timeout_s: float = 0) -> tuple[list[int], list[Path]]:
        """``(live processes of the stand-ins, of their sessions and of the trainers' sessions, their
        /dev/shm files)``, waiting up to ``timeout_s`` seconds for both to be empty."""
        deadline = time.monotonic() + timeout_s
        while True:
            pids = {p for role, ps in self.roles().items() if role != "served" for p in ps}
            sessions = set(self.roles().get("server", [])) | self.sessions
            processes = sorted({p for p in pids if _live(p)} | set(live_processes_in(sessions)))
            shm = [SHM / f"{standin_vllm.SHM_PREFIX}{p}" for p in pids
                   if (SHM / f"{standin_vllm.SHM_PREFIX}{p}").exists()]
            if (not processes and not shm) or time.monotonic() >= deadline:
                return processes, shm

    def kill_all(self) -> None:
        """What a failed test left (only the stand-ins it started)."""
        for pid in {p for role, ps in self.roles().items() if role != "served" for p in ps}:
            if _live(pid):
                os.kill(pid, signal.SIGKILL)
        for pid in self.roles().get("engine", []):
            (SHM / f"{standin_vllm.SHM_PREFIX}{pid}").unlink(missing_ok=True)


@pytest.fixture
def census(tmp_path, monkeypatch):
    found = Census(tmp_path)
    monkeypatch.setenv("STANDIN_PIDS", str(found.file))
    yield found
    found.kill_all()


# ---- in-process: the close and stop logic ------------------------------------------------------------
def _engine(tmp_path: Path, *extra: str):
    """A VLLMEngine whose server (the stand-in, started) serves ``tmp_path/run``."""
    from llmtrain.config.compose import compose
    from llmtrain.models.build import build_tokenizer
    from llmtrain.rollout.generate import Sampling
    from llmtrain.rollout.vllm_engine import VLLMEngine

    python = standin_vllm.python_wrapper(tmp_path)
    cfg = compose(["objective=grpo", "data=prompts", "rollout.engine=vllm", f"rollout.vllm_python={python}",
                   f"run_dir={tmp_path / 'run'}", "rollout.vllm_start_timeout_s=60", *extra])
    (tmp_path / "run").mkdir(exist_ok=True)
    engine = VLLMEngine(cfg, build_tokenizer(cfg.model), Sampling(max_new=4, end_ids=frozenset({256})))
    engine._launch(tmp_path / "run" / "model")
    return engine


@pytest.mark.parametrize("killed", ["nothing", "server", "engine", "worker"])
def test_closing_the_vllm_engine_stops_its_whole_group_whatever_died_first(tmp_path, census, killed):
    """A killed API server leaves its engine and worker (re-parented to init); close() stops them
    all the same. Before issue 61 close() stopped the group only while its leader lived."""
    engine = _engine(tmp_path)
    census.pid("worker")
    recorded = (tmp_path / "run" / ".children.json").is_file()  # for a rerun, until it is stopped
    if killed != "nothing":
        os.kill(census.pid(killed), signal.SIGKILL)
        time.sleep(0.3)
    engine.close()
    assert census.left(timeout_s=2) == ([], [])
    assert recorded and not (tmp_path / "run" / ".children.json").exists()


def test_a_request_to_a_killed_server_is_one_line_naming_it_and_the_fix(tmp_path, census):
    from llmtrain.common.errors import ChildDied

    engine = _engine(tmp_path)
    os.kill(census.pid("server"), signal.SIGKILL)
    with pytest.raises(ChildDied) as err:
        engine._complete((0, 0, [1, 2, 3], 7, 0, []))  # (group, member, prompt ids, seed, server, images)
    message = str(err.value)
    assert "\n" not in message and "was killed by SIGKILL mid-run" in message and "Rerun the same command" in message
    engine.close()
    assert census.left(timeout_s=2) == ([], [])


def test_a_weights_load_after_the_watcher_gave_up_on_a_server_names_how_it_died(tmp_path, census):
    """The watcher found the server dead first and, its restarts used, wrote the run's last line
    (and let go of the process): a weights load that then finds the server gone ends with that
    line, not with "stopped answering" (test_grpo_vllm's killed API server, when the kill landed
    during a sync)."""
    from llmtrain.common.errors import ChildDied

    engine = _engine(tmp_path, "rollout.vllm_restarts=0")
    engine.work.mkdir()  # (a run's first sync makes it)
    census.pid("worker")  # the engine is up: its /dev/shm file made, its SIGTERM handler set
    os.kill(census.pid("server"), signal.SIGKILL)
    with engine.lock:
        engine._revive(engine.servers[0])  # what the watcher does
    assert engine.servers[0].process is None
    with pytest.raises(ChildDied) as err:
        engine._load_all(tmp_path / "run" / "step_1", 1)
    message = str(err.value)
    assert "\n" not in message and "was killed by SIGKILL" in message and "vllm_restarts=0" in message, message
    engine.close()
    assert census.left(timeout_s=2) == ([], [])


def test_a_rerun_stops_what_a_killed_run_left_and_no_reused_pid(tmp_path, census):
    """The trainer and its server's leader killed at once (nobody closes the engine): the next
    lock of the run folder stops the orphaned engine and worker. A record whose pid now belongs
    to another process is dropped without a signal."""
    from llmtrain.checkpoint import protocol
    from llmtrain.common import children

    engine = _engine(tmp_path)
    census.pid("worker")
    engine.servers[0].process = None  # the trainer is gone: nothing of this process will close it
    os.kill(census.pid("server"), signal.SIGKILL)
    time.sleep(0.3)
    assert _live(census.pid("engine")) and _live(census.pid("worker"))
    run = tmp_path / "run"
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        records = json.loads((run / children.RECORD).read_text())
        # The same pid, another start: a process the system gave a recorded pid to.
        records.append({**records[0], "pid": bystander.pid, "kind": "reused"})
        (run / children.RECORD).write_text(json.dumps(records))
        assert protocol.lock_run_dir(run)
        assert census.left(timeout_s=2) == ([], [])
        assert bystander.poll() is None
        assert not (run / children.RECORD).exists()
    finally:
        bystander.kill()
        bystander.wait()
        protocol._RUN_LOCKS[-1].close()
        protocol._RUN_LOCKS.pop()


_FOLDER_OWNER = """
import os, subprocess, sys, time
from pathlib import Path
from llmtrain.rollout.vllm_server import MemoryFolder

folder = MemoryFolder(Path(sys.argv[1]))
folder.path.mkdir()
# The guard without a parent-death signal: only its look at its parent pid can see this one go.
subprocess.Popen([sys.executable, "-m", "llmtrain.common.children", "folder", str(folder.path), str(os.getpid())],
                 start_new_session=True)
print(folder.path, flush=True)
time.sleep(600)
"""


def test_the_weights_folder_guard_sees_its_trainer_go_without_a_parent_death_signal(tmp_path):
    """The guard of the /dev/shm weights folder also acts when its parent-death signal never
    comes (a parent that died before it was set): it looks at its parent pid each second. (With
    the signal: tests/test_vllm_servers.py, the memory folder's test.)"""
    owner = subprocess.Popen([sys.executable, "-c", _FOLDER_OWNER, str(tmp_path)], stdout=subprocess.PIPE,
                             text=True, env=subprocess_env())
    try:
        folder = Path(owner.stdout.readline().strip())
        assert folder.parent == SHM and folder.is_dir()
        (folder / "model.safetensors").write_bytes(b"0" * 4096)
        time.sleep(0.5)  # the guard is up (a python interpreter)
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while folder.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not folder.exists()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_a_rerun_removes_the_weights_folder_whose_guard_was_killed_with_the_job(tmp_path):
    """An OOM kill of the whole job takes the weights folder's guard too: the rerun, taking the
    run folder's lock, removes the folder recorded beside the guard."""
    from llmtrain.checkpoint import protocol
    from llmtrain.common import children
    from llmtrain.rollout.vllm_server import MemoryFolder

    run = tmp_path / "run"
    run.mkdir()
    folder = MemoryFolder(run)
    path = folder.open(1)
    try:
        (path / "model.safetensors").write_bytes(b"0" * 4096)
        folder.guard.kill()
        folder.guard.wait()
        assert path.is_dir()
        assert protocol.lock_run_dir(run)
        protocol._RUN_LOCKS[-1].close()
        protocol._RUN_LOCKS.pop()
        assert not path.exists() and not (run / children.RECORD).exists()
    finally:
        folder.guard = None
        folder.close()


def test_a_fixed_port_held_by_another_process_is_named_in_one_line(tmp_path, census):
    from llmtrain.rollout.vllm_server import VLLMServerError

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(VLLMServerError, match=rf"rollout.vllm_port={port} is held by pid {os.getpid()} "):
            _engine(tmp_path, f"rollout.vllm_port={port}")
    assert census.roles() == {}


@pytest.mark.parametrize("ending", ["finished", "error", "leader killed"])
def test_task_evaluations_are_stopped_whole_on_every_ending(tmp_path, census, ending):
    """A task evaluation (a stand-in that starts a worker) in a group of its own: its worker goes
    when the run ends on an error, also after its leader was killed, and when it ends itself."""
    from types import SimpleNamespace

    from llmtrain.evaluation.in_loop import TaskEvals

    evals = object.__new__(TaskEvals)
    evals.folder, evals.run_dir, evals.tasks = tmp_path / "eval", tmp_path, ["x"]
    evals.folder.mkdir()
    evals.running, evals.queued = {}, []
    evals.manager = SimpleNamespace(pinned=set(), prune=lambda: None)
    evals._command = lambda path: [sys.executable, standin_vllm.__file__, "--engine"]
    evals._spawn(1, tmp_path)
    worker = census.pid("worker")
    if ending == "finished":
        os.kill(worker, signal.SIGKILL)  # the engine stand-in ends itself (status 1) once its worker is gone
        evals.running[1][0].wait(timeout=10)
        evals._reaped(1, evals.running[1][0])
    else:
        if ending == "leader killed":
            os.kill(census.pid("engine"), signal.SIGKILL)
        evals.stop()
    assert census.left(timeout_s=2)[0] == [] and evals.running == {}
    assert not (tmp_path / ".children.json").exists()


# ---- the CLI: a GRPO run on the stand-in server, each ending -------------------------------------------
def _questions(folder: Path) -> Path:
    rng = random.Random(0)
    path = folder / "questions.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {a}+{b}?", "answer": f"#### {a + b}"}) + "\n"
                            for a, b in ((rng.randint(0, 50), rng.randint(0, 50)) for _ in range(32))))
    return path


def _start(tmp_path: Path, census: Census, steps: int, *extra: str) -> subprocess.Popen:
    """``python -m llmtrain`` (GRPO on the stand-in vLLM server) in a session of its own, as a
    terminal's foreground job."""
    python = standin_vllm.python_wrapper(tmp_path)
    overrides = [o for o in FAST if not o.startswith(("data.max_bytes", "trainer.eval"))] + [
        "objective=grpo", "data=prompts", f"data.path={_questions(tmp_path)}", "data.columns.prompt=question",
        f"reward.functions=[{FIXTURES}:odd_tokens]", "rollout.engine=vllm", f"rollout.vllm_python={python}",
        "rollout.max_completion_length=4", "objective.num_generations=2", f"trainer.max_steps={steps}",
        "data.val_fraction=0.1", "trainer.eval_samples=2", "trainer.eval_every=0", "trainer.global_batch_size=2",
        "trainer.micro_batch_size=2", "trainer.export_hf=false", "trainer.save_every=0",
        f"run_dir={tmp_path / 'run'}", *extra]
    env = {**subprocess_env(), **census.env}
    process = subprocess.Popen([sys.executable, "-m", "llmtrain", *overrides], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, start_new_session=True,
                               preexec_fn=sigint_as_in_a_terminal)
    census.sessions.add(process.pid)
    return process


def _end(process: subprocess.Popen, timeout_s: float = 300) -> tuple[int, str]:
    out, err = process.communicate(timeout=timeout_s)
    return process.returncode, out + err


ENDINGS = {  # ending -> (what the test does once the run samples, the exit status, a line it prints)
    "finished": (None, 0, "eval at step 3"),
    "SIGTERM": (lambda p, c: os.kill(p.pid, signal.SIGTERM), 0, "preempted"),
    "Ctrl-C": (lambda p, c: os.killpg(p.pid, signal.SIGINT), 0, "preempted"),
    "SIGKILL of the trainer": (lambda p, c: os.kill(p.pid, signal.SIGKILL), -9, ""),
    "SIGKILL of the server": (lambda p, c: os.kill(c.pid("server"), signal.SIGKILL), 5,
                              "llmtrain: error: rollout.engine=vllm: the vLLM server"),
    "SIGKILL of its worker": (lambda p, c: os.kill(c.pid("worker"), signal.SIGKILL), 5,
                              "llmtrain: error: rollout.engine=vllm: the vLLM server"),
}


@pytest.mark.slow
@pytest.mark.parametrize("ending", [*ENDINGS, "raised error"])
def test_a_grpo_run_leaves_no_process_and_no_shm_file_after_each_ending(tmp_path, census, ending):
    action, status, line = ENDINGS.get(ending, (None, 1, "checker crashed"))
    extra = [f"reward.functions=[{FIXTURES}:raises_at_step_two]", "objective.num_generations=4",
             "trainer.global_batch_size=4"] if ending == "raised error" else []
    if status == 5:  # no restart: the run ends (restarts: tests/test_vllm_servers.py)
        extra.append("rollout.vllm_restarts=0")
    with cores_for(1):
        process = _start(tmp_path, census, 3 if action is None else 10_000, *extra)
        try:
            if action is not None:
                census.pid("served", timeout_s=240)
                action(process, census)
            code, output = _end(process)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert code == status, output[-4000:]
    assert line in output, output[-4000:]
    if status == 5:  # one line, no traceback
        assert "Traceback" not in output and output.count("llmtrain: error:") == 1, output[-4000:]
    assert census.left(timeout_s=10) == ([], []), output[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("guard", ["alive", "killed too"])
def test_a_killed_run_leaves_no_server_engine_its_guard_or_the_rerun_stops_it(tmp_path, census, guard):
    """The trainer and its server's leader SIGKILLed together. With the server's guard alive
    (vllm_server._GROUP_GUARD), the trainer's death ends the server's group: the engine core and
    its worker are gone without a rerun. With the guard killed too (the OOM killer or ``kill -9``
    taking the whole job), nothing stops them, re-parented to init, until the rerun in the same
    folder, which names them."""
    from llmtrain.common.children import GRACE_S

    with cores_for(1):
        process = _start(tmp_path, census, 10_000)
        try:
            census.pid("served", timeout_s=240)
            records = json.loads((tmp_path / "run" / ".children.json").read_text())
            if guard == "killed too":
                os.kill(next(r["pid"] for r in records if r["kind"] == "vLLM server guard"), signal.SIGKILL)
            os.kill(census.pid("server"), signal.SIGKILL)
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            if guard == "alive":
                deadline = time.monotonic() + GRACE_S + 15
                while (_live(census.pid("engine")) or _live(census.pid("worker"))) and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert not _live(census.pid("engine")) and not _live(census.pid("worker"))
                assert census.left(timeout_s=10) == ([], [])
                return
            time.sleep(0.5)
            assert _live(census.pid("engine")) and _live(census.pid("worker"))
            rerun = _start(tmp_path, census, 1)
            code, output = _end(rerun)
        finally:
            for p in (process, locals().get("rerun")):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()
    assert "stopped the vLLM server (pid" in output and "that the last run in" in output, output[-4000:]
    assert code == 0, output[-4000:]
    assert census.left(timeout_s=10) == ([], []), output[-4000:]
