"""Preference objectives end to end against TRL's own trainers (pip ``trl``, a test dependency):
tiny Llama, fp32, one process, 32 Anthropic HH pairs (implicit-prompt layout), 5 steps with the
same batches, AdamW, constant learning rate and clipping. Per step, llmtrain's loss and TRL's
``rewards/chosen``, ``rewards/rejected`` and ``rewards/accuracies`` equal TRL's within 1e-5 at step
1 and within 1e-5 or 1e-4 relative after (see ``_assert_steps``):
DPO (sigmoid, IPO, hinge, robust), SimPO (TRL's CPO with ``loss_type=simpo``), ORPO and the
reward model (``RewardTrainer``). The token ids TRL builds from the same records are checked
equal to llmtrain's first, so the data layout is checked against TRL's too."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest
import torch

from conftest import make_cfg

trl = pytest.importorskip("trl")

STEPS, BATCH, SEQ = 5, 4, 256
REWARD_SEQ = 1024  # TRL's RewardTrainer drops pairs over max_length where llmtrain truncates: none are
TOL = 1e-5


@pytest.fixture(scope="module")
def hh_pairs(shared_data, tmp_path_factory) -> Path:
    """34 HH records whose extracted prompt fits well inside SEQ bytes (so neither side drops a
    record), as a JSONL file; 2 are held out by the validation split."""
    from llmtrain.data.preference import extract_prompt

    records = []
    with gzip.open(shared_data / "hh_rlhf_harmless_test.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            prompt, chosen, rejected = extract_prompt(rec["chosen"], rec["rejected"])
            whole = max(len(rec["chosen"].encode()), len(rec["rejected"].encode()))
            if len(prompt.encode()) < 200 and whole < REWARD_SEQ - 8 and chosen.strip() != rejected.strip():
                records.append(rec)
            if len(records) == 34:
                break
    path = tmp_path_factory.mktemp("hh") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# What TRL's trainers are given in these comparisons (AdamW at a constant 1e-3, no decay, clipping
# at 1), with every step logged and nothing else running: llmtrain's side of the same settings.
TRL_MATCHED = ["trainer.lr=1e-3", "trainer.warmup_steps=0", "trainer.min_lr_ratio=1.0", "trainer.weight_decay=0.0",
               "trainer.grad_clip=1.0", "tracker=none", "trainer.log_every=1", "trainer.eval_every=0",
               "trainer.progress_bar=false", "trainer.save_every_minutes=0"]


def train_rows(overrides: list[str], run_dir: Path) -> tuple[list[dict], object]:
    """llmtrain trained in-process with ``overrides`` + :data:`TRL_MATCHED`: its per-step training
    records and its config."""
    from llmtrain.trainer import train

    cfg = make_cfg([*overrides, *TRL_MATCHED, f"run_dir={run_dir}"])
    train(cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "train/loss" in r], cfg


def _ours(path: Path, run_dir: Path, objective: list[str], micro: int, seq: int = SEQ) -> tuple[list[dict], object]:
    return train_rows(["data=preference", f"data.path={path}", f"data.seq_len={seq}", "data.max_prompt_tokens=null",
                       "data.shuffle=false", "data.val_fraction=0.05", *objective, f"trainer.max_steps={STEPS}",
                       f"trainer.global_batch_size={BATCH}", f"trainer.micro_batch_size={micro}"], run_dir)


def _training_records(path: Path, cfg) -> list[dict]:
    """The records of llmtrain's training split, in its (unshuffled) order."""
    from llmtrain.data import _split

    records = [json.loads(line) for line in path.read_text().splitlines()]
    train_idx, _ = _split(len(records), cfg.data.val_fraction, cfg.trainer.seed)
    return [records[train_idx[k]] for k in range(len(train_idx))]


def _trl(trainer_cls, args, model, records: list[dict], tokenizer) -> tuple[list[dict], object]:
    import datasets

    logged: list[dict] = []

    class Recording(trainer_cls):
        def log(self, logs, start_time=None):
            # The averaged metrics as TRL's own log() adds them, before it clears them.
            mode = "train" if self.model.training else "eval"
            metrics = {k: float(sum(v) / len(v)) for k, v in self._metrics[mode].items() if v} if hasattr(
                self, "_metrics") else {}
            logged.append({**logs, **metrics})
            super().log(logs, start_time)

        def store_metrics(self, metrics, train_eval="train"):  # CPO/ORPO keep theirs here
            logged.append({"stored": True, **{k: float(v) for k, v in metrics.items()}})
            super().store_metrics(metrics, train_eval)

    trainer = Recording(model=model, args=args, train_dataset=datasets.Dataset.from_list(records),
                        processing_class=tokenizer)
    trainer.train()
    return logged, trainer


