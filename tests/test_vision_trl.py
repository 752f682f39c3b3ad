"""Image-text training against TRL's own trainers (pip ``trl``, a test dependency), fp32, one
process, the same model weights and records:

- supervised fine-tuning: one step of ``SFTTrainer`` (its vision collator, ``compute_loss``, the
  optimizer step) on the colour squares gives llmtrain's first step's loss and gradient norm
  within 1e-5, on the token ids and labels llmtrain builds;
- GRPO on image prompts: ``GRPOTrainer`` with the same fixed completions
  (:func:`grpo_fixtures.fixed_completion`, its ``rollout_func`` and llmtrain's
  ``rollout.engine``) gives llmtrain's loss and gradient norm at every step.

Which tokens are targets differs by default: TRL's ``SFTTrainer`` trains a ``messages`` record on
every token (prompt, image tokens and template markers included) unless
``assistant_only_loss=True``, and that needs a chat template with ``{% generation %}`` markers,
which llmtrain's ChatML-with-images template has no use for. The comparison gives TRL the same
template with the markers around each assistant turn's content and its ``<|im_end|>`` (what
llmtrain's labels hold), so both compute the loss on the same tokens; the test first shows that
TRL's default targets differ."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo_fixtures import fixed_completion, odd_tokens, short
from test_preference_trl import _common_args, _training_records, train_rows
from test_vision import write_dataset
from test_vision_grpo import write_prompts

trl = pytest.importorskip("trl")

TOL = 1e-5
IMAGE_PART = "{% if part['type'] == 'image' %}{{ '@IMAGE@' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
TURN = ("{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
        + IMAGE_PART + "{% endfor %}{% endif %}{{ '<|im_end|>' }}")


def training_template(processor) -> str:
    """llmtrain's ChatML-with-images template (``llmtrain.models.vision.CHATML_WITH_IMAGES``) with
    TRL's ``{% generation %}`` markers around each assistant turn's content and ``<|im_end|>``
    (not the newline after it): the targets of llmtrain's labels. It renders the same text."""
    turn = TURN.replace("@IMAGE@", processor.image_token)
    return ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
            "{% if message['role'] == 'assistant' %}{% generation %}" + turn + "{% endgeneration %}"
            "{% else %}" + turn + "{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def with_images(records: list[dict], folder: Path) -> list[dict]:
    """The records with their image paths opened as RGB PIL images (TRL's vision layout)."""
    from PIL import Image

    return [dict(r, images=[Image.open(folder / p).convert("RGB") for p in r["images"]]) for r in records]


class _Logged:
    """Wraps a TRL trainer class so every ``log`` call is kept (with the averaged metrics)."""

    def __init__(self, cls):
        self.rows: list[dict] = []
        rows = self.rows

        class Recording(cls):
            def log(self, logs, start_time=None):
                metrics = {k: float(sum(v) / len(v)) for k, v in self._metrics["train"].items() if v}
                rows.append({**logs, **metrics})
                super().log(logs, start_time)

        self.cls = Recording


SFT_ROWS = 6  # the 8 records less the 2 held out: one step over all of them


@pytest.mark.parametrize("model", ["tiny_idefics3", pytest.param("tiny_llava", marks=pytest.mark.slow),
                                   pytest.param("tiny_gemma3", marks=pytest.mark.slow)])
def test_one_sft_step_equals_trl_sft_trainer_on_the_same_image_records(model, tmp_path):
    """One step, micro-batch = global batch = the 6 training records: TRL's collator builds
    llmtrain's ids, labels and pixels (with the aligned template; its default labels every real
    token, image tokens included), and its step's loss and gradient norm (before clipping) are
    llmtrain's within 1e-5."""
    import datasets

    from llmtrain import data
    from llmtrain.common.images import image_token_id, processor_of
    from llmtrain.models.build import build_model, build_tokenizer

    path = write_dataset(tmp_path)
    ours, cfg = train_rows([f"model={model}", "data=vlm_chat", f"data.path={path}", "data.shuffle=false",
                            "data.val_fraction=0.25", "trainer.max_steps=1", f"trainer.global_batch_size={SFT_ROWS}",
                            f"trainer.micro_batch_size={SFT_ROWS}", "trainer.eval_every=0",
                            "trainer.export_hf=false"], tmp_path / "ours")
    tokenizer = build_tokenizer(cfg.model)
    processor = processor_of(tokenizer)
    records = with_images(_training_records(path, cfg), tmp_path)
    assert len(records) == SFT_ROWS
    template = tmp_path / "training.jinja"
    template.write_text(training_template(processor))
    assert processor.apply_chat_template(records[0]["messages"], chat_template=template.read_text()) == \
        processor.apply_chat_template(records[0]["messages"])  # the markers change no text

    splits = data.load_splits(cfg.data, tokenizer, seed=cfg.trainer.seed)
    batch = data.collator_for(cfg.data, tokenizer)([splits.train[i] for i in range(SFT_ROWS)])
    logged = _Logged(trl.SFTTrainer)
    common = {**_common_args(tmp_path, SFT_ROWS, cfg), "max_steps": 1, "gradient_accumulation_steps": 1}
    args = trl.SFTConfig(**common, max_length=None, assistant_only_loss=True, chat_template_path=str(template))
    trainer = logged.cls(model=build_model(cfg.model, cfg.trainer.seed), args=args, processing_class=processor,
                         train_dataset=datasets.Dataset.from_list(records))
    theirs = trainer.data_collator([dict(r) for r in records])
    for key in ("input_ids", "labels"):  # both pad on the right; ours to data.seq_len's bucket, so compare real tokens
        for row in range(SFT_ROWS):
            keep = theirs["attention_mask"][row].bool()
            assert theirs[key][row][keep].tolist() == batch[key][row][:int(keep.sum())].tolist(), (key, row)
    assert torch.equal(theirs["pixel_values"], batch["pixel_values"])

    # TRL's default (assistant_only_loss=False) trains every real token, the image's among them.
    default = trl.trainer.sft_trainer.DataCollatorForVisionLanguageModeling(processor)([dict(r) for r in records])
    image = image_token_id(processor)
    assert (default["labels"] == image).any() and int((default["labels"] != -100).sum()) > 4 * int(
        (batch["labels"] != -100).sum())

    trainer.train()
    (step,) = [r for r in logged.rows if "loss" in r]
    (mine,) = ours
    assert mine["train/loss"] == pytest.approx(step["loss"], abs=TOL)
    assert mine["train/grad_norm"] == pytest.approx(step["grad_norm"], abs=TOL, rel=TOL)
    assert mine["train/grad_norm"] > 1.0


