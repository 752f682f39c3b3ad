"""Image-text (vision-language) supervised fine-tuning on one process: the tiny Idefics3, LLaVA,
Gemma 3, Qwen2-VL and Qwen2.5-VL presets with processors built offline, TRL's conversational vision layout, assistant-only labels,
the loss against the model's own, bad records as one-line errors, exports that reload."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import FAST, assert_ok, make_cfg, read_metrics, run_cli

QUESTION = "Which colour is this square?"
COLOURS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220), "white": (240, 240, 240)}
# Tokens one image becomes: Idefics3 (16x16 image, 4x4 patches, pixel shuffle 2): 4; LLaVA
# (16x16, 4x4 patches, CLS dropped): 16; Gemma 3 (16x16, 4x4 patches pooled 2x2): 4; Qwen2-VL (a
# 12x12 square resized to 16x16, a multiple of patch 4 x merge 2, 4x4 patches merged 2x2): 4.
IMAGE_TOKENS = {"tiny_idefics3": 4, "tiny_llava": 16, "tiny_gemma3": 4, "tiny_qwen2vl": 4, "tiny_qwen2_5vl": 4}
QWEN_VL = ["tiny_qwen2vl", "tiny_qwen2_5vl"]  # Qwen2-VL and Qwen2.5-VL: the same processor and M-RoPE
FAMILIES = list(IMAGE_TOKENS)


def record(image: str | list[str], answer: str, parts: int = 1) -> dict:
    """One TRL vision-layout record: ``parts`` image parts, a question, the answer."""
    content = [{"type": "image"}] * parts + [{"type": "text", "text": QUESTION}]
    return {"messages": [{"role": "user", "content": content},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
            "images": image if isinstance(image, list) else [image]}


def write_dataset(folder: Path, records: list[dict] | None = None, n: int = 8) -> Path:
    """A folder of PIL-made 12x12 squares (one per colour) and ``train.jsonl`` naming them by
    relative path (``n`` records cycling through the colours, or ``records``)."""
    from PIL import Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    for name, rgb in COLOURS.items():
        Image.new("RGB", (12, 12), rgb).save(folder / "images" / f"{name}.png")
    names = list(COLOURS)
    rows = records if records is not None else [record(f"images/{names[i % 4]}.png", names[i % 4]) for i in range(n)]
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cross_entropy_by_hand(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean over target tokens of -log softmax(next-token logits)[label] in float64, and the
    target mask (labels[:, 1:] != -100): a loss written out, beside the model's and ours."""
    logp = torch.log_softmax(logits[:, :-1].double(), -1)
    mask = labels[:, 1:] != -100
    picked = logp.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    return -(picked * mask).sum() / mask.sum(), mask


def assert_three_losses_agree(model, batch: dict, logits: torch.Tensor) -> torch.Tensor:
    """Our objective's loss on the model's ``logits`` for ``batch``, the model's own cross-entropy
    with labels and :func:`cross_entropy_by_hand` agree within 1e-5; returns the target mask."""
    from llmtrain.engine.base import model_inputs
    from llmtrain.objectives import CausalLM

    objective = CausalLM()
    ours = objective.loss_sums(logits, batch).loss / objective.normaliser(batch)
    theirs = model(**model_inputs(batch), labels=batch["labels"]).loss
    by_hand, mask = cross_entropy_by_hand(logits, batch["labels"])
    assert torch.allclose(ours, theirs, atol=1e-5) and torch.allclose(ours.double(), by_hand, atol=1e-5)
    return mask


def loaded(model: str, path: Path, *extra: str):
    """(config, tokenizer, splits) of ``model`` on the vision chat data at ``path``."""
    from llmtrain import data
    from llmtrain.models.build import build_tokenizer

    cfg = make_cfg([f"model={model}", "data=vlm_chat", f"data.path={path}", "data.val_fraction=0.25", *extra])
    tokenizer = build_tokenizer(cfg.model)
    return cfg, tokenizer, data.load_splits(cfg.data, tokenizer, seed=0)


