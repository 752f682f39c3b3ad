"""Memory planner: per-rank bytes of a run's layout before launching it, and ``+recipe=auto``.

``python -m llmtrain.plan <the overrides of a run> world_size=N [device_memory=80GiB]`` prints,
per rank, the bytes of parameters, gradients, optimizer state (and the fp32 master copy the
DeepSpeed engine keeps), activations and the largest temporary buffers, for the chosen recipe and,
as a table, for every shipped recipe that is valid on N ranks. Nothing is trained, no weights are
read and no process group is needed: the model is built on the meta device (parameter counts) and
one and two of its decoder layers are run under ``FakeTensorMode`` at the run's micro-batch shape
(bytes saved for backward), so a 70B model plans in seconds on a laptop.

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
- Activations: bytes saved for backward per decoder layer (measured under FakeTensorMode on a
  layer with the tensor-parallel rank's share of heads and MLP width), times the stage's layers,
  plus the embedding and the loss (logits); with activation checkpointing, each layer keeps
  its input and one layer is recomputed at a time. A pipeline's first stage holds ``pp``
  micro-batches in flight under 1F1B and all of them under GPipe (Narayanan et al. SC'21,
  section 2.2).
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
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from llmtrain.config import (PREFERENCE_OBJECTIVES, ConfigError, compose, parse_bytes, validate_chunked_loss,
                             validate_context_parallel, validate_objective)
from llmtrain.context_parallel import check_model

GIB = 2**30
DEFAULT_MARGIN = 0.1  # of device memory, for the allocator's fragmentation and the CUDA context
# Preference of +recipe=auto, cheapest communication first (per step, Ψ = parameter bytes moved):
# DDP 2Ψ all-reduce; ZeRO-1/2 the same 2Ψ as reduce-scatter + all-gather (optimizer state / also
# gradients sharded); FSDP2 and ZeRO-3 3Ψ (parameters gathered in forward and again in
# backward); tensor parallel adds two activation all-reduces per layer and wants one node;
# pipelines add a bubble of (pp-1)/(micro-batches+pp-1) of the step; offload is bound by the
# host link. Within a recipe a larger micro-batch is preferred, then no activation checkpointing
# (it recomputes the forward, ~33% more compute).
PREFERENCE = ("ddp", "zero1", "zero2", "fsdp", "zero3", "hsdp", "fsdp_tp", "tp", "pp_fsdp", "pp", "3d",
              "zero3_offload")


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts (elements) of a causal LM, from a meta-device build.

    ``tp_sharded``: elements of one decoder layer in modules the tensor-parallel plan splits;
    ``embedding_tp`` / ``head_tp``: whether the plan splits the embedding / the output head.
    """

    total: int
    embedding: int
    head: int  # 0 when tied to the embedding
    final_norm: int
    layer: int
    layers: int
    tp_sharded: int
    embedding_tp: bool
    head_tp: bool
    small_params: int  # elements of one layer's tensors of <= 10 x hidden elements (norms, biases)
    hidden: int
    vocab: int
    tp_plan_error: str | None
    experts_layer: int = 0  # routed-expert elements per decoder layer (mean over layers; 0 = dense)
    top_k: int = 0


