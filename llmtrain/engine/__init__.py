"""Parallelism backends behind one interface (:class:`~llmtrain.engine.base.Engine`).

The loop only calls :class:`Engine` methods, so a backend is a subclass plus a branch in
:func:`build_engine`; the loop does not change. Engines: ``TorchEngine`` (one process or DDP),
``NativeEngine`` (FSDP2 / tensor / pipeline parallel over a device mesh), ``DeepSpeedEngine``.
The shared pieces and the loss contract are in :mod:`llmtrain.engine.base`.
"""

from __future__ import annotations

from typing import Any

from llmtrain.parallel.distributed import DistEnv
from llmtrain.engine.base import (Engine, advance_schedule_only, apply_schedule, autocast, build_adamw,  # noqa: F401
                                  build_scheduler, clip_gradients, first_step_count, lr_lambda, model_inputs,
                                  param_groups)
from llmtrain.parallel.dims import ParallelDims


def build_engine(cfg: Any, env: DistEnv, accumulation_steps: int, dims: ParallelDims, objective) -> Engine:
    """The engine for ``recipe.engine`` and the layout: DeepSpeed; plain torch for one process or
    pure replication (DDP); the torch-native mesh engine for any sharding, tp or pp. ``objective``
    (:class:`~llmtrain.objectives.Objective`) is the loss the engine calls."""
    if cfg.recipe.engine == "deepspeed":
        from llmtrain.engine.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(cfg, env, accumulation_steps, dims, objective=objective)
    if env.world_size == 1 or dims.dp_replicate == env.world_size:
        from llmtrain.engine.torch_engine import TorchEngine

        return TorchEngine(cfg, env, accumulation_steps, dims, objective=objective)
    from llmtrain.engine.native import NativeEngine

    return NativeEngine(cfg, env, accumulation_steps, dims, objective=objective)
