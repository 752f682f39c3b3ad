"""Online RL (``objective=grpo``, the ``hf`` rollout engine) on every data-parallel layout:
completions are seeded per prompt and sample, so 2 processes (ddp, zero2, zero3, fsdp, tp; LoRA
with a KL term and ``num_iterations=2`` on zero3 and fsdp) sample exactly the completions of the
1-process run (the step's sample digest, a sum of CRC32s of every prompt + completion, is equal)
and their per-step losses, gradient norms, rewards and held-out rewards equal it within 1e-5;
SIGKILL between the two optimizer steps of a generation batch and rerun continues bit for bit,
and the same checkpoint on another world size is refused.

One launch per world size trains every run of this module (``tests/scenarios.py``): 4 prompts a
step (micro-batch 1: 1 process accumulates 4, 2 processes 2 each), 4 completions each, fp32,
6 steps, checkpoints and held-out evaluations at 3 and 6."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest

from conftest import FAST, assert_ok, cores_for, read_metrics, run_cli, run_scenarios, train_rows
from test_resume import kill_after, launch, wait_for_step

STEPS = 6
TOL = 1e-5
FIXTURES = "tests.grpo_fixtures"
ASYNC = ["rollout.async_generation=true", "rollout.max_staleness=1"]
RUNS = {"dapo": ["objective.loss_type=dapo"],
        "lora": ["+peft=lora", "peft.r=4", "objective.loss_type=grpo", "objective.beta=0.04",
                 "objective.num_iterations=2"],
        # Weight-independent completions, so the hand reference knows them; every step checkpointed
        # (the weights that sampled and that train each step); rank 0 logs all its completions.
        "async": ["objective.loss_type=dapo", *ASYNC, f"rollout.engine={FIXTURES}:FixedCompletions",
                  "rollout.log_completions=16", "trainer.save_every=1", "trainer.keep_checkpoints=10"],
        # Calculator episodes; the model's side scripted (a random model never closes a tag).
        "tools": ["objective.loss_type=dapo", "rollout.environment=calculator", "reward.functions=[gsm8k]",
                  f"rollout.engine={FIXTURES}:ScriptedCalculator", "data.seq_len=128", "rollout.max_completion_length=96"]}
TWO_RANKS = {"dapo": ["ddp", "zero2", "zero3", "fsdp", "tp"], "lora": ["zero3", "fsdp"], "async": ["ddp"],
             "tools": ["zero3"]}
PACKED = ["ddp", "zero3", "fsdp"]  # padding-free rollouts, against the padded runs of the same recipe
CASES = [(name, recipe) for name, recipes in TWO_RANKS.items() for recipe in recipes]


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("gsm") / "questions.jsonl"
    pairs = [(rng.randint(0, 50), rng.randint(0, 50)) for _ in range(64)]
    path.write_text("".join(json.dumps({"question": f"What is {a}+{b}?", "answer": f"{a}+{b}={a + b}\n#### {a + b}"})
                            + "\n" for a, b in pairs), encoding="utf-8")
    return path


def overrides_of(name: str, questions: Path) -> list[str]:
    return [o for o in FAST if not o.startswith(("data.max_bytes", "data.seq_len", "trainer.eval"))] + [
        "objective=grpo", "data=prompts", f"data.path={questions}", "data.columns.prompt=question", "data.seq_len=64",
        f"reward.functions=[{FIXTURES}:odd_tokens,{FIXTURES}:short,{FIXTURES}:answer_seen]",
        "rollout.max_completion_length=10", "objective.num_generations=4", f"trainer.max_steps={STEPS}",
        "trainer.save_every=3", "trainer.eval_every=3", "data.val_fraction=0.1", "trainer.eval_samples=3",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=1", "trainer.lr=3e-3", "trainer.warmup_steps=1", "trainer.precision=fp32",
        "trainer.export_hf=false", *RUNS[name]]


@pytest.fixture(scope="module")
def runs(questions, tmp_path_factory) -> dict[str, Path]:
    one = {name: overrides_of(name, questions) + ["+recipe=ddp"] for name in RUNS}
    two = {f"{name}-{recipe}": overrides_of(name, questions) + [f"+recipe={recipe}"] for name, recipe in CASES}
    two.update({f"packed-{recipe}": overrides_of("dapo", questions) + ["rollout.packing=true", "data.seq_len=48",
                                                                     f"+recipe={recipe}"] for recipe in PACKED})
    # Asynchronous generation with staleness 0 is the synchronous run.
    two["stale0-ddp"] = overrides_of("dapo", questions) + ["rollout.async_generation=true", "rollout.max_staleness=0",
                                                            "+recipe=ddp"]
    out = {}
    for nproc, group in ((1, one), (2, two)):
        # 2.9 GB for the 2-rank launch's processes together (2026-12-06, bounded GRPO head): a
        # launch beside a one-process test, like any other.
        out.update(run_scenarios(group, nproc, tmp_path_factory.mktemp(f"grpo-{nproc}"), timeout=1500))
    return out


def test_every_two_rank_run_composes_with_its_share_of_the_prompts(questions):
    """In-process, for the fast tier: each run of the 2-rank launch composes and validates on 2
    ranks; a data-parallel layout takes 2 of a step's 4 prompts a rank (accumulating 2 of micro-batch
    1), tp gives both ranks all 4."""
    from conftest import make_cfg
    from llmtrain.config.validate import validate

    for name, recipe in CASES:
        shape = validate(make_cfg(overrides_of(name, questions) + [f"+recipe={recipe}"]), 2)
        assert (shape.dp, shape.accumulation) == ((1, 4) if recipe == "tp" else (2, 2)), (name, recipe)


KEYS = ("train/loss", "train/grad_norm", "train/entropy", "train/reward", "train/reward_std",
        "train/completions/mean_length")


@pytest.mark.slow
@pytest.mark.parametrize("name,recipe", CASES)
def test_two_ranks_sample_the_same_completions_and_equal_one_process(name, recipe, runs):
    one, two = train_rows(runs[name], STEPS), train_rows(runs[f"{name}-{recipe}"], STEPS)
    mu = 2 if name == "lora" else 1
    for a, b in zip(one, two):
        if name == "async":
            assert b["rollout/staleness"] == float(a["step"] > 1)
        assert b["data/sample_digest"] == a["data/sample_digest"], f"step {a['step']}: other completions"
        for key in KEYS if (a["step"] - 1) % mu == 0 else KEYS[:3]:
            assert b[key] == pytest.approx(a[key], abs=TOL, rel=1e-5), f"step {a['step']} {key}"
        if name == "lora":
            assert b["train/kl"] == pytest.approx(a["train/kl"], abs=TOL, rel=1e-5)
    val_one, val_two = ([r for r in read_metrics(runs[n]) if "val/reward" in r] for n in (name, f"{name}-{recipe}"))
    assert [r["step"] for r in val_two] == [0, 3, 6]
    for a, b in zip(val_one, val_two):
        assert b["val/reward"] == pytest.approx(a["val/reward"], abs=TOL)
        assert b["val/reward_stderr"] == pytest.approx(a["val/reward_stderr"], abs=TOL)  # squares all-reduced
        assert b["val/prompts"] == a["val/prompts"] == 3  # 2 on rank 0, 1 on rank 1


@pytest.mark.slow
def test_rollout_records_and_outputs(runs):
    rows = train_rows(runs["lora"], STEPS)
    # num_iterations=2: a generation batch at steps 1, 3 and 5, reused at 2, 4 and 6.
    assert [("train/reward" in r) for r in rows] == [True, False] * 3
    assert all(r["train/kl"] >= 0 for r in rows) and rows[0]["train/kl"] == pytest.approx(0, abs=1e-7)
    assert all(0 <= r["train/frac_reward_zero_std"] <= 1 for r in rows if "train/reward" in r)
    first = rows[0]
    assert first["train/completions/min_length"] <= first["train/completions/mean_length"] <= 10
    assert {"train/rewards/odd_tokens/mean", "train/rewards/short/mean", "train/rewards/answer_seen/std",
            "rollout/generation_s", "time/generation_s"} <= set(first)
    lines = [json.loads(line) for line in (runs["lora"] / "completions" / "step_1.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and set(lines[0]["rewards"]) == {"odd_tokens", "short", "answer_seen"}
    group = [line["advantage"] for line in lines]
    assert abs(sum(group)) < 1e-6  # one prompt's G=4 completions: group-relative advantages sum to 0
    assert lines[0]["prompt"].startswith("What is ")


@pytest.mark.slow
def test_completions_of_every_rank_are_gathered_in_global_order(runs):
    """``rollout.log_completions=16`` on 2 ranks: each step's file holds the whole global batch
    (4 prompts x G=4), rank 0's 8 then rank 1's 8 (prompt, then completion within its group),
    with the completions, rewards and advantages of the 1-process run's file."""
    keys = ("record", "prompt", "completion", "tokens", "rewards", "reward")
    for step in range(1, STEPS + 1):
        one, two = ([json.loads(line) for line in (runs[name] / "completions" / f"step_{step}.jsonl")
                     .read_text().splitlines()] for name in ("async", "async-ddp"))
        assert [r["rank"] for r in one] == [0] * 16
        assert [r["rank"] for r in two] == [0] * 8 + [1] * 8, f"step {step}"
        assert [[r[k] for k in keys] for r in two] == [[r[k] for k in keys] for r in one], f"step {step}"
        assert [r["advantage"] for r in two] == pytest.approx([r["advantage"] for r in one], abs=1e-9)
        assert len({r["record"] for r in two}) == 4