def _common_args(tmp_path: Path, micro: int, cfg) -> dict:
    t = cfg.trainer
    return dict(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=micro,
                gradient_accumulation_steps=BATCH // micro, max_steps=STEPS, learning_rate=1e-3,
                lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                report_to=[], train_sampling_strategy="sequential", use_cpu=True, adam_beta1=t.beta1, adam_beta2=t.beta2,
                adam_epsilon=t.eps, seed=0, disable_tqdm=True, gradient_checkpointing=False, bf16=False)


def _initial_model(cfg, tmp_path: Path, head: str = "logits") -> Path:
    from llmtrain.data import pad_id_of
    from llmtrain.models.build import build_model, build_tokenizer

    tok = build_tokenizer(cfg.model)
    folder = tmp_path / f"init-{head}"
    build_model(cfg.model, cfg.trainer.seed, head=head, pad_token_id=pad_id_of(tok)).save_pretrained(folder)
    return folder


def _assert_steps(ours: list[dict], theirs: list[dict], keys: tuple[str, ...] = (
        "rewards/chosen", "rewards/rejected", "rewards/accuracies")) -> None:
    """Step 1 (the same weights on both sides) within :data:`TOL`; later steps also within 1e-4
    relative: llmtrain's output layer runs on the labelled rows only (``trainer.logits_at_labels_only``),
    TRL's on every row, so the matmuls round differently and lr 1e-3 carries it into the weights
    (IPO's rewards drift by 1.3e-5 of 0.35 by step 4)."""
    assert len(ours) == len(theirs) == STEPS
    for step, (o, t) in enumerate(zip(ours, theirs), start=1):
        rel = 1e-6 if step == 1 else 1e-4
        assert o["train/loss"] == pytest.approx(t["loss"], abs=TOL, rel=rel), f"step {step} loss"
        for key in keys:
            assert o[f"train/{key}"] == pytest.approx(t[key], abs=TOL, rel=0 if step == 1 else rel), f"step {step} {key}"


# The sigmoid loss stays in the fast tier: one preference run against TRL in the inner loop.
@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), *(pytest.param(*case, marks=pytest.mark.slow) for case in
                                                                (("ipo", 0.0), ("hinge", 0.0), ("robust", 0.1)))])
def test_dpo_equals_trl_dpo_trainer(hh_pairs, tmp_path, loss_type, eps):
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from llmtrain import data
    from llmtrain.models.build import build_tokenizer

    ours, cfg = _ours(hh_pairs, tmp_path / "ours", ["objective=dpo", f"objective.loss_type={loss_type}",
                                                    f"objective.label_smoothing={eps}"], micro=BATCH)
    tok = build_tokenizer(cfg.model)
    records = _training_records(hh_pairs, cfg)
    model = AutoModelForCausalLM.from_pretrained(_initial_model(cfg, tmp_path), dtype=torch.float32)
    args = DPOConfig(**_common_args(tmp_path, BATCH, cfg), beta=0.1, loss_type=[loss_type], label_smoothing=eps,
                     max_length=SEQ)
    logged, trainer = _trl(DPOTrainer, args, model, records, tok)
    splits = data.load_splits(cfg.data, tok, cfg.trainer.seed)
    for k in range(len(trainer.train_dataset)):  # TRL's tokens = llmtrain's, record by record
        ex, pair = trainer.train_dataset[k], splits.train[k]
        assert (ex["prompt_ids"] + ex["chosen_ids"])[:SEQ] == pair["chosen_ids"]
        assert (ex["prompt_ids"] + ex["rejected_ids"])[:SEQ] == pair["rejected_ids"]
    _assert_steps(ours, [r for r in logged if "loss" in r and "rewards/chosen" in r])


