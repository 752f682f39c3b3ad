"""The chunked output layer (``trainer.loss_chunk_tokens``, :mod:`llmtrain.models.chunked_loss`):

* label log-probs, loss and gradients (hidden, weight, bias) equal float64 ``cross_entropy`` over
  whole logits within 1e-6 (relative), with ignored labels and a last chunk shorter than the rest;
* a vocabulary sharded over 2 tensor-parallel ranks (spawned gloo processes) gives the same;
* the peak extra bytes (torch profiler's allocation timeline) at Llama-3's vocabulary of 128,256
  are at most 1/8 of the plain loss's when chunks are 1/8 of the tokens;
* wired into a model: the loss a causal LM trains on equals the plain logits' loss.

Training runs with it (FSDP2 with cp, ZeRO-3, a tensor-parallel untied head) are in
``tests/test_context_parallel.py``, sharing its launches.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from llmtrain.models.chunked_loss import ChunkedLabelLogps, install


def _reference(hidden, weight, bias, targets):
    logits = hidden.double() @ weight.double().t() + (bias.double() if bias is not None else 0)
    return -F.cross_entropy(logits, targets, ignore_index=-100, reduction="none")


def _inputs(n=300, h=16, v=1000, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = (torch.randn(v, h, generator=g) * 0.3).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = -100
    return hidden, weight, b, targets


def _grads(*tensors):
    return [t.grad.clone() if t is not None else None for t in tensors]


@pytest.mark.parametrize("chunk", [1, 64, 300, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_label_logps_and_gradients_equal_float64_cross_entropy(chunk, bias):
    hidden, weight, b, targets = _inputs(bias=bias)
    weights = torch.linspace(0.5, 1.5, len(targets))  # a non-uniform upstream gradient
    got = ChunkedLabelLogps.apply(hidden, weight, b, targets, chunk, None, 0)
    (got * weights).sum().backward()
    mine = _grads(hidden, weight, b)
    for t in (hidden, weight, b):
        if t is not None:
            t.grad = None
    ref = _reference(hidden, weight, b, targets)
    (ref * weights.double()).sum().backward()
    assert torch.equal(got == 0, targets == -100)
    torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    for g, t in zip(mine, (hidden, weight, b)):
        if t is not None:
            torch.testing.assert_close(g.double(), t.grad.double(), rtol=1e-6, atol=1e-6)


def _peak_bytes(fn) -> int:
    """Peak bytes allocated while ``fn`` runs, from the profiler's allocation events in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    level = peak = 0
    for _, nbytes in events:
        level += nbytes
        peak = max(peak, level)
    return peak


