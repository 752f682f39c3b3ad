"""FP8 training (``recipe.fp8=true``): the decoder's Linear layers become torchao's
``Float8Linear`` (``torchao.float8.convert_to_float8_training``), whose three matmuls (output,
input gradient, weight gradient) take float8 operands: e4m3 inputs and weights, e5m2 output
gradients, each scaled dynamically by its absolute maximum (``tensorwise``: one scale per tensor;
``rowwise``: one per row, more accurate, slower). Micikevicius et al., "FP8 Formats for Deep
Learning" (2022); torchtitan's float8 converter (torchtitan reports +25-29 % tokens/s on
Llama-3 8B, H100).

Applied first in :func:`llmtrain.parallel.parallelize.parallelize`, before FSDP2 wraps the
layers, as torchtitan's converters are; with FSDP2 and ``tensorwise`` scaling the parameter
all-gather itself sends float8 (``enable_fsdp_float8_all_gather``: half the bytes of bf16).
Left in their dtype: the output head (its logits feed the loss, where float8's 3 mantissa bits
cost most; torchtitan leaves it out too) and any Linear whose dimensions are not multiples of
16 (``torch._scaled_mm``'s requirement), e.g. LoRA's rank-8 adapters.

Hardware: float8 matmuls need CUDA compute capability >= 8.9 (Ada, Hopper, Blackwell). Elsewhere
``recipe.fp8_emulate=true`` runs the same conversion with the matmuls emulated in higher
precision (float8 rounding of every operand, no speed-up): what the CPU tests use.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

def fp8_support(device: torch.device) -> str | None:
    """Why ``device`` cannot run float8 matmuls natively (None when it can)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (8, 9):
            return None
        return f"this GPU ({torch.cuda.get_device_name(device)}) has compute capability {major}.{minor}"
    return f"this machine trains on {device.type}"


def float8_filter(module: nn.Module, fqn: str) -> bool:
    """Whether the Linear ``module`` at ``fqn`` is converted: not the output head, both
    dimensions multiples of 16."""
    if fqn.split(".")[-1] == "lm_head" or not isinstance(module, nn.Linear):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(module: nn.Module, recipe: Any, sharded: bool) -> int:
    """Swap ``module``'s eligible Linear layers (:func:`float8_filter`) for ``Float8Linear`` in
    place (parameters kept: same names, same tensors); ``sharded``: FSDP2 will shard them, so
    ``tensorwise`` scaling all-gathers in float8. Returns the number of layers converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    import dataclasses

    if recipe.fp8_recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=sharded)
    else:  # rowwise scales cannot be all-gathered in float8: FSDP2 gathers the weights as they are
        config = Float8LinearConfig.from_recipe_name(recipe.fp8_recipe)
    config = dataclasses.replace(config, emulate=bool(recipe.fp8_emulate))
    convert_to_float8_training(module, config=config, module_filter_fn=float8_filter)
    return sum(isinstance(m, Float8Linear) for m in module.modules())
