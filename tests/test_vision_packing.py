"""Packed image-text rows (``data.packing=true``): several samples and their images in one row give
the unpacked samples' loss and gradients (fp32, within 1e-5) for tiny_idefics3, tiny_llava,
tiny_gemma3, tiny_qwen2vl and tiny_qwen2_5vl (through the data, the collator and the engine's
forward arguments), and for a tiny Qwen2-VL built here (M-RoPE positions computed per packed
sample by the family's hook)."""

from __future__ import annotations

import pytest
import torch

from test_vision import COLOURS, loaded, record, write_dataset


def mixed_records() -> list[dict]:
    """Ten records of 0, 1 or 2 images and answers of 3 to 15 bytes, so rows pack unevenly."""
    names = list(COLOURS)
    out = []
    for i in range(10):
        images = [f"images/{names[(i + k) % 4]}.png" for k in range(i % 3)]
        out.append(record(images, names[(i + 1) % 4] * (1 + i % 3), parts=len(images)))
    return out


def mean_loss_and_grads(model, batches: list[dict], inputs=None) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss over all target tokens of ``batches`` (sum / count, the objective's normaliser)
    and its gradients, one backward per micro-batch as gradient accumulation does; ``inputs``
    (default: the engine's ``model_inputs``) makes a batch's forward arguments."""
    from llmtrain.engine.base import model_inputs
    from llmtrain.objectives import CausalLM

    inputs = inputs or model_inputs
    objective = CausalLM()
    count = sum(objective.normaliser(b) for b in batches)
    model.zero_grad()
    total = 0.0
    for b in batches:
        loss = objective.loss_sums(model(**inputs(b)).logits, b).loss / count
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model", ["tiny_idefics3", "tiny_llava", "tiny_gemma3", "tiny_qwen2vl", "tiny_qwen2_5vl"])
def test_packed_rows_give_the_unpacked_loss_and_gradients(model, tmp_path):
    from llmtrain import data
    from llmtrain.models.build import build_model

    path = write_dataset(tmp_path, mixed_records())
    common = ("data.seq_len=256", "data.val_fraction=0.1")
    cfg, tokenizer, packed = loaded(model, path, "data.packing=true", *common)
    _, _, plain = loaded(model, path, *common)
    rows = [packed.train[i] for i in range(len(packed.train))]
    samples = [plain.train[i] for i in range(len(plain.train))]
    assert len(rows) < len(samples)
    # Each row's images are its samples' images, in the order of their tokens.
    by_ids = {tuple(s["input_ids"]): s["images"] for s in samples}
    with_images = 0
    for row in rows:
        starts = [k for k, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        members = [by_ids[tuple(row["input_ids"][a:b])] for a, b in zip(starts, starts[1:])]
        assert row["images"] == [image for member in members for image in member]
        with_images = max(with_images, sum(1 for member in members if member))
    assert with_images >= 2  # a row holds several samples' images
    collate = data.collator_for(cfg.data, tokenizer)
    net = build_model(cfg.model, seed=0)
    # Micro-batches of 2 rows (padding between them) against the samples 2 at a time.
    packed_loss, packed_grads = mean_loss_and_grads(net, [collate(rows[k:k + 2]) for k in range(0, len(rows), 2)])
    plain_loss, plain_grads = mean_loss_and_grads(net, [collate(samples[k:k + 2])
                                                        for k in range(0, len(samples), 2)])
    assert packed_loss == pytest.approx(plain_loss, abs=1e-5)
    assert packed_grads.keys() == plain_grads.keys()
    worst = max(float((packed_grads[n] - plain_grads[n]).abs().max()) for n in plain_grads)
    assert worst < 1e-5, worst


# A tiny Qwen2-VL: 2x2 patches, 2 frames a patch, 2x2 merge (4 patches a token); M-RoPE sections
# of the text heads' 4 rotary frequencies: 2 temporal, 1 height, 1 width.
IMAGE, START, END, VOCAB = 100, 98, 99, 128


def tiny_qwen2vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from llmtrain.models.packed_vision import packed_rows

    config = Qwen2VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=2, temporal_patch_size=2,
                           spatial_merge_size=2, in_channels=3),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=101)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).float()
    packed_rows(model)
    return model


def qwen_sample(generator: torch.Generator, text: int, grids: list[tuple[int, int, int]]) -> dict:
    """One hand-made Qwen2-VL sample: ``text`` random tokens, then per image ``<|vision_start|>``,
    ``t*h*w/4`` image tokens, ``<|vision_end|>`` and 3 more tokens; its pixel rows (one per
    2x2x2 patch of 3 channels: 24 values) and ``image_grid_thw``; labels on every token."""
    ids = torch.randint(0, 90, (text,), generator=generator).tolist()
    pixels = []
    for t, h, w in grids:
        ids += [START] + [IMAGE] * (t * h * w // 4) + [END] + torch.randint(0, 90, (3,), generator=generator).tolist()
        pixels.append(torch.randn(t * h * w, 24, generator=generator))
    return {"input_ids": torch.tensor(ids), "grids": grids, "pixels": pixels}


def qwen_batch(samples: list[dict], rows: list[list[int]]) -> dict:
    """Packed rows (each a list of sample indices), right-padded, positions from 0 per sample and
    for the padding, images in token order."""
    longest = max(sum(len(samples[i]["input_ids"]) for i in row) for row in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    positions = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    grids, pixels = [], []
    for r, row in enumerate(rows):
        t = 0
        for i in row:
            s = samples[i]["input_ids"]
            ids[r, t:t + len(s)], positions[r, t:t + len(s)] = s, torch.arange(len(s))
            labels[r, t + 1:t + len(s)] = s[1:]
            t += len(s)
            grids += samples[i]["grids"]
            pixels += samples[i]["pixels"]
        positions[r, t:] = torch.arange(longest - t)
    batch = {"input_ids": ids, "position_ids": positions, "labels": labels, "attention_mask": torch.ones_like(ids)}
    if pixels:
        batch.update(pixel_values=torch.cat(pixels), image_grid_thw=torch.tensor(grids))
    return batch


def test_qwen2vl_packed_rows_get_per_sample_mrope_positions_and_the_unpacked_loss(tmp_path):
    """Samples with 0, 1 and 2 images of several grids, packed 2-3 a row: each sample's logits
    equal its own forward's (the model computing its M-RoPE positions, ``get_rope_index``) within
    1e-5, and so do the loss and gradients; without the hook (1-D positions) they do not."""
    from llmtrain.engine.base import model_inputs

    model = tiny_qwen2vl()
    generator = torch.Generator().manual_seed(0)
    samples = [qwen_sample(generator, 5, [(1, 4, 4)]), qwen_sample(generator, 3, []),
               qwen_sample(generator, 4, [(1, 4, 6), (1, 2, 2)]), qwen_sample(generator, 6, [(1, 6, 4)]),
               qwen_sample(generator, 2, [])]
    rows = [[0, 1, 2], [3, 4]]
    batch = qwen_batch(samples, rows)
    alone = [qwen_batch(samples, [[i]]) for i in range(len(samples))]
    for b in alone:  # unpacked: the model derives M-RoPE from mm_token_type_ids, as its processor's inputs
        del b["position_ids"]
        b["mm_token_type_ids"] = (b["input_ids"] == IMAGE).int()
    with torch.no_grad():
        logits = model(**model_inputs(batch)).logits
        for r, row in enumerate(rows):
            t = 0
            for i in row:
                own = model(**own_inputs(alone[i])).logits[0]
                assert torch.allclose(logits[r, t:t + len(own)], own, atol=1e-5), (r, i)
                t += len(own)
    packed_loss, packed_grads = mean_loss_and_grads(model, [batch])
    plain_loss, plain_grads = mean_loss_and_grads(model, alone, own_inputs)
    assert packed_loss == pytest.approx(plain_loss, abs=1e-5)
    assert max(float((packed_grads[n] - plain_grads[n]).abs().max()) for n in plain_grads) < 1e-5
    model._forward_pre_hooks.clear()  # 1-D positions only: the images' tokens are placed wrongly
    with torch.no_grad():
        flat = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"][None].expand(4, -1, -1),
                     pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"]).logits
    assert not torch.allclose(flat, logits, atol=1e-3)


def own_inputs(batch: dict) -> dict:
    """A lone Qwen2-VL sample's forward arguments as its processor gives them (no positions: the
    model computes M-RoPE from ``mm_token_type_ids``)."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")
            if k in batch}


def test_packing_images_of_another_family_is_refused_naming_its_processor():
    from types import SimpleNamespace

    from llmtrain.common.errors import ConfigError
    from llmtrain.common.images import attach
    from llmtrain.data.vision import refuse_packing

    class MllamaProcessor:
        pass

    tokenizer = attach(SimpleNamespace(), MllamaProcessor())
    said = (r"^data.packing=true: image-text samples are packed for Idefics3, LLaVA, Gemma 3, Qwen2-VL, Qwen2.5-VL "
            r"models only, not this model's MllamaProcessor")
    with pytest.raises(ConfigError, match=said):
        refuse_packing(SimpleNamespace(packing=True), tokenizer)
    refuse_packing(SimpleNamespace(packing=False), tokenizer)
