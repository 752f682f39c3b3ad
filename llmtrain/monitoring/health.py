"""A run's health signals: peak memory per rank, loss spikes against the running mean, and what
``trainer.nonfinite`` does with a step whose loss or gradient norm is not finite (skip it, or stop
the run with :class:`~llmtrain.common.errors.TrainingStopped` before anything is saved)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from llmtrain.common.errors import TrainingStopped

if TYPE_CHECKING:
    from llmtrain.checkpoint.state import TrainState

log = logging.getLogger("llmtrain")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process in bytes: CUDA allocator peak, or the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


SPIKE_AFTER_STEPS = 10  # healthy steps in the running mean before trainer.spike_factor applies


def loss_spike(loss: float, state: TrainState, factor: float) -> str | None:
    """Why ``loss`` counts as a spike (``trainer.spike_factor`` x the running mean of healthy
    losses, once ``SPIKE_AFTER_STEPS`` fed it), else None."""
    if factor and state.loss_ema_steps >= SPIKE_AFTER_STEPS and loss > factor * state.loss_ema:
        return f"is above trainer.spike_factor={factor} x the running mean loss {state.loss_ema:.4f}"
    return None


def on_nonfinite(t: Any, step: int, loss: float, grad_norm: float, spike: str | None, skipped_in_a_row: int,
                  last_healthy: str | None, close: Any) -> None:
    """Apply ``trainer.nonfinite`` to a step whose loss or gradient norm is not finite, or whose
    loss is a spike (``spike``: why, see :func:`loss_spike`): with
    ``skip`` (the update was already dropped) log it until ``max_skipped_steps`` in a row;
    otherwise close the run's outputs and raise before anything is saved or exported.

    Raises:
        TrainingStopped: naming the step, the values and the last healthy checkpoint.
    """
    values = (f"loss spike: train loss {loss} {spike}, grad norm {grad_norm}" if spike else
              f"non-finite train loss {loss}, grad norm {grad_norm}")
    if t.nonfinite == "skip" and skipped_in_a_row < t.max_skipped_steps:
        log.warning("step %d: %s: update skipped (%d in a row; trainer.max_skipped_steps=%d)",
                    step, values, skipped_in_a_row, t.max_skipped_steps)
        return
    close()
    why = (f"{skipped_in_a_row} updates in a row were skipped (trainer.max_skipped_steps={t.max_skipped_steps})"
           if t.nonfinite == "skip" else "trainer.nonfinite=stop")
    restart = (f"the last healthy checkpoint is {last_healthy}: resume from it (trainer.resume=auto) to retry with "
               "the same settings (resume refuses a changed trainer.lr or grad_clip: those make a new run, with its "
               "own run_dir)" if last_healthy else
               "no checkpoint was written before it: lower trainer.lr or raise trainer.warmup_steps")
    raise TrainingStopped(f"step {step}: {values} ({why}); nothing was saved or exported from this state; "
                          f"{restart}")


class FlatRewards:
    """Warns when an online objective's groups keep getting one reward each: with
    ``train/frac_reward_zero_std`` at 1.0 every advantage is 0, so the loss and the gradient are 0
    and the step trains nothing. Warned after ``after`` sampled steps in a row, and again each
    time the streak doubles (6, 12, 24, ... steps), not every step; a step with any spread ends
    the streak."""

    def __init__(self, after: int = 3):
        self.after, self.streak, self.first, self.next_warning = after, 0, 0, after

    def observe(self, step: int, metrics: dict[str, float]) -> None:
        """Step ``step``'s rollout metrics (no ``train/frac_reward_zero_std``: nothing was sampled)."""
        fraction = metrics.get("train/frac_reward_zero_std")
        if fraction is None:
            return
        if fraction < 1.0:
            self.streak, self.next_warning = 0, self.after
            return
        self.streak += 1
        self.first = step if self.streak == 1 else self.first
        if self.streak < self.next_warning:
            return
        self.next_warning *= 2
        log.warning("steps %d-%d: every group's completions got the same reward (train/frac_reward_zero_std 1.00, "
                    "reward %.3f), so every advantage is 0 and these steps trained nothing (loss 0, grad norm 0): the "
                    "task is too hard or too easy for the model. Sample more completions per prompt "
                    "(objective.num_generations), more varied ones (rollout.temperature) or longer ones "
                    "(rollout.max_completion_length), or use easier prompts, a larger model or a reward with "
                    "partial credit", self.first, step, metrics.get("train/reward", float("nan")))
