"""One optimizer step's gradient over the engine: :func:`forward_backward` (the global batch's
mean loss over the objective's normaliser, in two collectives) and the records of a step
(:class:`StepScalars` that ride in its all-reduce, :class:`StepSums`, and :class:`StepResult` as
the trainer's loop reports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from llmtrain.parallel import distributed

if TYPE_CHECKING:  # the engine's objective, as the engines see it: an annotation only
    from llmtrain.objectives import Objective


@dataclass
class StepScalars:
    """This rank's values of one optimizer step that ride in the step's one all-reduce after
    backward, beside the loss, so the loop reports them without collectives of its own. After
    the all-reduce (:meth:`from_values`) each field holds the sum over all ranks.

    Attributes:
        sample_digest: order-free fingerprint of the step's samples (:func:`llmtrain.data.order.sample_digest`).
        preempt_requested: 1.0 where a preemption signal arrived (``Preemption.local_flags``).
        save_due: 1.0 where ``trainer.save_every_minutes`` has elapsed.
        background_written: 1.0 where this rank's background checkpoint write is done.
        memory_bytes: one slot per rank, this rank's peak memory (bytes) in its own slot: the
            sum holds every rank's figure, so the maximum and its rank cost no collective.
    """

    sample_digest: float = 0.0
    preempt_requested: float = 0.0
    save_due: float = 0.0
    background_written: float = 0.0
    memory_bytes: list[float] = field(default_factory=list)

    def values(self) -> list[float]:
        """The fields flattened in declaration order (the all-reduce's layout)."""
        return [self.sample_digest, self.preempt_requested, self.save_due, self.background_written,
                *self.memory_bytes]

    @classmethod
    def from_values(cls, values: list[float]) -> "StepScalars":
        """Inverse of :meth:`values`."""
        digest, requested, due, written, *memory = values
        return cls(digest, requested, due, written, list(memory))


@dataclass
class StepSums:
    """What :func:`forward_backward` returns: the step's global mean loss (over the objective's
    normaliser), the tokens of the global batch (prompt tokens included), the objective's metrics
    (means over the same normaliser, keyed ``NAME``) and the world sums of :class:`StepScalars`."""

    loss: float
    tokens: int
    metrics: dict[str, float]
    scalars: StepScalars
    # Mixture-of-experts models: the step's world-summed router counters, float64
    # [L (E + 3) + 1] (Engine.router_counters, already divided by the tensor-parallel degree).
    router: torch.Tensor | None = None


def forward_backward(engine, batches: list[dict[str, torch.Tensor]],
                     local_scalars: Callable[[], StepScalars] | None = None) -> StepSums:
    """Accumulate the gradient of one optimizer step over this rank's micro-batches.

    Each micro-batch's summed loss is divided by the objective's normaliser of the whole global
    batch (all micro-batches, all data-parallel ranks; one all-reduce before backward), so the
    accumulated gradient is that of the global batch's mean loss, independent of how it is split.
    Tensor/pipeline-parallel peers hold the same samples, so world sums are divided by
    ``dims.data_replicas``.

    ``local_scalars``: called after backward, this rank's :class:`StepScalars`; summed over ranks
    in the same all-reduce as the loss, so a step makes two collectives of its own whatever the
    loop reports.
    """
    objective: Objective = engine.objective
    replicas = engine.dims.data_replicas
    device = batches[0]["input_ids"].device
    # Counted on the device (no host sync per micro-batch); the one sync is the normaliser's.
    counts = torch.stack([sum(objective.normaliser(b) for b in batches).to(torch.float64),
                          sum(b["attention_mask"].sum() for b in batches).to(torch.float64)])
    normaliser, tokens = (distributed.all_reduce_sum(counts) / replicas).tolist()
    sums = engine.accumulate_gradients(batches, normaliser)
    scalars = local_scalars() if local_scalars is not None else StepScalars()
    router = engine.router_counters()
    router = router if router is not None else torch.zeros(0, dtype=torch.float64, device=device)
    reduced = distributed.all_reduce_sum(torch.cat([sums.to(torch.float64),
                                                    torch.tensor(scalars.values(), dtype=torch.float64,
                                                                 device=device), router]))
    values = reduced[:len(reduced) - len(router)].tolist()  # the step's one host sync after backward
    loss, *metric_sums = [v / replicas for v in values[:len(sums)]]
    metrics = objective.average(dict(zip(objective.metric_names, metric_sums)), normaliser)
    return StepSums(loss / normaliser, int(tokens), metrics, StepScalars.from_values(values[len(sums):]),
                    reduced[len(reduced) - len(router):].cpu() / engine.dims.tp if len(router) else None)


@dataclass
class StepResult:
    """One optimizer step as :meth:`Trainer.train_step` reports it (global values every rank
    holds). ``spike``: why the loss counts as a spike (:func:`llmtrain.monitoring.health.loss_spike`), else None."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    seconds: float
    metrics: dict[str, float]
    scalars: StepScalars
    stop: bool
    save_by_time: bool
    spike: str | None
    router: torch.Tensor | None = None  # StepSums.router
    # What the batch source reports (an online objective's rollout: rewards, lengths, times).
    source_metrics: dict[str, float] = field(default_factory=dict)
    gc_s: float = 0.0  # seconds of the scheduled garbage collection that ended the step (trainer.gc_every)
    data_wait_s: float = 0.0  # seconds the step waited for its micro-batches (llmtrain.data.prefetch)

    @property
    def healthy(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm) and not self.spike
