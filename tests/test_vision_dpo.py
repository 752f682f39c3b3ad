"""The DPO family with images in the prompt (TRL's VLM DPO layout: message-list ``prompt`` with
``{"type": "image"}`` parts, ``chosen``, ``rejected``, ``images``): the pairs' ids, the pixels in
the policy's and the reference's forwards, the loss against a hand computation from the model's own
log-probs of each sequence with its image and against TRL's DPOTrainer, bad records, and a run of
each objective."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import FAST, assert_ok, make_cfg, read_metrics, run_cli
from test_vision import COLOURS, IMAGE_TOKENS, QUESTION, write_dataset

NAMES = list(COLOURS)


def pair(i: int, parts: int = 1, images: list[str] | None = None) -> dict:
    """Pair ``i``: the image of colour ``i``, its name chosen, the next colour's name rejected."""
    colour, wrong = NAMES[i % 4], NAMES[(i + 1) % 4]
    return {"prompt": [{"role": "user", "content": [{"type": "image"}] * parts + [{"type": "text", "text": QUESTION}]}],
            "chosen": [{"role": "assistant", "content": [{"type": "text", "text": colour}]}],
            "rejected": [{"role": "assistant", "content": [{"type": "text", "text": wrong}]}],
            "images": images if images is not None else [f"images/{colour}.png"]}


def write_pairs(folder: Path, rows: list[dict] | None = None, n: int = 8) -> Path:
    write_dataset(folder)  # the coloured squares
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (rows if rows is not None else [pair(i) for i in range(n)])))
    return path


def pairs_of(model: str, path: Path, *extra: str):
    from llmtrain import data
    from llmtrain.models.build import build_tokenizer

    cfg = make_cfg([f"model={model}", "data=preference", f"data.path={path}", "objective=dpo", "data.seq_len=128",
                    "data.max_prompt_tokens=null", *extra])
    tokenizer = build_tokenizer(cfg.model)
    return cfg, tokenizer, data.load_splits(cfg.data, tokenizer, seed=0)


@pytest.mark.parametrize("model", ["tiny_idefics3", "tiny_llava", "tiny_gemma3", "tiny_qwen2vl"])
def test_image_pairs_hold_the_image_tokens_in_the_prompt_and_both_rows_get_the_pixels(model, tmp_path):
    from llmtrain import data
    from llmtrain.common.images import image_token_id, processor_of

    cfg, tokenizer, splits = pairs_of(model, write_pairs(tmp_path))
    image_token = image_token_id(processor_of(tokenizer))
    items = [splits.train[i] for i in range(3)]
    for item in items:
        prompt = item["chosen_ids"][:item["prompt_len"]]
        assert item["rejected_ids"][:item["prompt_len"]] == prompt and prompt.count(image_token) == IMAGE_TOKENS[model]
        colour = Path(item["images"][0]).stem
        assert tokenizer.decode(item["chosen_ids"][item["prompt_len"]:]).startswith(colour + "<|im_end|>")
        assert item["images"] == [str(tmp_path / "images" / f"{colour}.png")]
    batch = data.collator_for(cfg.data, tokenizer)(items)
    pixels = batch["pixel_values"]
    if "image_grid_thw" in batch:  # Qwen2-VL: every image's patches in one [patches, values] tensor, 16 an image
        assert batch["image_grid_thw"].tolist() == [[1, 4, 4]] * 6
        pixels = pixels.reshape(6, 16, -1)
    assert pixels.shape[0] == 6  # rows: the 3 chosen, then the 3 rejected, one image each
    assert torch.equal(pixels[:3], pixels[3:]) and not torch.equal(pixels[0], pixels[1])


def sequence_logp(net, processor, record: dict, which: str, image_folder: Path) -> float:
    """log π(completion | prompt, image) by hand: the processor's own chat template and image
    expansion, one forward of prompt + completion, the completion's tokens' log-softmax summed."""
    from PIL import Image

    image = Image.open(image_folder / record["images"][0]).convert("RGB")
    prompt = processor.apply_chat_template(record["prompt"], add_generation_prompt=True)
    full = processor.apply_chat_template(record["prompt"] + record[which])
    n = processor(text=[prompt], images=[[image]], return_tensors="pt")["input_ids"].shape[1]
    inputs = processor(text=[full], images=[[image]], return_tensors="pt")
    with torch.no_grad():
        logp = torch.log_softmax(net(**inputs).logits[0].double(), -1)
    ids = inputs["input_ids"][0]
    return float(sum(logp[t - 1, ids[t]] for t in range(n, len(ids))))


