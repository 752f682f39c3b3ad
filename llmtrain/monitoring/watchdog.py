"""Hang watchdog: a rank that falls behind is named, every rank's Python stacks are dumped, and
the job exits with status 4, so ``torchrun --max-restarts N`` restarts it from the last checkpoint.

Without it, a rank stuck before a collective makes every other rank wait inside that collective
until the process-group timeout (600 s) ends them with a gloo/NCCL error naming neither the rank
nor where it is. Here the trainer records each rank's position, its step and phase (:data:`PHASES`),
with :meth:`Watchdog.set` (one attribute store on the training thread, nothing else), and a
background thread of each rank writes it every few seconds as a heartbeat file
``run_dir/.watchdog/rank_<N>.json``: files, not the process group, which a hung collective blocks.
Ranks 0 and the last rank read every heartbeat. When the ranks are not all at the same position
and none of them has moved for ``trainer.hang_timeout_s`` seconds (in synchronous training the
ranks ahead are then waiting for the ones behind), the reader that sees it first writes
``run_dir/.watchdog/HANG`` naming the ranks at the lowest position. Every rank polls for that
file, dumps its stacks (:func:`faulthandler.dump_traceback`, all threads) to
``run_dir/hang-<time>/rank_<N>.txt`` and leaves with ``os._exit(4)`` (a blocked collective cannot
be interrupted); rank 0 (or, when rank 0's own watchdog thread is silent, the reader) first logs
one line naming the late ranks, their step and phase, and writes it to ``hang-<time>/report.txt``.

A rank whose watchdog thread cannot run (the process frozen, or a C call holding the GIL) still
gets its stacks: every rank registers :mod:`faulthandler` for SIGUSR2 (unless
``trainer.preempt_signal`` or, inside a submitit job, submitit's preemption signal is SIGUSR2), writing to ``run_dir/.watchdog/rank_<N>.stacks``, and the
reporting rank signals such a rank when it runs on its own host and copies that file
(``kill -USR2 PID`` dumps a rank's stacks there by hand, at any time).

Not a hang here: all ranks at the same step and phase with none moving (a slow checkpoint save,
or a hang inside one phase); a rank that is still sampling its step's completions while the
others wait for it (each decoded token is a move: :meth:`Watchdog.moved`). That is left to the process-group timeout, so a slow phase never
kills a healthy run. The watchdog is off for one process and for ``trainer.hang_timeout_s=0``.

Across nodes: the heartbeat folder lives in ``run_dir``, which must then be on a file system every
node shares (as it must be for checkpoints). No clocks are compared: each reader times the changes
it sees itself. The signal fallback reaches ranks on the reporting rank's own node only. Under
``torchrun --max-restarts``, set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torchrun's default
shared rendezvous store a restarted process group can read the previous attempt's addresses
(pytorch/pytorch#135712).

Test hook: ``LLMTRAIN_FAULT=stall:<rank>:<step>[:<phase>]`` stalls that rank's training thread
forever when it enters ``phase`` (default ``data``) of ``step``, on a launch's first attempt only
(``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a restarted job runs through.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from llmtrain.parallel import distributed

log = logging.getLogger("llmtrain")

# The phases of one step, in order. Step numbers are 1-based: the step being computed.
PHASES = ("data", "forward_backward", "optimizer", "log", "eval", "checkpoint")
START, DONE = "start", "done"  # before the first step of this launch (at the resumed step), after the loop
EXIT_STATUS = 4
DUMP_SIGNAL = "SIGUSR2"


def position(step: int, phase: str) -> tuple[float, int]:
    """Order of progress: by step, then by phase within the step (``start``: after the phases of
    the step it starts from; ``done``: after everything; unknown: before everything)."""
    if phase == DONE:
        return (math.inf, 0)
    if phase == START:
        return (step, len(PHASES))
    if phase in PHASES:
        return (step, PHASES.index(phase))
    return (-math.inf, 0)


def _stall_fault(rank: int) -> tuple[int, str] | None:
    """``(step, phase)`` at which ``LLMTRAIN_FAULT=stall:<rank>:<step>[:<phase>]`` stalls this rank."""
    parts = os.environ.get("LLMTRAIN_FAULT", "").split(":")
    if parts[0] != "stall" or len(parts) not in (3, 4) or int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0):
        return None
    if int(parts[1]) != rank:
        return None
    return int(parts[2]), parts[3] if len(parts) == 4 else PHASES[0]


def _ranks_text(ranks: list[int]) -> str:
    """``rank 3`` / ``ranks 0-2, 5``."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