GRPO_STEPS, PROMPTS, G, COMPLETION = 3, 2, 4, 8


def _trl_grpo(tmp_path: Path, cfg, records: list[dict]) -> list[dict]:
    """TRL's GRPOTrainer on ``records``' image prompts, its ``rollout_func`` handing out the fixed
    completions of the prompt's ids (the processor's chat template with the image expanded)."""
    import datasets

    from llmtrain.common.images import processor_of
    from llmtrain.models.build import build_model, build_tokenizer

    processor = processor_of(build_tokenizer(cfg.model))

    def rollout(prompts, trainer):  # G copies of each prompt in a row: copy i % G is completion i % G
        ids = processor.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        ids = [list(map(int, row)) for row in ids]
        completions = [fixed_completion(p, i % G, COMPLETION) for i, p in enumerate(ids)]
        return {"prompt_ids": ids, "completion_ids": completions, "logprobs": [[0.0] * len(c) for c in completions]}

    logged = _Logged(trl.GRPOTrainer)
    common = {**_common_args(tmp_path, G * PROMPTS, cfg), "max_steps": GRPO_STEPS, "gradient_accumulation_steps": 1}
    args = trl.GRPOConfig(**common, num_generations=G, max_completion_length=COMPLETION, shuffle_dataset=False,
                          temperature=1.0, beta=0.0, loss_type="grpo")
    prompts = [{"prompt": [turn for turn in r["messages"] if turn["role"] != "assistant"], "images": r["images"]}
               for r in records]
    trainer = logged.cls(model=build_model(cfg.model, cfg.trainer.seed), reward_funcs=[odd_tokens, short],
                         args=args, train_dataset=datasets.Dataset.from_list(prompts), processing_class=processor,
                         rollout_func=rollout)
    trainer.train()
    return [r for r in logged.rows if "loss" in r]


@pytest.mark.parametrize("model", ["tiny_idefics3", pytest.param("tiny_gemma3", marks=pytest.mark.slow)])
def test_grpo_on_image_prompts_equals_trl_grpo_trainer_on_fixed_completions(model, tmp_path, monkeypatch):
    """3 steps, 2 image prompts a step, 4 fixed completions each, one micro-batch: each step's
    loss, gradient norm, reward and reward std are TRL's within 1e-5 (the prompts' questions
    have one length, so TRL's left padding shifts no position). Image prompts sample on the hf
    engine only, so its sampler hands out the fixed completions here (``FixedCompletions.sample``)."""
    from grpo_fixtures import FixedCompletions

    from llmtrain.rollout.engines import PolicySampler

    monkeypatch.setattr(PolicySampler, "sample", FixedCompletions.sample)
    path = write_prompts(tmp_path, n=8)
    ours, cfg = train_rows([f"model={model}", "objective=grpo", "data=prompts", f"data.path={path}",
                            "data.columns.prompt=messages", "data.shuffle=false", "data.val_fraction=0.25",
                            "reward.functions=[tests.grpo_fixtures:odd_tokens,tests.grpo_fixtures:short]",
                            f"rollout.max_completion_length={COMPLETION}", f"objective.num_generations={G}",
                            "objective.loss_type=grpo", f"trainer.max_steps={GRPO_STEPS}",
                            f"trainer.global_batch_size={PROMPTS}", f"trainer.micro_batch_size={PROMPTS}",
                            "trainer.eval_every=0", "trainer.export_hf=false"], tmp_path / "ours")
    theirs = _trl_grpo(tmp_path, cfg, with_images(_training_records(path, cfg), tmp_path))
    assert len(ours) == len(theirs) == GRPO_STEPS
    for step, (o, t) in enumerate(zip(ours, theirs), start=1):
        assert o["train/loss"] == pytest.approx(t["loss"], abs=TOL, rel=TOL), f"step {step} loss"
        assert o["train/grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-4), f"step {step} grad norm"
        for key in ("reward", "reward_std", "rewards/odd_tokens/mean"):
            assert o[f"train/{key}"] == pytest.approx(t[key], abs=TOL, rel=TOL), f"step {step} {key}"
    assert all(o["train/grad_norm"] > 0.1 for o in ours)  # the completions taught something
    logged = [json.loads(line) for line in (tmp_path / "ours" / "completions" / "step_1.jsonl").read_text().splitlines()]
    assert logged[0]["prompt"][0]["content"][0]["type"] == "image"  # image prompts, not text
