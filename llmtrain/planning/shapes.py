"""What a memory plan (:mod:`llmtrain.planning.memory`) counts from the model alone: its shape
(:func:`model_shape`: parameters per layer, embedding and head, what tensor parallelism splits,
the decoder's linears, experts), the optimizer's state per parameter
(:func:`optimizer_state_per_param`) and the bytes one decoder layer saves for backward at the run's
micro-batch shape, measured under ``FakeTensorMode`` (:func:`measure_activations`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from llmtrain.common.errors import ConfigError


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
    # Optimizer state bytes per parameter, averaged over the model, per trainer.optimizer
    # (:func:`optimizer_state_per_param`); the largest hidden matrix's elements (Muon gathers it whole).
    optimizer_bytes: dict = field(default_factory=lambda: {"adamw": 8.0})
    largest_matrix: int = 0
    # (name suffix, in, out) of every Linear layer in the decoder layers (not the head, not MoE
    # routers): what LoRA adapts and QLoRA stores in 4 bits.
    decoder_linears: tuple = ()


def optimizer_state_per_param(model: torch.nn.Module) -> tuple[dict[str, float], int]:
    """Optimizer state bytes per parameter of ``model`` (mean over its parameters) for each
    ``trainer.optimizer``, and the elements of its largest Muon matrix: AdamW 8 (two fp32
    moments); 8-bit AdamW ~2.03 (torchao's ``AdamW8bit``: one byte a moment element, blockwise
    scales; tensors under 4096 elements keep fp32 moments); Muon 4 (one fp32 momentum) on the hidden matrices and AdamW's 8 on the rest
    (:func:`llmtrain.engine.optimizers.muon_split`); Adafactor 4·(rows + cols) per matrix (its
    factored second moment; Shazeer & Stern 2018, §3) and 4 per element of a vector."""
    from llmtrain.engine.optimizers import muon_split

    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    matrices, _ = muon_split(model)
    in_muon = sum(p.numel() for p in matrices)
    adafactor = sum(4 * (p.shape[-2] + p.shape[-1]) * (p.numel() // (p.shape[-2] * p.shape[-1])) if p.ndim >= 2
                    else 4 * p.numel() for p in params)
    # torchao's AdamW8bit quantizes a tensor of >= 4096 elements in blocks of 256 (bitsandbytes'
    # rule): per moment 1 byte an element, an fp32 scale a block and a 256-entry fp32 code table.
    eight_bit = sum(2 * (p.numel() + 4 * p.numel() // 256 + 4 * 256) if p.numel() >= 4096 and p.numel() % 256 == 0
                    else 8 * p.numel() for p in params)
    per_param = {"adamw": 8.0, "adamw_8bit": eight_bit / total, "muon": (4 * in_muon + 8 * (total - in_muon)) / total,
                 "adafactor": adafactor / total}
    return per_param, max((p.numel() for p in matrices), default=0)


def model_shape(hf_config: Any, tp_override: dict | None = None) -> ModelShape:
    """Count the parameters of the model ``hf_config`` describes, built on the meta device (no
    memory, no weights; an 8B model takes ~0.03 s)."""
    from transformers import AutoModelForCausalLM

    from llmtrain.parallel.parallelize import tp_plan

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
    from llmtrain.models.moe import moe_shape

    moe = moe_shape(hf_config, model)
    embedding = model.base_model.embed_tokens.weight
    head = model.lm_head.weight
    tied = head is embedding
    optimizer_bytes, largest_matrix = optimizer_state_per_param(model)
    return ModelShape(
        total=sum(p.numel() for p in model.parameters()), embedding=embedding.numel(),
        head=0 if tied else head.numel(), final_norm=sum(p.numel() for p in model.base_model.norm.parameters()),
        # Mean over layers: MoE models may mix sparse and dense layers.
        layer=sum(p.numel() for layer in layers for p in layer.parameters()) // len(layers), layers=len(layers),
        tp_sharded=sum(p.numel() for n, p in layer_params.items() if sharded(f"{prefix}.layers.0.{n}")),
        embedding_tp=sharded(f"{prefix}.embed_tokens.weight"), head_tp=sharded("lm_head.weight"),
        small_params=sum(p.numel() for p in layer_params.values() if p.numel() <= 10 * hidden),
        hidden=hidden, vocab=hf_config.vocab_size, tp_plan_error=plan_error,
        experts_layer=moe.routed_params // len(layers) if moe else 0, top_k=moe.top_k if moe else 0,
        optimizer_bytes=optimizer_bytes, largest_matrix=largest_matrix,
        decoder_linears=_decoder_linears(model, layers))


def _decoder_linears(model: torch.nn.Module, layers: list) -> tuple:
    from llmtrain.models.moe import sparse_blocks

    routers = {id(block.gate) for _, block in sparse_blocks(model)}
    return tuple((name.rsplit(".", 1)[-1], m.in_features, m.out_features) for layer in layers
                 for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear) and id(m) not in routers)


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
                        bf16_weights: bool = False, loss_chunk_tokens: int = 0, adapters: Any = None) -> Activations:
    """Bytes saved for backward, measured by running a one- and a two-layer copy of the model
    under ``FakeTensorMode`` (shapes only, no memory) with ``saved_tensors_hooks`` counting
    unique storages that are not parameters; the difference is one layer. A tensor-parallel
    rank runs its share of heads and MLP width (Megatron-LM's split), so its layer is measured
    as a layer with heads / tp and intermediate size / tp at the same head dimension.
    ``precision="bf16"`` runs under autocast over fp32 weights (tensor and pipeline parallel
    without FSDP, DeepSpeed's ZeRO-0, float8), or with ``bf16_weights`` on bf16 weights without
    autocast (DeepSpeed's bf16 ZeRO, FSDP2's ``param_dtype``, the torch engine's bf16 casts).
    ``loss_chunk_tokens``: the output layer is :mod:`llmtrain.models.chunked_loss`'s (it saves the
    hidden states and one log-sum-exp per token, not the logits). A context-parallel rank is
    measured at its share of the sequence (``seq_len`` / cp). ``adapters``: the ``peft`` config
    group of a LoRA run; its adapters are injected as the run injects them
    (:func:`llmtrain.models.adapters.lora_config`) and the base frozen, so what is measured is what
    a frozen base and its adapters save (each adapter's input and ``r``-wide intermediate, not the
    inputs kept only for a frozen weight's gradient).
    """
    adapters_key = _adapters_key(adapters)
    key = (hf_config.to_json_string(), micro_batch, seq_len, precision, tp, bf16_weights, loss_chunk_tokens,
           adapters_key)
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
        with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if bf16_weights else torch.float32)
            model.train()
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
            if adapters is not None:
                _inject_adapters(model, adapters, fake_mode)
            params = {p.untyped_storage()._cdata for p in model.parameters()}
            ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
            if loss_chunk_tokens:
                from llmtrain.models.chunked_loss import install

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


def _adapters_key(adapters: Any) -> str | None:
    """A cache key of the ``peft`` config group (None without adapters)."""
    if adapters is None:
        return None
    import json

    from omegaconf import OmegaConf

    return json.dumps(OmegaConf.to_container(adapters, resolve=True) if OmegaConf.is_config(adapters) else adapters,
                      sort_keys=True, default=str)


def _inject_adapters(model: torch.nn.Module, adapters: Any, fake_mode: Any) -> None:
    """LoRA adapters of the ``peft`` config group ``adapters`` injected into ``model`` (built under
    ``FakeTensorMode``) in place by :func:`llmtrain.models.adapters.inject`, as a run injects them
    (peft freezes every other parameter; the ``modules_to_save`` train in full), for measuring
    what they save.

    The adapters are made outside ``fake_mode``, as real tensors (``r x (in + out)`` elements per
    adapted layer of the one or two layers measured): peft moves each to its base layer's device
    and dtype with ``Module.to``, which cannot swap a fake parameter; a real one it converts. Each
    is then replaced by its fake copy, so that the count of saved storages knows it as a parameter
    (a real tensor would become a fresh fake one at each use)."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    from llmtrain.models.adapters import inject

    with unset_fake_temporarily():
        inject(model, adapters)
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and not isinstance(param, FakeTensor):
                module._parameters[name] = torch.nn.Parameter(fake_mode.from_tensor(param),
                                                              requires_grad=param.requires_grad)


def _dense_stand_in_for_experts(model: torch.nn.Module) -> None:
    """Under ``FakeTensorMode`` neither ``grouped_mm`` (its meta kernel takes bf16 only) nor the
    eager expert loop (data-dependent ``nonzero``) runs, so each experts module's forward is
    replaced by dense matmuls over the same ``[N k, ...]`` assignment rows that save what the
    grouped matmul saves: the gathered inputs ``[N k, H]``, the gate/up output ``[N k, 2I]``,
    the activation ``[N k, I]``, the expert outputs ``[N k, H]`` and the top-k weights."""
    import types

    from llmtrain.models.moe import sparse_blocks

    def forward(self, hidden_states, top_k_index, top_k_weights):
        n, k = top_k_index.shape
        rows = hidden_states.repeat_interleave(k, dim=0)
        gate, up = torch.nn.functional.linear(rows, self.gate_up_proj[0]).chunk(2, dim=-1)
        out = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[0])
        return (out * top_k_weights.reshape(-1, 1)).view(n, k, -1).sum(1)

    for _, block in sparse_blocks(model):
        if hasattr(block.experts, "gate_up_proj"):
            block.experts.forward = types.MethodType(forward, block.experts)
