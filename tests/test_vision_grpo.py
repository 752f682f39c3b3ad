"""GRPO with image prompts on the hf engine (issue 58): TRL's conversational vision layout as
prompts, the prompt's pixels in generation and in the policy's log-prob forward, the ``answer``
reward; engines of your own refused in one line (vLLM: tests/test_vllm_images.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import make_cfg

COLOURS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220), "white": (240, 240, 240)}


def write_prompts(folder: Path, n: int = 8) -> Path:
    """``n`` image prompts in TRL's vision layout (a user turn with an image part and a question
    naming the record's number, the reference answer as an assistant turn, as the digits file
    has it), 12x12 squares cycling through four colours, and an ``answer`` column."""
    from PIL import Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    for name, rgb in COLOURS.items():
        Image.new("RGB", (12, 12), rgb).save(folder / "images" / f"{name}.png")
    names = list(COLOURS)
    rows = [{"messages": [{"role": "user", "content": [{"type": "image"},
                                                       {"type": "text", "text": f"Square {i}: which colour?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": names[i % 4]}]}],
             "images": [f"images/{names[i % 4]}.png"], "answer": names[i % 4]} for i in range(n)]
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def overrides(path: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["model=tiny_idefics3", "objective=grpo", "data=prompts", f"data.path={path}", "data.columns.prompt=messages",
            "data.val_fraction=0.25", "reward.functions=[answer]", "rollout.max_completion_length=4",
            "objective.num_generations=2", "trainer.global_batch_size=2", "trainer.micro_batch_size=1",
            "trainer.max_steps=2", "trainer.eval_every=0", "tracker=none", "trainer.progress_bar=false",
            "trainer.export_hf=false", "trainer.precision=fp32", f"run_dir={run_dir}", *extra]


def test_image_prompts_encode_with_their_pixels_tokens(tmp_path):
    """A prompt's ids are the chat template's generation prompt with the image placeholder
    expanded (Idefics3: 4 image tokens between its fake-image tokens), the reference answer's
    assistant turn left out; the sample keeps the absolute image path."""
    from llmtrain import data
    from llmtrain.common.images import processor_of
    from llmtrain.models.build import build_tokenizer

    path = write_prompts(tmp_path)
    cfg = make_cfg(overrides(path, tmp_path / "run"))
    tokenizer = build_tokenizer(cfg.model)
    splits = data.load_splits(cfg.data, tokenizer, 0, prompt_budget=256 - 4)
    sample = next(s for s in (splits.train[i] for i in range(len(splits.train))) if s["record"] == 1)
    assert sample["images"] == [str(tmp_path / "images" / "green.png")] and sample["answer"] == "green"
    assert list(sample["prompt_ids"]).count(processor_of(tokenizer).image_token_id) == 4
    text = tokenizer.decode(sample["prompt_ids"])
    assert text.startswith("<|im_start|>user\n<fake_token_around_image><global-img>" + "<image>" * 4)
    assert text.endswith("Square 1: which colour?<|im_end|>\n<|im_start|>assistant\n")  # no answer turn


def test_grpo_on_image_prompts_uses_the_pixels_in_generation_and_in_the_loss(tmp_path, monkeypatch):
    """Two steps of GRPO on image prompts (in process): completions are logged with the answer
    reward; the first loss's per-token log-probs equal a direct forward of the initial model on
    the same tokens with the prompt's pixels (1e-6), and not with another image's; the completions
    are what llmtrain's sampler draws from the initial model with those pixels and the rollout's seeds."""
    from llmtrain import data
    from llmtrain.common.images import processor_of
    from llmtrain.data.vision import image_tensors
    from llmtrain.models.build import build_model, build_tokenizer
    from llmtrain.objectives import grpo
    from llmtrain.objectives.preference import completion_token_logps
    from llmtrain.rollout.generate import Sampling, completion_seed, sample_group
    from llmtrain.trainer import train
    import zlib

    seen: list[dict] = []
    original = grpo.GRPO.loss_sums

    def recording(self, output, batch):
        if not seen:
            logps = completion_token_logps(output.detach().float() / self.temperature, batch["labels"])
            seen.append({**{k: v.detach().clone() for k, v in batch.items()}, "logps": logps})
        return original(self, output, batch)

    monkeypatch.setattr(grpo.GRPO, "loss_sums", recording)
    path, run = write_prompts(tmp_path), tmp_path / "run"
    cfg = make_cfg(overrides(path, run))
    train(cfg)
    logged = [json.loads(line) for line in (run / "completions" / "step_1.jsonl").read_text().splitlines()]
    # Two prompts a step (two micro-batches of one), two completions each, each scored by the answer reward.
    assert len(logged) == 4 and all(r["rewards"]["answer"] in (0.0, 1.0) for r in logged)
    assert logged[0]["record"] == logged[1]["record"]
    assert [turn["role"] for turn in logged[0]["prompt"]] == ["user"]  # the reference answer's turn left out
    assert logged[0]["prompt"][0]["content"][0]["type"] == "image"

    batch = seen[0]
    assert batch["pixel_values"].shape == (2, 1, 3, 16, 16)  # Idefics3: rows, images, channels, 16x16
    tokenizer = build_tokenizer(cfg.model)
    model = build_model(cfg.model, cfg.trainer.seed).eval()  # the weights of the first step's forward
    prompt_text = tokenizer.decode(batch["input_ids"][0])
    record = int(re.search(r"Square (\d+):", prompt_text).group(1))
    assert record == logged[0]["record"]
    colour = list(COLOURS)[record % 4]
    pixels = image_tensors(processor_of(tokenizer), [[str(tmp_path / "images" / f"{colour}.png")]] * 2)
    assert torch.equal(pixels["pixel_values"], batch["pixel_values"])
    mask = batch["labels"] != -100

    def direct(images: dict) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **images).logits
        return completion_token_logps(logits.float() / cfg.rollout.temperature, batch["labels"])

    assert (direct(pixels) - batch["logps"])[mask].abs().max() < 1e-6
    other = image_tensors(processor_of(tokenizer), [[str(tmp_path / "images" / f"{list(COLOURS)[(record + 1) % 4]}.png")]] * 2)
    assert (direct(other) - batch["logps"])[mask].abs().max() > 1e-4  # the pixels matter to the forward

    # Generation: the sampler with the prompt's pixels and the rollout's seeds draws these completions.
    prompt_len = int((batch["labels"][0] == -100).long().cumprod(0).sum())
    prompt_ids = batch["input_ids"][0, :prompt_len].tolist()
    key = record * 2**32 + zlib.crc32(str(prompt_ids).encode())
    seeds = [completion_seed(cfg.trainer.seed, 0, key, k) for k in range(2)]
    sampling = Sampling(temperature=float(cfg.rollout.temperature), max_new=4,
                        end_ids=frozenset(data.end_token_ids(cfg.data, tokenizer)),
                        suppress=frozenset([processor_of(tokenizer).image_token_id]))
    one = {k: v[:1] for k, v in pixels.items()}
    drawn = sample_group(model, prompt_ids, seeds, sampling, torch.device("cpu"), images=one)
    assert [c.ids for c in drawn] == [batch["labels"][k][mask[k]].tolist() for k in range(2)]


@pytest.mark.parametrize("override,message", [
    ("rollout.engine=tests.grpo_fixtures:FixedCompletions",
     "rollout.engine=tests.grpo_fixtures:FixedCompletions: image prompts (the data's images column) are sampled on "
     "the hf and vllm engines only, one sequence per row, single-turn, for now; rollout.engine=hf"),
    ("rollout.packing=true", "rollout.packing=true: image prompts"),
])
def test_image_prompts_on_another_engine_are_refused_in_one_line(tmp_path, override, message):
    from llmtrain.common.errors import ConfigError
    from llmtrain.trainer import train

    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=re.escape(message)):
        train(make_cfg(overrides(write_prompts(tmp_path), run, override)))
    assert not (run / "checkpoints").exists()


@pytest.mark.parametrize("model,parts,message", [
    ("tiny_llama", 1, "train.jsonl line 1: field 'images' holds 1 image(s), and the model is text-only (no image processor)"),
    ("tiny_idefics3", 2, "train.jsonl line 1: 2 image part(s) in the prompt but 1 path(s) in field 'images'"),
])
def test_bad_image_prompts_are_data_errors_naming_the_line(tmp_path, model, parts, message):
    from llmtrain import data
    from llmtrain.common.errors import DataError
    from llmtrain.models.build import build_tokenizer

    path = write_prompts(tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["messages"][0]["content"] = [{"type": "image"}] * parts + [{"type": "text", "text": "which colour?"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_cfg([a for a in overrides(path, tmp_path / "run") if not a.startswith("model=")] + [f"model={model}"])
    with pytest.raises(DataError, match=re.escape(message)):
        data.load_splits(cfg.data, build_tokenizer(cfg.model), 0, prompt_budget=256 - 4)


@pytest.mark.parametrize("model,image", [("tiny_idefics3", 261), ("tiny_gemma3", 262), ("tiny_qwen2vl", 262)])
def test_the_image_token_is_never_sampled(model, image):
    """A completion holding the image token would stand for an image without pixels (the model's
    forward refuses the batch: "Image features and image tokens do not match"): the sampler of an
    image-text model suppresses it, greedy or sampled, as transformers' SuppressTokensLogitsProcessor."""
    from llmtrain.models.build import build_tokenizer
    from llmtrain.rollout import build_sampler
    from llmtrain.rollout.generate import Sampling, choose

    def next_token(logits, sampling, generator):  # one row of the batched draw
        return int(choose(logits[None], sampling, [generator])[0])

    cfg = make_cfg([a for a in overrides(Path("unused.jsonl"), Path("run")) if not a.startswith("model=")]
                   + [f"model={model}"])
    sampler = build_sampler(cfg, build_tokenizer(cfg.model), [259])
    assert sampler.sampling.suppress == frozenset([image])  # Idefics3's <image>, Gemma 3's <image_soft_token>, Qwen2-VL's <|image_pad|>
    logits = torch.full((320,), -5.0)
    logits[image], logits[7] = 10.0, 1.0
    assert next_token(logits, sampler.sampling, None) == 7  # greedy: the best token that is not <image>
    drawn = {next_token(logits, sampler.sampling, torch.Generator().manual_seed(s)) for s in range(50)}
    assert image not in drawn and next_token(logits, Sampling(), None) == image


