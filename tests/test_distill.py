"""On-policy distillation (``objective=distill``): tiny Llama students of a trained tiny Llama
teacher (its Hugging Face export, trained in the same launch).

* The loss of each of the first 3 steps equals the per-token reverse KL written out with plain
  ``transformers`` models (the student's weights before the step: its initial weights, then each
  checkpoint's export; the teacher's folder), summed over the vocabulary, averaged over the
  global batch's completion tokens, within 1e-5.
* On 2 processes (zero3 and fsdp: the teacher sharded like the student) every step equals the
  1-process run within 1e-5.
* λ = 0 trains on the data's own completions only; a missing teacher, another vocabulary and
  a missing ``completion`` column are refused before anything is written.

The completions are weight-independent (``tests.grpo_fixtures:FixedCompletions``) so the written-
out reference knows them; one launch per world size (``tests/scenarios.py``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from conftest import FAST, make_cfg, read_metrics, run_scenarios, train_rows

STEPS, G, COMPLETION, TOL = 4, 2, 12, 1e-5
FIXED = "rollout.engine=tests.grpo_fixtures:FixedCompletions"


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("distill") / "questions.jsonl"
    pairs = [(rng.randint(0, 50), rng.randint(0, 50)) for _ in range(48)]
    path.write_text("".join(json.dumps({"question": f"What is {a}+{b}?", "completion": f"{a}+{b}={a + b}"}) + "\n"
                            for a, b in pairs), encoding="utf-8")
    return path


def student(questions: Path, teacher: Path, *extra: str) -> list[str]:
    return [o for o in FAST if not o.startswith(("data.max_bytes", "data.seq_len", "trainer.eval"))] + [
        "objective=distill", f"objective.teacher={teacher}", "data=prompts", f"data.path={questions}",
        "data.columns.prompt=question", "data.seq_len=48", f"rollout.max_completion_length={COMPLETION}",
        f"objective.num_generations={G}", f"trainer.max_steps={STEPS}", "trainer.global_batch_size=4",
        "trainer.micro_batch_size=1", "trainer.lr=3e-3", "trainer.warmup_steps=1", "trainer.precision=fp32",
        "trainer.export_hf=false", "data.val_fraction=0.1", "trainer.eval_samples=3", "trainer.eval_every=2",
        *extra]


@pytest.fixture(scope="module")
def runs(questions, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distill-1")
    teacher = root / "teacher" / "hf"
    one = {"teacher": [*FAST, "trainer.max_steps=30", "trainer.export_hf=true", "trainer.lr=3e-3"],
           "fixed": student(questions, teacher, FIXED, "rollout.log_completions=8", "trainer.save_every=1",
                            "trainer.keep_checkpoints=10"),
           "sampled": student(questions, teacher),
           "lambda0": student(questions, teacher, "objective.lmbda=0", "rollout.log_completions=8")}
    out = run_scenarios(one, 1, root, timeout=1500)
    two = {f"sampled-{recipe}": student(questions, teacher, f"+recipe={recipe}") for recipe in ("zero3", "fsdp")}
    out.update(run_scenarios(two, 2, tmp_path_factory.mktemp("distill-2"), timeout=1500))  # 2.7 GB in all
    return out


def _hf(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


@pytest.mark.slow
def test_the_loss_is_the_per_token_reverse_kl_written_out(runs, questions, tmp_path):
    from grpo_fixtures import fixed_completion
    from test_preference_trl import _initial_model

    from llmtrain.checkpoint.export import export_checkpoint
    from llmtrain.data.prompts import render
    from llmtrain.models.build import build_tokenizer

    run = runs["fixed"]
    cfg = make_cfg(student(questions, runs["teacher"] / "hf", FIXED))
    tokenizer = build_tokenizer(cfg.model)
    teacher = _hf(runs["teacher"] / "hf")
    ours = {r["step"]: r for r in train_rows(run, STEPS)}
    for step in (1, 2, 3):
        if step == 1:
            weights = _initial_model(cfg, tmp_path)
        else:
            weights = export_checkpoint(run / "checkpoints" / f"step_{step - 1}", tmp_path / f"step_{step - 1}")
        model = _hf(weights)
        lines = [json.loads(line) for line in (run / "completions" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(lines) == 4 * G  # the whole global batch (1 process)
        total, tokens = 0.0, 0
        for k, line in enumerate(lines):
            prompt_ids = render(line["prompt"], tokenizer, str(cfg.data.template), "test")
            ids = fixed_completion(prompt_ids, k % G, COMPLETION)
            sequence = torch.tensor([prompt_ids + ids])
            p = len(prompt_ids)
            with torch.no_grad():
                s = torch.log_softmax(model(sequence).logits[0, p - 1:-1].double(), -1)
                t = torch.log_softmax(teacher(sequence).logits[0, p - 1:-1].double(), -1)
            total += float((s.exp() * (s - t)).sum())  # Σ_t Σ_v p_s (log p_s - log p_t)
            tokens += len(ids)
        assert ours[step]["train/loss"] == pytest.approx(total / tokens, abs=TOL), f"step {step}"
        assert ours[step]["train/teacher_kl"] == pytest.approx(total / tokens, abs=TOL)


@pytest.mark.slow
def test_the_student_learns_and_the_held_out_kl_falls(runs):
    rows = train_rows(runs["sampled"], STEPS)
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    val = [r for r in read_metrics(runs["sampled"]) if "val/loss" in r]
    assert [r["step"] for r in val] == [0, 2, 4] and val[-1]["val/loss"] < 0.8 * val[0]["val/loss"]
    assert all(r["val/teacher_kl"] == r["val/loss"] for r in val)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["zero3", "fsdp"])
def test_two_ranks_with_a_sharded_teacher_equal_one_process(runs, recipe):
    keys = ("train/loss", "train/grad_norm", "train/sampled_kl", "data/sample_digest")
    for a, b in zip(train_rows(runs["sampled"], STEPS), train_rows(runs[f"sampled-{recipe}"], STEPS)):
        assert b["data/sample_digest"] == a["data/sample_digest"]
        for key in keys:
            assert b[key] == pytest.approx(a[key], abs=TOL, rel=1e-5), f"step {a['step']} {key}"
    val_one, val_two = ([r for r in read_metrics(runs[n]) if "val/loss" in r] for n in ("sampled", f"sampled-{recipe}"))
    for a, b in zip(val_one, val_two):
        assert b["val/loss"] == pytest.approx(a["val/loss"], abs=TOL)


@pytest.mark.slow
def test_lambda_zero_trains_on_the_datas_own_completions(runs):
    rows = train_rows(runs["lambda0"], STEPS)
    assert all(r["rollout/on_policy"] == 0.0 for r in rows)
    for line in (runs["lambda0"] / "completions" / "step_1.jsonl").read_text().splitlines():
        record = json.loads(line)
        a, b = record["prompt"][len("What is "):-1].split("+")
        assert record["completion"] == f"{a}+{b}={int(a) + int(b)}"


@pytest.mark.parametrize("override,message", [
    ("objective.teacher=null", "objective=distill needs objective.teacher"),
    ("objective.lmbda=1.5", "objective.lmbda=1.5 must be in [0, 1]"),
    ("objective.num_generations=0", "objective.num_generations=0 must be >= 1"),
    ("objective.beta=0.5", "objective.beta=0.5 does not apply to objective=distill"),
])
def test_bad_distillation_configs_are_refused_naming_the_field(questions, override, message):
    import re

    from llmtrain.common.errors import ConfigError
    from llmtrain.config.validate import validate

    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(make_cfg(student(questions, "tiny_llama", override)), 1)


@pytest.mark.parametrize("teacher,extra,message", [
    ("no_such_model", [], "objective.teacher='no_such_model' is neither a folder nor a model group of conf/model"),
    ("tiny_llama", ["model.architecture.vocab_size=384"], "has 320 logits per token, the student model tiny_llama 384"),
    ("tiny_llama", ["objective.lmbda=0.5", "data.columns.prompt=completion"],
     "the records of data.path lack (theirs: "),
])
def test_a_teacher_that_cannot_serve_fails_before_anything_is_written(questions, tmp_path, teacher, extra, message):
    import re

    from llmtrain.common.errors import ConfigError
    from llmtrain.trainer import train

    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=re.escape(message)):
        train(make_cfg(student(questions, teacher, *extra, f"run_dir={run_dir}")))
    assert not run_dir.exists()
