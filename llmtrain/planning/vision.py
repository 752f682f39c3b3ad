"""What a memory plan counts of an image-text model besides its language model: the vision tower's
and projector's weights, the image tokens one image becomes and the bytes the tower saves for
backward per image, at the processor's pixel budget (its largest image).

One image per sample is planned (the digits' and most SFT sets' layout); its tokens are part of
``data.seq_len``, which the language model's activations already count.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class VisionShape:
    """An image-text model's parts outside the language model (:func:`vision_shape`).

    ``params``: elements of the vision tower and projector; ``image_tokens``: tokens one image at
    the pixel budget becomes in the text; ``pixels``: the image processor's ``pixel_values`` shape
    for that image; ``saved_per_image``: bytes the tower and projector save for backward per image.
    """

    params: int
    image_tokens: int
    pixels: tuple
    saved_per_image: int
    budget: tuple  # (height, width) of the largest image the processor keeps


_CACHE: dict[tuple, VisionShape | None] = {}


def budget_size(image_processor: Any) -> tuple[int, int]:
    """(height, width) of the largest image ``image_processor`` keeps: the square of
    ``max_pixels`` pixels for dynamic resolution (Qwen2-VL, whose ``size["longest_edge"]`` counts
    pixels: ``data.max_pixels`` when set), else its ``size``'s ``longest_edge`` (Idefics3, SmolVLM),
    ``height``/``width``, ``shortest_edge`` with its ``crop_size`` (CLIP)."""
    from llmtrain.common.images import has_pixel_budget

    size = dict(getattr(image_processor, "size", None) or {})
    crop = dict(getattr(image_processor, "crop_size", None) or {})
    if has_pixel_budget(image_processor):
        side = int(size["longest_edge"] ** 0.5)
        return side, side
    if "longest_edge" in size:
        return size["longest_edge"], size["longest_edge"]
    if "height" in size and "width" in size:
        return size["height"], size["width"]
    if crop.get("height") and crop.get("width"):
        return crop["height"], crop["width"]
    side = size.get("shortest_edge", 224)
    return side, side


def vision_shape(model_cfg: Any, precision: str, data_cfg: Any = None) -> VisionShape | None:
    """The :class:`VisionShape` of ``model_cfg``'s model, None for a text-only model, at the pixel
    budget of ``data_cfg`` (``data.max_pixels``, :func:`llmtrain.data.vision.apply_pixel_budget`)
    when it sets one. Built on
    the meta device (weights) and run under ``FakeTensorMode`` (the tower's saved tensors, counted
    as :func:`llmtrain.planning.shapes.measure_activations` counts a layer's); the processor runs
    for real on one blank image at the budget (its pixel tensor and image token count)."""
    from llmtrain.models.build import build_tokenizer, model_config
    from llmtrain.models.vision import auto_class, is_image_text, text_config
    from llmtrain.common.images import image_token_id, processor_of

    config = model_config(model_cfg)
    if not is_image_text(config):
        return None
    budget = {k: data_cfg.get(k) for k in ("min_pixels", "max_pixels")} if data_cfg is not None else {}
    key = (config.to_json_string(), str(model_cfg.get("processor")), precision, str(budget))
    if key in _CACHE:
        return _CACHE[key]
    from PIL import Image

    from llmtrain.data.vision import apply_pixel_budget

    tokenizer = build_tokenizer(model_cfg)
    processor = processor_of(apply_pixel_budget(data_cfg, tokenizer) if data_cfg is not None else tokenizer)
    height, width = budget_size(processor.image_processor)
    image = Image.new("RGB", (width, height), (128, 128, 128))
    out = processor(text=[processor.image_token], images=[[image]], return_tensors="pt")
    image_tokens = int((out["input_ids"] == image_token_id(processor)).sum())
    inputs = {k: out[k] for k in ("pixel_values", "pixel_attention_mask", "image_grid_thw", "image_sizes") if k in out}
    auto = auto_class(config)
    with torch.device("meta"):
        full = auto.from_config(copy.deepcopy(config), dtype=torch.float32)
        language = text_config(config)  # Qwen2-VL's: the Qwen2 causal LM of the same weights
        text = auto_class(language).from_config(copy.deepcopy(language), dtype=torch.float32)
    params = sum(p.numel() for p in full.parameters()) - sum(p.numel() for p in text.parameters())
    result = VisionShape(params=params, image_tokens=image_tokens, pixels=tuple(inputs["pixel_values"].shape),
                         saved_per_image=_saved_bytes(auto, config, inputs, precision), budget=(height, width))
    _CACHE[key] = result
    return result


def _saved_bytes(auto: Any, config: Any, inputs: dict[str, torch.Tensor], precision: str) -> int:
    """Bytes of the unique non-parameter storages the tower and projector save for backward on
    ``inputs`` (one image), under ``FakeTensorMode`` (shapes only); a tower whose shapes follow
    the image's grid (Qwen2-VL's, :func:`_saved_by_blocks`) is run for real on two blocks."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

    from transformers.initialization import no_init_weights

    # Shapes only: no weight init, whose data-dependent steps (SigLIP's truncated normal, Gemma 3's
    # tower) fake tensors cannot run.
    with FakeTensorMode(allow_non_fake_inputs=True), no_init_weights():
        model = auto.from_config(copy.deepcopy(config), dtype=torch.float32)
        model.train()
        saved = _SavedBytes(model)
        with saved.hooks(precision):
            try:
                model.get_image_features(**inputs)
            except DynamicOutputShapeException:
                saved.seen.clear()
                tower = next(m for m in model.modules() if getattr(m, "config", None) is model.config.vision_config)
                if "image_grid_thw" in inputs:
                    saved = type(tower)  # run for real, outside the fake mode
                else:
                    # A family that drops padding images by value (Idefics3: nonzero over the
                    # pixels) cannot run on shapes alone: the tower itself on the images, as
                    # [images, 3, H, W] (its projector, a few matrices, left out).
                    tower(pixel_values=inputs["pixel_values"].flatten(0, -4))
    if isinstance(saved, type):
        return _saved_by_blocks(saved, config.vision_config, inputs, precision)
    return saved.total()


