"""Online RL (``objective=grpo``): the loss against TRL's ``GRPOTrainer`` on the same inputs,
advantages against their definitions."""

from __future__ import annotations

import re

import pytest
import torch

trl = pytest.importorskip("trl")

G, PROMPT, COMPLETION = 4, 6, 5  # completions per prompt, prompt and completion tokens


def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1)
    return LlamaForCausalLM(config)


def _trl_trainer(tmp_path, model, **config):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from llmtrain.models.build import byte_tokenizer

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=G, num_generations=G,
                      max_completion_length=COMPLETION, report_to=[], use_cpu=True, bf16=False, logging_steps=1,
                      **config)
    model.save_pretrained(tmp_path / "model")  # with beta > 0 TRL loads its reference from the model's folder
    trainer = GRPOTrainer(model=str(tmp_path / "model"), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          args=args, train_dataset=Dataset.from_list([{"prompt": "hi"}] * G),
                          processing_class=byte_tokenizer())
    trainer.model.float().train()  # TRL logs under "train" in training mode
    return trainer


def _inputs(model, beta: float, num_iterations: int):
    """One group: G completions of one prompt, with padding after two of them, advantages, and
    (old, reference) log-probs that differ from the current ones."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, 64, (1, PROMPT), generator=g).repeat(G, 1)
    completion = torch.randint(2, 64, (G, COMPLETION), generator=g)
    mask = torch.ones(G, COMPLETION)
    mask[1, 3:] = 0
    mask[2, 1:] = 0
    completion = completion * mask.long()  # pad id 0 after the end
    advantages = torch.tensor([1.2, -0.7, 0.4, -0.9])
    with torch.no_grad():
        logits = model(torch.cat([prompt, completion], 1)).logits[:, PROMPT - 1:-1]
        current = torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    old = current + 0.3 * torch.randn(current.shape, generator=g) if num_iterations > 1 else None
    ref = current + 0.2 * torch.randn(current.shape, generator=g) if beta else None
    return prompt, completion, mask, advantages, old, ref


def _ours(model, loss_type: str, prompt, completion, mask, advantages, old, ref, **fields) -> tuple[float, dict]:
    from llmtrain.objectives.grpo import GRPO

    objective = GRPO({"loss_type": loss_type, **fields})
    objective.max_completion_length = COMPLETION
    rows = torch.cat([prompt, completion], 1)
    labels = torch.full(rows.shape, -100)
    labels[:, PROMPT:] = torch.where(mask.bool(), completion, -100)
    carried = torch.zeros(rows.shape)
    per_token = lambda values: torch.cat([carried[:, :PROMPT], values], 1) if values is not None else carried  # noqa: E731
    batch = objective.prepare({"input_ids": rows, "attention_mask": torch.ones_like(rows), "labels": labels,
                               "completion_mask": per_token(mask), "old_logps": per_token(old),
                               "ref_logps": per_token(ref),
                               "advantages": per_token(advantages.unsqueeze(1).expand(-1, COMPLETION) * mask)})
    sums = objective.loss_sums(model(rows).logits, batch)
    normaliser = float(objective.normaliser(batch))
    names = objective.metric_names
    values = {name: float(sums.metrics[name]) for name in names}
    return float(sums.loss) / normaliser, objective.average(values, normaliser)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
@pytest.mark.parametrize("beta,num_iterations,epsilon_high,level", [
    (0.0, 1, None, "token"), (0.04, 2, 0.28, "token"), (0.04, 2, None, "sequence"), (0.0, 2, 0.28, "sequence")])
def test_the_loss_and_its_metrics_equal_trls_on_the_same_inputs(tmp_path, loss_type, beta, num_iterations,
                                                                  epsilon_high, level):
    model = _tiny_model()
    prompt, completion, mask, advantages, old, ref = _inputs(model, beta, num_iterations)
    fields = {"beta": beta, "num_iterations": num_iterations, "epsilon_high": epsilon_high,
              "importance_sampling_level": level}
    trainer = _trl_trainer(tmp_path, model, loss_type=loss_type, beta=beta, num_iterations=num_iterations,
                           epsilon_high=epsilon_high, importance_sampling_level=level)
    trainer.current_gradient_accumulation_steps = 1
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
              "completion_mask": mask, "advantages": advantages, "num_items_in_batch": mask.sum()}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    theirs = float(trainer._compute_loss(trainer.model, inputs).detach())
    loss, metrics = _ours(model, loss_type, prompt, completion, mask, advantages, old, ref, **fields)
    assert loss == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    for name in ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                 *(["kl"] if beta else [])):
        assert metrics[name] == pytest.approx(logged[name], rel=1e-5, abs=1e-7), name


def test_group_advantages_follow_their_definitions():
    from llmtrain.objectives.grpo import group_advantages

    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    grpo = group_advantages(rewards)
    assert torch.allclose(grpo[0], (rewards[0] - 0.5) / (rewards[0].std() + 1e-4))
    assert torch.equal(grpo[1], torch.zeros(4, dtype=torch.float64))  # a group without spread teaches nothing
    rloo = group_advantages(rewards, "rloo", "none")
    others = (rewards.sum(1, keepdim=True) - rewards) / 3  # the mean of the group's other rewards
    assert torch.allclose(rloo, rewards - others)
    batch = group_advantages(rewards, scale="batch", batch_std=2.0)
    assert torch.allclose(batch, (rewards - rewards.mean(1, keepdim=True)) / (2.0 + 1e-4))


# ---- configs and bad input ---------------------------------------------------------------------
def _grpo_overrides(path, *extra: str) -> list[str]:
    return ["objective=grpo", "data=prompts", f"data.path={path}", "data.columns.prompt=question", "data.seq_len=64",
            "reward.functions=[tests.grpo_fixtures:odd_tokens]", "rollout.max_completion_length=8",
            "objective.num_generations=2", "trainer.global_batch_size=2", "trainer.micro_batch_size=1",
            "trainer.max_steps=2", "trainer.eval_every=0", "trainer.eval_samples=2", "tracker=none",
            "trainer.progress_bar=false", "trainer.export_hf=false", *extra]


@pytest.fixture()
def questions(tmp_path):
    import json

    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i}+{i}?", "answer": f"#### {2 * i}"}) + "\n"
                            for i in range(12)), encoding="utf-8")
    return path


@pytest.mark.parametrize("override,message", [
    ("objective.num_generations=1", "objective.num_generations=1: a group needs at least 2"),
    ("rollout.generation_batch=0", "rollout.generation_batch=0 must be >= 1 (rows decoded together)"),
    ("objective.loss_type=sigmoid", "objective.loss_type='sigmoid' must be one of grpo, dapo"),
    ("objective.scale_rewards=rank", "objective.scale_rewards='rank' must be one of group, batch, none"),
    ("objective.epsilon_high=0.1", "objective.epsilon_high=0.1 must be >= objective.epsilon=0.2"),
    ("objective.gamma=3.0", "objective.gamma=3.0 does not apply to objective=grpo"),
    ("+recipe=pp", "pipeline stages cannot do alone"),
    ("rollout.temperature=0", "rollout.temperature=0"),
    ("rollout.max_completion_length=64", "leaves no room for a prompt in data.seq_len=64"),
    ("rollout.engine=sglang", "rollout.engine='sglang' must be one of hf, vllm or module:Class"),
    ("reward.functions=[]", "reward.functions is empty"),
    ("reward.weights=[1.0,2.0]", "reward.weights has 2 values for 1 reward.functions"),
    ("data.format=text", "data.columns: ['prompt'] are not fields of format text"),
    ("rollout.max_turns=0", "rollout.max_turns=0 must be >= 1"),
    ("rollout.max_staleness=-1", "rollout.max_staleness=-1 must be >= 0"),
    ("objective.sampling_correction=clip", "objective.sampling_correction='clip' must be one of token_truncate"),
    ("objective.sampling_correction_min=4.0", "objective.sampling_correction_min=4.0 / _max=3.0"),
    ("reward.weights=[inf]", "reward.weights=[inf] must be finite numbers"),
    ("reward.weights=[nan]", "reward.weights=[nan] must be finite numbers"),
])
def test_bad_online_configs_are_refused_naming_the_field(questions, override, message):
    from conftest import make_cfg
    from llmtrain.common.errors import ConfigError
    from llmtrain.config.validate import validate

    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(make_cfg(_grpo_overrides(questions, override)), 2 if "recipe=pp" in override else 1)


def test_prompts_and_rewards_only_with_an_online_objective(questions):
    from conftest import make_cfg
    from llmtrain.common.errors import ConfigError
    from llmtrain.config.validate import validate

    with pytest.raises(ConfigError, match="data.format=prompts holds prompts without completions"):
        validate(make_cfg(_grpo_overrides(questions, "objective=causal_lm", "reward.functions=[]")), 1)
    with pytest.raises(ConfigError, match="rewards score sampled completions"):
        validate(make_cfg(["reward.functions=[gsm8k]"]), 1)
    with pytest.raises(ConfigError, match="objective=grpo samples completions of prompts: every source's format must "
                                          "be prompts"):
        validate(make_cfg(["objective=grpo", "reward.functions=[gsm8k]"]), 1)


@pytest.mark.parametrize("function,message", [
    ("no_such_module:f", r"reward.functions\[0\]='no_such_module:f' cannot be imported"),
    ("tests.grpo_fixtures:wrong_count", "wrong_count returned 1 values for 4 completions in the start-up check"),
    ("tests.grpo_fixtures:not_a_number", "not_a_number returned nan for completion 0 in the start-up check"),
    ("tests.grpo_fixtures:infinite", "infinite returned inf for completion 0 in the start-up check"),
    ("tests.grpo_fixtures:text_values", r"text_values returned '0.5' for completion 0 in the start-up check \(.*\): "
                                        "rewards must be finite real numbers"),
    ("length:x", r"the argument is the penalty's window in tokens"),
])
def test_a_bad_reward_function_fails_before_anything_is_written(questions, tmp_path, function, message):
    from conftest import make_cfg
    from llmtrain.common.errors import ConfigError
    from llmtrain.trainer import train

    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        train(make_cfg(_grpo_overrides(questions, f"reward.functions=[{function}]", f"run_dir={run_dir}")))
    assert not run_dir.exists()


def test_reward_values_trl_takes_are_taken_and_non_finite_ones_refused():
    """TRL converts a function's values with torch.tensor(float32): numpy scalars and arrays, ints,
    bools and 0-d tensors are numbers to it, and to the scorer; text and ±inf (at any step) are
    not."""
    import numpy as np

    from llmtrain.rollout import RewardError, score
    from llmtrain.rollout.rewards import RewardFunction

    def scored(values):
        f = RewardFunction("f", lambda completions, **_: values, 1.0)
        return score([f], ["p"] * len(values), ["c"] * len(values), [[]] * len(values), {}, "at step 3")

    taken = [np.float32(0.5), np.int64(2), 1, True, np.bool_(False), torch.tensor(0.25), np.array(-1.5), None]
    assert scored(taken)[:, 0].tolist()[:-1] == [0.5, 2.0, 1.0, 1.0, 0.0, 0.25, -1.5]
    assert scored(np.array([0.5, 1.0], dtype=np.float32))[:, 0].tolist() == [0.5, 1.0]
    for bad, shown in ((float("-inf"), "-inf"), (np.float64("inf"), "np.float64(inf)"), (10 ** 400, "1000"),
                       ("1", "'1'"), (np.array([1.0]), "array([1.])"), (1 + 2j, "(1+2j)")):
        with pytest.raises(RewardError, match=re.escape(f"reward function f returned {shown}") + ".* for completion 1 "
                                              "at step 3: rewards must be finite real numbers"):
            scored([0.0, bad])


def test_numpy_rewards_pass_the_start_up_check(questions):
    from conftest import make_cfg
    from llmtrain import data
    from llmtrain.models.build import byte_tokenizer
    from llmtrain.rollout import build_rewards

    cfg = make_cfg(_grpo_overrides(questions, "reward.functions=[tests.grpo_fixtures:numpy_values]"))
    splits = data.load_splits(cfg.data, byte_tokenizer(), 0, prompt_budget=64 - 8)
    [f] = build_rewards(cfg, [splits.train[0], splits.train[1]])
    assert f.name == "numpy_values"


def test_gsm8k_answers_without_a_number_are_refused_naming_the_column(tmp_path):
    """Answers with no number score every completion None: the run would train nothing. Refused at
    start-up naming data.columns.answer; a few answers without one are fine (None for those)."""
    import json

    from conftest import make_cfg
    from llmtrain.common.errors import ConfigError
    from llmtrain.rollout import build_rewards
    from llmtrain.trainer import train

    run_dir = tmp_path / "run"
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i}?", "solution": "see the book"}) + "\n"
                            for i in range(6)))
    cfg = make_cfg(_grpo_overrides(path, "reward.functions=[gsm8k]", "data.columns.answer=solution",
                                   f"run_dir={run_dir}"))
    with pytest.raises(ConfigError, match=re.escape("reward.functions[0]=gsm8k: no answer of the first 5 records, read "
                                                    "from data.columns.answer=solution, holds a number (e.g. 'see the "
                                                    "book')") + ".*GSM8K's '#### 42'"):
        train(cfg)
    assert not run_dir.exists()
    samples = [{"prompt": "q", "prompt_ids": [1], "record": i, "answer": a} for i, a in enumerate(["none", "none"])]
    build_rewards(cfg, samples, answers=["none", "none", "#### 3"])  # one with a number: that one scores
    with pytest.raises(ConfigError, match="no answer of the first 2 records, read from data.columns.answer=solution"):
        build_rewards(cfg, samples)


@pytest.mark.parametrize("environment,message", [
    ("sandbox", "rollout.environment='sandbox' is neither a built-in environment (calculator) nor module:Class"),
    ("tests.grpo_fixtures:odd_tokens", "is not a subclass of llmtrain.rollout.environments.Environment"),
    ("no_such_module:Env", "rollout.environment='no_such_module:Env' cannot be imported"),
])
def test_a_bad_environment_fails_before_anything_is_written(questions, tmp_path, environment, message):
    from conftest import make_cfg
    from llmtrain.common.errors import ConfigError
    from llmtrain.trainer import train

    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=re.escape(message)):
        train(make_cfg(_grpo_overrides(questions, f"rollout.environment={environment}", f"run_dir={run_dir}")))
    assert not run_dir.exists()


def test_a_prompt_too_long_names_the_record_and_the_fixes(questions, tmp_path):
    from conftest import make_cfg
    from llmtrain import data
    from llmtrain.common.errors import DataError
    from llmtrain.models.build import byte_tokenizer
    from llmtrain.trainer import train

    run_dir = tmp_path / "run"
    with pytest.raises(DataError, match=r"q.jsonl line 1: the prompt has 12 tokens, over the 8 that data.seq_len=16"):
        train(make_cfg(_grpo_overrides(questions, "data.seq_len=16", f"run_dir={run_dir}")))
    assert not run_dir.exists()
    dropping = make_cfg(_grpo_overrides(questions, "data.seq_len=21", "data.truncation=drop", f"run_dir={run_dir}"))
    splits = data.load_splits(dropping.data, byte_tokenizer(), 0, prompt_budget=21 - 8)
    assert "12 records -> 10 prompts (dropped 2 too long)" in data.describe(splits)  # the two of 14 tokens
    assert len(train(dropping)["losses"]) == 2


def test_empty_prompts_and_too_few_records_are_refused_naming_them(tmp_path):
    import json

    from conftest import make_cfg
    from llmtrain.common.errors import DataError
    from llmtrain.trainer import train

    run_dir = tmp_path / "run"
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in ["What?", "", "Why?"]))
    with pytest.raises(DataError, match=r"q.jsonl line 2: the prompt \('question'\) is empty"):
        train(make_cfg(_grpo_overrides(path, f"run_dir={run_dir}")))
    path.write_text(json.dumps({"question": "What?", "answer": "#### 1"}) + "\n")
    with pytest.raises(DataError, match="1 record\\(s\\); online RL needs at least 2 prompts"):
        train(make_cfg(_grpo_overrides(path, f"run_dir={run_dir}")))
    assert not run_dir.exists()


def test_a_builtin_reward_without_its_column_and_a_module_that_fails_to_load_are_refused(tmp_path, monkeypatch):
    """gsm8k on records without an 'answer' column would score nothing (every advantage 0) for the
    whole run; a reward module with a syntax error names its file and line. Nothing is written."""
    import json

    from conftest import make_cfg
    from llmtrain.common.errors import ConfigError
    from llmtrain.trainer import train

    run_dir = tmp_path / "run"
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i}?", "solution": f"#### {i}"}) + "\n" for i in range(6)))
    with pytest.raises(ConfigError, match=r"reward.functions\[0\]=gsm8k reads each record's 'answer' column, which "
                                          r"the records of data.path do not have \(theirs: solution besides the prompt\); map the column "
                                          r"holding them with data.columns.answer=YOUR_COLUMN"):
        train(make_cfg(_grpo_overrides(path, "reward.functions=[gsm8k]", f"run_dir={run_dir}")))
    (tmp_path / "broken_rewards.py").write_text("def f(completions, **_)\n    return [0.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"reward.functions\[0\]='broken_rewards:f': importing broken_rewards failed "
                                          r"with SyntaxError \(.*broken_rewards.py:1\)"):
        train(make_cfg(_grpo_overrides(path, "reward.functions=[broken_rewards:f]", f"run_dir={run_dir}")))
    assert not run_dir.exists()


def test_a_misspelt_reward_name_gets_the_closest_one():
    from llmtrain.common.errors import ConfigError
    from llmtrain.rollout import rewards

    with pytest.raises(ConfigError, match=re.escape("reward.functions[1]='gsm8kk': did you mean gsm8k? it is neither a "
                                                    "built-in (answer, format, gsm8k, length, model) nor module:function")):
        rewards.build(["format", "gsm8kk"], [], 8)
    with pytest.raises(ConfigError, match=re.escape("(module 'tests.grpo_fixtures' has no 'odd_token'); did you mean "
                                                    "odd_tokens? give importable.module:function")):
        rewards.build(["tests.grpo_fixtures:odd_token"], [], 8)


def test_the_gsm8k_reward_reads_an_answer_column_mapped_by_data_columns_answer(tmp_path):
    """The reference answers in a column named otherwise (``solution``) reach the gsm8k reward as
    ``answer`` through ``data.columns.answer``, as the prompt's through ``data.columns.prompt``."""
    import json

    from conftest import make_cfg
    from llmtrain import data
    from llmtrain.common.errors import DataError
    from llmtrain.models.build import byte_tokenizer
    from llmtrain.rollout import build_rewards

    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i}?", "solution": f"so #### {i}"}) + "\n"
                            for i in range(6)))
    cfg = make_cfg(_grpo_overrides(path, "reward.functions=[gsm8k]", "data.columns.answer=solution"))
    splits = data.load_splits(cfg.data, byte_tokenizer(), 0, prompt_budget=64 - 8)
    samples = [splits.train[i] for i in range(len(splits.train))]
    assert all(s["answer"] == f"so #### {s['prompt'].split()[-1][:-1]}" for s in samples)
    assert "solution" not in samples[0]
    [gsm8k] = build_rewards(cfg, samples[:2])
    assert gsm8k.fn(completions=["#### 1", "#### 7"], answer=["so #### 1", "so #### 2"]) == [1.0, 0.0]
    missing = make_cfg(_grpo_overrides(path, "reward.functions=[gsm8k]", "data.columns.answer=solutoin"))
    with pytest.raises(DataError, match=r"data.columns.answer=solutoin names the column 'solutoin', which is missing "
                                        r"\(did you mean 'solution'\?\)"):
        data.load_splits(missing.data, byte_tokenizer(), 0, prompt_budget=64 - 8)