def model_shape(hf_config: Any, tp_override: dict | None = None) -> ModelShape:
    """Count the parameters of the model ``hf_config`` describes, built on the meta device (no
    memory, no weights; an 8B model takes ~0.03 s)."""
    from transformers import AutoModelForCausalLM

    from llmtrain.parallelize import tp_plan

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    hidden = hf_config.hidden_size
    layers = list(model.base_model.layers)
    try:
        plan, plan_error = tp_plan(model, tp_override), None
    except ConfigError as err:
        plan, plan_error = {}, str(err)
    import fnmatch

    def sharded(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name.rsplit(".", 1)[0], path) for path in plan)

    prefix = model.base_model_prefix
    layer_params = dict(model.base_model.layers[0].named_parameters())
    from llmtrain.moe import moe_shape

    moe = moe_shape(hf_config, model)
    embedding = model.base_model.embed_tokens.weight
    head = model.lm_head.weight
    tied = head is embedding
    return ModelShape(
        total=sum(p.numel() for p in model.parameters()), embedding=embedding.numel(),
        head=0 if tied else head.numel(), final_norm=sum(p.numel() for p in model.base_model.norm.parameters()),
        # Mean over layers: MoE models may mix sparse and dense layers.
        layer=sum(p.numel() for layer in layers for p in layer.parameters()) // len(layers), layers=len(layers),
        tp_sharded=sum(p.numel() for n, p in layer_params.items() if sharded(f"{prefix}.layers.0.{n}")),
        embedding_tp=sharded(f"{prefix}.embed_tokens.weight"), head_tp=sharded("lm_head.weight"),
        small_params=sum(p.numel() for p in layer_params.values() if p.numel() <= 10 * hidden),
        hidden=hidden, vocab=hf_config.vocab_size, tp_plan_error=plan_error,
        experts_layer=moe.routed_params // len(layers) if moe else 0, top_k=moe.top_k if moe else 0)


@dataclass(frozen=True)
class Activations:
    """Bytes saved for backward by one micro-batch: ``per_layer`` for each decoder layer,
    ``outside`` for the embedding, final norm and loss (the logits), ``layer_input`` for one
    layer's input (what activation checkpointing keeps)."""

    per_layer: int
    outside: int
    layer_input: int
    norms_per_layer: int = 0  # of per_layer: saved inside the layer's norms (sequence-sharded under SP)


_ACTIVATION_CACHE: dict[tuple, Activations] = {}


def measure_activations(hf_config: Any, micro_batch: int, seq_len: int, precision: str, tp: int = 1,
                        bf16_weights: bool = False, loss_chunk_tokens: int = 0) -> Activations:
    """Bytes saved for backward, measured by running a one- and a two-layer copy of the model
    under ``FakeTensorMode`` (shapes only, no memory) with ``saved_tensors_hooks`` counting
    unique storages that are not parameters; the difference is one layer. A tensor-parallel
    rank runs its share of heads and MLP width (Megatron-LM's split), so its layer is measured
    as a layer with heads / tp and intermediate size / tp at the same head dimension.
    ``precision="bf16"`` runs under autocast over fp32 weights (the torch engine), or with
    ``bf16_weights`` on bf16 weights without autocast (DeepSpeed's bf16 ZeRO).
    ``loss_chunk_tokens``: the output layer is :mod:`llmtrain.chunked_loss`'s (it saves the
    hidden states and one log-sum-exp per token, not the logits). A context-parallel rank is
    measured at its share of the sequence (``seq_len`` / cp).
    """
    key = (hf_config.to_json_string(), micro_batch, seq_len, precision, tp, bf16_weights, loss_chunk_tokens)
    if key in _ACTIVATION_CACHE:
        return _ACTIVATION_CACHE[key]
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from llmtrain.objectives.causal_lm import token_cross_entropy_sum

    def saved_bytes(num_layers: int) -> int:
        cfg = copy.deepcopy(hf_config)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        cfg.head_dim = head_dim
        cfg.num_hidden_layers = num_layers
        cfg.num_attention_heads = max(1, cfg.num_attention_heads // tp)
        kv = getattr(cfg, "num_key_value_heads", None) or hf_config.num_attention_heads
        cfg.num_key_value_heads = max(1, kv // tp)
        cfg.intermediate_size = max(1, cfg.intermediate_size // tp)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if bf16_weights else torch.float32)
            model.train()
            params = {p.untyped_storage()._cdata for p in model.parameters()}
            seen: dict[int, int] = {}
            in_norm, norm_seen = [0], set()
            for layer in model.base_model.layers:
                for child in layer.children():
                    if "norm" in type(child).__name__.lower():
                        child.register_forward_pre_hook(lambda *_: in_norm.__setitem__(0, in_norm[0] + 1))
                        child.register_forward_hook(lambda *_: in_norm.__setitem__(0, in_norm[0] - 1))

            def pack(t: torch.Tensor) -> torch.Tensor:
                storage = t.untyped_storage()
                if storage._cdata not in params:
                    if storage._cdata not in seen and in_norm[0]:
                        norm_seen.add(storage._cdata)
                    seen.setdefault(storage._cdata, storage.nbytes())
                return t

            _dense_stand_in_for_experts(model)
            ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
            if loss_chunk_tokens:
                from llmtrain.chunked_loss import install

                install(model, loss_chunk_tokens).targets = ids
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast(
                    "cpu", dtype=torch.bfloat16, enabled=precision == "bf16" and not bf16_weights):
                token_cross_entropy_sum(model(input_ids=ids).logits, ids)
        return sum(seen.values()), sum(seen[k] for k in norm_seen)

    (one, norms_one), (two, norms_two) = saved_bytes(1), saved_bytes(2)
    act_bytes = 2 if precision == "bf16" else 4
    result = Activations(per_layer=two - one, outside=max(0, 2 * one - two),
                         layer_input=micro_batch * seq_len * hf_config.hidden_size * act_bytes,
                         norms_per_layer=norms_two - norms_one)
    _ACTIVATION_CACHE[key] = result
    return result


def _dense_stand_in_for_experts(model: torch.nn.Module) -> None:
    """Under ``FakeTensorMode`` neither ``grouped_mm`` (its meta kernel takes bf16 only) nor the
    eager expert loop (data-dependent ``nonzero``) runs, so each experts module's forward is
    replaced by dense matmuls over the same ``[N k, ...]`` assignment rows that save what the
    grouped matmul saves: the gathered inputs ``[N k, H]``, the gate/up output ``[N k, 2I]``,
    the activation ``[N k, I]``, the expert outputs ``[N k, H]`` and the top-k weights."""
    import types

    from llmtrain.moe import sparse_blocks

    def forward(self, hidden_states, top_k_index, top_k_weights):
        n, k = top_k_index.shape
        rows = hidden_states.repeat_interleave(k, dim=0)
        gate, up = torch.nn.functional.linear(rows, self.gate_up_proj[0]).chunk(2, dim=-1)
        out = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[0])
        return (out * top_k_weights.reshape(-1, 1)).view(n, k, -1).sum(1)

    for _, block in sparse_blocks(model):
        if hasattr(block.experts, "gate_up_proj"):
            block.experts.forward = types.MethodType(forward, block.experts)


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
    checkpointing: bool = False
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    master: int = 0
    activations: int = 0
    temporaries: dict[str, int] = field(default_factory=dict)  # during the step only
    buffers: dict[str, int] = field(default_factory=dict)  # kept between steps
    grads_kept: bool = False  # the gradient storage outlives the step (DDP buckets, ZeRO-3 partitions)
    host: int = 0
    stage: int = 0
    cp: int = 1
    cp_style: str = "ulysses"
    ep: int = 1
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
    def total(self) -> int:
        """Device bytes at the step's peak: model states, buffers, activations and every
        temporary (assumed live at once). An upper bound of the tensors the plan models; what it
        does not model (ZeRO-3's communication buffers and threads, allocator fragmentation, a
        GPU's cuBLAS workspace) measured up to 7% of the peak on CPU under ZeRO-3, which
        ``recipe.memory_margin`` (default 0.1) is there to cover."""
        return self.model_states + sum(self.buffers.values()) + self.activations + sum(self.temporaries.values())


def plan_recipe(cfg: Any, world_size: int, hf_config: Any | None = None, micro_batch: int | None = None,
                checkpointing: bool | None = None) -> RankPlan:
    """Per-rank bytes of ``cfg`` (a composed run config; its recipe) on ``world_size`` ranks.
    ``micro_batch`` / ``checkpointing`` override ``trainer.micro_batch_size`` /
    ``trainer.activation_checkpointing``. An invalid layout gives a plan with ``error`` set."""
    from llmtrain.engine.deepspeed_engine import communication_sizes
    from llmtrain.layout import layout
    from llmtrain.models import model_config
    from llmtrain.parallel_dims import ParallelDims
    from llmtrain.pipeline import stage_layer_ids
    from llmtrain.reference import reference_kind

    r, t = cfg.recipe, cfg.trainer
    hf_config = hf_config or model_config(cfg.model)
    micro = micro_batch or t.micro_batch_size
    ckpt = t.activation_checkpointing if checkpointing is None else checkpointing
    plan = RankPlan(recipe=r.name, world_size=world_size, micro_batch=micro, checkpointing=ckpt, ep=r.get("ep", 1))
    try:
        validate_objective(cfg)  # pairs refuse pipeline recipes (and reward models tp)
        validate_context_parallel(cfg)
        validate_chunked_loss(cfg)
        lay = layout(cfg, world_size, micro_batch_size=micro)  # degrees, accumulation, pipeline micro-batches
        dims = ParallelDims.from_layout(lay)
        dims.check_model_config(hf_config, r.pp_stages_per_rank)
        check_model(r.cp_style, dims.cp, dims.tp, hf_config)
        from llmtrain.config import validate_expert_parallel
        from llmtrain.moe import check_model as check_experts

        validate_expert_parallel(r)
        check_experts(hf_config, dims.ep)
    except ConfigError as err:
        plan.error = str(err)
        return plan
    shape = _shape(hf_config, cfg.model)
    if dims.tp > 1 and shape.tp_plan_error:
        plan.error = shape.tp_plan_error
        return plan
    plan.cp, plan.cp_style = dims.cp, r.cp_style
    plan.degrees = f"dp {dims.dp_replicate}x{dims.dp_shard} tp {dims.tp} pp {dims.pp}" + (
        f" cp {dims.cp}" if dims.cp > 1 else "") + (f" ep {dims.ep}" if dims.ep > 1 else "")
    accumulation = plan.accumulation = lay.accumulation
    bf16 = t.precision == "bf16"
    compute = 2 if bf16 else 4
    # bf16 runs compute on bf16 weights under DeepSpeed's ZeRO and FSDP2 (its param_dtype);
    # DDP, TP and PP without FSDP keep fp32 weights under autocast.
    fsdp = r.engine == "torch" and dims.dp_cp > 1 and dims.dp_replicate != world_size
    # Preference objectives run a micro-batch of pairs as twice as many rows (chosen, rejected).
    objective = cfg.get("objective")
    pairs = objective is not None and not objective.get("target") and objective.name in PREFERENCE_OBJECTIVES
    rows = micro * (2 if pairs else 1)
    frozen_copy = (pairs and objective.name == "dpo" and not objective.precompute_reference
                   and reference_kind(cfg) == "copy")
    chunk = t.get("loss_chunk_tokens", 0)
    local_seq = cfg.data.seq_len // dims.cp  # a context-parallel rank's share of each row
    acts = measure_activations(hf_config, rows, local_seq, t.precision, dims.tp,
                               bf16_weights=bf16 and ((r.engine == "deepspeed" and r.zero_stage >= 1) or fsdp),
                               loss_chunk_tokens=chunk)
    if r.get("tp_sequence_parallel") and dims.tp > 1:  # norms run on 1/tp of the sequence
        acts = replace(acts, per_layer=acts.per_layer - acts.norms_per_layer + acts.norms_per_layer // dims.tp,
                       layer_input=acts.layer_input // dims.tp)
    layer_n = shape.tp_sharded // dims.tp + (shape.layer - shape.tp_sharded)
    embedding_n = shape.embedding // (dims.tp if shape.embedding_tp else 1)
    head_n = shape.head // (dims.tp if shape.head_tp else 1)
    stages = dims.pp * r.pp_stages_per_rank
    stage_ids = stage_layer_ids(shape.layers, stages)
    best: RankPlan | None = None
    for pp_rank in range(dims.pp):
        mine = [s for s in range(stages) if s % dims.pp == pp_rank]
        first, last = 0 in mine, stages - 1 in mine
        layers = sum(len(stage_ids[s]) for s in mine)
        n = layers * layer_n + (embedding_n if first else 0)
        if last:
            n += shape.final_norm + (head_n if shape.head else (embedding_n if not first else 0))
        in_flight = 1 if dims.pp == 1 else (accumulation if r.pp_schedule == "gpipe" else
                                               min(accumulation, (dims.pp - pp_rank) * r.pp_stages_per_rank))
        per_micro = (layers * (acts.layer_input if ckpt else acts.per_layer)
                     + (acts.outside if last else (acts.layer_input if not first else 0)))
        activations = in_flight * per_micro + (acts.per_layer if ckpt else 0)  # one layer recomputed
        candidate = replace(plan, stage=pp_rank, activations=activations, temporaries={}, buffers={})
        _model_states(candidate, r, n, dims, compute, bf16, shape, layer_n, embedding_n, head_n,
                      communication_sizes(r, shape.hidden), experts_n=layers * shape.experts_layer)
        if dims.ep > 1:
            # Dispatch and combine of one MoE layer: this rank's N k assignment rows sent and as
            # many received (uniform routing), in the compute dtype.
            candidate.temporaries["all-to-all buffers (one MoE layer's dispatch + combine)"] = (
                2 * rows * local_seq * shape.top_k * shape.hidden * compute)
        if frozen_copy:  # DPO's reference: the initial weights, frozen, laid out like the policy's
            candidate.buffers["frozen reference model"] = _reference_bytes(r, n, dims, compute, shape)
        # The logits and their gradient, fp32, live on the last stage while the loss backpropagates.
        tokens = rows * local_seq
        # A reward model's head gives one score per token, not vocabulary logits.
        outputs = 1 if pairs and objective.name == "reward" else shape.vocab
        if last and chunk:  # one chunk's logits (recomputed in backward, gradient formed in place)
            vocab_local = shape.vocab // (dims.tp if shape.head_tp else 1)
            candidate.temporaries["logits of one loss chunk (trainer.loss_chunk_tokens)"] = (
                min(chunk, tokens) * vocab_local * 4)
        elif last:
            candidate.temporaries["logits and their gradient"] = 2 * tokens * outputs * 4
        if dims.pp > 1:  # torch.distributed.pipelining keeps these per micro-batch between steps
            candidate.buffers["pipeline receive buffers (one per micro-batch)"] = accumulation * tokens * shape.hidden * 4
        if best is None or candidate.total > best.total:
            best = candidate
    return best


def _reference_bytes(r: Any, n: int, dims: Any, compute: int, shape: ModelShape) -> int:
    """Bytes of the frozen reference copy (:meth:`llmtrain.engine.base.Engine.frozen_copy`) of a
    stage of ``n`` parameters: under ZeRO-3 partitioned like the policy in its working dtype (small
    parameters gathered); under FSDP2 sharded over ``dp_shard`` in fp32; otherwise whole, fp32."""
    if r.engine == "deepspeed":
        if r.zero_stage == 3:
            return compute * n // dims.world_size + compute * shape.small_params * shape.layers
        return 4 * n
    return 4 * n // (dims.dp_shard * dims.cp)


def _model_states(plan: RankPlan, r: Any, n: int, dims: Any, compute: int, bf16: bool, shape: ModelShape,
                  layer_n: int, embedding_n: int, head_n: int, sizes: dict[str, int], experts_n: int = 0) -> None:
    """Model-state bytes of a rank holding ``n`` parameters (``experts_n`` of them routed
    experts). Expert parallelism (torch engine) stores the same 1/(dp_shard x cp) share of every
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
        plan.master, plan.optimizer = 4 * n // d, 8 * n // d
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
    d = dims.dp_shard * dims.cp  # FSDP2 shards over dp_shard x cp (llmtrain.parallelize.fsdp_mesh)
    plan.params, plan.grads, plan.optimizer = 4 * n // d, 4 * n // d, 8 * n // d
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


_SHAPE_CACHE: dict[str, ModelShape] = {}


def _shape(hf_config: Any, model_cfg: Any) -> ModelShape:
    from omegaconf import OmegaConf

    override = model_cfg.get("tp_plan") if hasattr(model_cfg, "get") else None
    override = OmegaConf.to_container(override) if OmegaConf.is_config(override) else override
    key = hf_config.to_json_string() + repr(override)
    if key not in _SHAPE_CACHE:
        _SHAPE_CACHE[key] = model_shape(hf_config, override or None)
    return _SHAPE_CACHE[key]


# --- every recipe, and the choice of +recipe=auto ---------------------------------------------


def recipe_names() -> list[str]:
    """The shipped recipes (``recipes/*.yaml``) other than ``auto``."""
    from llmtrain.paths import RECIPES_DIR

    return sorted(p.stem for p in Path(RECIPES_DIR).glob("*.yaml") if p.stem != "auto")


def with_recipe(cfg: Any, name: str, cp: int = 1, cp_style: str = "ulysses", ep: int = 1, **trainer: Any) -> Any:
    """A copy of ``cfg`` with ``recipes/<name>.yaml`` as its recipe (on the recipe's own engine),
    ``recipe.cp`` = ``cp`` with ``cp_style``, ``recipe.ep`` = ``ep``, and ``trainer`` fields
    replaced. ``name`` may carry the ep degree as ``fsdp@ep4`` (+recipe=auto's candidates)."""
    if "@ep" in name:
        name, degree = name.split("@ep")
        ep = int(degree)
    from omegaconf import OmegaConf

    from llmtrain.config import load_recipe

    new = copy.deepcopy(cfg)
    OmegaConf.set_readonly(new, False)
    new.engine = None
    new.recipe = load_recipe(name)
    if cp > 1:
        new.recipe.cp, new.recipe.cp_style = cp, cp_style
    if ep > 1:
        new.recipe.ep = ep
    for key, value in trainer.items():
        new.trainer[key] = value
    return new


def plan_all(cfg: Any, world_size: int, checkpointing: bool | None = None) -> list[RankPlan]:
    """One :class:`RankPlan` per shipped recipe on ``world_size`` ranks for ``cfg``'s model,
    data and trainer settings, at the run's ``recipe.cp`` and ``recipe.cp_style``
    (``checkpointing``: override ``trainer.activation_checkpointing``); for a mixture of experts
    also each FSDP2 recipe at ep 2, 4 and 8 where that layout is valid."""
    from llmtrain.models import model_config

    cp, style = cfg.recipe.get("cp", 1), cfg.recipe.get("cp_style", "ulysses")
    hf_config = model_config(cfg.model)
    plans = [plan_recipe(with_recipe(cfg, name, cp, style), world_size, hf_config, checkpointing=checkpointing)
             for name in expert_parallel_candidates(recipe_names(), hf_config)]
    return [p for p in plans if p.ep == 1 or not p.error]  # an MoE model's ep rows where they are valid


@dataclass
class Choice:
    """What ``+recipe=auto`` picked: the plan, and the reasoning in lines."""

    plan: RankPlan
    reasons: list[str]


def choose(cfg: Any, world_size: int, device_memory: int, margin: float = DEFAULT_MARGIN,
           host_memory: int | None = None, shared_host: bool = False) -> Choice:
    """The first layout whose binding rank fits ``device_memory`` × (1 - ``margin``) bytes, in
    this order: recipes that keep everything on the device before offloading ones (host-link
    bound); context parallelism off before on (:func:`cp_degrees`: cp 2, 4, 8 only when nothing
    fits whole rows; it adds two all-to-alls per layer); without activation checkpointing
    before with it (it recomputes the forward, ~1/3 more compute); then recipes in
    :data:`PREFERENCE` order; then, per recipe, the largest micro-batch (a divisor of the global
    batch, from ``trainer.micro_batch_size`` down).
    Offloaded bytes must fit ``host_memory`` per rank (less the margin) when it is given; with
    ``shared_host`` (CPU training) device and host are one memory and their sum must fit.

    Raises:
        ConfigError: nothing fits; the message names the smallest per-rank need, its recipe and
            the number of ranks at which it would fit.
    """
    budget = int(device_memory * (1 - margin))
    host_budget = None if host_memory is None else int(host_memory * (1 - margin))

    def fits(plan: RankPlan) -> bool:
        if shared_host:
            return plan.total + plan.host <= budget
        return plan.total <= budget and (host_budget is None or plan.host <= host_budget)

    reasons = [f"budget per rank: {fmt_bytes(budget)} = device memory {fmt_bytes(device_memory)} x (1 - margin "
               f"{margin:g}); preference (communication per step, then pipeline bubble, then offload): "
               f"{', '.join(PREFERENCE)}"]
    from llmtrain.models import model_config

    hf_config = model_config(cfg.model)  # read once for every candidate
    smallest: RankPlan | None = None
    names = expert_parallel_candidates([n for n in PREFERENCE if n in recipe_names()], hf_config)
    micros = [m for m in range(cfg.trainer.micro_batch_size, 0, -1) if cfg.trainer.global_batch_size % m == 0]
    tried: dict[str, list[str]] = {name: [] for name in names}
    invalid: dict[str, str] = {}
    offloading = [n for n in names if n.endswith("_offload")]
    on_device = [n for n in names if n not in offloading]
    for group, cp, ckpt in [(group, cp, ckpt) for group in (on_device, offloading)
                            for cp in cp_degrees(cfg, world_size)
                            for ckpt in ([False, True] if not cfg.trainer.activation_checkpointing else [True])]:
        skip: set[str] = set()  # recipes invalid at this cp (a batch that does not divide dp may at another)
        for name in group:
            for micro in micros:
                if name in invalid if cp == 1 else name in skip:
                    break
                plan = plan_recipe(with_recipe(cfg, name, cp, auto_cp_style(hf_config, cp)), world_size, hf_config,
                                   micro_batch=micro, checkpointing=ckpt)
                if plan.error:
                    if micro == micros[0]:  # a layout error, not one of this micro-batch
                        if cp == 1:
                            invalid[name] = plan.error.split("; ")[0]
                        skip.add(name)
                    continue
                if smallest is None or plan.total < smallest.total:
                    smallest = plan
                if fits(plan):
                    if problem := _config_problem(cfg, name, world_size, micro, ckpt, cp, plan.cp_style):
                        if cp == 1:
                            invalid[name] = problem  # fits, but another setting of the run rules it out
                        skip.add(name)
                        break
                    reasons += [f"{label(n)}: not valid on {world_size} ranks ({e})" for n, e in invalid.items()]
                    reasons += [f"{label(n)}: does not fit ({t[0]}{' ... ' + t[-1] if len(t) > 1 else ''})"
                                for n, t in tried.items() if t]
                    host = f" and {fmt_bytes(plan.host)} of host memory" if plan.host else ""
                    reasons.append(f"{label(name)}: {fmt_bytes(plan.total)} per rank{host} at micro-batch {micro}"
                                   f"{' with activation checkpointing' if ckpt else ''}"
                                   f"{f' and context parallel cp={cp}' if cp > 1 else ''}: fits; chosen")
                    return Choice(plan, reasons)
                host = f" + host {fmt_bytes(plan.host)}" if plan.host else ""
                tried[name].append(f"micro-batch {micro}{' + checkpointing' if ckpt else ''}"
                                   f"{f' + cp {cp}' if cp > 1 else ''}: "
                                   f"{fmt_bytes(plan.total)}{host}")
    reasons += [f"{label(n)}: not valid on {world_size} ranks ({e})" for n, e in invalid.items()]
    if smallest is None:
        raise ConfigError(f"+recipe=auto: no shipped recipe is valid on world size {world_size} for this model and "
                          f"batch: {'; '.join(reasons[1:])}")
    fits_at = _ranks_to_fit(cfg, smallest.recipe, world_size, fits, hf_config)
    raise ConfigError(
        f"recipe.device_memory={fmt_bytes(device_memory)} fits no recipe on {world_size} ranks: the smallest per-rank "
        f"need is {fmt_bytes(smallest.total)} ({smallest.recipe}, micro-batch {smallest.micro_batch}"
        f"{', activation checkpointing' if smallest.checkpointing else ''}"
        f"{f', context parallel cp={smallest.cp}' if smallest.cp > 1 else ''}) against a budget of {fmt_bytes(budget)}"
        + (f", with {fmt_bytes(smallest.host)} of host memory per rank against {fmt_bytes(host_budget)}"
           if smallest.host and host_budget is not None else "")
        + (f"; {smallest.recipe} would fit on {fits_at[0]} ranks"
           f"{f' with recipe.cp={fits_at[1]}' if fits_at[1] > 1 else ''}: add ranks or use devices with more memory"
           if fits_at else
           f"; more ranks do not help (activations {fmt_bytes(smallest.activations)} and temporaries "
           f"{fmt_bytes(sum(smallest.temporaries.values()))} per rank do not shrink with data parallelism"
           f"{', nor with context parallelism up to cp=8' if cp_degrees(cfg, world_size * 64)[-1] > 1 else ''}): "
           "shorten data.seq_len, or use devices with more memory"))


def label(name: str) -> str:
    """A candidate's name as printed: ``fsdp@ep4`` -> ``fsdp recipe.ep=4``."""
    return name.replace("@ep", " recipe.ep=")


def expert_parallel_candidates(names: list[str], hf_config: Any) -> list[str]:
    """``names`` with, for a mixture-of-experts model, each FSDP2 recipe followed by its
    expert-parallel variants ``NAME@ep2``, ``@ep4``, ``@ep8`` (those dividing the experts): ep
    gathers 1/ep of a layer's experts (less memory) for two all-to-alls per MoE layer, so each
    comes after its recipe without ep."""
    from llmtrain.config import load_recipe
    from llmtrain.moe import num_experts_of

    experts = num_experts_of(hf_config)
    if not experts:
        return names
    out = []
    for name in names:
        out.append(name)
        recipe = load_recipe(name)
        if recipe.engine == "torch" and recipe.zero_stage >= 1 and recipe.pp == 1 and not recipe.offload_params:
            out += [f"{name}@ep{ep}" for ep in (2, 4, 8) if experts % ep == 0]
    return out


def cp_degrees(cfg: Any, world_size: int) -> list[int]:
    """Context-parallel degrees ``+recipe=auto`` may try: 1, then 2, 4, 8 where they divide the
    world size and ``data.seq_len`` is a multiple of 2 x cp (its load-balanced split) and the
    objective is next-token (``objective=causal_lm``)."""
    name = cfg.objective.get("name") or "causal_lm"
    if name != "causal_lm" or cfg.objective.get("target"):
        return [1]
    return [1] + [cp for cp in (2, 4, 8) if world_size % cp == 0 and cfg.data.seq_len % (2 * cp) == 0]


def auto_cp_style(hf_config: Any, cp: int) -> str:
    """``+recipe=auto``'s context-parallel style: Ulysses where the attention heads divide by cp
    (fewer collectives per layer), else ring."""
    return "ulysses" if hf_config.num_attention_heads % cp == 0 else "ring"


def _config_problem(cfg: Any, recipe: str, world_size: int, micro: int, ckpt: bool, cp: int = 1,
                    cp_style: str = "ulysses") -> str | None:
    """Why the run's config rejects this layout (``llmtrain.config.validate``, pure: no package,
    server or file is looked at; e.g. ``trainer.async_checkpoint`` on DeepSpeed), or None."""
    from llmtrain.config import validate

    candidate = with_recipe(cfg, recipe, cp, cp_style, micro_batch_size=micro, activation_checkpointing=ckpt)
    try:
        validate(candidate, world_size)
    except ConfigError as err:
        return str(err).split("; ")[0]
    return None


def check_auto_overrides(cfg: Any) -> None:
    """``+recipe=auto`` chooses the recipe: a top-level ``engine=`` or a ``recipe.*`` value other
    than ``device_memory`` / ``memory_margin`` could not apply to the choice.

    Raises:
        ConfigError: naming the overrides.
    """
    from llmtrain.config import load_recipe

    default = load_recipe("auto")
    given = [f"recipe.{key}={cfg.recipe[key]}" for key in cfg.recipe
             if key not in ("name", "engine", "auto", "device_memory", "memory_margin")
             and cfg.recipe[key] != default[key]]
    if cfg.get("engine") is not None:
        given.insert(0, f"engine={cfg.engine}")
    if given:
        raise ConfigError(f"+recipe=auto chooses the recipe, so {', '.join(given)} cannot apply to it; drop "
                          f"{'them' if len(given) > 1 else 'it'}, or name a recipe (+recipe=zero3 ...) to set "
                          f"{'them' if len(given) > 1 else 'it'}")


def _ranks_to_fit(cfg: Any, recipe: str, world_size: int, fits: Any, hf_config: Any) -> tuple[int, int] | None:
    """``(ranks, cp)``: the smallest doubling of ``world_size`` (up to 64x) at which ``recipe``
    ``fits`` (micro-batch 1, activation checkpointing), with the smallest context-parallel degree
    that does (:func:`cp_degrees`), or None."""
    n = world_size * 2
    while n <= world_size * 64:
        for cp in cp_degrees(cfg, n):
            plan = plan_recipe(with_recipe(cfg, recipe, cp, auto_cp_style(hf_config, cp)), n, hf_config, micro_batch=1,
                               checkpointing=True)
            if not plan.error and fits(plan):
                return n, cp
        n *= 2
    return None


def host_memory_per_rank() -> int:
    """This node's physical memory (bytes) shared by its ranks (``LOCAL_WORLD_SIZE``)."""
    import os

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local, 1)


def device_memory_bytes(cfg: Any, device: torch.device) -> int:
    """``recipe.device_memory``, or the device's memory: an accelerator's total memory, or on
    CPU :func:`host_memory_per_rank`."""
    if cfg.recipe.device_memory is not None:
        return parse_bytes(cfg.recipe.device_memory, "recipe.device_memory")
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory_per_rank()


def resolve_auto(cfg: Any, world_size: int, device: torch.device) -> tuple[Any, Choice]:
    """``+recipe=auto``: the run config with the chosen recipe, micro-batch and activation
    checkpointing in place of ``auto``, and the choice (to print).

    Raises:
        ConfigError: see :func:`choose`.
    """
    check_auto_overrides(cfg)
    on_cpu = device.type == "cpu"  # then device and host are one memory
    choice = choose(cfg, world_size, device_memory_bytes(cfg, device), cfg.recipe.memory_margin,
                    host_memory=None if on_cpu else host_memory_per_rank(), shared_host=on_cpu)
    return _chosen_config(cfg, choice), choice


def _chosen_config(cfg: Any, choice: Choice) -> Any:
    chosen = with_recipe(cfg, choice.plan.recipe, choice.plan.cp, choice.plan.cp_style, choice.plan.ep,
                         micro_batch_size=choice.plan.micro_batch,
                         activation_checkpointing=choice.plan.checkpointing)
    chosen.recipe.device_memory, chosen.recipe.memory_margin = cfg.recipe.device_memory, cfg.recipe.memory_margin
    # Marks the layout as chosen (the trainer checks that every rank chose alike) and keeps the
    # run's name, so relaunching the same command finds the same run directory whatever it chose.
    chosen.recipe.auto = True
    chosen.name = cfg.name
    return chosen


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
    rows = [("parameters", plan.params), ("gradients", plan.grads), ("optimizer state (AdamW)", plan.optimizer),
            ("fp32 master copy", plan.master), ("activations", plan.activations)]
    rows += sorted(plan.buffers.items(), key=lambda kv: -kv[1])
    rows += [(f"{name} (temporary)", value) for name, value in sorted(plan.temporaries.items(), key=lambda kv: -kv[1])]
    lines += [f"  {name:<64} {fmt_bytes(value):>12}" for name, value in rows]
    lines.append(f"  {'total per rank (device)':<64} {fmt_bytes(plan.total):>12}")
    if plan.host:
        lines.append(f"  {'offloaded to host memory per rank':<64} {fmt_bytes(plan.host):>12}")
    return "\n".join(lines)


def table(plans: list[RankPlan], budget: int | None = None, checkpointed: list[RankPlan] | None = None) -> str:
    """Every recipe's per-rank bytes as one table (GiB, or MiB when every total is under 1 GiB).
    With a ``budget``, the ``fits`` column says ``yes``, ``ckpt`` (only with activation
    checkpointing: the same recipes in ``checkpointed``) or ``no``."""
    unit, size = ("GiB", GIB) if max([p.total for p in plans if not p.error] or [GIB]) >= GIB else ("MiB", 2**20)
    head = (f"{'recipe':<14} {'layout':<22} {'params':>9} {'grads':>9} {'optim':>9} {'master':>9} {'activ':>9} "
            f"{'buf+temp':>9} {'total':>9} {'host':>9}" + ("  fits" if budget else "") + f"   ({unit})")
    lines = [head, "-" * len(head)]
    for p in plans:
        name = p.recipe + (f" ep {p.ep}" if p.ep > 1 else "")
        if p.error:
            lines.append(f"{name:<14} not valid: {p.error.split('; ')[0]}")
            continue
        cells = [p.params, p.grads, p.optimizer, p.master, p.activations,
                 sum(p.temporaries.values()) + sum(p.buffers.values()), p.total, p.host]
        fits = ""
        if budget:
            with_ckpt = {(c.recipe, c.ep): c for c in checkpointed or []}.get((p.recipe, p.ep))
            fits = "  " + ("yes" if p.total <= budget else
                           "ckpt" if with_ckpt is not None and with_ckpt.total <= budget else "no")
        lines.append(f"{name:<14} {p.degrees:<22} " + " ".join(f"{c / size:>9.2f}" for c in cells) + fits)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m llmtrain.plan OVERRIDES world_size=N [device_memory=SIZE] [margin=F] [--check]``.
    Returns 0, or 2 on bad input (the message names the field)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(args):
        print(__doc__.split("\n\nAccounting")[0] + "\n\nOptions besides a run's overrides: world_size=N (required), "
              "device_memory=SIZE (e.g. 80GiB; needed by +recipe=auto), host_memory=SIZE (per rank, for offload), "
              "margin=F (0.1), --check (a dry run of the layout instead of the bytes).")
        return 0
    options = {k: v for k, v in (a.split("=", 1) for a in args if "=" in a and a.split("=", 1)[0] in
                                 ("world_size", "device_memory", "margin", "host_memory"))}
    check = "--check" in args
    overrides = [a for a in args if a != "--check" and a.split("=", 1)[0] not in options]
    if "device_memory" in options:
        overrides.append(f"recipe.device_memory={options['device_memory']}")
    if "margin" in options:
        overrides.append(f"recipe.memory_margin={options['margin']}")
    try:
        if not options.get("world_size", "").isdigit() or int(options["world_size"]) < 1:
            raise ConfigError("world_size=N is required (the number of ranks to plan for, e.g. world_size=64)")
        world_size = int(options["world_size"])
        started = time.perf_counter()
        try:
            cfg = compose(overrides)
        except Exception as err:  # noqa: BLE001  (Hydra's and OmegaConf's composition errors)
            raise ConfigError(str(err).splitlines()[0]) from err
        r = cfg.recipe
        if not 0 <= r.memory_margin < 1:
            raise ConfigError(f"margin={r.memory_margin} must be in [0, 1) (a fraction of device memory kept free)")
        device_memory = None if r.device_memory is None else parse_bytes(r.device_memory, "device_memory")
        budget = None if device_memory is None else int(device_memory * (1 - r.memory_margin))
        if r.auto:
            if device_memory is None:
                raise ConfigError("+recipe=auto needs device_memory=SIZE here (e.g. device_memory=80GiB): the "
                                  "planner runs without the devices")
            host = parse_bytes(options["host_memory"], "host_memory") if "host_memory" in options else None
            check_auto_overrides(cfg)
            choice = choose(cfg, world_size, device_memory, r.memory_margin, host_memory=host)
            cfg = _chosen_config(cfg, choice)
            if choice.plan.host and host is None:
                choice.reasons.append(f"note: {choice.plan.recipe} offloads {fmt_bytes(choice.plan.host)} per rank to "
                                      "host memory, not checked here: give host_memory=SIZE (per rank) to check it")
            print("\n".join(choice.reasons))
            print(describe(choice.plan))
        if check:
            from llmtrain.dry_run import dry_run

            print(dry_run(cfg, world_size))
            return 0
        if not r.auto:
            plan = plan_recipe(cfg, world_size)
            if plan.error:
                raise ConfigError(f"{plan.recipe} is not valid on {world_size} ranks: {plan.error}")
            print(describe(plan))
        from llmtrain.adapters import is_partial

        if is_partial(cfg):
            print("note: the planner counts full training; with LoRA or model.freeze the frozen parameters carry no "
                  "gradient or optimizer state, so these figures are upper bounds")
        print(f"\nevery recipe on {world_size} ranks (per rank"
              f"{'; fits: total within ' + fmt_bytes(budget) if budget else ''}):")
        checkpointed = plan_all(cfg, world_size, checkpointing=True) if budget else None
        print(table(plan_all(cfg, world_size), budget, checkpointed))
        print(f"\nplanned in {time.perf_counter() - started:.1f} s (model on the meta device, activations under "
              "FakeTensorMode; no weights read)")
    except ConfigError as err:
        print(f"llmtrain.plan: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
