"""Preference data: TRL's layouts, the truncation policy, packing with log-probs equal to the
unpacked ones, the pair normaliser, and bad input named by file, record and field."""

from __future__ import annotations

import gzip
import re
import json
from pathlib import Path

import pytest
import torch

from conftest import assert_ok, make_cfg, run_cli
from llmtrain import data
from llmtrain.config.validate import validate
from llmtrain.data.preference import PairCollator, extract_prompt, fit_pair
from llmtrain.engine.base import model_inputs
from llmtrain.common.errors import ConfigError, DataError
from llmtrain.common.labels import IGNORE_INDEX
from llmtrain.models.build import build_model, build_tokenizer
from llmtrain.objectives import DPO, ORPO


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _splits(path: Path, *extra: str):
    cfg = make_cfg(["data=preference", f"data.path={path}", "objective=dpo", "data.shuffle=false", *extra])
    validate(cfg, 1)
    tok = build_tokenizer(cfg.model)
    return data.load_splits(cfg.data, tok, cfg.trainer.seed, unpair=cfg.objective.name == "kto"), tok, cfg


PAIRS = [{"prompt": f"Question {i}: what is {i} + {i}?", "chosen": f" It is {2 * i}.", "rejected": f" Maybe {i}."}
         for i in range(12)]


def test_implicit_prompts_are_trls(shared_data):
    from trl.data_utils import extract_prompt as trl_extract

    with gzip.open(shared_data / "hh_rlhf_harmless_test.jsonl.gz", "rt", encoding="utf-8") as f:
        records = [json.loads(line) for _, line in zip(range(200), f)]
    for rec in records:
        theirs = trl_extract(rec)
        assert extract_prompt(rec["chosen"], rec["rejected"]) == (theirs["prompt"], theirs["chosen"], theirs["rejected"])
    messages = {"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
                "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go away."}]}
    theirs = trl_extract(messages)
    assert extract_prompt(messages["chosen"], messages["rejected"]) == (theirs["prompt"], theirs["chosen"],
                                                                         theirs["rejected"])


def test_explicit_string_pairs_train_the_completion_and_eos_only(tmp_path):
    splits, tok, _ = _splits(_write(tmp_path / "p.jsonl", PAIRS), "data.val_fraction=0.1")
    pair = splits.train[0]
    rec = PAIRS[int(next(i for i in range(12) if tok(PAIRS[i]["prompt"], add_special_tokens=False)["input_ids"]
                         == pair["chosen_ids"][:pair["prompt_len"]]))]
    prompt = tok(rec["prompt"], add_special_tokens=False)["input_ids"]
    assert pair["prompt_len"] == len(prompt)
    assert pair["chosen_ids"] == tok(rec["prompt"] + rec["chosen"], add_special_tokens=False)["input_ids"] + [
        tok.eos_token_id]
    assert pair["rejected_ids"][:len(prompt)] == prompt and pair["rejected_ids"][-1] == tok.eos_token_id
    batch = PairCollator(data.pad_id_of(tok))([splits.train[0], splits.train[1]])
    assert batch["input_ids"].shape[0] == 4  # chosen rows, then rejected rows
    row = batch["labels"][0]
    assert (row[:len(prompt)] == IGNORE_INDEX).all() and row[len(prompt)] == pair["chosen_ids"][len(prompt)]
    assert batch["segment"][:, 0].tolist() == [0, 2, 1, 3]
    assert float(DPO().normaliser(batch)) == 2  # pairs, not rows or tokens


def test_message_pairs_render_with_the_chat_template(tmp_path):
    records = [{"prompt": [{"role": "user", "content": f"Say {i}"}],
                "chosen": [{"role": "assistant", "content": f"{i}"}],
                "rejected": [{"role": "assistant", "content": f"not {i}"}]} for i in range(10)]
    splits, tok, _ = _splits(_write(tmp_path / "m.jsonl", records), "data.template=chatml", "data.val_fraction=0.1")
    data.apply_template_setting(make_cfg(["data.template=chatml"]).data, tok)
    pair = splits.train[0]
    rec = next(r for r in records if tok.apply_chat_template(r["prompt"] + r["chosen"], tokenize=True,
                                                             return_dict=True)["input_ids"] == pair["chosen_ids"])
    prompt = tok.apply_chat_template(rec["prompt"], tokenize=True, add_generation_prompt=True,
                                     return_dict=True)["input_ids"]
    assert pair["prompt_len"] == len(prompt) and pair["chosen_ids"][:len(prompt)] == prompt
    completion = tok.decode(pair["chosen_ids"][len(prompt):])
    assert completion.startswith(rec["chosen"][0]["content"]) and "<|im_end|>" in completion


