"""Typed configuration: Hydra structured-config schemas and their cross-field validation.

The schemas are dataclasses registered in Hydra's ConfigStore, so a wrong type or an unknown
key fails while Hydra composes the config, naming the key. Checks that need more than one
field (or the world size) live in :func:`validate` (one function per section, then the
:class:`~llmtrain.layout.Layout` it returns) and raise :class:`ConfigError`, whose message names
the fields, their values and the fix. They are pure: checks against the machine (installed
packages, a tracking server, an API key, files) are :mod:`llmtrain.preflight`'s.

Recipes are YAML files in the top-level ``recipes/`` folder; :func:`register_configs` stores
each one as an option of the Hydra group ``recipe``, typed by :class:`RecipeConfig`, so
``+recipe=zero3`` works whether llmtrain runs from a checkout or from an installed wheel.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from llmtrain.errors import ConfigError
from llmtrain.layout import Layout, gradient_accumulation_steps, layout  # noqa: F401  (public here too)
from llmtrain.paths import RECIPES_DIR


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
CP_STYLES = ("ulysses", "ring")
# Attention implementations the context-parallel attention replaces (it computes softmax
# attention itself; a kernel with its own masking or state cannot be swapped under it).
CP_REPLACEABLE_ATTENTION = ("sdpa", "eager")
# Tensor-parallel styles a ``model.tp_plan`` may name (applied by llmtrain.parallelize).
TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "embedding_rowwise",
             "replicated_with_grad_allreduce")
# ``tracker.backends`` names (llmtrain.tracking; metrics.jsonl is always written).
TRACKER_BACKENDS = ("wandb", "tensorboard", "mlflow")


@dataclass
class ModelConfig:
    """Which causal LM to train and where its weights and tokenizer come from.

    ``source``:
      * ``config``: random init from ``architecture`` (a ``transformers`` config as a dict; it
        must name ``model_type``). Under ZeRO-3 the model is built already partitioned.
      * ``pretrained``: ``AutoModelForCausalLM.from_pretrained(path)``; ``path`` is a local folder
        (or a hub id, which needs network access).
      * ``gguf``: a GGUF file, dequantized by ``transformers``; the file is ``path/gguf_file`` or,
        when ``gguf_package`` is set, ``gguf_file`` inside that installed Python package.
    ``tokenizer``: ``byte`` (a built-in byte-level tokenizer that needs no download) or ``model``
    (the tokenizer stored with the weights) or a path to a tokenizer folder.
    ``tp_plan``: tensor-parallel plan ``{module path: colwise|rowwise|colwise_gather_output|
    embedding_rowwise}`` with paths as in the causal LM's ``named_modules()`` (``*`` = any layer
    index, e.g. ``model.layers.*.self_attn.q_proj``) for families whose transformers config has
    none; unset (default): the model's own plan.
    ``freeze``: parameter-name patterns (``fnmatch``, e.g. ``model.embed_tokens.*``) kept frozen
    in full fine-tuning: they get no gradient and no optimizer state, and checkpoints store only
    the trainable parameters (the frozen ones come from the source again on resume).

    Mixture-of-experts models (:mod:`llmtrain.moe`): ``experts_implementation`` is
    ``transformers``' switch for the routed experts (``grouped_mm``: one grouped matmul over all
    experts; ``batched_mm``: gathered per-token weights; ``eager``: a loop over the experts that
    got tokens; unset: transformers' default, ``grouped_mm`` where it can run).
    ``router_aux_loss_coef``: weight of the load-balancing loss (Switch Transformer, Fedus et al.
    2021, eqs. 4-6) added per micro-batch; unset: the model config's ``router_aux_loss_coef``.
    ``moe_capacity_factor``: 0 = dropless; > 0 = each expert takes at most ``ceil(factor x
    tokens x k / E)`` assignments of a forward's tokens, the rest are dropped and counted.
    """

    name: str = MISSING
    source: str = "config"
    path: Optional[str] = None
    gguf_file: Optional[str] = None
    gguf_package: Optional[str] = None
    architecture: Dict[str, Any] = field(default_factory=dict)
    tokenizer: str = "model"
    attn_implementation: str = "sdpa"
    tp_plan: Optional[Any] = None  # Any: a dict override must replace, not merge into, the field
    freeze: List[str] = field(default_factory=list)
    experts_implementation: Optional[str] = None
    router_aux_loss_coef: Optional[float] = None
    moe_capacity_factor: float = 0.0


EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning through the ``peft`` library (``+peft=lora``).

    LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022, section
    4.1): each targeted Linear ``W`` (out x in) gains ``B A`` with ``A`` (r x in) and ``B``
    (out x r), scaled by ``alpha / r`` (``use_rslora``: ``alpha / sqrt(r)``, Kalajdzievski 2023).
    ``B`` starts at zero, so training starts from the base model exactly. The base weights are
    frozen: they carry no gradient and no optimizer state, and checkpoints store only the
    trainable parameters (plus a fingerprint of the base weights).

    ``target_modules``: module-name suffixes (``[q_proj, v_proj]``) or ``all-linear`` (default:
    every Linear of the decoder layers, i.e. the attention and MLP projections, not the output
    head; a mixture of experts' routers are left out, its shared experts are Linear layers).
    ``target_parameters``: parameter names (suffixes) of non-Linear weights to adapt, peft's
    ``target_parameters``: a mixture of experts' 3-D expert tensors
    (``[mlp.experts.gate_up_proj, mlp.experts.down_proj]``), one low-rank update per expert. ``modules_to_save``: modules trained in full besides the adapters (``[lm_head]`` after
    adding tokens). ``bias``: ``none``, ``all`` or ``lora_only`` biases trained.

    Selecting ``+peft=lora`` also sets ``trainer.lr`` to 2e-4, LoRA's usual rate (``conf/peft/lora.yaml``
    is a ``_global_`` package applied after the trainer group); a ``trainer.lr`` override still wins.
    """

    method: str = "lora"
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Any = "all-linear"  # a list of names or the string all-linear
    target_parameters: List[str] = field(default_factory=list)
    modules_to_save: List[str] = field(default_factory=list)
    bias: str = "none"
    use_rslora: bool = False
    use_dora: bool = False


DATA_FORMATS = ("text", "instruction", "alpaca", "chat", "prompt_completion", "tokens", "preference", "kto")
# Older spellings of a format: same records, same samples.
FORMAT_ALIASES = {"alpaca": "instruction"}


def canonical_format(fmt: str) -> str:
    """``data.format`` with aliases resolved (``alpaca`` -> ``instruction``)."""
    return FORMAT_ALIASES.get(fmt, fmt)
# Record fields each format reads; data.columns maps them to a file's own column names.
FORMAT_COLUMNS = {
    "text": ("text",),
    "instruction": ("instruction", "input", "output"),
    "chat": ("messages", "conversations"),
    "prompt_completion": ("prompt", "completion"),
    "tokens": (),
    "preference": ("prompt", "chosen", "rejected", "margin"),
    "kto": ("prompt", "completion", "label"),
}


