"""Exports: a run's weights as a Hugging Face folder (safetensors + config + tokenizer) that
``AutoModelForCausalLM.from_pretrained`` loads, and for a LoRA run a PEFT adapter folder that
``AutoPeftModelForCausalLM.from_pretrained(folder)`` loads with its base (a base that its source
cannot give ``from_pretrained``, built from a config or read from GGUF, is written next to it), and
optionally the merged model, both built by ``peft`` itself from the trained state dict.

In the run (:func:`export_hf`, at the end of training): from the live engine's weights.

Offline (:func:`export_checkpoint`, ``python -m llmtrain.export CHECKPOINT OUT_DIR``): any
checkpoint of any recipe. Runs in one process without a process group: DeepSpeed ZeRO shards are
consolidated from their fp32 optimizer partitions (DeepSpeed's ``zero_to_fp32``), torch-engine
checkpoints (Distributed Checkpoint, any layout: DDP, FSDP2, TP, PP) are consolidated with DCP's
``dcp_to_torch_save``. The model config and tokenizer come from the checkpoint's own ``config.yaml``."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import llmtrain.parallel.distributed  # noqa: F401  (DeepSpeed accelerator choice before it is imported)
import torch
from omegaconf import OmegaConf
from torch import nn

from llmtrain.checkpoint.protocol import ENGINE_DIR, verify
from llmtrain.checkpoint.resume import check_base
from llmtrain.checkpoint.state import read_state
from llmtrain.common.errors import ResumeError
from llmtrain.common.paths import follow_umask
from llmtrain.common.safe_load import load_weights_only
from llmtrain.models import adapters, quantize
from llmtrain.models.build import build_tokenizer, canonical_name, model_config, resolve_gguf, save_pretrained
from llmtrain.models.vision import auto_class, save_processor
from llmtrain.monitoring import console

log = logging.getLogger("llmtrain")


# ---------------------------------------------------------------- in the run
def export_hf(engine, cfg: Any, tokenizer: Any, run_dir: Path, end_token_ids: list[int] | None = None) -> dict[str, str]:
    """The run's exports from the engine's weights: ``run_dir/hf``, a ``from_pretrained``-loadable
    folder (safetensors); for a LoRA run ``run_dir/adapter`` (:func:`export_lora`)
    and, with ``trainer.export_merged``, the merged model in ``run_dir/hf``.

    ZeRO-3 partitions are gathered into one state dict on rank 0. The weights are copied into a
    fresh model built from the config, which also re-ties input and output embeddings (and works
    for GGUF-loaded models, whose ``save_pretrained`` refuses). Collective call; returns the
    folders written (``{"export": ..., "adapter": ..., "base": ...}``) on rank 0, {} elsewhere.

    Raises:
        RuntimeError: the engine's state dict does not fit the model built from the config.
    """
    state = trained_state(engine, cfg)
    if state is None:
        return {}
    if cfg.get("peft") is not None and "score.weight" in state:
        # A LoRA reward model: its classification head trained in full, outside the adapter, so
        # the export is the merged classifier (AutoModelForSequenceClassification), no adapter.
        return export_lora(state, cfg, tokenizer, None, run_dir / "hf", end_token_ids)
    if cfg.get("peft") is not None:
        return export_lora(state, cfg, tokenizer, run_dir / "adapter",
                           run_dir / "hf" if cfg.trainer.export_merged else None, end_token_ids)
    return {"export": str(save_hf_folder(state, cfg.model, tokenizer, run_dir / "hf", end_token_ids))}


def trained_state(engine, cfg: Any, base: bool = True) -> dict[str, torch.Tensor] | None:
    """The live engine's whole fp32 state dict (in-place LoRA names) on rank 0, None elsewhere.
    Collective call (ZeRO-3 and FSDP2 gather). ``base`` False: the caller reads the trained
    tensors only (a LoRA adapter folder), so a base held in bf16 or 4 bits is not rebuilt; its
    tensors are then the held values, upcast."""
    state = engine.full_state_dict()
    if not engine.env.is_main:
        return None
    low_base = engine.frozen_in_bf16 or (cfg.recipe.engine == "deepspeed" and cfg.trainer.precision == "bf16")
    if base and adapters.is_partial(cfg) and (quantize.is_quantized(cfg) or low_base):
        # DeepSpeed's bf16 and the torch engine's bf16 LoRA hold frozen parameters in bf16 only
        # (no fp32 master), a QLoRA run its base in 4 bits: export the trained tensors on the fp32
        # base rebuilt from its source (for QLoRA, dequantized: the weights it trained on), as
        # users load it.
        trainable = {n for n, p in engine.model.named_parameters(remove_duplicate=False) if p.requires_grad}
        state = adapters.whole_state({k: v for k, v in state.items() if k in trainable}, cfg)
    elif low_base:
        state = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in state.items()}
    return state


def write_policy(engine, cfg: Any, tokenizer: Any, directory: Path, part: str,
                 end_token_ids: list[int] | None = None) -> Path | None:
    """The policy's current weights for an inference server (a rollout engine such as vLLM),
    written to ``directory`` by rank 0; collective call (returns None on other ranks).

    ``part``: ``"model"``: a Hugging Face folder of the whole model (for a LoRA run, its untrained
    base: :func:`untrained_base`) with the tokenizer and ``generation_config.json`` ending at
    ``end_token_ids``; ``"adapter"``: a LoRA run's PEFT adapter folder; ``"weights"``: for a
    server already serving a ``"model"`` folder of this run, only what an in-place reload needs
    (:func:`_write_weights`). The folder's output
    embedding is written untied (``lm_head.weight`` saved, ``tie_word_embeddings`` false): vLLM
    0.32's in-place weight reload skips a tied head, which would then keep its old values.

    Raises:
        ValueError: ``part`` is neither, or ``"adapter"`` for a run without ``+peft``.
    """
    if part not in ("model", "adapter", "weights") or (part != "model" and (cfg.get("peft") is None) == (part == "adapter")):
        raise ValueError(f"write_policy: part={part!r} (model; adapter for a +peft run, weights for one without)")
    state = trained_state(engine, cfg, base=part != "adapter")
    if state is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    if part == "adapter":
        save_adapter(state, cfg, directory, "")
        return directory
    if part == "weights":
        return _write_weights(engine, state, cfg, directory)
    from safetensors.torch import save_file

    whole = untrained_base(state, cfg) if cfg.get("peft") is not None else state
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    fresh = model_from_state(whole, cfg.model, pad)
    # Every key, a tied head too (PyTorch's state_dict lists it under both names), as its own copy.
    tensors = {k: v.detach().clone().contiguous() for k, v in fresh.state_dict().items()}
    fresh.config.tie_word_embeddings = False
    # vLLM picks its model class from `architectures` (save_pretrained would write it; config's
    # does not): without it an image-text folder resolves to the bare Idefics3Model, a pooling model.
    fresh.config.architectures = [type(fresh).__name__]
    if hasattr(fresh.config, "get_text_config"):
        fresh.config.get_text_config().tie_word_embeddings = False
    fresh.config.save_pretrained(directory)
    if end_token_ids and getattr(fresh, "generation_config", None) is not None:
        fresh.generation_config.eos_token_id = _eos_token_id(end_token_ids)
        fresh.generation_config.save_pretrained(directory)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    save_processor(tokenizer, directory)  # a vision-language model's processor too
    follow_umask(directory)
    return directory


def _write_weights(engine, state: dict[str, torch.Tensor], cfg: Any, directory: Path) -> Path:
    """``write_policy``'s ``"weights"``: the state's tensors as one ``model.safetensors``, in one
    pass, cast to the server's dtype (bf16 under ``trainer.precision=bf16``, else fp32), with no
    model rebuilt and no config or tokenizer (the server has those from its ``"model"`` folder):
    building a fresh model to save it was 80% of a SmolLM2-135M sync. The output embedding is
    written under ``lm_head.weight`` too where the model ties it (the served folder is untied).
    A transformer block (``*.layers.N.*``; elsewhere a module) whose parameters are all frozen
    (``model.freeze``) never changes and is left out: whole blocks only, as a server fuses a
    block's projections (q/k/v) into one tensor that a partial load would leave half old."""
    import re

    from safetensors.torch import save_file

    dtype = torch.bfloat16 if cfg.trainer.precision == "bf16" else torch.float32
    frozen = {n for n, p in engine.model.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def block(name: str) -> str:
        match = re.match(r"(.*\.layers\.\d+)\.", name)
        return match.group(1) if match else name.rpartition(".")[0]

    changing = {block(k) for k in state if k not in frozen}
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in state.items() if block(k) in changing}
    embed = next((k for k in state if k.endswith("embed_tokens.weight")), None)
    if "lm_head.weight" not in state and embed in tensors and getattr(model_config(cfg.model), "tie_word_embeddings", False):
        tensors["lm_head.weight"] = tensors[embed]
    # Tied names share storage, which safetensors refuses: each its own tensor (a no-op copy for most).
    seen: set[int] = set()
    for k, v in tensors.items():
        if v.data_ptr() in seen:
            tensors[k] = v.clone()
        seen.add(v.data_ptr())
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def model_from_state(state: dict[str, torch.Tensor], model_cfg: Any, pad_token_id: int | None = None) -> torch.nn.Module:
    """A plain fp32 model built from the config holding ``state`` (a whole state dict; a tied
    output embedding may be absent from it: it is filled by re-tying). GGUF quantization metadata
    is dropped from the config: the weights are plain fp32. A state with a ``score`` head (a
    reward model) builds ``AutoModelForSequenceClassification`` with ``pad_token_id`` (the token
    its pooling skips).

    Raises:
        RuntimeError: the state does not fit the model (names listed).
    """
    from transformers import AutoModelForSequenceClassification

    config = model_config(model_cfg)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    if "score.weight" in state:  # a reward model (objective=reward): the classification head
        config.num_labels = int(state["score.weight"].shape[0])
        if pad_token_id is not None:
            config.pad_token_id = pad_token_id
        fresh = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    else:
        fresh = auto_class(config).from_config(config, dtype=torch.float32)  # image-text models too
    result = fresh.load_state_dict(state, strict=False)
    fresh.tie_weights()
    loaded = {fresh.get_parameter(k).data_ptr() for k in state if k in dict(fresh.named_parameters())}
    missing = [k for k in result.missing_keys
               if k in dict(fresh.named_parameters(remove_duplicate=False)) and fresh.get_parameter(k).data_ptr() not in loaded]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"export: state dict does not match {config.model_type}: missing "
                           f"{missing[:5]}, unexpected {result.unexpected_keys[:5]}")
    return fresh