@pytest.mark.parametrize("model", FAMILIES)
def test_labels_are_the_assistant_turn_and_no_image_token_is_a_target(model, tmp_path):
    from llmtrain.common.images import image_token_id, processor_of

    path = write_dataset(tmp_path)
    _, tokenizer, splits = loaded(model, path)
    processor = processor_of(tokenizer)
    assert len(splits.train) + len(splits.val) == 8
    for sample in [splits.train[i] for i in range(len(splits.train))]:
        ids, labels = sample["input_ids"], sample["labels"]
        targets = [t for t in labels if t != -100]
        answer = Path(sample["images"][0]).stem
        assert tokenizer.decode(targets) == answer + "<|im_end|>"  # the answer and its end of turn, nothing else
        image = image_token_id(processor)
        assert ids.count(image) == IMAGE_TOKENS[model]
        assert image not in targets and processor.image_token_id not in targets  # (Gemma 3's <start_of_image>)
        assert all(t == -100 for t, i in zip(labels, ids) if i == image)
        assert sample["images"] == [str(path.parent / "images" / f"{answer}.png")]  # relative to the data file


def test_loss_equals_the_models_own_on_the_same_batch_and_the_images_reach_the_forward(tmp_path):
    """Our objective on the engine's forward arguments (model_inputs) gives the model's own
    cross-entropy with labels; other pixels change the logits after the image only."""
    from llmtrain import data
    from llmtrain.engine.base import model_inputs
    from llmtrain.models.build import build_model

    cfg, tokenizer, splits = loaded("tiny_idefics3", write_dataset(tmp_path))
    batch = data.collator_for(cfg.data, tokenizer)([splits.train[0], splits.train[1]])
    assert batch["pixel_values"].shape == (2, 1, 3, 16, 16) and batch["pixel_attention_mask"].shape == (2, 1, 16, 16)
    model = build_model(cfg.model, seed=0).eval()
    with torch.no_grad():
        logits = model(**model_inputs(batch)).logits
        mask = assert_three_losses_agree(model, batch, logits)
        # Other pixels (not zeros: Idefics3 drops all-zero images as padding).
        blank = model(**model_inputs({**batch, "pixel_values": batch["pixel_values"] + 0.5})).logits
    # The answers' bytes (the byte tokenizer: one token each) and their <|im_end|>s.
    assert int(mask.sum()) == sum(len(Path(splits.train[i]["images"][0]).stem) + 1 for i in (0, 1))
    first_image = int((batch["input_ids"][0] == 261).nonzero()[0])
    assert torch.equal(blank[0, :first_image], logits[0, :first_image])  # before the image: causal, unchanged
    assert not torch.allclose(blank[0, -1], logits[0, -1])


def test_gemma3_loss_equals_the_models_own_and_image_tokens_attend_both_ways(tmp_path):
    """tiny_gemma3: our objective on the engine's forward arguments gives the model's own
    cross-entropy with labels and a hand computation; the forward gets the processor's
    ``token_type_ids`` (its image tokens attend both ways, as in the export's generate), which
    changes the image's logits from a causal forward's and leaves the tokens before it alone."""
    from llmtrain import data
    from llmtrain.common.images import image_token_id, processor_of
    from llmtrain.engine.base import model_inputs
    from llmtrain.models.build import build_model

    cfg, tokenizer, splits = loaded("tiny_gemma3", write_dataset(tmp_path))
    batch = data.collator_for(cfg.data, tokenizer)([splits.train[0], splits.train[1]])
    assert batch["pixel_values"].shape == (2, 3, 16, 16)
    model = build_model(cfg.model, seed=0).eval()
    image = batch["input_ids"] == image_token_id(processor_of(tokenizer))
    with torch.no_grad():
        logits = model(**model_inputs(batch)).logits
        mask = assert_three_losses_agree(model, batch, logits)
        explicit = model(**model_inputs(batch), token_type_ids=image.long()).logits  # what the processor gives
        causal = model(**model_inputs(batch), token_type_ids=torch.zeros_like(batch["input_ids"])).logits
    assert int(mask.sum()) == sum(len(Path(splits.train[i]["images"][0]).stem) + 1 for i in (0, 1))
    assert int(image.sum()) == 2 * IMAGE_TOKENS["tiny_gemma3"]
    assert torch.equal(logits, explicit)
    first = int(image[0].nonzero()[0])
    assert torch.equal(causal[0, :first], logits[0, :first])
    assert not torch.allclose(causal[0, first], logits[0, first])  # the first image token sees the later ones