@dataclass
class ColumnsConfig:
    """The file's column for each field a format reads (null: the field's own name), e.g.
    ``data.columns.text=content`` or ``data.columns.messages=dialog``."""

    text: Optional[str] = None
    instruction: Optional[str] = None
    input: Optional[str] = None
    output: Optional[str] = None
    messages: Optional[str] = None
    conversations: Optional[str] = None
    prompt: Optional[str] = None
    completion: Optional[str] = None
    chosen: Optional[str] = None
    rejected: Optional[str] = None
    margin: Optional[str] = None
    label: Optional[str] = None


def mapped_columns(columns: Any) -> dict[str, str]:
    """``{field: column}`` for the fields a source maps (``columns`` as config node or dict)."""
    items = columns.items() if hasattr(columns, "items") else vars(columns).items()
    return {k: v for k, v in items if v is not None}


@dataclass
class DataSourceConfig:
    """One dataset: where its records come from and how to read them (see :class:`DataConfig`)."""

    name: str = MISSING
    format: str = "text"
    path: Optional[str] = MISSING
    glob: str = "**/*.py"
    subset: Optional[str] = None
    split: str = "train"
    revision: Optional[str] = None
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    chat_layout: str = "auto"
    max_bytes: Optional[int] = None
    max_records: Optional[int] = None


@dataclass
class DataConfig(DataSourceConfig):
    """Training data, read through ``datasets``.

    Sources (``path``): a local file or folder of ``.json``/``.jsonl``/``.parquet``/``.csv``/
    ``.txt``/``.arrow`` files (``glob`` picks files in a folder), a folder written by
    ``Dataset.save_to_disk``, or a Hugging Face Hub dataset id with ``subset``, ``split`` and
    ``revision`` (needs network, or the dataset in the ``datasets`` cache). ``columns`` maps the
    fields a format reads to the file's names (``columns: {text: content}``). ``text`` with
    ``path: null`` reads the Python standard library's own source files (on every machine).

    ``format``:
      * ``text``: documents tokenized, joined with EOS and cut into blocks of ``seq_len`` tokens
        (``document_masking``: attention and positions restart at each document).
      * ``instruction`` (alias ``alpaca``): {instruction, input, output} records; the response
        and its end token are trained, the prompt is not. ``template``: ``chat``/``auto`` (the
        tokenizer's chat template when it has one), ``alpaca`` (the Stanford Alpaca prompt), or
        a named template / Jinja file as for ``chat``.
      * ``chat``: one conversation per record, OpenAI ``messages`` (role/content) or ShareGPT
        ``conversations`` (from/value), told apart by ``chat_layout`` (``auto``, ``messages``,
        ``sharegpt``). Rendered with the chat template; every assistant turn and its end-of-turn
        token are trained. ``template``: ``auto`` (the tokenizer's), ``chatml`` (a built-in
        template) or a path to a Jinja file.
      * ``prompt_completion``: {prompt, completion}; the completion and EOS are trained.
      * ``preference``: preference pairs for ``objective=dpo|simpo|orpo|reward``, TRL's layouts:
        {prompt, chosen, rejected} as strings or message lists (rendered with the chat
        template), or implicit prompts ({chosen, rejected} only; the prompt is their shared
        prefix, as in Anthropic HH-RLHF); optional ``margin`` (reward models). Each sequence
        (prompt + completion + EOS) is at most ``seq_len`` tokens: a prompt over
        ``max_prompt_tokens`` keeps its last tokens, then completions are cut from the right;
        pairs left without a completion token are dropped and counted. Loss on completions only.
      * ``kto``: unpaired examples for ``objective=kto``: {prompt, completion, label} (strings or
        message lists; ``label`` a boolean: desirable or not), TRL's unpaired layout, truncated
        as pairs are. ``objective=kto`` also reads ``preference`` pairs, each as a desirable
        (chosen) and an undesirable (rejected) example.
      * ``tokens``: a folder written by ``python -m llmtrain.prepare`` (read by block from disk).
    ``truncation``: a sample longer than ``seq_len`` is cut (``right``) or dropped (``drop``); a
    sample left without target tokens is dropped either way. ``packing``: several samples share
    one row of ``seq_len`` tokens, with positions restarting and attention kept inside each.
    Mixtures: ``datasets`` (a list of sources) with ``weights``; each global sample index draws
    its source from the weights and ``trainer.seed``.
    ``max_bytes`` caps the raw text read from plain-text files at that many bytes in all (null:
    all; the file the cap falls in is cut at a character boundary; record files are read whole
    until their sizes reach it); ``max_records`` caps records per source. A mixture's sources read
    only their own ``data.datasets.N.path`` (a top-level ``data.path`` is refused).
    ``val_fraction`` of the samples (at least one) is held out for validation, chosen by the seed.
    ``num_proc``: processes for tokenization (``datasets.map``).
    """

    name: str = MISSING
    seq_len: int = 256
    val_fraction: float = 0.05
    template: str = "auto"
    truncation: str = "right"
    packing: bool = False
    document_masking: bool = False
    shuffle: bool = True
    num_proc: int = 1
    max_prompt_tokens: Optional[int] = None
    datasets: List[DataSourceConfig] = field(default_factory=list)
    weights: List[float] = field(default_factory=list)


