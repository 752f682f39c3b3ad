"""Image-text-to-text models (vision-language models): ``AutoModelForImageTextToText`` and the
``AutoProcessor`` that turns images and text into the model's inputs.

A model is image-text when its ``transformers`` config type is one ``AutoModelForImageTextToText``
builds and it has a vision tower (``vision_config``). Such a model gets a processor next to its
tokenizer: a pretrained model's own (``AutoProcessor.from_pretrained``); for a model built from
config (``model.source=config``, no download), one built here from the family's classes with the
byte tokenizer, the family's image tokens added to it, and ``model.processor`` settings (small
image sizes for tiny models). The processor rides on the tokenizer (:func:`processor_of`), so the
data, the collator and the exports reach it through the tokenizer they already receive.

Only families whose processors need no torchvision are built from config: Idefics3 (SmolVLM),
LLaVA, Gemma 3, Qwen2-VL and Qwen2.5-VL (with
:class:`~llmtrain.models.qwen2vl_images.Qwen2VLImagesProcessor`, ``Qwen2VLProcessor`` without its
video processor, which needs torchvision).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmtrain.common.errors import ConfigError, ModelSourceError
from llmtrain.common.images import IMAGE_INPUTS, attach, image_token_id, processor_of  # noqa: F401  (public here too)

# ChatML whose content may be a list of parts (TRL's conversational vision layout): an image part
# renders as the processor's image placeholder, which the processor expands into the image's tokens.
CHATML_WITH_IMAGES = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '@IMAGE@' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@dataclass(frozen=True)
class Family:
    """How to build a processor for a model type from config: the image processor and processor
    classes (``transformers`` attribute names) and the special tokens its text uses, added to the
    byte tokenizer in this order (ids 260, 261, ...: the preset's ``image_token_id`` must match)."""

    image_processor: str
    processor: str
    tokens: tuple[str, ...]
    # Tokenizer attributes the processor reads (Gemma 3's ``tokenizer.boi_token``, ...): name -> token.
    named: tuple[tuple[str, str], ...] = ()
    # What the chat template writes for an image part ({image}: the processor's image token).
    image_text: str = "{image}"
    # Where ``processor`` lives when transformers has no such class (llmtrain's own).
    processor_module: str = "transformers"


FAMILIES = {
    # Idefics3 / SmolVLM: <image> expands to <fake_token_around_image><global-img><image>*n<fake...>.
    "idefics3": Family("Idefics3ImageProcessorPil", "Idefics3Processor",
                       ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")),
    # LLaVA: a fixed-size tower (CLIP); <image> expands to one token per patch (+1 for CLS).
    "llava": Family("CLIPImageProcessorPil", "LlavaProcessor", ("<image>",)),
    # Gemma 3: a fixed-size tower (SigLIP); the text's <start_of_image> expands to
    # "\n\n<start_of_image>" + <image_soft_token> * mm_tokens_per_image + "<end_of_image>\n\n".
    "gemma3": Family("Gemma3ImageProcessorPil", "Gemma3Processor",
                     ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
                     (("boi_token", "<start_of_image>"), ("eoi_token", "<end_of_image>"),
                      ("image_token", "<image_soft_token>"))),
    # Qwen2-VL: <|image_pad|> expands to image_grid_thw.prod() / merge_size**2 tokens (dynamic
    # resolution), written between <|vision_start|> and <|vision_end|> as Qwen2-VL's template does.
    "qwen2_vl": Family("Qwen2VLImageProcessorPil", "Qwen2VLImagesProcessor",
                       ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
                       image_text="<|vision_start|>{image}<|vision_end|>",
                       processor_module="llmtrain.models.qwen2vl_images"),
}
# Qwen2.5-VL: the same tokens, image processor and image expansion (Qwen2_5_VLProcessor differs
# from Qwen2VLProcessor only in its videos' time steps, second_per_grid_ts), so the same class.
FAMILIES["qwen2_5_vl"] = FAMILIES["qwen2_vl"]
# Where the PIL image processors live (transformers exports some at the top level only with torchvision).
_PIL_MODULES = {"idefics3": "idefics3.image_processing_pil_idefics3", "llava": "clip.image_processing_pil_clip",
                "gemma3": "gemma3.image_processing_pil_gemma3", "qwen2_vl": "qwen2_vl.image_processing_pil_qwen2_vl",
                "qwen2_5_vl": "qwen2_vl.image_processing_pil_qwen2_vl"}
# Families whose Hub processors name a video processor (torchvision) and whose images go through
# Qwen2VLImagesProcessor when torchvision is missing.
_QWEN_VL = ("qwen2_vl", "qwen2_5_vl")


def is_image_text(config: Any) -> bool:
    """Whether ``config`` (a ``transformers`` config) is an image-text-to-text model with a vision
    tower, built by ``AutoModelForImageTextToText``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
            and getattr(config, "vision_config", None) is not None)


def auto_class(config: Any):
    """``AutoModelForImageTextToText`` for an image-text config, else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_image_text(config) else AutoModelForCausalLM


def attach_processor(model_cfg: Any, tokenizer: Any, config: Any, source: str | None) -> Any:
    """The tokenizer to train with: ``tokenizer`` unchanged for a text-only ``config``; for an
    image-text model, the processor's tokenizer (for config models: ``tokenizer`` with the
    family's image tokens added) carrying the processor (:func:`processor_of`). ``source``: the
    pretrained model's folder or hub id, as :func:`llmtrain.models.build.model_config` reads it
    (None for ``model.source=config``).

    Raises:
        ConfigError: a model type built from config without a processor recipe here, or a
            preset whose ``image_token_id`` is not the tokenizer's image token.
        ModelSourceError: a pretrained model folder without a processor.
    """
    if not is_image_text(config):
        return tokenizer
    if model_cfg.source == "config":
        processor = _processor_from_config(model_cfg, tokenizer, config)
    else:
        processor = _pretrained_processor(model_cfg, config, source)
    return attach(processor.tokenizer, processor)


def _pretrained_processor(model_cfg: Any, config: Any, source: str) -> Any:
    """``AutoProcessor.from_pretrained(source)``; for a Qwen2-VL or Qwen2.5-VL folder whose
    processor cannot load its video processor (no torchvision: a Hub checkpoint), the same folder's
    image processor and tokenizer as :class:`~llmtrain.models.qwen2vl_images.Qwen2VLImagesProcessor`."""
    import importlib.util

    import transformers

    from llmtrain.models.qwen2vl_images import Qwen2VLImagesProcessor  # registered: exports of it load

    try:
        return transformers.AutoProcessor.from_pretrained(source)
    except (OSError, ValueError, ImportError) as err:
        if config.model_type in _QWEN_VL and importlib.util.find_spec("torchvision") is None:
            return Qwen2VLImagesProcessor.from_pretrained(source)
        raise ModelSourceError(f"model.path={model_cfg.path}: no image processor could be loaded for this "
                               f"{config.model_type} model: {str(err).splitlines()[0]}") from err


def _processor_from_config(model_cfg: Any, tokenizer: Any, config: Any) -> Any:
    import importlib

    import transformers
    from omegaconf import OmegaConf

    family = FAMILIES.get(config.model_type)
    if family is None:
        raise ConfigError(f"model.architecture.model_type={config.model_type} is an image-text model that "
                          "llmtrain cannot build a processor for from config (it can: "
                          f"{', '.join(sorted(FAMILIES))}); use model.source=pretrained with a folder that "
                          "holds its processor")
    settings = model_cfg.get("processor") or {}
    settings = OmegaConf.to_container(settings, resolve=True) if OmegaConf.is_config(settings) else dict(settings)
    image_settings = settings.pop("image_processor", {})
    # As special tokens (never split, skipped when decoding), without replacing the tokenizer's
    # own special-token list (ChatML's markers stay special).
    tokenizer.add_tokens([t for t in family.tokens if t not in tokenizer.get_vocab()], special_tokens=True)
    if family.named:  # saved in tokenizer_config.json, so AutoProcessor.from_pretrained finds them again
        tokenizer._set_model_specific_special_tokens(dict(family.named))
    image_processor = getattr(transformers, family.image_processor, None)
    if image_processor is None:  # the PIL backends live in their model's module
        image_processor = getattr(importlib.import_module(f"transformers.models.{_PIL_MODULES[config.model_type]}"),
                                  family.image_processor)
    processor_cls = getattr(importlib.import_module(family.processor_module), family.processor)
    processor = processor_cls(image_processor=image_processor(**image_settings), tokenizer=tokenizer, **settings)
    _probe(processor, image_settings)
    template = CHATML_WITH_IMAGES.replace("@IMAGE@", family.image_text.format(image=processor.image_token))
    processor.chat_template = tokenizer.chat_template = template
    # The token the image's features replace (Gemma 3's <image_soft_token>, not its placeholder).
    expected = image_token_id(processor)
    declared = getattr(config, "image_token_id", None)
    if declared is not None and declared != expected:
        field = "image_token_index" if config.model_type == "gemma3" else "image_token_id"
        raise ConfigError(f"model.architecture.{field}={declared}, but the tokenizer's "
                          f"{tokenizer.convert_ids_to_tokens(expected)} is id {expected}; set {field}={expected}")
    return processor


def _probe(processor: Any, image_settings: dict) -> None:
    """Run the image processor on one 2x2 image, so that sizes it cannot use
    (``model.processor.image_processor.size={longest_edge:0}``) stop the run here, naming the
    settings, rather than as a traceback at the first record.

    Raises:
        ConfigError: the image processor fails on the probe (its message and the settings).
    """
    from PIL import Image

    try:
        pixels = processor.image_processor(images=[[Image.new("RGB", (2, 2))]], return_tensors="pt")["pixel_values"]
        said = "" if pixels.numel() else f"it gives pixel_values of shape {list(pixels.shape)}, no pixel"
    except (ValueError, TypeError, ZeroDivisionError, KeyError) as err:
        said = str(err).splitlines()[0] if str(err) else type(err).__name__
    if said:
        raise ConfigError(f"model.processor.image_processor={image_settings}: the image processor cannot prepare an "
                          f"image with these settings: {said}; give positive sizes (e.g. size={{longest_edge: 16}})")


def image_token_types(model: Any) -> None:
    """Give an image-text model's forward the token types its processor gives at inference when the
    caller has none (our collators, the DPO rows, the rollout's prompt forward), so training sees
    the image as the export's ``generate`` does. A forward pre-hook, so wrappers (FSDP2, DeepSpeed,
    PEFT) keep it; other models are left as they are.

    - Gemma 3: ``token_type_ids``, 1 at the image's ``<image_soft_token>``s, so each image's tokens
      attend to each other both ways (Gemma 3's block-bidirectional mask,
      ``modeling_gemma3.create_masks_for_vision_model``). Only forwards with ``pixel_values``.
    - Qwen2-VL (and families whose forward takes ``mm_token_type_ids`` with ``image_grid_thw``):
      ``mm_token_type_ids``, 1 at ``image_token_id``, from which the model places each image's
      tokens on M-RoPE's (time, height, width) grid (``get_rope_index``); transformers refuses a
      forward with ``image_grid_thw`` and without them. Only forwards with ``image_grid_thw``.

    A decoding step with a cache carries no image, and transformers leaves the types out there too."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None or getattr(config, "image_token_id", None) is None:
        return
    image_id = int(config.image_token_id)
    if config.model_type == "gemma3":
        key, needs = "token_type_ids", "pixel_values"
    elif "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        key, needs = "mm_token_type_ids", "image_grid_thw"
    else:
        return

    def add_token_types(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if kwargs.get(key) is None and kwargs.get(needs) is not None and ids is not None:
            kwargs[key] = (ids == image_id).long()
        return args, kwargs

    model.register_forward_pre_hook(add_token_types, with_kwargs=True)


def save_processor(tokenizer: Any, directory: Path) -> None:
    """Save ``tokenizer`` into ``directory``, with its processor when it has one (the processor's
    ``save_pretrained`` writes the tokenizer and ``processor_config.json``, so
    ``AutoProcessor.from_pretrained(directory)`` loads both)."""
    processor = processor_of(tokenizer)
    if processor is None:
        tokenizer.save_pretrained(directory)
    else:
        processor.save_pretrained(directory)


# Language parts without a causal-LM class of their own (their decoder lives only inside the
# image-text model) and the causal LM of the same weights: Qwen2-VL's and Qwen2.5-VL's text models
# are Qwen2 decoders whose rotary positions are M-RoPE's (the same parameters and activations).
_CAUSAL_TWINS = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2"}


def text_config(config: Any) -> Any:
    """The language model's part of ``config`` (its vocabulary, positions and layers): the text
    config of an image-text model, else ``config`` itself. A text config that
    ``AutoModelForCausalLM`` cannot build (Qwen2-VL's) is given as the config of the causal LM with
    the same weights (:data:`_CAUSAL_TWINS`), which the planners build on the meta device."""
    if not is_image_text(config):
        return config
    text = config.get_text_config()
    twin = _CAUSAL_TWINS.get(getattr(text, "model_type", None))
    if twin is None:
        return text
    from transformers import AutoConfig

    fields = {k: v for k, v in text.to_dict().items() if k not in ("model_type", "architectures", "rope_parameters",
                                                                  "layer_types", "transformers_version")}
    theta = (text.rope_parameters or {}).get("rope_theta", 10000.0)
    return AutoConfig.for_model(twin, **fields, rope_parameters={"rope_type": "default", "rope_theta": theta},
                                tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))
