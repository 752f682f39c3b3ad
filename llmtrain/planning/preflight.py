"""Checks of a valid config against the machine it is about to run on.

:func:`llmtrain.config.validate.validate` checks the config itself and is pure; what depends on this
machine lives here: the packages a tracker backend needs, an MLflow server's reachability, a
configured wandb API key, a Jinja ``data.template`` file, ``run_dir`` not being a file, and, with
context parallelism, the model's heads and attention dropout. A run
calls :func:`preflight` right after ``validate``, before anything is built or written; the planner
does not (it lays out runs for other machines).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmtrain.config.validate import declared_experts, peft_label, validate
from llmtrain.common.errors import ConfigError, require_extra
from llmtrain.config.layout import Layout


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def preflight_data(d: Any) -> None:
    """The ``data`` node's files that must exist before the data is read: a Jinja
    ``data.template`` (``*.jinja``, ``*.j2``), and every ``scheme://`` path: an ``s3://`` object
    or prefix readable with this environment's credentials and endpoint, any other scheme refused
    (:func:`llmtrain.data.remote.check_data_urls`).

    Raises:
        ConfigError: ``data.template=PATH: no such file``, an unsupported URL; MissingExtra: s3fs
            is not installed; DataError: the object store's answer (credentials, endpoint, bucket, key).
    """
    from llmtrain.data.remote import check_data_urls

    check_data_urls(d)
    template = str(d.template)
    if template.endswith((".jinja", ".j2")):
        _require(Path(template).expanduser().is_file(), f"data.template={template}: no such file")


def preflight_tracker(tr: Any) -> None:
    """Whether the ``tracker`` backends can start here: the ``tensorboard`` / ``mlflow`` package
    installed, the MLflow server at ``tracker.mlflow_uri`` reachable (with ``on_error=raise``),
    and a wandb API key configured for ``wandb_mode=online``.

    Raises:
        MissingExtra: a backend's package is not installed; ConfigError: naming the field and the
            fix (start the server, log in, or the setting that trains without the backend).
    """
    for backend in ("tensorboard", "mlflow"):  # the package of each is its name
        if backend in tr.backends:
            require_extra(backend, "tracking", f"tracker.backends={list(tr.backends)}",
                          instead=f"or drop {backend} from tracker.backends")
    if "mlflow" in tr.backends and tr.on_error == "raise" and tr.mlflow_uri:
        from llmtrain.monitoring.tracking.mlflow_backend import check_reachable

        problem = check_reachable(tr.mlflow_uri)
        _require(problem is None, f"tracker.mlflow_uri={tr.mlflow_uri} is unreachable ({problem}): start the "
                                  "server or fix the URI, or set tracker.on_error=warn to train without MLflow")
    if tr.wandb_mode == "online":
        from llmtrain.monitoring.tracking import wandb_api_key_configured

        _require(wandb_api_key_configured(), "tracker.wandb_mode=online but no wandb API key is configured: set "
                 "WANDB_API_KEY (or run `wandb login`), or use tracker.wandb_mode=offline")


def preflight_context_parallel(cfg: Any) -> None:
    """With ``recipe.cp`` > 1 or ``trainer.loss_chunk_tokens``, what the split attention and the
    chunked head need of the model's config (read here: a local folder's ``config.json`` or the
    architecture fields), before anything is written
    (:func:`llmtrain.parallel.context_parallel.check_model`, :func:`llmtrain.models.chunked_loss.check_model`).

    Raises:
        ConfigError: Ulysses heads not divisible, attention dropout or soft-capping,
            sliding-window layers; soft-capped final logits with the chunked head.
    """
    r = cfg.recipe
    chunked = cfg.trainer.get("loss_chunk_tokens", 0)
    if r.get("cp", 1) == 1 and not chunked:
        return
    from llmtrain.models import chunked_loss
    from llmtrain.parallel import context_parallel
    from llmtrain.models.build import model_config

    hf_config = model_config(cfg.model)
    context_parallel.check_model(r.cp_style, r.cp, max(1, r.tp), hf_config)
    if chunked:
        chunked_loss.check_model(hf_config)


# The layouts that split a model's layers or sequences, and what each does.
SPLITTING = {"tp": "tensor parallel", "pp": "pipeline parallel", "cp": "context parallel"}


def preflight_image_text(cfg: Any) -> None:
    """An image-text model trains on the data-parallel recipes only (docs/vision.md): tensor,
    pipeline and context parallelism would have to split its vision tower, its projector and the
    image features merged into the language model's embeddings, which llmtrain does not do.

    Raises:
        ConfigError: ``recipe.tp``, ``recipe.pp`` or ``recipe.cp`` other than 1 with an image-text
            model, naming the recipe and the recipes that work.
    """
    r = cfg.recipe
    split = [(key, r.get(key)) for key in SPLITTING if r.get(key) not in (None, 1)]
    if not split:
        return
    from llmtrain.models.build import model_config
    from llmtrain.models.vision import is_image_text

    hf_config = model_config(cfg.model)
    if is_image_text(hf_config):
        key, value = split[0]
        raise ConfigError(f"recipe={r.get('name', '?')}: recipe.{key}={value} ({SPLITTING[key]}) is not supported for the "
                          f"image-text model {hf_config.model_type} (its vision tower and image features are not split); "
                          "use a data-parallel recipe: ddp, zero1, zero2, zero3, zero3_offload, fsdp or hsdp")


def preflight_moe(cfg: Any) -> None:
    """With ``recipe.ep`` > 1, any of the MoE model fields, or sequence parallelism: what they
    need of the model's experts (:func:`llmtrain.models.moe.check_model`), read from the model's config.

    Raises:
        ConfigError: ep, a capacity factor, an aux-loss coefficient or an experts
            implementation with a dense model; ep not dividing the experts; sequence parallelism
            with an MoE model.
    """
    r, m = cfg.recipe, cfg.model
    ep, factor = r.get("ep", 1), m.get("moe_capacity_factor", 0.0)
    moe_fields = {k: m.get(k) for k in ("router_aux_loss_coef", "experts_implementation") if m.get(k) is not None}
    # A config model that declares experts is checked whatever the settings (a router llmtrain
    # cannot drive is refused here, not once the engine is built); pretrained weights' configs are
    # read when an MoE setting asks for it.
    declares = m.source == "config" and declared_experts(m.architecture) > 0
    if ep == 1 and not factor and not moe_fields and not declares and not r.get("tp_sequence_parallel", False):
        return
    from llmtrain.models import moe
    from llmtrain.models.build import model_config

    hf_config = model_config(m)
    shape = moe.check_model(hf_config, ep, factor)
    _require(shape is not None or not moe_fields,
             f"{', '.join(f'model.{k}={v}' for k, v in moe_fields.items())} but model {m.name} has no experts (a dense "
             "model); leave them unset")
    _require(shape is None or not r.get("tp_sequence_parallel", False),
             f"recipe.tp_sequence_parallel=true with the mixture-of-experts model {m.name}: the routed experts run on "
             "whole rows; turn recipe.tp_sequence_parallel off (tp still runs)")


def preflight_fp8(r: Any) -> None:
    """``recipe.fp8=true`` needs torchao and float8 matmuls on this machine's device (CUDA
    compute capability >= 8.9), unless ``recipe.fp8_emulate=true``.

    Raises:
        MissingExtra: torchao not installed; ConfigError: no float8 matmuls here, naming the fix.
    """
    if not r.fp8:
        return
    require_extra("torchao", "lowbit", "recipe.fp8=true", instead="or set recipe.fp8=false")
    if r.fp8_emulate:
        return
    import torch

    from llmtrain.parallel.float8 import fp8_support

    problem = fp8_support(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    _require(problem is None, f"recipe.fp8=true needs float8 matmuls (CUDA compute capability >= 8.9: L4, L40S, H100, "
             f"H200, B200) and {problem}; set recipe.fp8=false, or recipe.fp8_emulate=true to run the float8 "
             "rounding emulated (for testing: no speed-up)")


def preflight(cfg: Any) -> None:
    """Every machine check of ``cfg`` (a config :func:`llmtrain.config.validate.validate` accepted):
    :func:`preflight_data`, :func:`preflight_tracker`, the optional extras a feature needs
    (torchao for ``adamw_8bit``, ``+peft=qlora`` and FP8), and ``run_dir`` a folder that exists or
    can be created here (its nearest existing parent a writable folder).

    Raises:
        ConfigError: naming the field, what this machine lacks and the fix.
    """
    preflight_data(cfg.data)
    preflight_tracker(cfg.tracker)
    if cfg.trainer.optimizer == "adamw_8bit":
        require_extra("torchao", "lowbit", "trainer.optimizer=adamw_8bit", instead="or use trainer.optimizer=adamw")
    if cfg.model.quantize == "nf4":  # +peft=qlora: torchao's NF4 stores the base (llmtrain.models.quantize)
        require_extra("torchao", "lowbit", f"{peft_label(cfg)} (model.quantize=nf4)",
                      instead="or train full-precision adapters with +peft=lora")
    environment = str(cfg.get("rollout", {}).get("environment", "") or "")
    if environment.startswith("verifiers:"):
        require_extra("verifiers", "verifiers", f"rollout.environment={environment}")
    preflight_fp8(cfg.recipe)
    preflight_image_text(cfg)
    preflight_context_parallel(cfg)
    preflight_moe(cfg)
    run_dir = Path(str(cfg.run_dir)).expanduser().absolute()
    _require(not run_dir.is_file(), f"run_dir={cfg.run_dir} is a file; point run_dir at a folder")
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())  # the root always exists
    _require(existing.is_dir() and os.access(existing, os.W_OK | os.X_OK),
             f"run_dir={cfg.run_dir} cannot be created: {existing} is "
             f"{'not a folder' if not existing.is_dir() else 'not writable'}; choose a folder you can write, "
             "e.g. run_dir=runs/NAME")


def validate_and_preflight(cfg: Any, world_size: int) -> Layout:
    """:func:`llmtrain.config.validate.validate` then :func:`preflight`: everything a launch of ``cfg``
    on ``world_size`` ranks checks before it builds or writes anything.

    Returns:
        The run's :class:`~llmtrain.config.layout.Layout` (what ``validate`` returns).

    Raises:
        ConfigError: from either, naming the fields and the fix.
    """
    result = validate(cfg, world_size)
    preflight(cfg)
    return result