@pytest.mark.parametrize("model", ["tiny_idefics3", "tiny_llava", "tiny_gemma3", "tiny_qwen2vl"])
def test_dpo_loss_equals_a_hand_computation_from_each_sequences_log_prob_with_its_image(model, tmp_path):
    """Our DPO loss (the engine's forward arguments, the live reference's log-probs, the batch's
    pixels) equals -log σ(β((π_c - ref_c) - (π_r - ref_r))) averaged over pairs, each log-prob a
    forward of its own sequence with its image; the reference is another model (other weights),
    so both forwards count. Other pixels give another loss."""
    from llmtrain import data
    from llmtrain.common.images import processor_of
    from llmtrain.engine.base import model_inputs
    from llmtrain.models.build import build_model
    from llmtrain.objectives import build_objective
    from llmtrain.objectives.reference import LiveReference

    path = write_pairs(tmp_path)
    cfg, tokenizer, splits = pairs_of(model, path, "objective.beta=0.5")
    policy, reference = build_model(cfg.model, seed=0).eval(), build_model(cfg.model, seed=1).eval()
    objective = build_objective(cfg.objective)
    items = [splits.train[i] for i in range(3)]
    batch = data.collator_for(cfg.data, tokenizer)(items)

    def loss(b: dict) -> float:
        b = dict(b, ref_logps=LiveReference(lambda x: reference(**model_inputs(x)).logits)(b))
        with torch.no_grad():
            return float(objective.loss_sums(policy(**model_inputs(b)).logits, b).loss / objective.normaliser(b))

    records = [json.loads(line) for line in path.read_text().splitlines()]
    by_colour = {Path(r["images"][0]).stem: r for r in records}
    processor = processor_of(tokenizer)
    by_hand = 0.0
    for item in items:
        record = by_colour[Path(item["images"][0]).stem]
        logps = {(name, which): sequence_logp(net, processor, record, which, tmp_path)
                 for name, net in (("policy", policy), ("reference", reference)) for which in ("chosen", "rejected")}
        margin = ((logps["policy", "chosen"] - logps["reference", "chosen"])
                  - (logps["policy", "rejected"] - logps["reference", "rejected"]))
        by_hand += -math.log(1 / (1 + math.exp(-0.5 * margin))) / len(items)
    ours = loss(batch)
    assert ours == pytest.approx(by_hand, abs=1e-5)
    assert abs(ours - math.log(2)) > 1e-3  # other weights: the margin is not 0
    assert abs(loss(dict(batch, pixel_values=batch["pixel_values"] + 0.5)) - ours) > 1e-4


@pytest.mark.parametrize("rows, message", [
    ([pair(0, images=["images/gone.png"])], "line 1: field 'images': image {folder}/images/gone.png does not exist"),
    ([pair(0, parts=2)], "line 1: 2 image part(s) in field 'prompt' but 1 path(s) in field 'images'"),
    ([dict(pair(0), chosen=[{"role": "assistant", "content": [{"type": "image"}]}])],
     "line 1: field 'chosen' holds 1 image part(s); a pair's images go in its prompt"),
    ([dict(pair(0), prompt="Which colour?", chosen="red", rejected="blue")],
     "line 1: field 'images' holds images, which go with message-list prompts"),
])
def test_bad_image_pairs_are_data_errors_naming_the_line_and_field(rows, message, tmp_path):
    from llmtrain.common.errors import DataError

    path = write_pairs(tmp_path, rows + [pair(i) for i in range(1, 4)])
    with pytest.raises(DataError) as err:
        pairs_of("tiny_llava", path)
    assert str(err.value).startswith(f"data.path: {path} " + message.format(folder=tmp_path)), str(err.value)


def test_images_for_a_text_only_model_kto_and_packing_are_refused_in_one_line(tmp_path):
    from llmtrain.common.errors import ConfigError, DataError

    path = write_pairs(tmp_path)
    with pytest.raises(DataError, match=r"line 1: field 'images' holds 1 image\(s\), and the model is text-only"):
        pairs_of("tiny_llama", path, "data.template=chatml")
    with pytest.raises(ConfigError, match="^data.packing=true: image-text preference pairs are not packed yet"):
        pairs_of("tiny_llava", path, "data.packing=true")
    proc = run_cli(["model=tiny_llava", "data=preference", f"data.path={path}", "objective=kto", *FAST,
                    "data.seq_len=128", "data.max_prompt_tokens=null", f"run_dir={tmp_path / 'run'}"])
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "llmtrain: error: objective=kto with an images column: unpaired examples do not carry images yet; use "
        "objective=dpo (or simpo, orpo) on the pairs, or drop the images column"], proc.stderr[-2000:]


