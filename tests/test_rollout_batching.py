"""The ``hf`` engine's batched sampling (:func:`llmtrain.rollout.generate.sample_batch`): every
generation batch has ``rollout.generation_batch`` rows and the step's longest prompt as its
width, so a completion is bit for bit the same however the step's prompts are shared out
between ranks and grouped into batches. Checked against the same prompts on simulated layouts
(1, 2 and 3 ranks, batches of other prompts, each prompt alone) and, for greedy rows, against
the unpadded decode of one prompt at a time."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch


def _model(dtype: torch.dtype) -> torch.nn.Module:
    """A small Llama with SmolLM2's head layout (grouped-query attention, tied embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
    return LlamaForCausalLM(config).eval().to(dtype)


def _prompts() -> list[dict]:
    generator = torch.Generator().manual_seed(3)
    return [{"prompt_ids": torch.randint(2, 512, (n,), generator=generator).tolist(), "record": k}
            for k, n in enumerate([7, 19, 3, 12, 25, 9, 16])]


class _Policy:
    """What the engine reads of a training engine: the whole model, its device, no autocast."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.env, self.generation_autocast = model, SimpleNamespace(device=torch.device("cpu")), None

    @contextlib.contextmanager
    def generation_model(self):
        yield self.model


def _layout(monkeypatch, model, samples: list[dict], ranks: int, rows: int, **sampling) -> dict:
    """``samples`` shared out in contiguous slices between ``ranks`` simulated ranks, each sampling
    its share with ``rows``-row batches (the width all-reduced over every rank's prompts): each
    (record, seed)'s completion ids."""
    from llmtrain.rollout import engines
    from llmtrain.rollout.generate import Sampling

    longest = max(len(s["prompt_ids"]) for s in samples)
    monkeypatch.setattr(engines.distributed, "all_reduce_max", lambda value: torch.maximum(value, torch.tensor(longest)))
    cfg = SimpleNamespace(rollout=SimpleNamespace(generation_batch=rows))
    sampler = engines.PolicySampler(cfg, None, Sampling(max_new=10, end_ids=frozenset([1]), **sampling))
    out = {}
    share = -(-len(samples) // ranks)
    for rank in range(ranks):
        mine = samples[rank * share:(rank + 1) * share]
        seeds = [[100 * s["record"] + k for k in range(3)] + [None] for s in mine]
        for sample, row_seeds, group in zip(mine, seeds, sampler.sample(_Policy(model), mine, seeds)):
            out.update({(sample["record"], seed): c.ids for seed, c in zip(row_seeds, group)})
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_completions_do_not_depend_on_how_prompts_are_grouped(monkeypatch, dtype):
    """The same 7 prompts (3-25 tokens), 3 seeded rows and 1 greedy row each, in batches of 5 rows:
    on 1, 2 and 3 simulated ranks, in reverse order, and each prompt with dummy rows only, every
    completion's ids are equal; the seeds give different completions (the draws are not greedy)."""
    model, samples = _model(dtype), _prompts()
    one = _layout(monkeypatch, model, samples, ranks=1, rows=5, temperature=1.0, top_k=50, top_p=0.9)
    assert len(one) == 28 and len({tuple(one[(r, 100 * r + k)]) for r in range(7) for k in range(3)}) > 14
    for ranks in (2, 3):
        assert _layout(monkeypatch, model, samples, ranks, rows=5, temperature=1.0, top_k=50, top_p=0.9) == one
    assert _layout(monkeypatch, model, samples[::-1], 1, rows=5, temperature=1.0, top_k=50, top_p=0.9) == one
    assert _layout(monkeypatch, model, samples, 7, rows=5, temperature=1.0, top_k=50, top_p=0.9) == one


def test_greedy_rows_equal_the_unpadded_decode_of_one_prompt():
    """Left padding (masked, positions from each prompt's first token) and dummy rows change no
    greedy completion against the prompt decoded alone, unpadded (:func:`sample_group`)."""
    from llmtrain.rollout.generate import Sampling, sample_batch, sample_group

    model, samples = _model(torch.float32), _prompts()
    sampling = Sampling(max_new=10, end_ids=frozenset([1]))
    prompts = [s["prompt_ids"] for s in samples]
    batched = sample_batch(model, prompts, [None] * 7, sampling, torch.device("cpu"), rows=8, width=30)
    alone = [sample_group(model, p, [None], sampling, torch.device("cpu"))[0] for p in prompts]
    assert [c.ids for c in batched] == [c.ids for c in alone]
    assert all(len(c.ids) == 10 for c in batched)  # a random model never says its end token here


def test_a_batch_refuses_more_prompts_than_rows_or_a_prompt_wider_than_the_batch():
    from llmtrain.rollout.generate import Sampling, sample_batch

    model = _model(torch.float32)
    with pytest.raises(ValueError, match="3 prompts \\(at most 2\\)"):
        sample_batch(model, [[2], [3], [4]], [None] * 3, Sampling(max_new=1), torch.device("cpu"), rows=2, width=4)
    with pytest.raises(ValueError, match="up to 5 tokens \\(at most 4\\)"):
        sample_batch(model, [[2] * 5], [None], Sampling(max_new=1), torch.device("cpu"), rows=2, width=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_logits_are_bitwise_the_same_in_any_batch_of_the_fixed_shape(dtype):
    """The output layer's logits of a prompt's row, at the prefill and at every decoding step, are
    bit for bit equal in a batch of 4 other prompts, of 2 and with dummy rows, and as the only row
    (3 dummies): what makes the completions layout-independent, not just their tokens."""
    from llmtrain.rollout.generate import Sampling, sample_batch

    model, samples = _model(dtype), _prompts()
    prompts = [s["prompt_ids"] for s in samples]
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out[:, -1].float().clone()))

    def logits(batch: list[int], row: int) -> torch.Tensor:
        seen.clear()
        sample_batch(model, [prompts[i] for i in batch], [None] * len(batch), Sampling(max_new=6), torch.device("cpu"),
                     rows=4, width=25)
        return torch.stack([step[row] for step in seen])  # [prefill + 5 steps, vocab]

    try:
        for prompt, others in ((0, [1, 2, 3]), (4, [5, 6, 2])):
            alone = logits([prompt], 0)
            assert alone.shape[0] == 6
            assert torch.equal(logits([*others[:2], prompt, others[2]], 2), alone)
            assert torch.equal(logits([others[0], prompt], 1), alone)
        # Four rows of the longest prompt fill the batch with no padding of their own: the same
        # logits as beside dummy rows (an all-ones mask would take another attention kernel).
        longest = logits([4], 0)
        assert torch.equal(logits([4, 4, 4, 4], 3), longest)
    finally:
        hook.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_group_is_prefilled_once_with_the_logits_and_completions_of_a_prefill_of_every_row(dtype):
    """3 prompts x G = 4 rows in a batch of 16 (a dummy group after them): with ``group=4`` the
    prefill runs on 4 rows where it ran on 16, and every row's output-layer logits, at the prefill
    and at each decoding step, and its completion are bit for bit those of the prefill of every row."""
    from llmtrain.rollout.generate import Sampling, sample_batch

    model, samples = _model(dtype), _prompts()
    batch = [samples[k]["prompt_ids"] for k in (1, 4, 0) for _ in range(4)]
    sampling = Sampling(max_new=8, temperature=1.0, top_k=50)
    seen: list[torch.Tensor] = []
    prefill_rows: list[int] = []
    hooks = [model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out[:, -1].float().clone())),
             model.model.register_forward_pre_hook(lambda module, args, kwargs: prefill_rows.append(
                 kwargs["input_ids"].shape[0]) if not prefill_rows else None, with_kwargs=True)]

    def run(group: int):
        seen.clear(), prefill_rows.clear()
        out = sample_batch(model, batch, list(range(12)), sampling, torch.device("cpu"), rows=16, width=25, group=group)
        return [c.ids for c in out], list(seen), prefill_rows[0]

    try:
        whole, whole_logits, whole_rows = run(1)
        once, once_logits, once_rows = run(4)
    finally:
        for hook in hooks:
            hook.remove()
    assert (whole_rows, once_rows) == (16, 4)
    assert once == whole and len({tuple(ids) for ids in whole}) > 6  # seeded draws: the rows differ
    assert len(once_logits) == len(whole_logits) == 8
    assert all(torch.equal(a, b) for a, b in zip(once_logits, whole_logits))


