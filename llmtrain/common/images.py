"""What the layers of an image-text (vision-language) run share without importing each other: the
image tensors a model's forward takes, and the processor a tokenizer carries.

:mod:`llmtrain.models.vision` builds the processor and puts it on the tokenizer; the data
(:mod:`llmtrain.data.vision`), the engines and the exports read it back here, from the tokenizer
they already receive."""

from __future__ import annotations

from typing import Any

# Keyword arguments of an image-text model's forward that come from the image processor, besides
# input_ids/attention_mask: the engines pass those a batch holds (llmtrain.engine.base.model_inputs).
IMAGE_INPUTS = ("pixel_values", "pixel_attention_mask", "image_grid_thw", "image_sizes")
_PROCESSOR_ATTR = "_llmtrain_processor"
# Processors of the image-text families whose packed rows equal their unpacked samples (tested to
# 1e-5 in fp32, tests/test_vision_packing.py; Qwen2.5-VL shares Qwen2-VL's get_rope_index, and
# llmtrain.models.packed_vision hooks the families that need more than 1-D positions): the data
# refuse packing for any other (llmtrain.data.vision.refuse_packing).
PACKED_PROCESSORS = {"Idefics3Processor": "Idefics3", "LlavaProcessor": "LLaVA", "Gemma3Processor": "Gemma 3",
                     "Qwen2VLProcessor": "Qwen2-VL", "Qwen2VLImagesProcessor": "Qwen2-VL",
                     "Qwen2_5_VLProcessor": "Qwen2.5-VL"}


def processor_of(tokenizer: Any) -> Any | None:
    """The processor :func:`attach` put on ``tokenizer``, or None (a text-only model)."""
    return getattr(tokenizer, _PROCESSOR_ATTR, None)


def image_token_id(processor: Any) -> int:
    """The id of the tokens an image's features replace in the model's input: the processor's
    ``image_token_ids`` (what ``transformers`` marks in ``mm_token_type_ids``). Not always
    ``processor.image_token_id``: Gemma 3's is its ``<start_of_image>`` placeholder, while the
    features go to the ``<image_soft_token>``s it expands into."""
    return int(processor.image_token_ids[0])


def attach(tokenizer: Any, processor: Any) -> Any:
    """Put ``processor`` on ``tokenizer`` (its own ``processor.tokenizer``); returns ``tokenizer``."""
    setattr(tokenizer, _PROCESSOR_ATTR, processor)
    return tokenizer


def has_pixel_budget(image_processor: Any) -> bool:
    """Whether ``image_processor`` resizes each image to its own size within a pixel budget
    (Qwen2-VL's dynamic resolution: ``size`` ``{"shortest_edge": min_pixels, "longest_edge":
    max_pixels}``, counted in pixels, not edges) rather than to a fixed size."""
    kwargs = getattr(getattr(image_processor, "valid_kwargs", None), "__annotations__", {})
    return "max_pixels" in kwargs and "min_pixels" in kwargs
