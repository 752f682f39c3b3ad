"""Partial training: LoRA adapters (through ``peft``) and frozen parameters.

One owner for "which parameters train": :func:`apply` injects LoRA layers in place into the
Hugging Face model (``peft.inject_adapter_in_model``: module paths and the model class stay the
same, so every engine and parallelize step sees a normal causal LM), then freezes what does not
train. Engines build their optimizers from ``requires_grad`` parameters only, so a frozen
parameter gets no gradient and no optimizer state; checkpoints hold the trainable parameters only
(:func:`is_partial`), and the base weights are identified by :func:`base_fingerprint`.

The whole state of a partial checkpoint (:func:`whole_state`) puts its trained tensors on the base
rebuilt from the model's source. Exports (a PEFT adapter folder that
``AutoPeftModelForCausalLM.from_pretrained(folder)`` loads with its base, the merged model) are
:mod:`llmtrain.export`'s.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmtrain.common.errors import ConfigError
from llmtrain.models import parts
from llmtrain.models.build import build_model, canonical_name, init_weights, parameter_numel, resolve_gguf  # canonical_name: also here

log = logging.getLogger("llmtrain")

ADAPTER_NAME = "default"


def lora_config(p: Any, model: Any = None) -> Any:
    """``peft.LoraConfig`` for the ``peft`` config group (``modules_to_save`` is applied by
    :func:`apply` in place, and given to peft only when exporting). A reward model's
    classification head (``model.score``) is excluded from the targets: it is new and trains in
    full, which ``all-linear`` would otherwise turn into an adapter."""
    import peft
    from omegaconf import OmegaConf

    targets = p.target_modules if isinstance(p.target_modules, str) else list(OmegaConf.to_container(p.target_modules))
    exclude = ["score"] if model is not None and hasattr(model, "score") else []
    if model is not None:
        from llmtrain.models.moe import sparse_blocks

        # Routers decide which experts a token reaches; an adapter on them would move tokens
        # between experts the adapters of which never saw them. They stay as trained.
        names = {id(module): name for name, module in model.named_modules()}
        exclude += [names[id(block.gate)] for _, block in sparse_blocks(model)]
        if targets == "all-linear" and sparse_blocks(model):
            # peft 0.21 turns all-linear on transformers' fused-expert models into adapters on
            # the routers and the expert tensors too (its MoE conversion, which ignores
            # exclude_modules); spelled out, all-linear means the decoder's Linear layers
            # (attention, shared experts), and expert tensors are asked for by target_parameters.
            head = model.get_output_embeddings()
            targets = sorted(name for name, module in model.named_modules()
                             if isinstance(module, nn.Linear) and module is not head and not name.startswith("score"))
            exclude = []
    if model is not None:
        targets = _in_parts(model, targets, list(p.get("parts") or ["language"]))
    parameters = list(p.get("target_parameters") or [])
    return peft.LoraConfig(r=int(p.r), lora_alpha=float(p.alpha), lora_dropout=float(p.dropout), target_modules=targets,
                           bias=p.bias, use_rslora=bool(p.use_rslora), use_dora=bool(p.use_dora),
                           exclude_modules=exclude or None, target_parameters=parameters or None)


def _in_parts(model: nn.Module, targets: Any, names: list[str]) -> Any:
    """``targets`` (``all-linear`` or module-name suffixes) kept to the Linear modules of the parts
    ``names`` (``peft.parts``) of an image-text model, as full module names; unchanged for a
    text-only model (all of it is ``language``).

    Raises:
        ConfigError: a part the model lacks, or suffixes that match nothing inside the parts.
    """
    family = parts.known_family(model)
    if family is parts.TEXT:  # all language: peft.parts=[vision] would have adapted it silently
        parts.check_names(family, names, "peft.parts", getattr(getattr(model, "config", None), "model_type", None))
    if family is parts.TEXT or (family is None and targets != "all-linear"):
        return targets  # a text-only model is all language; module names chosen by hand are kept
    family = parts.family_of(model, "peft.parts")  # all-linear on a family without parts: refused
    parts.check_names(family, names, "peft.parts", getattr(getattr(model, "config", None), "model_type", None))
    inside = parts.linear_modules(model, names)
    if targets == "all-linear":
        return inside
    chosen = [name for name in inside if any(_is_target(name, t) for t in targets)]
    if not chosen:
        raise ConfigError(f"peft.target_modules={list(targets)} matches no Linear module of the parts "
                          f"peft.parts={names}; add the part (e.g. peft.parts=[language,vision]) or other names")
    return chosen


def is_partial(cfg: Any) -> bool:
    """Whether some parameters stay frozen (LoRA, ``model.freeze``, or parameters the model's
    forward never reads, :func:`has_unused`): then checkpoints hold only the trainable ones."""
    return cfg.get("peft") is not None or bool(cfg.model.get("freeze")) or has_unused(cfg.model)


def has_unused(model_cfg: Any) -> bool:
    """Whether the model's family leaves parameters unread (:meth:`llmtrain.models.parts.Parts.unused`:
    LLaVA's tower ``post_layernorm``), which :func:`apply` freezes. False for a GGUF file (text
    models only) or a config that cannot be read (the build reports that)."""
    from llmtrain.models.build import model_config
    from llmtrain.models.parts import FAMILIES

    if model_cfg.source == "gguf":
        return False
    try:
        config = model_config(model_cfg)
    except (OSError, ValueError, KeyError):
        return False
    family = FAMILIES.get(getattr(config, "model_type", None))
    return family is not None and bool(family.unused(config))


def apply(model: nn.Module, cfg: Any) -> nn.Module:
    """Inject LoRA adapters (``cfg.peft``) and freeze ``cfg.model.freeze`` patterns, in place.

    LoRA weights are initialised as peft does (``A`` Kaiming-uniform, ``B`` zero), but from a
    generator per parameter name (:func:`llmtrain.models.build.initial_value`), so they do not depend on
    the engine or the number of ranks. Under the meta-device build (torch-native engines) they are
    filled with the rest of the shards.

    Raises:
        ConfigError: ``peft.target_modules``, ``peft.modules_to_save`` or ``model.freeze`` match
            nothing (the message lists some of the model's own names).
    """
    p = cfg.get("peft")
    if p is not None:
        _check_targets(model, p)
        inject(model, p)
        init_weights(model, cfg.trainer.seed, only=lambda name: ".lora_A." in name or ".lora_B." in name)
    _freeze(model, list(cfg.model.get("freeze") or []))
    if not any(param.requires_grad for param in model.parameters()):
        raise ConfigError("model.freeze froze every parameter: nothing would train")
    return model


def inject(model: nn.Module, peft_cfg: Any) -> None:
    """peft's LoRA adapters of the ``peft`` config group injected into ``model`` in place (peft
    freezes every other parameter), and the ``peft.modules_to_save`` present in ``model`` trained
    in full; the adapters keep peft's own initial values (:func:`apply` re-draws them). The
    planner injects them into its one- and two-layer copies the same way."""
    import peft

    peft.inject_adapter_in_model(lora_config(peft_cfg, model), model, adapter_name=ADAPTER_NAME)
    modules = dict(model.named_modules())
    for name in peft_cfg.get("modules_to_save") or []:
        if name in modules:  # apply() checked them against the whole model; a planner copy has fewer layers
            modules[name].requires_grad_(True)


def _freeze(model: nn.Module, entries: list[str]) -> None:
    """Freeze the parts (``vision``, ``projector``, ``language``, ``lm_head``:
    :mod:`llmtrain.models.parts`) and parameter-name patterns ``entries`` name, and the parameters
    the family's forward never reads (they would get no gradient, hence no optimizer state).

    Raises:
        ConfigError: an unknown part name (listing the model's parts), a pattern that matches nothing.
    """
    names = [n for n, _ in model.named_parameters()]
    named_parts = [e for e in entries if parts.is_part_name(e)]
    patterns = [e for e in entries if not parts.is_part_name(e)]
    family = parts.family_of(model, "model.freeze") if named_parts else None
    parts.check_names(family, named_parts, "model.freeze", getattr(getattr(model, "config", None), "model_type", None))
    for part in named_parts:
        if not any(parts.member(family, canonical_name(n), [part]) for n in names):
            raise ConfigError(f"model.freeze: part {part!r} has no parameters of its own in this model (a head tied "
                              "to the embeddings is the language model's); freeze the part that holds them")
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(canonical_name(n), pattern) for n in names):
            raise ConfigError(f"model.freeze pattern {pattern!r} matches no parameter; names look like "
                              f"{', '.join(names[:4])}")
    unused = set(parts.unused_parameters(model))
    for name, param in model.named_parameters():
        plain = canonical_name(name)
        if (name in unused or any(fnmatch.fnmatchcase(plain, pattern) for pattern in patterns)
                or (named_parts and parts.member(family, plain, named_parts) is not None)):
            param.requires_grad_(False)


def _is_target(module_name: str, target: str) -> bool:
    """peft's rule for a ``target_modules`` entry: the module's full name or its last part(s)."""
    return module_name == target or module_name.endswith(f".{target}")


def _check_targets(model: nn.Module, p: Any) -> None:
    linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    tied = set()
    if getattr(model.config, "tie_word_embeddings", False):
        output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        tied = {name for name, module in model.named_modules() if module is output or module is embedding}
    named = set(p.modules_to_save) | (set() if p.target_modules == "all-linear" else
                                      {n for n in linear if any(_is_target(n, t) for t in p.target_modules)})
    if named & tied:
        # Training one side of a tied pair changes the other (in place), but a PEFT adapter
        # carries only the named module: adapter, merged model and base would disagree.
        raise ConfigError(f"peft.target_modules / peft.modules_to_save name {sorted(named & tied)}, which share one "
                          f"weight with {sorted(tied - (named & tied))} (tie_word_embeddings=true); an adapter cannot "
                          "carry one side of a tied pair: leave them out, or untie the model "
                          "(model.architecture.tie_word_embeddings=false) for full fine-tuning of the head")
    if p.target_modules != "all-linear":
        for target in p.target_modules:
            if not any(_is_target(name, target) for name in linear):
                suffixes = sorted({name.rsplit(".", 1)[-1] for name in linear})
                raise ConfigError(f"peft.target_modules: {target!r} matches no Linear module of this model; its "
                                  f"Linear modules end in {', '.join(suffixes[:8])}")
    parameter_names = [name for name, _ in model.named_parameters()]
    for target in p.get("target_parameters") or []:
        if not any(name == target or name.endswith(f".{target}") for name in parameter_names):
            raise ConfigError(f"peft.target_parameters: {target!r} matches no parameter of this model; expert tensors "
                              "of an MoE model are named like mlp.experts.gate_up_proj, mlp.experts.down_proj")
    names = dict(model.named_modules())
    for name in p.modules_to_save:
        if name not in names:
            top = [n for n in names if n and "." not in n]
            raise ConfigError(f"peft.modules_to_save: {name!r} is not a module of this model; top-level modules "
                              f"are {', '.join(top)}")


def summary(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) distinct parameters (``parameters()`` names a tied weight once), also
    under ZeRO-3 (``ds_numel``)."""
    trainable = total = 0
    for name, param in model.named_parameters():
        n = parameter_numel(param, name)
        total += n
        trainable += n if param.requires_grad else 0
    return trainable, total


def model_state_bytes(model: nn.Module, optimizer_shards: int) -> tuple[int, int]:
    """Bytes this rank holds for model state: (frozen, trainable). Frozen parameters cost their
    local storage only; trainable ones their storage plus an fp32 gradient and Adam's two fp32
    moments (+12 bytes per element; ZeRO-1/2 shard the optimizer part ``optimizer_shards`` ways).
    Local storage: the DTensor shard (FSDP2), the ZeRO-3 partition (``ds_tensor``), else the
    whole tensor."""
    frozen = trainable = 0
    for param in model.parameters():
        local = getattr(param, "_local_tensor", None)
        local = local if local is not None else getattr(param, "ds_tensor", param)
        stored = local.numel() * local.element_size()
        if param.requires_grad:
            trainable += stored + local.numel() * 12 // max(1, optimizer_shards if local is param else 1)
        else:
            frozen += stored
    return frozen, trainable


def base_fingerprint(model_cfg: Any, seed: int) -> str:
    """Identity of the base weights a partial checkpoint was trained on: the SHA-256 of the weight
    files (pretrained folder or GGUF file; cached per path, size and modification time under
    ``~/.cache/llmtrain/fingerprints``), or of the architecture and seed for models built from a
    config (their initial weights are a function of both)."""
    from omegaconf import OmegaConf

    if model_cfg.source == "config":
        spec = json.dumps({"architecture": OmegaConf.to_container(model_cfg.architecture, resolve=True), "seed": seed},
                          sort_keys=True)
        return "config:" + hashlib.sha256(spec.encode()).hexdigest()[:16]
    if model_cfg.source == "gguf":
        folder, file = resolve_gguf(model_cfg)
        files = [Path(folder) / file]
    else:
        folder = Path(str(model_cfg.path))
        if not folder.is_dir():
            return f"hub:{model_cfg.path}"  # a Hub id: its revision is what identifies it
        files = sorted(f for f in folder.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf", ".pt"))
    return "sha256:" + hashlib.sha256("".join(_file_digest(f) for f in files).encode()).hexdigest()[:16]


def _file_digest(path: Path) -> str:
    from llmtrain.common.paths import CACHE_DIR

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    cached = CACHE_DIR / "fingerprints" / key
    if cached.is_file():
        return cached.read_text()
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    cached.parent.mkdir(parents=True, exist_ok=True)
    pending = cached.with_name(f"{key}.{os.getpid()}.tmp")  # every rank may hash at once
    pending.write_text(digest)
    pending.replace(cached)
    return digest


def whole_state(trained: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """The whole model state of a partial checkpoint: the base rebuilt from the model's source
    (``cfg`` as saved with the checkpoint; a ``model.quantize`` base quantized and dequantized
    again, fp32), adapters injected, then the checkpoint's trainable
    tensors (``trained``, in-place names) put in.

    Raises:
        RuntimeError: ``trained`` names a tensor the rebuilt model does not have.
    """
    from llmtrain.models.quantize import round_trip

    model = apply(round_trip(build_model(cfg.model, cfg.trainer.seed), cfg), cfg)
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    unknown = sorted(set(trained) - set(state))
    if unknown:
        raise RuntimeError(f"checkpoint tensors {unknown[:5]} are not in the rebuilt model")
    state.update({k: v.float() for k, v in trained.items()})
    return state
