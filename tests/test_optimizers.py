"""trainer.optimizer (llmtrain.engine.optimizers) against torch's own optimizers written out by
hand, their state sizes, and the refusals. The layouts (ddp, fsdp, tp) and resume on 2
processes are in tests/test_recipes.py (one shared launch)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import make_cfg
from llmtrain.common.errors import ConfigError
from llmtrain.engine.optimizers import MuonWithAdamW, build_optimizer


def tiny_llama(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(config)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        batch = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(step))
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("adjust_lr", ["match_rms_adamw", "original"])
def test_muon_equals_torch_muon_on_hidden_matrices_and_adamw_on_the_rest(adjust_lr):
    """5 steps of trainer.optimizer=muon equal torch.optim.Muon over the attention and MLP
    matrices plus torch.optim.AdamW over embeddings and head (decayed) and norms (not), the split
    of Moonlight's recipe written out by name; and a state_dict round trip after step 3
    (what a checkpoint stores) continues identically."""
    t = make_cfg(["trainer.optimizer=muon", f"trainer.muon.adjust_lr={adjust_lr}", "trainer.lr=0.02",
                  "trainer.muon.lr=0.05"]).trainer
    ours_model, ref_model = tiny_llama(), tiny_llama()
    ours = build_optimizer(ours_model, t)
    assert isinstance(ours, MuonWithAdamW)

    named = dict(ref_model.named_parameters())
    hidden = [p for n, p in named.items() if (".self_attn." in n or ".mlp." in n) and p.ndim == 2]
    lookups = [named["model.embed_tokens.weight"], named["lm_head.weight"]]
    norms = [p for n, p in named.items() if "norm" in n]
    assert len(hidden) + len(lookups) + len(norms) == len(named)
    muon = torch.optim.Muon(hidden, lr=0.05, weight_decay=t.weight_decay, momentum=t.muon.momentum,
                            nesterov=t.muon.nesterov, ns_steps=t.muon.ns_steps, adjust_lr_fn=adjust_lr)
    adamw = torch.optim.AdamW([{"params": lookups, "weight_decay": t.weight_decay},
                               {"params": norms, "weight_decay": 0.0}], lr=0.02, betas=(t.beta1, t.beta2), eps=t.eps)

    class Both:
        def step(self):
            muon.step()
            adamw.step()

        def zero_grad(self, set_to_none=True):
            muon.zero_grad(set_to_none)
            adamw.zero_grad(set_to_none)

    train(ours_model, ours, range(3))
    train(ref_model, Both(), range(3))
    # Resume from what a checkpoint holds: fresh model and optimizer, state loaded.
    resumed_model = copy.deepcopy(ours_model)
    resumed = build_optimizer(resumed_model, t)
    resumed.load_state_dict(copy.deepcopy(ours.state_dict()))
    train(ours_model, ours, range(3, 5))
    train(ref_model, Both(), range(3, 5))
    train(resumed_model, resumed, range(3, 5))
    start = tiny_llama()
    for (name, got), want, again, first in zip(ours_model.named_parameters(), ref_model.parameters(),
                                               resumed_model.parameters(), start.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
        assert torch.equal(again, got), name
        assert not torch.equal(got, first), name  # every parameter was updated
    assert int(ours.state[ours.param_groups[0]["params"][0]]["step"]) == 5


def test_muon_keeps_a_tied_embedding_with_adamw():
    model = tiny_llama(tie=True)
    optimizer = build_optimizer(model, make_cfg(["trainer.optimizer=muon"]).trainer)
    muon = {id(p) for g in optimizer.param_groups if g["use_muon"] for p in g["params"]}
    assert id(model.model.embed_tokens.weight) not in muon and len(muon) == 2 * 7


def state_bytes(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> int:
    return sum(v.numel() * v.element_size() for v in optimizer.state[param].values()
               if isinstance(v, torch.Tensor) and v.ndim > 0)


@pytest.mark.parametrize("name", ["adamw", "adafactor", "muon"])
def test_optimizer_state_bytes_per_parameter(name):
    """Measured state bytes (scalars such as the step count aside): AdamW 8 bytes per parameter;
    Adafactor rows + cols floats per matrix, one float per element of a vector; Muon one
    momentum buffer (4 bytes) per hidden-matrix element, AdamW's 8 on the rest."""
    model = tiny_llama()
    optimizer = build_optimizer(model, make_cfg([f"trainer.optimizer={name}"]).trainer)
    train(model, optimizer, range(1))
    named = dict(model.named_parameters())
    up, norm, embed = named["model.layers.0.mlp.up_proj.weight"], named["model.norm.weight"], named["lm_head.weight"]
    assert up.shape == (48, 32)
    want = {"adamw": (8 * 48 * 32, 8 * 32, 8 * 96 * 32),
            "adafactor": (4 * (48 + 32), 4 * 32, 4 * (96 + 32)),
            "muon": (4 * 48 * 32, 8 * 32, 8 * 96 * 32)}[name]
    assert (state_bytes(optimizer, up), state_bytes(optimizer, norm), state_bytes(optimizer, embed)) == want