def _paired_logs(logged: list[dict], accumulation: int) -> list[dict]:
    """CPO/ORPO store each micro-batch's metrics; a step's record is their mean, with the loss."""
    stored = [r for r in logged if r.get("stored")]
    losses = [r for r in logged if "loss" in r and not r.get("stored")]
    steps = []
    for step, loss in enumerate(losses[:STEPS]):
        chunk = stored[step * accumulation:(step + 1) * accumulation]
        steps.append({"loss": loss["loss"], **{k: sum(c[k] for c in chunk) / len(chunk) for k in chunk[0]
                                                if k != "stored"}})
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["simpo", "orpo"])
def test_simpo_and_orpo_equal_trl_cpo_and_orpo_trainers(hh_pairs, tmp_path, objective):
    """ORPO's NLL term is a token mean over TRL's whole micro-batch, the paper's (eq. 6) is per
    pair: with one pair per micro-batch (accumulated to the same global batch) they coincide."""
    from transformers import AutoModelForCausalLM
    from trl.data_utils import extract_prompt
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from llmtrain.models.build import build_tokenizer

    micro = 1 if objective == "orpo" else BATCH
    ours, cfg = _ours(hh_pairs, tmp_path / "ours", [f"objective={objective}"], micro=micro)
    tok = copy.deepcopy(build_tokenizer(cfg.model))
    tok.bos_token = None  # TRL's CPO/ORPO would prepend a BOS, which llmtrain's pairs do not have
    records = [extract_prompt(r) for r in _training_records(hh_pairs, cfg)]
    model = AutoModelForCausalLM.from_pretrained(_initial_model(cfg, tmp_path), dtype=torch.float32)
    if objective == "simpo":
        args = CPOConfig(**_common_args(tmp_path, micro, cfg), loss_type="simpo", cpo_alpha=0.0, beta=2.0,
                         simpo_gamma=1.0, max_length=SEQ, max_completion_length=SEQ)
        logged, _ = _trl(CPOTrainer, args, model, records, tok)
    else:
        args = ORPOConfig(**_common_args(tmp_path, micro, cfg), beta=0.1, max_length=SEQ, max_completion_length=SEQ)
        logged, _ = _trl(ORPOTrainer, args, model, records, tok)
    theirs = _paired_logs(logged, BATCH // micro)
    _assert_steps(ours, theirs)
    if objective == "orpo":
        for o, t in zip(ours, theirs):
            assert o["train/nll_loss"] == pytest.approx(t["nll_loss"], abs=TOL)
            assert o["train/log_odds_ratio"] == pytest.approx(t["log_odds_ratio"], abs=TOL)
            assert o["train/log_odds_chosen"] == pytest.approx(t["log_odds_chosen"], abs=TOL)


@pytest.mark.slow
def test_reward_model_equals_trl_reward_trainer(hh_pairs, tmp_path):
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from llmtrain import data
    from llmtrain.models.build import build_tokenizer

    ours, cfg = _ours(hh_pairs, tmp_path / "ours", ["objective=reward"], micro=BATCH, seq=REWARD_SEQ)
    tok = build_tokenizer(cfg.model)
    records = _training_records(hh_pairs, cfg)
    model = AutoModelForSequenceClassification.from_pretrained(_initial_model(cfg, tmp_path, "scores"),
                                                               dtype=torch.float32)
    args = RewardConfig(**_common_args(tmp_path, BATCH, cfg), max_length=REWARD_SEQ, center_rewards_coefficient=None)
    logged, trainer = _trl(RewardTrainer, args, model, records, tok)
    splits = data.load_splits(cfg.data, tok, cfg.trainer.seed)
    for k in range(len(trainer.train_dataset)):
        ex, pair = trainer.train_dataset[k], splits.train[k]
        assert (ex["chosen_ids"], ex["rejected_ids"]) == (pair["chosen_ids"], pair["rejected_ids"])
    theirs = [r for r in logged if "loss" in r and "accuracy" in r]
    assert len(ours) == len(theirs) == STEPS
    for step, (o, t) in enumerate(zip(ours, theirs), start=1):
        assert o["train/loss"] == pytest.approx(t["loss"], abs=TOL), f"step {step}"
        assert o["train/rewards/accuracies"] == pytest.approx(t["accuracy"], abs=TOL), f"step {step}"
        assert o["train/rewards/margins"] == pytest.approx(t["margin"], abs=TOL), f"step {step}"


@pytest.mark.slow
def test_kto_equals_trl_kto_trainer(hh_pairs, tmp_path):
    """Unpaired HH examples (each pair's chosen as desirable, rejected as undesirable): TRL builds
    its KL examples by rotating completions within each per-device batch, llmtrain within each
    micro-batch; with one micro-batch a step they are the same examples."""
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig, KTOTrainer
    from trl.data_utils import extract_prompt

    from llmtrain.models.build import build_tokenizer

    examples = []
    for line in hh_pairs.read_text().splitlines():
        rec = extract_prompt(json.loads(line))
        examples += [{"prompt": rec["prompt"], "completion": rec["chosen"], "label": True},
                     {"prompt": rec["prompt"], "completion": rec["rejected"], "label": False}]
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in examples), encoding="utf-8")
    ours, cfg = _ours(path, tmp_path / "ours", ["data.format=kto", "objective=kto"], micro=BATCH)
    tok = build_tokenizer(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(_initial_model(cfg, tmp_path), dtype=torch.float32)
    args = KTOConfig(**_common_args(tmp_path, BATCH, cfg), beta=0.1, max_length=SEQ)
    logged, _ = _trl(KTOTrainer, args, model, _training_records(path, cfg), tok)
    theirs = [r for r in logged if "loss" in r and "kl" in r]
    assert len(ours) == len(theirs) == STEPS
    for step, (o, t) in enumerate(zip(ours, theirs), start=1):
        assert o["train/loss"] == pytest.approx(t["loss"], abs=TOL), f"step {step}"
        # z0 and the rewards are differences of sequence log-probs of ~-500 nats, means over a few
        # examples: fp32 rounding of the two implementations agrees to 1e-5 relative.
        assert o["train/kl"] == pytest.approx(t["kl"], abs=TOL, rel=1e-5), f"step {step}"
        for key in ("rewards/chosen", "rewards/rejected"):
            if key in t:  # TRL logs a side only when the batch has examples of it
                assert o[f"train/{key}"] == pytest.approx(t[key], abs=TOL, rel=1e-5), f"step {step} {key}"