def test_truncation_cuts_prompts_left_and_completions_right_and_counts_drops():
    prompt, chosen, rejected = list(range(10)), [100, 101, 102, 103], [200, 201]
    pair, outcome = fit_pair(prompt, chosen, rejected, seq_len=8, max_prompt_tokens=5, drop_long=False)
    assert outcome == "truncated" and pair["prompt_len"] == 5
    assert pair["chosen_ids"] == [5, 6, 7, 8, 9, 100, 101, 102] and pair["rejected_ids"] == [5, 6, 7, 8, 9, 200, 201]
    assert fit_pair(prompt, chosen, rejected, 8, None, False) == (None, "dropped_truncated_away")  # prompt fills it
    assert fit_pair(prompt, chosen, rejected, 8, 5, True) == (None, "dropped_too_long")
    # Completions that differ only past the cut are no pair any more.
    assert fit_pair([1, 2], [7, 8, 9], [7, 8, 5], 4, None, False) == (None, "dropped_truncated_away")
    assert fit_pair([1, 2], [7], [8], 4, None, False)[1] == "kept"


def test_packed_rows_give_the_unpacked_log_probs(tmp_path):
    splits, tok, cfg = _splits(_write(tmp_path / "p.jsonl", PAIRS), "data.val_fraction=0.1")
    model = build_model(cfg.model, cfg.trainer.seed).eval()
    pairs = [splits.train[k] for k in range(5)]
    collate = PairCollator(data.pad_id_of(tok))
    objective = DPO(cfg.objective)
    unpacked = objective.prepare(collate(pairs))
    packed = objective.prepare(collate([{"pairs": pairs[:3]}, {"pairs": pairs[3:]}]))
    assert packed["input_ids"].shape[0] == 2 and "position_ids" in packed
    with torch.no_grad():  # the engines' model inputs: packed rows attend by document
        la, lb = model(**model_inputs(unpacked)).logits, model(**model_inputs(packed)).logits
        a, b = objective.sequence_logps(la, unpacked), objective.sequence_logps(lb, packed)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
    assert float(objective.normaliser(packed)) == 5
    orpo = ORPO(make_cfg(["objective=orpo"]).objective)
    with torch.no_grad():  # ORPO's NLL over whole sequences must not cross document boundaries either
        torch.testing.assert_close(orpo._chosen_nll(la, unpacked, 10), orpo._chosen_nll(lb, packed, 10), atol=1e-5,
                                   rtol=0)


@pytest.mark.parametrize("records,needle", [
    ([{"prompt": "a", "good": "b", "rejected": "c"}] * 4, "'chosen'"),
    ([{"prompt": "Q", "chosen": " same", "rejected": " same"}] * 4, "line 1: fields 'chosen' and 'rejected' are identical"),
    ([{"chosen": "Hello there", "rejected": "Goodbye"}] * 4, "line 1: fields 'chosen' and 'rejected' share no prefix"),
    ([{"prompt": "Q", "chosen": 3, "rejected": " b"}] * 4, "line 1: field 'chosen' is a int, field 'chosen' a int"),
    ([{"prompt": [{"role": "user", "content": "Q"}], "chosen": [{"role": "robot", "content": "x"}],
       "rejected": [{"role": "assistant", "content": "y"}]}] * 4, "line 1 field 'chosen' turn 0: role='robot' is not a known role"),
    ([{"prompt": "Q", "chosen": None, "rejected": " b"}] * 4, "line 1: field 'chosen' is missing"),
])
def test_bad_pairs_name_the_file_record_and_field(tmp_path, records, needle):
    path = _write(tmp_path / "bad.jsonl", records)
    with pytest.raises(DataError, match=needle) as info:
        _splits(path, "data.template=chatml")
    assert str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("label,needle", [("yes", "field 'label' must be a boolean"), (None, "field 'label' must be a boolean")])
def test_kto_labels_must_be_booleans(tmp_path, label, needle):
    records = [{"prompt": "Q", "completion": " a", "label": True}] * 3 + [{"prompt": "Q", "completion": " b", "label": label}]
    with pytest.raises(DataError, match=f"k.jsonl line 4: {needle}"):
        _splits(_write(tmp_path / "k.jsonl", records), "data.format=kto", "objective=kto")


def test_kto_reads_pairs_as_a_desirable_and_an_undesirable_example(tmp_path):
    splits, tok, cfg = _splits(_write(tmp_path / "p.jsonl", PAIRS), "objective=kto", "data.val_fraction=0.1")
    assert len(splits.train) + len(splits.val) == 2 * len(PAIRS)
    labels = [splits.train[k]["label"] for k in range(len(splits.train))]
    assert 0 < sum(labels) < len(labels)
    batch = data.collator_for(cfg.data, tok)([splits.train[k] for k in range(3)])
    # Example j's KL sequence: its own prompt, the previous example's completion.
    first, prev = splits.train[0], splits.train[2]
    kl = batch["input_ids"][3][batch["attention_mask"][3].bool()].tolist()
    assert kl == first["ids"][:first["prompt_len"]] + prev["completion_ids"]