def test_adafactor_is_torch_adafactor_with_decay_on_matrices_only():
    model = tiny_llama()
    t = make_cfg(["trainer.optimizer=adafactor", "trainer.adafactor.eps2=0.002"]).trainer
    optimizer = build_optimizer(model, t)
    assert type(optimizer) is torch.optim.Adafactor
    decays = {g["weight_decay"]: {p.ndim for p in g["params"]} for g in optimizer.param_groups}
    assert decays == {t.weight_decay: {2}, 0.0: {1}}
    assert optimizer.param_groups[0]["eps"] == (None, 0.002) and optimizer.param_groups[0]["lr"] == t.lr


@pytest.mark.parametrize("overrides,message", [
    (["trainer.optimizer=sgd"], "trainer.optimizer='sgd' must be one of adamw, adamw_8bit, adafactor, muon"),
    (["+recipe=zero2", "trainer.optimizer=muon"], "DeepSpeed's ZeRO-2 optimizer steps flat 1-D partitions"),
    (["+recipe=zero1", "trainer.optimizer=adamw_8bit"], "adamw_8bit runs on the torch engine"),
    (["+recipe=zero3", "trainer.optimizer=adafactor"], "engine=torch"),
    (["+recipe=fsdp", "trainer.optimizer=adafactor"], "adafactor with recipe fsdp"),
    (["+recipe=fsdp", "recipe.dp_shard=1", "recipe.cp=2", "trainer.optimizer=adafactor"], r"dp_shard 1, cp 2"),
    (["+recipe=tp", "engine=torch", "trainer.optimizer=adafactor"], "not FSDP2/TP shards"),
    (["trainer.muon.momentum=1.0"], "trainer.muon.momentum=1.0 must be in"),
    (["trainer.muon.ns_steps=0"], "trainer.muon.ns_steps=0"),
    (["trainer.muon.adjust_lr=none"], "trainer.muon.adjust_lr='none'"),
    (["trainer.adafactor.beta2_decay=0.5"], "trainer.adafactor.beta2_decay=0.5 must be <= 0"),
])
def test_bad_optimizer_settings_are_refused_by_name(overrides, message):
    from llmtrain.config.validate import validate

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("'", "'")):
        validate(make_cfg(overrides), world_size=2)


@pytest.mark.parametrize("name", ["adamw", "adafactor", "muon"])
def test_planner_counts_the_state_the_optimizer_holds(name):
    """The planner's optimizer bytes for the tiny model on one rank equal the state tensors the
    built optimizer holds after a step (fp32; step counters aside); on 2 FSDP2 ranks, half."""
    from llmtrain.models.build import build_model, model_config
    from llmtrain.planning.memory import plan_recipe

    cfg = make_cfg([f"trainer.optimizer={name}"])
    model = build_model(cfg.model, seed=0)
    optimizer = build_optimizer(model, cfg.trainer)
    batch = torch.randint(0, model.config.vocab_size, (2, 8))
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    held = sum(state_bytes(optimizer, p) for p in model.parameters())
    assert plan_recipe(cfg, 1, model_config(cfg.model)).optimizer == pytest.approx(held, rel=1e-6, abs=8)
    if name != "adafactor":  # adafactor keeps whole tensors (refused on FSDP2)
        fsdp = plan_recipe(make_cfg([f"trainer.optimizer={name}", "+recipe=fsdp"]), 2, model_config(cfg.model))
        assert fsdp.optimizer == pytest.approx(held / 2, rel=1e-6, abs=8)
        assert ("Muon: the largest matrix's update gathered whole (fp32 + bf16)" in fsdp.temporaries) == (name == "muon")


def test_adamw_8bit_stores_two_bytes_a_parameter_and_tracks_adamw():
    """torchao's AdamW8bit on a 512 x 512 matrix: 1 byte per element per moment plus an fp32 scale
    per 256-element block and a 256-entry code table (2.04 bytes per parameter against AdamW's 8);
    the planner counts the same; and 5 steps stay within 8-bit rounding of fp32 AdamW."""
    from llmtrain.planning.memory import optimizer_state_per_param

    t = make_cfg(["trainer.optimizer=adamw_8bit", "trainer.lr=0.01"]).trainer
    models = [torch.nn.Sequential(torch.nn.Linear(512, 512, bias=False)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    start = models[0][0].weight.detach().clone()
    low = build_optimizer(models[0], t)
    full = torch.optim.AdamW(models[1].parameters(), lr=0.01, betas=(t.beta1, t.beta2), eps=t.eps,
                             weight_decay=t.weight_decay)
    for step in range(5):
        x = torch.randn(16, 512, generator=torch.Generator().manual_seed(step))
        for model, optimizer in zip(models, (low, full)):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    weight = models[0][0].weight
    bytes_held = sum(t.numel() * t.element_size() for moment in ("exp_avg", "exp_avg_sq")
                     for t in (getattr(low.state[weight][moment], n) for n in ("codes", "scale", "qmap")))
    assert bytes_held == 2 * (512 * 512 + 4 * 1024 + 4 * 256)
    assert optimizer_state_per_param(models[0])[0]["adamw_8bit"] == pytest.approx(bytes_held / (512 * 512))
    moved, diff = (models[1][0].weight - start).abs().mean(), (weight - models[1][0].weight).abs().mean()
    assert moved > 0.02 and diff < 0.1 * moved, (float(moved), float(diff))
