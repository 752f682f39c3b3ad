"""Plain PyTorch engine: one process, or DistributedDataParallel when the world size is > 1."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

import llmtrain.engine.dcp_state as dcp_state
from llmtrain.engine.base import (Engine, advance_schedule_only, apply_schedule, autocast, build_scheduler,
                                  clip_gradients, model_inputs, replicated_frozen_copy)
from llmtrain.engine.mixed_precision import Bf16ComputeWeights, store_frozen_in_bf16, uses_bf16_casts
from llmtrain.engine.optimizers import build_optimizer

LEGACY_STATE = "state.pt"  # torch-engine checkpoints before DCP: {"model", "optimizer", "scheduler"}


class TorchEngine(Engine):
    """Replicated model; gradients all-reduced (averaged) by DDP, so the loss is scaled by the
    world size to keep the sum-over-global-batch contract.

    ``trainer.precision=bf16``: the model computes on bf16 casts of its fp32 master weights, with
    fp32 gradients (:class:`~llmtrain.engine.mixed_precision.Bf16ComputeWeights`), as FSDP2's
    ``param_dtype`` and DeepSpeed's bf16 ZeRO do; with ``recipe.fp8`` and compiled DDP, fp32
    weights under bf16 autocast (:func:`~llmtrain.engine.mixed_precision.uses_bf16_casts`). A
    LoRA run's frozen base is then stored in bf16 only
    (:func:`~llmtrain.engine.mixed_precision.store_frozen_in_bf16`)."""

    def setup(self, model: torch.nn.Module) -> None:
        t = self.cfg.trainer
        self._model = model.to(self.env.device)
        if self.cfg.recipe.get("fp8"):
            from llmtrain.parallel.float8 import apply_float8

            apply_float8(self._model, self.cfg.recipe, sharded=False)
        self._install_label_head(self._model)
        self._install_router_monitors([self._model], self._model)
        if t.activation_checkpointing:
            self._model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.cfg.recipe.compile:
            # Per decoder layer, after activation checkpointing and before DDP: the order and the
            # granularity of the mesh engine's ``parallelize``, so a recipe compiles alike on both.
            from llmtrain.parallel.parallelize import apply_compile, decoder_layers

            apply_compile(decoder_layers(self._model))
        self.wrapped = self._model
        if self.env.world_size > 1:
            device_ids = [self.env.local_rank] if self.env.device.type == "cuda" else None
            # Gradients are views into DDP's all-reduce buckets: no second copy of every gradient
            # (4Ψ bytes in fp32) and no copy between them after each backward.
            self.wrapped = DistributedDataParallel(self._model, device_ids=device_ids, gradient_as_bucket_view=True)
        self.optimizer = build_optimizer(self._model, t, model_cfg=self.cfg.model)
        self.scheduler = build_scheduler(self.optimizer, t)
        self.bf16_compute = None
        if uses_bf16_casts(self.cfg, self.env.world_size):
            if self.cfg.get("peft") is not None:
                # A LoRA base computes on its bf16 cast only: store the cast (after DDP's broadcast
                # of the fp32 weights; it registered the trained parameters only).
                store_frozen_in_bf16(self._model)
                self.frozen_in_bf16 = True
            self.bf16_compute = Bf16ComputeWeights(self._model)

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    def frozen_copy(self, build, from_config=None):
        return replicated_frozen_copy(build, self.env.device, self.cfg.trainer.precision,
                                      bf16_weights=self.bf16_compute is not None)

    @contextlib.contextmanager
    def generation_model(self):
        """The model itself; on the bf16 casts of its weights when it trains on them, so the
        sampling loop's log-probabilities are computed as the training forward's are."""
        with self.bf16_compute.computing() if self.bf16_compute is not None else contextlib.nullcontext():
            yield self._model

    def generation_autocast(self):
        if self.bf16_compute is not None:
            return contextlib.nullcontext()  # bf16 weights already; autocast would upcast softmax and norms
        return super().generation_autocast()

    def accumulate(self, is_last_micro_batch: bool):
        with contextlib.ExitStack() as stack:  # closes what was entered if entering the next fails
            if isinstance(self.wrapped, DistributedDataParallel) and not is_last_micro_batch:
                stack.enter_context(self.wrapped.no_sync())
            if self.bf16_compute is not None:  # the backward too runs on the bf16 weights
                stack.enter_context(self.bf16_compute.computing())
            return stack.pop_all()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with (self.bf16_compute.computing() if self.bf16_compute is not None
              else autocast(self.env.device, self.cfg.trainer.precision)):
            return self.wrapped(**model_inputs(batch)).logits

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.env.world_size).backward()

    def step(self, keep_update=None) -> float:
        norm = clip_gradients(self._model.parameters(), self.cfg.trainer.grad_clip)
        if keep_update is None or keep_update(norm):
            self.optimizer.step()
            self.scheduler.step()
        else:
            advance_schedule_only(self.scheduler)
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])  # torchao keeps lr as a tensor

    def save_checkpoint(self, directory: Path, background: bool = False):
        # Distributed Checkpoint keyed by parameter name: DCP writes replicated tensors once,
        # and any torch layout (FSDP2, TP, PP, another world size) can load them.
        return dcp_state.save(directory, [self._model], [self.optimizer], self.scheduler, self.env.is_main, background)

    def load_checkpoint(self, directory: Path, saved_world_size: int) -> None:
        legacy = directory / LEGACY_STATE
        if legacy.is_file() and not dcp_state.is_dcp_checkpoint(directory):
            # Written by llmtrain before checkpoints moved to DCP: one replicated torch.save file.
            state = torch.load(legacy, map_location=self.env.device, weights_only=True)
            self._model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        else:
            dcp_state.load(directory, [self._model], [self.optimizer], [self.scheduler])
        apply_schedule(self.optimizer, self.scheduler)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return {k: v.detach().cpu() for k, v in self._model.state_dict().items()} if self.env.is_main else None