@dataclass
class TrainerConfig:
    """Optimisation and the loop's cadence.

    Batch sizes are in samples (sequences). ``global_batch_size`` = ``micro_batch_size`` ×
    gradient accumulation steps × data-parallel size; the accumulation steps are derived from the
    other three, so the same config gives the same global batch on any number of ranks.
    Learning rate: linear warmup over ``warmup_steps`` then cosine decay to
    ``lr * min_lr_ratio`` at ``max_steps`` (Loshchilov & Hutter, SGDR, 2017, eq. 5).
    Intervals (``eval_every``, ``save_every``, ``log_every``) are in optimizer steps; 0 = never
    (a final checkpoint and evaluation are always made); ``save_every_minutes`` adds a
    wall-clock cadence (default 30: a crash loses at most half an hour; 0 = off). ``keep_checkpoints`` newest complete checkpoints are kept.
    ``checkpoint_hash``: the completion marker's per-file checksum, ``xxh3`` (XXH3-128: detects
    corruption at memory speed) or ``sha256`` (cryptographic, slower); either way each rank
    checksums a share of the files. ``async_checkpoint`` (torch engine): a periodic save copies
    the state to host memory and writes it in the background while training goes on; the
    checkpoint counts (completion marker, rename) only once every rank's write has finished,
    which the ranks agree on in the step's own all-reduce. The final save and a preemption save
    are always synchronous.

    ``nonfinite``: what a non-finite loss or gradient norm does (checked every step on values every
    rank already shares, so no extra collective): ``stop`` (default) exits with status 3 naming the
    step, the value and the last healthy checkpoint, before anything is saved or exported from the
    bad state; ``skip`` (torch engine) drops that update (parameters and optimizer state unchanged;
    the step, its samples and the LR schedule still advance) and stops after ``max_skipped_steps``
    skipped steps in a row. ``spike_factor`` (0 = off, the default): a loss above
    ``spike_factor`` x the running mean of the healthy steps' losses (exponential moving average,
    weight 0.1 per step, checked from the 10th healthy step on, carried in checkpoints) counts as
    a bad step too and gets the same ``nonfinite`` treatment: it guards against the slow
    divergence that stays finite. Typical values 2-5; a spike at a data-distribution change is a
    false alarm, so it is off by default.

    ``resume``: ``auto`` (newest complete checkpoint of ``run_dir``, else a fresh start), ``never``
    (fresh start; refuses a ``run_dir`` that already holds checkpoints), a checkpoint folder, or a
    step number of this run. ``preempt_signal``: besides SIGTERM and SIGINT, the signal that
    asks for a save-and-exit at the next step boundary (SLURM: ``--signal=USR1@120``).
    ``peak_tflops``: one device's peak dense TFLOP/s for ``perf/mfu`` (0 = from the table of
    accelerators in :mod:`llmtrain.flops` by device name; CPUs report ``perf/tflops_per_device``
    only).

    ``eval_tasks``: lm-evaluation-harness tasks (``hh_local``, ``alpaca_local`` from ``conf/eval``,
    the YAML folders in ``eval_tasks_include``, or the harness's own) scored on the checkpoint
    of every ``eval_tasks_every`` steps (those steps are then checkpoint steps; 0 = the last step
    only), each in its own process (:mod:`llmtrain.task_eval`); training goes on meanwhile
    unless ``eval_tasks_async=false``. ``eval_tasks_limit``: documents per task (all when unset);
    ``eval_tasks_device``: where the evaluation runs (default: rank 0's device).
    """

    seed: int = 1234
    max_steps: int = 200
    global_batch_size: int = 16
    micro_batch_size: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    precision: str = "fp32"
    activation_checkpointing: bool = False
    # > 0: the output layer and loss run over this many tokens at a time, recomputed in backward,
    # so the [tokens, vocab] logits never exist whole (llmtrain.chunked_loss); 0 = plain logits.
    loss_chunk_tokens: int = 0
    # Build the layout on dry_run_world_size ranks (None: the launch's) on the fake process
    # group, print each rank's shards and exit without training (llmtrain.dry_run).
    dry_run: bool = False
    dry_run_world_size: Optional[int] = None
    eval_every: int = 50
    eval_samples: int = 64
    log_every: int = 1
    save_every: int = 0
    save_every_minutes: float = 30.0
    keep_checkpoints: int = 3
    checkpoint_hash: str = "xxh3"
    async_checkpoint: bool = False
    resume: str = "auto"
    preempt_signal: Optional[str] = "SIGUSR1"
    # Hang watchdog (llmtrain.watchdog): ranks at different steps/phases, none moving for this many seconds,
    # dump their stacks to run_dir/hang-<time>/ and exit with status 4; 0 = off (off for one process).
    hang_timeout_s: float = 300.0
    nonfinite: str = "stop"
    max_skipped_steps: int = 5
    spike_factor: float = 0.0
    export_hf: bool = True
    export_merged: bool = False
    progress_bar: bool = True
    peak_tflops: float = 0.0
    eval_tasks: List[str] = field(default_factory=list)
    eval_tasks_every: int = 0
    eval_tasks_async: bool = True
    eval_tasks_limit: Optional[float] = None
    eval_tasks_batch_size: int = 8
    eval_tasks_device: Optional[str] = None
    eval_tasks_include: List[str] = field(default_factory=list)
    eval_tasks_bootstrap_iters: int = 1000


@dataclass
class TrackerConfig:
    """Experiment tracking. ``backends``: any of ``wandb``, ``tensorboard`` (event files in
    ``run_dir/tensorboard``; needs the ``tensorboard`` package, ``pip install llmtrain[tracking]``);
    ``metrics.jsonl`` is always written. ``wandb_mode``: ``auto`` (online when an API key is
    configured, else offline), ``online``, ``offline`` or ``disabled``. ``mlflow``: a tracking
    server at ``mlflow_uri`` (``http://host:5000``) or a local store (default: a SQLite file in
    the run directory), experiment ``mlflow_experiment`` (default: ``project``). ``on_error``:
    ``raise`` (a backend that cannot start, e.g. an unreachable server, is an error before
    training) or ``warn`` (train without it). A backend failing mid-run is always dropped with a
    warning. ``report``: write ``report.png`` and ``report.md`` (:mod:`llmtrain.report`) into the
    run directory when a run ends (``python -m llmtrain.report RUN_DIR`` does it at any time)."""

    backends: List[str] = field(default_factory=lambda: ["wandb"])
    wandb_mode: str = "auto"
    mlflow_uri: Optional[str] = None
    mlflow_experiment: Optional[str] = None
    on_error: str = "raise"
    project: str = "llmtrain"
    entity: Optional[str] = None
    run_name: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    report: bool = True


