"""Memory plans: per-rank bytes of a recipe's layout on N ranks, from the model's config alone
(built on the meta device; one and two decoder layers run under ``FakeTensorMode`` at the run's
micro-batch shape for the bytes saved for backward), and their table.

Accounting (bytes per rank; n = parameters the rank holds before data-parallel sharding, i.e.
after the tensor-parallel split and its pipeline stage's share; d = data-parallel shard degree):

- torch engine, ``zero_stage`` 0 (DDP, TP, PP): parameters 4n, gradients 4n (DDP's buckets are
  the gradients, ``gradient_as_bucket_view``), AdamW 8n (two fp32 moments). FSDP2 (stage 3):
  each / d, plus the all-gathered largest unit twice (current and prefetched) in the compute
  dtype and its fp32 gradient before the reduce-scatter. Stages 1-2 on FSDP2 keep every unit
  gathered from forward to backward (``reshard_after_forward=False``). With gradient
  accumulation, FSDP2 keeps every unsharded fp32 gradient from the first micro-batch's backward
  to the last one's reduce-scatter (4n, of which the sharded 4n / d replaces a share), and DDP
  holds no_sync's gradients beside its buckets (4n).
- DeepSpeed (ZeRO, Rajbhandari et al. SC'20 section 5.1): working parameters 2n (bf16) or 4n
  (fp32), / d at stage 3; fp32 gradients n (stage 1) or n / d (stages 2-3); an fp32 master
  partition 4n / d (DeepSpeed keeps it even in fp32 runs, a second copy of the weights); AdamW
  8n / d. Temporaries: the reduce and all-gather buckets, and at stage 3 the gathered parameters
  (up to ``max_live_parameters``, DeepSpeed's default 1e9 elements) and the prefetch bucket.
  Offload moves the optimizer state and master (and the parameter partition, and at stage 3
  the gradient partition, twice) to host memory.
- Optimizer state: AdamW's 8n above is ``trainer.optimizer=adamw``'s; ``muon`` keeps 4 bytes per
  hidden-matrix element and AdamW's 8 on the rest, plus (sharded layouts) the largest matrix's
  update gathered whole; ``adamw_8bit`` ~2; ``adafactor`` 4(rows + cols) per matrix
  (:func:`optimizer_state_per_param`).
- Activations: bytes saved for backward per decoder layer (measured under FakeTensorMode on a
  layer with the tensor-parallel rank's share of heads and MLP width), times the stage's layers,
  plus the embedding and the loss (logits); under LoRA the layers carry the run's adapters and a
  frozen base (``peft``'s own modules, measured the same way); with activation checkpointing,
  each layer keeps its input and one layer is recomputed at a time. A pipeline's first stage holds ``pp``
  micro-batches in flight under 1F1B and all of them under GPipe (Narayanan et al. SC'21,
  section 2.2).
- Image-text models (:mod:`llmtrain.planning.vision`): the vision tower's and projector's
  parameters join the first stage's (sharded with the rest: FSDP2 units of the tower's blocks
  are smaller than a decoder layer), and each row's image (one a sample, at the processor's
  largest size) adds what the tower saves for backward, measured under FakeTensorMode.
- Context parallel (``recipe.cp``): a rank holds seq_len / cp tokens of each row, so its layers
  are measured at that length and its logits are its tokens'. Both attention styles save what
  ``sdpa`` saves at that length (Ulysses: whole rows of heads / cp; ring on CPU: the flash
  kernel's output and log-sum-exp per block; on other devices ring falls back to plain tensor
  ops that keep (T/cp)^2 scores per head and block, which the plan does not count: use Ulysses
  there). FSDP2 shards over dp_shard x cp.
- Tensor-parallel sequence parallelism (``recipe.tp_sequence_parallel``): what a layer's norms
  save (measured apart) and each layer's checkpointed input are 1/tp; the blocks' all-gathered
  inputs are saved whole, as torch's ``SequenceParallel`` styles keep them.
- Chunked loss (``trainer.loss_chunk_tokens``): the output layer is measured as it runs (saving
  hidden states and a log-sum-exp per token), and the logits temporary is one chunk's.
- Online RL (``objective=grpo``): a micro-batch of m prompts trains m x G completion rows, whose
  loss runs the output layer in chunks as ``trainer.loss_chunk_tokens`` does (of
  ``bounded_chunk_tokens`` by default, where the engine installs GRPO's label head: two
  chunk-sized tensors with the entropy's exponentials, within ``BOUNDED_CHUNK_BYTES``); with
  ``beta`` > 0 and no adapters, the frozen reference copy as for DPO. Sampling happens between
  optimizer steps, so its bytes (:attr:`RankPlan.sampling`) peak apart from the step's: the
  resident bytes, the weights gathered whole under ZeRO-3 and FSDP2 (the compute dtype, less the
  share the rank already holds), one generation batch's KV cache (2 x layers x
  ``rollout.generation_batch`` rows, or G where larger, x ``data.seq_len`` tokens x the
  key/value heads / tp x head size, in the compute dtype; :func:`kv_cache_bytes`) and one decode
  step's fp32 logits. The plan's total is the larger of the two peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from llmtrain.config.validate import (ONLINE_OBJECTIVES, PREFERENCE_OBJECTIVES, validate_chunked_loss,
                                      validate_context_parallel, validate_objective, validate_peft, peft_label,
                                      validate_quantize)
from llmtrain.common.errors import ConfigError
from llmtrain.parallel.context_parallel import check_model
# The model's shape and activations, measured; importers of this module find them here too.
from llmtrain.planning.shapes import (Activations, ModelShape, measure_activations, model_shape,  # noqa: F401
                                      optimizer_state_per_param)

GIB = 2**30


@dataclass
class RankPlan:
    """Bytes one rank needs for a recipe (the binding rank: the pipeline stage needing most).
    ``host``: bytes offloaded to host memory per rank. ``error``: why the recipe cannot run on
    this world size (then the byte fields are 0)."""

    recipe: str
    world_size: int
    degrees: str = ""
    micro_batch: int = 0
    accumulation: int = 0
    global_batch: int = 0
    checkpointing: bool = False
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    optimizer_name: str = "adamw"
    master: int = 0
    activations: int = 0
    temporaries: dict[str, int] = field(default_factory=dict)  # during the step only
    buffers: dict[str, int] = field(default_factory=dict)  # kept between steps
    sampling: dict[str, int] = field(default_factory=dict)  # online RL: while sampling, beside `resident`
    grads_kept: bool = False  # the gradient storage outlives the step (DDP buckets, ZeRO-3 partitions)
    host: int = 0
    stage: int = 0
    cp: int = 1
    cp_style: str = "ulysses"
    ep: int = 1
    vision: Any = None  # an image-text model's VisionShape (llmtrain.planning.vision), counted in the bytes
    error: str | None = None

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer state + master copy on the device (bytes)."""
        return self.params + self.grads + self.optimizer + self.master

    @property
    def resident(self) -> int:
        """Device bytes held between steps (after the optimizer step): parameters, optimizer
        state, master copy, buffers, and the gradients where their storage is kept."""
        return (self.params + self.optimizer + self.master + (self.grads if self.grads_kept else 0)
                + sum(self.buffers.values()))

    @property
    def step_peak(self) -> int:
        """Device bytes at the training step's peak: model states, buffers, activations and every
        temporary (assumed live at once)."""
        return self.model_states + sum(self.buffers.values()) + self.activations + sum(self.temporaries.values())

    @property
    def sampling_peak(self) -> int:
        """Device bytes while an online objective samples (0 for other objectives): the resident
        bytes and :attr:`sampling`'s."""
        return self.resident + sum(self.sampling.values()) if self.sampling else 0

    @property
    def total(self) -> int:
        """Device bytes at the run's peak: the larger of :attr:`step_peak` and
        :attr:`sampling_peak`. An upper bound of the tensors the plan models; what it does not
        model (ZeRO-3's communication buffers and threads, allocator fragmentation, a GPU's
        cuBLAS workspace) measured up to 7% of the peak on CPU under ZeRO-3, which
        ``recipe.memory_margin`` (default 0.1) is there to cover."""
        return max(self.step_peak, self.sampling_peak)


