"""Online RL end to end against TRL's ``GRPOTrainer`` (pip ``trl``, a test dependency): tiny
Llama, fp32, one process, 5 steps on the same prompts with the same completions (TRL's
``rollout_func`` and llmtrain's ``rollout.engine`` both hand out
:func:`grpo_fixtures.fixed_completion`), AdamW, constant learning rate and clipping. Per step,
llmtrain's loss and ``kl``, ``entropy``, ``clip_ratio/*``, ``reward``, ``reward_std``,
``frac_reward_zero_std`` and each reward function's mean and std equal TRL's within 1e-5, for
every ``loss_type``, with ``beta`` 0 and 0.04, ``num_iterations`` 1 and 2, ``epsilon_high`` above
``epsilon``, sequence-level importance sampling, batch-scaled rewards and masked truncated
completions.

One micro-batch per step (TRL logs the mean of its micro-batches' means; llmtrain the global
batch's, the same with one micro-batch). Prompts have one token length, so TRL's left padding
(which shifts positions) never applies."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from grpo_fixtures import fixed_completion, odd_tokens, short
from test_preference_trl import _common_args, _initial_model, _training_records, train_rows

trl = pytest.importorskip("trl")

STEPS, PROMPTS, G, COMPLETION, SEQ = 5, 2, 4, 12, 64
TOL = 1e-5
METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
ROLLOUT_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "rewards/odd_tokens/mean", "rewards/odd_tokens/std",
                   "rewards/short/mean", "completions/mean_length", "completions/max_length",
                   "completions/min_length")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    """32 arithmetic questions of one length (14 bytes)."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("prompts") / "questions.jsonl"
    lines = [json.dumps({"question": f"What is {rng.randint(10, 99)}+{rng.randint(10, 99)}?"}) for _ in range(32)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _ours(path: Path, run_dir: Path, fields: list[str]) -> tuple[list[dict], object]:
    return train_rows(["objective=grpo", "data=prompts", f"data.path={path}", "data.columns.prompt=question",
                       f"data.seq_len={SEQ}", "data.shuffle=false", "data.val_fraction=0.05",
                       "reward.functions=[tests.grpo_fixtures:odd_tokens,tests.grpo_fixtures:short]",
                       "rollout.engine=tests.grpo_fixtures:FixedCompletions",
                       f"rollout.max_completion_length={COMPLETION}", f"objective.num_generations={G}", *fields,
                       f"trainer.max_steps={STEPS}", f"trainer.global_batch_size={PROMPTS}",
                       f"trainer.micro_batch_size={PROMPTS}", "trainer.precision=fp32", "trainer.eval_samples=1",
                       "trainer.export_hf=false"], run_dir)


def _training_prompts(path: Path, cfg) -> list[str]:
    """The questions of llmtrain's training split, in its (unshuffled) order."""
    return [record["question"] for record in _training_records(path, cfg)]


def _trl(tmp_path: Path, cfg, questions: list[str], **config) -> list[dict]:
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from llmtrain.models.build import build_tokenizer

    tokenizer = build_tokenizer(cfg.model)
    logged: list[dict] = []

    def rollout(prompts, trainer):  # G copies of each prompt in a row: copy i % G is completion i % G
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        completions = [fixed_completion(p, i % G, COMPLETION) for i, p in enumerate(ids)]
        return {"prompt_ids": ids, "completion_ids": completions, "logprobs": [[0.0] * len(c) for c in completions]}

    class Recording(GRPOTrainer):
        def log(self, logs, start_time=None):
            metrics = {k: float(sum(v) / len(v)) for k, v in self._metrics["train"].items() if v}
            logged.append({**logs, **metrics})
            super().log(logs, start_time)

    common = {**_common_args(tmp_path, G * PROMPTS, cfg), "gradient_accumulation_steps": 1}
    args = GRPOConfig(**common, num_generations=G, max_completion_length=COMPLETION, shuffle_dataset=False,
                      temperature=1.0, **config)
    trainer = Recording(model=str(_initial_model(cfg, tmp_path)), reward_funcs=[odd_tokens, short], args=args,
                        train_dataset=datasets.Dataset.from_list([{"prompt": q} for q in questions]),
                        processing_class=tokenizer, rollout_func=rollout)
    trainer.model.float()
    trainer.train()
    return [r for r in logged if "loss" in r]


CASES = {  # name -> (llmtrain overrides, TRL's GRPOConfig fields)
    "grpo_batch_masked": (["objective.loss_type=grpo", "objective.scale_rewards=batch",
                           "objective.mask_truncated_completions=true", "objective.epsilon_high=0.28"],
                          dict(loss_type="grpo", scale_rewards="batch", mask_truncated_completions=True,
                               epsilon_high=0.28)),
    "dapo_kl": (["objective.loss_type=dapo", "objective.beta=0.04"], dict(loss_type="dapo", beta=0.04)),
    "dr_grpo_mu2": (["objective.loss_type=dr_grpo", "objective.num_iterations=2", "objective.epsilon_high=0.28"],
                    dict(loss_type="dr_grpo", num_iterations=2, epsilon_high=0.28)),
    "bnpo_sequence": (["objective.loss_type=bnpo", "objective.importance_sampling_level=sequence",
                       "objective.num_iterations=2", "objective.beta=0.04"],
                      dict(loss_type="bnpo", importance_sampling_level="sequence", num_iterations=2, beta=0.04)),
}


# The first case stays in the fast tier: one GRPO run against TRL in the inner loop.
@pytest.mark.parametrize("case", [*CASES][:1] + [pytest.param(case, marks=pytest.mark.slow) for case in [*CASES][1:]])
def test_five_steps_equal_trls_grpo_trainer(prompts, tmp_path, case):
    overrides, config = CASES[case]
    ours, cfg = _ours(prompts, tmp_path / "ours", overrides)
    theirs = _trl(tmp_path, cfg, _training_prompts(prompts, cfg), **{"beta": 0.0, **config})
    assert len(ours) == len(theirs) == STEPS
    mu = config.get("num_iterations", 1)
    for step, (o, t) in enumerate(zip(ours, theirs), start=1):
        assert o["train/loss"] == pytest.approx(t["loss"], abs=TOL, rel=1e-5), f"step {step} loss"
        # The gradient itself (its norm before clipping): on-policy losses are about 0 by construction.
        assert o["train/grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-4), f"step {step} grad norm"
        for key in METRICS:
            if key in t:
                assert o[f"train/{key}"] == pytest.approx(t[key], abs=TOL, rel=1e-5), f"step {step} {key}"
        if (step - 1) % mu == 0:  # a generation step: both log its rollout
            for key in ROLLOUT_METRICS:
                assert o[f"train/{key}"] == pytest.approx(t[key], abs=TOL, rel=1e-5), f"step {step} {key}"
    assert all(o["train/grad_norm"] > 0.1 for o in ours)  # the completions taught something
