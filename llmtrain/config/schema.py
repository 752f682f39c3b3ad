"""The typed schema of a run's config: dataclasses registered in Hydra's ConfigStore (by
:func:`llmtrain.config.compose.register_configs`), so a wrong type or an unknown key fails while
Hydra composes, naming the key; the names each field may take; and the resolvers its
interpolations use (``recipe.engine``, ``recipe.name``, a sweep job's folder name).

Imports nothing of llmtrain: the cross-field checks are :mod:`llmtrain.config.validate`'s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

# The interpolations' resolvers (their names importable from here too), registered at import:
# every composition (Hydra, compose API, OmegaConf.structured) needs them.
from llmtrain.config.resolvers import (ONLINE_OBJECTIVES, SWEEP_SUBDIR_MAX, held_out_samples,  # noqa: F401
                                       register_resolvers, sweep_subdir)

register_resolvers()

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
CP_STYLES = ("ulysses", "ring")
# Attention implementations the context-parallel attention replaces (it computes softmax
# attention itself; a kernel with its own masking or state cannot be swapped under it).
CP_REPLACEABLE_ATTENTION = ("sdpa", "eager")
# Tensor-parallel styles a ``model.tp_plan`` may name (applied by llmtrain.parallel.parallelize).
TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "embedding_rowwise",
             "replicated_with_grad_allreduce")
# ``tracker.backends`` names (llmtrain.monitoring.tracking; metrics.jsonl is always written).
TRACKER_BACKENDS = ("wandb", "tensorboard", "mlflow")
WANDB_MODES = ("auto", "online", "offline", "disabled")  # tracker.wandb_mode


@dataclass
class LrMultipliersConfig:
    """``model.lr_multipliers``: a multiplier of ``trainer.lr`` per part (unset: 1)."""

    vision: Optional[float] = None
    projector: Optional[float] = None
    language: Optional[float] = None
    lm_head: Optional[float] = None


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
    the trainable parameters (the frozen ones come from the source again on resume). A bare word
    names a part (:mod:`llmtrain.models.parts`: ``vision``, ``projector``, ``language``,
    ``lm_head``); ``[vision, language]`` is LLaVA's stage 1. ``lr_multipliers``: ``{part: m}``
    trains a part at ``m`` times ``trainer.lr`` (optimizer groups of its own).

    Mixture-of-experts models (:mod:`llmtrain.models.moe`): ``experts_implementation`` is
    ``transformers``' switch for the routed experts (``grouped_mm``: one grouped matmul over all
    experts; ``batched_mm``: gathered per-token weights; ``eager``: a loop over the experts that
    got tokens; unset: transformers' default, ``grouped_mm`` where it can run).
    ``router_aux_loss_coef``: weight of the load-balancing loss (Switch Transformer, Fedus et al.
    2021, eqs. 4-6) added per micro-batch; unset: the model config's ``router_aux_loss_coef``.
    ``moe_capacity_factor``: 0 = dropless; > 0 = each expert takes at most ``ceil(factor x
    tokens x k / E)`` assignments of a forward's tokens, the rest are dropped and counted.
    ``quantize``: ``none``, or ``nf4``: the frozen base's Linear layers stored as 4-bit
    NormalFloat with double-quantized scales (QLoRA; :mod:`llmtrain.models.quantize`), the head
    and embeddings kept; needs ``+peft=lora`` (``+peft=qlora`` sets both).
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
    lr_multipliers: LrMultipliersConfig = field(default_factory=lambda: LrMultipliersConfig())
    experts_implementation: Optional[str] = None
    router_aux_loss_coef: Optional[float] = None
    moe_capacity_factor: float = 0.0
    quantize: str = "none"
    # An image-text model built from config: its processor's settings (image_processor: the image
    # processor's; the rest: the processor's own, e.g. image_seq_len), llmtrain.models.vision.
    processor: Dict[str, Any] = field(default_factory=dict)


EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")
QUANTIZATIONS = ("none", "nf4")  # model.quantize (llmtrain.models.quantize)


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

    ``parts``: the parts (:mod:`llmtrain.models.parts`) whose Linear layers ``target_modules``
    reaches: ``[language]`` (an image-text model's decoder only); ``vision``, ``projector`` on demand.

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
    parts: List[str] = field(default_factory=lambda: ["language"])


PEFT_PARTS = ("vision", "projector", "language")  # peft.parts: parts with Linear layers to adapt


# The data group, in its own module (schema_data.py); its names importable from here.
from llmtrain.config.schema_data import (  # noqa: F401
    ColumnsConfig,
    DATA_FORMATS,
    DataConfig,
    DataSourceConfig,
    FORMAT_ALIASES,
    FORMAT_COLUMNS,
    canonical_format,
    mapped_columns,
)


# trainer.optimizer's choices (built by llmtrain.engine.optimizers.build_optimizer).
OPTIMIZERS = ("adamw", "adamw_8bit", "adafactor", "muon")
PRECISIONS = ("auto", "fp32", "bf16")  # trainer.precision (auto: llmtrain.common.hardware.resolve_precision)


@dataclass
class MuonConfig:
    """``trainer.optimizer=muon`` (:class:`llmtrain.engine.optimizers.MuonWithAdamW`): Muon on the
    hidden 2-D matrices, AdamW (``trainer.lr``, betas, eps) on embeddings, head, norms and biases.
    ``lr``: Muon's learning rate (None: ``trainer.lr``); ``adjust_lr``: how it scales per matrix
    shape, ``match_rms_adamw`` (0.2·√max(rows, cols): an AdamW-tuned lr and weight decay carry
    over; Liu et al. 2025, §2.2) or ``original`` (√max(1, rows/cols), Jordan et al. 2024);
    ``momentum``, ``nesterov``, ``ns_steps``: torch.optim.Muon's."""

    lr: Optional[float] = None
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr: str = "match_rms_adamw"