def test_peak_extra_bytes_at_llama3_vocab_are_an_eighth_of_the_plain_loss():
    tokens, vocab, hidden_size = 1024, 128_256, 32
    hidden, weight, _, targets = _inputs(tokens, hidden_size, vocab, bias=False)

    def plain():
        F.cross_entropy(hidden @ weight.t(), targets, ignore_index=-100, reduction="sum").backward()

    def chunked():
        (-ChunkedLabelLogps.apply(hidden, weight, None, targets, tokens // 8, None, 0).sum()).backward()

    peaks = {}
    for fn in (plain, chunked):
        hidden.grad = weight.grad = None
        peaks[fn.__name__] = _peak_bytes(fn)
    grads = weight.numel() * 4 + hidden.numel() * 4  # both losses end holding the gradients
    logits = tokens * vocab * 4
    assert peaks["plain"] - grads >= logits  # the plain loss holds at least the whole logits
    assert peaks["chunked"] - grads <= (peaks["plain"] - grads) / 8, peaks


def _tp_worker(rank: int, world: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        hidden, weight, b, targets = _inputs(n=120, v=1001, bias=True)
        rows = -(-weight.shape[0] // world)  # torch's Shard(0) split: ceil, the last rank shorter
        start, stop = rank * rows, min(weight.shape[0], (rank + 1) * rows)
        w_local = weight.detach()[start:stop].clone().requires_grad_()
        b_local = b.detach()[start:stop].clone().requires_grad_()
        h = hidden.detach().clone().requires_grad_()
        got = ChunkedLabelLogps.apply(h, w_local, b_local, targets, 32, dist.group.WORLD, start)
        got.sum().backward()
        ref = _reference(hidden, weight, b, targets)
        ref.sum().backward()
        out[rank] = {"logps": float((got.double() - ref.detach()).abs().max()),
                     "dh": float((h.grad.double() - hidden.grad.double()).abs().max()),
                     "dW": float((w_local.grad.double() - weight.grad[start:stop].double()).abs().max()),
                     "db": float((b_local.grad.double() - b.grad[start:stop].double()).abs().max())}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_vocabulary_sharded_over_tensor_parallel_ranks_equals_whole():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.start_processes(_tp_worker, args=(2, port, out), nprocs=2, start_method="spawn")
    for rank in range(2):
        for key, err in out[rank].items():
            assert err < 1e-5, f"rank {rank} {key}: {err}"


def test_installed_head_gives_the_plain_loss_and_gradients():
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.objectives.causal_lm import token_cross_entropy_sum

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 300, (2, 40))
    labels = ids.clone()
    labels[:, :7] = -100
    plain = token_cross_entropy_sum(model(input_ids=ids).logits, labels)
    plain.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    head = install(model, chunk_tokens=16)
    head.targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    logps = model(input_ids=ids).logits
    assert logps.shape == (2, 40)
    chunked = token_cross_entropy_sum(logps, labels)
    chunked.backward()
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=0)
    for name, p in model.named_parameters():
        err = float((p.grad - expected[name]).abs().max())
        assert err <= 1e-6 * float(expected[name].abs().max()), (name, err)
    head.targets = None
    assert model(input_ids=ids).logits.shape == (2, 40, 300)  # no targets: the plain output layer


@pytest.mark.parametrize("name", ["causal_lm", "dpo", "simpo"])
def test_objectives_give_the_same_sums_from_label_logps_as_from_logits(name):
    """The seam the chunked head feeds: each objective that declares ``label_logps_only`` gives
    the same loss and metrics from next-label log-probs ``[B, T]`` as from the logits."""
    from omegaconf import OmegaConf

    from llmtrain.data.preference import PairCollator
    from llmtrain.objectives import build_objective

    torch.manual_seed(0)
    objective = build_objective(OmegaConf.create({"name": name, "beta": 0.1, "loss_type": "sigmoid",
                                                  "label_smoothing": 0.0, "gamma": 0.5}))
    assert objective.label_logps_only
    if name == "causal_lm":
        ids = torch.randint(0, 50, (3, 12))
        batch = {"input_ids": ids, "labels": ids.masked_fill(torch.rand(3, 12) < 0.3, -100)}
    else:
        items = [{"chosen_ids": torch.randint(0, 50, (n,)).tolist(), "rejected_ids": torch.randint(0, 50, (n + 2,)).tolist(),
                  "prompt_len": 3} for n in (6, 9)]
        batch = PairCollator(0)(items)
        batch["ref_logps"] = torch.zeros(batch["input_ids"].shape)
        batch["ref_logps"][batch["labels"] != -100] = -1.5
    logits = torch.randn(*batch["input_ids"].shape, 50)
    shifted = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    label_logps = torch.where(shifted != -100, torch.log_softmax(logits, -1).gather(
        -1, shifted.clamp(min=0)[..., None])[..., 0], torch.zeros(()))
    whole, chunked = objective.loss_sums(logits, batch), objective.loss_sums(label_logps, batch)
    torch.testing.assert_close(chunked.loss, whole.loss, rtol=1e-6, atol=1e-6)
    for key, value in whole.metrics.items():
        torch.testing.assert_close(chunked.metrics[key], value, rtol=1e-6, atol=1e-6, msg=key)
