"""GRPO through the bounded label head (:mod:`llmtrain.models.chunked_loss`): the loss, every
parameter's gradient, the log-probs and every metric equal those from whole logits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from llmtrain.engine.base import Engine, model_inputs
from llmtrain.models.chunked_loss import install
from llmtrain.objectives.grpo import GRPO

VOCAB, TEMPERATURE = 96, 0.7


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    return LlamaForCausalLM(config).float()


def _batch(objective: GRPO, packed: bool) -> dict[str, torch.Tensor]:
    """Four completions of two prompts: one per row, right-padded; or ``packed`` two per row
    (``position_ids`` restarting at each, ``segment`` ids). Old and reference log-probs off the
    current ones, so the ratios clip and the KL is not 0."""
    g = torch.Generator().manual_seed(3)
    samples = [(torch.randint(2, VOCAB, (p,), generator=g), torch.randint(2, VOCAB, (c,), generator=g))
               for p, c in ((5, 7), (5, 3), (4, 9), (4, 6))]
    layout = [[0, 1], [2, 3]] if packed else [[0], [1], [2], [3]]
    width = max(sum(len(p) + len(c) for p, c in (samples[j] for j in row)) for row in layout)
    shape = (len(layout), width)
    batch = {"input_ids": torch.zeros(shape, dtype=torch.long), "attention_mask": torch.zeros(shape, dtype=torch.long),
             "labels": torch.full(shape, -100), "completion_mask": torch.zeros(shape),
             "advantages": torch.zeros(shape), "segment": torch.full(shape, -1),
             "position_ids": torch.zeros(shape, dtype=torch.long)}
    for i, row in enumerate(layout):
        at = 0
        for j in row:
            prompt, completion = samples[j]
            n = len(prompt) + len(completion)
            batch["input_ids"][i, at:at + n] = torch.cat([prompt, completion])
            batch["attention_mask"][i, at:at + n] = 1
            batch["position_ids"][i, at:at + n] = torch.arange(n)
            batch["segment"][i, at:at + n] = j
            done = slice(at + len(prompt), at + n)
            batch["labels"][i, done] = completion
            batch["completion_mask"][i, done] = 0.0 if j == 3 else 1.0  # a masked (truncated) completion
            batch["advantages"][i, done] = (1.1, -0.8, 0.5, -0.3)[j]
            at += n
        batch["position_ids"][i, at:] = torch.arange(width - at)
    if not packed:
        del batch["position_ids"]
    noise = torch.randn(shape, generator=g) * (batch["labels"] != -100)
    batch["old_logps"] = -3.0 + 0.4 * noise
    batch["ref_logps"] = -3.2 + 0.3 * noise
    return objective.prepare(batch)


class _Engine:
    """The engine methods the loss goes through, around a bare model (one process, no recipe)."""

    _loss_sums, _padded_rows, labelling = Engine._loss_sums, Engine._padded_rows, Engine.labelling

    def __init__(self, model, objective, head):
        self.model, self.objective, self.label_head = model, objective, head
        self.cfg = OmegaConf.create({"recipe": {}})
        self.dims, self.context, self.routers = SimpleNamespace(cp=1, tp=1), None, []

    def forward(self, batch):
        return self.model(**model_inputs(batch)).logits


def _step(objective, batch, chunk: int | None, bounded: bool = True, frozen_head: bool = False):
    """Loss / normaliser, metrics, gradients by parameter name (of those that get one), and the
    old-policy pass's log-probs, from whole logits (``chunk`` None) or the label head
    (:func:`install`'s); ``frozen_head``: the output layer trains not (as under LoRA)."""
    model = _tiny_llama()
    model.lm_head.requires_grad_(not frozen_head)
    head = None if chunk is None else install(model, chunk, bounded)
    engine = _Engine(model, objective, head)
    sums = engine._loss_sums(batch, training=True)
    normaliser = objective.normaliser(batch)
    (sums.loss / normaliser).backward()
    with torch.no_grad(), engine.labelling(batch):
        logps = objective.token_logps(engine.forward(batch), batch["labels"])
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return float(sums.loss.detach() / normaliser), {k: float(v) for k, v in sums.metrics.items()}, grads, logps


@pytest.mark.parametrize("loss_type,level,packed", [("grpo", "token", False), ("dapo", "token", True),
                                                    ("dr_grpo", "sequence", False), ("bnpo", "token", True)])
def test_chunked_grpo_equals_whole_logits(loss_type, level, packed):
    """In fp32, through the engine's loss path: loss, each parameter's gradient, the entropy and
    every other metric, and the old-policy pass's log-probs equal whole logits' within 1e-6, for
    chunks of 1, 7 (not dividing the 25 completion tokens), the default (one chunk here) and the
    layer's own forward on the completion rows (an unbounded head, as an adapted layer gets)."""
    objective = GRPO({"loss_type": loss_type, "beta": 0.04, "num_iterations": 2, "epsilon_high": 0.28,
                      "importance_sampling_level": level})
    objective.temperature, objective.max_completion_length = TEMPERATURE, 9
    batch = _batch(objective, packed)
    loss, metrics, grads, logps = _step(objective, batch, None)
    assert metrics["entropy"] > 0 and metrics["kl"] > 0 and metrics["clip_ratio/region_mean"] > 0
    assert (logps != 0).sum() == (batch["labels"] != -100).sum() == 25
    for chunk, bounded in ((1, True), (7, True), (0, True), (0, False)):
        got_loss, got_metrics, got_grads, got_logps = _step(objective, batch, chunk, bounded)
        assert got_loss == pytest.approx(loss, rel=1e-6, abs=1e-7), chunk
        assert got_metrics == pytest.approx(metrics, rel=1e-6, abs=1e-6), chunk
        torch.testing.assert_close(got_logps, logps, rtol=1e-6, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-6, atol=1e-6, msg=f"{name} at chunk {chunk}")


def test_a_bounded_head_never_holds_more_than_a_chunk_of_logits(monkeypatch):
    """The output layer's matmuls of a bounded head with chunks of 4 see at most 4 positions,
    and only completion positions: 25 in all, not the batch's rows x length."""
    from llmtrain.models import chunked_loss

    seen: list[int] = []
    real = chunked_loss.ChunkedLabelLogps._logits

    def logits(hidden, weight, bias, temperature=1.0):
        seen.append(hidden.shape[0])
        return real(hidden, weight, bias, temperature)

    monkeypatch.setattr(chunked_loss.ChunkedLabelLogps, "_logits", staticmethod(logits))
    objective = GRPO({"loss_type": "dapo"})
    objective.temperature = TEMPERATURE
    batch = _batch(objective, packed=False)
    _step(objective, batch, 4)
    assert max(seen) == 4
    assert sum(seen) == 3 * 25  # forward, backward's recomputation, the old-policy pass


def test_the_default_chunk_holds_its_logits_within_a_byte_bound(monkeypatch):
    """With ``chunk_tokens`` 0 a bounded head's chunks hold as many positions as keep their fp32
    logits within ``BOUNDED_CHUNK_BYTES`` (6 positions' worth here): 3 positions with the
    entropy's second copy (the training forward and its recomputation in backward), 6 without
    (the old-policy pass); the loss and every gradient as from whole logits."""
    from llmtrain.models import chunked_loss

    seen: list[int] = []
    real = chunked_loss.ChunkedLabelLogps._logits

    def logits(hidden, weight, bias, temperature=1.0):
        seen.append(hidden.shape[0])
        return real(hidden, weight, bias, temperature)

    objective = GRPO({"loss_type": "dapo", "beta": 0.04})
    objective.temperature = TEMPERATURE
    batch = _batch(objective, packed=False)
    loss, _, grads, _ = _step(objective, batch, None)
    monkeypatch.setattr(chunked_loss, "BOUNDED_CHUNK_BYTES", 6 * VOCAB * 4)
    monkeypatch.setattr(chunked_loss.ChunkedLabelLogps, "_logits", staticmethod(logits))
    got_loss, _, got_grads, _ = _step(objective, batch, 0)
    assert seen == 2 * ([3] * 8 + [1]) + [6] * 4 + [1]  # 25 completion positions
    assert got_loss == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-6, atol=1e-6, msg=name)
    assert chunked_loss.bounded_chunk_tokens(49152) == 1  # never 0, however large the vocabulary
    monkeypatch.undo()
    assert chunked_loss.bounded_chunk_tokens(49152) == 42 and chunked_loss.bounded_chunk_tokens(49152, 1) == 85


def test_a_frozen_output_layer_gets_no_gradient_and_the_rest_the_same():
    """LoRA's frozen output layer: the chunks' backward skips its weight gradient (no
    ``[vocab, hidden]`` matmul per chunk), and every trained parameter's gradient is unchanged."""
    objective = GRPO({"loss_type": "grpo", "beta": 0.04})
    objective.temperature = TEMPERATURE
    batch = _batch(objective, packed=True)
    loss, _, grads, _ = _step(objective, batch, None, frozen_head=True)
    got_loss, _, got_grads, _ = _step(objective, batch, 4, frozen_head=True)
    assert "lm_head.weight" not in grads and got_grads.keys() == grads.keys() and len(grads) > 10
    assert got_loss == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-6, atol=1e-6, msg=name)
