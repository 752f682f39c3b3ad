"""Context parallelism (``recipe.cp``): rows split over ranks, attention exchanged (Ulysses
all-to-all or ring), equal to whole rows on one process.

* The attention itself against ``torch.nn.functional.scaled_dot_product_attention`` on whole
  rows (forward and gradients; GQA, packed documents, both styles and ring's two kernels, cp 2
  and 4), in spawned gloo processes.
* Training runs (one launch per world size, ``tests/scenarios.py``): tiny Llama, fp32, 2048 byte
  tokens of Tiny Shakespeare a row, 4 steps; per-step loss and pre-clip gradient norm within
  1e-5 of the 1-process run for cp=2 Ulysses and ring on FSDP2 and on DeepSpeed ZeRO-3 (2
  processes), dp_shard 2 x cp 2 and tp 2 x cp 2 with sequence parallelism (4 processes), packed
  Alpaca rows with document masking, the chunked loss (with cp, on ZeRO-3, on a vocab-parallel
  tensor-parallel head), tensor-parallel sequence parallelism on padded unpacked rows; SIGKILL
  under cp=2 and resume on one process (cp=1) continues exactly.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from conftest import FAST, assert_ok, cores_for, make_cfg, run_cli, run_scenarios, train_rows
from test_resume import kill_after

from llmtrain.parallel.context_parallel import chunk_order, local_index
from llmtrain.common.errors import ConfigError

STEPS = 4  # checkpoints at 2 and 4: the resume from step 2 trains two more
TOL = 1e-5


# ---- layout and validation -----------------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_every_token_is_held_once_and_each_rank_holds_a_head_and_a_tail_chunk(cp):
    length = 24 * cp
    held = torch.cat([local_index(length, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(length))
    chunk = length // (2 * cp)
    for r in range(cp):
        idx = local_index(length, cp, r)
        assert idx[0] == r * chunk and idx[chunk] == (2 * cp - 1 - r) * chunk
    assert sorted(chunk_order(cp)) == list(range(2 * cp))


def test_split_keeps_every_next_token_target_and_global_positions():
    """Each local output position is paired with the label of the next *global* token, so the
    targets of all cp ranks together are exactly the row's (none lost at a chunk boundary)."""
    from llmtrain.parallel.context_parallel import ContextParallel

    rows, length, cp = 2, 16, 2
    ids = torch.arange(rows * length).reshape(rows, length)
    labels = ids + 1000
    labels[0, :3] = -100
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    pairs = set()
    for rank in range(cp):
        context = ContextParallel.__new__(ContextParallel)
        context.cp, context.rank, context.style = cp, rank, "ring"
        local = context.split(batch, {"labels": -100})
        idx = local_index(length, cp, rank)
        assert torch.equal(local["position_ids"][0], idx) and torch.equal(local["input_ids"], ids[:, idx])
        for b in range(rows):
            for i in range(len(idx)):  # the objective pairs output i with carried i + 1
                if local["labels"][b, i + 1] != -100:
                    pairs.add((int(local["input_ids"][b, i]), int(local["labels"][b, i + 1])))
    expected = {(int(ids[b, i]), int(labels[b, i + 1])) for b in range(rows) for i in range(length - 1)
                if labels[b, i + 1] != -100}
    assert pairs == expected
    # the output gets one trailing column, which the objective's shift drops: output i stays at i
    out = torch.randn(rows, length // cp, 3)
    padded = ContextParallel.pad_output(out)
    assert torch.equal(padded[:, :-1], out) and not padded[:, -1].any()


@pytest.mark.parametrize("overrides,message", [
    (["recipe.cp=2", "data.seq_len=66"], "multiple of 4"),
    (["recipe.pp=2", "recipe.cp=2"], "pipeline stages"),
    (["recipe.cp=2", "objective=dpo", "data=preference", "data.path=x.jsonl", "data.max_prompt_tokens=32"],
     "objective=dpo"),
    (["recipe.cp=2", "model.attn_implementation=flex_attention"], "attn_implementation=flex_attention"),
    (["recipe.cp_style=zigzag"], "recipe.cp_style='zigzag'"),
    (["recipe.cp=0"], "recipe.cp=0"),
])
def test_bad_context_parallel_settings_are_refused_naming_the_field(overrides, message):
    from llmtrain.config.validate import validate

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        validate(make_cfg(["+recipe=fsdp", "data.seq_len=64", "trainer.global_batch_size=8"] + overrides), 8)


def test_world_size_not_a_multiple_of_cp_and_ulysses_heads_are_refused():
    from llmtrain.config.validate import validate
    from llmtrain.parallel.context_parallel import check_heads

    with pytest.raises(ConfigError, match="recipe.cp=4 does not divide the world size 6"):
        validate(make_cfg(["+recipe=fsdp", "recipe.cp=4"]), 6)
    with pytest.raises(ConfigError, match="cp_style=ulysses with recipe.cp=3"):
        check_heads("ulysses", 3, 4, 2)
    check_heads("ring", 3, 4, 2)


@pytest.mark.parametrize("overrides,message", [
    (["+recipe=fsdp", "recipe.tp_sequence_parallel=true"], "recipe.tp=1"),
    (["+recipe=3d", "recipe.tp_sequence_parallel=true"], "recipe.pp=2"),
    (["+recipe=pp", "trainer.loss_chunk_tokens=256"], "the pipeline's last stage"),
    (["+recipe=fsdp", "trainer.loss_chunk_tokens=256", "objective=orpo", "data=preference", "data.path=x.jsonl",
      "data.max_prompt_tokens=32"], "objective=orpo"),
    (["+recipe=fsdp", "trainer.loss_chunk_tokens=-1"], "trainer.loss_chunk_tokens=-1"),
])
def test_bad_sequence_parallel_and_chunked_loss_settings_are_refused(overrides, message):
    from llmtrain.config.validate import validate

    with pytest.raises(ConfigError, match=message):
        validate(make_cfg(["data.seq_len=64", "trainer.global_batch_size=8", "trainer.micro_batch_size=1"]
                          + overrides), 8)


@pytest.mark.parametrize("recipe,world,cp,degrees", [
    ("fsdp", 4, 2, (1, 2, 1, 1)), ("fsdp", 2, 2, (1, 1, 1, 1)), ("hsdp", 8, 2, (2, 2, 1, 1)),
    ("fsdp_tp", 8, 2, (1, 2, 2, 1)), ("zero3", 4, 2, (1, 2, 1, 1)), ("ddp", 4, 2, (2, 1, 1, 1)),
])
def test_data_parallel_degrees_fill_the_world_size_over_cp(recipe, world, cp, degrees):
    from llmtrain.config.validate import validate
    from llmtrain.parallel.dims import ParallelDims

    lay = validate(make_cfg([f"+recipe={recipe}", f"recipe.cp={cp}", "trainer.global_batch_size=8",
                              "trainer.micro_batch_size=1"]), world)
    dims = ParallelDims.from_layout(lay)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp) == degrees
    assert dims.cp == cp and dims.data_replicas == dims.tp * dims.pp * cp and dims.dp_cp * dims.tp == world