@pytest.mark.parametrize("objective,extra", [
    ("dpo", []), ("simpo", []), ("orpo", []), ("dpo", ["objective.precompute_reference=true"]),
    ("dpo", ["+peft=lora", "peft.parts=[language,vision]", "trainer.lr=3e-2"])])
def test_each_pair_objective_trains_on_image_pairs(objective, extra, tmp_path):
    """One process, 4 steps on image pairs: the DPO family runs end to end (references: a frozen
    copy, precomputed log-probs, LoRA's base with the adapters off) and learns to prefer the right
    colour's name (the chosen rewards pull ahead of the rejected)."""
    path = write_pairs(tmp_path, n=16)
    run = tmp_path / "run"
    assert_ok(run_cli(["model=tiny_idefics3", "data=preference", f"data.path={path}", f"objective={objective}", *FAST,
                       "data.seq_len=128", "data.max_prompt_tokens=null", "trainer.max_steps=4",
                       "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.lr=3e-3",
                       "trainer.warmup_steps=1", "trainer.eval_every=4", *extra, f"run_dir={run}"]))
    assert any("val/loss" in r for r in read_metrics(run))  # held-out pairs, with their pixels, too
    rows = [r for r in read_metrics(run) if "train/loss" in r]
    assert len(rows) == 4 and rows[-1]["train/loss"] < rows[0]["train/loss"], [r["train/loss"] for r in rows]
    assert rows[-1]["train/rewards/margins"] > rows[0]["train/rewards/margins"]


def test_a_reward_model_on_an_image_text_model_is_refused_in_one_line(tmp_path):
    path = write_pairs(tmp_path)
    proc = run_cli(["model=tiny_llava", "data=preference", f"data.path={path}", "objective=reward", *FAST,
                    "data.seq_len=128", "data.max_prompt_tokens=null", f"run_dir={tmp_path / 'run'}"])
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "llmtrain: error: objective=reward with model=tiny_llava: an image-text model has no sequence-classification "
        "head in transformers; train the reward model on a text-only model, or use objective=dpo on the image pairs"], \
        proc.stderr[-2000:]


@pytest.mark.parametrize("model", ["tiny_idefics3", "tiny_llava"])
def test_dpo_loss_token_ids_and_pixels_equal_trl_dpo_trainer_on_the_same_image_pairs(model, tmp_path):
    """TRL's DPOTrainer (its vision collator, ``compute_loss``) on the same three records with PIL
    images, the same policy and reference (other weights), β 0.5: its rows' ids and pixels are
    ours, and its loss is ours within 1e-5."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    from PIL import Image

    from llmtrain import data
    from llmtrain.common.images import processor_of
    from llmtrain.engine.base import model_inputs
    from llmtrain.models.build import build_model
    from llmtrain.objectives import build_objective
    from llmtrain.objectives.reference import LiveReference

    path = write_pairs(tmp_path)
    cfg, tokenizer, splits = pairs_of(model, path, "objective.beta=0.5")
    policy, reference = build_model(cfg.model, seed=0).eval(), build_model(cfg.model, seed=1).eval()
    items = [splits.train[i] for i in range(3)]
    by_colour = {Path(r["images"][0]).stem: r for r in map(json.loads, path.read_text().splitlines())}
    records = [dict(r, images=[Image.open(tmp_path / r["images"][0]).convert("RGB")])
               for r in (by_colour[Path(item["images"][0]).stem] for item in items)]
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=3, beta=0.5, report_to=[],
                         use_cpu=True, max_length=None, bf16=False, remove_unused_columns=False)
    trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=args, processing_class=processor_of(tokenizer),
                             train_dataset=datasets.Dataset.from_list(records))
    theirs = trainer.data_collator([dict(r) for r in records])
    ours = data.collator_for(cfg.data, tokenizer)(items)
    for row in range(6):  # TRL left-pads its prompts: compare the real tokens
        assert (theirs["input_ids"][row][theirs["attention_mask"][row].bool()].tolist()
                == ours["input_ids"][row][ours["attention_mask"][row].bool()].tolist())
    assert torch.equal(theirs["pixel_values"], ours["pixel_values"])
    objective = build_objective(cfg.objective)
    ours = dict(ours, ref_logps=LiveReference(lambda b: reference(**model_inputs(b)).logits)(ours))
    with torch.no_grad():
        trl_loss = float(trainer.compute_loss(policy, theirs))
        our_loss = float(objective.loss_sums(policy(**model_inputs(ours)).logits, ours).loss / objective.normaliser(ours))
    assert our_loss == pytest.approx(trl_loss, abs=1e-5) and abs(our_loss - math.log(2)) > 1e-3
