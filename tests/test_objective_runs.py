"""Small in-process end-to-end runs (2 steps, the tiny model) of the objectives whose other runs are
all multi-process or long, so the fast tier (``pytest -m "not slow"``) trains every objective once:
instruction tuning (SFT), KTO and on-policy distillation here; language modelling in
``test_cli`` (the default job), DPO and the reward model in ``test_preference_data``, GRPO in
``test_grpo``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from conftest import FAST, make_cfg, train_rows

SHORT = ["trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.export_hf=false"]


def _lines(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_instruction_tuning_trains_on_alpaca_records(tmp_path):
    from llmtrain.trainer import train

    rng = random.Random(0)
    records = [{"instruction": f"Count to {i}.", "input": "",
                "output": " ".join(str(k) for k in range(rng.randint(1, 9)))} for i in range(40)]
    run = tmp_path / "sft"
    # Alpaca's template makes prompts of ~100 tokens: seq_len 256 keeps every response.
    out = train(make_cfg([o for o in FAST if not o.startswith("data.seq_len")] + SHORT + [
        "data=alpaca", f"data.path={_lines(tmp_path / 'a.jsonl', records)}", "data.seq_len=256",
        "trainer.micro_batch_size=2", f"run_dir={run}"]))
    rows = train_rows(run, 2)
    assert rows[1]["train/loss"] < rows[0]["train/loss"]
    assert out["final_val"]["val/loss"] < rows[0]["train/loss"]


def test_kto_starts_at_one_half_with_the_policy_as_its_reference(tmp_path):
    from llmtrain.trainer import train

    pairs = [{"prompt": f"Question {i}: what is {i} + {i}?", "chosen": f" It is {2 * i}.", "rejected": f" Maybe {i}."}
             for i in range(12)]
    run = tmp_path / "kto"
    train(make_cfg(SHORT + ["data=preference", f"data.path={_lines(tmp_path / 'p.jsonl', pairs)}", "objective=kto",
                            "trainer.micro_batch_size=4", "trainer.eval_every=0", "tracker=none",
                            "trainer.progress_bar=false", f"run_dir={run}"]))
    first, second = train_rows(run, 2)
    # Rewards and the KL estimate are 0 while the policy is the reference: 1 - sigmoid(0) per example.
    assert first["train/loss"] == pytest.approx(0.5, abs=1e-7)
    assert first["train/rewards/chosen"] == first["train/rewards/rejected"] == first["train/kl"] == 0.0
    assert second["train/rewards/chosen"] > second["train/rewards/rejected"]


def test_distillation_from_a_teacher_equal_to_the_student_starts_at_zero_kl(tmp_path):
    from llmtrain.trainer import train

    questions = [{"question": f"What is {a}+{a * 2}?", "completion": f"{a}+{a * 2}={a * 3}"} for a in range(16)]
    run = tmp_path / "distill"
    # The teacher is built from the student's model group and seed: the same initial weights.
    train(make_cfg([o for o in FAST if not o.startswith(("data.max_bytes", "data.seq_len", "trainer.eval"))] + SHORT + [
        "objective=distill", "objective.teacher=tiny_llama", "data=prompts",
        f"data.path={_lines(tmp_path / 'q.jsonl', questions)}", "data.columns.prompt=question", "data.seq_len=48",
        "rollout.max_completion_length=8", "objective.num_generations=2", "trainer.micro_batch_size=2",
        "trainer.eval_every=0", f"run_dir={run}"]))
    first, second = train_rows(run, 2)
    assert first["train/loss"] == first["train/teacher_kl"] == pytest.approx(0.0, abs=1e-6)
    assert second["train/teacher_kl"] > 0  # the student moved away from its initial weights