@dataclass
class AdafactorConfig:
    """``trainer.optimizer=adafactor`` (``torch.optim.Adafactor``; Shazeer & Stern 2018):
    ``beta2_decay`` (the second moment's decay 1 - t^beta2_decay), ``eps1`` (None: the dtype's
    eps) added to the squared gradient, ``eps2`` the floor of the parameter scale."""

    beta2_decay: float = -0.8
    eps1: Optional[float] = None
    eps2: float = 1e-3


@dataclass
class TrainerConfig:
    """Optimisation and the loop's cadence.

    Batch sizes are in samples (sequences). ``global_batch_size`` = ``micro_batch_size`` ×
    gradient accumulation steps × data-parallel size; the accumulation steps are derived from the
    other three, so the same config gives the same global batch on any number of ranks.
    Learning rate: linear warmup over ``warmup_steps`` then cosine decay to
    ``lr * min_lr_ratio`` at ``max_steps`` (Loshchilov & Hutter, SGDR, 2017, eq. 5).
    Intervals (``eval_every``, ``save_every``, ``log_every``) are in optimizer steps; 0 = never
    (a final checkpoint and evaluation are always made); a fresh run evaluates at step 0 too,
    unless ``eval_every=0``; ``save_every_minutes`` adds a
    wall-clock cadence (default 30: a crash loses at most half an hour; 0 = off). ``keep_checkpoints`` newest complete checkpoints are kept.
    ``gc_every``: Python's garbage collector runs a full collection every that many steps, at the
    same step on every rank, with the automatic collector off and set-up's objects frozen out of
    it (:mod:`llmtrain.common.collection`); 0 = Python's automatic collector.
    ``malloc_mmap_threshold``: glibc's mmap threshold in bytes, fixed at start-up, so freed
    tensors above it go back to the system instead of staying in the heap
    (:mod:`llmtrain.common.allocator`); 0 = glibc's default (dynamic, up to 32 MiB).
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
    ``peak_tflops``: one device's peak dense TFLOP/s (10^12 FLOP/s) at the run's precision, the
    denominator of ``perf/mfu``; 0 = the data sheet of the device (the table in
    :mod:`llmtrain.planning.flops`, by device name), else measured by a matmul probe on this
    machine (CPUs, unknown GPUs; once per machine, cached in ``LLMTRAIN_CACHE/peak_flops.json``).

    ``eval_tasks``: lm-evaluation-harness tasks (``hh_local``, ``alpaca_local``, shipped in ``llmtrain/evaluation/tasks``,
    the YAML folders in ``eval_tasks_include``, or the harness's own) scored on the checkpoint
    of every ``eval_tasks_every`` steps (those steps are then checkpoint steps; 0 = the last step
    only), each in its own process (:mod:`llmtrain.evaluation.in_loop`); training goes on meanwhile
    unless ``eval_tasks_async=false``. ``eval_tasks_limit``: documents per task (all when unset);
    ``eval_tasks_device``: where the evaluation runs (default: rank 0's device).
    ``eval_tasks_data_dir``: the folder of the local tasks' data files (default: ``$LLMTRAIN_DATA_DIR``,
    then the working directory; :mod:`llmtrain.evaluation.local_tasks`).
    """

    seed: int = 1234
    max_steps: int = 200
    global_batch_size: int = 16
    micro_batch_size: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    # adamw | adafactor | muon (llmtrain.engine.optimizers); their own fields in trainer.muon / trainer.adafactor.
    optimizer: str = "adamw"
    muon: MuonConfig = field(default_factory=MuonConfig)
    adafactor: AdafactorConfig = field(default_factory=AdafactorConfig)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    # auto: bf16 mixed precision where bf16 matmuls are native (CUDA >= 8.0, CPUs with AMX or
    # AVX512-BF16; llmtrain.common.hardware), else fp32; fp32 / bf16 force one.
    precision: str = "auto"
    activation_checkpointing: bool = False
    # > 0: the output layer and loss run over this many tokens at a time, recomputed in backward,
    # so the [tokens, vocab] logits never exist whole (llmtrain.models.chunked_loss); 0 = plain logits.
    loss_chunk_tokens: int = 0
    # The output layer runs only at positions that carry a label (not at prompt, padding or
    # row-end positions), for objectives that read next-label log-probs only (causal_lm, dpo,
    # simpo, kto), without pipeline stages, on model types whose forward leaves the logits as
    # they are (llmtrain.models.chunked_loss.LabelHead). Off: whole logits, as Hugging Face computes.
    logits_at_labels_only: bool = True
    # Build the layout on dry_run_world_size ranks (None: the launch's) on the fake process
    # group, print each rank's shards and exit without training (llmtrain.planning.dry_run).
    dry_run: bool = False
    dry_run_world_size: Optional[int] = None
    eval_every: int = 50
    # Held-out samples (an online objective: prompts, one greedy completion each, decoded one at
    # a time); by default 64, or for an online objective (grpo, distill) twice the step's prompts
    # (at most 64), so an evaluation costs about two steps' sampling, not minutes before step 1
    # on a CPU (64 prompts x 256 tokens: 20 min of SmolLM2 on 2 cores). :func:`held_out_samples`.
    eval_samples: int = "${held_out_samples:${objective.name},${trainer.global_batch_size}}"  # type: ignore[assignment]
    log_every: int = 1
    save_every: int = 0
    save_every_minutes: float = 30.0
    keep_checkpoints: int = 3
    gc_every: int = 50
    malloc_mmap_threshold: int = 0  # opt-in: 65536 cost GRPO 1.28x CPU time for 0.61x peak RSS (BENCHMARKS.md)
    checkpoint_hash: str = "xxh3"
    async_checkpoint: bool = False
    resume: str = "auto"
    preempt_signal: Optional[str] = "SIGUSR1"
    # Hang watchdog (llmtrain.monitoring.watchdog): ranks at different steps/phases, none moving for this many seconds,
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
    eval_tasks_data_dir: Optional[str] = None
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
    # cp_style (ulysses | ring; llmtrain.parallel.context_parallel).
    cp: int = 1
    cp_style: str = "ulysses"
    # Expert parallel (mixture-of-experts models, torch engine): each MoE layer's experts split
    # over ep ranks of dp_shard, tokens dispatched and combined by all-to-all
    # (llmtrain.parallel.expert_parallel); the other dp_shard / ep ranks FSDP-shard each expert.
    ep: int = 1
    # Megatron-LM sequence parallelism inside tensor parallelism (torchtitan's default with TP):
    # norms and the residual stream sharded along the sequence between the TP blocks.
    tp_sequence_parallel: bool = False
    compile: bool = False
    # FP8 matmuls in the decoder's Linear layers (torchao float8 training; llmtrain.parallel.float8):
    # fp8_recipe tensorwise | rowwise scaling; fp8_emulate: emulated float8 where the hardware has
    # none (tests, CPUs; no speed-up).
    fp8: bool = False
    fp8_recipe: str = "tensorwise"
    fp8_emulate: bool = False
    # +recipe=auto: llmtrain.plan picks the recipe (and micro-batch, activation checkpointing)
    # that fits device_memory ("80GiB"; None = the device's own) less memory_margin.
    auto: bool = False
    device_memory: Optional[str] = None
    memory_margin: float = 0.1


