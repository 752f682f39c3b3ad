"""Parallelize a Hugging Face decoder (or one pipeline stage of it), always in this order:

0. float8 Linear layers (``recipe.fp8``; :mod:`llmtrain.parallel.float8`), a module swap that
   keeps the parameters, so every step below sees the float8 layers,
1. tensor parallel (DTensor; the model's own Hugging Face TP plan, without its expert entries:
   routed experts stay whole per TP rank), with a per-TP-rank random stream inside attention
   (dropout on head-sharded probabilities),
2. expert parallel (``recipe.ep``: each MoE layer's experts sharded over the ep mesh, tokens
   dispatched by all-to-all; :mod:`llmtrain.parallel.expert_parallel`),
3. activation checkpointing (per decoder layer),
4. ``torch.compile`` (per decoder layer, optional),
5. FSDP2 (``fully_shard`` per experts module on the expert FSDP mesh, then per decoder layer,
   then the root).

TP comes first because it turns the Linear weights into DTensors that FSDP2 then shards again
along the data-parallel mesh dims (2D); checkpointing wraps what TP produced so the recompute
repeats the same collectives; compile sees the checkpointed layer; FSDP2 comes last so its
per-layer all-gathers wrap everything inside the layer. The optimizer is built after all four
(torchtitan applies the same order, ``parallelize_llama``).
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

from llmtrain.common.errors import ConfigError

# Plans for families whose transformers config has no ``base_model_tp_plan``: model_type ->
# {module path relative to the base model (``*`` = any layer index): style}. A run can also
# give ``model.tp_plan`` in its config, which wins over both.
TP_PLAN_OVERRIDES: dict[str, dict[str, str]] = {}

# replicated_with_grad_allreduce (transformers' style for Qwen3's per-head q/k norms): the weight
# stays whole on every TP rank, each rank's gradient covers its own heads, so the gradients are
# summed over the TP group before the update (tp_replicated_params, NativeEngine.step).
SUPPORTED_STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "embedding_rowwise",
                    "replicated_with_grad_allreduce")
REPLICATED_GRAD_SUM = "replicated_with_grad_allreduce"


def tp_plan(model: nn.Module, override: dict[str, str] | None = None) -> dict[str, str]:
    """Module path -> TP style for the causal LM ``model`` (paths relative to it).

    Source, first found: ``override`` (``model.tp_plan``), :data:`TP_PLAN_OVERRIDES` for the
    model type, the config's ``base_model_tp_plan`` (prefixed with the base model's attribute,
    e.g. ``model.``) plus the causal LM's own ``_tp_plan`` (``lm_head``). The input embedding
    and the output head stay replicated when they share one weight (sharding one module's
    weight would split the tie).

    Raises:
        ConfigError: no plan is known for the model type, or a style is not supported.
    """
    model_type = model.config.model_type
    if override:
        plan = dict(override)
    else:
        base = TP_PLAN_OVERRIDES.get(model_type) or getattr(model.config, "base_model_tp_plan", None)
        if not base:
            raise ConfigError(f"recipe.tp > 1 but model type {model_type!r} has no tensor-parallel plan in transformers; "
                              "give one as model.tp_plan={'layers.*.self_attn.q_proj': colwise, ...} (paths relative to "
                              "the causal LM) or add it to llmtrain.parallel.parallelize.TP_PLAN_OVERRIDES")
        prefix = model.base_model_prefix
        # Routed experts are 3-D tensors transformers shards with styles of its own; they stay
        # whole per TP rank (expert parallelism, recipe.ep, is how experts are split).
        plan = {f"{prefix}.{path}": style for path, style in base.items()}
        plan.update(getattr(model, "_tp_plan", None) or {})
        plan = {path: style for path, style in plan.items() if ".experts" not in path}
        if getattr(model.config, "tie_word_embeddings", False):
            plan = {path: style for path, style in plan.items()
                    if path not in ("lm_head", f"{prefix}.embed_tokens")}
    unknown = {p: s for p, s in plan.items() if s not in SUPPORTED_STYLES}
    if unknown:
        raise ConfigError(f"tensor-parallel plan for {model_type!r} uses styles {unknown}; llmtrain supports "
                          f"{', '.join(SUPPORTED_STYLES)}. Give a plan with those as model.tp_plan")
    names = [name for name, _ in model.named_modules()]
    unmatched = [p for p in plan if not any(fnmatch.fnmatchcase(name, p) for name in names)]
    if not override:
        # The model's own plan may name modules this configuration lacks (Qwen3-MoE's dense-MLP
        # entries for mlp_only_layers a model without any).
        plan, unmatched = {p: s for p, s in plan.items() if p not in unmatched}, []
    if unmatched or not plan:
        example = next((n for n in names if ".layers.0." in n), names[-1])
        raise ConfigError(f"tensor-parallel plan paths {unmatched or '(none)'} match no module of the {model_type!r} "
                          f"model; paths are as in named_modules(), e.g. {example!r} (use * for the layer index)")
    return plan


def _style(name: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate())  # vocab-sharded table, all-reduced rows
    return ColwiseParallel(output_layouts=Replicate())  # colwise_gather_output / colwise_rep


def apply_tp(module: nn.Module, plan: dict[str, str], tp_mesh, sequence_parallel: bool = False) -> None:
    """Shard ``module``'s Linear layers named by ``plan`` over ``tp_mesh`` (Megatron-LM split:
    column-parallel Q/K/V and gate/up, row-parallel output and down projections, so each block
    needs one all-reduce in forward and one in backward; Shoeybi et al. 2019, section 3).

    Attention modules reshape with ``-1`` heads, so they run on their local heads unchanged.
    Paths absent from ``module`` (other pipeline stages' layers) are skipped.

    ``sequence_parallel`` (``recipe.tp_sequence_parallel``; Korthikanti et al., "Reducing
    Activation Recomputation in Large Transformer Models", 2022, section 4.2.2): between the
    tensor-parallel blocks the residual stream and the norms are sharded along the sequence, each
    row-parallel projection reduce-scatters (instead of all-reducing) into that shard, and each
    block all-gathers its input: the same bytes on the wire, 1/tp of the norm and residual
    activations per rank. See :func:`sequence_parallel_plan` for where the layout changes.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    present = {name for name, _ in module.named_modules()}
    styles = {path: _style(style) for path, style in plan.items() if style != REPLICATED_GRAD_SUM}
    if sequence_parallel:
        styles = sequence_parallel_plan(module, plan, styles)
    # Paths as concrete module names: a model mixing dense and sparse layers (Qwen2-MoE's
    # mlp_only_layers) has `layers.*.mlp.gate_proj` in some layers only, and torch warns about
    # every layer a wildcard finds nothing in.
    local_plan = {}
    for path, style in styles.items():
        for name in sorted(present, key=lambda n: [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in n.split(".")]):
            if fnmatch.fnmatchcase(name, path) and (name == path or name not in styles):
                local_plan[name] = style
    if local_plan:
        parallelize_module(module, tp_mesh, local_plan)


def tp_replicated_params(module: nn.Module, plan: dict[str, str]) -> list[nn.Parameter]:
    """The parameters of ``module`` in modules the plan keeps whole with summed gradients
    (``replicated_with_grad_allreduce``)."""
    paths = [path for path, style in plan.items() if style == REPLICATED_GRAD_SUM]
    return [p for name, p in module.named_parameters()
            if any(fnmatch.fnmatchcase(name.rsplit(".", 1)[0], path) for path in paths)]


def sequence_parallel_plan(model: nn.Module, plan: dict[str, str], styles: dict[str, Any]) -> dict[str, Any]:
    """``styles`` (path -> ParallelStyle of the TP plan) with Megatron-style sequence parallelism
    added for a Hugging Face decoder (torchtitan's Llama plan, adapted to where ``transformers``
    builds masks and rotary embeddings):

    - the first decoder layer takes its input replicated and keeps its sequence shard (the model
      has built the attention mask and position embeddings from the whole row before that);
    - every norm directly inside a decoder layer, and the final norm, runs on the shard
      (``SequenceParallel``);
    - the attention and MLP blocks all-gather their input (``PrepareModuleInput``), their
      row-parallel output projections reduce-scatter it back (``output_layouts=Shard(1)``);
    - the output head all-gathers its input (column-parallel head: ``input_layouts=Shard(1)``).

    Raises:
        ConfigError: a decoder layer without ``self_attn`` and ``mlp`` blocks.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    from llmtrain.parallel.pipeline import base_model

    base = base_model(model)
    prefix = model.base_model_prefix
    layer = f"{prefix}.layers"
    first = decoder_layers(model)[0]
    if not (hasattr(first, "self_attn") and hasattr(first, "mlp")):
        raise ConfigError(f"recipe.tp_sequence_parallel: {type(first).__name__} has no self_attn and mlp blocks; "
                          "turn recipe.tp_sequence_parallel off for this model")
    out = dict(styles)
    for path, style in plan.items():
        if style == "rowwise" and path.startswith(f"{layer}."):
            out[path] = RowwiseParallel(output_layouts=Shard(1))
    out[f"{layer}.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                           use_local_output=True)
    norms = [name for name, child in first.named_children() if "norm" in type(child).__name__.lower()]
    for name in norms:
        out[f"{layer}.*.{name}"] = SequenceParallel(use_local_output=True)
    out[f"{layer}.*.self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                     desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                     use_local_output=True)
    out[f"{layer}.*.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                               use_local_output=True)
    if getattr(base, "norm", None) is not None:
        out[f"{prefix}.norm"] = SequenceParallel(use_local_output=True)
    if "lm_head" in plan:
        out["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    else:  # a replicated (tied) head takes the whole row
        out["lm_head"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                            use_local_output=True)
    return out


def attention_modules(layers: list[nn.Module]) -> list[nn.Module]:
    """The attention block of each decoder layer (``self_attn`` in Llama, Qwen2, Mistral...)."""
    return [getattr(layer, "self_attn") for layer in layers if hasattr(layer, "self_attn")]


def apply_tp_rng(attention: list[nn.Module], tp_rank: int) -> None:
    """Give each TP rank its own dropout stream inside the attention blocks, whose activations
    (per-head attention probabilities) are sharded over the TP group, while everything outside
    them (replicated activations) keeps drawing from the stream the TP group shares.

    Scheme (the role of Megatron-LM's model-parallel RNG tracker, Shoeybi et al. 2019, section
    3, "tensor-parallel-seed"): on entering an attention block, one 63-bit seed is drawn from the
    shared stream (identically on every TP rank, so the shared stream stays in step), the
    generator is reseeded with (that seed, ``tp_rank``) for the block, and the shared stream's
    state is restored on exit. Being a function of the shared stream's state, the block's
    stream needs no checkpointed state of its own: exact resume restores the shared stream, and
    activation checkpointing (which restores the RNG state at the layer's start) recomputes the
    same masks.
    """
    from llmtrain.parallel.distributed import derived_seed

    def enter(module, args, kwargs):
        seed = int(torch.randint(0, 2**62, (1,)))
        on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
        fork = torch.random.fork_rng(devices=[torch.cuda.current_device()] if on_gpu else [])
        fork.__enter__()  # saves the shared stream; leave() restores it
        module._llmtrain_rng_fork = fork
        torch.manual_seed(derived_seed(seed, f"tp{tp_rank}"))

    def leave(module, args, kwargs, output):
        module.__dict__.pop("_llmtrain_rng_fork").__exit__(None, None, None)

    for block in attention:
        block.register_forward_pre_hook(enter, with_kwargs=True)
        block.register_forward_hook(leave, with_kwargs=True, always_call=True)


def apply_activation_checkpointing(layers: list[nn.Module]) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant checkpoint): memory
    per layer drops to its input, at the cost of one more forward (Chen et al. 2016)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    for layer in layers:
        if not hasattr(layer, "gradient_checkpointing"):
            raise ConfigError(f"trainer.activation_checkpointing: {type(layer).__name__} is not a transformers "
                              "GradientCheckpointingLayer; turn it off for this model")
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)


def apply_compile(layers: list[nn.Module]) -> None:
    """``torch.compile`` each decoder layer in place (names and parameters unchanged)."""
    for layer in layers:
        layer.compile(fullgraph=False)


def compiled_graphs() -> int:
    """Graphs torch.compile's front end (dynamo) has captured in this process so far (its own
    ``unique_graphs`` counter, which ``torch._dynamo.reset()`` does not clear; 0 before any
    compiled call). A count that keeps rising over the steps means recompiles, e.g. on a new
    sequence length each step."""
    import sys

    dynamo = sys.modules.get("torch._dynamo.utils")
    return int(dynamo.counters["stats"]["unique_graphs"]) if dynamo is not None else 0


def apply_fsdp(module: nn.Module, layers: list[nn.Module], dp_mesh, reshard_after_forward: bool,
               offload: bool, param_dtype: torch.dtype | None = None,
               experts: tuple[list[nn.Module], Any] | None = None) -> None:
    """FSDP2 (``fully_shard``) each decoder layer, then ``module`` as the root.

    ``dp_mesh`` is 1-D (shard) or 2-D (replicate x shard = HSDP). ``reshard_after_forward``
    False keeps a layer's parameters gathered from forward to backward (ZeRO-2-like traffic);
    ``offload`` keeps parameters, gradients and the optimizer step on CPU. ``param_dtype``
    (bf16 runs): parameters are all-gathered and computed in that dtype, half the bytes of
    gathering fp32 and casting under autocast, while the sharded master weights, their
    gradients (reduce-scattered in fp32) and the optimizer state stay fp32.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # Pinned host memory needs an accelerator; on a CPU-only machine offload is plain CPU memory.
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    precision = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if experts is not None:
        # Expert-parallel experts shard over the ranks outside their ep group (their gradients
        # are pre-divided by ep in the experts' forward, llmtrain.parallel.expert_parallel, so averaging
        # over this smaller mesh divides by every data-parallel rank, as for dense weights).
        from torch.distributed.tensor import Shard

        modules, expert_mesh = experts
        shards = expert_mesh.size(expert_mesh.ndim - 1)
        for expert_module in modules:
            # Fewer local experts than FSDP ranks: shard each expert's rows instead (dim 1), so
            # every rank holds a share (torchtitan's rule).
            local = next(expert_module.parameters()).to_local().shape[0]
            placement = (lambda param: Shard(1)) if local % shards else None
            fully_shard(expert_module, mesh=expert_mesh, reshard_after_forward=reshard_after_forward,
                        offload_policy=policy, mp_policy=precision, shard_placement_fn=placement)
    for layer in layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, offload_policy=policy,
                    mp_policy=precision)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, offload_policy=policy,
                mp_policy=precision)