@pytest.mark.parametrize("preset", QWEN_VL)
def test_qwen2vl_loss_equals_the_models_own_and_image_tokens_get_their_mrope_positions(preset, tmp_path):
    """tiny_qwen2vl and tiny_qwen2_5vl: the collator gives the images' patches and grids (``image_grid_thw``); our
    objective gives the model's own cross-entropy with labels and a hand computation; the forward
    gets the processor's ``mm_token_type_ids`` (1 at <|image_pad|>), so each image's tokens sit on
    M-RoPE's 2-D grid: the logits equal a forward given the processor's types, and differ after
    the image from one given plain 1-D positions (the tokens before it are alike). Qwen2.5-VL's
    tower attends within windows of one merged token (2x2 patches) in block 0: its image features
    differ from those of the same tower attending over the whole image in every block."""
    from PIL import Image

    from llmtrain import data
    from llmtrain.common.images import processor_of
    from llmtrain.engine.base import model_inputs
    from llmtrain.models.build import build_model

    cfg, tokenizer, splits = loaded(preset, write_dataset(tmp_path))
    samples = [splits.train[0], splits.train[1]]
    batch = data.collator_for(cfg.data, tokenizer)(samples)
    # Two 16x16 images of 4x4 patches, each flattened to channels x 2 frames x 4 x 4 values.
    assert batch["pixel_values"].shape == (32, 3 * 2 * 4 * 4) and batch["image_grid_thw"].tolist() == [[1, 4, 4]] * 2
    model = build_model(cfg.model, seed=0).eval()
    processor = processor_of(tokenizer)
    text = processor.apply_chat_template([record("x", "")["messages"][0]])
    by_processor = processor(text=[text], images=[[Image.new("RGB", (12, 12))]])
    image = batch["input_ids"] == processor.image_token_id
    assert by_processor["mm_token_type_ids"][0] == [int(t == processor.image_token_id) for t in by_processor["input_ids"][0]]
    with torch.no_grad():
        logits = model(**model_inputs(batch)).logits
        mask = assert_three_losses_agree(model, batch, logits)
        explicit = model(**model_inputs(batch), mm_token_type_ids=image.long()).logits
        flat = torch.arange(batch["input_ids"].shape[1]).expand(3, 2, -1)  # text positions on every axis
        plain = model(**model_inputs(batch), position_ids=flat).logits
    assert int(mask.sum()) == sum(len(Path(s["images"][0]).stem) + 1 for s in samples)
    assert int(image.sum()) == 2 * IMAGE_TOKENS[preset]
    assert torch.equal(logits, explicit)
    first = int(image[0].nonzero()[0])
    assert torch.equal(plain[0, :first + 1], logits[0, :first + 1])  # the first image token: (t, h, w) = its text position
    assert not torch.allclose(plain[0, first + 1], logits[0, first + 1])
    if preset == "tiny_qwen2_5vl":
        # Noise, not the squares: a one-colour image's patches are alike, so any mask averages the same values.
        noise = torch.randn(batch["pixel_values"].shape, generator=torch.Generator().manual_seed(0))
        tower, pixels = model.model.visual, (noise, batch["image_grid_thw"])
        assert tower.fullatt_block_indexes == [1] and tower.window_size == 8
        with torch.no_grad():
            windowed = tower(*pixels).pooler_output
            tower.fullatt_block_indexes = [0, 1]
            whole = tower(*pixels).pooler_output
        assert windowed.shape == whole.shape == (8, 64) and not torch.allclose(windowed, whole, atol=1e-4)