@pytest.mark.slow
def test_sigkill_inside_a_generation_batch_then_rerun_continues_exactly(runs, questions, tmp_path):
    overrides = overrides_of("lora", questions) + ["+recipe=zero3", f"run_dir={tmp_path}"]
    kill_after(overrides, tmp_path, 5, nproc=2)  # step 6 reuses step 5's batch, saves
    assert (tmp_path / "checkpoints" / "step_3" / "rollout_rank_1.safetensors").is_file()  # step 3 is mid-batch
    elsewhere = run_cli(overrides, nproc=1)
    assert elsewhere.returncode == 2, elsewhere.stderr[-2000:]
    assert "resume it on 2 rank(s)" in elsewhere.stderr
    resumed = run_cli(overrides, nproc=2)
    assert_ok(resumed)
    assert "resuming from" in resumed.stdout + resumed.stderr
    keys = ("train/loss", "train/grad_norm", "train/kl", "data/sample_digest")
    for a, b in zip(train_rows(runs["lora-zero3"], STEPS), train_rows(tmp_path, STEPS)):
        assert [b[k] for k in keys] == [a[k] for k in keys], f"step {a['step']}"  # bitwise


@pytest.mark.slow
def test_staleness_zero_is_the_synchronous_run_bit_for_bit(runs):
    keys = ("train/loss", "train/grad_norm", "train/reward", "data/sample_digest", "train/entropy")
    for a, b in zip(train_rows(runs["dapo-ddp"], STEPS), train_rows(runs["stale0-ddp"], STEPS)):
        assert [b[k] for k in keys] == [a[k] for k in keys], f"step {a['step']}"
        assert b["rollout/staleness"] == 0.0 and "train/importance_ratio/mean" not in b