def plan_recipe(cfg: Any, world_size: int, hf_config: Any | None = None, micro_batch: int | None = None,
                checkpointing: bool | None = None) -> RankPlan:
    """Per-rank bytes of ``cfg`` (a composed run config; its recipe) on ``world_size`` ranks.
    ``micro_batch`` / ``checkpointing`` override ``trainer.micro_batch_size`` /
    ``trainer.activation_checkpointing``. An invalid layout gives a plan with ``error`` set.

    The steps: the layout checked (:func:`_checked_layout`), what the run computes on
    (:func:`_setting`), then each pipeline rank's plan (:func:`_stage_plan`); the largest wins."""
    from llmtrain.models.build import language_config

    r, t = cfg.recipe, cfg.trainer
    hf_config = hf_config or language_config(cfg.model)
    micro = micro_batch or t.micro_batch_size
    ckpt = t.activation_checkpointing if checkpointing is None else checkpointing
    plan = RankPlan(recipe=r.name, world_size=world_size, micro_batch=micro, checkpointing=ckpt, ep=r.get("ep", 1),
                    global_batch=cfg.trainer.global_batch_size)
    try:
        lay, dims = _checked_layout(cfg, world_size, micro, hf_config)
    except ConfigError as err:
        plan.error = str(err)
        return plan
    shape = _shape(hf_config, cfg.model)
    if dims.tp > 1 and shape.tp_plan_error:
        plan.error = shape.tp_plan_error
        return plan
    plan.cp, plan.cp_style = dims.cp, r.cp_style
    plan.optimizer_name = t.get("optimizer", "adamw")
    plan.degrees = f"dp {dims.dp_replicate}x{dims.dp_shard} tp {dims.tp} pp {dims.pp}" + (
        f" cp {dims.cp}" if dims.cp > 1 else "") + (f" ep {dims.ep}" if dims.ep > 1 else "")
    plan.accumulation = lay.accumulation
    s = _setting(cfg, world_size, hf_config, dims, shape, micro, ckpt, lay.accumulation)
    best: RankPlan | None = None
    for pp_rank in range(dims.pp):
        candidate = _stage_plan(s, plan, pp_rank)
        if best is None or candidate.total > best.total:
            best = candidate
    return best


