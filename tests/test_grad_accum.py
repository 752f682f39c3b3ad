"""Gradient accumulation and data parallelism give the gradient of one big batch.

Four variable-length, right-padded sequences: the gradient of their global mean token loss,
computed directly, must equal (within 1e-6) what the engine accumulates for micro-batch 1 x
accumulation 4, micro-batch 4 x accumulation 1, and the same split across 2 DDP ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from conftest import cores_for, make_cfg
from llmtrain import data
from llmtrain.parallel.distributed import DistEnv
from llmtrain.engine.torch_engine import TorchEngine
from llmtrain.models.build import build_model, byte_tokenizer
from llmtrain.objectives import CausalLM
from llmtrain.objectives.causal_lm import token_cross_entropy_sum
from llmtrain.trainer import forward_backward

LENGTHS = [5, 11, 16, 8]


def samples() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(0, 256, (n,), generator=gen).tolist()
        labels = list(ids)
        labels[: i + 1] = [-100] * (i + 1)  # a masked prompt of varying length
        out.append({"input_ids": ids, "labels": labels})
    return out


def tiny_cfg(*extra: str):
    return make_cfg(["model.architecture.hidden_size=32", "model.architecture.intermediate_size=64",
                     "model.architecture.num_hidden_layers=2", "trainer.grad_clip=0", *extra])


def reference_grads() -> dict[str, torch.Tensor]:
    cfg = tiny_cfg()
    model = build_model(cfg.model, seed=5)
    batch = data.Collator(257)(samples())
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    n = (batch["labels"][:, 1:] != -100).sum()
    (token_cross_entropy_sum(logits, batch["labels"]) / n).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def engine_grads(rank: int, world: int, micro: int, *extra: str) -> dict[str, torch.Tensor]:
    cfg = tiny_cfg(*extra)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    engine = TorchEngine(cfg, env, accumulation_steps=4 // (micro * world), objective=CausalLM())
    engine.setup(build_model(cfg.model, seed=5))
    mine = samples()[rank * 4 // world:(rank + 1) * 4 // world]
    batches = [data.Collator(257)(mine[i:i + micro]) for i in range(0, len(mine), micro)]
    forward_backward(engine, batches)
    return {k: p.grad.clone() for k, p in engine.model.named_parameters()}


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)


def test_padded_sequences_really_differ_in_length():
    batch = data.Collator(byte_tokenizer().pad_token_id)(samples())
    assert batch["attention_mask"].sum(1).tolist() == LENGTHS


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_accumulation_equals_one_big_batch(micro):
    assert_same(engine_grads(0, 1, micro), reference_grads())


def test_compiled_decoder_layers_equal_one_big_batch():
    # recipe.compile=true on one process: each decoder layer runs as an inductor-compiled graph
    # (the torch engine once ignored the knob), and the gradient still equals the eager
    # full-batch reference, up to inductor's fused rounding.
    from torch._dynamo.utils import counters

    from llmtrain.parallel.parallelize import compiled_graphs

    torch._dynamo.reset()
    counters.clear()
    try:
        got = engine_grads(0, 1, 4, "recipe.compile=true")
        assert counters["frames"]["ok"] >= 1 and counters["inductor"]["fxgraph_cache_miss"] + \
            counters["inductor"]["fxgraph_cache_hit"] >= 1, dict(counters)
        assert compiled_graphs() >= 1
        want = reference_grads()
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    finally:
        torch._dynamo.reset()


def test_compile_on_a_model_without_decoder_layers_names_the_knob():
    from transformers import GPT2Config, GPT2LMHeadModel

    from llmtrain.common.errors import ConfigError
    from llmtrain.parallel.parallelize import decoder_layers

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    with pytest.raises(ConfigError, match="'gpt2' keeps no decoder layers.*recipe.compile"):
        decoder_layers(gpt2)


def _worker(rank: int, world: int, micro: int, rendezvous: str, out: str) -> None:
    # A file rendezvous: no free-port race with other processes on the machine.
    torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    grads = engine_grads(rank, world, micro)
    if rank == 0:
        torch.save(grads, out)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("micro", [1, 2])
def test_two_ranks_equal_one_big_batch(tmp_path, micro):
    out = str(tmp_path / "grads.pt")
    with cores_for(2):
        mp.spawn(_worker, args=(2, micro, str(tmp_path / "rendezvous"), out), nprocs=2, join=True)
    assert_same(torch.load(out), reference_grads())