def save_hf_folder(state: dict[str, torch.Tensor], model_cfg: Any, tokenizer: Any, out_dir: Path,
                   end_token_ids: list[int] | None = None) -> Path:
    """Save a full fp32 state dict as a Hugging Face folder (model + tokenizer).

    ``end_token_ids``: every token training taught as the end of a response (the chat
    template's end-of-turn token and EOS, :func:`llmtrain.data.end_token_ids`); written as
    ``generation_config.json``'s ``eos_token_id`` so ``generate()`` stops on any of them."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    fresh = model_from_state(state, model_cfg, pad)
    if end_token_ids and getattr(fresh, "generation_config", None) is not None:  # a reward model generates nothing
        fresh.generation_config.eos_token_id = _eos_token_id(end_token_ids)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_pretrained(fresh, out_dir)
    save_processor(tokenizer, out_dir)
    follow_umask(out_dir)
    return out_dir


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base, adapter) halves of a trained model's state dict with in-place LoRA names: base
    weights under their plain names, LoRA weights as peft names them in a ``PeftModel``."""
    base, adapter = {}, {}
    for name, tensor in state.items():
        if ".lora_" in name:
            adapter[f"base_model.model.{name}"] = tensor
        else:
            base[canonical_name(name)] = tensor
    return base, adapter