def test_a_bad_pair_stops_the_cli_before_anything_is_written(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "Q", "chosen": " same", "rejected": " same"}] * 4)
    proc = run_cli(["data=preference", f"data.path={path}", "objective=dpo", f"run_dir={tmp_path / 'run'}",
                    "tracker=none"])
    assert proc.returncode != 0 and "are identical" in proc.stderr + proc.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides,needle", [
    (["objective=dpo"], "objective=dpo trains on preference pairs: data.format=text must be preference"),
    (["data=preference", "data.path=/x"], "data.format=preference holds preference data, which objective=causal_lm"),
    (["data=preference", "data.path=/x", "objective=dpo", "+recipe=pp"], "pipeline stages"),
    (["data=preference", "data.path=/x", "objective=reward", "data.packing=true"], "set data.packing=false"),
    (["data=preference", "data.path=/x", "objective=simpo", "objective.precompute_reference=true"],
     "objective=simpo is reference-free"),
    (["data=preference", "data.path=/x", "objective=dpo", "objective.reference=adapters_disabled"], "needs +peft=lora"),
    (["data=preference", "data.path=/x", "objective=dpo", "objective.loss_type=kto"], "objective.loss_type='kto'"),
    (["data=preference", "data.path=/x", "objective=dpo", "objective.label_smoothing=0.5"], "must be in [0, 0.5)"),
    (["data=preference", "data.path=/x", "objective=orpo", "objective.loss_type=ipo"],
     "objective.loss_type=ipo does not apply to objective=orpo, which reads objective.beta, objective.nll_on_prompt"),
    (["data=preference", "data.path=/x", "objective=dpo", "objective.gamma=3"], "objective.gamma=3.0 does not apply"),
    (["objective.beta=0.5"], "objective.beta=0.5 does not apply to objective=causal_lm"),
    (["data=preference", "data.path=/x", "objective=kto", "trainer.micro_batch_size=1", "trainer.global_batch_size=4"],
     "needs at least 2"),
    (["data=kto", "data.path=/x", "objective=dpo"], "objective=dpo trains on preference pairs"),
])
def test_objective_settings_that_cannot_work_are_refused(overrides, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        validate(make_cfg(overrides), 2)


def test_reward_margin_column_reaches_the_loss(tmp_path):
    from llmtrain.objectives import Reward
    from llmtrain.objectives.preference_losses import reward_losses

    records = [dict(p, margin=0.5 * i) for i, p in enumerate(PAIRS)]
    splits, tok, cfg = _splits(_write(tmp_path / "m.jsonl", records), "objective=reward", "objective.margin_column=true",
                               "data.val_fraction=0.1")
    batch = PairCollator(data.pad_id_of(tok))([splits.train[k] for k in range(3)])
    scores = torch.tensor([[0.3], [1.0], [-0.2], [0.1], [0.4], [0.0]])  # chosen rows, then rejected rows
    got = Reward(cfg.objective).loss_sums(scores, batch).loss
    margins = torch.tensor([splits.train[k]["margin"] for k in range(3)], dtype=torch.float64)
    want = reward_losses(scores[:3, 0].double(), scores[3:, 0].double(), margins).losses.sum()
    assert float(got) == pytest.approx(float(want), rel=1e-12)
    assert margins.tolist() != [0.0, 0.0, 0.0]


def test_reward_export_loads_as_a_classifier_and_scores_as_the_run_evaluated(tmp_path, caplog):
    """The export, read back by transformers alone (scripts/tools/reward_accuracy.py), scores the held-
    out pairs in the order the run's own final evaluation did; a causal LM export is refused."""
    import subprocess
    import sys

    from conftest import REPO, read_metrics, subprocess_env
    from llmtrain.trainer import train

    path = _write(tmp_path / "p.jsonl", PAIRS * 3)
    run = tmp_path / "reward"
    train(make_cfg(["data=preference", f"data.path={path}", "objective=reward", "data.val_fraction=0.25",
                    "trainer.max_steps=3", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
                    "trainer.eval_samples=0", "tracker=none", "trainer.progress_bar=false", f"run_dir={run}"]))
    final = [r for r in read_metrics(run) if "val/rewards/accuracies" in r][-1]
    proc = subprocess.run([sys.executable, "scripts/tools/reward_accuracy.py", str(run)], capture_output=True, text=True,
                          cwd=REPO, env=subprocess_env())
    assert_ok(proc)
    assert f"{final['val/pairs']} held-out pairs" in proc.stdout
    assert f"= {final['val/rewards/accuracies']:.3f} +-" in proc.stdout
    lm = tmp_path / "lm"
    import logging

    caplog.clear()  # the reward run's own step-0 line is not the one under test
    with caplog.at_level(logging.INFO, logger="llmtrain"):
        train(make_cfg(["data=preference", f"data.path={path}", "objective=dpo", "trainer.max_steps=1",
                        "trainer.global_batch_size=2", "trainer.micro_batch_size=2", "tracker=none",
                        "trainer.progress_bar=false", f"run_dir={lm}"]))
    # Step 0: the policy is the reference, every reward 0: the accuracy of 0 is said to be ties.
    step0 = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("eval at step 0"))
    assert "preference accuracy 0.000 (every pair a tie: the policy is still the reference)" in step0, step0
    proc = subprocess.run([sys.executable, "scripts/tools/reward_accuracy.py", str(lm)], capture_output=True, text=True,
                          cwd=REPO, env=subprocess_env())
    assert proc.returncode == 1
    assert "is not a reward model" in proc.stderr and "objective=reward" in proc.stderr