@dataclass
class RecipeConfig:
    """A parallelism recipe: what to shard and how, independent of the model.

    ``engine``: ``torch`` (torch-native: DDP, FSDP2, tensor and pipeline parallel) or
    ``deepspeed``. ``zero_stage``: 0-3 as in Rajbhandari et al., "ZeRO" (SC'20), section 5:
    1 partitions optimizer state, 2 also gradients, 3 also parameters. On the torch engine
    stage 0 replicates (DDP), 1 and 2 run FSDP2 keeping parameters gathered between forward and
    backward (``reshard_after_forward=False``; FSDP2 has no optimizer-only sharding, so stage 1
    also shards gradients), 3 runs FSDP2 full shard. Offload (Ren et al., "ZeRO-Offload",
    ATC'21) moves optimizer state (stage >= 1) and parameters (stage 3) to CPU memory; FSDP2
    offloads both together (``CPUOffloadPolicy``).

    Degrees (torch engine): ``dp_replicate`` x ``dp_shard`` x ``tp`` x ``pp`` = world size, one
    of them may be -1 (= the rest). Unset data-parallel degrees follow ``zero_stage``: stage 0
    replicates over every data-parallel rank, stages 1-3 shard over them (HSDP = both set). ``tp`` shards attention heads and MLP columns (Shoeybi et
    al., "Megatron-LM", 2019, section 3); ``pp`` splits the decoder layers into stages run by
    ``pp_schedule`` (``gpipe``: Huang et al. 2019; ``1f1b``: Narayanan et al., "PipeDream-Flush",
    2021; ``interleaved_1f1b``: Narayanan et al., SC'21, section 2.2, with
    ``pp_stages_per_rank`` > 1 virtual stages per rank).
    """

    # Interpolations resolved at composition (see _register_resolvers): a top-level ``engine=``
    # shows in ``--cfg job --resolve`` exactly as the run uses it.
    name: str = "${recipe_name:default,torch}"
    engine: str = "${recipe_engine:torch}"
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    overlap_comm: bool = False
    # DeepSpeed communication sizes in elements; None = derived from the model's hidden size
    # (llmtrain.engine.deepspeed_engine.communication_sizes).
    reduce_bucket_size: Optional[int] = None
    allgather_bucket_size: Optional[int] = None
    prefetch_bucket_size: Optional[int] = None
    param_persistence_threshold: Optional[int] = None
    # ZeRO-3's memory/traffic trade-off: gathered elements kept alive, and the reuse distance
    # (in parameters) within which a gathered parameter is kept for its backward use. None =
    # DeepSpeed's 1e9: a model under ~1e9 parameters stays gathered from forward to backward
    # (2Ψ per step instead of ZeRO-3's 3Ψ, at the memory of unsharded parameters); set 0 for
    # the paper's 3Ψ with parameters sharded between uses.
    max_live_parameters: Optional[int] = None
    max_reuse_distance: Optional[int] = None
    # ZeRO-1/2 gradient reduction: false = each gradient slice is reduced to the rank that owns
    # it (the ZeRO paper's reduce-scatter volume, Ψ per step); true = DeepSpeed's default, a
    # full all-reduce of every bucket (2Ψ) then each rank keeps its slice.
    multi_rank_bucket_allreduce: bool = False
    dp_replicate: Optional[int] = None
    dp_shard: Optional[int] = None
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 1
    # Pipeline steps are right-padded to their longest micro-batch rounded up to this many tokens
    # (at most data.seq_len): fewer padded tokens vs fewer distinct shapes (one schedule each).
    pp_pad_multiple: int = 64
    # Context parallel: each sequence split over cp ranks (never derived), attention by
    # cp_style (ulysses | ring; llmtrain.context_parallel).
    cp: int = 1
    cp_style: str = "ulysses"
    # Expert parallel (mixture-of-experts models, torch engine): each MoE layer's experts split
    # over ep ranks of dp_shard, tokens dispatched and combined by all-to-all
    # (llmtrain.expert_parallel); the other dp_shard / ep ranks FSDP-shard each expert.
    ep: int = 1
    # Megatron-LM sequence parallelism inside tensor parallelism (torchtitan's default with TP):
    # norms and the residual stream sharded along the sequence between the TP blocks.
    tp_sequence_parallel: bool = False
    compile: bool = False
    # +recipe=auto: llmtrain.plan picks the recipe (and micro-batch, activation checkpointing)
    # that fits device_memory ("80GiB"; None = the device's own) less memory_margin.
    auto: bool = False
    device_memory: Optional[str] = None
    memory_margin: float = 0.1


# torch.distributed's collective timeout (llmtrain.distributed.init_distributed): a hang watchdog
# must fire before it.
PROCESS_GROUP_TIMEOUT_S = 600.0


@dataclass
class ObjectiveConfig:
    """The training objective (``objective=NAME``; :mod:`llmtrain.objectives`).

    Attributes:
        name: a built-in objective: ``causal_lm`` (next-token cross-entropy over target tokens),
            ``dpo``, ``simpo``, ``orpo`` (preference pairs, ``data.format=preference``), ``kto``
            (unpaired examples, ``data.format=kto``, or pairs) or ``reward`` (a
            sequence-classification head on pairs); or the label of ``target``.
        target: ``"module:Class"`` of your own :class:`llmtrain.objectives.Objective` subclass
            (importable on every rank); built with this section.
        beta: the preference losses' temperature: DPO's β (Rafailov et al. 2023, eq. 7; 0.1), IPO's
            τ (Azar et al. 2023, eq. 17), SimPO's β (Meng et al. 2024, eq. 6; 2.0 in
            ``objective=simpo``), ORPO's λ weighting the odds-ratio term (Hong et al. 2024, eq. 6;
            0.1, TRL's ``beta``).
        loss_type: DPO's pairwise loss: ``sigmoid`` (DPO eq. 7), ``ipo`` (IPO eq. 17 on length-
            normalised log-ratios, as TRL), ``hinge`` (SLiC-HF, Zhao et al. 2023, eq. 1) or
            ``robust`` (Chowdhury et al. 2024, eq. 6, with ``label_smoothing`` the flip rate).
        label_smoothing: ε, the assumed rate of flipped preference labels: conservative DPO
            (Mitchell 2023) under ``sigmoid`` (and SimPO), robust DPO under ``robust``; in [0, 0.5).
        gamma: SimPO's target reward margin γ (eq. 6; 1.0, the paper's γ/β = 0.5 at β = 2).
        desirable_weight, undesirable_weight: KTO's λ_D and λ_U (Ethayarajh et al. 2024, eq. 8;
            1.0 each; the paper's rule: λ_D n_D / (λ_U n_U) in [1, 4/3]).
        nll_on_prompt: ORPO's SFT term over the whole chosen sequence, prompt included (true, as
            the authors' code and TRL), or over its completion only (false).
        margin_column: reward models: subtract the record's ``margin`` column from the score
            difference (Llama 2, Touvron et al. 2023, eq. 2); needs the column in the data.
        center_coefficient: reward models: weight of the centering term (r_w + r_l)²
            (Eisenstein et al. 2023; TRL's ``center_rewards_coefficient``); 0 = off.
        reference: the frozen reference policy of ``dpo``: ``auto`` (with ``+peft=lora`` the base
            model with adapters disabled, no second copy; otherwise ``copy``), ``copy`` (a frozen
            copy of the initial weights laid out like the policy) or ``adapters_disabled``.
        precompute_reference: one pass over the training and validation pairs before step 1
            stores the reference log-probs in ``run_dir/reference_logps.safetensors`` (kept for
            resume); each step then runs one model.
    """

    name: str = "causal_lm"
    target: Optional[str] = None
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    gamma: float = 1.0
    nll_on_prompt: bool = True
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    margin_column: bool = False
    center_coefficient: float = 0.0
    reference: str = "auto"
    precompute_reference: bool = False


@dataclass
class Config:
    """The whole run: model × data × parallelism recipe, plus trainer and tracker settings."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    peft: Optional[PeftConfig] = None  # +peft=lora
    # Overrides recipe.engine: `+recipe=zero3 engine=torch` runs the ZeRO-3 recipe on FSDP2.
    engine: Optional[str] = None
    name: str = "${model.name}-${data.name}-${recipe.name}"
    run_dir: str = "runs/${name}"


def _recipe_engine(own: str, _root_: Any) -> str:
    """``recipe.engine``: the top-level ``engine=`` when given (one ZeRO recipe, either engine),
    else the recipe file's own."""
    top = _root_.get("engine") if "recipe" in _root_ else None  # alone, _root_ is the recipe itself
    return top or own


def _recipe_name(name: str, own_engine: str, _parent_: Any) -> str:
    """``recipe.name``: the file's name, with the engine appended when the recipe runs on another
    engine than its own (``zero3-torch``), so that run's default run_dir is not the other's."""
    engine = _parent_.engine
    return name if engine == own_engine else f"{name}-{engine}"


SWEEP_SUBDIR_MAX = 200  # bytes of a sweep job's folder name; file systems allow 255


