"""The memory planner on an image-text model: the vision tower's weights and the bytes it saves for
backward, and the image tokens one image becomes at the processor's pixel budget, against a
measured one-process step of tiny_idefics3 and tiny_llava."""

from __future__ import annotations

import pytest
import torch

from conftest import make_cfg
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
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage()._cdata not in params:
            seen.setdefault(t.untyped_storage()._cdata, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = CausalLM().loss_sums(model(**model_inputs(batch)).logits, batch).loss
    loss.backward()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    optimizer.step()
    states = sum(p.numel() * 4 for p in model.parameters())
    states += sum(p.grad.numel() * 4 for p in model.parameters() if p.grad is not None)
    states += sum(v.numel() * v.element_size() for s in optimizer.state.values() for k, v in s.items() if k != "step")
    return states, sum(seen.values()), batch["input_ids"].shape[1]


@pytest.mark.parametrize("model", ["tiny_idefics3", "tiny_llava", "tiny_gemma3"])
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
               and "multi_modal_projector" not in n)
    assert plan.vision.params == sum(p.numel() for p in full.parameters()) - text
    assert plan.vision.image_tokens == IMAGE_TOKENS[model]
    planned_states = plan.params + plan.grads + plan.optimizer
    unused = set(parts.unused_parameters(full))
    frozen = sum(p.numel() for n, p in full.named_parameters() if n in unused)
    assert frozen > 0 if model != "tiny_idefics3" else frozen == 0
    # The plan counts every parameter as trained; the parameters frozen as unused (tiny_llava's
    # post_layernorm, tiny_gemma3's SigLIP head) have no gradient or AdamW state (12 bytes an element).
    assert abs((planned_states - 12 * frozen) / states - 1) < 0.02, (planned_states, states)
    assert abs(plan.activations / saved - 1) < 0.30, (plan.activations, saved)
    without = plan.activations - micro * plan.vision.saved_per_image
    assert abs(without / saved - 1) > abs(plan.activations / saved - 1)  # the tower's share brings it closer
