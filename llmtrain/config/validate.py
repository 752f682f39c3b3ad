"""Cross-field validation, one function per section, then :func:`validate` of the whole config on
a world size, which returns the run's :class:`~llmtrain.config.layout.Layout`.

Checks that need more than one field (or the world size) raise
:class:`~llmtrain.common.errors.ConfigError`, whose message names the fields, their values and
the fix. They are pure: checks against the machine (installed packages, a tracking server, an
API key, files) are :mod:`llmtrain.planning.preflight`'s."""

from __future__ import annotations

import math
import re
from typing import Any, Optional

from omegaconf import OmegaConf

from llmtrain.config.keys import check_known_keys
from llmtrain.config.schema import (
    CP_REPLACEABLE_ATTENTION,
    CP_STYLES,
    EXPERTS_IMPLEMENTATIONS,
    PEFT_PARTS,
    PIPELINE_SCHEDULES,
    PRECISIONS,
    PROCESS_GROUP_TIMEOUT_S,
    QUANTIZATIONS,
    TP_STYLES,
    TRACKER_BACKENDS,
    WANDB_MODES,
    ObjectiveConfig,
    canonical_format,
)
from llmtrain.common.errors import ConfigError
from llmtrain.config.layout import Layout, layout
from llmtrain.config.data_checks import NAMED_TEMPLATES, _require, validate_data  # noqa: F401  (public here too)


def peft_label(cfg: Any) -> str:
    """The ``peft`` selection as the user most likely typed it, for messages: ``+peft=qlora``
    when the base is stored in 4 bits (``+peft=qlora`` is ``+peft=lora`` plus
    ``model.quantize=nf4``), else ``+peft=lora``."""
    return "+peft=qlora" if cfg.model.get("quantize", "none") == "nf4" else "+peft=lora"


def validate_peft(p: Any, r: Any, label: str = "+peft=lora") -> None:
    """The ``peft`` group's values, and the recipes it runs on; ``label``: the selection as typed
    (:func:`peft_label`), named in the recipe refusal.

    Raises:
        ConfigError: naming the field and its allowed values.
    """
    _require(p.method == "lora", f"peft.method={p.method!r}: only lora is supported")
    _require(p.r > 0, f"peft.r={p.r} must be > 0 (the adapter rank, e.g. 8)")
    _require(p.alpha > 0, f"peft.alpha={p.alpha} must be > 0 (scaling alpha/r, e.g. 16)")
    _require(0.0 <= p.dropout < 1.0, f"peft.dropout={p.dropout} must be in [0, 1)")
    _require(p.bias in ("none", "all", "lora_only"), f"peft.bias={p.bias!r} must be none, all or lora_only")
    targets = p.target_modules
    _require(targets == "all-linear" or (OmegaConf.is_list(targets) and len(targets) > 0
                                         and all(isinstance(t, str) and t for t in targets)),
             f"peft.target_modules={targets!r} must be all-linear or a non-empty list of module names "
             "(e.g. [q_proj, v_proj])")
    parts = list(p.get("parts") or [])
    _require(bool(parts) and all(part in PEFT_PARTS for part in parts),
             f"peft.parts={parts} must be a non-empty list of {', '.join(PEFT_PARTS)} (the parts whose Linear layers "
             "get adapters; default [language])")
    _require(not p.use_dora, "peft.use_dora=true is not supported yet: DoRA's magnitude vector is initialised "
             "from the base weights, which FSDP2 and ZeRO-3 do not hold whole at build; use LoRA (use_dora=false)")
    _require(r.tp == 1 and r.pp == 1,
             f"{label} with recipe {r.name} (recipe.tp={r.tp}, recipe.pp={r.pp}): LoRA runs on the data-parallel "
             "recipes (ddp, zero1-3, zero3_offload, fsdp, hsdp); peft's LoRA layers are not sharded by the "
             "tensor-parallel plan or split into pipeline stages here")


