"""The memory planner on an image-text model: the vision tower's weights and the bytes it saves for
backward, and the image tokens one image becomes at the processor's pixel budget, against a
measured one-process step of tiny_idefics3 and tiny_llava."""

from __future__ import annotations

import pytest
import torch

from conftest import make_cfg
from test_plan import saved_storages
from test_vision import IMAGE_TOKENS, write_dataset


def measured_step(cfg, micro: int) -> tuple[int, int, int]:
    """(bytes of parameters + gradients + AdamW state after one optimizer step, peak bytes saved
    for backward by one micro-batch of ``micro`` image samples, its padded length) of the model
    as the trainer builds it (the blank-image hooks included), fp32 on CPU."""
    from llmtrain import data
    from llmtrain.engine.base import model_inputs
    from llmtrain.models.blank_image import keep_tower_in_every_forward
    from llmtrain.models.build import build_model, build_tokenizer
    from llmtrain.objectives import CausalLM

    tokenizer = build_tokenizer(cfg.model)
    splits = data.load_splits(cfg.data, tokenizer, seed=0)
    batch = data.collator_for(cfg.data, tokenizer)([splits.train[i] for i in range(micro)])
    model = keep_tower_in_every_forward(build_model(cfg.model, seed=0), tokenizer).train()
    for name in cfg.model.get("freeze") or []:  # tiny_llava's unused post_layernorm
        for n, p in model.named_parameters():
            p.requires_grad_(p.requires_grad and not __import__("fnmatch").fnmatchcase(n, name))
    with saved_storages(model) as seen:
        loss = CausalLM().loss_sums(model(**model_inputs(batch)).logits, batch).loss
    loss.backward()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    optimizer.step()
    states = sum(p.numel() * 4 for p in model.parameters())
    states += sum(p.grad.numel() * 4 for p in model.parameters() if p.grad is not None)
    states += sum(v.numel() * v.element_size() for s in optimizer.state.values() for k, v in s.items() if k != "step")
    return states, sum(seen.values()), batch["input_ids"].shape[1]


@pytest.mark.parametrize("model", ["tiny_idefics3", "tiny_llava", "tiny_gemma3", "tiny_qwen2vl", "tiny_qwen2_5vl"])
def test_the_plan_counts_the_tower_and_matches_a_measured_step(model, tmp_path):
    """Model states (parameters, gradients, AdamW) within 2% of the measured bytes, and the bytes
    saved for backward within 30% (the planner's bound for activations, docs/planning.md); the
    tower's parameters are what the model holds outside its language model, and one image is the
    preset's image tokens."""
    from llmtrain.models import parts
    from llmtrain.models.build import build_model
    from llmtrain.planning.memory import plan_recipe

    micro = 4
    path = write_dataset(tmp_path, n=8)
    base = [f"model={model}", "data=vlm_chat", f"data.path={path}", "data.val_fraction=0.25", "+recipe=ddp",
            f"trainer.micro_batch_size={micro}", f"trainer.global_batch_size={micro}"]
    states, saved, length = measured_step(make_cfg(base + ["data.seq_len=256"]), micro)
    plan = plan_recipe(make_cfg(base + [f"data.seq_len={length}"]), 1)  # the planner pads to data.seq_len
    full = build_model(make_cfg(base).model, seed=0)
    text = sum(p.numel() for n, p in full.named_parameters() if ".vision" not in n and "connector" not in n
               and "multi_modal_projector" not in n and ".visual." not in n)
    assert plan.vision.params == sum(p.numel() for p in full.parameters()) - text
    assert plan.vision.image_tokens == IMAGE_TOKENS[model]
    planned_states = plan.params + plan.grads + plan.optimizer
    unused = set(parts.unused_parameters(full))
    frozen = sum(p.numel() for n, p in full.named_parameters() if n in unused)
    assert frozen > 0 if model in ("tiny_llava", "tiny_gemma3") else frozen == 0
    # The plan counts every parameter as trained; the parameters frozen as unused (tiny_llava's
    # post_layernorm, tiny_gemma3's SigLIP head) have no gradient or AdamW state (12 bytes an element).
    assert abs((planned_states - 12 * frozen) / states - 1) < 0.02, (planned_states, states)
    assert abs(plan.activations / saved - 1) < 0.30, (plan.activations, saved)
    without = plan.activations - micro * plan.vision.saved_per_image
    assert abs(without / saved - 1) > abs(plan.activations / saved - 1)  # the tower's share brings it closer


def test_qwen2vl_plans_its_image_tokens_from_max_pixels_and_its_tower_by_blocks(tmp_path):
    """tiny_qwen2vl: one image at the budget is 4 tokens (256 pixels: 16x16, 4x4 patches merged
    2x2) and 16 at data.max_pixels=1024 (32x32), with more bytes saved for backward; the saved
    bytes of a 3-block tower, extrapolated from 1 and 2 blocks (Qwen2-VL's tower cannot run on
    fake tensors), equal a real run of 3 blocks."""
    from llmtrain.models.build import model_config
    from llmtrain.planning.memory import plan_recipe
    from llmtrain.planning.vision import _SavedBytes, _saved_by_blocks

    path = write_dataset(tmp_path, n=8)
    base = ["model=tiny_qwen2vl", "data=vlm_chat", f"data.path={path}", "+recipe=ddp", "data.seq_len=64",
            "trainer.micro_batch_size=2", "trainer.global_batch_size=2"]
    small, large = (plan_recipe(make_cfg(base + extra), 1).vision for extra in ([], ["data.max_pixels=1024"]))
    assert (small.image_tokens, small.budget, large.image_tokens, large.budget) == (4, (16, 16), 16, (32, 32))
    assert large.saved_per_image > 2 * small.saved_per_image

    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    vision = model_config(make_cfg(base).model).vision_config
    vision.depth = 3
    pixels = {"pixel_values": torch.randn(64, 96), "image_grid_thw": torch.tensor([[1, 8, 8]])}
    tower = Qwen2VisionTransformerPretrainedModel._from_config(vision).train()
    saved = _SavedBytes(tower)
    with saved.hooks("fp32"):
        tower(pixels["pixel_values"], grid_thw=pixels["image_grid_thw"])
    assert _saved_by_blocks(Qwen2VisionTransformerPretrainedModel, vision, pixels, "fp32") == saved.total() > 0
