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
   (``grouped_mm``, ``batched_mm`` or ``eager``) on the local weight shard, one call per
   source rank;
4. combine: the inverse ``all_to_all_single``; weight by the router's top-k weights and sum
   per token.

Each step repeats the unsharded module's arithmetic for the source rank's tokens: the same
rows in the same order per expert GEMM, the same weighting and order of additions. So a
rank's expert outputs and input gradients are bitwise those of 1 process on its tokens, and a
local expert's weight gradient is bitwise the sum of the ranks' gradients for one micro-batch
(``tests/test_moe.py``, also with AVX2 kernels). A whole run still is not bitwise 1 process:
like any data-parallel layout, it sums the micro-batches' gradients in another order.

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
        expert ids) -> ``[N, H]``: each token's weighted sum of its experts' outputs, bitwise
        what the unsharded module computes for this rank's tokens (see :func:`_arrival_order`)."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        n, k = top_k_index.shape
        implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
        order = _arrival_order(top_k_index, implementation)  # [N k] assignments, by expert
        counts = torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts)  # [E] assignments per expert
        arrived = torch.empty_like(counts)
        torch.distributed.all_to_all_single(arrived, counts, group=self.group)
        send = counts.view(self.ep, self.local_experts).sum(1).tolist()
        arrived = arrived.view(self.ep, self.local_experts)  # [source rank, local expert]
        receive = arrived.sum(1).tolist()
        outgoing = _gather(hidden_states, top_k_index, order, implementation)
        received = all_to_all_single_autograd(outgoing, receive, send, self.group)
        shadow = self._shadow(module)
        outputs = self._local_experts(shadow, received, arrived, implementation, top_k_weights.dtype)
        # Keep the local experts in the graph even when no token reached them (the eager loop
        # then touches no weight): every rank must run both all-to-alls' backward, and FSDP2
        # must reduce the same gradients on every rank, or the collectives hang. Adding 0.0
        # changes no bit of an output or a gradient.
        outputs = outputs + 0.0 * (received.sum() + sum(p.sum() for p in shadow._parameters.values()))
        returned = all_to_all_single_autograd(outputs.contiguous(), send, receive, self.group)
        return _combine(returned, order, top_k_index, top_k_weights, implementation, hidden_states.dtype)

    def _local_experts(self, shadow: nn.Module, received: torch.Tensor, arrived: torch.Tensor,
                       implementation: str | None, weight_dtype: torch.dtype) -> torch.Tensor:
        """Run the local experts on ``received`` ``[M, H]`` (ordered by source rank, then local
        expert: ``arrived`` ``[ep, E / ep]`` counts) -> ``[M, H]`` unweighted outputs.

        One call per source rank, not one over all arrivals: a CPU GEMM's row may round
        differently with another row count (measured with AVX2 kernels and with small groups),
        so each call gets exactly the rows, in the order, that the source's own unsharded
        module gives that expert; its weight gradient then sums the same products in the same
        order too."""
        device = received.device
        outputs, start = [], 0
        for per_expert in arrived.tolist():
            rows = received[start:start + sum(per_expert)]
            start += len(rows)
            if not len(rows):
                outputs.append(rows)
                continue
            local_ids = torch.repeat_interleave(torch.arange(self.local_experts, device=device),
                                                torch.tensor(per_expert, device=device))[:, None]
            # Unit weights in the router's dtype: the product is exact, so no rounding happens
            # before _combine weighs the output as the unsharded module does.
            ones = torch.ones(len(rows), 1, dtype=weight_dtype, device=device)
            inverse, single = None, implementation == "batched_mm" and len(rows) == 1
            if single:
                # A batch of one takes torch.bmm's matrix-vector path, which rounds otherwise
                # than its batched one (the unsharded module's, with N k >= 2 rows): add a copy
                # whose output is dropped (its gradient, zero, changes no bit).
                rows, local_ids, ones = rows.expand(2, -1), local_ids.expand(2, -1), ones.expand(2, -1)
            if implementation not in ("eager", "batched_mm"):
                # grouped_mm sorts its ids again with torch.sort, which is not stable: place the
                # rows where that sort takes them from, so its groups hold them in arrival order.
                taken = torch.sort(local_ids.reshape(-1)).indices
                inverse = torch.empty_like(taken)
                inverse[taken] = torch.arange(len(taken), device=device)
                rows = rows[inverse]
            out = self.original_forward(shadow, rows, local_ids, ones)
            outputs.append(out[:1] if single else out if inverse is None else out[taken])
        return torch.cat(outputs)


def _arrival_order(top_k_index: torch.Tensor, implementation: str | None) -> torch.Tensor:
    """``[N k]`` flat assignment positions (``token * k + slot``) sorted by expert, each expert's
    assignments in the order the unsharded ``implementation`` meets them, so the local experts'
    GEMMs see the same rows in the same order: ``torch.sort``'s own (unstable) order of the ids
    for ``grouped_mm``, token order for ``batched_mm``, slot-major order for ``eager`` (its
    ``torch.where`` over a ``[k, N]`` mask)."""
    n, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    if implementation not in ("eager", "batched_mm"):
        return torch.sort(flat).indices  # the same call as transformers' grouped_mm
    position = torch.arange(n * k, device=flat.device)
    if implementation == "eager":
        position = (position % k) * n + position // k  # slot-major
    return torch.sort(flat * (n * k) + position).indices  # unique keys: any sort gives this order


def _gather(hidden_states: torch.Tensor, top_k_index: torch.Tensor, order: torch.Tensor,
            implementation: str | None) -> torch.Tensor:
    """``[N k, H]``: the hidden state of each assignment in ``order``, gathered with the
    unsharded implementation's operations so that backward adds a token's ``k`` input
    gradients in the same order (which matters from top-3 on): one gather for ``grouped_mm``,
    ``repeat_interleave`` for ``batched_mm``, one gather per expert (ascending) for ``eager``."""
    n, k = top_k_index.shape
    if implementation == "batched_mm":
        return hidden_states.repeat_interleave(k, dim=0)[order]
    if implementation != "eager":
        return hidden_states[order // k]
    experts = top_k_index.reshape(-1)[order]
    bounds = torch.bincount(experts).tolist()
    tokens = (order // k).split(bounds)
    return torch.cat([hidden_states[t] for t in tokens if len(t)])


def _combine(returned: torch.Tensor, order: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor, implementation: str | None, dtype: torch.dtype) -> torch.Tensor:
    """Weigh the experts' outputs ``returned`` ``[N k, H]`` (in ``order``) by ``top_k_weights``
    ``[N, k]`` and sum each token's ``k`` -> ``[N, H]`` in ``dtype``, with the unsharded
    implementation's operations, dtypes and order of additions: ``eager`` adds each product,
    cast to ``dtype``, in ascending expert order; the others sum ``[N, k, H]`` over ``k`` in
    the weights' promoted dtype, then cast."""
    n, k = top_k_index.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=order.device)
    weighted = returned * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    if implementation != "eager":
        return weighted[inverse].view(n, k, -1).sum(dim=1).to(dtype)
    weighted = weighted.to(dtype)[inverse].view(n, k, -1)
    by_expert = torch.argsort(top_k_index, dim=1)  # [N, k] slots in ascending expert order
    combined = torch.zeros(n, weighted.shape[-1], dtype=dtype, device=weighted.device)
    tokens = torch.arange(n, device=weighted.device)
    for j in range(k):  # += the j-th expert's product, as eager's index_add_ of expert after expert
        combined = combined + weighted[tokens, by_expert[:, j]]
    return combined


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