def sweep_subdir(job_num: Any, overrides: str) -> str:
    """A sweep job's folder name: ``<job number>_<its overrides>`` (``3_trainer.lr=0.001``), with
    ``/`` made ``_`` (a value with a slash would nest folders) and a name longer than
    :data:`SWEEP_SUBDIR_MAX` bytes (UTF-8) cut, ending in a hash of the whole name so that it
    stays unique."""
    import hashlib

    name = f"{job_num}_{overrides}".rstrip("_").replace("/", "_")
    if len(name.encode()) > SWEEP_SUBDIR_MAX:
        digest = hashlib.sha1(name.encode()).hexdigest()[:8]
        kept = name.encode()[:SWEEP_SUBDIR_MAX - 10].decode(errors="ignore")
        name = f"{kept}..{digest}"
    return name


def _register_resolvers() -> None:
    for name, resolver in (("recipe_engine", _recipe_engine), ("recipe_name", _recipe_name),
                           ("sweep_subdir", sweep_subdir)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)


_register_resolvers()  # at import: every composition (Hydra, compose API, OmegaConf.structured) needs them


def register_configs() -> None:
    """Store the schema as ``base_config`` and every ``recipes/*.yaml`` as group ``recipe``.

    Raises:
        ConfigError: a recipe file has an unknown key or a value of the wrong type (the message
            names the file and the key).
    """
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for recipe_file in sorted(Path(RECIPES_DIR).glob("*.yaml")):
        cs.store(group="recipe", name=recipe_file.stem, node=load_recipe(recipe_file.stem))


def compose(overrides: list[str]) -> Any:
    """The run config of ``python -m llmtrain OVERRIDES``, composed in-process with Hydra's
    compose API (the same primary config, groups and recipes as the command line)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from llmtrain.paths import CONF_DIR

    register_configs()
    check_overrides(list(overrides))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return hydra_compose(config_name="config", overrides=keep_typed_strings(list(overrides)))


def _string_field(dotted_key: str) -> Optional[str]:
    """``"str"`` when ``dotted_key`` names a string field of :class:`Config` (``name``,
    ``data.path``, ``data.datasets.0.name``, ``tracker.run_name``), ``"list"`` for a list of
    strings (``tracker.tags``), else None."""
    hint = _schema_hint(dotted_key, through_containers=True)
    if hint is str:
        return "str"
    return "list" if typing.get_origin(hint) is list and typing.get_args(hint) == (str,) else None


def keep_typed_strings(overrides: list[str]) -> list[str]:
    """Overrides of string fields quoted where Hydra would read the value as something else, so
    the field keeps the characters typed.

    Hydra's override grammar reads an unquoted ``1_1_1`` as the integer 111, ``1e3`` as the float
    1000.0 and ``true`` as a boolean before OmegaConf turns them into the strings ``'111'``,
    ``'1000.0'``, ``'True'`` (Hydra issue #999): ``name=1_1_1`` would train in ``runs/111``. Such a
    value of a string field (or an element of a list of strings, or of a ``a,b`` sweep) is
    quoted as typed: ``name=1_1_1`` becomes ``name='1_1_1'``. Every other override is unchanged.

    Raises:
        ConfigError: a value of a string field that Hydra reads as a number, inside a form this
            cannot split safely (``choice(...)``, quotes or brackets inside a list); the message
            asks for quotes.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, ValueType

    def retyped(value: Any) -> bool:
        return isinstance(value, (bool, int, float))

    def refuse(arg: str, key: str, values: list) -> None:
        example = next(str(v) for v in values if retyped(v))
        raise ConfigError(f"{arg}: {key} takes strings, but Hydra reads unquoted values such as 1_1 or 1e3 as numbers "
                          f"(here one becomes {example}); quote each string value, e.g. {key}='1_1' (in a shell, "
                          f"wrap the whole override in double quotes: \"{key}='1_1'\")")

    def quoted_pieces(arg: str, key: str, text: str, values: list) -> str:
        pieces = [p.strip() for p in text.split(",")]
        if len(pieces) != len(values) or any(c in text for c in "'\"[]{}()$\\"):
            refuse(arg, key, values)
        return ",".join(f"'{p}'" if retyped(v) else p for p, v in zip(pieces, values))

    parser = OverridesParser.create()
    kept = []
    for arg in overrides:
        match = re.fullmatch(r"(\+{0,2})([A-Za-z_][\w.-]*)=(.*)", arg, re.S)
        kind = _string_field(match.group(2)) if match else None
        if kind is None:
            kept.append(arg)
            continue
        prefix, key, text = match.group(1), match.group(2), match.group(3).strip()
        try:
            override = parser.parse_override(arg)
        except Exception:  # noqa: BLE001  (malformed: Hydra reports it while composing)
            kept.append(arg)
            continue
        value = override.value()
        if override.value_type == ValueType.ELEMENT and retyped(value):
            arg = f"{prefix}{key}='{text}'"
        elif kind == "list" and override.value_type == ValueType.ELEMENT and isinstance(value, list) \
                and any(map(retyped, value)):
            if not (text.startswith("[") and text.endswith("]")):
                refuse(arg, key, value)
            arg = f"{prefix}{key}=[{quoted_pieces(arg, key, text[1:-1], value)}]"
        elif isinstance(value, ChoiceSweep) and any(map(retyped, value.list)):
            if override.value_type != ValueType.SIMPLE_CHOICE_SWEEP:  # choice(...): refused, not parsed here
                refuse(arg, key, value.list)
            arg = f"{prefix}{key}={quoted_pieces(arg, key, text, value.list)}"
        kept.append(arg)
    return kept


def load_recipe(name: str) -> Any:
    """The ``recipe`` node of ``recipes/<name>.yaml`` over the :class:`RecipeConfig` schema, as
    ``+recipe=<name>`` composes it: its engine and name are interpolations that honour a
    top-level ``engine=``.

    Raises:
        ConfigError: no such recipe, or the file has an unknown key or a value of the wrong type
            (the message names the file and the key).
    """
    from omegaconf.errors import OmegaConfBaseException

    recipe_file = Path(RECIPES_DIR) / f"{name}.yaml"
    if not recipe_file.is_file():
        known = ", ".join(sorted(p.stem for p in Path(RECIPES_DIR).glob("*.yaml")))
        raise ConfigError(f"no recipe {name!r} in {RECIPES_DIR}; the recipes are {known}")
    try:
        node = OmegaConf.merge(OmegaConf.structured(RecipeConfig), OmegaConf.load(recipe_file))
    except OmegaConfBaseException as err:
        raise ConfigError(f"recipe file {recipe_file}: {err}".replace("\n", " ")) from err
    engine = OmegaConf.to_container(node, resolve=True)["engine"]
    node.engine = f"${{recipe_engine:{engine}}}"
    node.name = f"${{recipe_name:{node._get_node('name')._value()},{engine}}}"
    return node


def is_schema_key(dotted_key: str) -> bool:
    """Whether ``dotted_key`` (``trainer.lr``) names a field of :class:`Config`, or lies inside a
    field that is not a dataclass (``model.architecture.rope_theta``: free-form mappings take any
    key). The same notion of the schema as :func:`check_known_keys`, for plain dicts."""
    return _schema_hint(dotted_key, through_containers=False) is not _NOT_IN_SCHEMA


_NOT_IN_SCHEMA = object()
_FREE_FORM = object()


def _schema_hint(dotted_key: str, through_containers: bool) -> Any:
    """The type hint of the :class:`Config` field ``dotted_key`` names; :data:`_FREE_FORM` when
    the key lies inside a field that is not a dataclass, :data:`_NOT_IN_SCHEMA` when a part is
    no field. ``through_containers``: also step through ``Optional[X]`` and list indexes
    (``data.datasets.0.name``) and return the bare hint; otherwise such a field counts as
    free-form (as :func:`check_known_keys` sees plain dicts)."""
    return _walk_schema(dotted_key, through_containers)[0]


def _walk_schema(dotted_key: str, through_containers: bool) -> tuple[Any, int, list[str]]:
    """:func:`_schema_hint`'s walk: ``(hint, depth, fields)``, where for :data:`_NOT_IN_SCHEMA`
    ``depth`` is the index of the first part that is no field and ``fields`` are the fields of
    the node that lacks it (for the error naming the closest); otherwise ``(hint, -1, [])``."""
    def bare(hint: Any) -> Any:  # Optional[X] -> X
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint

    schema: Any = Config
    for depth, part in enumerate(dotted_key.split(".")):
        if through_containers:
            schema = bare(schema)
            if typing.get_origin(schema) is list and part.isdigit():
                schema = typing.get_args(schema)[0]
                continue
        if not dataclasses.is_dataclass(schema):
            return _FREE_FORM, -1, []
        hints = typing.get_type_hints(schema)
        if part not in hints:
            return _NOT_IN_SCHEMA, depth, list(hints)
        schema = hints[part]
    return (bare(schema) if through_containers else schema), -1, []


_NO_DEFAULT = object()


def schema_default(dotted_key: str) -> Any:
    """The schema's default of ``dotted_key`` (``data.packing`` -> False), as plain data; a
    sentinel when the key has no default of its own (inside a free-form mapping or a list)."""
    node: Any = OmegaConf.structured(Config)
    for part in dotted_key.split("."):
        if not OmegaConf.is_dict(node) or node._is_none() or part not in node or OmegaConf.get_type(node) is dict:
            return _NO_DEFAULT  # free-form, or an optional group left out (peft: None)
        node = node._get_node(part)
        if OmegaConf.is_config(node):
            continue
        if node._is_missing():
            return _NO_DEFAULT
        node = node._value()
    return OmegaConf.to_container(node) if OmegaConf.is_config(node) else node


def added_at_default(dotted_key: str, value: Any) -> bool:
    """Whether ``dotted_key`` = ``value`` is a field at its schema default (used when a checkpoint
    predates the field: the default reproduces what that run did)."""
    default = schema_default(dotted_key)
    return default is not _NO_DEFAULT and default == value


def check_known_keys(node: Any, prefix: str = "") -> None:
    """Refuse keys that are not fields of the typed schema, however they were added.

    Hydra's struct mode already rejects ``trainer.max_step=10``, but ``+key=value``, ``++key=value``
    and a config file merged with ``+`` open the node and add the key, which would then be
    stored in ``config.yaml`` and silently ignored. Free-form mappings (``model.architecture``,
    ``model.tp_plan``) are not checked: they are passed on to ``transformers``.

    Raises:
        ConfigError: naming the unknown key and the closest field.
    """
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    fields = [f.name for f in dataclasses.fields(schema)]
    for key in node.keys():
        path = f"{prefix}{key}"
        if key not in fields:
            raise _unknown_key(path, prefix, fields)
        if OmegaConf.is_config(node._get_node(key)):
            check_known_keys(node[key], f"{path}.")


def _unknown_key(path: str, prefix: str, fields: list[str]) -> ConfigError:
    """The error for ``path``, not a field of the schema node at ``prefix`` (``trainer.``), with
    the closest of ``fields``."""
    key = path[len(prefix):]
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.5)
    owner = f"a field of {prefix.rstrip('.')}" if prefix else "a top-level field"
    hint = f"did you mean {prefix}{close[0]}?" if close else f"the fields are {', '.join(fields)}."
    return ConfigError(f"{path} is not {owner}: {hint} Fix or remove it "
                       "(`python -m llmtrain --help` lists the groups and fields)")