# torch.distributed's collective timeout (llmtrain.parallel.distributed.init_distributed): a hang watchdog
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

    Online RL (``objective=grpo``, :mod:`llmtrain.objectives.grpo`; TRL 1.16's names and defaults):
        num_generations: G, completions sampled per prompt (a group; GRPO, Shao et al. 2024).
        loss_type (grpo): ``dapo`` (default; DAPO, Yu et al. 2025, eq. 8), ``grpo``, ``dr_grpo``
            (Liu et al. 2025) or ``bnpo``: how the per-token losses are normalised.
        epsilon, epsilon_high: the clipped ratio's lower and upper ε (PPO, Schulman et al. 2017;
            clip-higher, DAPO section 3.1; ``epsilon_high`` unset: ``epsilon``).
        importance_sampling_level: ``token`` or ``sequence`` (GSPO, Zheng et al. 2025).
        beta (grpo): weight of the k3 KL to the reference (0: no reference is built).
        scale_rewards: advantages over the group's (``group``), the batch's (``batch``) or no
            (``none``, Dr. GRPO) standard deviation.
        advantage_estimator: ``grpo`` (the group mean as baseline) or ``rloo`` (leave-one-out,
            Ahmadian et al. 2024).
        num_iterations: μ, optimizer steps per generation batch (its sampling log-probs kept).
        mask_truncated_completions: completions cut at ``rollout.max_completion_length`` carry
            no loss (DAPO section 3.3).
        sampling_correction: where the completions' sampling (behaviour) policy may differ from
            the policy the loss sees — ``rollout.async_generation`` (one or more steps old) and
            ``rollout.engine=vllm`` (other kernels, ``rollout.sync_every``) — each token's surrogate
            is weighted by w = π_old / π_behaviour (truncated importance sampling, Yao et al. 2025;
            TRL 1.16's ``vllm_importance_sampling_mode``): ``token_truncate`` (w clipped to
            [min, max]), ``token_mask`` (0 outside), ``sequence_truncate`` / ``sequence_mask`` (one w
            per completion, of its summed log-ratio), or ``none``.
        sampling_correction_max, sampling_correction_min: the bounds of w (min: none when unset).

    On-policy distillation (``objective=distill``, :mod:`llmtrain.objectives.distill`; also reads
    ``num_generations``, default 1, and ``mask_truncated_completions``):
        teacher: the frozen teacher: a ``conf/model`` group name or a Hugging Face folder, with the
            student's tokenizer.
        lmbda: λ, the share of generation batches the student samples; the others are the data's
            own ``completion`` column (GKD, Agarwal et al. 2024, section 3.2; TRL's ``lmbda``).
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
    num_generations: int = 8
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    importance_sampling_level: str = "token"
    scale_rewards: str = "group"
    advantage_estimator: str = "grpo"
    num_iterations: int = 1
    mask_truncated_completions: bool = False
    sampling_correction: str = "token_truncate"
    sampling_correction_max: float = 3.0
    sampling_correction_min: Optional[float] = None
    teacher: Optional[str] = None
    lmbda: float = 1.0


# objective=grpo's choices (llmtrain.objectives.grpo defines each).
GRPO_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
GRPO_IMPORTANCE_LEVELS = ("token", "sequence")
GRPO_SCALE_REWARDS = ("group", "batch", "none")
GRPO_ADVANTAGE_ESTIMATORS = ("grpo", "rloo")
GRPO_SAMPLING_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")


@dataclass
class RolloutConfig:
    """How an online objective's completions are sampled (``objective=grpo``; :mod:`llmtrain.rollout`).

    Attributes:
        engine: ``hf``: the policy itself, under its layout, with llmtrain's sampling loop (every
            data-parallel recipe, tensor parallel, LoRA); ``vllm``: a vLLM server in its own
            environment (:mod:`llmtrain.rollout.vllm_server`); or ``module:Class`` of your own
            :class:`llmtrain.rollout.engines.RolloutEngine` (a server client, fixed completions).
        temperature, top_p, top_k: sampling (``top_k`` 0: off; ``top_p`` 1: off). The loss's
            log-probs are those of the logits divided by ``temperature``.
        max_completion_length: tokens a completion may have; one cut there is truncated.
        stop: strings that end a completion (besides the tokenizer's end tokens), kept in it.
        log_completions: completions of each step written to ``run_dir/completions/step_N.jsonl``
            (the first ones of the step's global batch, gathered from every rank, with their
            prompts, rewards, advantages and the data-parallel rank that sampled each); 0: none.
        generation_batch: ``hf``: rows (completions) decoded together. Every batch has this many
            rows (dummy rows fill a rank's last one) and its prompts left-padded to the longest
            of the step's, so a completion is bit for bit the same on every layout and whichever
            prompts share its batch; keep it the same across runs whose completions must match.
            Dummy rows cost as much as real ones: a divisor of a rank's rows (its prompts x G)
            needs none.
        sync_every: ``vllm``: optimizer steps between weight syncs to the server (1: every step;
            more samples from weights up to ``sync_every - 1`` steps old).
        vllm_python: ``vllm``: the Python of the environment with vLLM ("": ``$LLMTRAIN_VLLM_PYTHON``
            or ``~/.cache/llmtrain/vllm-venv/bin/python``).
        vllm_url: ``vllm``: a server you started (same flags as llmtrain's, on this filesystem),
            or several (a list, or URLs separated by commas); "": llmtrain starts and stops
            ``vllm_servers``.
        vllm_servers: ``vllm``: how many servers llmtrain starts (each a share of the host's CPUs
            and of every step's prompts, whole groups; the weights reach each at every sync).
        vllm_restarts: ``vllm``: how many times in a run a server llmtrain started is restarted
            after it died (with the current weights; the step goes on with the same seeded
            requests), or a user's server that came back as a new process is given the run's
            weights again; once they are used, a dead server ends the run (exit status 5).
        vllm_port: ``vllm``: the port of the server llmtrain starts (0: a free one; server K of
            several: this + K).
        vllm_start_timeout_s: ``vllm``: seconds to wait for the server to answer ``/health``.
        vllm_args: ``vllm``: extra arguments to the server llmtrain starts.
        async_generation: sample the generation batch of step k + ``max_staleness`` while step k
            trains, with the weights of step k (one-step-off-policy RL, as verl's one-step-off
            and TRL's async GRPO): the samples carry their sampling policy's log-probs and the loss
            corrects for it (``objective.sampling_correction``). The ``vllm`` engine samples in
            the background during the step; the ``hf`` engine shares the training process's
            weights, so it samples before the step (off-policy the same way, no faster). A
            checkpoint holds the batches already sampled (not re-sampled on resume: their
            weights are gone by then). (``async`` is a Python keyword, hence the name.)
        max_staleness: with ``async_generation``: optimizer steps between the weights that
            sample a batch and the step that trains it (0: the synchronous run, bit for bit).
        environment: multi-turn episodes with tools (:mod:`llmtrain.rollout.environments`):
            ``calculator`` or ``module:Class`` of your own ``Environment``; a verifiers
            environment, ``verifiers:ENV_ID`` or ``module:function`` returning one
            (:mod:`llmtrain.rollout.verifiers_env`, ``llmtrain[verifiers]``); "": single-turn
            completions. An episode's turns and the environment's answers share
            ``max_completion_length`` tokens; the answers carry no loss.
        max_turns: with ``environment``: model turns an episode may have.
        packing: the training micro-batches hold several sequences (prompt + completion) per
            row, up to ``data.seq_len`` tokens, each attending to itself only (``position_ids``
            from 0; a ``segment`` id per completion for the loss's per-completion means): no
            padding to the longest completion. Equal to the padded layout up to float rounding.
    """

    engine: str = "hf"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_completion_length: int = 256
    stop: List[str] = field(default_factory=list)
    log_completions: int = 4
    generation_batch: int = 16
    sync_every: int = 1
    vllm_python: str = ""
    vllm_url: Any = ""  # a URL, or a list of URLs
    vllm_servers: int = 1
    vllm_restarts: int = 2
    vllm_port: int = 0
    vllm_start_timeout_s: float = 600.0
    vllm_args: List[str] = field(default_factory=list)
    async_generation: bool = False
    max_staleness: int = 1
    environment: str = ""
    max_turns: int = 4
    packing: bool = False


@dataclass
class RewardConfig:
    """What scores an online objective's completions (:mod:`llmtrain.rollout.rewards`).

    Attributes:
        functions: built-in names (``gsm8k``, ``format``, ``length``, ``model:FOLDER``) or
            ``module:function`` of your own, called as TRL calls reward functions:
            ``f(prompts=, completions=, completion_ids=, **the data's other columns)`` -> one float
            (or None: not applicable) per completion.
        weights: one per function (default: 1 each); the reward is their weighted sum.
    """

    functions: List[str] = field(default_factory=list)
    weights: List[float] = field(default_factory=list)


@dataclass
class Config:
    """The whole run: model × data × parallelism recipe, plus trainer and tracker settings."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    peft: Optional[PeftConfig] = None  # +peft=lora
    # Overrides recipe.engine: `+recipe=zero3 engine=torch` runs the ZeRO-3 recipe on FSDP2.
    engine: Optional[str] = None
    name: str = "${model.name}-${data.name}-${recipe.name}"
    run_dir: str = "runs/${name}"