def untrained_base(state: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """The base half of a LoRA run's whole trained ``state`` (:func:`split_state`) as it was
    before training: the tensors of ``peft.modules_to_save``, which trained in full (the adapter
    carries their trained copy), are put back to the initial weights of the model's source
    (:func:`llmtrain.models.build.build_model` with ``trainer.seed``); every other base tensor was
    frozen and is taken as it is (fp32).

    Raises:
        RuntimeError: a ``modules_to_save`` tensor is not in the rebuilt model.
    """
    from llmtrain.models.build import build_model

    base = split_state(state)[0]
    names = list(cfg.peft.modules_to_save or []) if cfg.get("peft") is not None else []
    trained = [k for k in base if any(k.startswith(f"{name}.") for name in names)]
    if not trained:
        return base
    initial = quantize.round_trip(build_model(cfg.model, cfg.trainer.seed), cfg).state_dict()
    unknown = [k for k in trained if k not in initial]
    if unknown:
        raise RuntimeError(f"adapter export: peft.modules_to_save tensors {unknown[:5]} are not in the model rebuilt "
                           f"from model={cfg.model.get('name')}")
    return {**base, **{k: initial[k].detach().float().clone() for k in trained}}


def save_adapter(state: dict[str, torch.Tensor], cfg: Any, adapter_dir: Path | None, base_reference: str) -> nn.Module:
    """Write the PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) from
    the trained ``state`` (in-place names, fp32, whole) into ``adapter_dir`` (None: write nothing),
    and return the merged plain model (LoRA folded into the base weights by ``merge_and_unload``).

    ``base_reference``: recorded as the adapter's ``base_model_name_or_path`` (the folder or id to
    load the base from).

    Raises:
        RuntimeError: the state does not fit the model (names listed).
    """
    import peft

    base, adapter = split_state(state)
    fresh = model_from_state(base, cfg.model)
    config = adapters.lora_config(cfg.peft, fresh)
    config.modules_to_save = list(cfg.peft.modules_to_save) or None
    config.base_model_name_or_path = fresh.name_or_path = base_reference
    with warnings.catch_warnings():  # peft probes transformers' deprecated gradient-checkpointing flag
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        # A merged-only export (a LoRA reward model) names no base: peft notes it, nothing to act on.
        warnings.filterwarnings("ignore", message=".*base_model_name_or_path. was renamed.*", category=UserWarning)
        model = peft.get_peft_model(fresh, config, adapter_name=adapters.ADAPTER_NAME)
    for name in cfg.peft.modules_to_save:  # trained in full: the wrapper's copy gets the trained weights
        for key, tensor in base.items():
            if key.startswith(f"{name}."):
                suffix = key[len(name) + 1:]
                adapter[f"base_model.model.{name}.modules_to_save.{adapters.ADAPTER_NAME}.{suffix}"] = tensor
    result = model.load_state_dict(adapter, strict=False)
    if result.unexpected_keys:
        raise RuntimeError(f"adapter export: unexpected adapter weights {result.unexpected_keys[:5]}")
    missing_lora = [k for k in result.missing_keys if ".lora_" in k]
    if missing_lora:
        raise RuntimeError(f"adapter export: adapter weights missing from the state: {missing_lora[:5]}")
    if adapter_dir is not None:
        adapter_dir.mkdir(parents=True, exist_ok=True)
        with console.quiet_library_warnings():  # peft looks for the base's config on the Hub: expected to fail
            model.save_pretrained(str(adapter_dir))
    return model.merge_and_unload()


def _eos_token_id(end_token_ids: list[int]) -> int | list[int]:
    """``generation_config.eos_token_id`` for the tokens training taught as ends: one id, or the list."""
    return end_token_ids if len(end_token_ids) > 1 else end_token_ids[0]


BASE_DIR = "base"  # adapter_dir/base: the base written next to the adapter when its source is not loadable


def base_needs_folder(model_cfg: Any) -> bool:
    """Whether a LoRA run's base must be written out for ``from_pretrained`` to load it: a model
    built from a config (its weights exist nowhere else) or read from a GGUF file (which
    ``from_pretrained`` opens only with a ``gguf_file`` argument, which an adapter's metadata cannot
    carry). A pretrained folder or Hub id loads as it is."""
    return model_cfg.source in ("config", "gguf")


def base_reference(cfg: Any, base_dir: Path | None) -> str:
    """Where the adapter's base model is loaded from (``adapter_config.json``'s
    ``base_model_name_or_path``, which ``AutoPeftModelForCausalLM.from_pretrained(adapter_dir)``
    passes to ``from_pretrained``): ``base_dir`` as an absolute path for a source that
    :func:`base_needs_folder` (peft resolves a relative path against the working directory, not the
    adapter folder), else the pretrained folder (absolute) or Hub id. Without ``base_dir`` (none
    written) for such a source: the source's own location (the GGUF folder), or "" for a config.
    """
    m = cfg.model
    if base_needs_folder(m) and base_dir is not None:
        return str(base_dir.resolve())
    if m.source == "config":
        return ""
    if m.source == "gguf":
        return str(Path(resolve_gguf(m)[0]).resolve())
    return str(Path(str(m.path)).resolve()) if Path(str(m.path)).exists() else str(m.path)


def export_lora(state: dict[str, torch.Tensor], cfg: Any, tokenizer: Any, adapter_dir: Path | None,
                merged_dir: Path | None = None, end_token_ids: list[int] | None = None) -> dict[str, str]:
    """Exports of a LoRA run from its whole trained state (in-place names, fp32; rank 0).

    ``adapter_dir``: the PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``),
    the tokenizer and a ``generation_config.json`` whose ``eos_token_id`` lists ``end_token_ids``.
    For a base that ``from_pretrained`` cannot load from its source (:func:`base_needs_folder`: built
    from a config, or a GGUF file) the untrained base (:func:`untrained_base`: the frozen weights,
    and ``peft.modules_to_save`` at their initial values) is written as a Hugging Face folder (fp32
    safetensors) to ``adapter_dir/base``, and the adapter names that folder (absolute path) as its
    ``base_model_name_or_path``; so ``AutoPeftModelForCausalLM.from_pretrained(adapter_dir)`` loads
    base and adapter from the folder's own metadata. A pretrained base is named by its folder or
    Hub id. ``merged_dir``: the merged model. Either folder may be None.

    Returns:
        The folders written: ``{"adapter", "base", "export"}`` (those written only).

    Raises:
        RuntimeError: the state does not fit the model (names listed).
    """
    written: dict[str, str] = {}
    base_dir = adapter_dir / BASE_DIR if adapter_dir is not None and base_needs_folder(cfg.model) else None
    if base_dir is not None:
        save_hf_folder(untrained_base(state, cfg), cfg.model, tokenizer, base_dir, end_token_ids)
        written["base"] = str(base_dir)
    merged = save_adapter(state, cfg, adapter_dir, base_reference(cfg, base_dir))
    if adapter_dir is not None:
        save_processor(tokenizer, adapter_dir)
        if end_token_ids:  # what generate() stops on, as in the merged and base folders
            merged.generation_config.eos_token_id = _eos_token_id(end_token_ids)
            merged.generation_config.save_pretrained(adapter_dir)
        follow_umask(adapter_dir)
        written["adapter"] = str(adapter_dir)
    if merged_dir is not None:
        save_hf_folder(merged.state_dict(), cfg.model, tokenizer, merged_dir, end_token_ids)
        written["export"] = str(merged_dir)
    return written


def consolidated_state_dict(checkpoint_dir: Path, engine: str, zero_stage: int = 1) -> dict[str, torch.Tensor]:
    """Full fp32 model state dict from a checkpoint folder written by ``engine``.

    DeepSpeed files are first checked with ``torch.load(weights_only=True)`` and DeepSpeed's own
    checkpoint classes allow-listed (:func:`llmtrain.engine.deepspeed_engine.check_checkpoint_files`):
    ZeRO-0's model states are then loaded that way; ZeRO-1/2/3 shards by DeepSpeed's
    ``zero_to_fp32``, which unpickles them (``weights_only=False``).

    Raises:
        ResumeError: a DeepSpeed file holds other pickled objects (named; none of it runs).
    """
    engine_dir = checkpoint_dir / ENGINE_DIR
    if engine == "deepspeed":
        from llmtrain.engine.deepspeed_engine import check_checkpoint_files, checkpoint_safe_globals

        check_checkpoint_files(engine_dir)
    if engine == "deepspeed" and zero_stage == 0:
        # ZeRO-0 keeps no partitions (zero_to_fp32 has nothing to merge): the module is whole, in
        # fp32 (bf16 runs train with fp32 parameters under torch autocast).
        states = load_weights_only(engine_dir / "mp_rank_00_model_states.pt", checkpoint_safe_globals())
        return {k: v.float() for k, v in states["module"].items()}
    if engine == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        log.info("consolidating %s with DeepSpeed's zero_to_fp32, which unpickles its files (weights_only=False) "
                 "after a weights_only=True check; load only checkpoints you trust", engine_dir)
        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=ENGINE_DIR)
    from llmtrain.engine.dcp_state import consolidated_model, is_dcp_checkpoint
    from llmtrain.engine.torch_engine import LEGACY_STATE

    if not is_dcp_checkpoint(engine_dir) and (engine_dir / LEGACY_STATE).is_file():
        return torch.load(engine_dir / LEGACY_STATE, map_location="cpu", weights_only=True)["model"]
    return consolidated_model(engine_dir)


