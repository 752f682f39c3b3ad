"""Expert parallelism for ``transformers`` mixture-of-experts blocks (``recipe.ep``).

Each MoE layer's ``E`` experts are split over the ``ep`` ranks of an expert-parallel group:
rank ``r`` holds experts ``[r E/ep, (r+1) E/ep)`` (``gate_up_proj``/``down_proj`` become DTensors
``Shard(0)`` on the ep mesh, so checkpoints keep the global ``[E, ...]`` tensors and load onto
any other ep or world size). A token stays on its own rank through attention and routing; only
its hidden state travels to the experts it was routed to and back (GShard, Lepikhin et al.
2020, section 3.2; DeepSpeed-MoE, Rajbhandari et al. 2022; torchtitan's ``ExpertParallel``):

1. sort this rank's ``N k`` (token, expert) assignments by expert and exchange the counts;
2. dispatch: one ``all_to_all_single`` of ``[N k, H]`` hidden states to the experts' ranks;
3. run the local experts on what arrived with ``transformers``' own ``experts_implementation``
   (``grouped_mm``, ``batched_mm`` or ``eager``) on the local weight shard;
4. combine: the inverse ``all_to_all_single``; weight by the router's top-k weights and sum
   per token.

Both exchanges are differentiable (``all_to_all_single_autograd``): backward sends the
gradients the opposite way, so each expert's gradient sums over every token routed to it from
any rank. Dropless: every assignment is computed (a capacity factor, :mod:`llmtrain.models.moe`,
drops before dispatch). Per MoE layer and direction a rank sends ``N k H`` elements, of which
``(ep - 1) / ep`` leave the rank when routing is uniform.

The ep group is made of ``ep`` neighbouring ranks of ``dp_shard``; the remaining ``dp_shard /
ep`` ranks (and ``dp_replicate``) hold the same experts and FSDP2-shard them (torchtitan's
``dp_shard_mod_ep``), while dense layers shard over all of ``dp_shard`` as before.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn


def expert_meshes(mesh, dims) -> tuple[Any, Any]:
    """``(ep mesh, expert FSDP mesh)`` from the engine's mesh: ``dp_shard`` unflattened into
    ``(dp_shard / ep, ep)``; the FSDP mesh of experts is ``dp_shard / ep`` (under
    ``dp_replicate`` as 2-D HSDP when that is > 1). Both share the root mesh, which FSDP2
    needs to shard DTensor parameters again (2-D)."""
    split = mesh._unflatten("dp_shard", (dims.dp_shard // dims.ep, dims.ep), ("dp_shard_mod_ep", "ep"))
    fsdp = split["dp_replicate", "dp_shard_mod_ep"] if dims.dp_replicate > 1 else split["dp_shard_mod_ep"]
    return split["ep"], fsdp


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ExpertParallelExperts:
    """Shards one ``experts`` module over ``ep_mesh`` and replaces its forward by dispatch /
    local experts / combine (see the module docstring). The module keeps its class, its
    parameter names and its ``experts_implementation``.

    Args:
        experts: a ``transformers`` experts module with 3-D ``gate_up_proj`` / ``down_proj`` (and
            optional biases) ``[E, ...]``.
        ep_mesh: 1-D mesh of the ep group.
    """

    def __init__(self, experts: nn.Module, ep_mesh):
        from torch.distributed.tensor import Shard, distribute_tensor

        self.experts, self.mesh = experts, ep_mesh
        self.group = ep_mesh.get_group()
        self.ep, self.rank = ep_mesh.size(), ep_mesh.get_local_rank()
        self.num_experts = experts.num_experts
        self.local_experts = self.num_experts // self.ep
        self.original_forward = type(experts).forward
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)]) if not param.is_meta else \
                _meta_dtensor(param, ep_mesh)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.forward = types.MethodType(self._forward, experts)

    def _shadow(self, module: nn.Module) -> nn.Module:
        """A view of ``module`` whose parameters are this rank's local experts, for the
        ``transformers`` implementation to run as if the model had ``E / ep`` experts."""
        shadow = object.__new__(type(module))
        shadow.__dict__.update(module.__dict__)
        # A local expert's gradient sums over the tokens of all ep ranks (the all-to-all's
        # backward), while FSDP2 then averages over the dp_shard / ep ranks holding the same
        # experts: 1/ep makes that the mean over every data-parallel rank, as for dense weights
        # (torchtitan sets FSDP's divide factor instead, which needs PREMUL_SUM, absent in gloo).
        shadow._parameters = {name: _ScaleGradient.apply(_local(p), 1.0 / self.ep)
                              for name, p in module._parameters.items()}
        shadow.num_experts = self.local_experts
        return shadow

    def _forward(self, module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` ``[N, H]``, ``top_k_index``/``top_k_weights`` ``[N, k]`` (global
        expert ids) -> ``[N, H]``: each token's weighted sum of its experts' outputs."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        n, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        source_token = order // k
        counts = torch.bincount(flat, minlength=self.num_experts)  # [E] assignments per expert
        arrived = torch.empty_like(counts)
        torch.distributed.all_to_all_single(arrived, counts, group=self.group)
        send = counts.view(self.ep, self.local_experts).sum(1).tolist()
        arrived = arrived.view(self.ep, self.local_experts)  # [source rank, local expert]
        receive = arrived.sum(1).tolist()
        received = all_to_all_single_autograd(hidden_states[source_token].contiguous(), receive, send, self.group)
        # Arrivals are ordered by (source rank, local expert): each source sent its tokens sorted.
        local_ids = torch.repeat_interleave(torch.arange(self.local_experts, device=flat.device).repeat(self.ep),
                                            arrived.flatten())
        ones = torch.ones(len(local_ids), 1, dtype=hidden_states.dtype, device=hidden_states.device)
        shadow = self._shadow(module)
        outputs = self.original_forward(shadow, received, local_ids[:, None], ones)
        # Keep the local experts in the graph even when no token reached them (the eager loop
        # then touches no weight): every rank must run both all-to-alls' backward, and FSDP2
        # must reduce the same gradients on every rank, or the collectives hang.
        outputs = outputs + 0.0 * (received.sum() + sum(p.sum() for p in shadow._parameters.values()))
        returned = all_to_all_single_autograd(outputs.contiguous(), send, receive, self.group)
        weighted = returned * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(returned.dtype)
        combined = torch.zeros(n, hidden_states.shape[-1], dtype=weighted.dtype, device=weighted.device)
        return combined.index_add(0, source_token, weighted).to(hidden_states.dtype)


def _meta_dtensor(param: torch.Tensor, mesh):
    """A meta-device DTensor ``Shard(0)`` of ``param``'s global shape (models built on meta are
    materialised after sharding)."""
    from torch.distributed.tensor import DTensor, Shard

    local = torch.empty((param.shape[0] // mesh.size(), *param.shape[1:]), dtype=param.dtype, device="meta")
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=param.shape,
                              stride=param.stride())


def apply_expert_parallel(module: nn.Module, ep_mesh) -> list[nn.Module]:
    """Shard every sparse block's experts of ``module`` (a causal LM or pipeline stage) over
    ``ep_mesh``; returns the experts modules (FSDP2 wraps each on its own mesh)."""
    from llmtrain.models.moe import sparse_blocks

    wrapped = []
    for _, block in sparse_blocks(module):
        ExpertParallelExperts(block.experts, ep_mesh)
        wrapped.append(block.experts)
    return wrapped
