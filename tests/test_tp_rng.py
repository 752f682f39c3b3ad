"""Tensor-parallel ranks draw apart inside attention (head-sharded activations) and together
outside it (replicated activations); activation checkpointing recomputes the same masks."""

from __future__ import annotations

import torch
from torch import nn

from llmtrain.parallel.parallelize import apply_tp_rng, attention_modules


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1, 1, 64).reshape(8, 8))

    def forward(self, x):
        return nn.functional.dropout(x @ self.weight, p=0.5, training=True)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Attention()

    def forward(self, x):
        out = self.self_attn(x)
        self.outside = torch.rand(16)  # a draw outside attention: replicated activations' dropout
        return out


def _run(tp_rank: int, checkpointed: bool = False, streams: bool = True):
    torch.manual_seed(7)  # the stream the TP group shares
    layer = Layer()
    if streams:
        apply_tp_rng(attention_modules([layer]), tp_rank)
    x = torch.ones(4, 8, requires_grad=True)
    masks = []
    layer.self_attn.register_forward_hook(lambda m, a, out: masks.append((out != 0).clone()))
    if checkpointed:
        from torch.utils.checkpoint import checkpoint

        out = checkpoint(layer, x, use_reentrant=False)
    else:
        out = layer(x)
    out.sum().backward()
    return masks[0], layer.outside, layer.self_attn.weight.grad.clone(), torch.get_rng_state()


def test_tp_ranks_draw_different_attention_masks_and_the_same_outside():
    inner0, outside0, _, after0 = _run(0)
    inner1, outside1, _, after1 = _run(1)
    assert not torch.equal(inner0, inner1)  # the sharded heads' dropout differs per TP rank
    assert torch.equal(outside0, outside1)  # the replicated activations' draws agree
    assert torch.equal(after0, after1)  # and the shared stream stays in step
    # Without the per-rank streams both ranks would repeat one mask on their different heads.
    assert torch.equal(_run(0, streams=False)[0], _run(1, streams=False)[0])


def test_activation_checkpointing_recomputes_the_same_tp_masks():
    for tp_rank in (0, 1):
        _, _, grad, _ = _run(tp_rank)
        _, _, grad_checkpointed, _ = _run(tp_rank, checkpointed=True)
        torch.testing.assert_close(grad_checkpointed, grad, rtol=0, atol=0)