def parse_bytes(text: Any, field_name: str = "device_memory") -> int:
    """A size in bytes from ``80GiB``, ``80GB`` (decimal), ``1.5TiB``, ``512MiB`` or a number.

    Raises:
        ConfigError: not a size (the message names ``field_name``).
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.I)
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"{field_name}={text!r} is not a positive size; write e.g. 80GiB, 40GB or 512MiB")
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
             "TIB": 2**40}[(match.group(2) or "B").upper()]
    return int(float(match.group(1)) * scale)


def validate_model(m: Any) -> None:
    """The ``model`` node: its source and what that source needs, ``tp_plan`` styles, the
    architecture's head counts (``source=config``) and the ``freeze`` patterns.

    Raises:
        ConfigError: naming the field, its value and the fix.
    """
    _require(m.source in ("config", "pretrained", "gguf"),
             f"model.source={m.source!r} must be one of config, pretrained, gguf")
    if m.source == "config":
        _require("model_type" in m.architecture,
                 "model.architecture must name model_type (e.g. llama) when model.source=config")
    if m.source == "pretrained":
        _require(m.path is not None, "model.path must be set when model.source=pretrained")
    if m.source == "gguf":
        _require(m.gguf_file is not None, "model.gguf_file must be set when model.source=gguf")
        _require(m.path is not None or m.gguf_package is not None,
                 "model.source=gguf needs model.path (folder of the file) or model.gguf_package")
    _require(m.quantize in QUANTIZATIONS, f"model.quantize={m.quantize!r} must be one of {', '.join(QUANTIZATIONS)}")
    _require(m.tp_plan is None or OmegaConf.is_dict(m.tp_plan),
             f"model.tp_plan={m.tp_plan!r} must be a mapping {{module path: style}}")
    bad_styles = {k: v for k, v in (m.tp_plan or {}).items() if v not in TP_STYLES}
    _require(not bad_styles, f"model.tp_plan: styles {bad_styles} are not supported; use "
             f"{', '.join(TP_STYLES)}")
    if m.source == "config" and "model_type" in m.architecture:
        arch = m.architecture
        hidden, heads = arch.get("hidden_size"), arch.get("num_attention_heads")
        kv_heads = arch.get("num_key_value_heads") or heads
        if hidden and heads:
            _require(hidden % heads == 0, f"model.architecture.hidden_size={hidden} must be divisible by "
                     f"model.architecture.num_attention_heads={heads}")
            _require(heads % kv_heads == 0, f"model.architecture.num_attention_heads={heads} must be divisible by "
                     f"model.architecture.num_key_value_heads={kv_heads}")
    _require(m.experts_implementation in (None, *EXPERTS_IMPLEMENTATIONS),
             f"model.experts_implementation={m.experts_implementation!r} must be one of "
             f"{', '.join(EXPERTS_IMPLEMENTATIONS)} (or unset: transformers' default)")
    _require(m.router_aux_loss_coef is None or (math.isfinite(m.router_aux_loss_coef) and m.router_aux_loss_coef >= 0),
             f"model.router_aux_loss_coef={m.router_aux_loss_coef} must be a finite number >= 0 (0 = no "
             "load-balancing loss; unset = the model config's)")
    _require(math.isfinite(m.moe_capacity_factor) and m.moe_capacity_factor >= 0,
             f"model.moe_capacity_factor={m.moe_capacity_factor} must be >= 0 (0 = dropless; e.g. 1.25)")
    if m.source == "config":
        experts = declared_experts(m.architecture)
        top_k = m.architecture.get("num_experts_per_tok")
        _require(not experts or top_k is None or 1 <= top_k <= experts,
                 f"model.architecture.num_experts_per_tok={top_k} must be between 1 and the number of experts "
                 f"({experts})")
    _require(all(isinstance(p, str) and p for p in m.freeze),
             f"model.freeze={list(m.freeze)} must be a list of part names or parameter-name patterns (e.g. [vision] or "
             "[model.embed_tokens.*])")
    for part, rate in ((k, v) for k, v in (m.get("lr_multipliers") or {}).items() if v is not None):
        _require(math.isfinite(rate) and rate > 0, f"model.lr_multipliers.{part}={rate} must be a number > 0 (to keep a "
                 f"part unchanged, freeze it: model.freeze=[{part}])")


# The config keys that count an MoE model's routed experts (transformers' names by family).
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def declared_experts(architecture: Any) -> int:
    """Routed experts per layer ``architecture`` (``model.architecture``) declares; 0 for a
    dense model (:func:`llmtrain.models.moe.num_experts_of` reads a ``transformers`` config)."""
    return next((architecture.get(k) for k in EXPERT_COUNT_FIELDS
                 if isinstance(architecture.get(k), int) and architecture.get(k) > 0), 0)


def _validate_eval_tasks(t: Any) -> None:
    """The ``trainer.eval_tasks*`` fields (whether the tasks exist is the preflight's check)."""
    _require(all(isinstance(name, str) and name and "," not in name for name in t.eval_tasks),
             f"trainer.eval_tasks={list(t.eval_tasks)} must be a list of task names (e.g. [hh_local])")
    _require(t.eval_tasks_every >= 0, f"trainer.eval_tasks_every={t.eval_tasks_every} must be >= 0 (0 = the last step "
             "only)")
    _require(t.eval_tasks_batch_size >= 1, f"trainer.eval_tasks_batch_size={t.eval_tasks_batch_size} must be >= 1")
    _require(t.eval_tasks_limit is None or t.eval_tasks_limit > 0,
             f"trainer.eval_tasks_limit={t.eval_tasks_limit} must be > 0 (documents per task; unset = all)")
    _require(t.eval_tasks_bootstrap_iters >= 0,
             f"trainer.eval_tasks_bootstrap_iters={t.eval_tasks_bootstrap_iters} must be >= 0")
    _require(bool(t.eval_tasks) or (not t.eval_tasks_every and not t.eval_tasks_include and not t.eval_tasks_data_dir),
             f"trainer.eval_tasks_every={t.eval_tasks_every} / eval_tasks_include={list(t.eval_tasks_include)} / "
             f"eval_tasks_data_dir={t.eval_tasks_data_dir} without trainer.eval_tasks: name the tasks, e.g. "
             "trainer.eval_tasks=[hh_local]")


def validate_trainer(t: Any, r: Any) -> None:
    """The ``trainer`` node, and the trainer features the recipe's engine lacks
    (``nonfinite=skip`` and ``async_checkpoint`` need ``engine=torch``). The batch sizes'
    divisibility is :func:`llmtrain.config.layout.layout`'s.

    Raises:
        ConfigError: naming the field, its value and the fix.
    """
    for key in ("max_steps", "global_batch_size", "micro_batch_size"):
        _require(t[key] >= 1, f"trainer.{key}={t[key]} must be >= 1")
    for key in ("warmup_steps", "eval_every", "log_every", "save_every", "eval_samples", "gc_every"):
        _require(t[key] >= 0, f"trainer.{key}={t[key]} must be >= 0")
    _require(0 <= t.malloc_mmap_threshold <= 32 * 2**20,
             f"trainer.malloc_mmap_threshold={t.malloc_mmap_threshold} must be 0 (glibc's default) to 33554432 bytes")
    _require(t.lr > 0, f"trainer.lr={t.lr} must be > 0")
    _validate_eval_tasks(t)
    _require(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, f"trainer.beta1={t.beta1}, trainer.beta2={t.beta2} must be in [0, 1)")
    _require(t.eps > 0, f"trainer.eps={t.eps} must be > 0")
    _require(t.weight_decay >= 0, f"trainer.weight_decay={t.weight_decay} must be >= 0")
    _require(t.grad_clip >= 0, f"trainer.grad_clip={t.grad_clip} must be >= 0 (0 = no clipping)")
    _require(t.keep_checkpoints >= 1, f"trainer.keep_checkpoints={t.keep_checkpoints} must be >= 1")
    _require(t.nonfinite in ("stop", "skip"), f"trainer.nonfinite={t.nonfinite!r} must be stop or skip")
    _require(t.spike_factor == 0 or t.spike_factor > 1,
             f"trainer.spike_factor={t.spike_factor} must be 0 (off) or > 1 (a multiple of the running mean loss)")
    _require(t.max_skipped_steps >= 1, f"trainer.max_skipped_steps={t.max_skipped_steps} must be >= 1")
    _require(not (t.nonfinite == "skip" and r.engine == "deepspeed"),
             "trainer.nonfinite=skip needs engine=torch: DeepSpeed applies the update inside its own step, before "
             "llmtrain sees the gradient norm (ZeRO-3 and ZeRO-0 would apply a NaN update); use trainer.nonfinite=stop "
             "or engine=torch")
    _require(t.dry_run_world_size is None or t.dry_run_world_size >= 1,
             f"trainer.dry_run_world_size={t.dry_run_world_size} must be >= 1 (the number of ranks to lay out)")
    _require(t.save_every_minutes >= 0, f"trainer.save_every_minutes={t.save_every_minutes} must be >= 0")
    _require(0 <= t.hang_timeout_s < PROCESS_GROUP_TIMEOUT_S,
             f"trainer.hang_timeout_s={t.hang_timeout_s} must be >= 0 (0 = no hang watchdog) and below the process "
             f"group's timeout of {PROCESS_GROUP_TIMEOUT_S:.0f} s, which would otherwise end a hung job first")
    _require(t.peak_tflops >= 0, f"trainer.peak_tflops={t.peak_tflops} must be >= 0 (0 = a GPU data sheet, else a matmul probe of this machine)")
    _require(t.checkpoint_hash in ("xxh3", "sha256"), f"trainer.checkpoint_hash={t.checkpoint_hash!r} must be xxh3 or sha256")
    _require(not (t.async_checkpoint and r.engine == "deepspeed"),
             "trainer.async_checkpoint=true needs engine=torch: llmtrain does not yet drive DeepSpeed's background "
             "checkpoint writers (Nebula, the decoupled engine) through its completion marker; use "
             "trainer.async_checkpoint=false or engine=torch")
    if t.preempt_signal is not None:
        import signal

        _require(str(t.preempt_signal) in signal.Signals.__members__ and t.preempt_signal not in ("SIGKILL", "SIGSTOP"),
                 f"trainer.preempt_signal={t.preempt_signal!r} must name a catchable signal (e.g. SIGUSR1)")
    _require(0.0 <= t.min_lr_ratio <= 1.0, f"trainer.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    _require(t.precision in PRECISIONS, f"trainer.precision={t.precision!r} must be auto, fp32 or bf16")
    _validate_optimizer(t, r)


def _validate_optimizer(t: Any, r: Any) -> None:
    """``trainer.optimizer`` and its fields (:mod:`llmtrain.engine.optimizers`)."""
    from llmtrain.config.schema import OPTIMIZERS

    _require(t.optimizer in OPTIMIZERS, f"trainer.optimizer={t.optimizer!r} must be one of {', '.join(OPTIMIZERS)}")
    _require(t.optimizer == "adamw" or r.engine != "deepspeed" or r.zero_stage == 0,
             f"trainer.optimizer={t.optimizer} runs on the torch engine: DeepSpeed's ZeRO-{r.zero_stage} optimizer steps "
             "flat 1-D partitions, where Muon and Adafactor find no matrix (and 8-bit states are untested); use "
             "engine=torch, whose ZeRO stages are FSDP2 shards that keep each parameter's shape, or "
             "trainer.optimizer=adamw")
    m, a = t.muon, t.adafactor
    _require(m.lr is None or m.lr > 0, f"trainer.muon.lr={m.lr} must be > 0 (or null: trainer.lr)")
    _require(0 <= m.momentum < 1, f"trainer.muon.momentum={m.momentum} must be in [0, 1)")
    _require(1 <= m.ns_steps < 100, f"trainer.muon.ns_steps={m.ns_steps} must be in [1, 100)")
    _require(m.adjust_lr in ("match_rms_adamw", "original"),
             f"trainer.muon.adjust_lr={m.adjust_lr!r} must be match_rms_adamw or original")
    _require(a.beta2_decay <= 0, f"trainer.adafactor.beta2_decay={a.beta2_decay} must be <= 0")
    _require(a.eps1 is None or a.eps1 >= 0, f"trainer.adafactor.eps1={a.eps1} must be >= 0 (or null)")
    _require(a.eps2 >= 0, f"trainer.adafactor.eps2={a.eps2} must be >= 0")


def validate_tracker(tr: Any) -> None:
    """The ``tracker`` node's values. Whether its backends can start on this machine (packages,
    server, API key) is :func:`llmtrain.planning.preflight.preflight_tracker`'s.

    Raises:
        ConfigError: naming the field, its value and the allowed values.
    """
    unknown = [b for b in tr.backends if b not in TRACKER_BACKENDS]
    _require(not unknown, f"tracker.backends: {unknown} are not backends; choose from {list(TRACKER_BACKENDS)} "
                          "(metrics.jsonl is always written)")
    _require(len(set(tr.backends)) == len(tr.backends), f"tracker.backends={list(tr.backends)} names a backend twice")
    _require(tr.on_error in ("raise", "warn"), f"tracker.on_error={tr.on_error!r} must be raise or warn")
    _require(tr.wandb_mode in WANDB_MODES,
             f"tracker.wandb_mode={tr.wandb_mode!r} must be auto, online, offline or disabled")


def validate_recipe(r: Any, engine: Optional[str] = None) -> None:
    """The ``recipe`` node (and the top-level ``engine`` override): engine, ZeRO stage and
    offload, what each engine supports, the pipeline schedule and the memory budget of
    ``+recipe=auto``. The degrees against the world size are :func:`llmtrain.config.layout.layout`'s.

    Raises:
        ConfigError: naming the fields, their values and the fix.
    """
    _require(0 <= r.memory_margin < 1, f"recipe.memory_margin={r.memory_margin} must be in [0, 1) (a fraction of "
                                        "device memory kept free, e.g. 0.1)")
    if r.device_memory is not None:
        parse_bytes(r.device_memory, "recipe.device_memory")
    _require(engine in (None, "torch", "deepspeed"),
             f"engine={engine!r} must be torch or deepspeed (or unset: the recipe's own engine)")
    _require(r.engine in ("torch", "deepspeed"),
             f"recipe.engine={r.engine!r} must be torch or deepspeed")
    _require(r.zero_stage in (0, 1, 2, 3), f"recipe.zero_stage={r.zero_stage} must be 0, 1, 2 or 3")
    _require(not r.offload_optimizer or r.zero_stage >= 1,
             f"recipe.offload_optimizer=true needs recipe.zero_stage>=1 (got {r.zero_stage})")
    _require(not r.offload_params or r.zero_stage == 3,
             f"recipe.offload_params=true needs recipe.zero_stage=3 (got {r.zero_stage})")
    if r.engine == "deepspeed":
        degrees = {k: r[k] for k in ("dp_replicate", "dp_shard") if r[k] not in (None, -1)}
        degrees.update({k: r[k] for k in ("tp", "pp") if r[k] != 1})
        _require(not degrees, f"{', '.join(f'recipe.{k}={v}' for k, v in degrees.items())} needs engine=torch (the "
                              "DeepSpeed engine shards over every rank with ZeRO and has no tensor or pipeline "
                              "parallelism here)")
    else:
        _require(r.offload_params == r.offload_optimizer,
                 f"recipe.offload_optimizer={r.offload_optimizer}, recipe.offload_params={r.offload_params}: FSDP2 "
                 "offloads parameters, gradients and optimizer state together; set both, or use engine=deepspeed")
        _require(not (r.zero_stage == 0 and r.dp_shard not in (None, 1)),
                 f"recipe.dp_shard={r.dp_shard} shards data-parallel ranks but recipe.zero_stage=0 replicates; "
                 "use zero_stage 1-3 (FSDP2) or dp_shard=1")
    _require(r.pp_schedule in PIPELINE_SCHEDULES,
             f"recipe.pp_schedule={r.pp_schedule!r} must be one of {', '.join(PIPELINE_SCHEDULES)}")
    _require(r.pp_stages_per_rank >= 1, f"recipe.pp_stages_per_rank={r.pp_stages_per_rank} must be >= 1")
    _require(r.pp_pad_multiple >= 1, f"recipe.pp_pad_multiple={r.pp_pad_multiple} must be >= 1 (tokens)")
    _require((r.pp_schedule == "interleaved_1f1b") == (r.pp_stages_per_rank > 1),
             f"recipe.pp_schedule={r.pp_schedule} with recipe.pp_stages_per_rank={r.pp_stages_per_rank}: "
             "interleaved_1f1b needs pp_stages_per_rank >= 2, gpipe and 1f1b run one stage per rank")


def validate(cfg: Any, world_size: int) -> Layout:
    """Check every rule of the config itself, before anything is built or written: no packages,
    servers or files are looked at (that is :func:`llmtrain.planning.preflight.preflight`'s, which a run
    calls after this), so the planner can validate layouts for any machine.

    Args:
        cfg: the composed :class:`Config` (an OmegaConf DictConfig).
        world_size: number of processes of the launch.

    Returns:
        The run's :class:`~llmtrain.config.layout.Layout` on ``world_size`` ranks: parallel degrees and
        gradient accumulation steps.

    Raises:
        ConfigError: naming the offending fields, their values and the fix.
    """
    check_known_keys(cfg)
    _require(str(cfg.name).strip() != "", "name= is empty, so the run would write into runs/ itself, beside other "
             "runs; give it a name (name=NAME) or leave name out for <model>-<data>-<recipe>")
    validate_model(cfg.model)
    validate_data(cfg.data)
    validate_trainer(cfg.trainer, cfg.recipe)
    validate_tracker(cfg.tracker)
    if cfg.get("peft") is not None:
        validate_peft(cfg.peft, cfg.recipe, peft_label(cfg))
    validate_recipe(cfg.recipe, cfg.get("engine"))
    validate_objective(cfg)
    validate_context_parallel(cfg)
    validate_sequence_parallel(cfg.recipe)
    validate_chunked_loss(cfg)
    validate_expert_parallel(cfg.recipe)
    validate_fp8(cfg.recipe)
    validate_quantize(cfg)
    objective = cfg.objective.get("target") or cfg.objective.get("name") or "causal_lm"
    _require(not cfg.model.moe_capacity_factor or objective not in PREFERENCE_OBJECTIVES,
             f"model.moe_capacity_factor={cfg.model.moe_capacity_factor} with objective={objective}: a pair's chosen row "
             "comes first and would take expert capacity before its rejected row, and the reference runs dropless; "
             "set model.moe_capacity_factor=0 for preference tuning")
    rates = {k: v for k, v in (cfg.model.get("lr_multipliers") or {}).items() if v is not None}
    _require(not rates or cfg.trainer.optimizer != "muon",
             f"model.lr_multipliers={rates} with trainer.optimizer=muon: Muon's groups are "
             "split by tensor shape, not by part; use trainer.optimizer=adamw, or drop model.lr_multipliers")
    p = cfg.get("peft")
    _require(p is None or not p.get("target_parameters") or cfg.recipe.ep == 1,
             f"peft.target_parameters={list(p.target_parameters) if p is not None else []} with recipe.ep={cfg.recipe.ep}: "
             "adapters on expert tensors are not sharded over an ep group; use recipe.ep=1 (fsdp shards them), "
             "or adapt attention only (peft.target_parameters=[])")
    shape = layout(cfg, world_size)
    # FSDP2 shards over dp_shard x cp (llmtrain.parallel.parallelize.fsdp_mesh); TP makes DTensors too.
    _require(cfg.trainer.optimizer != "adafactor" or cfg.recipe.engine != "torch"
             or (shape.dp_shard * shape.cp == 1 and shape.tp == 1),
             f"trainer.optimizer=adafactor with recipe {cfg.recipe.name} (dp_shard {shape.dp_shard}, cp {shape.cp}, "
             f"tp {shape.tp}): "
             "torch.optim.Adafactor's factored moments run on whole tensors, not FSDP2/TP shards (DTensor); use "
             "trainer.optimizer=muon or adamw here, or a recipe that keeps whole parameters (ddp, pp)")
    return shape


def validate_fp8(r: Any) -> None:
    """``recipe.fp8`` and its fields (what the hardware has is :mod:`llmtrain.planning.preflight`'s).

    Raises:
        ConfigError: an unknown ``fp8_recipe``; fp8 on the DeepSpeed engine or with tensor parallelism.
    """
    _require(r.fp8_recipe in ("tensorwise", "rowwise"), f"recipe.fp8_recipe={r.fp8_recipe!r} must be tensorwise or rowwise")
    if not r.fp8:
        return
    _require(r.engine == "torch", f"recipe.fp8=true with recipe {r.name} (engine {r.engine}): FP8 training runs on the "
             "torch engine (torchao's Float8Linear under DDP/FSDP2); use engine=torch")
    _require(r.tp == 1, f"recipe.fp8=true with recipe.tp={r.tp}: float8 tensor-parallel styles are not wired in yet; "
             "use recipe.tp=1 (FSDP2 shards float8 layers and all-gathers them in float8)")


def validate_quantize(cfg: Any) -> None:
    """``model.quantize`` against what trains and the recipe (QLoRA: :mod:`llmtrain.models.quantize`).

    Raises:
        ConfigError: a 4-bit base without LoRA adapters, with FP8 matmuls, or with a reference copy.
    """
    if cfg.model.quantize == "none":
        return
    _require(cfg.get("peft") is not None,
             f"model.quantize={cfg.model.quantize} stores the frozen base in 4 bits, so only adapters can train: add "
             "+peft=lora (or use +peft=qlora, which sets both)")
    _require(not cfg.recipe.fp8, f"model.quantize={cfg.model.quantize} with recipe.fp8=true: the 4-bit base is "
             "dequantized for each matmul, which float8 training does not convert; drop one of the two")
    _require(cfg.objective.get("reference") != "copy",
             f"objective.reference=copy with model.quantize={cfg.model.quantize}: the copy would be the full-precision "
             "base while the policy starts from its 4-bit version; use objective.reference=adapters_disabled (the "
             "4-bit base itself, the default with +peft)")


def validate_expert_parallel(r: Any) -> None:
    """``recipe.ep`` against the recipe (what it needs of the model is checked with the model's
    config, :func:`llmtrain.models.moe.check_model`; that it divides dp_shard, by the layout).

    Raises:
        ConfigError: ep < 1; ep > 1 on the DeepSpeed engine, with context parallelism, or with
            sequence parallelism.
    """
    _require(isinstance(r.ep, int) and r.ep >= 1, f"recipe.ep={r.ep} must be an integer >= 1 (1 = off)")
    if r.ep == 1:
        return
    _require(r.engine == "torch", f"recipe.ep={r.ep} with recipe {r.name} (engine {r.engine}): expert parallelism runs "
             "on the torch engine (FSDP2 recipes: fsdp, hsdp, fsdp_tp); DeepSpeed's own MoE needs its MoE layer "
             "classes, not transformers' experts")
    _require(r.cp == 1, f"recipe.ep={r.ep} with recipe.cp={r.cp}: expert and context parallelism do not compose yet; "
             "use one of them")


# Built-in objectives whose loss reads the logits only through next-label log-probs.
CHUNKABLE_OBJECTIVES = ("causal_lm", "dpo", "simpo", "kto", "grpo")


def validate_chunked_loss(cfg: Any) -> None:
    """``trainer.loss_chunk_tokens`` against the objective and the recipe.

    Raises:
        ConfigError: a negative value; with chunks: pipeline stages, or a built-in objective that
            reads more than next-label log-probs (orpo's whole-sequence NLL, reward's scores).
    """
    chunk = cfg.trainer.loss_chunk_tokens
    _require(isinstance(chunk, int) and chunk >= 0,
             f"trainer.loss_chunk_tokens={chunk} must be an integer >= 0 (tokens per chunk; 0 = off)")
    if not chunk:
        return
    r = cfg.recipe
    _require(r.pp == 1, f"trainer.loss_chunk_tokens={chunk} with recipe {r.name} (recipe.pp={r.pp}): the pipeline's "
             "last stage computes whole logits for its schedule's loss; set trainer.loss_chunk_tokens=0")
    name = cfg.objective.get("name") or "causal_lm"
    _require(cfg.objective.get("target") or name in CHUNKABLE_OBJECTIVES,
             f"trainer.loss_chunk_tokens={chunk} with objective={name}: chunking needs a loss over next-label "
             f"log-probs only ({', '.join(CHUNKABLE_OBJECTIVES)}); set trainer.loss_chunk_tokens=0")


def validate_sequence_parallel(r: Any) -> None:
    """``recipe.tp_sequence_parallel`` needs tensor parallelism and no pipeline stages.

    Raises:
        ConfigError: naming the recipe's tp and pp.
    """
    if not r.tp_sequence_parallel:
        return
    _require(r.tp != 1 and r.engine == "torch", f"recipe.tp_sequence_parallel=true with recipe {r.name} (recipe.tp="
             f"{r.tp}, engine {r.engine}): sequence parallelism shards inside tensor-parallel groups; use a recipe "
             "with tp (tp, fsdp_tp) or turn it off")
    _require(r.pp == 1, f"recipe.tp_sequence_parallel=true with recipe.pp={r.pp}: not with pipeline stages; "
             "turn it off or use fsdp_tp")
    _require(not r.compile, "recipe.tp_sequence_parallel=true with recipe.compile=true: torch.compile fails on the "
             "sequence-sharded norms in torch 2.13 (Dynamo: unhashable SymInt); turn one of them off")


def validate_context_parallel(cfg: Any) -> None:
    """``recipe.cp`` and ``recipe.cp_style`` against the data, the model and the recipe.

    Raises:
        ConfigError: an unknown style; with cp > 1: ``data.seq_len`` not a multiple of 2 x cp (the
            load-balanced split), pipeline stages, an objective other than causal_lm, or an attention
            implementation the context-parallel attention cannot replace.
    """
    r = cfg.recipe
    _require(r.cp_style in CP_STYLES, f"recipe.cp_style={r.cp_style!r} must be one of {', '.join(CP_STYLES)}")
    _require(isinstance(r.cp, int) and r.cp >= 1, f"recipe.cp={r.cp} must be an integer >= 1 (1 = off)")
    if r.cp == 1:
        return
    seq = cfg.data.seq_len
    _require(seq % (2 * r.cp) == 0, f"data.seq_len={seq} with recipe.cp={r.cp}: each row is cut into 2 x cp = "
             f"{2 * r.cp} chunks (a head and a tail chunk per rank); use a seq_len that is a multiple of {2 * r.cp}")
    _require(r.pp == 1, f"recipe.cp={r.cp} with recipe {r.name} (recipe.pp={r.pp}): context parallelism does not run "
             "inside pipeline stages; use a recipe without pp (fsdp, hsdp, fsdp_tp, zero3)")
    name = cfg.objective.get("name") or "causal_lm"
    _require(name == "causal_lm" and cfg.objective.get("target") in (None, ""),
             f"recipe.cp={r.cp} with objective={cfg.objective.get('target') or name}: context parallelism splits "
             "rows for the built-in next-token loss only (objective=causal_lm); preference and custom objectives "
             "read whole sequences per rank")
    attn = cfg.model.attn_implementation
    _require(attn in CP_REPLACEABLE_ATTENTION,
             f"recipe.cp={r.cp} with model.attn_implementation={attn}: the context-parallel attention replaces "
             f"{' or '.join(CP_REPLACEABLE_ATTENTION)} only; set model.attn_implementation=sdpa")


PREFERENCE_OBJECTIVES = ("dpo", "simpo", "orpo", "reward", "kto")
# The objective fields each built-in objective reads (any other one must keep its default).
GRPO_FIELDS = ("num_generations", "epsilon", "epsilon_high", "importance_sampling_level", "scale_rewards",
               "advantage_estimator", "num_iterations", "mask_truncated_completions", "sampling_correction",
               "sampling_correction_max", "sampling_correction_min")
OBJECTIVE_FIELDS = {
    "all": ("beta", "loss_type", "label_smoothing", "gamma", "nll_on_prompt", "desirable_weight", "undesirable_weight",
            "margin_column", "center_coefficient", "reference", "precompute_reference", *GRPO_FIELDS, "teacher",
            "lmbda"),
    "causal_lm": (),
    "dpo": ("beta", "loss_type", "label_smoothing", "reference", "precompute_reference"),
    "simpo": ("beta", "gamma", "label_smoothing"),
    "orpo": ("beta", "nll_on_prompt"),
    "kto": ("beta", "desirable_weight", "undesirable_weight", "reference"),
    "reward": ("margin_column", "center_coefficient"),
    "grpo": ("beta", "loss_type", "reference", *GRPO_FIELDS),
    "distill": ("teacher", "lmbda", "num_generations", "mask_truncated_completions"),
}
ONLINE_OBJECTIVES = ("grpo", "distill")
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
REFERENCE_KINDS = ("auto", "copy", "adapters_disabled")


def validate_objective(cfg: Any) -> None:
    """The ``objective`` node against the data, the recipe and ``peft``.

    Raises:
        ConfigError: naming the field, its value and the fix.
    """
    o, d, r = cfg.objective, cfg.data, cfg.recipe
    formats = {canonical_format(src.format) for src in d.datasets} if d.datasets else {canonical_format(d.format)}
    _require(o.target or o.name in ONLINE_OBJECTIVES or "prompts" not in formats,
             f"data.format=prompts holds prompts without completions, which objective={o.name} does not train on; "
             f"use an online objective (objective={'/'.join(ONLINE_OBJECTIVES)})")
    _require(o.target or o.name in ONLINE_OBJECTIVES or not cfg.reward.functions,
             f"reward.functions={list(cfg.reward.functions)} with objective={o.name}: rewards score sampled completions "
             f"of an online objective (objective={'/'.join(ONLINE_OBJECTIVES)}); drop them")
    if o.target:
        return
    name = o.name
    _require(name == "causal_lm" or name in PREFERENCE_OBJECTIVES or name in ONLINE_OBJECTIVES,
             f"objective.name={name!r} is not a built-in objective (choose causal_lm, "
             f"{', '.join(PREFERENCE_OBJECTIVES + ONLINE_OBJECTIVES)}, or set objective.target=module:Class)")
    if name in ONLINE_OBJECTIVES:
        validate_online(cfg, formats)
        _refuse_stray_fields(o, name)
        return
    if name == "causal_lm":
        _require(not formats & {"preference", "kto"}, f"data.format={'/'.join(sorted(formats & {'preference', 'kto'}))} "
                 "holds preference data, which objective=causal_lm does not train on; pick a preference objective "
                 "(objective=dpo, simpo, orpo, kto or reward)")
        _refuse_stray_fields(o, name)
        return
    if name == "kto":
        _require(len(formats) == 1 and formats <= {"kto", "preference"}, "objective=kto trains on unpaired examples: "
                 "every source's format must be kto (data=kto), or every source's preference (pairs, unpaired); "
                 f"the data has {' and '.join(sorted(formats))}")
        _require(not d.packing, "objective=kto estimates its KL term from the micro-batch's own mismatched examples: "
                 "set data.packing=false")
        _require(not o.precompute_reference, "objective.precompute_reference=true: KTO's KL examples pair each prompt "
                 "with another example of its micro-batch, which changes with the data order; drop the setting")
        _require(cfg.trainer.micro_batch_size >= 2, f"objective=kto with trainer.micro_batch_size="
                 f"{cfg.trainer.micro_batch_size}: the KL term pairs each prompt with another example of the "
                 "micro-batch, so it needs at least 2 (as TRL's KTOTrainer)")
        _require(o.desirable_weight > 0 and o.undesirable_weight > 0, "objective.desirable_weight and "
                 "objective.undesirable_weight must be > 0")
    else:
        sources = list(d.datasets) if d.datasets else [d]
        keys = [f"data.datasets.{i}.format" for i in range(len(sources))] if d.datasets else ["data.format"]
        bad = [f"{key}={src.format}" for key, src in zip(keys, sources) if src.format != "preference"]
        _require(not bad, f"objective={name} trains on preference pairs: {', '.join(bad)} must be preference "
                 "(data=preference)")
    for key in ("beta", "label_smoothing", "gamma", "center_coefficient", "desirable_weight", "undesirable_weight"):
        _require(math.isfinite(o[key]), f"objective.{key}={o[key]} must be a finite number")
    _require(o.beta > 0, f"objective.beta={o.beta} must be > 0")
    _require(o.loss_type in DPO_LOSS_TYPES, f"objective.loss_type={o.loss_type!r} must be one of "
             f"{', '.join(DPO_LOSS_TYPES)}")
    _require(0.0 <= o.label_smoothing < 0.5, f"objective.label_smoothing={o.label_smoothing} must be in [0, 0.5)")
    _require(o.center_coefficient >= 0, f"objective.center_coefficient={o.center_coefficient} must be >= 0")
    _require(o.reference in REFERENCE_KINDS, f"objective.reference={o.reference!r} must be one of "
             f"{', '.join(REFERENCE_KINDS)}")
    _require(o.reference != "adapters_disabled" or cfg.get("peft") is not None,
             "objective.reference=adapters_disabled needs +peft=lora (the base model is the reference when the "
             "adapters are off); use objective.reference=copy for full fine-tuning")
    _require(not o.precompute_reference or name in ("dpo", "kto"),
             f"objective.precompute_reference=true: objective={name} is reference-free (dpo and kto have a reference "
             "model); drop the setting")
    _require(not o.margin_column or name == "reward", "objective.margin_column=true applies to objective=reward")
    _require(r.pp == 1, f"objective={name} with recipe {r.name} (recipe.pp={r.pp}): preference and reward losses "
             "compare a pair's sequences, which pipeline stages do not see together; use a data-parallel, "
             "ZeRO, FSDP or tensor-parallel recipe")
    if name == "reward":
        _require(not d.packing, "objective=reward scores one sequence per row (the classification head reads its "
                 "last token): set data.packing=false")
        _require(r.tp == 1, f"objective=reward with recipe {r.name} (recipe.tp={r.tp}): the classification head "
                 "is not in the tensor-parallel plan; use a data-parallel, ZeRO or FSDP recipe")
    _refuse_stray_fields(o, name)


ROLLOUT_ENGINES = ("hf", "vllm")


def validate_online(cfg: Any, formats: set[str]) -> None:
    """``objective=grpo`` or ``distill`` against its data, ``rollout``, ``reward`` and the recipe.

    Raises:
        ConfigError: naming the field, its value and the fix.
    """
    from llmtrain.config.schema import (GRPO_ADVANTAGE_ESTIMATORS, GRPO_IMPORTANCE_LEVELS, GRPO_LOSS_TYPES,
                                        GRPO_SAMPLING_CORRECTIONS, GRPO_SCALE_REWARDS)

    o, d, r, ro, t = cfg.objective, cfg.data, cfg.recipe, cfg.rollout, cfg.trainer
    _require(formats == {"prompts"}, f"objective={o.name} samples completions of prompts: every source's format must "
             f"be prompts (data=prompts, data.columns.prompt=COLUMN); the data has {', '.join(sorted(formats))}")
    if o.name == "distill":
        _require(bool(o.teacher), "objective=distill needs objective.teacher: a conf/model group name (e.g. "
                 "smollm2_135m) or a Hugging Face folder, with the student's tokenizer")
        _require(0 <= o.lmbda <= 1, f"objective.lmbda={o.lmbda} must be in [0, 1] (the share of batches the student "
                 "samples)")
        _require(o.num_generations >= 1, f"objective.num_generations={o.num_generations} must be >= 1")
    else:
        _require(o.num_generations >= 2, f"objective.num_generations={o.num_generations}: a group needs at least 2 "
                 "completions per prompt for a group-relative advantage")
        _require(o.loss_type in GRPO_LOSS_TYPES, f"objective.loss_type={o.loss_type!r} must be one of "
                 f"{', '.join(GRPO_LOSS_TYPES)} for objective={o.name}")
        for key, allowed in (("importance_sampling_level", GRPO_IMPORTANCE_LEVELS), ("scale_rewards", GRPO_SCALE_REWARDS),
                             ("advantage_estimator", GRPO_ADVANTAGE_ESTIMATORS),
                             ("sampling_correction", GRPO_SAMPLING_CORRECTIONS)):
            _require(o[key] in allowed, f"objective.{key}={o[key]!r} must be one of {', '.join(allowed)}")
        _require(math.isfinite(o.beta) and o.beta >= 0, f"objective.beta={o.beta} must be >= 0 (0: no reference model)")
        _require(0 < o.epsilon < 1, f"objective.epsilon={o.epsilon} must be in (0, 1)")
        _require(o.epsilon_high is None or o.epsilon_high >= o.epsilon,
                 f"objective.epsilon_high={o.epsilon_high} must be >= objective.epsilon={o.epsilon} (clip-higher)")
        _require(o.num_iterations >= 1, f"objective.num_iterations={o.num_iterations} must be >= 1")
        low = o.sampling_correction_min
        _require(o.sampling_correction_max > 0 and (low is None or 0 <= low < o.sampling_correction_max),
                 f"objective.sampling_correction_min={low} / _max={o.sampling_correction_max}: the importance weight's "
                 "bounds need 0 <= min < max (min unset: no lower bound)")
    _require(ro.max_turns >= 1, f"rollout.max_turns={ro.max_turns} must be >= 1 (model turns per episode)")
    _require(ro.max_staleness >= 0, f"rollout.max_staleness={ro.max_staleness} must be >= 0 (0: synchronous)")
    _require(not ro.async_generation or o.num_iterations == 1,
             f"rollout.async_generation=true with objective.num_iterations={o.num_iterations}: asynchronous "
             "generation trains each batch once (its correction is against the sampling policy); set "
             "objective.num_iterations=1 or rollout.async_generation=false")
    _require(o.reference in REFERENCE_KINDS, f"objective.reference={o.reference!r} must be one of "
             f"{', '.join(REFERENCE_KINDS)}")
    _require(o.reference != "adapters_disabled" or cfg.get("peft") is not None,
             "objective.reference=adapters_disabled needs +peft=lora; use objective.reference=copy for full fine-tuning")
    _require(r.pp == 1, f"objective={o.name} with recipe {r.name} (recipe.pp={r.pp}): sampling decodes a whole "
             "sequence token by token, which pipeline stages cannot do alone; use a data-parallel, ZeRO, FSDP or "
             "tensor-parallel recipe")
    _require(not d.packing, f"objective={o.name} lays out its own micro-batches of completions: set data.packing=false "
             "(rollout.packing=true packs the completions)")
    _require(ro.engine in ROLLOUT_ENGINES or ":" in str(ro.engine),
             f"rollout.engine={ro.engine!r} must be one of {', '.join(ROLLOUT_ENGINES)} or module:Class (a "
             "llmtrain.rollout.engines.RolloutEngine)")
    _require(ro.temperature > 0, f"rollout.temperature={ro.temperature} must be > 0 (the loss's log-probs are of the "
             "logits over the temperature; greedy completions would make every group's rewards equal)")
    _require(0 < ro.top_p <= 1, f"rollout.top_p={ro.top_p} must be in (0, 1]")
    _require(ro.top_k >= 0, f"rollout.top_k={ro.top_k} must be >= 0 (0: off)")
    _require(ro.max_completion_length >= 1, f"rollout.max_completion_length={ro.max_completion_length} must be >= 1")
    _require(ro.max_completion_length < d.seq_len, f"rollout.max_completion_length={ro.max_completion_length} leaves "
             f"no room for a prompt in data.seq_len={d.seq_len}; raise data.seq_len or lower the completion length")
    _require(ro.log_completions >= 0, f"rollout.log_completions={ro.log_completions} must be >= 0")
    _require(ro.generation_batch >= 1, f"rollout.generation_batch={ro.generation_batch} must be >= 1 (rows "
             "decoded together)")
    _require(ro.sync_every >= 1, f"rollout.sync_every={ro.sync_every} must be >= 1 (optimizer steps between weight "
             "syncs to the vLLM server)")
    _require(ro.vllm_servers >= 1 and ro.vllm_restarts >= 0, f"rollout.vllm_servers={ro.vllm_servers} must be >= 1 "
             f"and rollout.vllm_restarts={ro.vllm_restarts} >= 0")
    _require(ro.vllm_servers == 1 or not ro.vllm_url, f"rollout.vllm_servers={ro.vllm_servers} with rollout.vllm_url "
             "set: the URLs are the servers; list several in rollout.vllm_url, or drop it to let llmtrain start them")
    if ro.engine == "vllm" and cfg.get("peft") is not None:
        p = cfg.peft
        _require(not p.modules_to_save and not p.target_parameters, "peft.modules_to_save / peft.target_parameters "
                 "with rollout.engine=vllm: vLLM loads adapters of Linear layers only; use rollout.engine=hf or drop "
                 "them")
        _require(int(p.r) <= 512, f"peft.r={p.r} with rollout.engine=vllm: vLLM serves LoRA ranks up to 512")
    # An environment may score the episodes itself (a verifiers rubric): checked once it is built.
    _require(bool(cfg.reward.functions) or o.name == "distill" or bool(ro.environment), "reward.functions is empty: "
             "an online objective needs at least one reward function, e.g. reward.functions=[gsm8k] or "
             "reward.functions=[my_module:my_reward]")
    _require(not cfg.reward.weights or len(cfg.reward.weights) == len(cfg.reward.functions),
             f"reward.weights has {len(cfg.reward.weights)} values for {len(cfg.reward.functions)} reward.functions; "
             "give one weight per function (or none: 1 each)")
    _require(all(math.isfinite(w) for w in cfg.reward.weights), f"reward.weights={list(cfg.reward.weights)} must be "
             "finite numbers (an infinite or NaN weight makes every reward, and so every advantage, NaN or 0)")
    _require(t.eval_samples > 0 or not t.eval_every, "trainer.eval_samples=0 leaves no held-out prompts to score")


def _refuse_stray_fields(o: Any, name: str) -> None:
    """An objective field set away from its default that ``objective=name`` does not read (say
    ``objective.gamma`` under DPO) would be silently ignored: refused naming what it reads."""
    defaults = ObjectiveConfig()
    stray = [f"objective.{key}={o[key]}" for key in OBJECTIVE_FIELDS["all"] if key not in OBJECTIVE_FIELDS[name]
             and o[key] != getattr(defaults, key)]
    _require(not stray, f"{', '.join(stray)} does not apply to objective={name}, which reads "
             f"{', '.join(f'objective.{k}' for k in OBJECTIVE_FIELDS[name]) or 'no objective field'}; drop it")