def _checked_layout(cfg: Any, world_size: int, micro: int, hf_config: Any) -> tuple[Any, Any]:
    """The run's layout and parallel dimensions, checked as a run's start would check them.

    Raises:
        ConfigError: the objective, adapters, context or expert parallelism, the chunked loss or
            the model does not fit the recipe on ``world_size`` ranks.
    """
    from llmtrain.config.layout import layout
    from llmtrain.config.validate import validate_expert_parallel
    from llmtrain.models.moe import check_model as check_experts
    from llmtrain.parallel.dims import ParallelDims

    r = cfg.recipe
    validate_objective(cfg)  # pairs refuse pipeline recipes (and reward models tp)
    if cfg.get("peft") is not None:  # LoRA / QLoRA run on the data-parallel recipes only
        validate_peft(cfg.peft, r, peft_label(cfg))
        validate_quantize(cfg)
    validate_context_parallel(cfg)
    validate_chunked_loss(cfg)
    lay = layout(cfg, world_size, micro_batch_size=micro)  # degrees, accumulation, pipeline micro-batches
    dims = ParallelDims.from_layout(lay)
    dims.check_model_config(hf_config, r.pp_stages_per_rank)
    check_model(r.cp_style, dims.cp, dims.tp, hf_config)
    validate_expert_parallel(r)
    check_experts(hf_config, dims.ep)
    return lay, dims


@dataclass(frozen=True)
class _Setting:
    """What every pipeline rank's plan of one run shares (:func:`_setting`)."""

    cfg: Any
    hf_config: Any
    dims: Any
    shape: ModelShape
    ckpt: bool
    accumulation: int
    compute: int  # bytes per element of the compute dtype
    bf16: bool
    fsdp: bool
    replicated_bf16: bool
    pairs: bool  # a preference objective: a micro-batch of pairs is twice as many rows
    online: bool  # online RL: a micro-batch of prompts is G completions each
    group: int
    rows: int
    frozen_copy: bool  # a frozen reference copy of the initial weights
    teacher: ModelShape | None  # distillation's teacher
    chunk: int  # trainer.loss_chunk_tokens
    local_seq: int  # a context-parallel rank's share of each row
    acts: Any  # per-layer activations (:func:`measure_activations`)
    vision: Any  # an image-text model's tower (:func:`llmtrain.planning.vision.vision_shape`), or None
    layer_n: int
    embedding_n: int
    head_n: int
    stage_ids: list
    communication: Any