def test_qwen2vl_pixel_budget_sets_the_image_tokens_and_travels_with_the_export(tmp_path):
    """data.max_pixels: a 40x40 image is 16x16 (4 tokens) at the preset's budget of 256 pixels and
    32x32 (16 tokens) at 1024; the export's processor keeps the budget. A fixed-size image
    processor refuses a budget in one line."""
    from PIL import Image
    from transformers import AutoProcessor

    from llmtrain import data
    from llmtrain.checkpoint.export import save_hf_folder
    from llmtrain.common.errors import ConfigError
    from llmtrain.models.build import build_model

    path = write_dataset(tmp_path)
    Image.new("RGB", (40, 40), (20, 20, 220)).save(tmp_path / "images" / "blue.png")
    counts = {}
    for budget in (None, 1024):
        extra = [f"data.max_pixels={budget}"] if budget else []
        cfg, tokenizer, splits = loaded("tiny_qwen2vl", path, *extra)
        blue = next(s for s in (splits.train[i] for i in range(len(splits.train))) if "blue" in s["images"][0])
        counts[budget] = blue["input_ids"].count(262)
    assert counts == {None: 4, 1024: 16}
    out = save_hf_folder(build_model(cfg.model, seed=0).state_dict(), cfg.model, tokenizer, tmp_path / "hf",
                         data.end_token_ids(cfg.data, tokenizer))
    assert AutoProcessor.from_pretrained(out).image_processor.size["longest_edge"] == 1024
    with pytest.raises(ConfigError) as err:
        loaded("tiny_llava", path, "data.max_pixels=1024")
    assert str(err.value).startswith("data.max_pixels=1024: a pixel budget is for image processors with dynamic "
                                     "resolution (Qwen2-VL's), and this model's image processor (CLIPImageProcessorPil)")
    with pytest.raises(ConfigError, match=r"^data.min_pixels=512 is over data.max_pixels=256"):
        loaded("tiny_qwen2vl", path, "data.min_pixels=512")


@pytest.mark.parametrize("preset,stock", [("tiny_qwen2vl", "Qwen2VLProcessor"),
                                          ("tiny_qwen2_5vl", "Qwen2_5_VLProcessor")])
def test_a_qwen2vl_folder_with_the_stock_processor_loads_its_images_part_without_torchvision(preset, stock, tmp_path):
    """A folder laid out as a Hub Qwen2-VL or Qwen2.5-VL checkpoint (``processor_class:
    Qwen2VLProcessor`` or ``Qwen2_5_VLProcessor``, no llmtrain code), where torchvision is missing: ``AutoProcessor`` cannot load its video
    processor, and ``model.source=pretrained`` trains with the folder's image processor (its pixel
    budget) and tokenizer."""
    import importlib.util

    from llmtrain import data
    from llmtrain.checkpoint.export import save_hf_folder
    from llmtrain.common.images import processor_of
    from llmtrain.models.build import build_model

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the stock Qwen2VLProcessor loads")
    path = write_dataset(tmp_path)
    cfg, tokenizer, _ = loaded(preset, path, "data.max_pixels=1024")
    out = save_hf_folder(build_model(cfg.model, seed=0).state_dict(), cfg.model, tokenizer, tmp_path / "hf",
                         data.end_token_ids(cfg.data, tokenizer))
    config = json.loads((out / "processor_config.json").read_text())
    config["processor_class"] = stock
    for node in (config, config["image_processor"]):
        node.pop("auto_map")
    (out / "processor_config.json").write_text(json.dumps(config))
    (out / "qwen2vl_images.py").unlink()
    pretrained = ["model.source=pretrained", f"model.path={out}", "model.tokenizer=model"]
    _, tokenizer, splits = loaded(preset, path, *pretrained)
    processor = processor_of(tokenizer)
    assert type(processor).__name__ == "Qwen2VLImagesProcessor" and processor.image_processor.size["longest_edge"] == 1024
    assert splits.train[0]["input_ids"].count(262) == 4  # 12x12 squares: 16x16 at any budget over 256


@pytest.mark.parametrize("rows, message", [
    ([record("images/missing.png", "red")], "line 1: field 'images': image {folder}/images/missing.png does not exist"),
    ([record("train.jsonl", "red")], "line 1: field 'images': image {folder}/train.jsonl cannot be read"),
    ([record(["images/red.png"], "red", parts=2)], "line 1: 2 image part(s) in field 'messages' but 1 image(s) in "
                                                   "field 'images'"),
    ([record(["images/red.png", "images/blue.png"], "red")], "line 1: 1 image part(s) in field 'messages' but 2 "
                                                             "image(s) in field 'images'"),
])
def test_bad_records_are_data_errors_naming_the_line_and_field(rows, message, tmp_path):
    from llmtrain.common.errors import DataError

    path = write_dataset(tmp_path, rows + [record("images/red.png", "red")] * 3)
    with pytest.raises(DataError) as err:
        loaded("tiny_llava", path)
    assert str(err.value).startswith(f"data.path: {path} " + message.format(folder=tmp_path)), str(err.value)


