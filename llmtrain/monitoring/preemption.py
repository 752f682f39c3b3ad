"""Save-and-exit on preemption: SIGTERM, SIGINT, a configurable signal (SLURM's warning) and,
inside a submitit job, the signal submitit forwards (:func:`llmtrain.parallel.distributed.scheduler_signal`).
Submitit's own handler for it (which requeues the job) is kept: once the save is done and the
process group is gone, :func:`hand_over_to_submitit` calls it, so the job is requeued and
resumes from that checkpoint.

A handler only sets a flag; once per step the loop sums every rank's :meth:`Preemption.local_flags`
(in the step's scalar all-reduce, :func:`llmtrain.engine.step.forward_backward`) and
:meth:`Preemption.decide` reads the sums, so every rank sees a signal that reached any rank, and all
ranks save the same step and exit together. An online objective's step that is still sampling
when the signal comes stops at its next decode step and is dropped, every rank agreeing by one
all-reduce after sampling (:meth:`llmtrain.rollout.rollout.Rollout._sample_step`); the trainer
then saves the state of the last finished step
(:meth:`llmtrain.checkpoint.checkpointer.Checkpointer.save_between_steps`).
"""

from __future__ import annotations

import logging
import signal
import time



log = logging.getLogger("llmtrain")


class Preemption:
    """Signal flag plus the wall-clock save cadence, agreed across ranks once per step."""

    def __init__(self, extra_signal: str | None, save_every_minutes: float, scheduler_signal: str | None = None):
        self.requested: str | None = None
        self.save_interval_s = save_every_minutes * 60.0
        self.last_save = time.monotonic()
        names = ["SIGTERM", "SIGINT"]
        names += [name for name in (extra_signal, scheduler_signal) if name and name not in names]
        self._previous = {}
        for name in names:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.requested is None:
            self.requested = signal.Signals(signum).name
            log.warning("received %s: will save a checkpoint at the end of this step (of the last one, when it comes "
                        "while an online step samples) and exit", self.requested)

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


def hand_over_to_submitit() -> bool:
    """After a preemption save inside a submitit job: call submitit's handler of its preemption
    signal (restored by :meth:`Preemption.restore`), which, on the job's first task, pickles the
    job again through hydra-submitit-launcher's ``checkpoint`` and requeues it (``scontrol
    requeue`` on SLURM; exit status 144 for the local executor, which starts the tasks again),
    then exits. Other tasks return from it. Returns False outside submitit."""
    from llmtrain.parallel.distributed import scheduler_signal

    name = scheduler_signal()
    if name is None:
        return False
    handler = signal.getsignal(getattr(signal, name))
    if callable(handler):
        log.warning("preempted inside a submitit job: handing over to submitit to requeue it")
        handler(getattr(signal, name), None)
    return True