def _exported(checkpoint: Path, out: Path):
    import torch
    import transformers

    from llmtrain.checkpoint.export import export_checkpoint

    export_checkpoint(checkpoint, out)
    return transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()


@pytest.mark.slow
def test_async_generation_loss_equals_truncated_importance_sampling_written_out(runs, questions, tmp_path):
    """Step s trains on completions the weights after step s - 2 sampled, with the weights after
    step s - 1: per token -A · min(π_{s-1} / π_{s-2}, 3) (the on-policy clipped surrogate's value
    is -A; TIS: Yao et al. 2025), DAPO-normalised over the global batch's completion tokens. The
    completions are :func:`grpo_fixtures.fixed_completion`; the weights are each checkpoint's
    export; advantages are recomputed from the logged rewards by GRPO's formula."""
    import torch

    from conftest import make_cfg
    from grpo_fixtures import fixed_completion
    from llmtrain.data.prompts import render
    from llmtrain.models.build import build_tokenizer

    one, two = runs["async"], runs["async-ddp"]
    cfg = make_cfg(overrides_of("async", questions) + ["+recipe=ddp"])
    tokenizer = build_tokenizer(cfg.model)
    ours = {r["step"]: r for r in train_rows(two, STEPS)}
    models = {}
    for step in (3, 4, 5):
        for k in (step - 2, step - 1):
            if k not in models:
                models[k] = _exported(one / "checkpoints" / f"step_{k}", tmp_path / f"step_{k}")
        lines = [json.loads(line) for line in (one / "completions" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(lines) == 16  # 4 prompts x G=4: the whole global batch
        total, tokens, ratios = 0.0, 0, []
        for start in range(0, 16, 4):
            group = lines[start:start + 4]
            rewards = torch.tensor([g["reward"] for g in group], dtype=torch.float64)
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            prompt_ids = render(group[0]["prompt"], tokenizer, str(cfg.data.template), "test")
            for index, (line, advantage) in enumerate(zip(group, advantages.tolist())):
                assert line["advantage"] == pytest.approx(advantage, abs=1e-6)
                ids = fixed_completion(prompt_ids, index, 10)
                assert len(ids) == line["tokens"]
                sequence = torch.tensor([prompt_ids + ids])
                p = len(prompt_ids)
                logps = {}
                with torch.no_grad():
                    for k in (step - 2, step - 1):
                        logits = models[k](sequence).logits[0, p - 1:-1].double()
                        logps[k] = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
                ratio = torch.exp(logps[step - 1] - logps[step - 2])
                ratios.append(ratio)
                total += float((-advantage * ratio.clamp(max=3.0)).sum())
                tokens += len(ids)
        assert ours[step]["train/loss"] == pytest.approx(total / tokens, abs=TOL), f"step {step}"
        assert ours[step]["train/importance_ratio/mean"] == pytest.approx(float(torch.cat(ratios).mean()), abs=TOL)
        assert ours[step]["rollout/staleness"] == 1.0
    assert any(abs(ours[s]["train/loss"]) > 1e-3 for s in (3, 4, 5))  # the weights moved: the correction bites


@pytest.mark.slow
def test_sigkill_with_a_batch_sampled_ahead_then_rerun_continues_exactly(runs, questions, tmp_path):
    overrides = overrides_of("async", questions) + ["+recipe=ddp", f"run_dir={tmp_path}"]
    with cores_for(2):
        proc = launch(overrides, nproc=2)
        wait_for_step(proc, tmp_path, 4)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    saved = sorted(tmp_path.glob("checkpoints/step_*/rollout_rank_1.safetensors"))
    assert saved, "no checkpoint holds the batch sampled ahead"
    resumed = run_cli(overrides, nproc=2)
    assert_ok(resumed)
    assert "resuming from" in resumed.stdout + resumed.stderr
    keys = ("train/loss", "train/grad_norm", "train/importance_ratio/mean", "data/sample_digest", "rollout/staleness")
    for a, b in zip(train_rows(runs["async-ddp"], STEPS), train_rows(tmp_path, STEPS)):
        assert [b[k] for k in keys] == [a[k] for k in keys], f"step {a['step']}"  # bitwise


@pytest.mark.slow
def test_calculator_episodes_are_recorded_turn_by_turn(runs):
    rows = train_rows(runs["tools-zero3"], STEPS)
    assert all(r["train/episodes/turns_mean"] == 2.0 and r["train/episodes/tool_calls_mean"] == 1.0 for r in rows)
    # One seed in three writes a malformed call: a tool error, answered and logged, never a crash.
    assert all(0 < r["train/episodes/tool_errors_mean"] < 1 for r in rows)
    lines = [json.loads(line) for line in (runs["tools-zero3"] / "completions" / "step_1.jsonl").read_text().splitlines()]
    roles = [[t["role"] for t in line["turns"]] for line in lines]
    assert all(r == ["assistant", "tool", "assistant"] for r in roles)
    for line in lines:
        call, answer, final = (t["text"] for t in line["turns"])
        assert line["completion"] == call + answer + final
        if line["tool_errors"]:
            assert "plus" in call and answer.startswith("<result>error:")
        else:
            a, b = call[len("<calc>"):-len("</calc>")].split("+")
            assert answer == f"<result>{int(a) + int(b)}</result>\n"
            assert line["rewards"]["gsm8k"] == float(final == f"#### {int(a) + int(b)}")
    val = [r for r in read_metrics(runs["tools-zero3"]) if "val/reward" in r]
    assert all(r["val/episodes/turns_mean"] == 2.0 for r in val)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", PACKED)
def test_packed_rollouts_equal_the_padded_run(recipe, runs):
    """``rollout.packing``: each micro-batch's 4 sequences (prompts of ~14 tokens, completions
    up to 10) packed into rows of ``data.seq_len=48``; the same completions (digest), losses,
    gradient norms and entropies as the padded run within 1e-5."""
    keys = ("train/loss", "train/grad_norm", "train/entropy", "train/reward")
    for a, b in zip(train_rows(runs[f"dapo-{recipe}"], STEPS), train_rows(runs[f"packed-{recipe}"], STEPS)):
        assert b["data/sample_digest"] == a["data/sample_digest"], f"step {a['step']}: other completions"
        for key in keys:
            assert b[key] == pytest.approx(a[key], abs=TOL, rel=1e-5), f"step {a['step']} {key}"
