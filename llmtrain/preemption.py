"""Save-and-exit on preemption: SIGTERM, SIGINT and a configurable signal (SLURM's warning).

A handler only sets a flag; the loop asks :meth:`Preemption.agree` at each step boundary, where
one all-reduce makes every rank see a signal that reached any rank, so all ranks save the same
step and exit together.
"""

from __future__ import annotations

import logging
import signal
import time

import torch

from llmtrain import distributed

log = logging.getLogger("llmtrain")


class Preemption:
    """Signal flag plus the wall-clock save cadence, agreed across ranks once per step."""

    def __init__(self, extra_signal: str | None, save_every_minutes: float, device: torch.device):
        self.requested: str | None = None
        self.device = device
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

    def agree(self) -> tuple[bool, bool]:
        """(stop, save_now_by_time), identical on all ranks. Collective call."""
        due = self.save_interval_s > 0 and time.monotonic() - self.last_save >= self.save_interval_s
        flags = torch.tensor([float(self.requested is not None), float(due)], device=self.device)
        distributed.all_reduce_sum(flags)
        return bool(flags[0] > 0), bool(flags[1] > 0)

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
