"""Save-and-exit on preemption: SIGTERM, SIGINT and a configurable signal (SLURM's warning).

A handler only sets a flag; once per step the loop sums every rank's :meth:`Preemption.local_flags`
(in the step's scalar all-reduce, :func:`llmtrain.trainer.forward_backward`) and
:meth:`Preemption.decide` reads the sums, so every rank sees a signal that reached any rank, and all
ranks save the same step and exit together.
"""

from __future__ import annotations

import logging
import signal
import time



log = logging.getLogger("llmtrain")


class Preemption:
    """Signal flag plus the wall-clock save cadence, agreed across ranks once per step."""

    def __init__(self, extra_signal: str | None, save_every_minutes: float):
        self.requested: str | None = None
        self.save_interval_s = save_every_minutes * 60.0
        self.last_save = time.monotonic()
        names = ["SIGTERM", "SIGINT"] + ([extra_signal] if extra_signal and extra_signal not in ("SIGTERM", "SIGINT") else [])
        self._previous = {}
        for name in names:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.requested is None:
            self.requested = signal.Signals(signum).name
            log.warning("received %s: will save a checkpoint at the end of this step and exit", self.requested)

    def local_flags(self) -> tuple[float, float]:
        """This rank's (signal received, save due by time), as 0/1, to be summed over ranks."""
        due = self.save_interval_s > 0 and time.monotonic() - self.last_save >= self.save_interval_s
        return float(self.requested is not None), float(due)

    @staticmethod
    def decide(summed_flags: list[float]) -> tuple[bool, bool]:
        """(stop, save_now_by_time) from the world sums of :meth:`local_flags`."""
        return summed_flags[0] > 0, summed_flags[1] > 0

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
