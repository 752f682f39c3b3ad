"""The parts of a model that ``model.freeze``, ``model.lr_multipliers`` and ``peft.parts`` name:
``vision`` (the vision tower), ``projector`` (the connector from image features to the language
model's embeddings), ``language`` (the decoder, its embeddings and its output head) and
``lm_head`` (the output head alone, inside ``language``).

One small class per family says which parameter-name prefixes make each part (LLaMA-Factory's
idea of one plugin per VLM family, ``data/mm_plugin.py`` and ``model/model_utils/visual.py``) and
which parameters the family's forward never reads (:meth:`Parts.unused`): those get no gradient,
so they are frozen (:func:`llmtrain.models.adapters.apply`), or the optimizer would hold no state
for them and a checkpoint could not be resumed. A text-only model has ``language`` and ``lm_head``.

A parameter belongs to the part of its longest matching prefix (Qwen2-VL's projector,
``model.visual.merger``, lies inside its vision tower ``model.visual``). Naming ``language`` names
``lm_head`` too unless ``lm_head`` is named itself (its own learning-rate multiplier wins).
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from torch import nn

from llmtrain.common.errors import ConfigError

PART_NAMES = ("vision", "projector", "language", "lm_head")
_PART = re.compile(r"[a-z_]+")  # a bare word: a part name, not a parameter-name pattern (those have dots)
_INSIDE = {"lm_head": "language"}  # a part inside another: naming the outer one names it too


class Parts:
    """A family's parts: ``prefixes`` maps a part name to the parameter-name prefixes (as
    ``named_parameters`` gives them, ``canonical_name``-d) that make it."""

    model_types: tuple[str, ...] = ()
    prefixes: dict[str, tuple[str, ...]] = {"language": ("",), "lm_head": ("lm_head.",)}

    def unused(self, config: Any) -> tuple[str, ...]:
        """Parameter-name prefixes of ``config``'s model that its forward never reads (none)."""
        return ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p for p in PART_NAMES if p in self.prefixes)

    def part_of(self, name: str) -> str | None:
        """The part of the parameter ``name`` (longest matching prefix), or None."""
        best, length = None, -1
        for part, prefixes in self.prefixes.items():
            for prefix in prefixes:
                if name.startswith(prefix) and len(prefix) > length:
                    best, length = part, len(prefix)
        return best


class Idefics3Parts(Parts):
    """Idefics3 / SmolVLM: a SigLIP tower, a pixel-shuffle connector, a Llama decoder."""

    model_types = ("idefics3", "smolvlm")
    prefixes = {"vision": ("model.vision_model.",), "projector": ("model.connector.",),
                "language": ("model.text_model.",), "lm_head": ("lm_head.",)}


class LlavaParts(Parts):
    """LLaVA: a CLIP tower read at ``vision_feature_layer``, a two-layer projector, a decoder.

    The tower's output is its hidden states after layer ``vision_feature_layer`` (``-1``: the
    last; ``-2``: LLaVA-1.5's), never its ``post_layernorm``: that and the layers after the one
    read are unused (``LlavaModel.get_image_features``)."""

    model_types = ("llava",)
    prefixes = {"vision": ("model.vision_tower.",), "projector": ("model.multi_modal_projector.",),
                "language": ("model.language_model.",), "lm_head": ("lm_head.",)}

    def unused(self, config: Any) -> tuple[str, ...]:
        layers = config.vision_config.num_hidden_layers
        read = config.vision_feature_layer
        read = read if isinstance(read, (list, tuple)) else [read]
        # hidden_states has layers + 1 entries (the embeddings first): entry k is layer k-1's output.
        last = max(k if k >= 0 else layers + 1 + k for k in read)
        unused = []
        # transformers 5's CLIP tower has its transformer at the top; older ones under .vision_model.
        for tower in ("model.vision_tower.", "model.vision_tower.vision_model."):
            unused += [f"{tower}post_layernorm."] + [f"{tower}encoder.layers.{i}." for i in range(last, layers)]
        return tuple(unused)