def fsdp_mesh(mesh, dims):
    """The mesh FSDP2 shards over: ``dp_shard`` (with ``cp`` folded in: a sequence's cp ranks
    each hold a part of its gradient, torchtitan's ``dp_shard_cp``), under ``dp_replicate`` as a
    2-D HSDP mesh when that is > 1."""
    shard = "dp_shard"
    if dims.cp > 1:
        shard = "dp_shard_cp"
        flat = mesh["dp_shard", "cp"]._flatten(shard)  # a second call (the reference copy) finds the first
        if dims.dp_replicate == 1:
            return flat
        import warnings

        with warnings.catch_warnings():  # torch 2.13 has no other way to pair a flattened dim with another
            warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
            return mesh["dp_replicate", shard]
    return mesh["dp_replicate", shard] if dims.dp_replicate > 1 else mesh[shard]


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The decoder layers inside ``module`` (a causal LM or a pipeline stage).

    Raises:
        ConfigError: the model keeps its layers elsewhere than ``<base_model_prefix>.layers``
            (GPT-2's ``transformer.h``, OPT's ``decoder.layers``), so a per-layer recipe knob
            (compile, FSDP2, tensor parallel) has nothing to apply to.
    """
    from llmtrain.parallel.pipeline import base_model

    try:
        layers = base_model(module).layers
    except AttributeError:  # no base model under its prefix, or no .layers in it
        # An image-text model: its language model (transformers' get_decoder) holds the layers.
        layers = getattr(module.get_decoder(), "layers", None) if hasattr(module, "get_decoder") else None
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
        raise ConfigError(f"model type {model_type!r} keeps no decoder layers at <base model>.layers, which "
                          "recipe.compile, FSDP2 and tensor parallel apply per layer; use a Llama-style decoder "
                          "(Llama, Qwen2, Mistral, ...) or set recipe.compile=false with a ddp/zero recipe")
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def vision_blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an image-text model's vision tower (the submodule whose config
    is the model's ``vision_config``: CLIP's and SigLIP's ``encoder.layers``, Qwen2-VL's
    ``blocks``), which FSDP2 shards one by one as it does decoder layers; ``[]`` for a text-only
    model or a tower laid out otherwise (it is then sharded with the root)."""
    vision = getattr(getattr(module, "config", None), "vision_config", None)
    if vision is None:
        return []
    tower = next((m for m in module.modules() if getattr(m, "config", None) is vision), None)
    for path in ("encoder.layers", "blocks", "layers"):
        blocks = tower
        for name in path.split("."):
            blocks = getattr(blocks, name, None)
        if isinstance(blocks, nn.ModuleList):
            return list(blocks)
    return []