def test_unscorable_completions_get_no_advantage_and_one_warning(questions, tmp_path, caplog):
    """A completion every function returned None for: NaN reward (left out of train/reward, as
    TRL 1.16), advantage 0, and one warning a run (TRL warns every step)."""
    import json
    import logging

    from conftest import make_cfg, read_metrics
    from llmtrain.trainer import train

    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="llmtrain"):
        train(make_cfg(_grpo_overrides(questions, "reward.functions=[tests.grpo_fixtures:scores_nothing]",
                                       f"run_dir={run_dir}")))
    warned = [r for r in caplog.records if "every reward function returned None" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    rows = [r for r in read_metrics(run_dir) if "train/reward" in r]
    assert len(rows) == 2 and all(r["train/reward"] != r["train/reward"] for r in rows)  # NaN
    assert all(r["train/loss"] == 0.0 for r in rows)  # every advantage 0
    lines = [json.loads(line) for line in (run_dir / "completions" / "step_1.jsonl").read_text().splitlines()]
    assert all(line["advantage"] == 0.0 and line["reward"] is None for line in lines)


def test_a_reward_function_that_raises_mid_run_stops_after_the_last_checkpoint(questions, tmp_path):
    from conftest import make_cfg
    from llmtrain.checkpoint.protocol import verify
    from llmtrain.rollout import RewardError
    from llmtrain.trainer import train

    run_dir = tmp_path / "run"
    with pytest.raises(RewardError, match="raises_at_step_two raised ValueError at step 2: checker crashed") as caught:
        train(make_cfg(_grpo_overrides(questions, "reward.functions=[tests.grpo_fixtures:raises_at_step_two]",
                                       "trainer.save_every=1", f"run_dir={run_dir}")))
    assert isinstance(caught.value.__cause__, ValueError)  # the function's own traceback
    assert verify(run_dir / "checkpoints" / "step_1") is None
    assert not (run_dir / "checkpoints" / "step_2").exists()


def test_completions_reach_wandb_as_a_table_equal_to_their_file(questions, tmp_path):
    """rollout.log_completions rows of each generation step: run_dir/completions/step_N.jsonl and a
    wandb table at step N holding the same rows (read back from the offline run's files)."""
    import json

    from conftest import make_cfg
    from llmtrain.monitoring.tracking.wandb_backend import offline_history
    from llmtrain.trainer import train

    run = tmp_path / "run"
    overrides = [o for o in _grpo_overrides(questions, f"run_dir={run}") if o != "tracker=none"]
    train(make_cfg(overrides + ["tracker.wandb_mode=offline", "rollout.log_completions=3"]))
    import wandb

    wandb.teardown()  # the service this process started: later tests' runs get their own
    (folder,) = list((run / "wandb").glob("offline-run-*"))
    history = offline_history(folder)
    for step in (1, 2):
        rows = [json.loads(line) for line in (run / "completions" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 3
        row = history[step]  # wandb flattens the table's reference into completions/<field>
        assert row["completions/_type"] == "table-file" and row["completions/nrows"] == 3
        table = json.loads((folder / "files" / row["completions/path"]).read_text())
        assert table["columns"] == list(rows[0])
        assert [r[table["columns"].index("completion")] for r in table["data"]] == [r["completion"] for r in rows]
        assert [json.loads(r[table["columns"].index("rewards")]) for r in table["data"]] == [r["rewards"] for r in rows]


# ---- built-in rewards -----------------------------------------------------------------------------
def test_gsm8k_reward_checks_the_final_number_as_lm_eval_extracts_it():
    """The number after the completion's own "####" (lm-eval gsm8k's strict-match), else its
    last number (flexible-extract), against the number after the reference's "####"; commas and
    dollar signs dropped; None where the record has no answer or the reference no number."""
    from llmtrain.rollout.rewards import gsm8k_reward

    reference = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,072"
    completions = ["So she sold 1072 clips.", "#### $1,072\nThen 5 more", "#### 1072.0", "1072 clips, or 1073",
                   "no number", [{"role": "assistant", "content": "#### 1072"}]]
    assert gsm8k_reward(completions, answer=[reference] * len(completions)) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert gsm8k_reward(["#### 3"], answer=["no final number"]) == [None]
    assert gsm8k_reward(["#### 3"]) == [None]
    assert gsm8k_reward(["#### -3"], answer=["#### -3"]) == [1.0]


def test_format_and_length_rewards():
    """format: GSM8K's final "#### N" line by default, or any regular expression; length: DAPO's
    soft overlong penalty (Yu et al. 2025, eq. 13): 0 up to L_max - L_cache tokens, then linearly
    down to -1 at L_max, and -1 beyond."""
    from llmtrain.rollout.rewards import format_reward, length_penalty

    assert format_reward(["so #### 12", "#### 12\nmore", "12"]) == [1.0, 0.0, 0.0]
    assert format_reward(["<answer>7</answer>", "7"], pattern=r"<answer>\d+</answer>") == [1.0, 0.0]
    ids = [[0] * n for n in (0, 12, 13, 14, 16, 20)]
    assert length_penalty(ids, max_completion_length=16, cache=4) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert length_penalty([[0] * 14], max_completion_length=16) == [-0.5]  # default cache: a quarter of L_max


def test_reward_model_scores_prompt_and_completion_with_its_own_tokenizer(tmp_path):
    """model:FOLDER: the classification head's first logit on prompt + completion + EOS (what
    objective=reward trains on), as transformers alone computes it for each text: batching and
    padding change no score; a message-list prompt is rendered through the reward model's chat
    template with the completion as the assistant's turn."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    from llmtrain.models.build import byte_tokenizer
    from llmtrain.rollout.rewards import RewardModel

    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    config = LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)  # as llmtrain's reward export sets it
    model = AutoModelForSequenceClassification.from_config(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    def alone(text: str) -> float:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            return float(model(input_ids=torch.tensor([ids])).logits[0, 0])

    scorer = RewardModel(str(tmp_path))
    prompts, completions = ["What is 2+2?", "Name a colour."], [" 4", " A rather long answer: blue."]
    got = scorer(prompts=prompts, completions=completions)
    assert got == pytest.approx([alone(p + c) for p, c in zip(prompts, completions)], abs=1e-5)
    assert got[0] != pytest.approx(got[1], abs=1e-4)
    chat = [[{"role": "user", "content": "Hi"}]]  # byte_tokenizer has no chat template: contents joined
    assert scorer(prompts=chat, completions=[[{"role": "assistant", "content": " there"}]]) == pytest.approx(
        [alone("Hi there")], abs=1e-5)


def test_reasoning_gym_prompts_carry_answers_the_gsm8k_reward_checks(tmp_path):
    """scripts/tools/reasoning_gym_prompts.py: seeded problems (the same seed, the same file) whose
    '#### N' answers the gsm8k reward accepts for the right number only."""
    pytest.importorskip("reasoning_gym")
    import json
    import sys

    from conftest import REPO
    from llmtrain.rollout.rewards import gsm8k_reward

    sys.path.insert(0, str(REPO / "scripts" / "tools"))
    from reasoning_gym_prompts import main

    args = ["basic_arithmetic", "--size", "20", "--seed", "3", "--config", "min_terms=2", "max_terms=2"]
    assert main([args[0], str(tmp_path / "a.jsonl"), *args[1:]]) == 0
    assert main([args[0], str(tmp_path / "b.jsonl"), *args[1:]]) == 0
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    records = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(records) == 20 and all(r["answer"].startswith("#### ") for r in records)
    right = [f"The answer is {r['answer'][5:]}." for r in records]
    wrong = [f"The answer is {float(r['answer'][5:]) + 1}." for r in records]
    answers = [r["answer"] for r in records]
    assert gsm8k_reward(right, answer=answers) == [1.0] * 20 and gsm8k_reward(wrong, answer=answers) == [0.0] * 20
    assert main(["no_such_task", str(tmp_path / "c.jsonl")]) == 2


def test_bf16_runs_sample_from_bf16_weights_and_get_their_fp32_weights_back():
    """``bf16_weights`` (the sampling loop of tensor parallel without FSDP under ``precision=bf16``): inside,
    the model computes as a bf16 copy of itself does (an independent ``.to(bfloat16)``); after, every
    parameter is the same fp32 tensor with the same values (the optimizer's master weights)."""
    import copy

    from llmtrain.engine.native import bf16_weights
    from llmtrain.rollout.generate import Sampling, sample_group

    model = _tiny_model().eval()
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    reference = copy.deepcopy(model).to(torch.bfloat16)
    for buffer, ref_buffer in zip(model.buffers(), reference.buffers()):
        ref_buffer.data = buffer.data.clone()  # buffers (RoPE) stay fp32 in bf16_weights
    ids = torch.tensor([[5, 9, 3, 7]])
    sampling = Sampling(temperature=1.0, max_new=6)
    with bf16_weights(model, True):
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert torch.equal(model(ids).logits, reference(ids).logits)
        ours = sample_group(model, [5, 9, 3, 7], [11, 12, None], sampling, torch.device("cpu"))
    theirs = sample_group(reference, [5, 9, 3, 7], [11, 12, None], sampling, torch.device("cpu"))
    assert [c.ids for c in ours] == [c.ids for c in theirs]
    for name, p in model.named_parameters():
        assert p is before[name][0] and p.dtype == torch.float32 and torch.equal(p, before[name][1]), name
    with bf16_weights(model, False):
        assert {p.dtype for p in model.parameters()} == {torch.float32}


# ---- what a run says ----------------------------------------------------------------------------
def _logged(caplog, overrides: list[str]) -> list[str]:
    import logging

    from conftest import make_cfg
    from llmtrain.trainer import train

    with caplog.at_level(logging.INFO, logger="llmtrain"):
        train(make_cfg(overrides))
    return [r.getMessage() for r in caplog.records]


def test_step_lines_show_rewards_and_a_flat_reward_is_warned_of_once(questions, tmp_path, caplog):
    """Step lines carry the mean reward, its spread and the share of groups without spread; a
    constant reward (no advantage, no gradient) is warned of after 3 steps, and again only when
    the streak doubles."""
    overrides = [o for o in _grpo_overrides(questions, "reward.functions=[tests.grpo_fixtures:constant]",
                                            f"run_dir={tmp_path / 'run'}")
                 if not o.startswith(("trainer.max_steps", "trainer.progress_bar"))]
    lines = _logged(caplog, overrides + ["trainer.max_steps=7", "trainer.progress_bar=true"])
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 7 and all(", reward 0.500 (std 0.000, zero-spread groups 1.00), " in s for s in steps), steps
    warned = [line for line in lines if "got the same reward" in line]
    assert [w.split(":")[0] for w in warned] == ["steps 1-3", "steps 1-6"], warned
    assert "objective.num_generations" in warned[0] and "rollout.temperature" in warned[0]
    caplog.clear()
    varied = [o for o in _grpo_overrides(questions, f"run_dir={tmp_path / 'varied'}")  # odd_tokens: groups differ
              if not o.startswith(("trainer.max_steps", "trainer.progress_bar"))]
    lines = _logged(caplog, varied + ["trainer.max_steps=3", "trainer.progress_bar=true"])
    assert not [line for line in lines if "got the same reward" in line]


def test_a_slow_steps_sampling_says_how_far_it_is(questions, tmp_path, caplog, monkeypatch):
    """A GRPO step on a CPU samples for minutes; past ``SAMPLING_QUIET_S`` (0 here) it logs its
    prompts done between step lines, as the held-out evaluation does (before: nothing); a prompt
    is done with the generation batch that ends its group (2 rows a batch here: one prompt's)."""
    import llmtrain.rollout.progress as progress

    monkeypatch.setattr(progress, "SAMPLING_QUIET_S", 0.0)
    lines = _logged(caplog, _grpo_overrides(questions, f"run_dir={tmp_path / 'run'}", "rollout.generation_batch=2"))
    sampling = [line for line in lines if ", sampling: " in line]
    for step in (1, 2):
        said = [line.split(", ")[1] for line in sampling if line.startswith(f"step {step}, ")]
        # The first prompt done (or, on a loaded machine, the timer's line before it), then the last.
        assert said[0] in ("sampling: 0/2 prompts", "sampling: 1/2 prompts") and said[-1] == "sampling: 2/2 prompts"
    assert len(sampling) <= 4 and all(" prompts/s, eta " in line or " s so far" in line for line in sampling), lines
    assert sampling[-1].startswith("step 2, sampling: 2/2 prompts, ")


def test_held_out_evaluation_shows_progress_and_eval_every_0_skips_step_0(questions, tmp_path, caplog):
    """The held-out generation logs its progress (prompts done of all, rate); its default size is
    twice a step's prompts; trainer.eval_every=0 means no step-0 evaluation (the last step's stays)."""
    from conftest import read_metrics

    overrides = [o for o in _grpo_overrides(questions) if not o.startswith(("trainer.eval_every", "trainer.eval_samples",
                                                                           "trainer.progress_bar"))]
    # One greedy row a generation batch: a prompt at a time, so the progress has steps to show.
    overrides += ["data.val_fraction=0.5", "trainer.progress_bar=false", "rollout.generation_batch=1"]
    lines = _logged(caplog, overrides + ["trainer.eval_every=2", f"run_dir={tmp_path / 'every'}"])
    assert any(line.startswith("start-up: first evaluation (a greedy completion of each of up to 4 held-out prompts")
               for line in lines), lines
    progress = [line.split(",")[0] for line in lines if line.startswith("held-out evaluation: ")]
    # Step 0 and step 2: after the first prompt, then at the last (every 10 s between).
    assert progress == ["held-out evaluation: 1/4 prompts", "held-out evaluation: 4/4 prompts"] * 2, lines
    assert [r["step"] for r in read_metrics(tmp_path / "every") if "val/reward" in r] == [0, 2]
    assert all(r["val/prompts"] == 4 for r in read_metrics(tmp_path / "every") if "val/reward" in r)
    caplog.clear()
    lines = _logged(caplog, overrides + ["trainer.eval_every=0", f"run_dir={tmp_path / 'never'}"])
    assert not any("first evaluation" in line or "eval at step 0" in line for line in lines), lines
    assert [r["step"] for r in read_metrics(tmp_path / "never") if "val/reward" in r] == [2]  # the last step's