class Qwen2VLParts(Parts):
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: the tower ``model.visual`` holds its projector, the patch
    merger ``model.visual.merger`` (and Qwen3-VL's deepstack mergers)."""

    model_types = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
    prefixes = {"vision": ("model.visual.",),
                "projector": ("model.visual.merger.", "model.visual.deepstack_merger_list."),
                "language": ("model.language_model.",), "lm_head": ("lm_head.",)}


class Gemma3Parts(Parts):
    """Gemma 3: a SigLIP tower read at its last hidden state (an attention-pooling ``head``, when
    the vision config has one, is unused), a projector, a Gemma 3 decoder (tied head)."""

    model_types = ("gemma3",)
    prefixes = {"vision": ("model.vision_tower.",), "projector": ("model.multi_modal_projector.",),
                "language": ("model.language_model.",), "lm_head": ("lm_head.",)}

    def unused(self, config: Any) -> tuple[str, ...]:
        return ("model.vision_tower.head.",) if getattr(config.vision_config, "vision_use_head", False) else ()


FAMILIES: dict[str, Parts] = {t: family() for family in (Idefics3Parts, LlavaParts, Qwen2VLParts, Gemma3Parts)
                              for t in family.model_types}
TEXT = Parts()


def known_family(model: nn.Module) -> Parts | None:
    """The parts of ``model`` (a Hugging Face model): its family's, a text-only model's, or None
    for an image-text model of a family without a parts class here."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    return None if config is not None and getattr(config, "vision_config", None) is not None else TEXT


def family_of(model: nn.Module, field: str) -> Parts:
    """:func:`known_family`, which ``field`` (the setting that names parts) needs.

    Raises:
        ConfigError: an image-text model of a family without a parts class here.
    """
    family = known_family(model)
    if family is None:
        model_type = getattr(model.config, "model_type", None)
        raise ConfigError(f"{field}: llmtrain does not know the parts of {model_type} models (it knows "
                          f"{', '.join(sorted(FAMILIES))}); name parameters by pattern in model.freeze, and modules "
                          "in peft.target_modules, instead")
    return family


def is_part_name(entry: str) -> bool:
    """Whether a ``model.freeze`` entry is a part name (a bare word) rather than a pattern."""
    return bool(_PART.fullmatch(entry))


def check_names(family: Parts, names: Iterable[str], field: str, model_type: str | None) -> None:
    """Raises ConfigError (one line, naming ``field`` and the family's parts) for an unknown name."""
    for name in names:
        if name not in family.names:
            kind = f"a {model_type} model" if model_type else "this model"
            raise ConfigError(f"{field}: {name!r} is not a part of {kind}; its parts are {', '.join(family.names)}")


def member(family: Parts, parameter: str, names: Iterable[str]) -> str | None:
    """Which of ``names`` (part names) the parameter ``parameter`` falls under: its own part, or
    the part it lies inside (``lm_head`` in ``language``); None if neither is named."""
    names = set(names)
    part = family.part_of(parameter)
    while part is not None and part not in names:
        part = _INSIDE.get(part)
    return part


def rates_of(model_cfg: Any) -> dict[str, float]:
    """The parts ``model.lr_multipliers`` (of ``model_cfg``) sets: ``{part: multiplier}``."""
    node = model_cfg.get("lr_multipliers") or {}
    return {str(k): float(v) for k, v in node.items() if v is not None}


def multipliers(model: nn.Module, rates: dict[str, float], canonical) -> dict[int, float]:
    """``id(parameter) -> learning-rate multiplier`` of ``model``'s parameters under the part
    multipliers ``rates`` (``model.lr_multipliers``); parameters of no named part are left out
    (multiplier 1). ``canonical``: the parameter-name map (peft's ``base_layer`` removed).

    Raises:
        ConfigError: a name in ``rates`` that is not a part of the model.
    """
    family = family_of(model, "model.lr_multipliers")
    check_names(family, rates, "model.lr_multipliers", getattr(getattr(model, "config", None), "model_type", None))
    out = {}
    for name, param in model.named_parameters():
        part = member(family, canonical(name), rates)
        if part is not None:
            out[id(param)] = float(rates[part])
    return out


def unused_parameters(model: nn.Module) -> list[str]:
    """Names of ``model``'s parameters that its family's forward never reads (:meth:`Parts.unused`)."""
    family, config = known_family(model), getattr(model, "config", None)
    prefixes = family.unused(config) if family is not None and config is not None else ()
    return [name for name, _ in model.named_parameters() if prefixes and name.startswith(prefixes)]


def linear_modules(model: nn.Module, names: Iterable[str]) -> list[str]:
    """Names of the ``nn.Linear`` modules inside the parts ``names`` of ``model``, the output
    head left out (LoRA's ``all-linear`` restricted to those parts, as peft's own rule drops the
    head)."""
    family, names = family_of(model, "peft.parts"), list(names)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not head and member(family, name + ".", names) is not None]
