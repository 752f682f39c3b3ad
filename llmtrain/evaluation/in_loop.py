"""In-loop benchmark scores: ``trainer.eval_tasks=[NAME,...]`` runs lm-evaluation-harness tasks
on the run's checkpoints (every ``trainer.eval_tasks_every`` steps, which are then checkpoint
steps, and at the last step), each in its own process, ``python -m llmtrain.evaluate CHECKPOINT``
(:mod:`llmtrain.evaluation.harness`), started once the checkpoint counts. Training does not wait for it
(llm-foundry's ``async_eval`` pattern; ``trainer.eval_tasks_async=false`` waits, every rank
together, so the hang watchdog sees no straggler). A process of its own also keeps the harness's
seeding (``simple_evaluate`` reseeds Python, NumPy and torch) out of the training streams that
exact resume restores.

Each result lands in ``run_dir/eval/step_N.json`` (the process's output in ``step_N.log``) and
is logged to every tracker at step N, the checkpoint's, when the loop next sees it: a score can
arrive steps later and still sit at its own step (wandb, whose history only grows, files it
under the current step with ``eval/step`` = N as its x-axis).

Exactly once across crashes: a result is logged at step N <= the checkpoint the run resumes from
only if ``metrics.jsonl`` (kept up to that checkpoint by the resume) does not hold it yet; results
of later steps are moved aside (those steps are trained again); due checkpoints with no result
(the evaluation died with the run) are evaluated again. Checkpoints under evaluation are kept
from ``trainer.keep_checkpoints``'s pruning until their process ends. At the end of the run the
loop waits for the evaluations still running; a preempted run stops them (its resume redoes them).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from llmtrain.checkpoint.protocol import CheckpointManager, verify
from llmtrain.common import children
from llmtrain.evaluation import harness
from llmtrain.parallel.distributed import die_with_parent
from llmtrain.monitoring.tracking.jsonl import move_aside

log = logging.getLogger("llmtrain")

POLL_S = 0.5  # how often ranks waiting for rank 0's evaluations look for their end
CLOSED = ".closed"  # rank 0 has waited for every evaluation at the end of the run


# What a launcher sets for the training ranks; the evaluation is one plain process.
_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                     "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID",
                     "TORCHELASTIC_RESTART_COUNT", "LLMTRAIN_FAULT")


class TaskEvals:
    """The run's task evaluations (see the module). Every rank builds one; rank 0 starts, reaps
    and logs them; the others only wait with it in synchronous mode. ``tracker``: the run's
    :class:`llmtrain.monitoring.tracking.Tracker`; ``manager``: its checkpoint manager (pinning);
    ``resume_step``: the step resumed from (None for a fresh run)."""

    def __init__(self, t: Any, run_dir: Path, is_main: bool, tracker: Any, manager: CheckpointManager,
                 resume_step: int | None, device: str):
        self.tasks = list(t.eval_tasks)
        self.every, self.max_steps = t.eval_tasks_every, t.max_steps
        self.wait_for_each = not t.eval_tasks_async
        self.t, self.is_main, self.tracker, self.manager, self.device = t, is_main, tracker, manager, device
        self.folder, self.run_dir = run_dir / "eval", run_dir
        self.running: dict[int, tuple[subprocess.Popen, Path]] = {}  # step -> (process, checkpoint)
        self.queued: list[tuple[int, Path]] = []  # one evaluation runs at a time: the others wait here
        self.logged: dict[int, dict[str, int]] = {}  # step -> {task-score key: documents it was logged from}
        if not self.tasks or not is_main:
            return
        for stale in [*self.folder.glob("step_*.done"), self.folder / CLOSED]:
            stale.unlink(missing_ok=True)  # an earlier process's markers (the other ranks wait for new ones)
        if resume_step is None:
            move_aside(self.folder)
        else:
            self.logged = harness.logged_keys(tracker.kept_records)
            for path in self.folder.glob("step_*.*"):
                if _step_of(path) is not None and _step_of(path) > resume_step and not path.name.endswith(".old"):
                    move_aside(path)  # a step the run trains again
        self.folder.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            self._redo_lost(resume_step)

    def due(self, step: int) -> bool:
        """Whether step ``step`` is evaluated (its checkpoint is then written)."""
        return bool(self.tasks) and (bool(self.every and step % self.every == 0) or step == self.max_steps)

    def checkpoint_counted(self, step: int, path: Path) -> None:
        """Checkpoint ``path`` of ``step`` counts: start its evaluation if due (synchronous mode:
        and wait, every rank). Called on every rank."""
        if not self.due(step):
            return
        if self.is_main and not self._has_result(step):
            self._start(step, path)
        if self.wait_for_each:
            self._wait_together(step)

    def poll(self) -> None:
        """Rank 0: reap finished evaluations and log every result not logged yet."""
        if not self.tasks or not self.is_main:
            return
        for step, (process, path) in list(self.running.items()):
            if process.poll() is not None:
                self._reaped(step, process)
        if self.queued and not self.running:
            self._spawn(*self.queued.pop(0))
        for path in sorted(self.folder.glob("step_*.json"), key=lambda p: _step_of(p) or 0):
            step = _step_of(path)
            if step is None or step in self.running or any(q == step for q, _ in self.queued):
                continue
            record = harness.read_result(path)
            new = harness.unlogged((record or {}).get("scores", {}), self.logged.get(step, {}))
            if not new:
                continue
            self.tracker.log(new, step=step)
            self.logged.setdefault(step, {}).update({k: harness.documents_of(new, k) for k in new})
            shown = ", ".join(f"{k[len(harness.SCORE_PREFIX):]} {v:.4f}" if isinstance(v, float) else
                              f"{k[len(harness.SCORE_PREFIX):]} {v}" for k, v in new.items())
            log.info("task eval at step %d: %s", step, shown)

    def finish(self, preempted: bool) -> None:
        """End of the loop: wait for the evaluations still running (rank 0 logs each) or, for a
        preempted run, stop them (the resume evaluates those checkpoints again). The other ranks
        wait for rank 0's ``.closed`` file (not a collective: the last evaluation may outlast the
        process group's timeout)."""
        if not self.tasks:
            return
        if not self.is_main:
            while not preempted and not (self.folder / CLOSED).exists():
                time.sleep(POLL_S)
            return
        if preempted:
            self.queued = []
        while self.running:
            step, (process, _) = next(iter(self.running.items()))
            if preempted:
                self._stop(step, process)
                continue
            if process.poll() is None:
                log.info("waiting for the task evaluation of step %d (pid %d, output in %s)%s", step, process.pid,
                         self.folder / f"step_{step}.log",
                         f"; then steps {', '.join(str(q) for q, _ in self.queued)}" if self.queued else "")
            process.wait()
            self._reaped(step, process)
            if self.queued:
                self._spawn(*self.queued.pop(0))
        if not preempted:
            self.poll()
        (self.folder / CLOSED).touch()

    def stop(self) -> None:
        """Rank 0, a run ending on an error: stop the evaluations still running (each one's whole
        process group) and drop the queued ones; a resume evaluates their checkpoints again.
        Idempotent."""
        self.queued = []
        for step, (process, _) in list(self.running.items()):
            self._stop(step, process)

    # ---- inside ----------------------------------------------------------------------------
    def _stop(self, step: int, process: subprocess.Popen) -> None:
        """End evaluation ``step``'s process group (SIGTERM first: it removes its temporary export)."""
        self.running.pop(step, None)
        children.stop(self.run_dir, process)

    def _command(self, path: Path) -> list[str]:
        t = self.t
        command = [sys.executable, "-m", "llmtrain.evaluate", str(path), f"tasks=[{','.join(self.tasks)}]",
                   f"out_dir={self.folder}", "log=false", f"batch_size={t.eval_tasks_batch_size}",
                   f"device={self.device}", f"bootstrap_iters={t.eval_tasks_bootstrap_iters}"]
        if t.eval_tasks_limit is not None:
            command.append(f"limit={t.eval_tasks_limit}")
        if t.eval_tasks_include:
            command.append(f"include=[{','.join(str(Path(p).resolve()) for p in t.eval_tasks_include)}]")
        if t.eval_tasks_data_dir:
            command.append(f"data_dir={Path(t.eval_tasks_data_dir).expanduser().resolve()}")
        return command

    def _start(self, step: int, path: Path) -> None:
        """Evaluate checkpoint ``path`` now, or after the one running (its checkpoint pinned
        meanwhile)."""
        self.manager.pinned.add(step)
        if self.running:
            self.queued.append((step, path))
            log.info("task eval of step %d queued behind step %d", step, next(iter(self.running)))
            return
        self._spawn(step, path)

    def _spawn(self, step: int, path: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES and not k.startswith("SUBMITIT_")}
        output = open(self.folder / f"step_{step}.log", "w", encoding="utf-8")
        # A session of its own: its whole group can be stopped (and the terminal's Ctrl-C reaches the
        # trainer alone, which stops it); it gets SIGTERM when the trainer dies.
        process = subprocess.Popen(self._command(path), stdout=output, stderr=subprocess.STDOUT, env=env,
                                   stdin=subprocess.DEVNULL, start_new_session=True,
                                   preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        output.close()
        children.remember(self.run_dir, "task evaluation", process.pid, step=step)
        self.running[step] = (process, path)
        log.info("task eval of step %d started (%s; pid %d, output in %s)", step, ", ".join(self.tasks), process.pid,
                 self.folder / f"step_{step}.log")

    def _reaped(self, step: int, process: subprocess.Popen) -> None:
        self._stop(step, process)  # anything it started and left behind
        self.manager.pinned.discard(step)
        self.manager.prune()  # what trainer.keep_checkpoints held back for this evaluation goes now
        if process.returncode != 0 or harness.read_result(harness.result_path(self.folder, step)) is None:
            import shlex

            log.warning("task eval of step %d failed (exit status %s): see %s; evaluate again with `%s`", step,
                        process.returncode, self.folder / f"step_{step}.log",
                        shlex.join(["python", *process.args[1:]]))

    def _wait_together(self, step: int) -> None:
        """Synchronous mode: rank 0 waits for the process and logs it; the others wait for its
        ``step_N.done`` file (not a collective: an evaluation may outlast the process group's
        timeout)."""
        done = self.folder / f"step_{step}.done"
        if self.is_main:
            while step in self.running or any(q == step for q, _ in self.queued):  # after any it queued behind
                if not self.running:
                    self._spawn(*self.queued.pop(0))
                    continue
                running, (process, _) = next(iter(self.running.items()))
                process.wait()
                self._reaped(running, process)
            self.poll()
            done.touch()
            return
        while not done.exists():
            time.sleep(POLL_S)

    def _redo_lost(self, resume_step: int) -> None:
        """Start the evaluations of due checkpoints up to ``resume_step`` that have no result
        (they died with the process that started them)."""
        for step, path in sorted(self.manager.step_dirs()):
            if step <= resume_step and self.due(step) and not self._has_result(step) and verify(path) is None:
                self._start(step, path)

    def _has_result(self, step: int) -> bool:
        """Whether every task of the run has a score of ``step``, logged or in its result file."""
        record = harness.read_result(harness.result_path(self.folder, step)) or {}
        return set(self.tasks) <= set(record.get("tasks", [])) | {
            k.split("/")[1] for k in self.logged.get(step, {})}


def check(t: Any, image_text: bool | None = None) -> None:
    """Before anything is written: lm-eval is installed, every ``trainer.eval_tasks`` task is
    known and its documents load, and a task with images has an image-text model (``image_text``).

    Raises:
        MissingExtra: lm-eval is not installed; ConfigError: an unknown task or a missing
        ``eval_tasks_include`` folder; DataError: a task's data files are missing.
    """
    from llmtrain.common.errors import require_extra

    require_extra("lm_eval", "eval", "trainer.eval_tasks", instead="or drop trainer.eval_tasks")
    if t.eval_tasks_device:
        harness.check_device(t.eval_tasks_device, "trainer.eval_tasks_device")
    harness.check_tasks(list(t.eval_tasks), harness.include_paths(list(t.eval_tasks_include)), t.eval_tasks_data_dir,
                        image_text=image_text)


def _step_of(path: Path) -> int | None:
    stem = path.name.split(".")[0]
    return int(stem[5:]) if stem.startswith("step_") and stem[5:].isdigit() else None
