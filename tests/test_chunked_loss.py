"""The label head (:mod:`llmtrain.models.chunked_loss`): whole (``trainer.logits_at_labels_only``,
the default) and chunked (``trainer.loss_chunk_tokens``):

* label log-probs, loss and gradients (hidden, weight, bias) equal float64 ``cross_entropy`` over
  whole logits within 1e-6 (relative), with ignored labels and a last chunk shorter than the rest;
* a vocabulary sharded over 2 tensor-parallel ranks (spawned gloo processes) gives the same;
* the peak extra bytes (torch profiler's allocation timeline) at Llama-3's vocabulary of 128,256
  are at most 1/8 of the plain loss's when chunks are 1/8 of the tokens;
* wired into a model, whole or chunked, tied or not: loss and every gradient equal Hugging Face's
  own loss (``labels=``) over whole logits, with prompt-masked, unmasked and padded rows;
* whole, the output layer sees only the labelled rows; a micro-batch without labels gives loss 0
  and a zero (not missing) head gradient;
* chunks refuse a wrapped (adapter) output layer; models that transform logits after the head
  (Cohere's ``logit_scale``) keep the plain head.

Training runs with it (FSDP2 with cp, ZeRO-3, a tensor-parallel untied head) are in
``tests/test_context_parallel.py``, sharing its launches.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from conftest import cores_for
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
    with cores_for(2):
        mp.start_processes(_tp_worker, args=(2, port, out), nprocs=2, start_method="spawn")
    for rank in range(2):
        for key, err in out[rank].items():
            assert err < 1e-5, f"rank {rank} {key}: {err}"


def _tiny_llama(tied=False, vocab=300):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("masked", [True, False], ids=["prompts-masked", "all-labelled"])
@pytest.mark.parametrize("chunk", [0, 16])
@pytest.mark.parametrize("tied", [False, True])
def test_installed_head_gives_hugging_faces_loss_and_gradients(chunk, tied, masked):
    """Against the model's own loss (``labels=``: Hugging Face's ``ForCausalLMLoss`` over whole
    logits), with prompt tokens masked in one row, none in another and a padded tail: the label
    head (whole, ``chunk`` 0, or in chunks) gives the same loss and every parameter's gradient."""
    from llmtrain.objectives.causal_lm import count_target_tokens, token_cross_entropy_sum

    model = _tiny_llama(tied)
    ids = torch.randint(0, 300, (3, 40))
    labels = ids.clone()
    if masked:
        labels[0, :7] = -100
        labels[2, :25] = -100
        labels[2, 33:] = -100
    reference = model(input_ids=ids, labels=labels).loss * count_target_tokens(labels)
    reference.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    head = install(model, chunk_tokens=chunk)
    head.targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    logps = model(input_ids=ids).logits
    assert logps.shape == (3, 40) and logps.dtype == torch.float32
    assert torch.equal(logps == 0, head.targets == -100)
    loss = token_cross_entropy_sum(logps, labels)
    loss.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=0)
    for name, p in model.named_parameters():
        err = float((p.grad - expected[name]).abs().max())
        assert err <= 1e-6 * float(expected[name].abs().max()), (name, err)
    head.targets = None
    assert model(input_ids=ids).logits.shape == (3, 40, 300)  # no targets: the plain output layer


def test_whole_head_runs_the_output_layer_on_labelled_rows_only():
    model = _tiny_llama()
    rows = []
    real = model.lm_head.forward
    model.lm_head.forward = lambda h: rows.append(tuple(h.shape)) or real(h)  # noqa: E731 (what the matmul sees)
    head = install(model, 0)
    ids = torch.randint(0, 300, (2, 30))
    labels = torch.full_like(ids, -100)
    labels[0, 20:] = ids[0, 20:]
    head.targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    model(input_ids=ids)
    assert rows == [(10, 32)]  # positions 19..28 of row 0 predict its 10 labels
    head.targets = F.pad(ids[:, 1:], (0, 1), value=-100)  # pre-training: only the row ends unlabelled
    model(input_ids=ids)
    assert rows[-1] == (60, 32)  # every position of both rows, no gather
    head.targets = None
    model(input_ids=ids)
    assert rows[-1] == (2, 30, 32)


def test_a_micro_batch_without_labels_gives_zero_loss_and_zero_head_gradients():
    """DDP, FSDP2 and ZeRO reduce every parameter's gradient: an all-prompt micro-batch (a
    truncated sample) still gives the head a gradient, of zeros, and a loss of exactly 0."""
    model = _tiny_llama()
    head = install(model, 0)
    ids = torch.randint(0, 300, (2, 12))
    head.targets = torch.full_like(ids, -100)
    logps = model(input_ids=ids).logits
    assert torch.equal(logps, torch.zeros(2, 12))
    (-logps.sum()).backward()
    assert model.lm_head.weight.grad is not None and not model.lm_head.weight.grad.any()