def test_grouped_batches_give_the_same_completions_on_any_layout(monkeypatch):
    """Batches of 8 rows hold whole groups of G = 4 (3 seeded rows and a greedy one), so the engine
    prefills each prompt once: on 1, 2, 3 and 7 simulated ranks and in reverse order the completions
    are those of 1 rank with a prefill of every row (``group`` forced to 1)."""
    from llmtrain.rollout import engines

    model, samples = _model(torch.float32), _prompts()
    groups: list[int] = []
    real = engines.sample_batch

    def spy(*args, **kwargs):
        groups.append(args[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(engines, "sample_batch", spy)
    one = _layout(monkeypatch, model, samples, ranks=1, rows=8, temperature=1.0)
    assert set(groups) == {4}
    for ranks in (2, 3, 7):
        assert _layout(monkeypatch, model, samples, ranks, rows=8, temperature=1.0) == one
    assert _layout(monkeypatch, model, samples[::-1], 1, rows=8, temperature=1.0) == one
    monkeypatch.setattr(engines, "sample_batch", lambda *args, **kwargs: real(*args[:-1], 1, **kwargs))
    assert _layout(monkeypatch, model, samples, ranks=1, rows=8, temperature=1.0) == one


def test_a_grouped_batch_refuses_rows_that_are_not_runs_of_one_prompt():
    from llmtrain.rollout.generate import Sampling, sample_batch

    model = _model(torch.float32)
    with pytest.raises(ValueError, match="runs of 2 copies"):
        sample_batch(model, [[2], [3]], [None] * 2, Sampling(max_new=1), torch.device("cpu"), rows=4, width=4, group=2)
    with pytest.raises(ValueError, match="group=3 must divide rows=4"):
        sample_batch(model, [[2]] * 3, [None] * 3, Sampling(max_new=1), torch.device("cpu"), rows=4, width=4, group=3)