class Watchdog:
    """One rank's heartbeat and (on ranks 0 and the last) the check of every rank's; see the
    module docstring. Build it with :meth:`start`; disabled, :meth:`set` only records the phase."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, timeout_s: float, step: int,
                 dump_signal: str | None = DUMP_SIGNAL):
        self.run_dir, self.dir = Path(run_dir), Path(run_dir) / ".watchdog"
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.enabled = self.timeout_s > 0 and world_size > 1
        self.interval_s = min(5.0, max(0.2, self.timeout_s / 10))
        self.dump_signal = dump_signal
        self._where: tuple[int, str, int] = (step, START, 0)  # (step, phase, changes): the training thread's
        self._stall = _stall_fault(rank)
        self._beat = 0
        self._pid, self._host = os.getpid(), socket.gethostname()
        self._seen: dict[int, dict[str, Any]] = {}  # rank -> what this reader last saw, and when it changed
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stacks = None
        self._handling = False
        self._warned = False

    @classmethod
    def start(cls, run_dir: Path, rank: int, world_size: int, timeout_s: float, step: int,
              preempt_signals: tuple[str | None, ...] = ()) -> "Watchdog":
        """The watchdog of this rank, its thread started. Collective where enabled (every rank
        calls it at the same point): rank 0 clears an earlier launch's heartbeats, then a barrier.
        ``preempt_signals``: signals that ask for a preemption save (the stacks are then dumped on
        no signal if one of them is SIGUSR2)."""
        dog = cls(run_dir, rank, world_size, timeout_s, step,
                  DUMP_SIGNAL if DUMP_SIGNAL not in preempt_signals else None)
        if dog.enabled:
            if rank == 0:
                shutil.rmtree(dog.dir, ignore_errors=True)
                dog.dir.mkdir(parents=True, exist_ok=True)
            distributed.barrier()
            dog._begin()
        return dog

    def _begin(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.dump_signal:
            self._stacks = open(self.dir / f"rank_{self.rank}.stacks", "w")
            faulthandler.register(getattr(signal, self.dump_signal), file=self._stacks, all_threads=True)
        self._write_heartbeat()
        self._thread = threading.Thread(target=self._run, name="llmtrain-watchdog", daemon=True)
        self._thread.start()

    # ---- the training thread -------------------------------------------------------------------
    def set(self, phase: str, step: int | None = None) -> None:
        """The training thread enters ``phase`` (of :data:`PHASES`) of ``step`` (1-based; default:
        the current step)."""
        where = self._where
        step = where[0] if step is None else step
        self._where = (step, phase, where[2] + 1)
        if self._stall == (step, phase):
            self._stall_forever(step, phase)

    def moved(self) -> None:
        """The training thread made progress inside its phase (a rollout decoded a token): a rank
        that samples longer than the others, which wait for it in the step's collectives, moves
        and is not taken for a hang (one attribute store, as :meth:`set`)."""
        step, phase, changes = self._where
        self._where = (step, phase, changes + 1)

    def _stall_forever(self, step: int, phase: str) -> None:
        log.warning("LLMTRAIN_FAULT: rank %d stalls at step %d, phase %s", self.rank, step, phase)
        while True:
            time.sleep(3600)

    def stop(self) -> None:
        """End the thread after a last heartbeat that reads ``done`` (idempotent; a no-op once a
        hang is being handled: the process is about to exit)."""
        if not self.enabled or self._stop.is_set() or self._handling:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if self._handling:
            return
        self._where = (self._where[0], DONE, self._where[2] + 1)
        try:
            self._write_heartbeat()
        except OSError:
            pass
        if self._stacks is not None:
            faulthandler.unregister(getattr(signal, self.dump_signal))
            self._stacks.close()
            self._stacks = None

    # ---- the watchdog thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write_heartbeat()
                hang = self._read_trigger()
                if hang is None and self.rank in (0, self.world_size - 1):
                    hang = self._check()
                if hang is not None:
                    self._on_hang(hang)  # does not return
            except Exception as err:  # noqa: BLE001  (a watchdog problem must never stop training)
                if not self._warned:
                    log.warning("hang watchdog on rank %d: %s (training goes on)", self.rank, err)
                    self._warned = True

    def _record(self) -> dict[str, Any]:
        step, phase, changes = self._where
        return {"rank": self.rank, "pid": self._pid, "host": self._host, "step": step, "phase": phase,
                "changes": changes, "beat": self._beat}

    def _write_heartbeat(self) -> None:
        with self._lock:
            self._beat += 1
            path = self.dir / f"rank_{self.rank}.json"
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(self._record()))
            os.replace(tmp, path)

    def _read(self, rank: int) -> dict[str, Any] | None:
        try:
            return json.loads((self.dir / f"rank_{rank}.json").read_text())
        except (OSError, ValueError):
            return None

    def _read_trigger(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.dir / "HANG").read_text())
        except (OSError, ValueError):
            return None

    def _check(self) -> dict[str, Any] | None:
        """The hang this reader sees, written as the trigger file (or the one another reader
        wrote first); None while some rank moves or all ranks are at the same position."""
        now = time.monotonic()
        for r in range(self.world_size):
            record = self._record() if r == self.rank else self._read(r)
            seen = self._seen.get(r)
            if seen is None:
                self._seen[r] = {"record": record, "moved": now, "beat_at": now}
                continue
            if record is None:
                continue  # keep the last one read (a file being replaced, a network hiccup)
            old = seen["record"]
            if old is None or (old["pid"], old["changes"]) != (record["pid"], record["changes"]):
                seen["moved"] = now
            if old is None or (old["pid"], old["beat"]) != (record["pid"], record["beat"]):
                seen["beat_at"] = now
            seen["record"] = record
        at = {r: position(s["record"]["step"], s["record"]["phase"]) if s["record"] else position(-1, "")
              for r, s in self._seen.items()}
        still = now - max(s["moved"] for s in self._seen.values())
        if len(set(at.values())) < 2 or still < self.timeout_s:
            return None
        return self._trigger(self._describe(at, still, now))

    def _describe(self, at: dict[int, tuple], still: float, now: float) -> dict[str, Any]:
        lowest = min(at.values())
        late = [r for r, p in at.items() if p == lowest]
        silent_after = max(3 * self.interval_s, 2.0)
        silent = {r: now - s["beat_at"] for r, s in self._seen.items() if now - s["beat_at"] >= silent_after}
        ranks = {str(r): ({k: s["record"][k] for k in ("step", "phase", "host", "pid")} if s["record"] else None)
                 for r, s in self._seen.items()}
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = self.run_dir / f"hang-{stamp}"
        n = 1
        while out.exists():
            n += 1
            out = self.run_dir / f"hang-{stamp}-{n}"

        def where(r: int) -> str:
            info = ranks[str(r)]
            return "no heartbeat yet" if info is None else f"step {info['step']}, phase {info['phase']}"

        groups: dict[str, list[int]] = {}
        for r in sorted(at):
            if r not in late:
                groups.setdefault(where(r), []).append(r)
        others = "; ".join(f"{_ranks_text(rs)} at {w}" for w, rs in groups.items())
        quiet = [r for r in late if r in silent]
        processes = ", ".join(f"host {info['host']} pid {info['pid']}"
                              for info in (ranks[str(r)] for r in late) if info)
        message = (f"hang: {_ranks_text(late)} fell behind at {where(late[0])} ({processes or 'never seen'}); "
                   f"no rank has moved for {still:.0f} s (trainer.hang_timeout_s={self.timeout_s:g}); "
                   f"waiting: {others}"
                   + (f"; the watchdog thread of {_ranks_text(quiet)} is silent too (the process is frozen or holds "
                      "the GIL; the position is the last one it wrote)"
                      if quiet else "")
                   + f"; stacks of every rank in {out}/rank_<N>.txt; every rank exits with status {EXIT_STATUS} "
                     "(torchrun --max-restarts restarts the job from the last checkpoint)")
        reporter = 0 if 0 not in silent else self.rank
        return {"dir": str(out), "late": late, "ranks": ranks, "reporter": reporter, "reader": self.rank,
                "still_s": still, "message": message}

    def _trigger(self, hang: dict[str, Any]) -> dict[str, Any] | None:
        tmp = self.dir / f"HANG.{self.rank}.tmp"
        tmp.write_text(json.dumps(hang))
        try:
            os.link(tmp, self.dir / "HANG")  # atomic, and fails where another reader was first
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        return self._read_trigger()

    def _on_hang(self, hang: dict[str, Any]) -> None:
        """Dump this rank's stacks; the reporter gathers every rank's and logs; then exit."""
        self._handling = True
        try:
            out = Path(hang["dir"])
            out.mkdir(parents=True, exist_ok=True)
            self._dump_own(out)
            grace = 2 * self.interval_s + 2.0
            if self.rank == hang["reporter"]:
                message = self._gather(out, hang, grace)
                log.error("%s", message)
                (out / "report.txt").write_text(message + "\n\n" + json.dumps(hang["ranks"], indent=1) + "\n")
            else:
                deadline = time.monotonic() + grace + 5.0
                while not (out / "report.txt").exists() and time.monotonic() < deadline:
                    time.sleep(0.2)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001
                    pass
            os._exit(EXIT_STATUS)

    def _dump_own(self, out: Path) -> None:
        step, phase, _ = self._where
        path = out / f"rank_{self.rank}.txt"
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(f"rank {self.rank} of {self.world_size} (host {self._host}, pid {self._pid}): step {step}, "
                    f"phase {phase}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(tmp, path)

    def _gather(self, out: Path, hang: dict[str, Any], grace: float) -> str:
        """Wait up to ``grace`` s for every rank's stacks; signal the missing ones on this host
        for theirs. Returns the report line (naming ranks whose stacks are missing)."""
        def missing() -> list[int]:
            present = set(os.listdir(out))
            return [r for r in range(self.world_size) if f"rank_{r}.txt" not in present]

        deadline = time.monotonic() + grace
        while missing() and time.monotonic() < deadline:
            time.sleep(0.1)
        signalled = []
        for r in missing():
            info = hang["ranks"].get(str(r))
            if self.dump_signal and info and info["host"] == self._host:
                try:
                    os.kill(info["pid"], getattr(signal, self.dump_signal))
                    signalled.append(r)
                except OSError:
                    pass
        if signalled:
            time.sleep(1.0)
        for r in signalled:
            try:
                stacks = (self.dir / f"rank_{r}.stacks").read_text()
            except OSError:
                continue
            path = out / f"rank_{r}.txt"
            if not path.exists():
                path.write_text(f"rank {r}: its watchdog thread did not answer; stacks dumped by {self.dump_signal} "
                                f"from rank {self.rank}\n\n{stacks}")
        message = hang["message"]
        if lost := missing():
            message += f"; no stacks from {_ranks_text(lost)} (frozen, on another node)"
        return message