def test_images_for_a_text_only_model_are_refused_and_text_only_records_are_chat(tmp_path):
    from llmtrain.common.errors import DataError

    path = write_dataset(tmp_path)
    with pytest.raises(DataError, match=r"line 1: field 'images' holds 1 image\(s\), and the model is text-only"):
        loaded("tiny_llama", path, "data.template=chatml")
    # The same layout without images is plain chat for a text-only model.
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "assistant", "content": "yo"}], "images": []}
    _, tokenizer, splits = loaded("tiny_llama", write_dataset(tmp_path / "text", [chat] * 4), "data.template=chatml")
    assert tokenizer.decode([t for t in splits.train[0]["labels"] if t != -100]) == "yo<|im_end|>"
    assert splits.train[0]["images"] == []


def test_a_missing_image_exits_2_with_one_line(tmp_path):
    path = write_dataset(tmp_path, [record("images/red.png", "red")] * 3 + [record("images/gone.png", "red")])
    proc = run_cli(["model=tiny_llava", "data=vlm_chat", f"data.path={path}", *FAST, f"run_dir={tmp_path / 'run'}"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [f"llmtrain: error: data.path: {path} line 4: field 'images': image "
                                        f"{tmp_path}/images/gone.png does not exist"]


@pytest.mark.parametrize("model", FAMILIES)
def test_export_reloads_with_its_processor_and_generates_the_same_tokens(model, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from llmtrain import data
    from llmtrain.checkpoint.export import save_hf_folder
    from llmtrain.data.vision import load_image
    from llmtrain.models.build import build_model

    cfg, tokenizer, _ = loaded(model, write_dataset(tmp_path))
    trained = build_model(cfg.model, seed=3).eval()
    out = save_hf_folder(trained.state_dict(), cfg.model, tokenizer, tmp_path / "hf",
                         data.end_token_ids(cfg.data, tokenizer))
    processor, reloaded = AutoProcessor.from_pretrained(out), AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(reloaded) is type(trained)
    prompt = processor.apply_chat_template([record("x", "")["messages"][0]], add_generation_prompt=True)
    image = load_image(tmp_path / "images" / "blue.png", "test", "images")
    inputs = processor(text=[prompt], images=[[image]], return_tensors="pt")
    same = dict(max_new_tokens=6, do_sample=False, min_new_tokens=6)
    expected = trained.generate(**inputs, **same, pad_token_id=257)
    assert torch.equal(reloaded.generate(**inputs, **same), expected)
    assert (reloaded.generation_config.eos_token_id == [259, 256])  # <|im_end|> and EOS end a response
    if model in QWEN_VL:  # a process without llmtrain loads the processor the export carries
        import os
        import subprocess
        import sys

        code = ("import sys; from transformers import AutoProcessor; "
                "p = AutoProcessor.from_pretrained(sys.argv[1], trust_remote_code=True); "
                "print(type(p).__name__, 'llmtrain' in sys.modules)")
        env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
        proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env)
        assert proc.stdout.split() == ["Qwen2VLImagesProcessor", "False"], proc.stderr[-2000:]


@pytest.mark.parametrize("model,processor", [("tiny_idefics3", "Idefics3Processor"),
                                             ("tiny_gemma3", "Gemma3Processor"),
                                             ("tiny_qwen2vl", "Qwen2VLImagesProcessor"),
                                             ("tiny_qwen2_5vl", "Qwen2VLImagesProcessor")])
def test_one_process_cli_run_trains_and_exports(model, processor, tmp_path):
    """``python -m llmtrain model=tiny_idefics3 data=vlm_chat``: the loss falls over 4 steps on
    four coloured squares and the export loads with AutoProcessor."""
    from transformers import AutoProcessor

    path = write_dataset(tmp_path, n=16)
    run = tmp_path / "run"
    proc = run_cli([f"model={model}", "data=vlm_chat", f"data.path={path}", *FAST, "trainer.max_steps=4",
                    "trainer.global_batch_size=4", "trainer.micro_batch_size=4", "trainer.lr=3e-3",
                    "trainer.warmup_steps=1", f"run_dir={run}"])
    assert_ok(proc)
    losses = [r["train/loss"] for r in read_metrics(run) if "train/loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, losses
    # The images' preparation is reported each step (read ahead, so early steps may hold several).
    prepared = [r.get("time/image_prep_s") for r in read_metrics(run) if "train/loss" in r]
    assert None not in prepared and sum(prepared) > 0, prepared
    assert type(AutoProcessor.from_pretrained(run / "hf")).__name__ == processor


def test_the_digits_folder_encodes(shared_data):
    """The shared digits folder (docs/vision.md's, made by scripts/make_digits.py): records read,
    one image each, the digit as the only target before <|im_end|>."""
    path = shared_data / "digits" / "train.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    _, tokenizer, splits = loaded("tiny_llava", path, "data.max_records=20")
    sample = splits.train[0]
    targets = tokenizer.decode([t for t in sample["labels"] if t != -100])
    assert len(targets) == len("0<|im_end|>") and targets[0].isdigit() and len(sample["images"]) == 1


def test_make_digits_writes_the_shared_folders_records_and_pixels(tmp_path, shared_data):
    """scripts/make_digits.py (docs/vision.md) rebuilds the shared digits folder from
    scikit-learn's bundled copy: the same records and the same pixels (PNG bytes may differ)."""
    import importlib.util

    import numpy as np
    from PIL import Image

    from conftest import REPO

    pytest.importorskip("sklearn")
    shared = shared_data / "digits"
    if not (shared / "train.jsonl").is_file():
        pytest.skip(f"{shared} not present")
    spec = importlib.util.spec_from_file_location("make_digits", REPO / "scripts" / "make_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.write_digits(tmp_path, limit=5) == 5
    ours = (tmp_path / "train.jsonl").read_text().splitlines()
    assert ours == (shared / "train.jsonl").read_text().splitlines()[:5]
    for i in range(5):
        name = f"images/{i:04d}.png"
        assert np.array_equal(np.asarray(Image.open(tmp_path / name)), np.asarray(Image.open(shared / name)))
    # The same images as DPO pairs: the record's prompt and digit chosen, another digit rejected.
    for line, pair_line in zip(ours, (tmp_path / "train_pairs.jsonl").read_text().splitlines(), strict=True):
        rec, pair = json.loads(line), json.loads(pair_line)
        chosen, rejected = (pair[k][0]["content"][0]["text"] for k in ("chosen", "rejected"))
        assert pair["prompt"] == rec["messages"][:1] and pair["images"] == rec["images"]
        assert chosen == rec["answer"] and rejected != chosen and rejected.isdigit()


@pytest.mark.slow
def test_a_resumed_run_continues_as_the_uninterrupted_one(tmp_path):
    """3 steps, a checkpoint, then on to 5: steps 4 and 5 as in one 5-step run (tiny_llava's
    unused post_layernorm is frozen, or its missing optimizer state would refuse the resume)."""
    path = write_dataset(tmp_path, n=16)
    common = ["model=tiny_llava", "data=vlm_chat", f"data.path={path}", *FAST, "trainer.global_batch_size=4",
              "trainer.micro_batch_size=2", "trainer.save_every=3"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert_ok(run_cli(common + ["trainer.max_steps=5", f"run_dir={whole}"]))
    assert_ok(run_cli(common + ["trainer.max_steps=3", f"run_dir={parts}"]))
    assert_ok(run_cli(common + ["trainer.max_steps=5", f"run_dir={parts}"]))
    losses = {run: {r["step"]: r["train/loss"] for r in read_metrics(run) if "train/loss" in r} for run in (whole, parts)}
    assert [losses[parts][s] for s in (4, 5)] == pytest.approx([losses[whole][s] for s in (4, 5)], abs=1e-5)


@pytest.mark.parametrize("model,lora_parts", [("tiny_idefics3", "[language]"), ("tiny_llava", "[language,vision]"),
                                              ("tiny_qwen2vl", "[language,vision]")])
def test_lora_on_chosen_parts_and_its_merged_export_generates_the_same_tokens(model, lora_parts, tmp_path):
    """+peft=lora on an image-text model: adapters on the language model only by default, on the
    vision tower too with peft.parts=[language,vision], never on the projector or the head. The
    merged export (AutoModelForImageTextToText) and the adapter folder on its base (PeftModel)
    generate the trained model's greedy tokens, adapters non-zero."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from llmtrain import data
    from llmtrain.checkpoint.export import export_lora
    from llmtrain.data.vision import load_image
    from llmtrain.models import adapters, parts
    from llmtrain.models.build import build_model

    cfg, tokenizer, _ = loaded(model, write_dataset(tmp_path), "+peft=lora", f"peft.parts={lora_parts}")
    trained = adapters.apply(build_model(cfg.model, seed=3), cfg).eval()
    family = parts.known_family(trained)
    adapted = {family.part_of(n) for n, _ in trained.named_parameters() if ".lora_A." in n}
    assert adapted == set(lora_parts.strip("[]").split(","))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if ".lora_B." in name:  # B starts at zero: give the adapters something to merge
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    written = export_lora(trained.state_dict(), cfg, tokenizer, tmp_path / "adapter", tmp_path / "hf",
                          data.end_token_ids(cfg.data, tokenizer))
    processor = AutoProcessor.from_pretrained(written["export"])
    merged = AutoModelForImageTextToText.from_pretrained(written["export"]).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    on_base = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(written["base"]),
                                        written["adapter"]).eval()
    prompt = processor.apply_chat_template([record("x", "")["messages"][0]], add_generation_prompt=True)
    image = load_image(tmp_path / "images" / "blue.png", "test", "images")
    inputs = processor(text=[prompt], images=[[image]], return_tensors="pt")
    same = dict(max_new_tokens=6, do_sample=False, min_new_tokens=6, pad_token_id=257)
    expected = trained.generate(**inputs, **same)
    with adapters_off(trained):
        base_tokens = trained.generate(**inputs, **same)
    assert not torch.equal(base_tokens, expected)  # the adapters change the answer
    assert torch.equal(merged.generate(**inputs, **same), expected)
    assert torch.equal(on_base.generate(**inputs, **same), expected)


def adapters_off(model):
    from llmtrain.objectives.reference import adapters_disabled

    return adapters_disabled(model)


@pytest.mark.parametrize("model, setting, said", [
    ("tiny_idefics3", "size={longest_edge:0}", "size must be a dictionary with key 'longest_edge'"),
    ("tiny_llava", "crop_size={height:0,width:0}", "it gives pixel_values of shape [1, 3, 0, 0], no pixel"),
    ("tiny_gemma3", "size={height:0,width:16}", "Size must contain 'height' and 'width' keys"),
])
def test_image_sizes_the_processor_cannot_use_are_refused_at_the_build(model, setting, said):
    """Once a ValueError traceback at the first record (or empty pixels for LLaVA): a config error
    naming model.processor.image_processor, before any data is read."""
    from llmtrain.common.errors import ConfigError
    from llmtrain.models.build import build_tokenizer

    with pytest.raises(ConfigError, match=r"^model\.processor\.image_processor=\{.*\}: the image processor cannot "
                                          r"prepare an image with these settings: " + re.escape(said)):
        build_tokenizer(make_cfg([f"model={model}", f"model.processor.image_processor.{setting}"]).model)
    build_tokenizer(make_cfg([f"model={model}"]).model)  # the preset's own sizes pass


@pytest.mark.parametrize("seq_len, too_long, cut", [(8, 8, 0), (24, 0, 8)])
def test_records_that_do_not_fit_are_counted_by_why_and_the_fix_named(seq_len, too_long, cut, tmp_path):
    """data.seq_len=8 cuts through each record's image (4 image tokens after ChatML's user header):
    dropped as too long; 24 keeps the image but cuts the question before the answer: every record
    is counted (once the second kind was in no count: '0 of 8 ... too long 0, ... 0')."""
    from llmtrain.common.errors import DataError

    path = write_dataset(tmp_path)
    with pytest.raises(DataError) as err:
        loaded("tiny_idefics3", path, f"data.seq_len={seq_len}")
    assert str(err.value) == (f"data.path: {path}: 0 of 8 records give a usable sample at data.seq_len={seq_len} "
                              f"(dropped as too long or cut through an image {too_long}, cut before their first "
                              f"target token {cut}, without an assistant turn 0); need at least 2; raise data.seq_len")