def config_groups() -> dict[str, list[str]]:
    """Every config group and its options: the folders of ``conf/`` and ``recipe`` (the files of
    ``recipes/``), e.g. ``{"data": ["alpaca", "chat", ...], "recipe": ["3d", "auto", ...]}``."""
    from llmtrain.paths import CONF_DIR

    groups = {d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in Path(CONF_DIR).iterdir() if d.is_dir()}
    groups["recipe"] = sorted(f.stem for f in Path(RECIPES_DIR).glob("*.yaml"))
    return groups


def check_overrides(args: list[str]) -> None:
    """Check command-line overrides against the schema and the config groups before Hydra
    composes, so that a misspelt field (``trainer.max_step=10``, ``data.colums.text=content``)
    or option (``data=alpacca``, ``+recipe=zero4``) gets one line naming the closest one, as
    :func:`check_known_keys` gives for ``+key=value``, instead of Hydra's composition error and
    its advice to append with ``+``. Hydra's own flags (``--cfg job``), ``hydra.*`` and
    ``hydra/...`` overrides, deletions (``~key``) and keys inside free-form mappings
    (``model.architecture.*``) pass through; malformed overrides are left to Hydra's parser.

    Raises:
        ConfigError: naming the override and the closest field or option.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    parser = OverridesParser.create()
    overrides = []
    for arg in args:
        if arg.startswith("-") or "=" not in arg or arg.startswith("~"):
            continue
        try:
            overrides.append((arg, parser.parse_override(arg)))
        except Exception:  # noqa: BLE001  (malformed: Hydra's parser reports it, with its grammar)
            continue
    groups = config_groups()
    if any(a in ("--config-dir", "-cd") or a.startswith("--config-dir=") for a in args):
        groups = {}  # options from a folder of the user's: Hydra names what it cannot find
    for _, override in overrides:  # hydra.searchpath=[file://DIR]: DIR's groups add options
        if override.key_or_group != "hydra.searchpath":
            continue
        entries = override.value() or []
        for entry in entries if isinstance(entries, list) else [entries]:
            if not str(entry).startswith("file://"):
                groups = {}  # pkg:// and the like: not read here
                break
            for folder in Path(str(entry)[len("file://"):]).glob("*/"):
                groups[folder.name] = sorted(set(groups.get(folder.name, [])) | {f.stem for f in folder.glob("*.yaml")})
    selected = set()
    for arg, override in overrides:
        key = override.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")) or override.package is not None:
            continue
        if key in groups:
            selected.add(key)
            value = override.value()
            if not isinstance(value, (str, ChoiceSweep)) or (isinstance(value, ChoiceSweep) and
                                                            not all(isinstance(v, str) for v in value.list)):
                continue  # glob(...), range(...), null: Hydra expands or refuses them
            chosen = value.list if isinstance(value, ChoiceSweep) else [value]
            for option in chosen:
                if option is not None and str(option) not in groups[key]:
                    close = difflib.get_close_matches(str(option), groups[key], n=1, cutoff=0.5)
                    hint = f"did you mean {close[0]}? " if close else ""
                    raise ConfigError(f"{arg}: {option!r} is not an option of group {key}: {hint}the options are "
                                      f"{', '.join(groups[key])} (`python -m llmtrain --help` lists every group)")
            continue
        # Through Optional and list elements (data.datasets.0.path); keys inside a free-form
        # mapping (model.architecture.*) are the user's.
        hint, depth, fields = _walk_schema(key, through_containers=True)
        if hint is _NOT_IN_SCHEMA:
            parts = key.split(".")
            prefix = ".".join(parts[:depth])
            raise _unknown_key(".".join(parts[:depth + 1]), f"{prefix}." if prefix else "", fields)
    for arg, override in overrides:
        if override.key_or_group.startswith("peft.") and "peft" not in selected:
            raise ConfigError(f"{arg}: no peft method is selected; add +peft=lora (the fields are those of "
                              "conf/peft/lora.yaml)")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


NAMED_TEMPLATES = ("chatml",)


def _validate_source(src: Any, key: str) -> None:
    """Checks of one source (``key`` = ``data`` or ``data.datasets.N``); see :func:`validate_data`."""
    _require(not OmegaConf.is_missing(src, "path"),
             f"{key}.path must be set for data={src.name}: add {key}.path=/path/to/your/{src.name} file or folder")
    _require(src.format in DATA_FORMATS, f"{key}.format={src.format!r} must be one of {', '.join(DATA_FORMATS)}")
    _require(src.path is not None or src.format == "text",
             f"{key}.path must name a file, folder or Hub dataset id when {key}.format={src.format} "
             "(only format=text has a built-in default)")
    _require(src.chat_layout in ("auto", "messages", "sharegpt"),
             f"{key}.chat_layout={src.chat_layout!r} must be auto, messages or sharegpt")
    kind = canonical_format(src.format)
    unknown = sorted(set(mapped_columns(src.columns)) - set(FORMAT_COLUMNS[kind]))
    _require(not unknown, f"{key}.columns: {unknown} are not fields of format {src.format}; it reads "
             f"{', '.join(FORMAT_COLUMNS[kind]) or 'no columns'} (map them as {key}.columns.FIELD=your_column)")


def validate_data(d: Any) -> None:
    """Checks of the ``data`` node (one source or a mixture) that need no file access (a Jinja
    ``data.template`` file is looked for by :func:`llmtrain.preflight.preflight_data`).

    Raises:
        ConfigError: naming the field (``data.datasets.1.path``), its value and the fix.
    """
    if d.datasets:
        _require(len(d.weights) == len(d.datasets),
                 f"data.weights has {len(d.weights)} value(s) for {len(d.datasets)} data.datasets; give one weight "
                 "per dataset")
        _require(all(math.isfinite(w) and w >= 0 for w in d.weights) and sum(d.weights) > 0,
                 f"data.weights={list(d.weights)} must be finite and >= 0 with a positive sum")
        names = [src.name for src in d.datasets]
        _require(len(set(names)) == len(names), f"data.datasets names {names} must be distinct (they name the "
                 "per-source counts data/source/<name>_samples)")
        _require(OmegaConf.is_missing(d, "path") or d.path is None,
                 f"data.path={d.path} is set, but data.datasets lists a mixture ({', '.join(names)}), whose sources "
                 f"read only their own paths, so data.path would be ignored; give each source's instead "
                 f"({', '.join(f'data.datasets.{i}.path=...' for i in range(len(names)))}), or drop data.datasets "
                 "(another data= option) to train on data.path alone")
        for i, src in enumerate(d.datasets):
            _validate_source(src, f"data.datasets.{i}")
    else:
        _require(not d.weights, "data.weights is set but data.datasets is empty; list the mixture's datasets")
        _validate_source(d, "data")
    formats = {src.format for src in d.datasets} if d.datasets else {d.format}
    template = str(d.template)
    _require(template in ("auto", "chat", "alpaca") + NAMED_TEMPLATES or template.endswith((".jinja", ".j2")),
             f"data.template={template!r} must be auto, chat, alpaca, {', '.join(NAMED_TEMPLATES)} or a Jinja file "
             "(*.jinja)")
    _require(d.truncation in ("right", "drop"), f"data.truncation={d.truncation!r} must be right or drop")
    _require(not (d.packing and formats & {"text", "tokens"}),
             "data.packing=true packs variable-length samples (instruction, chat, prompt_completion); text and "
             "tokens are already cut into full blocks: use data.document_masking=true to keep attention inside "
             "each document")
    _require(not (d.document_masking and formats - {"text", "tokens"}),
             f"data.document_masking=true applies to format text/tokens (got {', '.join(sorted(formats))}); "
             "use data.packing=true for the other formats")
    _require(d.seq_len >= 2, f"data.seq_len={d.seq_len} must be at least 2")
    if d.max_prompt_tokens is not None:
        _require(formats <= {"preference", "kto"}, f"data.max_prompt_tokens={d.max_prompt_tokens} applies to "
                 f"preference data (format preference or kto), not {', '.join(sorted(formats))}; drop it")
        _require(0 < d.max_prompt_tokens < d.seq_len, f"data.max_prompt_tokens={d.max_prompt_tokens} must be > 0 and "
                 f"< data.seq_len={d.seq_len} (room for the completion); lower it or raise data.seq_len")
    _require(0.0 < d.val_fraction < 1.0, f"data.val_fraction={d.val_fraction} must be in (0, 1)")
    _require(d.num_proc >= 1, f"data.num_proc={d.num_proc} must be >= 1")


def validate_peft(p: Any, r: Any) -> None:
    """The ``peft`` group's values, and the recipes it runs on.

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
    _require(not p.use_dora, "peft.use_dora=true is not supported yet: DoRA's magnitude vector is initialised "
             "from the base weights, which FSDP2 and ZeRO-3 do not hold whole at build; use LoRA (use_dora=false)")
    _require(r.tp == 1 and r.pp == 1,
             f"+peft=lora with recipe {r.name} (recipe.tp={r.tp}, recipe.pp={r.pp}): LoRA runs on the data-parallel "
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
             f"model.freeze={list(m.freeze)} must be a list of parameter-name patterns (e.g. [model.embed_tokens.*])")


