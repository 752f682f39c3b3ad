"""A memory-lean output layer: next-token log-probabilities computed chunk by chunk from the last
hidden states, so neither the ``[tokens, vocab]`` logits nor their gradient ever exist whole.

The same technique as DeepSpeed's ``TiledFusedLogitsLoss``, Liger-Kernel's fused linear
cross-entropy and Apple's Cut Cross-Entropy (Wijmans et al., "Cut Your Losses in Large-Vocabulary
Language Models", 2024): per chunk of ``trainer.loss_chunk_tokens`` tokens, ``logits = h W^T``,
the log-sum-exp and the target's logit are taken and the logits dropped; backward recomputes each
chunk's logits and forms ``d logits = g (onehot - softmax)``, then ``dh = d logits W`` and
``dW += d logits^T h``. Peak extra memory is one chunk's logits (and their gradient) instead of
all tokens', at the cost of one more output-layer matmul per token in backward.

Own code rather than a library: DeepSpeed's ``TiledFusedLogitsLoss`` takes a loss function over
whole logits chunks and has no tensor-parallel (vocab-sharded) head; Liger needs Triton (GPU);
Cut Cross-Entropy's kernels need Triton too (its ``torch_compile`` fallback has no vocab-parallel
head either). Here a tensor-parallel head sharded along the vocabulary (``ColwiseParallel``,
Megatron-LM's vocab-parallel cross-entropy, Shoeybi et al. 2019, section 3) reduces the
log-sum-exp and the target logit over the tensor-parallel group instead of gathering logits.

The head is swapped in place (``lm_head.forward``), so parameter names, FSDP2 units, ZeRO-3
hooks and tensor-parallel wrapping are unchanged; while no targets are set it is the plain
output layer.
"""

from __future__ import annotations

import types

import torch

from llmtrain.common.labels import IGNORE_INDEX


def _reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(x, op=op, group=group)
    return x


