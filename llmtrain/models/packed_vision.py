"""Packed rows of image-text models: what a family's forward needs besides 1-D positions.

A packed row (``data.packing=true``) holds several samples, each with positions from 0
(``position_ids`` ``[B, T]``) and no attention mask: ``transformers`` then keeps attention inside
each sample (``masking_utils.find_packed_sequence_indices``). That is all Idefics3 and LLaVA need
(a Llama decoder, causal, 1-D RoPE). Two families need more, each given here by a forward
pre-hook that acts only on packed forwards (2-D ``position_ids`` and no ``attention_mask``):

* **Qwen2-VL, Qwen2.5-VL** (M-RoPE): an image's tokens take 3-D (temporal, height, width)
  positions and the text after it continues from the image's largest, computed per sequence by the
  model's own ``get_rope_index``. The hook computes them for each packed sample on its own and
  passes ``[4, B, T]`` positions: row 0 the 1-D positions that the mask is built from (the layout
  ``Qwen2VLTextModel.forward`` documents for packed inputs), rows 1-3 the M-RoPE positions.
* **Gemma 3** (an image's tokens attend to each other both ways): ``transformers`` remaps the
  sliding-window mask's functions to the packed positions, the image-block overlay included, which
  then reads the wrong tokens' blocks (5.25: packed rows gave losses 1e-2 off the unpacked ones).
  The hook builds both masks itself with ``create_causal_mask`` at the row's own indices:
  (causal OR same image block) AND same sample (AND the sliding window).

Other families are not packed with images (:data:`llmtrain.common.images.PACKED_PROCESSORS`, refused by
the data).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl")


def is_packed(kwargs: dict) -> bool:
    """Whether a forward's keyword arguments are a packed batch's (what
    :func:`llmtrain.engine.base.model_inputs` passes for packed rows: ``position_ids`` ``[B, T]``
    and no ``attention_mask``)."""
    positions = kwargs.get("position_ids")
    return (positions is not None and positions.ndim == 2 and kwargs.get("attention_mask") is None
            and kwargs.get("input_ids") is not None)


def sequence_ids(positions: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` index of each token's sample within its row: a new sample starts where its
    position is 0 (``packed_samples``, the collator's padding counted as one more)."""
    return (positions == 0).long().cumsum(-1)


def mrope_positions(model: Any, input_ids: torch.Tensor, positions: torch.Tensor,
                    image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """``[4, B, T]`` positions of packed rows for an M-RoPE model: row 0 ``positions`` (1-D, from 0
    in each sample), rows 1-3 the model's ``get_rope_index`` of each sample on its own, given the
    ``image_grid_thw`` rows of its images (images are in token order along the batch; an image is
    one run of ``config.image_token_id`` tokens, as ``get_rope_index`` groups them)."""
    inner = model.model if hasattr(model, "model") and hasattr(model.model, "get_rope_index") else model
    image_id = int(model.config.image_token_id)
    out = positions.unsqueeze(0).repeat(4, 1, 1)
    grids = list(image_grid_thw) if image_grid_thw is not None else []
    used = 0
    segments = sequence_ids(positions)
    for r in range(input_ids.shape[0]):
        for s in torch.unique_consecutive(segments[r]).tolist():
            where = (segments[r] == s).nonzero().flatten()
            ids = input_ids[r, where]
            types = (ids == image_id).int()
            images = int(((types[1:] == 1) & (types[:-1] == 0)).sum()) + int(types[0] == 1) if len(types) else 0
            if images == 0:
                continue  # text only: M-RoPE's three rows are the 1-D positions
            grid = torch.stack(grids[used:used + images])
            used += images
            rope, _ = inner.get_rope_index(ids[None], mm_token_type_ids=types[None], image_grid_thw=grid)
            out[1:, r, where] = rope[:, 0].to(out.dtype)
    return out


def _mrope_hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if is_packed(kwargs) and not args:
        kwargs["position_ids"] = mrope_positions(module, kwargs["input_ids"], kwargs["position_ids"],
                                                 kwargs.get("image_grid_thw"))
    return args, kwargs


def gemma3_masks(config: Any, input_ids: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> dict:
    """Gemma 3's ``{"full_attention", "sliding_attention"}`` masks of packed rows, in the layer's
    attention implementation's format: (causal OR same image block) AND same sample, the sliding
    one AND within ``sliding_window`` tokens (``modeling_gemma3.create_masks_for_vision_model``'s
    composition, evaluated at the row's own indices)."""
    from transformers.masking_utils import (and_masks, blockwise_overlay, create_causal_mask,
                                            packed_sequence_mask_function, sliding_window_overlay)
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    text = config.get_text_config()
    blocks = get_block_sequence_ids_for_mask((input_ids == int(config.image_token_id)).long(), device=input_ids.device)
    same = packed_sequence_mask_function(sequence_ids(positions))
    shape = torch.empty(*input_ids.shape, 0, dtype=dtype, device=input_ids.device)
    common = dict(config=text, inputs_embeds=shape, attention_mask=None, cache=None, position_ids=None,
                  or_mask_function=blockwise_overlay(blocks))
    return {"full_attention": create_causal_mask(**common, and_mask_function=same),
            "sliding_attention": create_causal_mask(
                **common, and_mask_function=and_masks(sliding_window_overlay(text.sliding_window), same))}


def _gemma3_hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if is_packed(kwargs) and not args:
        kwargs["attention_mask"] = gemma3_masks(module.config, kwargs["input_ids"], kwargs["position_ids"],
                                                module.dtype)
    return args, kwargs


HOOKS: dict[str, Callable] = {"gemma3": _gemma3_hook, **{family: _mrope_hook for family in MROPE_FAMILIES}}


def packed_rows(model: Any) -> None:
    """Register the packed-row forward pre-hook of ``model``'s family (:data:`HOOKS`), if it has
    one; other models are left as they are. A pre-hook, so wrappers (FSDP2, DeepSpeed, PEFT)
    keep it."""
    hook = HOOKS.get(getattr(getattr(model, "config", None), "model_type", None))
    if hook is not None:
        model.register_forward_pre_hook(hook, with_kwargs=True)