def test_kto_keeps_both_examples_of_a_pair_on_one_side_of_the_split(tmp_path):
    splits, _, _ = _splits(_write(tmp_path / "p.jsonl", PAIRS * 2), "objective=kto", "data.val_fraction=0.25")
    train = {splits.train[k]["group"] for k in range(len(splits.train))}
    val = {splits.val[k]["group"] for k in range(len(splits.val))}
    assert train and val and not train & val


def test_a_resumed_runs_reference_file_must_match_its_data(tmp_path):
    """reference.check_stored, which runs before a resumed run writes anything: a missing file, one
    written for other pairs (same count, other tokens) and one covering fewer held-out pairs than
    evaluation reads are refused; the file written for these pairs passes."""
    from safetensors.torch import save_file

    from llmtrain.common.errors import ResumeError
    from llmtrain.objectives.reference import REFERENCE_FILE, check_stored, data_digest

    splits, _, _ = _splits(_write(tmp_path / "p.jsonl", PAIRS), "data.val_fraction=0.25")
    other, _, _ = _splits(_write(tmp_path / "q.jsonl", [dict(p, rejected=p["rejected"] + "!") for p in PAIRS]),
                          "data.val_fraction=0.25")
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ResumeError, match="is missing"):
        check_stored(run, splits, 0)

    def write(source, val_items: int) -> None:
        n = len(source.train)
        save_file({"train_values": torch.zeros(n, 2, dtype=torch.float64), "train_offsets": torch.arange(n + 1),
                   "val_values": torch.zeros(val_items, 2, dtype=torch.float64), "val_offsets": torch.arange(val_items + 1)},
                  str(run / REFERENCE_FILE), metadata={"train_digest": data_digest(source.train),
                                                       "val_digest": data_digest(source.val, val_items)})
    write(other, len(other.val))
    with pytest.raises(ResumeError, match="other training data"):
        check_stored(run, splits, 0)
    write(splits, 1)
    with pytest.raises(ResumeError, match=r"1 held-out items and evaluation now reads 3: set trainer.eval_samples=1"):
        check_stored(run, splits, 0)
    check_stored(run, splits, 1)
    write(splits, len(splits.val))
    check_stored(run, splits, 0)


@pytest.mark.parametrize("overrides,needle", [
    (["data=preference", "data.path=/x", "objective=dpo", "data.max_prompt_tokens=0"], "must be > 0 and < data.seq_len"),
    (["data=preference", "data.path=/x", "objective=dpo", "data.seq_len=128"], "data.max_prompt_tokens=384 must be"),
    (["data=alpaca", "data.path=/x", "data.max_prompt_tokens=8"], "applies to preference data"),
    (["data=preference", "data.path=/x", "objective=dpo", "objective.beta=inf"], "objective.beta=inf must be a finite"),
])
def test_data_and_objective_numbers_that_cannot_work(overrides, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        validate(make_cfg(overrides), 1)


def test_margin_column_without_a_margin_is_refused_before_writing(tmp_path):
    from llmtrain.trainer import train

    run = tmp_path / "run"
    with pytest.raises(DataError, match="objective.margin_column=true, but data.path=.* has no margin column"):
        train(make_cfg(["data=preference", f"data.path={_write(tmp_path / 'p.jsonl', PAIRS)}", "objective=reward",
                        "objective.margin_column=true", "tracker=none", f"run_dir={run}"]))
    assert not run.exists()