def export_checkpoint(checkpoint_dir: Path, out_dir: Path, merged: bool = False, verified: bool = False) -> Path:
    """Verify ``checkpoint_dir`` and write its model as a Hugging Face folder to ``out_dir``.

    A LoRA checkpoint (``+peft=lora``) becomes a PEFT adapter folder (plus, for a model built from
    a config or read from a GGUF file, its base in ``out_dir/base``, which the adapter names), or
    with ``merged`` the merged Hugging Face model. The
    frozen base of a partial checkpoint (LoRA, ``model.freeze``) is rebuilt from the model's
    source, which must still hold the weights it was trained on.

    ``verified``: the caller has just checked ``checkpoint_dir`` with :func:`llmtrain.checkpoint.protocol.verify`
    (its checksums are not computed again).

    Raises:
        ResumeError: the checkpoint is missing, fails verification, or its base weights changed.
    """
    if not checkpoint_dir.is_dir():
        raise ResumeError(f"checkpoint {checkpoint_dir} does not exist")
    problem = None if verified else verify(checkpoint_dir)
    if problem is not None:
        raise ResumeError(f"checkpoint {checkpoint_dir} is not usable: {problem}")
    from llmtrain.config.schema import DataConfig
    from llmtrain.data import apply_pixel_budget, apply_template_setting, end_token_ids

    cfg = OmegaConf.load(checkpoint_dir / "config.yaml")
    state = consolidated_state_dict(checkpoint_dir, cfg.recipe.engine, cfg.recipe.zero_stage)
    # Older checkpoints lack newer data fields: the schema's defaults fill them.
    data_cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), cfg.data)
    tokenizer = apply_pixel_budget(data_cfg, apply_template_setting(data_cfg, build_tokenizer(cfg.model)))
    end_tokens = end_token_ids(data_cfg, tokenizer)
    if adapters.is_partial(cfg):
        current = adapters.base_fingerprint(cfg.model, cfg.trainer.seed)
        check_base(checkpoint_dir, read_state(checkpoint_dir), cfg.model, current,
                              remedy="export it with the base it was trained on")
        state = adapters.whole_state(state, cfg)
    if cfg.get("peft") is not None:
        written = export_lora(state, cfg, tokenizer, None if merged else out_dir, out_dir if merged else None,
                              end_tokens)
        return Path(written["export" if merged else "adapter"])
    return save_hf_folder(state, cfg.model, tokenizer, out_dir, end_tokens)
