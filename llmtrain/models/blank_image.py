"""Every forward of an image-text model runs its vision tower, also on a micro-batch without images.

Sharded data parallelism gathers a module's weights when it runs and reduces its gradients after
its backward, collectively: under FSDP2 and ZeRO-3 a rank whose micro-batch holds no image (a
text-only record, or an image-text fine-tune mixed with text chat) would skip the tower's
all-gathers while the other ranks wait in them, and hang. DDP and ZeRO-0..2 reduce every
parameter's gradient in buckets and need the tower's gradients on every rank as well.

So, as TRL and verl do (verl ``dp_actor``: ``inputs_embeds += 0.0 * image_embeds.mean()``), a
forward without ``pixel_values`` runs the tower and projector on one blank image as the language
model is entered (after the token embedding, where a forward with images computes their
features) and adds the features' mean times zero to the embeddings it receives: the logits and
the loss are unchanged bit for bit, the tower's gradients are exact zeros, and every rank gathers
weights in forward and backward and reduces gradients in the same order as a rank with images
(ZeRO-3 fetches each module's weights again in backward, in the order autograd reaches them;
ZeRO-2 fills its reduce buckets in the order gradients arrive). Hooking the language model's
entry, not the embedding's output, keeps the embedding's own backward fetch on the embedding's
tensor, where a forward with images has it. It runs on one process too, so a step whose
micro-batches hold no image updates the tower as a 2-rank step does (AdamW's weight decay and
moment decay on zero gradients), and one process equals several.

Generation (a forward with a KV cache) is left alone: its steps after the prompt carry no pixels
on any rank.
"""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.common.images import IMAGE_INPUTS, processor_of


def blank_pixels(processor: Any, size: int) -> dict[str, torch.Tensor]:
    """The image processor's forward tensors (:data:`~llmtrain.common.images.IMAGE_INPUTS`) of
    one grey ``size`` x ``size`` RGB image (not black: Idefics3 takes all-zero images for
    padding), unsplit where the processor splits images (``do_image_splitting``)."""
    from PIL import Image

    image = Image.new("RGB", (size, size), (128, 128, 128))
    extra = {"do_image_splitting": False} if hasattr(processor.image_processor, "do_image_splitting") else {}
    pixels = processor.image_processor(images=[[image]], return_tensors="pt", **extra)
    return {key: pixels[key] for key in IMAGE_INPUTS if key in pixels}


def _tensors(value: Any) -> list[torch.Tensor]:
    """The floating tensors in ``get_image_features``' output (a tensor, a tuple or list of them,
    or a ``ModelOutput``, as families and transformers versions differ): a ``ModelOutput``'s
    ``pooler_output`` alone when it has one, the features a forward with images puts into the
    embeddings. Its other tensors would add backward paths a forward with images lacks: Qwen2-VL's
    tower returns its blocks' output beside its merger's, and ZeRO-3 would fetch the tower twice in
    backward on a rank without images and once on the others (a trace that must match across ranks)."""
    pooled = value.get("pooler_output") if isinstance(value, dict) else None
    if pooled is not None:
        return _tensors(pooled)
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def keep_tower_in_every_forward(model: torch.nn.Module, tokenizer: Any) -> torch.nn.Module:
    """Register the hooks (module docstring) on ``model`` when ``tokenizer`` carries a processor
    (an image-text model; text-only models are returned as they are). Call before the engine
    wraps the model (FSDP2's and DeepSpeed's own hooks then run around these). Returns ``model``."""
    processor = processor_of(tokenizer)
    if processor is None or not hasattr(model, "get_image_features"):
        return model
    size = int(getattr(model.config.vision_config, "image_size", 224))
    blank = blank_pixels(processor, size)
    wanted: list[bool] = [False]

    def before(module, args, kwargs):
        # A KV cache marks generation; transformers 5.24 on names it ``cache`` (rollout.generate.cache_argument).
        wanted[0] = kwargs.get("pixel_values") is None and all(kwargs.get(k) is None for k in ("cache", "past_key_values"))
        return None

    def into_language_model(decoder, args, kwargs):
        embeds = kwargs.get("inputs_embeds")
        if not wanted[0] or not isinstance(embeds, torch.Tensor):
            return None
        wanted[0] = False
        inputs = {k: v.to(embeds.device) for k, v in blank.items()}
        features = _tensors(model.get_image_features(**inputs))
        zero = sum(t.float().mean() for t in features).to(embeds.dtype) * 0.0
        return args, {**kwargs, "inputs_embeds": embeds + zero}

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.get_decoder().register_forward_pre_hook(into_language_model, with_kwargs=True)
    return model
