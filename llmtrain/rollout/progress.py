"""What a slow sampling says while it runs: each prompt an engine finishes advances a progress
line (a step's sampling, the held-out evaluation), and a timer ticks it while one prompt is slow."""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

from llmtrain.monitoring import console
from llmtrain.rollout.engines import RolloutEngine

# A step's sampling says how far it is (``step 3, sampling: 1/2 prompts, ..., eta``) only once it
# has taken this many seconds, then every 10 s: minutes a step on a CPU, silent when it is fast.
SAMPLING_QUIET_S = 10.0


@contextlib.contextmanager
def counting(sampler: RolloutEngine, progress: console.CountProgress, tick_s: float | None = None) -> Iterator[None]:
    """Inside, each prompt ``sampler`` finishes advances ``progress`` (its ``on_sampled`` hook,
    restored after); ``tick_s``: a timer also ticks it every that many seconds, so work whose items
    are slow still says where it stands. ``progress`` is closed on the way out."""
    previous, stop = sampler.on_sampled, threading.Event()

    def ticking() -> None:
        while not stop.wait(tick_s):
            progress.tick()

    if progress.enabled:
        sampler.on_sampled = progress.advance
        if tick_s is not None:
            threading.Thread(target=ticking, name="llmtrain-sampling-progress", daemon=True).start()
    try:
        yield
    finally:
        stop.set()
        sampler.on_sampled = previous
        progress.close()


@contextlib.contextmanager
def sampling_progress(sampler: RolloutEngine, label: str, prompts: int, enabled: bool,
                      say: Callable[[str], None] | None) -> Iterator[None]:
    """A step's progress through its ``prompts`` while ``sampler`` samples them (``label``: ``step
    N, sampling``), said once it has taken :data:`SAMPLING_QUIET_S` (a CPU takes minutes), to
    ``say`` (the step bar's postfix) or the log; ``enabled``: rank 0, single-turn completions
    (multi-turn episodes' engine calls count turns, not prompts)."""
    progress = console.CountProgress(label, prompts, "prompts", enabled, quiet_s=SAMPLING_QUIET_S, say=say)
    # One prompt can take a minute on a CPU: a timer says the step is sampling before any is done.
    with counting(sampler, progress, tick_s=1.0):
        yield
