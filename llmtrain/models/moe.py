"""Mixture-of-experts decoders from ``transformers`` (Qwen3-MoE, Qwen2-MoE with a shared expert,
Mixtral, OLMoE): what llmtrain adds around the model's own sparse blocks.

Each sparse block of these families has a ``gate`` (a top-k router returning ``(router_logits
[N, E], top-k weights [N, k], top-k expert ids [N, k])`` for its ``N`` flattened tokens) and
``experts`` (3-D ``gate_up_proj`` ``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]`` run by
``transformers``' ``experts_implementation``: ``grouped_mm``, ``batched_mm`` or the ``eager``
per-expert loop). Nothing here changes a parameter's name, so checkpoints and exports are the
model's own.

- :class:`RouterMonitor` (forward hooks on every ``gate``) accumulates, per forward, the sums
  the load-balancing loss needs and, per step, each layer's tokens per expert, router entropy
  and dropped assignments.
- :func:`load_balancing_loss` is the Switch Transformer auxiliary loss (Fedus et al. 2021,
  eqs. 4-6) exactly as ``transformers`` computes it over all MoE layers of one forward
  (``load_balancing_loss_func``), written over sums so that a row split over context-parallel
  ranks or layers split over pipeline stages add up to the same value.
- :class:`CapacityLimit` (``model.moe_capacity_factor``) drops assignments beyond an expert's
  capacity (GShard, Lepikhin et al. 2020, section 2.2); dropless (0) by default.
"""

from __future__ import annotations

import json
import math
import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from llmtrain.config.validate import EXPERT_COUNT_FIELDS
from llmtrain.common.errors import ConfigError


@dataclass(frozen=True)
class MoeShape:
    """The expert layout of a ``transformers`` config.

    Attributes:
        num_experts: routed experts per MoE layer (E).
        top_k: experts each token is routed to (k).
        moe_layers: indices of the decoder layers with a sparse block.
        routed_params: parameters of all routed experts, all layers (elements).
        shared_params: parameters of always-on shared experts (and their gates), all layers.
        router_params: parameters of the routers, all layers.
    """

    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    routed_params: int
    shared_params: int
    router_params: int

    @property
    def active_routed_params(self) -> int:
        """Routed-expert parameters one token passes through: k / E of them."""
        return self.routed_params * self.top_k // self.num_experts


def num_experts_of(hf_config: Any) -> int:
    """Routed experts per layer a config declares (0 for a dense model)."""
    for name in EXPERT_COUNT_FIELDS:
        value = getattr(hf_config, name, None)  # getattr: a config's attribute_map aliases count
        if isinstance(value, int) and value > 0:
            return value
    return 0


