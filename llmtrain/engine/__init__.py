"""The engine boundary: everything the training loop asks of a parallelism backend.

The loop only calls :class:`Engine` methods, so a new backend (FSDP2, tensor or pipeline
parallel) is a new subclass plus a branch in :func:`build_engine`; the loop does not change.

Loss contract: the loop passes :meth:`Engine.backward` a micro-batch loss already divided by the
number of target tokens of the whole global batch (all micro-batches, all ranks). The engine
must make the accumulated gradient equal the gradient of that sum, undoing whatever averaging
over data-parallel ranks or accumulation steps its backend applies.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable

import torch

from llmtrain.distributed import DistEnv


def lr_lambda(trainer_cfg: Any) -> Callable[[int], float]:
    """Multiplier of the base learning rate for optimizer step ``s`` (0-based).

    Linear warmup ``(s + 1) / warmup_steps``, then cosine decay to ``min_lr_ratio`` at
    ``max_steps`` (Loshchilov & Hutter, "SGDR", ICLR 2017, eq. 5, one cycle without restarts).
    """
    warmup, total, floor = trainer_cfg.warmup_steps, trainer_cfg.max_steps, trainer_cfg.min_lr_ratio

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


def apply_schedule(optimizer, scheduler) -> None:
    """Set each group's learning rate from the *current* schedule at the restored step.

    A loaded LambdaLR keeps the rate it last computed, which came from the saved run's schedule;
    after ``trainer.max_steps`` was raised that rate is stale for the first resumed step. With an
    unchanged schedule this recomputes the identical value (same expression as LambdaLR).
    """
    rates = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on matrices and embeddings, none on 1-D tensors (norms, biases)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            # ZeRO-3 flattens partitions to 1-D; ds_shape keeps the logical shape.
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Engine(ABC):
    """A parallelism backend. Lifecycle: ``model_init_context()`` → build model → ``setup(model)``
    → per optimizer step: ``accumulate``/``forward``/``backward`` per micro-batch, then ``step()``.
    """

    def __init__(self, cfg: Any, env: DistEnv, accumulation_steps: int):
        self.cfg, self.env, self.accumulation_steps = cfg, env, accumulation_steps

    def model_init_context(self):
        """Context in which the model is built (ZeRO-3 partitions parameters as they appear)."""
        return contextlib.nullcontext()

    def prepare_resume(self, directory: Path, saved_world_size: int) -> None:
        """Called before :meth:`setup` when resuming from ``directory`` (the engine folder of a
        checkpoint written by ``saved_world_size`` ranks): a chance to convert the checkpoint or
        configure the backend for loading it. Collective call."""

    @abstractmethod
    def setup(self, model: torch.nn.Module) -> None:
        """Wrap the model, build optimizer and LR scheduler."""

    @property
    @abstractmethod
    def model(self) -> torch.nn.Module:
        """The unwrapped ``transformers`` model (parameters may be partitions under ZeRO-3)."""

    def accumulate(self, is_last_micro_batch: bool):
        """Context around one micro-batch's forward and backward; gradient sync on the last."""
        return contextlib.nullcontext()

    @abstractmethod
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits ``[micro_batch, seq, vocab]`` for ``batch`` (already on the engine's device)."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of ``loss`` (a scalar normalised by global target tokens)."""

    @abstractmethod
    def step(self) -> float:
        """Clip, apply the optimizer and LR schedule, zero gradients; returns the pre-clip
        global gradient L2 norm."""

    @abstractmethod
    def lr(self) -> float:
        """Learning rate of the next optimizer step."""

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    @abstractmethod
    def save_checkpoint(self, directory: Path) -> None:
        """Write model, optimizer and LR-scheduler state into ``directory`` (engine-native,
        sharded where the engine shards). Collective call."""

    @abstractmethod
    def load_checkpoint(self, directory: Path, saved_world_size: int) -> None:
        """Load what :meth:`save_checkpoint` wrote, possibly by another number of ranks.

        Raises:
            ResumeError: the state cannot be resharded to this world size.
        """

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Consolidated model state dict on rank 0 (None on other ranks). Collective call."""


def build_engine(cfg: Any, env: DistEnv, accumulation_steps: int) -> Engine:
    """The engine named by ``recipe.engine``."""
    if cfg.recipe.engine == "deepspeed":
        from llmtrain.engine.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(cfg, env, accumulation_steps)
    from llmtrain.engine.torch_engine import TorchEngine

    return TorchEngine(cfg, env, accumulation_steps)