class _SavedBytes:
    """Counts the unique non-parameter storages autograd saves while :meth:`hooks` is entered."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage()._cdata for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in self.params:
            self.seen.setdefault(storage._cdata, storage.nbytes())
        return t

    def hooks(self, precision: str):
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t))
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"))
        return stack

    def total(self) -> int:
        return sum(self.seen.values())


def _saved_by_blocks(tower_class: Any, vision: Any, inputs: dict[str, torch.Tensor], precision: str) -> int:
    """Bytes a tower (``tower_class`` of the config ``vision``) of ``depth`` identical blocks saves for backward on ``inputs``, for a tower
    whose shapes depend on the image's grid (Qwen2-VL's: ``image_grid_thw`` sets its attention
    windows, which fake tensors cannot follow): the tower and merger run for real (uninitialised
    weights; the values do not matter) with 1 and 2 blocks, and each further block adds what the
    second added, ``saved(1) + (depth - 1) (saved(2) - saved(1))``. Memory: two blocks' weights
    and one image's activations, not the whole tower's."""
    from transformers.initialization import no_init_weights

    depth, totals = int(vision.depth), []
    for blocks in (1, 2):
        small = copy.deepcopy(vision)
        small.depth = blocks
        with no_init_weights():
            tower = tower_class._from_config(small, dtype=torch.float32)
        tower.train()
        saved = _SavedBytes(tower)
        with saved.hooks(precision):
            tower(inputs["pixel_values"].float(), grid_thw=inputs["image_grid_thw"])
        totals.append(saved.total())
    return totals[0] + (depth - 1) * (totals[1] - totals[0])