# The config keys that count an MoE model's routed experts (transformers' names by family).
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def declared_experts(architecture: Any) -> int:
    """Routed experts per layer ``architecture`` (``model.architecture``) declares; 0 for a
    dense model (:func:`llmtrain.moe.num_experts_of` reads a ``transformers`` config)."""
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
    _require(bool(t.eval_tasks) or (not t.eval_tasks_every and not t.eval_tasks_include),
             f"trainer.eval_tasks_every={t.eval_tasks_every} / eval_tasks_include={list(t.eval_tasks_include)} "
             "without trainer.eval_tasks: name the tasks, e.g. trainer.eval_tasks=[hh_local]")


def validate_trainer(t: Any, r: Any) -> None:
    """The ``trainer`` node, and the trainer features the recipe's engine lacks
    (``nonfinite=skip`` and ``async_checkpoint`` need ``engine=torch``). The batch sizes'
    divisibility is :func:`llmtrain.layout.layout`'s.

    Raises:
        ConfigError: naming the field, its value and the fix.
    """
    for key in ("max_steps", "global_batch_size", "micro_batch_size"):
        _require(t[key] >= 1, f"trainer.{key}={t[key]} must be >= 1")
    for key in ("warmup_steps", "eval_every", "log_every", "save_every", "eval_samples"):
        _require(t[key] >= 0, f"trainer.{key}={t[key]} must be >= 0")
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
    _require(t.peak_tflops >= 0, f"trainer.peak_tflops={t.peak_tflops} must be >= 0 (0 = from the device name)")
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
    _require(t.precision in ("fp32", "bf16"), f"trainer.precision={t.precision!r} must be fp32 or bf16")


