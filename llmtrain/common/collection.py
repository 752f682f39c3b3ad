"""Python's cyclic garbage collector on the training loop's schedule (``trainer.gc_every``).

CPython's automatic collector runs a full (generation 2) collection whenever enough objects have
survived the younger collections, and a full collection traverses every object the collector
tracks. Once torch, transformers and a model are imported and built, that is 470,000-630,000
objects, 0.24-0.29 s a collection on the 2-core development machine. The default job's 30-step
loop spent 0.6 s of its 5.7 s in two of them; a 2-rank FSDP2 resume of SmolLM2-135M's shape took
0.55 s instead of 0.31 s (median of 9) because one rank's collection held the other at DCP's next
collective. The moments differ between ranks, so each rank's pause becomes every rank's.

So, as torchtitan (``training.gc_freq``) and Megatron-LM (``--manual-gc``) do, the loop owns the
schedule: every rank collects at the same step, every ``gc_every`` steps, and the automatic
collector is off in between. Objects that exist when the loop starts (the libraries, the model,
the data) are moved to CPython's permanent generation (``gc.freeze``), which collections skip,
so a scheduled full collection only traverses what the loop itself keeps (a few milliseconds).
Set-up's own garbage is collected once before that freeze, so none of it is kept. Objects are
still freed by reference counting at once; only garbage in reference cycles waits for the next
scheduled collection (or, for objects set-up built, for the run's end).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("llmtrain")

# What this module changed, for restore: (the automatic collector was on, it froze objects).
_changed: tuple[bool, bool] | None = None
# A run ended in this process (restore ran): its objects may be garbage in reference cycles.
_run_ended = False


class CollectionSchedule:
    """Full collections every ``every`` optimizer steps, at the same steps on every rank.

    Args:
        every: steps between collections; 0 leaves Python's automatic collector as it is (and
            freezes nothing).
    """

    def __init__(self, every: int) -> None:
        self.every = every

    def set_up(self) -> None:
        """Before a run's set-up: freeze the objects that exist (imported modules, their
        functions and classes, which live to the process's end), so that the automatic
        collections during set-up traverse set-up's own objects only. The collector stays on.
        A freeze made before by someone else (a host application) is left as it is, and this
        module then freezes nothing.

        After an earlier run in the same process (a Hydra sweep's in-process jobs, a benchmark's
        configurations) it collects first: the Trainer that ended is garbage in reference cycles
        (its evaluator's and sampler's closures hold it), and freezing it would keep its model and
        optimizer state, on an accelerator too, through the whole next run."""
        global _changed, _run_ended
        if self.every and _changed is None:
            ours = gc.get_freeze_count() == 0
            if ours:
                if _run_ended:
                    gc.collect()
                gc.freeze()
            _changed = (gc.isenabled(), ours)
            _run_ended = False

    def start(self) -> None:
        """At the loop's start (set-up and any resume done): collect set-up's garbage, freeze what
        set-up built (the model, the data, the optimizer state) and turn the automatic collector
        off.

        The collection comes first because a freeze keeps whatever it moves, garbage included,
        until :func:`restore`: a reference cycle left by the model's build or a resume's loaded
        state would otherwise hold its memory for the whole run. It traverses set-up's objects
        only (the imports were frozen by :meth:`set_up`): 0.10-0.12 s for the default job here.
        Objects that set-up built and the loop drops later are still freed by reference counting;
        only those of them in reference cycles wait for the run's end."""
        if not self.every:
            return
        self.set_up()
        if _changed is not None and _changed[1]:
            started = time.perf_counter()
            found = gc.collect()
            log.debug("garbage collection before the loop: %d unreachable objects, %.3f s", found,
                      time.perf_counter() - started)
            gc.freeze()
        gc.disable()

    def collect_if_due(self, steps_done: int) -> float:
        """A full collection when ``steps_done`` (optimizer steps finished, in this process or
        before a resume) is a positive multiple of ``every``; returns its seconds (0.0: none)."""
        if not self.every or steps_done <= 0 or steps_done % self.every:
            return 0.0
        started = time.perf_counter()
        found = gc.collect()
        seconds = time.perf_counter() - started
        log.debug("scheduled garbage collection after step %d: %d unreachable objects, %.3f s", steps_done, found, seconds)
        return seconds


def restore() -> None:
    """Undo what :class:`CollectionSchedule` changed: unfreeze what it froze and turn the
    automatic collector back on if it was on. Idempotent; a run calls it when it ends or fails,
    so that a process that goes on (a sweep, a test session) collects as it did before."""
    global _changed, _run_ended
    if _changed is None:
        return
    enabled, ours = _changed
    _changed = None
    _run_ended = True
    if ours:
        gc.unfreeze()
    if enabled:
        gc.enable()
