"""Goodput: productive training time over the wall time since a run's first start, with the
time lost to start-up, evaluation, checkpoints, work redone after a crash, and restarts
(carried across resumes in :class:`llmtrain.checkpoint.state.TrainState`, rank 0's clock)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from llmtrain.monitoring.tracking.jsonl import move_aside

if TYPE_CHECKING:
    from llmtrain.checkpoint.state import TrainState

TIMELINE = "timeline.jsonl"


def timeline_event(run_dir: Path, event: str, fresh: bool = False, **fields: Any) -> None:
    """Append ``{"event": event, "time": <Unix s>, **fields}`` to ``run_dir/timeline.jsonl``, one
    line per process start (``start``: ``step``, ``resumed_from``, ``world_size``, ``recipe``)
    and clean end (``end``: ``step``, ``reason``); a start without an end is a crash. Rank 0 only.
    ``fresh``: a new run moves an earlier run's timeline aside first. The run report reads it.
    """
    path = run_dir / TIMELINE
    if fresh:
        move_aside(path)
    # A kill mid-write leaves a line cut short: the next event starts on a line of its own.
    with open(path, "a+b") as file:
        cut_short = file.tell() > 0 and (file.seek(-1, os.SEEK_END), file.read(1))[1] != b"\n"
        line = json.dumps({"event": event, "time": time.time(), **fields}) + "\n"
        file.write((b"\n" if cut_short else b"") + line.encode("utf-8"))


def unfinished_process(run_dir: Path) -> Optional[dict]:
    """The previous process of ``run_dir`` when it ended without its ``end`` event (killed,
    crashed, or stopped on a bad step): its ``start`` event (``time``, ``step``, ``host``,
    ``pid``) with ``last_step``, the last step ``metrics.jsonl`` logged after that start (its
    start step when none). None for a run that ended cleanly or never started. Rank 0 only."""
    path = run_dir / TIMELINE
    if not path.is_file():
        return None
    last = None
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the kill
        if isinstance(event, dict) and event.get("event") in ("start", "end"):
            last = event
    if last is None or last["event"] != "start":
        return None
    last_step = int(last.get("step", 0))
    metrics = run_dir / "metrics.jsonl"
    for line in metrics.read_text(encoding="utf-8").splitlines() if metrics.is_file() else []:
        try:
            record = json.loads(line)
            if record.get("time", 0.0) >= last.get("time", 0.0):
                last_step = max(last_step, int(record["step"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            continue
    return {**last, "last_step": last_step}


def describe_unfinished(previous: dict, resumed_step: int) -> str:
    """The line a rerun prints about a previous process that did not end cleanly
    (:func:`unfinished_process`), resuming at ``resumed_step`` (0: a fresh start)."""
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(previous.get("time", 0.0)))
    where = f" on {previous['host']}, pid {previous['pid']}" if "host" in previous and "pid" in previous else ""
    last = previous["last_step"]
    redone = max(0, last - resumed_step)
    since = f"since step {resumed_step}" if resumed_step else "at all"
    return (f"the previous process (started {started}{where}) ended after step {last} without its final save "
            f"(killed or crashed) and with no checkpoint {since}: {redone} step{'s' if redone != 1 else ''} "
            f"{'are' if redone != 1 else 'is'} redone. trainer.save_every=N or trainer.save_every_minutes=M "
            "bounds the work a crash loses")


def finished_at(run_dir: Path) -> Optional[float]:
    """When the run's last process ended because it had trained every step (its ``end`` event with
    reason ``finished``, the last event of the timeline), else None (a crash, a preemption, a
    fresh run). Rank 0 only."""
    path = run_dir / TIMELINE
    last = None
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(event, dict) and event.get("event") in ("start", "end"):
            last = event
    if last is not None and last["event"] == "end" and last.get("reason") == "finished":
        return float(last.get("time", 0.0))
    return None


def account_restart(state: TrainState, redone: list[dict], process_started: float, resumed: bool,
                    finished: Optional[float] = None) -> None:
    """Goodput bookkeeping at start-up. A fresh run starts the clock. A resume books the wall
    time the previous process spent after its checkpoint as lost (its records after the
    checkpoint's step, which this run trains again) and the gap until this process started as
    restart time (crash detection, queueing, start-up of the launcher). When the previous process
    had finished (``finished``: its end, :func:`finished_at`), the run was idle until this one
    continued it (a raised ``trainer.max_steps``): that gap is idle time, out of the wall time."""
    if not resumed or not state.run_started_unix:  # a fresh run, or a checkpoint from before goodput
        state.run_started_unix = state.run_started_unix or process_started
        return
    if finished is not None:
        state.idle_s += max(0.0, process_started - max(finished, state.saved_unix))
        return
    last_seen = max([state.saved_unix] + [r.get("time", 0.0) for r in redone])
    state.lost_s += max(0.0, last_seen - state.saved_unix)
    state.restart_s += max(0.0, process_started - last_seen)


def time_metrics(state: TrainState) -> dict[str, float]:
    """``time/goodput`` = productive step time / wall time since the run's first start (Unix
    clock of rank 0; idle gaps after a finished process left out), with the losses broken out,
    all cumulative over resumes; an online objective's generation and reward time (parts of the
    productive time) beside them."""
    wall = max(time.time() - state.run_started_unix - state.idle_s, 1e-9)
    return {"time/goodput": state.productive_s / wall, "time/wall_s": wall, "time/productive_s": state.productive_s,
            "time/startup_s": state.startup_s, "time/eval_s": state.eval_s, "time/checkpoint_s": state.checkpoint_s,
            "time/lost_s": state.lost_s, "time/restart_s": state.restart_s,
            **({"time/generation_s": state.generation_s, "time/reward_s": state.reward_s} if state.generation_s else {})}


def start_run(run_dir: Path, state: TrainState, redone: list[dict], process_started: float, resumed: Any,
              is_main: bool, world_size: int, recipe: str) -> None:
    """A run's start in the goodput accounting (:func:`account_restart`; ``resumed``: the
    checkpoint resumed, or None) and, by rank 0, the timeline's ``start`` event."""
    finished = finished_at(run_dir) if is_main and resumed is not None else None
    account_restart(state, redone, process_started, resumed=resumed is not None, finished=finished)
    if is_main:
        import socket

        timeline_event(run_dir, "start", fresh=resumed is None, step=state.step,
                       resumed_from=resumed.name if resumed else None, world_size=world_size,
                       recipe=recipe, host=socket.gethostname(), pid=os.getpid())
