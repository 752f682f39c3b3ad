"""QLoRA's 4-bit base (``model.quantize=nf4``, :mod:`llmtrain.models.quantize`) in one process:
the stored weights are QLoRA's NF4 (the paper's code values, blockwise absmax, the error bound
that follows), the bytes are half a byte per weight plus the scales, and a QLoRA model computes
exactly what a LoRA model on the dequantized base computes (forward and adapter gradients).
The layouts, checkpoints, resume and exports are in test_lora.py and test_resume.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import make_cfg
from llmtrain.common.errors import ConfigError
from llmtrain.config.validate import validate
from llmtrain.models import adapters
from llmtrain.models.build import build_model, count_parameters
from llmtrain.models.quantize import NF4Linear, dequantize_model, quantize_base, round_trip

# The 16 NF4 values: QLoRA (Dettmers et al. 2023) Appendix E / bitsandbytes' NF4 table, to 4 digits.
NF4_PAPER = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609, 0.2461, 0.3379,
             0.4407, 0.5626, 0.7230, 1.0]


def test_stored_weights_are_nf4_codes_of_blockwise_absmax_within_half_a_code_gap():
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True)
    layer = NF4Linear(linear)
    w, got = linear.weight.detach(), layer.dequantized()
    blocks, got_blocks = w.reshape(-1, 64), got.reshape(-1, 64)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    # Every dequantized weight is one of the 16 NF4 values times its block's (double-quantized) scale.
    codes = got_blocks / got_blocks.abs().amax(dim=1, keepdim=True)
    table = torch.tensor(NF4_PAPER)
    assert (codes.unsqueeze(-1) - table).abs().min(dim=-1).values.max() < 1e-3
    # Round to the nearest code: error <= half the widest gap (-1 .. -0.6962) x absmax, plus the
    # scale's own 8-bit quantization (<= its block's spread / 255).
    bound = absmax * (1 - 0.6962) / 2 + (absmax.max() - absmax.min()) / 255 + 1e-6
    assert ((blocks - got_blocks).abs() <= bound).all()
    assert (blocks - got_blocks).abs().mean() < 0.1 * absmax.mean()
    # The bias stays as it is; y = x W^T + b with the dequantized W.
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer(x), x @ got.T + linear.bias, rtol=0, atol=1e-5)


def test_bytes_are_half_a_byte_per_weight_plus_the_scales():
    linear = nn.Linear(1024, 512, bias=False)
    for storage in (torch.float32, torch.bfloat16):
        layer = NF4Linear(linear, storage)
        n = 1024 * 512
        assert layer.weight_nf4.dtype == storage and not layer.weight_nf4.requires_grad
        assert layer.weight_nf4.numel() * layer.weight_nf4.element_size() == n // 2
        assert layer.nf4_scalers.numel() * layer.nf4_scalers.element_size() == n // 64  # int8 per block of 64
        assert layer.nf4_factors.numel() == 4 * n // (64 * 256)  # fp32 per 256 scales, as bytes
        assert [k for k, _ in layer.named_parameters()] == ["weight_nf4"]
        assert list(layer.state_dict()) == ["weight_nf4"]  # the constants are rebuilt, never checkpointed
        torch.testing.assert_close(layer.dequantized(), NF4Linear(linear).dequantized(), rtol=0, atol=0)


def _lora(model, cfg):
    return adapters.apply(model, cfg)


def test_qlora_computes_what_lora_on_the_dequantized_base_computes():
    cfg = make_cfg(["+peft=qlora", "peft.r=4", "peft.target_modules=all-linear"])
    plain = build_model(cfg.model, cfg.trainer.seed)
    qlora = copy.deepcopy(plain)
    # Every decoder Linear of the 4 layers (q, o 128x128; k, v 64x128; gate, up, down 128x352); not the head.
    assert quantize_base(qlora, cfg) == 4 * (2 * 128 * 128 + 2 * 64 * 128 + 3 * 128 * 352)
    on_dequantized = dequantize_model(copy.deepcopy(qlora))
    for model in (plain, qlora, on_dequantized):
        _lora(model, cfg)
        with torch.no_grad():  # B != 0 so that the adapters take part
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.full_like(p, 0.01))
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    losses, grads = {}, {}
    for key, model in (("plain", plain), ("qlora", qlora), ("dequantized", on_dequantized)):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses[key] = out.loss.item()
        grads[key] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert losses["qlora"] == pytest.approx(losses["dequantized"], abs=1e-6)
    for name, g in grads["qlora"].items():
        torch.testing.assert_close(g, grads["dequantized"][name], rtol=1e-5, atol=1e-7)
    # Against the full-precision base the 4-bit rounding shows, within its scale: relative loss
    # difference ~1e-3 on this random-init model (weights N(0, 0.02), per-block error <= 15% of absmax).
    assert 0 < abs(losses["qlora"] - losses["plain"]) < 1e-2 * losses["plain"]
    trainable, total = adapters.summary(qlora)
    assert total == count_parameters(plain) == adapters.summary(plain)[1]  # 4-bit weights count as weights
    assert trainable == adapters.summary(plain)[0]


def test_round_trip_leaves_the_head_embeddings_and_modules_to_save_whole():
    cfg = make_cfg(["model=tiny_qwen2", "+peft=qlora", "peft.modules_to_save=[lm_head]"])
    initial = build_model(cfg.model, cfg.trainer.seed).state_dict()
    state = round_trip(build_model(cfg.model, cfg.trainer.seed), cfg).state_dict()
    assert state.keys() == initial.keys()
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias",
                 "model.norm.weight"):
        assert torch.equal(state[name], initial[name]), name
    assert not torch.equal(state["model.layers.0.mlp.up_proj.weight"], initial["model.layers.0.mlp.up_proj.weight"])
    none = make_cfg(["model=tiny_qwen2", "+peft=lora"])
    assert all(torch.equal(v, initial[k]) for k, v in round_trip(build_model(none.model, 1234), none).state_dict().items())


@pytest.mark.parametrize("overrides,needle", [
    (["model.quantize=nf4"], "add +peft=lora"),
    (["model.quantize=int3", "+peft=lora"], "model.quantize='int3' must be one of none, nf4"),
    (["+peft=qlora", "engine=torch", "recipe.fp8=true", "recipe.fp8_emulate=true"], "model.quantize=nf4 with recipe.fp8"),
    (["+peft=qlora", "+recipe=tp"], "+peft=qlora with recipe tp (recipe.tp=-1, recipe.pp=1): LoRA runs on the "
                                    "data-parallel recipes"),
    (["+peft=qlora", "objective=dpo", "objective.reference=copy", "data=preference", "data.path=x.jsonl"],
     "objective.reference=copy with model.quantize=nf4"),
])
def test_bad_quantize_settings_are_refused_naming_the_field(overrides, needle):
    with pytest.raises(ConfigError, match=None) as err:
        validate(make_cfg(overrides), world_size=2)
    assert needle in str(err.value)


@pytest.mark.parametrize("model", ["tiny_idefics3", "tiny_gemma3"])
def test_qlora_on_an_image_text_model_quantizes_the_language_model_only_and_computes_lora_on_its_dequantized_base(
        model, tmp_path):
    """+peft=qlora on an image-text model: every Linear of the language model but the head is NF4,
    the vision tower and projector stay whole (LLaVA's QLoRA recipe); with adapters on the
    language model and the (full-precision) tower, the loss of a batch with images and the
    adapters' gradients are those of LoRA on the dequantized base, and the image counts."""
    from test_vision import loaded, write_dataset

    from llmtrain import data
    from llmtrain.engine.base import model_inputs

    cfg, tokenizer, splits = loaded(model, write_dataset(tmp_path), "+peft=qlora", "peft.parts=[language,vision]")
    plain = build_model(cfg.model, cfg.trainer.seed)
    language = plain.get_decoder()
    linears = sum(m.weight.numel() for m in language.modules() if type(m) is nn.Linear)
    qlora = copy.deepcopy(plain)
    assert quantize_base(qlora, cfg) == linears > 0
    inside = {id(m) for m in qlora.get_decoder().modules()}
    assert {id(m) for m in qlora.modules() if isinstance(m, NF4Linear)} <= inside
    whole = {n: p for n, p in qlora.named_parameters() if not n.startswith(_prefix(qlora, qlora.get_decoder()))}
    assert any("vision" in n for n in whole)
    reference = dict(plain.named_parameters())
    assert all(torch.equal(p, reference[n]) for n, p in whole.items())  # the tower and projector untouched
    on_dequantized = dequantize_model(copy.deepcopy(qlora))
    batch = data.collator_for(cfg.data, tokenizer)([splits.train[i] for i in range(2)])
    assert "pixel_values" in batch
    losses, grads = {}, {}
    for key, net in (("qlora", qlora), ("dequantized", on_dequantized)):
        _lora(net, cfg)
        with torch.no_grad():  # B != 0 so that the adapters take part
            for name, p in net.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.full_like(p, 0.01))
        out = net(**model_inputs(batch), labels=batch["labels"])
        out.loss.backward()
        losses[key] = out.loss.item()
        grads[key] = {n: p.grad for n, p in net.named_parameters() if p.requires_grad}
    assert any("vision" in n for n in grads["qlora"]) and any(n.startswith(_prefix(qlora, qlora.get_decoder()))
                                                               for n in grads["qlora"])
    assert losses["qlora"] == pytest.approx(losses["dequantized"], abs=1e-6)
    for name, g in grads["qlora"].items():
        torch.testing.assert_close(g, grads["dequantized"][name], rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        other = qlora(**model_inputs(dict(batch, pixel_values=batch["pixel_values"] + 0.5)), labels=batch["labels"])
    assert abs(other.loss.item() - losses["qlora"]) > 1e-5


def _prefix(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module) + "."


def test_a_qlora_run_on_image_text_data_trains_and_exports_a_loadable_merged_model(tmp_path):
    """One process, 4 steps of +peft=qlora on tiny_idefics3 with images: the loss falls, and the
    merged export (adapters merged into the dequantized language model) loads with
    AutoModelForImageTextToText, its vision tower the initial one bit for bit (never quantized)."""
    from transformers import AutoModelForImageTextToText

    from conftest import FAST, assert_ok, read_metrics, run_cli
    from test_vision import write_dataset

    run = tmp_path / "run"
    path = write_dataset(tmp_path, n=16)
    assert_ok(run_cli(["model=tiny_idefics3", "data=vlm_chat", f"data.path={path}", *FAST, "+peft=qlora",
                       "trainer.max_steps=4", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
                       "trainer.lr=1e-2", "trainer.warmup_steps=1", "trainer.export_merged=true", f"run_dir={run}"]))
    rows = [r for r in read_metrics(run) if "train/loss" in r]
    assert len(rows) == 4 and rows[-1]["train/loss"] < rows[0]["train/loss"], [r["train/loss"] for r in rows]
    merged = AutoModelForImageTextToText.from_pretrained(run / "hf")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    cfg = make_cfg(["model=tiny_idefics3"])
    initial = build_model(cfg.model, cfg.trainer.seed).state_dict()
    exported = merged.state_dict()
    tower = [k for k in initial if k.startswith("model.vision_model.") and k in exported]
    assert tower and all(torch.equal(exported[k], initial[k]) for k in tower)  # LoRA on the language model only
    q = "model.text_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(exported[q], initial[q])
