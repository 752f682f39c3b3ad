"""Qwen2-VL's processor for images and text only, without a video processor (so without torchvision).
Qwen2.5-VL's too: ``Qwen2_5_VLProcessor`` differs from ``Qwen2VLProcessor`` only in its videos'
time steps (``second_per_grid_ts``), and both use ``Qwen2VLImageProcessor``.

``transformers.Qwen2VLProcessor`` takes an image processor, a tokenizer and a video processor;
every video processor is a torchvision one, and ``ProcessorMixin`` builds (``__init__``) and loads
(``from_pretrained``) every sub-processor its ``__init__`` names, so the stock class cannot be made
or loaded where torchvision is missing (transformers issue #48558). This subclass names only the
image processor and the tokenizer: ``ProcessorMixin.get_attributes`` reads them from this
``__init__``, and every image path (``<|image_pad|>`` expanded to ``image_grid_thw.prod() /
merge_size**2`` tokens, ``mm_token_type_ids``) is ``Qwen2VLProcessor``'s own.

Saved folders name this class (``processor_config.json``) and carry this file with an ``auto_map``
(transformers' custom-processor mechanism, ``register_for_auto_class``): a process that imported
llmtrain loads them with ``AutoProcessor.from_pretrained`` (the class is registered for
``Qwen2VLConfig`` and ``Qwen2_5_VLConfig``); any other with
``AutoProcessor.from_pretrained(folder, trust_remote_code=True)``.
This file imports transformers only, as a file copied next to a model must.
"""

from transformers import AutoProcessor, Qwen2_5_VLConfig, Qwen2VLConfig, Qwen2VLProcessor


class Qwen2VLImagesProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` with an image processor and a tokenizer, no video processor."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # Qwen2VLProcessor passes (image_processor, tokenizer, None) on; ProcessorMixin pairs them
        # with this class's two attributes and drops the third.
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **kwargs)


Qwen2VLImagesProcessor.register_for_auto_class("AutoProcessor")
AutoProcessor.register(Qwen2VLConfig, Qwen2VLImagesProcessor, exist_ok=True)
AutoProcessor.register(Qwen2_5_VLConfig, Qwen2VLImagesProcessor, exist_ok=True)