def test_qwen2vl_sampler_draws_the_greedy_tokens_of_transformers_generate(tmp_path):
    """tiny_qwen2vl: llmtrain's sampler (a group of 2 rows, the image's tensors repeated per row,
    a KV cache) decodes greedily the tokens ``generate`` gives on the processor's inputs: the
    decode steps after the prompt keep M-RoPE's positions (text positions shifted past the image's
    grid, ``rope_deltas``)."""
    from PIL import Image

    from llmtrain.common.images import processor_of
    from llmtrain.data.vision import image_tensors
    from llmtrain.models.build import build_model, build_tokenizer
    from llmtrain.rollout.generate import Sampling, sample_group

    Image.new("RGB", (40, 24), (200, 30, 30)).save(tmp_path / "wide.png")  # a 3x5 grid of tokens: not square
    cfg = make_cfg(["model=tiny_qwen2vl"])
    processor = processor_of(build_tokenizer(cfg.model))
    processor.image_processor.size = {"shortest_edge": 64, "longest_edge": 1024}  # data.max_pixels=1024's budget
    model = build_model(cfg.model, seed=3).eval()
    turn = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}
    prompt = processor.apply_chat_template([turn], add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[[Image.open(tmp_path / "wide.png")]], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 6, 10]]
    expected = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=257)
    pixels = image_tensors(processor, [[str(tmp_path / "wide.png")]])
    drawn = sample_group(model, inputs["input_ids"][0].tolist(), [None, None], Sampling(temperature=0, max_new=8),
                         torch.device("cpu"), images=pixels)
    assert [c.ids for c in drawn] == [expected[0, inputs["input_ids"].shape[1]:].tolist()] * 2