def _setting(cfg: Any, world_size: int, hf_config: Any, dims: Any, shape: ModelShape, micro: int, ckpt: bool,
             accumulation: int) -> _Setting:
    """The dtypes, the objective's rows, the activations and the parameter shares every
    pipeline rank's plan uses."""
    from llmtrain.engine.deepspeed_engine import communication_sizes
    from llmtrain.engine.mixed_precision import uses_bf16_casts
    from llmtrain.objectives.reference import reference_kind
    from llmtrain.parallel.pipeline import stage_layer_ids

    r, t = cfg.recipe, cfg.trainer
    bf16 = t.precision == "bf16"
    # bf16 runs compute on bf16 weights under DeepSpeed's ZeRO, FSDP2 (its param_dtype) and the
    # torch engine's one process and DDP (uses_bf16_casts); TP and PP without FSDP, DeepSpeed's
    # ZeRO-0, float8 and compiled DDP keep fp32 weights under autocast.
    fsdp = r.engine == "torch" and dims.dp_cp > 1 and dims.dp_replicate != world_size
    replicated_bf16 = r.engine == "torch" and dims.dp_replicate == world_size and uses_bf16_casts(cfg, world_size)
    # Preference objectives run a micro-batch of pairs as twice as many rows (chosen, rejected);
    # online RL a micro-batch of prompts as G completions each.
    objective = cfg.get("objective")
    builtin = objective is not None and not objective.get("target")
    pairs = builtin and objective.name in PREFERENCE_OBJECTIVES
    online = builtin and objective.name in ONLINE_OBJECTIVES
    group = int(objective.num_generations) if online else 1
    rows = micro * (2 if pairs else group)
    frozen_copy = reference_kind(cfg) == "copy" and (
        (pairs and objective.name == "dpo" and not objective.precompute_reference) or (online and objective.beta > 0))
    teacher = None
    if online and objective.name == "distill" and objective.get("teacher"):
        from llmtrain.models.build import model_config
        from llmtrain.objectives.distill import teacher_model_config

        teacher = model_shape(model_config(teacher_model_config(str(objective.teacher))))
    chunk = t.get("loss_chunk_tokens", 0) or _bounded_chunk(cfg, hf_config, dims, online)
    local_seq = cfg.data.seq_len // dims.cp
    acts = measure_activations(hf_config, rows, local_seq, t.precision, dims.tp,
                               bf16_weights=bf16 and ((r.engine == "deepspeed" and r.zero_stage >= 1) or fsdp
                                                      or replicated_bf16),
                               loss_chunk_tokens=chunk, adapters=cfg.get("peft"))
    if r.get("tp_sequence_parallel") and dims.tp > 1:  # norms run on 1/tp of the sequence
        acts = replace(acts, per_layer=acts.per_layer - acts.norms_per_layer + acts.norms_per_layer // dims.tp,
                       layer_input=acts.layer_input // dims.tp)
    from llmtrain.planning.vision import vision_shape

    return _Setting(cfg=cfg, hf_config=hf_config, dims=dims, shape=shape, ckpt=ckpt, accumulation=accumulation,
                    compute=2 if bf16 else 4, bf16=bf16, fsdp=fsdp, replicated_bf16=replicated_bf16, pairs=pairs,
                    online=online, group=group, rows=rows, frozen_copy=frozen_copy, teacher=teacher, chunk=chunk,
                    local_seq=local_seq, acts=acts, vision=vision_shape(cfg.model, t.precision, cfg.data),
                    layer_n=shape.tp_sharded // dims.tp + (shape.layer - shape.tp_sharded),
                    embedding_n=shape.embedding // (dims.tp if shape.embedding_tp else 1),
                    head_n=shape.head // (dims.tp if shape.head_tp else 1),
                    stage_ids=stage_layer_ids(shape.layers, dims.pp * r.pp_stages_per_rank),
                    communication=communication_sizes(r, shape.hidden))


def _bounded_chunk(cfg: Any, hf_config: Any, dims: Any, online: bool) -> int:
    """Tokens per chunk of GRPO's bounded label head with ``trainer.loss_chunk_tokens`` 0
    (:func:`llmtrain.models.chunked_loss.bounded_chunk_tokens` of the rank's vocabulary rows, the
    entropy's second copy counted) where the engine installs it:
    ``trainer.logits_at_labels_only``, no pipeline stages, a model type whose forward leaves the
    output layer's result as it is; else 0 (whole logits)."""
    from llmtrain.models.chunked_loss import PLAIN_HEAD_MODEL_TYPES, bounded_chunk_tokens, head_transform

    if not (online and cfg.objective.name == "grpo" and cfg.trainer.get("logits_at_labels_only", True)
            and dims.pp == 1):
        return 0
    plain = getattr(hf_config, "model_type", None) in PLAIN_HEAD_MODEL_TYPES and head_transform(hf_config) is None
    if not plain:
        return 0
    shape = _shape(hf_config, cfg.model)
    return bounded_chunk_tokens(shape.vocab // (dims.tp if shape.head_tp else 1), copies=2)


def _stage_plan(s: _Setting, plan: RankPlan, pp_rank: int) -> RankPlan:
    """Pipeline rank ``pp_rank``'s plan: its parameters and model states, activations in flight,
    temporaries, buffers (:func:`_add_buffers`) and what sampling adds (:func:`_add_sampling`)."""
    cfg, r, dims, shape, acts = s.cfg, s.cfg.recipe, s.dims, s.shape, s.acts
    stages = dims.pp * r.pp_stages_per_rank
    mine = [k for k in range(stages) if k % dims.pp == pp_rank]
    first, last = 0 in mine, stages - 1 in mine
    layers = sum(len(s.stage_ids[k]) for k in mine)
    n = layers * s.layer_n + (s.embedding_n if first else 0)
    if last:
        n += shape.final_norm + (s.head_n if shape.head else (s.embedding_n if not first else 0))
    in_flight = 1 if dims.pp == 1 else (s.accumulation if r.pp_schedule == "gpipe" else
                                           min(s.accumulation, (dims.pp - pp_rank) * r.pp_stages_per_rank))
    per_micro = (layers * (acts.layer_input if s.ckpt else acts.per_layer)
                 + (acts.outside if last else (acts.layer_input if not first else 0)))
    activations = in_flight * per_micro + (acts.per_layer if s.ckpt else 0)  # one layer recomputed
    if s.vision is not None and first:  # the tower and projector (not checkpointed), one image a row
        n += s.vision.params
        activations += in_flight * s.rows * s.vision.saved_per_image
    candidate = replace(plan, stage=pp_rank, activations=activations, temporaries={}, buffers={}, vision=s.vision)
    if cfg.get("peft") is not None:  # LoRA / QLoRA: the base frozen (data-parallel recipes only)
        _partial_model_states(candidate, cfg, n, dims, s.compute, s.bf16, shape, s.layer_n, s.embedding_n, s.head_n,
                              s.communication, replicated_bf16=s.replicated_bf16)
    else:
        _model_states(candidate, r, n, dims, s.compute, s.bf16, shape, s.layer_n, s.embedding_n, s.head_n,
                      s.communication, experts_n=layers * shape.experts_layer, optimizer=plan.optimizer_name)
    if r.get("fp8") and shape.decoder_linears:
        _fp8_bytes(candidate, r, shape, s.rows * s.local_seq, s.compute, s.fsdp)
    if s.replicated_bf16:  # quantized (NF4) weights are not cast
        from llmtrain.models.quantize import is_quantized

        quantized = sum(i * o for _, i, o in shape.decoder_linears) if is_quantized(cfg) else 0
        # A LoRA base is stored in bf16 already: only the adapters are cast.
        cast = adapter_elements(shape, cfg.peft)[0] if cfg.get("peft") is not None else n - quantized
        candidate.temporaries["bf16 casts of the weights (one micro-batch's graph)"] = 2 * cast
    if dims.ep > 1:
        # Dispatch and combine of one MoE layer: this rank's N k assignment rows sent and as
        # many received (uniform routing), in the compute dtype.
        candidate.temporaries["all-to-all buffers (one MoE layer's dispatch + combine)"] = (
            2 * s.rows * s.local_seq * shape.top_k * shape.hidden * s.compute)
    _add_buffers(s, candidate, n, last)
    _add_sampling(s, candidate, n)
    return candidate


def _add_buffers(s: _Setting, candidate: RankPlan, n: int, last: bool) -> None:
    """A stage's frozen reference or teacher, the loss's logits (last stage) and the pipeline's
    receive buffers. ``n``: the stage's parameters on this rank."""
    r, dims, shape = s.cfg.recipe, s.dims, s.shape
    if s.frozen_copy:  # DPO's reference: the initial weights, frozen, laid out like the policy's
        candidate.buffers["frozen reference model"] = _reference_bytes(r, n, dims, s.compute, shape, s.replicated_bf16)
    teacher = s.teacher
    if teacher is not None:  # distillation: the teacher, frozen, laid out like a reference copy
        candidate.buffers["frozen teacher model"] = _reference_bytes(r, teacher.total, dims, s.compute, teacher,
                                                                     s.replicated_bf16)
        # Its log-probs of every micro-batch of the step wait on the device for the loss
        # (rows x seq x vocab fp32 each), beside one teacher forward's logits.
        candidate.buffers["teacher log-probs (the step's micro-batches)"] = (s.accumulation * s.rows * s.local_seq
                                                                              * teacher.vocab * 4)
        candidate.temporaries["teacher logits of one forward"] = s.rows * s.local_seq * teacher.vocab * 4
    # The logits and their gradient, fp32, live on the last stage while the loss backpropagates.
    tokens = s.rows * s.local_seq
    # A reward model's head gives one score per token, not vocabulary logits.
    outputs = 1 if s.pairs and s.cfg.objective.name == "reward" else shape.vocab
    if last and s.chunk:  # one chunk's logits (recomputed in backward, gradient formed in place)
        vocab_local = shape.vocab // (dims.tp if shape.head_tp else 1)
        # GRPO's entropy metric holds a second chunk-sized tensor (the exponentials) in the forward;
        # its label head runs on the completions' positions only (at most max_completion_length a row).
        copies = 2 if s.online else 1
        labelled = min(tokens, s.rows * int(s.cfg.rollout.max_completion_length)) if s.online else tokens
        candidate.temporaries["logits of one loss chunk (trainer.loss_chunk_tokens)"] = (
            copies * min(s.chunk, labelled) * vocab_local * 4)
    elif last:
        candidate.temporaries["logits and their gradient"] = 2 * tokens * outputs * 4
    if dims.pp > 1:  # torch.distributed.pipelining keeps these per micro-batch between steps
        candidate.buffers["pipeline receive buffers (one per micro-batch)"] = s.accumulation * tokens * shape.hidden * 4


def _add_sampling(s: _Setting, candidate: RankPlan, n: int) -> None:
    """What an online objective's sampling adds on a stage of ``n`` parameters on this rank."""
    cfg, r, dims = s.cfg, s.cfg.recipe, s.dims
    if s.online and cfg.rollout.engine == "vllm":
        # The server holds its own weights and KV cache (another process, outside this plan);
        # rank 0 gathers the whole fp32 state, rebuilds a model from it and copies it for the file.
        candidate.sampling["whole fp32 model x3 on rank 0 (gathered, rebuilt, written for vLLM)"] = 3 * n * dims.tp * 4
    elif s.online:
        if (r.engine == "deepspeed" and r.zero_stage == 3) or s.fsdp:
            candidate.sampling["weights gathered whole for sampling"] = max(0, s.compute * n - candidate.params)
        # Text prompts decode rollout.generation_batch rows at a time, always that many (dummy
        # rows fill a short batch); an image prompt decodes its group of G rows.
        rows = max(int(cfg.rollout.get("generation_batch", s.group)), s.group)
        candidate.sampling[f"KV cache of one generation batch ({rows} rows x data.seq_len tokens)"] = kv_cache_bytes(
            s.hf_config, rows, cfg.data.seq_len, s.compute, dims.tp)
        candidate.sampling["logits of one decode step (fp32)"] = rows * s.shape.vocab * 4


def kv_cache_bytes(hf_config: Any, rows: int, tokens: int, dtype_bytes: int, tp: int = 1) -> int:
    """Bytes of a KV cache holding ``tokens`` positions of ``rows`` sequences: a key and a value
    of ``num_key_value_heads / tp`` heads x ``head_dim`` per layer and position (transformers'
    ``DynamicCache``; ``head_dim`` defaults to hidden / attention heads)."""
    heads = getattr(hf_config, "num_attention_heads")
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return 2 * hf_config.num_hidden_layers * rows * tokens * max(1, kv_heads // tp) * head_dim * dtype_bytes


def _reference_bytes(r: Any, n: int, dims: Any, compute: int, shape: ModelShape, replicated_bf16: bool) -> int:
    """Bytes of the frozen reference copy (:meth:`llmtrain.engine.base.Engine.frozen_copy`) of a
    stage of ``n`` parameters: under ZeRO-3 partitioned like the policy in its working dtype (small
    parameters gathered); under ZeRO-1/2 whole in the working dtype (ZeRO-0 keeps fp32 weights);
    under FSDP2 sharded over ``dp_shard`` in fp32; the torch engine's one process and DDP under
    bf16 (``replicated_bf16``) whole in bf16; otherwise whole, fp32."""
    if r.engine == "deepspeed":
        if r.zero_stage == 3:
            return compute * n // dims.world_size + compute * shape.small_params * shape.layers
        return (compute if r.zero_stage >= 1 else 4) * n
    if replicated_bf16:
        return 2 * n
    return 4 * n // (dims.dp_shard * dims.cp)


def _model_states(plan: RankPlan, r: Any, n: int, dims: Any, compute: int, bf16: bool, shape: ModelShape,
                  layer_n: int, embedding_n: int, head_n: int, sizes: dict[str, int], experts_n: int = 0,
                  optimizer: str = "adamw") -> None:
    """Model-state bytes of a rank holding ``n`` parameters (``experts_n`` of them routed
    experts). ``optimizer``: ``trainer.optimizer``, whose state is ``shape.optimizer_bytes`` per
    parameter. Expert parallelism (torch engine) stores the same 1/(dp_shard x cp) share of every
    expert (1/ep of the experts, each over dp_shard/ep ranks), but gathers only its ep share of a
    layer's experts: the FSDP units are a layer's dense part and its local experts."""
    if r.engine == "deepspeed":
        d = dims.world_size
        working = 2 if bf16 else 4
        plan.params = working * n // d if r.zero_stage == 3 else working * n
        if r.zero_stage == 3:  # small parameters (norms, biases) stay gathered on every rank
            plan.params += working * shape.small_params * shape.layers
        plan.grads = 4 * n // d if r.zero_stage >= 2 else 4 * n
        plan.grads_kept = r.zero_stage == 3  # stage 3's flat gradient partition; 1-2 free theirs
        plan.master, plan.optimizer = 4 * n // d, int(shape.optimizer_bytes[optimizer] * n) // d
        plan.temporaries["reduce bucket"] = 4 * sizes["reduce_bucket_size"]
        if r.zero_stage < 3:
            plan.temporaries["all-gather bucket"] = working * sizes["allgather_bucket_size"]
        else:
            live = r.max_live_parameters if r.max_live_parameters is not None else 10**9
            plan.temporaries["gathered parameters (max_live_parameters)"] = working * min(n, live)
            plan.temporaries["prefetch bucket"] = working * sizes["prefetch_bucket_size"]
        if r.offload_optimizer:
            # The CPU optimizer's master and moments live on the host. At stage 3 so does the
            # fp32 gradient partition (stage3.py allocates it on the optimizer's device), and the
            # optimizer keeps a second fp32 copy of it: measured as two partitions of host bytes.
            plan.host += plan.master + plan.optimizer + (2 * plan.grads if r.zero_stage == 3 else 0)
            plan.master = plan.optimizer = 0
            if r.zero_stage == 3:
                plan.grads, plan.grads_kept = 0, False
        if r.offload_params and r.zero_stage == 3:
            plan.host += plan.params
            plan.params = 0
        return
    d = dims.dp_shard * dims.cp  # FSDP2 shards over dp_shard x cp (llmtrain.parallel.parallelize.fsdp_mesh)
    plan.params, plan.grads, plan.optimizer = 4 * n // d, 4 * n // d, int(shape.optimizer_bytes[optimizer] * n) // d
    if optimizer == "muon" and (d > 1 or dims.tp > 1):
        # Each sharded matrix's update is gathered whole (fp32) and orthogonalised in bf16.
        plan.temporaries["Muon: the largest matrix's update gathered whole (fp32 + bf16)"] = 6 * shape.largest_matrix
    plan.grads_kept = d == 1 and dims.dp_replicate > 1 and dims.tp == dims.pp == 1  # DDP: buckets are the grads
    if plan.grads_kept and plan.accumulation > 1:
        # Under no_sync (every micro-batch but the last) autograd writes fresh gradients beside
        # DDP's buckets, which stay allocated (zero_grad sets the views to None); the last
        # micro-batch's backward copies them into the buckets.
        plan.temporaries["gradients beside DDP's buckets (no_sync micro-batches)"] = 4 * n
    if d > 1:
        unit = max(layer_n, embedding_n + shape.final_norm + head_n)  # a decoder layer, or the root's
        gathered = n  # elements a rank ever holds unsharded
        if dims.ep > 1:
            unit = max(layer_n - shape.experts_layer, shape.experts_layer // dims.ep, embedding_n + shape.final_norm + head_n)
            gathered = n - experts_n + experts_n // dims.ep
        if r.zero_stage == 3:
            plan.temporaries["FSDP all-gather (largest unit, current + prefetch)"] = 2 * compute * unit
        else:
            plan.temporaries["FSDP unsharded parameters (kept forward to backward)"] = compute * gathered
        plan.temporaries["FSDP reduce-scatter input (largest unit, fp32)"] = 4 * unit
        if plan.accumulation > 1:
            # Gradient sync is off for every micro-batch but the last: FSDP2 accumulates each
            # parameter's unsharded gradient (in reduce_dtype, fp32) until the last backward
            # reduce-scatters it into the sharded gradient (counted above, 4n / d).
            plan.temporaries["FSDP unsharded gradients between micro-batches (fp32)"] = 4 * gathered - 4 * n // d
    if r.offload_params:
        plan.host += plan.params + plan.grads + plan.optimizer
        plan.params = plan.grads = plan.optimizer = 0


def adapter_elements(shape: ModelShape, peft_cfg: Any) -> tuple[int, int]:
    """(LoRA elements, elements of the adapted Linear weights) of a model: ``r x (in + out)``
    per adapted Linear layer of the decoder (``peft.target_modules``: ``all-linear`` or name
    suffixes)."""
    chosen = adapted_linears(shape, peft_cfg)
    return sum(int(peft_cfg.r) * (i + o) for i, o in chosen), sum(i * o for i, o in chosen)


def adapted_linears(shape: ModelShape, peft_cfg: Any) -> list[tuple[int, int]]:
    """(in, out) of each decoder Linear layer ``peft.target_modules`` adapts."""
    targets = peft_cfg.target_modules
    return [(i, o) for name, i, o in shape.decoder_linears if targets == "all-linear" or name in list(targets)]


def _partial_model_states(plan: RankPlan, cfg: Any, n: int, dims: Any, compute: int, bf16: bool, shape: ModelShape,
                          layer_n: int, embedding_n: int, head_n: int, sizes: dict[str, int],
                          replicated_bf16: bool = False) -> None:
    """Model-state bytes of LoRA on a frozen base of ``n`` elements: gradients, master copy and
    optimizer state for the adapters only (:func:`_model_states` on their elements), plus the
    frozen base's storage: fp32 on the torch engine (FSDP2 shards it over dp_shard x cp) except
    bf16 where one process or DDP computes on bf16 casts (``replicated_bf16``: the base is stored
    as its cast, :func:`llmtrain.engine.mixed_precision.store_frozen_in_bf16`), the
    working dtype on DeepSpeed (ZeRO-3 partitions it), and with ``model.quantize=nf4`` every
    decoder Linear weight at :func:`llmtrain.models.quantize.stored_bytes_per_weight` bytes
    (QLoRA's NF4 codes and scales) with one layer's weight dequantized at a time."""
    from llmtrain.models.quantize import is_quantized, stored_bytes_per_weight

    r = cfg.recipe
    lora_n, _ = adapter_elements(shape, cfg.peft)
    _model_states(plan, r, lora_n, dims, compute, bf16, shape, layer_n, embedding_n, head_n, sizes,
                  optimizer=plan.optimizer_name)
    linear_n = sum(i * o for _, i, o in shape.decoder_linears)
    quantized = linear_n if is_quantized(cfg) else 0
    deepspeed = r.engine == "deepspeed"
    frozen_elt = (2 if bf16 else 4) if deepspeed else (2 if replicated_bf16 else 4)
    base = int(quantized * stored_bytes_per_weight()) + (n - quantized) * frozen_elt
    shards = dims.world_size if deepspeed and r.zero_stage == 3 else (1 if deepspeed else dims.dp_shard * dims.cp)
    plan.params += base // shards
    gathered_elt = frozen_elt if deepspeed else compute
    if deepspeed and r.zero_stage == 3:
        # ZeRO-3 keeps tensors of up to param_persistence_threshold elements whole on every rank:
        # most adapter matrices (r x in, out x r) are that small.
        threshold, rank = sizes["param_persistence_threshold"], int(cfg.peft.r)
        persistent = sum(m for i, o in adapted_linears(shape, cfg.peft) for m in (rank * i, rank * o) if m <= threshold)
        plan.params += (2 if bf16 else 4) * (persistent - persistent // dims.world_size)
        live = r.max_live_parameters if r.max_live_parameters is not None else 10**9
        plan.temporaries["gathered parameters (max_live_parameters)"] = min(base, frozen_elt * live)
    elif not deepspeed and shards > 1:
        per_layer_gathered = int(quantized / max(1, shape.layers) * stored_bytes_per_weight()) + (
            layer_n - quantized // max(1, shape.layers)) * gathered_elt
        unit = max(per_layer_gathered, (embedding_n + shape.final_norm + head_n) * gathered_elt)
        plan.temporaries.pop("FSDP all-gather (largest unit, current + prefetch)", None)
        plan.temporaries.pop("FSDP unsharded parameters (kept forward to backward)", None)
        if r.zero_stage == 3:
            plan.temporaries["FSDP all-gather (largest unit, current + prefetch)"] = 2 * unit
        else:
            plan.temporaries["FSDP unsharded parameters (kept forward to backward)"] = base
    if "FSDP reduce-scatter input (largest unit, fp32)" in plan.temporaries:  # the adapters' gradients only
        plan.temporaries["FSDP reduce-scatter input (largest unit, fp32)"] = 4 * lora_n // max(1, shape.layers)
    if quantized:
        largest = max(i * o for _, i, o in shape.decoder_linears)
        plan.temporaries["one NF4 weight dequantized (fp32 + compute dtype)"] = largest * (4 + compute)


def _fp8_bytes(plan: RankPlan, r: Any, shape: ModelShape, tokens: int, compute: int, fsdp: bool) -> None:
    """What ``recipe.fp8`` (torchao's ``Float8Linear``, :mod:`llmtrain.parallel.float8`) adds or
    saves: each float8 matmul casts its weight and input to one byte per element (e4m3) and, in
    backward, the output gradient (e5m2); the largest decoder Linear's copies are the temporary.
    Under FSDP2 with tensorwise scaling the decoder's Linear weights are all-gathered in float8
    (1 byte instead of the compute dtype's), which shrinks the gathered unit."""
    largest = max(((i * o, i, o) for _, i, o in shape.decoder_linears), key=lambda t: t[0])
    plan.temporaries["FP8: float8 copies of the largest Linear's weight, input and output gradient"] = (
        largest[0] + tokens * (largest[1] + largest[2]))
    key = "FSDP all-gather (largest unit, current + prefetch)"
    if fsdp and r.fp8_recipe == "tensorwise" and key in plan.temporaries:
        linear_per_layer = sum(i * o for _, i, o in shape.decoder_linears) // max(1, shape.layers)
        plan.temporaries[key] -= 2 * linear_per_layer * (compute - 1)


_SHAPE_CACHE: dict[str, ModelShape] = {}


def _shape(hf_config: Any, model_cfg: Any) -> ModelShape:
    from omegaconf import OmegaConf

    override = model_cfg.get("tp_plan") if hasattr(model_cfg, "get") else None
    override = OmegaConf.to_container(override) if OmegaConf.is_config(override) else override
    key = hf_config.to_json_string() + repr(override)
    if key not in _SHAPE_CACHE:
        _SHAPE_CACHE[key] = model_shape(hf_config, override or None)
    return _SHAPE_CACHE[key]


# --- printing and the command line -----------------------------------------------------------


def fmt_bytes(n: float) -> str:
    """``n`` bytes in GiB (MiB under 1 GiB, KiB under 1 MiB)."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def describe(plan: RankPlan) -> str:
    """A per-rank breakdown of one plan, one line per kind of bytes."""
    if plan.error:
        return f"{plan.recipe} on {plan.world_size} ranks: not valid ({plan.error})"
    stage = "" if " pp 1 " in f"{plan.degrees} " else f"; binding rank: pipeline stage {plan.stage}"
    lines = [f"{plan.recipe} on {plan.world_size} ranks ({plan.degrees}; micro-batch {plan.micro_batch} x "
             f"accumulation {plan.accumulation}{'; activation checkpointing' if plan.checkpointing else ''}{stage})"]
    if plan.vision is not None:
        v = plan.vision
        lines.append(f"  vision tower and projector: {v.params:,} parameters; one image a sample at the processor's "
                     f"budget {v.budget[0]}x{v.budget[1]}: {v.image_tokens} image tokens (within data.seq_len), "
                     f"{fmt_bytes(v.saved_per_image)} saved for backward per image")
    rows = [("parameters", plan.params), ("gradients", plan.grads), (f"optimizer state ({plan.optimizer_name})", plan.optimizer),
            ("fp32 master copy", plan.master), ("activations", plan.activations)]
    rows += sorted(plan.buffers.items(), key=lambda kv: -kv[1])
    rows += [(f"{name} (temporary)", value) for name, value in sorted(plan.temporaries.items(), key=lambda kv: -kv[1])]
    if plan.sampling:
        rows.append(("peak of the training step", plan.step_peak))
        rows += [(f"{name} (while sampling)", value) for name, value in sorted(plan.sampling.items(), key=lambda kv: -kv[1])]
        rows.append(("peak while sampling (resident bytes and the above)", plan.sampling_peak))
    lines += [f"  {name:<64} {fmt_bytes(value):>12}" for name, value in rows]
    lines.append(f"  {'total per rank (device)':<64} {fmt_bytes(plan.total):>12}")
    if plan.host:
        lines.append(f"  {'offloaded to host memory per rank':<64} {fmt_bytes(plan.host):>12}")
    return "\n".join(lines)


def table(plans: list[RankPlan], budget: int | None = None, checkpointed: list[RankPlan] | None = None) -> str:
    """Every recipe's per-rank bytes as one table (GiB, or MiB when every total is under 1 GiB).
    With a ``budget``, the ``fits`` column says ``yes``, ``ckpt`` (only with activation
    checkpointing: the same recipes in ``checkpointed``) or ``no``, and a last line says so."""
    unit, size = ("GiB", GIB) if max([p.total for p in plans if not p.error] or [GIB]) >= GIB else ("MiB", 2**20)
    sampling = any(p.sampling for p in plans)  # online RL: a column for what sampling adds
    head = (f"{'recipe':<14} {'layout':<22} {'params':>9} {'grads':>9} {'optim':>9} {'master':>9} {'activ':>9} "
            f"{'buf+temp':>9}" + (f" {'sampling':>9}" if sampling else "") + f" {'total':>9} {'host':>9}"
            + ("  fits" if budget else "") + f"   ({unit})")
    lines = [head, "-" * len(head)]
    for p in plans:
        name = p.recipe + (f" ep {p.ep}" if p.ep > 1 else "")
        if p.error:
            lines.append(f"{name:<14} not valid: {p.error.split('; ')[0]}")
            continue
        cells = [p.params, p.grads, p.optimizer, p.master, p.activations,
                 sum(p.temporaries.values()) + sum(p.buffers.values()),
                 *([sum(p.sampling.values())] if sampling else []), p.total, p.host]
        fits = ""
        if budget:
            with_ckpt = {(c.recipe, c.ep): c for c in checkpointed or []}.get((p.recipe, p.ep))
            fits = "  " + ("yes" if p.total <= budget else
                           "ckpt" if with_ckpt is not None and with_ckpt.total <= budget else "no")
        lines.append(f"{name:<14} {p.degrees:<22} " + " ".join(f"{c / size:>9.2f}" for c in cells) + fits)
    if sampling:
        lines.append("sampling: bytes that online RL's rollouts add to the resident ones between steps; the total is "
                     "the larger peak, the training step's or the sampling's")
    if budget:
        lines.append(f"fits: yes = the total is within {fmt_bytes(budget)}; ckpt = only with activation checkpointing "
                     "(trainer.activation_checkpointing=true); no = not even with it")
    return "\n".join(lines)