def parallelize(module: nn.Module, cfg: Any, mesh, dims, tp_plan_paths: dict[str, str] | None) -> None:
    """Apply TP, activation checkpointing, compile and FSDP2 to ``module`` in the documented
    order, as the recipe and trainer config ask. ``mesh`` has dims ``pp, dp_replicate,
    dp_shard, tp`` (:class:`llmtrain.parallel.dims.ParallelDims`)."""
    r, t = cfg.recipe, cfg.trainer
    layers = decoder_layers(module)
    if r.get("fp8"):
        from llmtrain.parallel.float8 import apply_float8

        apply_float8(module, r, sharded=dims.dp_cp > 1)
    if dims.tp > 1:
        apply_tp(module, tp_plan_paths, mesh["tp"], sequence_parallel=r.get("tp_sequence_parallel", False))
        apply_tp_rng(attention_modules(layers), mesh["tp"].get_local_rank())
    experts = None
    if dims.ep > 1:
        from llmtrain.parallel.expert_parallel import apply_expert_parallel, expert_meshes

        ep_mesh, expert_fsdp_mesh = expert_meshes(mesh, dims)
        experts = (apply_expert_parallel(module, ep_mesh), expert_fsdp_mesh)
    if t.activation_checkpointing:
        apply_activation_checkpointing(layers)
    if r.compile:
        apply_compile(layers)
    if dims.dp_cp > 1:
        # An image-text model's vision blocks are sharded units too, gathered when the tower runs
        # (every forward: llmtrain.models.blank_image), before the decoder layers.
        apply_fsdp(module, vision_blocks(module) + layers, fsdp_mesh(mesh, dims), reshard_after_forward=r.zero_stage == 3,
                   offload=r.offload_params, param_dtype=torch.bfloat16 if t.precision == "bf16" else None,
                   experts=experts)