def sparse_blocks(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(decoder layer index, sparse block)`` of ``model`` (a causal LM or a pipeline stage): the
    modules with a top-k router ``gate`` and 3-D ``experts``, in layer order."""
    blocks = []
    for name, module in model.named_modules():
        experts, gate = getattr(module, "experts", None), getattr(module, "gate", None)
        while experts is not None and hasattr(experts, "base_layer"):  # peft's wrappers (target_parameters)
            experts = experts.base_layer
        if experts is None or gate is None or not hasattr(experts, "gate_up_proj") and not hasattr(experts, "up_proj"):
            continue
        if not hasattr(gate, "top_k"):
            continue
        index = next((int(p) for p in reversed(name.split(".")) if p.isdigit()), len(blocks))
        blocks.append((index, module))
    return blocks


def moe_shape(hf_config: Any, model: nn.Module | None = None) -> MoeShape | None:
    """The :class:`MoeShape` of the model ``hf_config`` describes, or None for a dense model.
    Counted on ``model`` when given (a built model: whole sizes also under ZeRO-3 and DTensor
    sharding), else on a copy built on the meta device (no memory, any size).

    Raises:
        ConfigError: experts declared but no sparse block llmtrain can drive (a router that does
            not return ``(logits, weights, ids)``, e.g. DeepSeek-V3's grouped router), or top-k
            above the number of experts.
    """
    experts = num_experts_of(hf_config)
    if not experts:
        return None
    top_k = int(getattr(hf_config, "num_experts_per_tok", 0) or 0)
    if not 1 <= top_k <= experts:
        raise ConfigError(f"model.architecture.num_experts_per_tok={top_k} must be between 1 and the number of "
                          f"experts ({experts})")
    if model is None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    blocks = sparse_blocks(model)
    biased = [type(block.gate).__name__ for _, block in blocks if hasattr(block.gate, "e_score_correction_bias")]
    if biased:
        raise ConfigError(f"model type {hf_config.model_type!r}: its router {biased[0]} balances experts with a learned "
                          "score-correction bias (DeepSeek-V3's auxiliary-loss-free balancing), not the Switch loss "
                          "llmtrain adds; llmtrain does not drive it yet (supported: qwen3_moe, qwen2_moe, mixtral, olmoe)")
    if not blocks:
        raise ConfigError(f"model type {hf_config.model_type!r} declares {experts} experts but llmtrain finds no "
                          "sparse block with a top-k router `gate` and 3-D `experts` (supported: qwen3_moe, "
                          "qwen2_moe, mixtral, olmoe)")
    def numel(p: torch.Tensor) -> int:
        return int(getattr(p, "ds_numel", p.numel()))  # ZeRO-3 holds a partition

    routed = shared = router = 0
    for _, block in blocks:
        routed += sum(numel(p) for p in block.experts.parameters())
        router += sum(numel(p) for p in block.gate.parameters())
        shared += sum(numel(p) for name, p in block.named_parameters()
                      if not name.startswith(("experts.", "gate.")))
    return MoeShape(experts, top_k, tuple(i for i, _ in blocks), routed, shared, router)


def router_aux_coef(model_cfg: Any, hf_config: Any) -> float:
    """``model.router_aux_loss_coef``, or the model config's own ``router_aux_loss_coef`` when
    unset (0 when it has none)."""
    value = model_cfg.get("router_aux_loss_coef") if hasattr(model_cfg, "get") else None
    if value is None:
        value = getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0
    return float(value)


def load_balancing_loss(prob_sum: torch.Tensor, count_sum: torch.Tensor, rows: torch.Tensor,
                        num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary load-balancing loss (Fedus et al. 2021, eqs. 4-6) over all
    MoE layers of one forward, as ``transformers.models.*.load_balancing_loss_func`` computes it:
    ``E * sum_e (count_e / rows) * (prob_e / rows)``.

    Args:
        prob_sum: fp32 ``[E]``, router probabilities summed over layers and real tokens (with grad).
        count_sum: fp32 ``[E]``, top-k assignments per expert summed over layers and real tokens.
        rows: fp32 0-dim, real tokens times MoE layers.
        num_experts: E.

    Returns:
        fp32 0-dim loss (1.0 for perfectly balanced routing with uniform probabilities, times k).
    """
    rows = rows.clamp_min(1.0)
    return (count_sum / rows * (prob_sum / rows)).sum() * num_experts


class RouterMonitor:
    """Forward hooks on every router of a model (part) that record routing.

    Per forward between :meth:`begin` and :meth:`end`: the sums of
    :func:`load_balancing_loss` over this part's MoE layers and this rank's real tokens. Per
    optimizer step (training forwards only; a checkpointed layer's recompute in backward is not
    counted): tokens per expert ``[L, E]``, the summed router entropy (nats) and the real
    tokens ``[L]``, and dropped assignments ``[L]`` (with a capacity factor).

    Args:
        model: the causal LM or pipeline stage whose routers to watch.
        num_layers: decoder layers of the whole model (rows of the per-step counts).
        num_experts: E.
    """

    def __init__(self, model: nn.Module, num_layers: int, num_experts: int, capacity_factor: float = 0.0):
        self.num_experts = num_experts
        self.blocks = sparse_blocks(model)
        self.num_layers = num_layers
        self._zero_counters()
        self._forwards: list[torch.Tensor] = []  # the step's training forwards, flattened counters each
        self._armed = False
        self._training = False
        self._valid: torch.Tensor | None = None
        self._sums: list[torch.Tensor] = []
        for layer, block in self.blocks:
            block.gate.register_forward_hook(self._hook(layer))
            if capacity_factor > 0:
                CapacityLimit(block.experts, num_experts, capacity_factor, self, layer).install()

    def begin(self, valid: torch.Tensor | None, training: bool) -> None:
        """Start one forward. ``valid``: ``[B, T]`` (any dtype) 1 for this rank's real tokens, 0
        for padding, in the order the model flattens them; None: every token is real."""
        self._armed, self._training = True, training
        self._valid = None if valid is None else valid.reshape(-1).to(torch.float32)
        self._sums = []

    def end(self, device: torch.device | None = None) -> torch.Tensor | None:
        """Finish the forward. Returns fp32 ``[2 E + 1]``: router-probability sums (with grad),
        assignment counts, and real tokens x layers, summed over this part's MoE layers; when no
        router ran, None, or zeros on ``device`` when it is given."""
        self._armed = False
        if self._training:
            self._forwards.append(self._flat_counters())
            self._zero_counters()
        if not self._sums:
            return None if device is None else torch.zeros(2 * self.num_experts + 1, device=device)
        total = torch.stack(self._sums).sum(0) if len(self._sums) > 1 else self._sums[0]
        self._sums = []
        return total

    def valid_rows(self, rows: int, device: torch.device) -> torch.Tensor:
        """fp32 ``[rows]`` mask of real tokens for a router's ``rows`` flattened tokens."""
        if self._valid is None or self._valid.numel() != rows:
            return torch.ones(rows, dtype=torch.float32, device=device)
        return self._valid.to(device)

    def _hook(self, layer: int) -> Callable:
        def record(module, args, output):
            # The same ops armed or not: a checkpointed layer's recompute in backward (unarmed)
            # must save as many tensors as its forward did, or torch.utils.checkpoint refuses.
            logits, _, ids = output[0], output[1], output[2]
            valid = self.valid_rows(logits.shape[0], logits.device)
            probs = torch.softmax(logits.float(), dim=-1)
            prob_sum = (probs * valid[:, None]).sum(0)
            counts = torch.zeros(self.num_experts, dtype=torch.float32, device=logits.device).scatter_add_(
                0, ids.reshape(-1), valid.repeat_interleave(ids.shape[-1]))
            real = valid.sum()
            if not self._armed:
                return
            self._sums.append(torch.cat([prob_sum, counts, real[None]]))
            if self._training and not logits.is_meta:
                with torch.no_grad():  # counted on the device: no host sync per layer
                    if self.counts.device != logits.device:
                        self._zero_counters(logits.device)
                    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
                    self.counts[layer] += counts.double()
                    self.entropy[layer] += (entropy * valid).sum().double()
                    self.tokens[layer] += real.double()
        return record

    def _zero_counters(self, device: torch.device | None = None) -> None:
        L, E = self.num_layers, self.num_experts
        device = device or getattr(self, "counts", torch.zeros(0)).device
        self.counts = torch.zeros(L, E, dtype=torch.float64, device=device)
        self.entropy = torch.zeros(L, dtype=torch.float64, device=device)
        self.tokens = torch.zeros(L, dtype=torch.float64, device=device)
        self.dropped = torch.zeros(L, dtype=torch.float64, device=device)

    def _flat_counters(self) -> torch.Tensor:
        return torch.cat([self.counts.flatten(), self.entropy, self.tokens, self.dropped])

    def take_step(self, last: int | None = None) -> torch.Tensor:
        """This rank's step counters flattened (float64 ``[L (E + 3)]``: counts, entropy sums,
        tokens, dropped), summed over the step's training forwards (``last``: only the last so
        many: a pipeline schedule's first step runs one extra forward to infer shapes), then
        reset for the next step."""
        forwards = self._forwards[-last:] if last else self._forwards
        flat = sum(forwards, torch.zeros(self.num_layers * (self.num_experts + 3), dtype=torch.float64,
                                         device=self.counts.device))
        self._forwards = []
        return flat


def step_metrics(flat: torch.Tensor, num_layers: int, num_experts: int, moe_layers: tuple[int, ...],
                 aux_loss: float | None) -> tuple[dict[str, float], list[list[float]]]:
    """The trackers' router metrics from world-summed :meth:`RouterMonitor.take_step` counters.

    Per MoE layer ``l``: ``moe/layer{l}/load_max_over_mean`` (tokens of the busiest expert over
    the mean, 1.0 = balanced, E / k = all tokens on the same k experts), ``moe/layer{l}/entropy``
    (mean router entropy in nats; ln E = uniform), ``moe/layer{l}/dropped_fraction`` (with a
    capacity factor: the share of the router's assignments dropped); their means over layers
    under ``moe/``; ``moe/aux_loss`` (the unweighted loss, mean over micro-batches). Counts are
    the router's assignments, before a capacity limit drops any. Also returns the ``[L, E]``
    counts (rows of dense layers are zero) for the report's heatmap.
    """
    L, E = num_layers, num_experts
    counts = flat[:L * E].view(L, E)
    entropy, tokens, dropped = flat[L * E:L * E + L], flat[L * E + L:L * E + 2 * L], flat[L * E + 2 * L:]
    metrics: dict[str, float] = {}
    loads, entropies, drops = [], [], []
    for layer in moe_layers:
        row = counts[layer]
        mean = float(row.mean())
        load = float(row.max()) / mean if mean > 0 else 0.0
        ent = float(entropy[layer] / tokens[layer]) if tokens[layer] > 0 else 0.0
        assigned = float(row.sum())  # the router's assignments, dropped ones included
        drop = float(dropped[layer]) / assigned if assigned > 0 else 0.0
        metrics[f"moe/layer{layer}/load_max_over_mean"] = load
        metrics[f"moe/layer{layer}/entropy"] = ent
        loads.append(load), entropies.append(ent), drops.append(drop)
        if drop or dropped.any():
            metrics[f"moe/layer{layer}/dropped_fraction"] = drop
    metrics["moe/load_max_over_mean"] = max(loads) if loads else 0.0
    metrics["moe/entropy"] = sum(entropies) / max(1, len(entropies))
    if dropped.any():
        metrics["moe/dropped_fraction"] = sum(drops) / max(1, len(drops))
    if aux_loss is not None:
        metrics["moe/aux_loss"] = aux_loss
    return metrics, counts.tolist()


class CapacityLimit:
    """Expert capacity (GShard, Lepikhin et al. 2020, section 2.2; Switch, Fedus et al. 2021,
    section 2.2): each expert takes at most ``ceil(factor * N * k / E)`` of this forward's ``N``
    tokens' assignments, first come (token order) first served; the rest are dropped (their
    weight set to 0: the token passes that expert by through the residual) and counted.

    Installed as a wrapper of the experts module's forward, so it applies before dispatch under
    expert parallelism too (a rank's own tokens decide). Training forwards only: evaluation is
    dropless, so validation loss does not depend on how the held-out rows are spread over ranks.
    """

    def __init__(self, experts: nn.Module, num_experts: int, factor: float, monitor: RouterMonitor, layer: int):
        self.experts, self.num_experts, self.factor = experts, num_experts, factor
        self.monitor, self.layer = monitor, layer

    def install(self) -> None:
        inner = self.experts.forward

        def forward(module, hidden_states, top_k_index, top_k_weights):
            if module.training:  # evaluation runs dropless: its loss does not depend on the layout
                top_k_weights = self.limit(top_k_index, top_k_weights)
            return inner(hidden_states, top_k_index, top_k_weights)
        self.experts.forward = types.MethodType(forward, self.experts)

    def capacity(self, tokens: int, top_k: int) -> int:
        """Assignments one expert may take out of ``tokens`` real tokens' ``top_k`` each (at
        most all of them)."""
        return max(1, min(tokens * top_k, math.ceil(self.factor * tokens * top_k / self.num_experts)))

    def limit(self, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``weights`` ``[N, k]`` with the real tokens' assignments past capacity set to 0;
        padding (the monitor's mask) takes no capacity and is not counted."""
        n, k = ids.shape
        valid = self.monitor.valid_rows(n, ids.device) > 0
        real = valid.repeat_interleave(k)
        cap = self.capacity(int(valid.sum()), k)
        flat = ids.reshape(-1)  # token-major: earlier tokens first
        one_hot = torch.nn.functional.one_hot(flat, self.num_experts) * real[:, None]
        position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # arrival index within its expert
        keep = ((position < cap) | ~real).view(n, k)
        if self.monitor._armed and self.monitor._training:
            dropped = self.monitor.dropped
            dropped[self.layer] += (~keep).sum().to(dropped.device, torch.float64)
        return weights * keep.to(weights.dtype)


def check_model(hf_config: Any, ep: int, capacity_factor: float = 0.0) -> MoeShape | None:
    """What ``recipe.ep`` and ``model.moe_capacity_factor`` need of the model.

    Raises:
        ConfigError: ep > 1 with a dense model, or not dividing the number of experts;
            a capacity factor on a dense model.
    """
    shape = moe_shape(hf_config)
    if shape is None:
        if ep > 1:
            raise ConfigError(f"recipe.ep={ep} but model type {hf_config.model_type!r} has no experts (a dense model); "
                              "use recipe.ep=1, or an MoE model (model=tiny_qwen3_moe, tiny_mixtral, ...)")
        if capacity_factor:
            raise ConfigError(f"model.moe_capacity_factor={capacity_factor} but the model has no experts; leave it 0")
        return None
    if shape.num_experts % ep:
        raise ConfigError(f"recipe.ep={ep} does not divide the model's {shape.num_experts} experts per layer; use an ep "
                          f"that divides {shape.num_experts}")
    return shape


def add_expert_load(saved: list, router: torch.Tensor, num_layers: int, num_experts: int) -> list[list[float]]:
    """Tokens per expert per layer summed over the steps so far: ``saved`` (the checkpointed
    count, empty at first) plus one step's world-summed router counters."""
    counts = router[:num_layers * num_experts].view(num_layers, num_experts)
    previous = torch.tensor(saved, dtype=torch.float64) if saved else torch.zeros_like(counts)
    return (previous + counts).tolist()


def step_record(router: torch.Tensor, num_layers: int, shape: Any, router_coef: float,
                micro_batches: int) -> dict[str, float]:
    """A step's MoE record (:func:`step_metrics`) from the engine's router sums ``router``
    (per-layer counts, then the auxiliary loss summed over ``micro_batches`` micro-batches of
    all data-parallel ranks: averaged here when ``router_coef`` trains it)."""
    aux = float(router[-1]) / micro_batches if router_coef else None
    return step_metrics(router[:-1], num_layers, shape.num_experts, shape.moe_layers, aux)[0]


def write_expert_load(run_dir: Path, step: int, shape: Any, load: list[list[float]]) -> None:
    """``run_dir/expert_load.json``: ``load`` (:func:`add_expert_load`: tokens per expert per
    layer summed over every step so far, the checkpointed count, so a resumed run continues it
    exactly) with the model's ``shape`` (experts, top-k, MoE layers), for the report's heatmap;
    replaced whole. Nothing for a model without experts (``load`` empty)."""
    if not load:
        return
    path = run_dir / "expert_load.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"step": step, "num_experts": shape.num_experts, "top_k": shape.top_k,
                               "moe_layers": list(shape.moe_layers), "tokens_per_expert": load}))
    os.replace(tmp, path)