class ChunkedLabelLogps(torch.autograd.Function):
    """``log softmax(h W^T + b)[target]`` per token, chunk by chunk.

    Inputs: ``hidden`` ``[N, H]``; ``weight`` ``[V_local, H]`` (this rank's vocabulary rows,
    starting at ``vocab_start``); ``bias`` ``[V_local]`` or None; ``targets`` ``[N]`` token ids
    (``-100`` = none); ``chunk`` tokens per chunk; ``group``: the tensor-parallel group the
    vocabulary is sharded over (None = whole vocabulary here). Output fp32 ``[N]`` (0 where
    the target is -100).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, group, vocab_start, shape=None):
        import torch.distributed as dist

        device = hidden.device.type
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device), device)
        n, v_local = hidden.shape[0], weight.shape[0]
        # Allocated in the caller's shape (``shape``, e.g. [B, T]): a view of it returned from an
        # FSDP2 root would make FSDP2 warn about in-place use of views.
        whole = torch.zeros(shape or (n,), dtype=torch.float32, device=hidden.device)
        out = whole.view(-1)
        lses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            logits = ChunkedLabelLogps._logits(hidden[start:stop], weight, bias)
            local = targets[start:stop] - vocab_start
            mine = (local >= 0) & (local < v_local)
            picked = logits.gather(1, local.clamp(0, v_local - 1)[:, None])[:, 0] * mine
            picked = _reduce(picked, dist.ReduceOp.SUM, group)
            peak = _reduce(logits.max(dim=1).values, dist.ReduceOp.MAX, group)
            # In place: one chunk of logits is the only [chunk, vocab] tensor alive.
            total = _reduce(logits.sub_(peak[:, None]).exp_().sum(dim=1), dist.ReduceOp.SUM, group)
            del logits
            lse = peak + torch.log(total)
            valid = targets[start:stop] != IGNORE_INDEX
            out[start:stop] = torch.where(valid, picked - lse, torch.zeros_like(lse))
            lses[start:stop] = lse
        ctx.save_for_backward(hidden, weight, bias, targets, lses)
        ctx.chunk, ctx.group, ctx.vocab_start = chunk, group, vocab_start
        return whole

    @staticmethod
    def _logits(hidden, weight, bias):
        logits = (hidden @ weight.t()).float()
        if bias is not None:
            logits += bias
        return logits

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        hidden, weight, bias, targets, lses = ctx.saved_tensors
        grad = grad.reshape(-1)
        enabled, dtype, device = ctx.autocast
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if bias is not None else None
        v_local = weight.shape[0]
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            for start in range(0, hidden.shape[0], ctx.chunk):
                stop = min(hidden.shape[0], start + ctx.chunk)
                h = hidden[start:stop]
                g = (grad[start:stop] * (targets[start:stop] != IGNORE_INDEX)).float()
                # softmax x -g, in place over the recomputed logits (one [chunk, vocab] tensor)
                d_logits = ChunkedLabelLogps._logits(h, weight, bias).sub_(lses[start:stop, None]).exp_()
                d_logits.mul_(-g[:, None])
                local = targets[start:stop] - ctx.vocab_start
                mine = (local >= 0) & (local < v_local)
                rows = torch.nonzero(mine)[:, 0]
                d_logits[rows, local[rows]] += g[rows]
                grad_hidden[start:stop] = (d_logits.to(weight.dtype) @ weight).to(hidden.dtype)
                grad_weight += (d_logits.t() @ h.float())
                if grad_bias is not None:
                    grad_bias += d_logits.sum(0)
        _reduce(grad_hidden, dist.ReduceOp.SUM, ctx.group)  # each rank's vocabulary rows add to dh
        return (grad_hidden, grad_weight.to(weight.dtype),
                grad_bias.to(bias.dtype) if grad_bias is not None else None, None, None, None, None, None)


class ChunkedHead:
    """The output layer of a causal LM, swapped to return label log-probs while :attr:`targets` is set.

    Set :attr:`targets` (``[B, T]``: the token each position predicts, -100 for none) before a
    forward; the model's ``logits`` are then fp32 ``[B, T]`` log-probabilities of those targets
    (0 where -100). With :attr:`targets` None the head is the plain output layer.
    """

    def __init__(self, head: torch.nn.Module, chunk_tokens: int):
        self.head, self.chunk = head, int(chunk_tokens)
        self.targets: torch.Tensor | None = None
        plain = head.forward
        owner = self

        def forward(module, hidden):
            if owner.targets is None:
                return plain(hidden)
            return owner._label_logps(module, hidden, owner.targets)

        head.forward = types.MethodType(forward, head)

    def _label_logps(self, module: torch.nn.Module, hidden, targets: torch.Tensor):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        weight, bias = module.weight, getattr(module, "bias", None)
        group, start, mesh = None, 0, None
        if isinstance(weight, DTensor):
            mesh = weight.device_mesh
            if any(isinstance(p, Shard) for p in weight.placements):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                group = mesh.get_group()
                start = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)[1][0]
            weight = weight.to_local()
            bias = bias.to_local() if isinstance(bias, DTensor) else bias
        if isinstance(hidden, DTensor):
            mesh = hidden.device_mesh
            hidden = hidden.to_local()
        rows, length = hidden.shape[:2]
        logps = ChunkedLabelLogps.apply(hidden.reshape(rows * length, -1), weight, bias,
                                        targets.reshape(-1).to(hidden.device), self.chunk, group, start, (rows, length))
        if mesh is not None:  # ColwiseParallel's output hook expects a DTensor; the values are whole
            logps = DTensor.from_local(logps, mesh, [Replicate()], run_check=False)
        return logps


def check_model(hf_config) -> None:
    """A model whose forward transforms the head's output (Gemma-2's ``final_logit_softcapping``)
    would transform the log-probs the chunked head returns instead of the logits.

    Raises:
        ConfigError: naming the model field.
    """
    from llmtrain.common.errors import ConfigError

    cap = getattr(hf_config, "final_logit_softcapping", None)
    if cap:
        raise ConfigError(f"trainer.loss_chunk_tokens with a model whose logits are soft-capped after the output layer "
                          f"(final_logit_softcapping={cap}): the chunked head returns log-probs, not logits; set "
                          "trainer.loss_chunk_tokens=0")


def install(model: torch.nn.Module, chunk_tokens: int) -> ChunkedHead:
    """Swap ``model``'s output embedding (``get_output_embeddings()``) for a :class:`ChunkedHead`.

    Raises:
        ValueError: the model has no output embedding (a classification head).
        ConfigError: see :func:`check_model`.
    """
    check_model(model.config)
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embedding for trainer.loss_chunk_tokens")
    return ChunkedHead(head, chunk_tokens)
