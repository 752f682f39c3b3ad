"""Preference objectives on every data-parallel layout: the loss is the mean over the global
batch's pairs whatever the split, so per-step losses and TRL's reward metrics on 2 processes
(ddp, zero2, zero3, fsdp; LoRA on zero3 and fsdp; packed rows) equal the 1-process run within
1e-5; a precomputed reference equals the live frozen copy; SIGKILL and resume continue exactly.

One launch per world size trains every run of this module (``tests/scenarios.py``): global batch
8 pairs, micro-batch 2 (1 process accumulates 4, 2 processes 2 each), fp32, 4 steps, checkpoints
and evaluations at 2 and 4, on 120 Anthropic HH pairs (implicit prompts), byte tokens cut to 128.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from conftest import FAST, assert_ok, read_metrics, run_cli, run_scenarios, train_rows
from test_resume import kill_after

STEPS = 4  # steps 1-2 warm up, 3-4 at the full rate; a checkpoint and an evaluation mid-run
TOL = 1e-5
METRICS = ("train/loss", "train/rewards/chosen", "train/rewards/rejected", "train/rewards/accuracies")
KTO_METRICS = ("train/loss", "train/rewards/chosen", "train/rewards/rejected", "train/kl")
LORA = ["+peft=lora", "peft.r=4"]


def common(pairs: Path) -> list[str]:
    return [o for o in FAST if not o.startswith(("data.max_bytes", "data.seq_len"))] + [
        "data=preference", f"data.path={pairs}", "data.seq_len=128", "data.max_prompt_tokens=96",
        f"trainer.max_steps={STEPS}", "trainer.save_every=2", "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2", "trainer.warmup_steps=2", "trainer.lr=3e-3", "trainer.eval_every=2",
        "trainer.eval_samples=5", "trainer.export_hf=false"]


# name -> objective overrides; each runs on 1 process (+recipe=ddp) and on 2 with the recipes below.
OBJECTIVES = {"dpo": ["objective=dpo"], "reward": ["objective=reward"],
              "dpo_lora": ["objective=dpo", *LORA],
              # Short pairs in rows of 2 x 512 tokens: two or more pairs a row.
              "dpo_packed": ["objective=dpo", "data.packing=true", "data.seq_len=512", "data.path=SHORT"],
              "dpo_precompute": ["objective=dpo", "objective.precompute_reference=true"],
              # KTO on the pairs, unpaired: its KL term is per micro-batch, and micro-batches hold the same
              # examples on any number of ranks (contiguous slices of the global batch).
              "kto": ["objective=kto"]}
TWO_RANKS = {"dpo": ["ddp", "zero2", "zero3", "fsdp", "tp"], "reward": ["ddp", "zero2", "zero3", "fsdp"],
             "dpo_lora": ["zero3", "fsdp"], "dpo_packed": ["fsdp"], "dpo_precompute": ["zero3"], "kto": ["ddp", "zero3"]}
CASES = [(objective, recipe) for objective, recipes in TWO_RANKS.items() for recipe in recipes]


@pytest.fixture(scope="module")
def pairs(shared_data, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hh") / "pairs.jsonl"
    with gzip.open(shared_data / "hh_rlhf_harmless_test.jsonl.gz", "rt", encoding="utf-8") as f:
        path.write_text("".join(line for _, line in zip(range(120), f)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def short_pairs(shared_data, tmp_path_factory) -> Path:
    """120 HH pairs whose sequences have under 300 bytes (tokens)."""
    path = tmp_path_factory.mktemp("hh-short") / "pairs.jsonl"
    kept = []
    with gzip.open(shared_data / "hh_rlhf_harmless_test.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if len(rec["chosen"].encode()) < 300 and len(rec["rejected"].encode()) < 300 and len(kept) < 120:
                kept.append(line)
    path.write_text("".join(kept), encoding="utf-8")
    return path


def overrides_of(name: str, pairs: Path, short_pairs: Path) -> list[str]:
    return common(pairs) + [o.replace("SHORT", str(short_pairs)) for o in OBJECTIVES[name]]


@pytest.fixture(scope="module")
def runs(pairs, short_pairs, tmp_path_factory) -> dict[tuple[str, int, str], Path]:
    one = {name: overrides_of(name, pairs, short_pairs) + ["+recipe=ddp"] for name in OBJECTIVES}
    two = {f"{name}-{recipe}": overrides_of(name, pairs, short_pairs) + [f"+recipe={recipe}"] for name, recipe in CASES}
    out = {}
    for nproc, group in ((1, one), (2, two)):
        for name, run_dir in run_scenarios(group, nproc, tmp_path_factory.mktemp(f"pref-{nproc}"), timeout=1500).items():
            out[name] = run_dir
    return out


def per_step(run_dir: Path) -> list[dict]:
    return train_rows(run_dir, STEPS)


@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.parametrize("objective,recipe", CASES)
def test_two_ranks_equal_one_process(objective, recipe, runs):
    one, two = per_step(runs[objective]), per_step(runs[f"{objective}-{recipe}"])
    for a, b in zip(one, two):
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=TOL), f"step {a['step']}"
        for key in (KTO_METRICS if objective == "kto" else METRICS)[1:]:
            # rewards (raw scores of a reward model, KTO's means over a few examples) drift a little more in fp32
            assert b[key] == pytest.approx(a[key], abs=10 * TOL, rel=1e-5), f"step {a['step']} {key}"
    assert one[-1]["train/loss"] != one[0]["train/loss"]  # it trained
    evals = [r for r in read_metrics(runs[f"{objective}-{recipe}"]) if "val/loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert objective == "kto" or all(0 <= r["val/rewards/accuracies"] <= 1 for r in evals)


@pytest.mark.slow
@pytest.mark.alone
def test_precomputed_reference_equals_the_live_frozen_copy(runs):
    live, stored = per_step(runs["dpo"]), per_step(runs["dpo_precompute"])
    for a, b in zip(live, stored):
        # At step 1 the rewards are 0 up to rounding (policy = reference), so which of a pair's
        # is larger, the accuracy, is rounding noise there.
        for key in METRICS if a["step"] > 1 else METRICS[:3]:
            assert b[key] == pytest.approx(a[key], abs=TOL), f"step {a['step']} {key}"
    assert (runs["dpo_precompute"] / "reference_logps.safetensors").is_file()


@pytest.mark.alone
def test_packed_rows_hold_several_pairs(pairs, short_pairs):
    from conftest import make_cfg
    from llmtrain import data
    from llmtrain.models.build import build_tokenizer

    cfg = make_cfg(overrides_of("dpo_packed", pairs, short_pairs))
    splits = data.load_splits(cfg.data, build_tokenizer(cfg.model), cfg.trainer.seed)
    stats = next(iter(splits.stats.values()))
    assert stats["packed_rows"] * 2 <= stats["packed_samples"]  # two or more pairs a row on average


@pytest.mark.slow
@pytest.mark.alone
def test_first_dpo_step_is_ln2_and_rewards_zero(runs):
    """Policy = reference at step 1: every implicit reward is 0 and the sigmoid loss is ln 2."""
    import math

    for name in ("dpo", "dpo_lora", "dpo_packed", "dpo_precompute"):
        first = per_step(runs[name])[0]
        assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6), name
        assert first["train/rewards/chosen"] == pytest.approx(0, abs=1e-6)


@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.parametrize("name,recipe", [("dpo_precompute", "zero3"), ("dpo_lora", "fsdp")])
def test_sigkill_then_rerun_continues_exactly(name, recipe, runs, pairs, short_pairs, tmp_path):
    overrides = overrides_of(name, pairs, short_pairs) + [f"+recipe={recipe}", f"run_dir={tmp_path}"]
    kill_after(overrides + ["trainer.hang_timeout_s=0"], tmp_path, 3, nproc=2)  # a sealed step-2 checkpoint
    resumed = run_cli(overrides, nproc=2)
    assert_ok(resumed)
    assert "resuming from" in resumed.stdout + resumed.stderr
    got, uninterrupted = per_step(tmp_path), per_step(runs[f"{name}-{recipe}"])
    for a, b in zip(uninterrupted, got):
        assert [b[k] for k in METRICS] == [a[k] for k in METRICS], f"step {a['step']}"  # bitwise
