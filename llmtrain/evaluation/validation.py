"""Held-out loss during training: the objective's mean over every rank's validation batches
(perplexity = exp(loss) for next-token objectives), at ``trainer.eval_every`` steps and at the
last step, every rank making the same number of forward passes; and the line each evaluation
logs (:func:`log_eval`)."""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

import torch

from llmtrain.checkpoint.state import TrainState
from llmtrain.common.labels import IGNORE_INDEX
from llmtrain.objectives import Objective
from llmtrain.parallel import distributed

log = logging.getLogger("llmtrain")


@torch.no_grad()
def evaluate(engine, batches: list[dict], device: torch.device) -> dict[str, float]:
    """Validation loss (the objective's mean over all ranks' batches; for next-token training,
    mean token CE), perplexity = exp(loss), and the objective's metrics as ``val/NAME``.

    Ranks with fewer batches run forwards on a batch without targets, so every rank makes the
    same number of forward passes (ZeRO-3 gathers parameters collectively in each one).
    """
    objective: Objective = engine.objective
    engine.train(False)
    replicas = engine.dims.data_replicas
    most = distributed.all_reduce_max(torch.tensor(len(batches), device=device))
    no_targets = {"input_ids": torch.zeros(1, 2, dtype=torch.long), "attention_mask": torch.ones(1, 2, dtype=torch.long),
                  "labels": torch.full((1, 2), IGNORE_INDEX, dtype=torch.long)}
    names = objective.metric_names
    totals = torch.zeros(2 + len(names), dtype=torch.float64, device=device)
    for batch in list(batches) + [objective.prepare(no_targets)] * (int(most) - len(batches)):
        batch = {k: v.to(device) for k, v in batch.items()}
        totals[:-1] += engine.eval_sums(batch)
        totals[-1] += objective.normaliser(batch).double()
    distributed.all_reduce_sum(totals)
    totals /= replicas
    engine.train(True)
    normaliser = totals[-1].clamp(min=1)
    loss = float(totals[0] / normaliser)
    perplexity = {"val/perplexity": math.exp(min(loss, 50.0))} if objective.reports_perplexity else {}
    if objective.counted_unit:
        perplexity[f"val/{objective.counted_unit}"] = int(totals[-1])
    averaged = objective.average({name: float(totals[1 + k]) for k, name in enumerate(names)}, float(normaliser))
    return {"val/loss": loss, **perplexity,
            **{f"val/{name}": value for name, value in averaged.items() if not name.startswith("_")}}


class Evaluator:
    """Held-out evaluation at ``trainer.eval_every`` steps and at the last step; its time is
    added to ``state.eval_s`` (goodput's accounting). ``measure()`` returns the ``val/...``
    metrics (a collective call): :func:`evaluate` on the held-out batches, or an online
    objective's held-out rewards (:meth:`llmtrain.rollout.rollout.Rollout.evaluate`)."""

    def __init__(self, measure: Callable[[], dict[str, float]], every: int, max_steps: int):
        self.measure, self.every, self.max_steps = measure, every, max_steps

    def should_run(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.max_steps

    def run(self, state: TrainState) -> dict[str, float]:
        started = time.perf_counter()
        metrics = self.measure()
        state.eval_s += time.perf_counter() - started
        return metrics


def log_eval(step: int, metrics: dict[str, float], train_loss: float | None = None) -> None:
    """Log an evaluation's line: the held-out loss and what the objective adds (perplexity, the
    teacher's KL, preference accuracy, rewards), or an online objective's held-out reward."""
    if "val/perplexity" in metrics:
        detail = f"ppl {metrics['val/perplexity']:.2f}"
    elif "val/teacher_kl" in metrics:
        detail = (f"per-token reverse KL to the teacher on greedy completions of {metrics['val/prompts']} "
                  f"held-out prompts, mean {metrics['val/completions/mean_length']:.1f} tokens")
    elif "val/rewards/accuracies" in metrics:
        # Accuracy counts pairs whose chosen reward is strictly higher; with the policy still
        # the reference every reward is 0: a tie, not a wrong answer.
        ties = metrics["val/rewards/accuracies"] == 0 and metrics["val/rewards/margins"] == 0
        detail = (f"preference accuracy {metrics['val/rewards/accuracies']:.3f}"
                  f"{' (every pair a tie: the policy is still the reference)' if ties else ''}, margin "
                  f"{metrics['val/rewards/margins']:.4f}")
    else:
        detail = ", ".join(f"{k[4:]} {v:.4f}" for k, v in metrics.items() if k.startswith("val/rewards/"))
    if "val/loss" in metrics:
        log.info("eval at step %d: val loss %.4f (%s)%s", step, metrics["val/loss"], detail,
                 f", train loss {train_loss:.4f}" if train_loss is not None else "")
    else:  # an online objective: the mean reward of greedy completions of held-out prompts
        log.info("eval at step %d: val reward %.4f ± %.4f (standard error) over %d prompts (%s), mean "
                 "completion %.1f tokens", step, metrics["val/reward"], metrics["val/reward_stderr"],
                 metrics["val/prompts"], detail, metrics["val/completions/mean_length"])
