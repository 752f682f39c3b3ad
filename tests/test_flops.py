"""Model FLOPs per token (PaLM appendix B), for full and partial (LoRA) training, and MFU."""

from __future__ import annotations

import pytest
import torch

from conftest import make_cfg
from llmtrain.models import adapters
from llmtrain.planning import flops
from llmtrain.models.build import build_model, model_config

# tiny_llama: hidden 128, intermediate 352, 4 layers, 4 heads of 32, 2 KV heads, vocab 320, tied.
H, I, L, HEADS, KV, V = 128, 352, 4, 4, 2, 320
PER_LAYER = H * H + 2 * H * (KV * H // HEADS) + H * H + 3 * H * I + 2 * H  # q, k, v, o, MLP, two norms
MATMUL = L * PER_LAYER + H + V * H  # final norm, and the tied output projection (a matmul)


def test_full_training_flops_are_six_per_matmul_parameter_plus_attention():
    hf_config = model_config(make_cfg([]).model)
    assert flops.parameter_counts(hf_config) == (L * PER_LAYER + H + V * H, V * H)  # tied: counted once
    assert flops.flops_per_token(hf_config, 64) == 6 * MATMUL + 12 * L * HEADS * (H // HEADS) * 64


def test_untied_output_projection_counts_and_the_embedding_lookup_does_not():
    hf_config = model_config(make_cfg(["model.architecture.tie_word_embeddings=false"]).model)
    total, embedding = flops.parameter_counts(hf_config)
    assert (total, embedding) == (L * PER_LAYER + H + 2 * V * H, V * H)
    assert flops.flops_per_token(hf_config, 64) == 6 * MATMUL + 12 * L * H * 64


def test_lora_counts_frozen_weights_four_and_adapters_six():
    cfg = make_cfg(["+peft=lora"])
    model = build_model(cfg.model, 0)
    adapters.apply(model, cfg)
    frozen, adapter = flops.partial_training_counts(model)
    assert frozen == MATMUL  # the whole base, with the tied projection; not the embedding lookup twice
    r = cfg.peft.r  # all-linear: q, k, v, o, gate, up, down, each A (r x in) + B (out x r)
    kv = KV * H // HEADS
    per_layer = r * ((H + H) + (H + kv) * 2 + (H + H) + (H + I) * 2 + (I + H))
    assert adapter == L * per_layer
    hf_config = model_config(cfg.model)
    assert flops.flops_per_token(hf_config, 64, frozen, adapter) == 4 * MATMUL + 6 * adapter + 12 * L * H * 64


def test_mfu_needs_a_peak_and_tflops_are_per_device():
    got = flops.achieved(tokens_per_s=1e4, flops_per_token=3e9, world_size=4, peak=None)
    assert got == {"perf/tflops_per_device": pytest.approx(7.5)}
    got = flops.achieved(tokens_per_s=1e4, flops_per_token=3e9, world_size=4, peak=15.0)
    assert got["perf/mfu"] == pytest.approx(0.5)
    assert flops.peak_tflops(torch.device("meta"), "bf16") is None  # no rule: no MFU (CPUs: tests/test_mfu.py)
    assert flops.peak_tflops(torch.device("cpu"), "bf16", configured=312.0).tflops == 312.0