def test_chunks_refuse_an_adapted_output_layer_and_transforming_models_are_left_plain():
    from transformers import CohereConfig, CohereForCausalLM

    from llmtrain.common.errors import ConfigError
    from llmtrain.models.chunked_loss import applies_by_default

    model = _tiny_llama()
    model.lm_head = torch.nn.Sequential(model.lm_head)  # stands in for a PEFT wrapper around lm_head
    with pytest.raises(ConfigError, match="lm_head"):
        install(model, 16)
    assert applies_by_default(_tiny_llama())
    cohere = CohereForCausalLM(CohereConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, logit_scale=0.0625))
    assert not applies_by_default(cohere)
    with pytest.raises(ConfigError, match="logit_scale=0.0625"):
        install(cohere, 16)


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


@pytest.mark.parametrize("label_rows", [True, False])
def test_lora_dpo_reference_with_adapters_off_starts_at_ln2(tmp_path, label_rows):
    """LoRA's B starts at zero, so at step 1 the policy is its own reference (adapters off):
    DPO's loss is ln 2 and both rewards exactly 0, with the label head on a PEFT model (policy
    and reference forwards both through it) and without it. (The reference on whole logits gives
    0 too here: the matmul's rows round alike whichever rows it is given.)"""
    import json
    import math

    from conftest import make_cfg
    from llmtrain.trainer import train

    gen = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega"]

    def text(n):
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=gen))

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q: {text(12)}\nA:", "chosen": " " + text(5),
                                        "rejected": " " + text(7)}) + "\n" for _ in range(12)))
    run = tmp_path / "run"
    train(make_cfg(["data=preference", f"data.path={data}", "data.seq_len=160", "data.max_prompt_tokens=100", "objective=dpo", "+peft=lora",
                    "objective.reference=adapters_disabled", "trainer.max_steps=1", "trainer.global_batch_size=4",
                    "trainer.micro_batch_size=2", "trainer.log_every=1", "trainer.eval_every=0", "tracker=none",
                    "trainer.progress_bar=false", "trainer.save_every_minutes=0",
                    f"trainer.logits_at_labels_only={str(label_rows).lower()}", f"run_dir={run}"]))
    first = next(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "train/loss" in line)
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert first["train/rewards/chosen"] == first["train/rewards/rejected"] == 0


def test_frozen_reference_copy_gets_the_policys_label_head():
    """``build_reference`` with ``objective.reference=copy``: the engine builds the frozen copy
    (``Engine.frozen_reference``) through a ``build`` that installs the policy's kind of label
    head, and its forward sets the
    targets, so the reference's output layer sees the labelled rows only and its log-probs equal
    those from whole logits."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from llmtrain.objectives.preference import completion_token_logps
    from llmtrain.objectives.reference import build_reference

    rows, built = [], []

    def build():
        model = _tiny_llama()
        real = model.lm_head.forward
        model.lm_head.forward = lambda h: rows.append(tuple(h.shape)) or real(h)  # noqa: E731
        built.append(model)
        return model

    from llmtrain.engine.base import Engine as BaseEngine

    class Engine:
        label_head = SimpleNamespace(chunk=0, bounded=False)
        objective = SimpleNamespace(label_temperature=1.0)
        frozen_reference = BaseEngine.frozen_reference

        def frozen_copy(self, make):
            model = make()
            return lambda batch: model(input_ids=batch["input_ids"]).logits

    cfg = OmegaConf.create({"objective": {"name": "dpo", "reference": "copy"}, "peft": None,
                            "recipe": {"name": "ddp"}})
    reference = build_reference(cfg, Engine(), build)
    ids = torch.randint(0, 300, (2, 20))
    labels = ids.clone()
    labels[:, :12] = -100
    got = reference({"input_ids": ids, "labels": labels})
    assert rows == [(2 * 8, 32)]  # positions 11..18 of both rows predict their labels 12..19
    plain = _tiny_llama()
    torch.testing.assert_close(got, completion_token_logps(plain(input_ids=ids).logits, labels), rtol=1e-6, atol=1e-6)
    assert built[0].lm_head.forward(torch.zeros(1, 32)).shape == (1, 300)  # targets reset after the forward


def test_default_label_head_feeds_builtin_objectives_and_user_classes_that_declare_it():
    """A user's subclass of a built-in objective may read the vocabulary in its own ``loss_sums``
    (a z-loss): it inherits ``label_logps_only`` but gets whole logits unless it sets the flag."""
    from llmtrain.engine.base import _declares_label_logps_only
    from llmtrain.objectives import CausalLM

    class ZLoss(CausalLM):
        pass

    class Declared(CausalLM):
        label_logps_only = True

    assert _declares_label_logps_only(CausalLM())
    assert not _declares_label_logps_only(ZLoss())
    assert _declares_label_logps_only(Declared())