# ---- the attention against whole-row SDPA (spawned gloo ranks) ------------------------------
CASES = [(style, packed) for style in ("ulysses", "ring", "ring-eager") for packed in (False, True)]


def _attention_worker(rank: int, world: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for case in CASES:
            out[(rank, *case)] = _attention_errors(rank, world, *case)
    finally:
        dist.destroy_process_group()


def _attention_errors(rank: int, world: int, style: str, packed: bool) -> dict[str, float]:
    import torch.distributed as dist
    import torch.nn.functional as F

    from llmtrain.parallel.context_parallel import ContextParallel

    style, _, kernel = style.partition("-")
    torch.manual_seed(0)
    b, heads, kv_heads, length, d = 2, 4, 2, 16 * world, 8
    q, k, v = torch.randn(b, heads, length, d), torch.randn(b, kv_heads, length, d), torch.randn(b, kv_heads, length, d)
    positions = torch.arange(length).expand(b, -1).clone()
    if packed:  # documents of 5, 9 and the rest of the tokens in row 0; row 1 one document
        positions[0] = torch.cat([torch.arange(n) for n in (5, 9, length - 14)])
    # reference: whole rows, causal within each document, GQA by repeating KV heads
    docs = (positions == 0).cumsum(1)
    allowed = torch.ones(length, length).tril().bool()[None] & (docs[:, :, None] == docs[:, None, :])
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr.repeat_interleave(2, 1), vr.repeat_interleave(2, 1),
                                         attn_mask=allowed[:, None]).transpose(1, 2)
    weight = torch.randn_like(ref)
    (ref * weight).sum().backward()

    context = ContextParallel(dist.group.WORLD, style, ring_kernel=kernel or "auto")
    context.split({"input_ids": torch.zeros(b, length, dtype=torch.long), "position_ids": positions}, {})
    idx = local_index(length, world, rank)
    ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    got, _ = context.attention(torch.nn.Module(), ql, kl, vl, None, scaling=d ** -0.5)
    (got * weight[:, idx]).sum().backward()
    # K/V gradients come back from every rank's queries to the rank holding those keys
    return {"out": float((got.detach() - ref[:, idx]).abs().max()),
            "dq": float((ql.grad - qr.grad[:, :, idx]).abs().max()),
            "dk": float((kl.grad - kr.grad[:, :, idx]).abs().max()),
            "dv": float((vl.grad - vr.grad[:, :, idx]).abs().max())}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_attention_over_split_rows_equals_whole_row_sdpa(world):
    """Every style (Ulysses; ring on the CPU flash kernel and on plain ops), unpacked and packed
    rows; 4 ranks: 2 KV heads do not divide cp, so Ulysses replicates them."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    with cores_for(world):
        mp.start_processes(_attention_worker, args=(world, port, out), nprocs=world, start_method="spawn")
    for rank in range(world):
        for case in CASES:
            for key, err in out[(rank, *case)].items():
                assert err < 1e-5, f"rank {rank} {case} {key}: {err}"


# ---- training runs --------------------------------------------------------------------------
# No assertion here reads the held-out loss: the step-0 and last evaluations of every run read 2
# rows of 2048 tokens (one a data-parallel rank) instead of FAST's 8.
EVAL = ["trainer.eval_samples=2"]


def common(shakespeare: Path) -> list[str]:
    return [o for o in FAST if not o.startswith(("data.max_bytes", "data.seq_len"))] + [
        "data=tinyshakespeare", f"data.path={shakespeare}", "data.seq_len=2048", "data.max_bytes=120000",
        "model.architecture.max_position_embeddings=4096", f"trainer.max_steps={STEPS}", "trainer.save_every=2",
        "trainer.global_batch_size=4", "trainer.micro_batch_size=1", "trainer.warmup_steps=2", "trainer.lr=3e-3",
        "trainer.export_hf=false", *EVAL]


def packed(alpaca: Path) -> list[str]:
    return [o for o in FAST if not o.startswith(("data.max_bytes", "data.seq_len"))] + [
        # The first 1000 of the 5000 records: 251 packed rows, 16 of them trained, read in a fifth of the time.
        "data=alpaca", f"data.path={alpaca}", "data.max_records=1000", "data.packing=true", "data.seq_len=2048",
        "model.architecture.max_position_embeddings=4096",
        f"trainer.max_steps={STEPS}", "trainer.save_every=0", "trainer.global_batch_size=4",
        "trainer.micro_batch_size=1", "trainer.warmup_steps=2", "trainer.lr=3e-3", "trainer.export_hf=false", *EVAL]


CP2 = ["recipe.cp=2"]
CHUNKED = ["trainer.loss_chunk_tokens=384"]  # not dividing a rank's 1024 tokens: a short last chunk
SP = ["recipe.tp_sequence_parallel=true"]
QWEN = ["model=tiny_qwen2"]  # untied: its tensor-parallel head is sharded along the vocabulary
TWO = {"ulysses-fsdp": ("text", ["+recipe=fsdp", *CP2]),
       "ulysses-fsdp-chunked": ("text", ["+recipe=fsdp", *CP2, *CHUNKED]),
       "zero3-chunked": ("text", ["+recipe=zero3", *CHUNKED]),
       "tp_sp-vocab_parallel-chunked": ("qwen", ["+recipe=tp", *SP, *CHUNKED]),
       # unpacked rows of varying length: padded to a multiple of tp for the sequence shards
       "tp_sp-unpacked": ("unpacked", ["+recipe=tp", *SP]),
       "ring-fsdp": ("text", ["+recipe=fsdp", *CP2, "recipe.cp_style=ring"]),
       "ulysses-zero3": ("text", ["+recipe=zero3", *CP2]),
       "packed-ulysses": ("packed", ["+recipe=fsdp", *CP2]),
       "packed-ring": ("packed", ["+recipe=fsdp", *CP2, "recipe.cp_style=ring"])}
FOUR = {"ring-fsdp_x_cp": ("text", ["+recipe=fsdp", *CP2, "recipe.cp_style=ring"]),
        "ulysses-tp_sp_x_cp": ("text", ["+recipe=tp", "recipe.tp=2", *CP2, *SP])}


@pytest.fixture(scope="module")
def runs(shared_data, tmp_path_factory) -> dict[str, Path]:
    data = {"text": common(shared_data / "tinyshakespeare.txt"), "packed": packed(shared_data / "alpaca_5000.json")}
    data["qwen"] = data["text"] + QWEN
    data["unpacked"] = [o for o in data["packed"] if o not in ("data.packing=true", "data.seq_len=2048")] + [
        "data.seq_len=512"]
    groups = {1: {"text": data["text"] + ["+recipe=ddp"], "packed": data["packed"] + ["+recipe=ddp"],
                  "qwen": data["qwen"] + ["+recipe=ddp"], "unpacked": data["unpacked"] + ["+recipe=ddp"]},
              2: {name: data[kind] + extra for name, (kind, extra) in TWO.items()},
              4: {name: data[kind] + extra for name, (kind, extra) in FOUR.items()}}
    out = {}
    for nproc, group in groups.items():
        out.update(run_scenarios(group, nproc, tmp_path_factory.mktemp(f"cp-{nproc}"), timeout=1800))
    return out


def per_step(run_dir: Path) -> list[dict]:
    return train_rows(run_dir, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*TWO, *FOUR])
def test_split_rows_train_like_one_process(name, runs):
    kind = (TWO | FOUR)[name][0]
    one, split = per_step(runs[kind]), per_step(runs[name])
    for a, b in zip(one, split):
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=TOL), f"step {a['step']}"
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], abs=TOL, rel=TOL), f"step {a['step']}"
        assert b["train/tokens_seen"] == a["train/tokens_seen"] and b["data/sample_digest"] == a["data/sample_digest"]
    assert one[-1]["train/loss"] < one[0]["train/loss"] - 0.05  # it trained


def test_packed_rows_hold_several_documents(shared_data):
    from llmtrain import data
    from llmtrain.models.build import build_tokenizer

    cfg = make_cfg(packed(shared_data / "alpaca_5000.json"))
    splits = data.load_splits(cfg.data, build_tokenizer(cfg.model), cfg.trainer.seed)
    stats = next(iter(splits.stats.values()))
    assert stats["packed_samples"] >= 2 * stats["packed_rows"]


@pytest.mark.slow
def test_sigkill_under_cp_then_resume_on_one_process_continues_exactly(shared_data, runs, tmp_path):
    overrides = common(shared_data / "tinyshakespeare.txt") + [f"run_dir={tmp_path}"]
    kill_after(overrides + ["+recipe=fsdp", *CP2, "trainer.hang_timeout_s=0"], tmp_path, 3, nproc=2,
               timeout=600)  # a sealed step-2 checkpoint
    resumed = run_cli(overrides + ["+recipe=fsdp"], nproc=1)
    assert_ok(resumed)
    assert "resuming from" in resumed.stdout + resumed.stderr
    got, reference = per_step(tmp_path), per_step(runs["text"])
    for a, b in zip(reference, got):
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=TOL), f"step {a['step']}"
