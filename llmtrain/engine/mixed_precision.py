"""bf16 compute weights over fp32 master weights for a replicated model (the torch engine: one
process or DDP): the mixed precision of FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` and of DeepSpeed's bf16 ZeRO, without sharding.

Why not autocast: autocast keeps the model's residual stream in fp32 (the embedding output is
fp32 and every matmul's bf16 output is added back into it), saves fp32 activations for backward
and casts each matmul's input to bf16 at every call. On bf16 weights the whole forward is bf16:
a SmolLM2-135M-wide model saves 0.72x the activation bytes at the same step time
(``scripts/bench/bf16_compute.py``, BENCHMARKS.md), and every engine's bf16 computes the same
numbers (FSDP2's ``param_dtype`` and DeepSpeed's bf16 ZeRO already computed on bf16 weights).

What differs from autocast, as under FSDP2 and DeepSpeed's bf16: the residual stream is bf16,
and ops autocast would run in fp32 (softmax, norms) follow the model's own upcasts (HF's RMSNorm
and the objectives' log-softmax upcast to fp32). Per-step losses agree with DeepSpeed's bf16
ZeRO-1 on the same run (``tests/test_precision.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn


def uses_bf16_casts(cfg: Any, world_size: int) -> bool:
    """Whether the torch engine (one process, DDP) computes on :class:`Bf16ComputeWeights`:
    ``trainer.precision=bf16``, except with ``recipe.fp8`` (float8 linears scale their fp32
    weights themselves) and with ``recipe.compile`` under DDP (dynamo's DDP optimizer splits a
    compiled graph at DDP's gradient buckets by finding the ``nn.Parameter`` inputs; casts are
    not Parameters, so a compiled layer would hand DDP all its gradients at its end instead of
    overlapping their all-reduce with the rest of its backward). Those keep autocast."""
    return (cfg.trainer.precision == "bf16" and not cfg.recipe.get("fp8")
            and not (cfg.recipe.get("compile") and world_size > 1))


def store_frozen_in_bf16(model: nn.Module) -> int:
    """Store every frozen fp32 parameter of ``model`` (a LoRA run's base, ``requires_grad``
    False) as its bf16 cast, in place (the same ``nn.Parameter`` objects, their ``.data``
    replaced); returns the bytes freed.

    Why: a frozen parameter has no gradient, no optimizer state and no update, so its fp32 value
    is only ever read to make the bf16 cast :class:`Bf16ComputeWeights` computes on, the same
    cast every micro-batch. Stored as that cast it takes 2 bytes an element instead of 4 between
    steps and no cast copy (2 more) during each micro-batch: the step's peak holds 2 bytes of the
    base where it held 6, and forward and backward read the very values they read before (the
    losses do not change). What DeepSpeed's bf16 ZeRO does with frozen parameters (it keeps no
    fp32 master for them); as there, an export that needs the base's fp32 values rebuilds it from
    the model's source (:func:`llmtrain.checkpoint.export.trained_state`).

    Only plain fp32 ``nn.Parameter`` objects are converted (the filter of
    :class:`Bf16ComputeWeights`): DTensor, float8 and quantized weights are left alone.
    """
    freed, done = 0, set()
    for param in model.parameters():  # each tied parameter once
        if (param.requires_grad or id(param) in done or param.dtype != torch.float32
                or type(param) is not nn.Parameter):
            continue
        done.add(id(param))
        param.data = param.data.to(torch.bfloat16)
        freed += 2 * param.numel()
    return freed


class Bf16ComputeWeights:
    """Inside :meth:`computing`, the model's fp32 parameters are replaced by their bf16 casts.

    The cast is an op in the autograd graph (``param.to(bfloat16)``, made once per
    :meth:`computing` and shared by every use, tied weights included), so each micro-batch's
    weight gradient is computed in bf16 and arrives in the fp32 parameter's ``.grad`` through the
    cast's backward: micro-batches accumulate in fp32, DDP's reducer sees fp32 gradients on the
    parameters it registered and all-reduces them in fp32, and clipping, the optimizer, the
    checkpoint and export see an fp32 model. The replacement lasts through the backward (hold the
    context around forward and backward), so activation checkpointing recomputes on the same
    bf16 weights.

    Memory: one bf16 copy of the weights per :meth:`computing` (2 bytes per parameter), freed
    with the micro-batch's graph.

    Only plain fp32 parameters are cast: DTensor, float8 and quantized weights are left alone.
    """

    def __init__(self, model: nn.Module):
        # Every (module, name) slot that holds an fp32 parameter; a tied parameter has two slots.
        self._slots = [(module, name, param) for module in model.modules()
                       for name, param in module._parameters.items()
                       if param is not None and param.dtype == torch.float32 and type(param) is nn.Parameter]
        self._depth = 0

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Forward and backward inside run on bf16 weights; re-entrant (an inner forward reuses
        the outer casts)."""
        self._depth += 1
        try:
            if self._depth == 1:
                casts: dict[int, torch.Tensor] = {}
                for module, name, param in self._slots:
                    low = casts.get(id(param))
                    if low is None:
                        low = casts[id(param)] = param.to(torch.bfloat16)
                    # What torch.func.functional_call does: a non-leaf tensor in the parameter's
                    # slot (nn.Module.__setattr__ accepts only Parameters there).
                    module._parameters[name] = low
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                for module, name, param in self._slots:
                    # A parametrization registered and removed inside (peft's target_parameters:
                    # LoRA on a MoE layer's expert tensors, per forward) puts a plain tensor back
                    # as a buffer: drop the cast from there, so the name is the Parameter's alone.
                    if name in module._buffers:
                        del module._buffers[name]
                        module._non_persistent_buffers_set.discard(name)
                    module._parameters[name] = param