def validate_tracker(tr: Any) -> None:
    """The ``tracker`` node's values. Whether its backends can start on this machine (packages,
    server, API key) is :func:`llmtrain.preflight.preflight_tracker`'s.

    Raises:
        ConfigError: naming the field, its value and the allowed values.
    """
    unknown = [b for b in tr.backends if b not in TRACKER_BACKENDS]
    _require(not unknown, f"tracker.backends: {unknown} are not backends; choose from {list(TRACKER_BACKENDS)} "
                          "(metrics.jsonl is always written)")
    _require(len(set(tr.backends)) == len(tr.backends), f"tracker.backends={list(tr.backends)} names a backend twice")
    _require(tr.on_error in ("raise", "warn"), f"tracker.on_error={tr.on_error!r} must be raise or warn")
    _require(tr.wandb_mode in ("auto", "online", "offline", "disabled"),
             f"tracker.wandb_mode={tr.wandb_mode!r} must be auto, online, offline or disabled")


def validate_recipe(r: Any, engine: Optional[str] = None) -> None:
    """The ``recipe`` node (and the top-level ``engine`` override): engine, ZeRO stage and
    offload, what each engine supports, the pipeline schedule and the memory budget of
    ``+recipe=auto``. The degrees against the world size are :func:`llmtrain.layout.layout`'s.

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
        _require(not degrees and not r.compile,
                 f"{', '.join(f'recipe.{k}={v}' for k, v in degrees.items()) or 'recipe.compile'}"
                 " needs engine=torch (the DeepSpeed engine shards over every rank with ZeRO and has no "
                 "tensor or pipeline parallelism here)")
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
    servers or files are looked at (that is :func:`llmtrain.preflight.preflight`'s, which a run
    calls after this), so the planner can validate layouts for any machine.

    Args:
        cfg: the composed :class:`Config` (an OmegaConf DictConfig).
        world_size: number of processes of the launch.

    Returns:
        The run's :class:`~llmtrain.layout.Layout` on ``world_size`` ranks: parallel degrees and
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
        validate_peft(cfg.peft, cfg.recipe)
    validate_recipe(cfg.recipe, cfg.get("engine"))
    validate_objective(cfg)
    validate_context_parallel(cfg)
    validate_sequence_parallel(cfg.recipe)
    validate_chunked_loss(cfg)
    validate_expert_parallel(cfg.recipe)
    objective = cfg.objective.get("target") or cfg.objective.get("name") or "causal_lm"
    _require(not cfg.model.moe_capacity_factor or objective not in PREFERENCE_OBJECTIVES,
             f"model.moe_capacity_factor={cfg.model.moe_capacity_factor} with objective={objective}: a pair's chosen row "
             "comes first and would take expert capacity before its rejected row, and the reference runs dropless; "
             "set model.moe_capacity_factor=0 for preference tuning")
    p = cfg.get("peft")
    _require(p is None or not p.get("target_parameters") or cfg.recipe.ep == 1,
             f"peft.target_parameters={list(p.target_parameters) if p is not None else []} with recipe.ep={cfg.recipe.ep}: "
             "adapters on expert tensors are not sharded over an ep group; use recipe.ep=1 (fsdp shards them), "
             "or adapt attention only (peft.target_parameters=[])")
    return layout(cfg, world_size)


def validate_expert_parallel(r: Any) -> None:
    """``recipe.ep`` against the recipe (what it needs of the model is checked with the model's
    config, :func:`llmtrain.moe.check_model`; that it divides dp_shard, by the layout).

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
CHUNKABLE_OBJECTIVES = ("causal_lm", "dpo", "simpo", "kto")


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
OBJECTIVE_FIELDS = {
    "all": ("beta", "loss_type", "label_smoothing", "gamma", "nll_on_prompt", "desirable_weight", "undesirable_weight",
            "margin_column", "center_coefficient", "reference", "precompute_reference"),
    "causal_lm": (),
    "dpo": ("beta", "loss_type", "label_smoothing", "reference", "precompute_reference"),
    "simpo": ("beta", "gamma", "label_smoothing"),
    "orpo": ("beta", "nll_on_prompt"),
    "kto": ("beta", "desirable_weight", "undesirable_weight", "reference"),
    "reward": ("margin_column", "center_coefficient"),
}
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
REFERENCE_KINDS = ("auto", "copy", "adapters_disabled")


def validate_objective(cfg: Any) -> None:
    """The ``objective`` node against the data, the recipe and ``peft``.

    Raises:
        ConfigError: naming the field, its value and the fix.
    """
    o, d, r = cfg.objective, cfg.data, cfg.recipe
    formats = {canonical_format(src.format) for src in d.datasets} if d.datasets else {canonical_format(d.format)}
    if o.target:
        return
    name = o.name
    _require(name == "causal_lm" or name in PREFERENCE_OBJECTIVES,
             f"objective.name={name!r} is not a built-in objective (choose causal_lm, {', '.join(PREFERENCE_OBJECTIVES)}"
             ", or set objective.target=module:Class)")
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


def _refuse_stray_fields(o: Any, name: str) -> None:
    """An objective field set away from its default that ``objective=name`` does not read (say
    ``objective.gamma`` under DPO) would be silently ignored: refused naming what it reads."""
    defaults = ObjectiveConfig()
    stray = [f"objective.{key}={o[key]}" for key in OBJECTIVE_FIELDS["all"] if key not in OBJECTIVE_FIELDS[name]
             and o[key] != getattr(defaults, key)]
    _require(not stray, f"{', '.join(stray)} does not apply to objective={name}, which reads "
             f"{', '.join(f'objective.{k}' for k in OBJECTIVE_FIELDS[name]) or 'no objective field'}; drop it")
