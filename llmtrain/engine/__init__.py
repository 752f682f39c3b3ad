"""The engine boundary: everything the training loop asks of a parallelism backend.

The loop only calls :class:`Engine` methods, so a backend is a subclass plus a branch in
:func:`build_engine`; the loop does not change. Engines: ``TorchEngine`` (one process or DDP),
``NativeEngine`` (FSDP2 / tensor / pipeline parallel over a device mesh), ``DeepSpeedEngine``.

Loss contract: :meth:`Engine.forward_backward` gets one rank's micro-batches of a step and the
number of target tokens of the whole global batch (all micro-batches, all data-parallel ranks).
Each micro-batch's summed cross-entropy is divided by that number, so the accumulated gradient
is that of the global batch's mean token loss; the engine undoes whatever averaging over
data-parallel ranks or accumulation steps its backend applies. Ranks of one data-parallel
group (its tensor- and pipeline-parallel peers, ``dims.data_replicas`` of them) see the same
samples and report the same loss.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable

import torch

from llmtrain.distributed import DistEnv
from llmtrain.loss import token_cross_entropy_sum
from llmtrain.parallel_dims import ParallelDims


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


def advance_schedule_only(scheduler) -> None:
    """Step the LR schedule for an update that was dropped (``trainer.nonfinite=skip``). torch
    warns when a scheduler steps before its optimizer ever has; here that is the intent: the
    schedule follows trainer steps, skipped or not."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        scheduler.step()


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's forward for ``batch``. Packed rows carry ``position_ids``
    restarting at each sample: then the attention mask is left out, so ``transformers`` builds
    block-diagonal causal attention from the positions (``masking_utils.find_packed_sequence_indices``;
    it needs no cache, hence ``use_cache=False``). Unpacked batches pass their padding mask."""
    if "position_ids" in batch:
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups of the trainable parameters: decay on matrices and embeddings, none on 1-D
    tensors (norms, biases); a group left empty is omitted."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            # ZeRO-3 flattens partitions to 1-D; ds_shape keeps the logical shape.
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # An empty group (LoRA trains matrices only) breaks DCP's flattened optimizer state on load.
    return [group for group in groups if group["params"]]


def clip_gradients(params, grad_clip: float) -> float:
    """Clip the gradients of ``params`` to global L2 norm ``grad_clip`` (0 = measure only) with
    ``torch.nn.utils.clip_grad_norm_``; returns the norm before clipping."""
    return float(torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf")))


def first_step_count(optimizer: torch.optim.Optimizer) -> int:
    """Updates an Adam-style optimizer has applied: the ``step`` of its parameter states (0
    before the first, as torch creates state lazily)."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


class Engine(ABC):
    """A parallelism backend. Lifecycle: ``model_init_context()`` → build model → ``setup(model)``
    → per optimizer step: ``accumulate``/``forward``/``backward`` per micro-batch, then ``step()``.
    """

    def __init__(self, cfg: Any, env: DistEnv, accumulation_steps: int, dims: ParallelDims | None = None):
        self.cfg, self.env, self.accumulation_steps = cfg, env, accumulation_steps
        self.dims = dims or ParallelDims(env.world_size, 1, 1, 1, env.world_size)

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ``dims.dp`` data-parallel ranks (which samples it reads)."""
        return self.env.rank

    def forward_backward(self, batches: list[dict[str, torch.Tensor]], global_targets: float) -> torch.Tensor:
        """Accumulate the gradient of one optimizer step over this rank's micro-batches.

        Args:
            batches: micro-batches (``input_ids``, ``labels``, ``attention_mask``, each
                ``[micro_batch, seq]``) on the engine's device.
            global_targets: target tokens of the whole global batch (the loss normaliser).

        Returns:
            float64 scalar: summed token cross-entropy of ``batches`` (not normalised).
        """
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.env.device)
        for k, batch in enumerate(batches):
            with self.accumulate(is_last_micro_batch=k == len(batches) - 1):
                ce = token_cross_entropy_sum(self.forward(batch), batch["labels"])
                self.backward(ce / global_targets)
            loss_sum += ce.detach().double()
        return loss_sum

    @torch.no_grad()
    def eval_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed token cross-entropy (float64 scalar) of one batch, without gradients."""
        return token_cross_entropy_sum(self.forward(batch), batch["labels"]).double()

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
    def step(self, keep_update: Callable[[float], bool] | None = None) -> float:
        """Clip, apply the optimizer and LR schedule, zero gradients; returns the pre-clip
        global gradient L2 norm.

        ``keep_update(norm)``: when given and False, the update is dropped (gradients zeroed,
        parameters and optimizer state untouched) while the LR schedule still advances. Engines
        that cannot decide before updating (DeepSpeed) refuse it at validation."""

    @abstractmethod
    def lr(self) -> float:
        """Learning rate of the next optimizer step."""

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def close(self) -> None:
        """Release the backend's threads and buffers while the process group still exists (the
        trainer's teardown order: tracker, engine, process group). Collective call."""

    def optimizer_step_count(self) -> int:
        """Updates the optimizer has applied (Adam's ``step``); equals the trainer step after
        set-up and after every step, which the trainer checks."""
        return first_step_count(self.optimizer)

    @abstractmethod
    def save_checkpoint(self, directory: Path, background: bool = False):
        """Write model, optimizer and LR-scheduler state into ``directory`` (engine-native,
        sharded where the engine shards). Collective call.

        ``background`` (torch engines; ``trainer.async_checkpoint``): copy the state to host
        memory, return a ``concurrent.futures.Future`` that completes once this rank's files are
        written, and write them while training continues. Otherwise returns None when written."""

    @abstractmethod
    def load_checkpoint(self, directory: Path, saved_world_size: int) -> None:
        """Load what :meth:`save_checkpoint` wrote, possibly by another number of ranks.

        Raises:
            ResumeError: the state cannot be resharded to this world size.
        """

    def num_parameters(self) -> int:
        """Distinct parameters of the whole model (tied counted once), whatever the sharding.
        Collective call."""
        from llmtrain.models import count_parameters

        return count_parameters(self.model)

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Consolidated model state dict on rank 0 (None on other ranks). Collective call."""


def build_engine(cfg: Any, env: DistEnv, accumulation_steps: int, dims: ParallelDims) -> Engine:
    """The engine for ``recipe.engine`` and the layout: DeepSpeed; plain torch for one process or
    pure replication (DDP); the torch-native mesh engine for any sharding, tp or pp."""
    if cfg.recipe.engine == "deepspeed":
        from llmtrain.engine.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(cfg, env, accumulation_steps, dims)
    if env.world_size == 1 or dims.dp_replicate == env.world_size:
        from llmtrain.engine.torch_engine import TorchEngine

        return TorchEngine(cfg, env, accumulation_steps, dims)
    from llmtrain.engine.native import NativeEngine

    return NativeEngine(cfg, env, accumulation_steps, dims)
