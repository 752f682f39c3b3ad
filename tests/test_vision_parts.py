"""What trains in an image-text model: ``model.freeze`` by part (vision, projector, language,
lm_head), ``model.lr_multipliers`` as optimizer groups, the parameters a family never reads
frozen (checked against autograd), and a LLaVA stage-1 run (projector only) that resumes."""

from __future__ import annotations

import pytest
import torch

from conftest import FAST, assert_ok, make_cfg, read_metrics, run_cli
from test_vision import loaded, write_dataset


def built(model: str, *extra: str):
    """(config, model with ``adapters.apply`` done) for ``model`` with the overrides ``extra``."""
    from llmtrain.models import adapters
    from llmtrain.models.build import build_model

    cfg = make_cfg([f"model={model}", "data=vlm_chat", "data.path=unused", *extra])
    return cfg, adapters.apply(build_model(cfg.model, seed=0), cfg)


def tiny_configs() -> dict:
    """Tiny transformers configs of the families without a preset (Qwen2-VL, Qwen2.5-VL, Gemma 3)."""
    import transformers

    text = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)
    mrope = dict(text, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    return {
        "qwen2_vl": transformers.Qwen2VLConfig(
            text_config=mrope, image_token_id=300,
            vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4, spatial_merge_size=2)),
        "qwen2_5_vl": transformers.Qwen2_5_VLConfig(
            text_config=mrope, image_token_id=300,
            vision_config=dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                               patch_size=4, spatial_merge_size=2, fullatt_block_indexes=[1])),
        "gemma3": transformers.Gemma3Config(
            text_config=dict(text, model_type="gemma3_text"), mm_tokens_per_image=4, image_token_index=300,
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                               image_size=16, patch_size=4)),
    }


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "gemma3"])
def test_every_parameter_of_a_family_lies_in_one_named_part(family):
    """Each parameter falls in a part by its module (not by a guess that happens to match), and
    each of the family's parts holds parameters."""
    from transformers import AutoModelForImageTextToText

    from llmtrain.models import parts

    model = AutoModelForImageTextToText.from_config(tiny_configs()[family])
    fam = parts.known_family(model)
    modules = {"vision": "visual" if family.startswith("qwen") else "vision_tower",
               "language": "language_model"}
    seen = {}
    for name, _ in model.named_parameters():
        part = fam.part_of(name)
        seen.setdefault(part, []).append(name)
        if ".merger." in name or "multi_modal_projector" in name:
            assert part == "projector", name
        elif name.startswith("lm_head."):
            assert part == "lm_head", name
        else:
            assert part is not None and modules[part] in name.split("."), name
    assert set(seen) >= {"vision", "projector", "language"}
    unused = parts.unused_parameters(model)
    assert all(n.startswith("model.vision_tower.head.") for n in unused) and (family == "gemma3") == bool(unused)


@pytest.mark.parametrize("model,extra", [("tiny_idefics3", []), ("tiny_llava", []), ("tiny_gemma3", []),
                                         ("tiny_qwen2vl", []), ("tiny_qwen2_5vl", []),
                                         ("tiny_llava", ["model.architecture.vision_feature_layer=-2"])])
def test_the_parameters_frozen_as_unused_are_those_autograd_leaves_without_a_gradient(model, extra, tmp_path):
    """The family's rule (LLaVA: the tower's post_layernorm and the layers after the one read)
    against autograd: a backward of the loss through every part reaches exactly the others."""
    from llmtrain import data
    from llmtrain.engine.base import model_inputs
    from llmtrain.models import parts
    from llmtrain.models.build import build_model

    cfg, tokenizer, splits = loaded(model, write_dataset(tmp_path), *extra)
    batch = data.collator_for(cfg.data, tokenizer)([splits.train[0], splits.train[1]])
    net = build_model(cfg.model, seed=0)
    net(**model_inputs(batch), labels=batch["labels"]).loss.backward()
    no_grad = sorted(n for n, p in net.named_parameters() if p.grad is None)
    assert sorted(parts.unused_parameters(net)) == no_grad
    # Gemma 3: SigLIP's attention-pooling head, 11 tensors (probe, attention 4, layernorm 2, mlp 4).
    expected = {"tiny_idefics3": 0, "tiny_llava": 2, "tiny_gemma3": 11, "tiny_qwen2vl": 0,
                "tiny_qwen2_5vl": 0}[model] + (16 if extra else 0)  # a CLIP layer: 16
    assert len(no_grad) == expected
    _, applied = built(model, *extra)
    assert sorted(n for n, p in applied.named_parameters() if not p.requires_grad) == no_grad


@pytest.mark.parametrize("model", ["tiny_idefics3", "tiny_llava", "tiny_qwen2vl"])
def test_frozen_parts_stay_bit_identical_and_each_part_gets_its_learning_rate(model, tmp_path):
    """model.freeze=[vision] and lr multipliers {projector: 0.1, lm_head: 3}: the optimizer's groups
    hold each part at trainer.lr times its multiplier (lm_head's own over language's 1), frozen
    weights get no gradient and no optimizer state and are bit-identical after 3 AdamW steps, and
    every trainable tensor moved."""
    from llmtrain import data
    from llmtrain.engine.base import model_inputs
    from llmtrain.engine.optimizers import build_optimizer
    from llmtrain.models import parts

    cfg, net = built(model, "model.freeze=[vision]", "model.lr_multipliers={projector: 0.1, lm_head: 3}",
                     "trainer.lr=0.01", "trainer.weight_decay=0")
    _, tokenizer, splits = loaded(model, write_dataset(tmp_path))
    batch = data.collator_for(cfg.data, tokenizer)([splits.train[i] for i in range(4)])
    optimizer = build_optimizer(net, cfg.trainer, model_cfg=cfg.model)
    family = parts.known_family(net)
    names = {id(p): n for n, p in net.named_parameters()}
    expected = {"projector": 0.001, "lm_head": 0.03, "language": 0.01}
    for group in optimizer.param_groups:
        for p in group["params"]:
            assert group["lr"] == pytest.approx(expected[family.part_of(names[id(p)])]), names[id(p)]
    grouped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    vision = {n for n in names.values() if family.part_of(n) == "vision"}
    assert vision and all(names[i] not in vision for i in grouped)
    assert {names[i] for i in grouped} == {n for n, p in net.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    for _ in range(3):
        optimizer.zero_grad()
        net(**model_inputs(batch), labels=batch["labels"]).loss.backward()
        optimizer.step()
    for name, p in net.named_parameters():
        if name in vision:
            assert p.grad is None and p not in optimizer.state and torch.equal(p, before[name]), name
        elif p.requires_grad:
            assert not torch.equal(p, before[name]), name


def test_unknown_parts_and_a_zero_multiplier_are_one_line_errors(tmp_path):
    from llmtrain.common.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model.freeze: 'tower' is not a part of a llava model; its parts are "
                                          r"vision, projector, language, lm_head$"):
        built("tiny_llava", "model.freeze=[tower]")
    with pytest.raises(ConfigError, match=r"^model.freeze: part 'lm_head' has no parameters of its own in this model"):
        built("tiny_llama", "model.freeze=[lm_head]", "model.architecture.tie_word_embeddings=true")
    with pytest.raises(ConfigError, match=r"^model.lr_multipliers: 'vision' is not a part of a llama model; its "
                                          r"parts are language, lm_head$"):
        from llmtrain.engine.optimizers import build_optimizer

        cfg, net = built("tiny_llama", "model.lr_multipliers={vision: 0.5}")
        build_optimizer(net, cfg.trainer, model_cfg=cfg.model)
    path = write_dataset(tmp_path)
    for override, line in [("model.freeze=[tower]", "llmtrain: error: model.freeze: 'tower' is not a part of a llava "
                            "model; its parts are vision, projector, language, lm_head"),
                           ("model.lr_multipliers.vision=0", "llmtrain: error: model.lr_multipliers.vision=0.0 must be "
                            "a number > 0 (to keep a part unchanged, freeze it: model.freeze=[vision])"),
                           ("model.lr_multipliers.tower=2", "llmtrain: error: model.lr_multipliers.tower is not a "
                            "field of model.lr_multipliers: the fields are vision, projector, language, lm_head. Fix or "
                            "remove it (`python -m llmtrain --help` lists the groups and fields)")]:
        proc = run_cli(["model=tiny_llava", "data=vlm_chat", f"data.path={path}", *FAST, override,
                        f"run_dir={tmp_path / 'run'}"])
        assert proc.returncode == 2 and proc.stderr.splitlines() == [line], proc.stderr[-2000:]
        assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_llava_stage_one_trains_the_projector_only_and_resumes_as_the_uninterrupted_run(tmp_path):
    """model.freeze=[vision, language] (and the projector at half the rate, its own optimizer
    groups): 3 steps, a checkpoint, on to 5 equals one 5-step run; the export's vision and
    language weights are the initial ones, its projector moved."""
    from transformers import AutoModelForImageTextToText

    from llmtrain.models.build import build_model

    path = write_dataset(tmp_path, n=16)
    common = ["model=tiny_llava", "data=vlm_chat", f"data.path={path}", *FAST, "trainer.global_batch_size=4",
              "trainer.micro_batch_size=2", "trainer.save_every=3", "model.freeze=[vision,language]", "trainer.lr=1e-2",
              "model.lr_multipliers={projector:0.5}"]
    whole, parts_run = tmp_path / "whole", tmp_path / "parts"
    assert_ok(run_cli(common + ["trainer.max_steps=5", f"run_dir={whole}"]))
    assert_ok(run_cli(common + ["trainer.max_steps=3", f"run_dir={parts_run}"]))
    assert_ok(run_cli(common + ["trainer.max_steps=5", f"run_dir={parts_run}"]))
    losses = {run: {r["step"]: r["train/loss"] for r in read_metrics(run) if "train/loss" in r}
              for run in (whole, parts_run)}
    assert [losses[parts_run][s] for s in (4, 5)] == pytest.approx([losses[whole][s] for s in (4, 5)], abs=1e-5)
    exported = AutoModelForImageTextToText.from_pretrained(parts_run / "hf").state_dict()
    cfg = make_cfg(["model=tiny_llava"])
    initial = build_model(cfg.model, seed=cfg.trainer.seed).state_dict()
    for name, tensor in exported.items():
        same = torch.equal(tensor, initial[name])
        assert same == ("multi_modal_projector" not in name), name


def test_a_family_without_parts_keeps_patterns_and_hand_named_lora_targets_and_refuses_part_names():
    """PaliGemma (no parts class here): model.freeze patterns and peft.target_modules lists work as
    for any model; part names, and all-linear (which would reach its vision tower), are refused."""
    import transformers

    from llmtrain.common.errors import ConfigError
    from llmtrain.models import adapters

    config = transformers.PaliGemmaConfig(
        text_config=dict(model_type="gemma", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16), image_token_index=300,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=16, patch_size=4, projection_dim=64), projection_dim=64)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    adapters._freeze(model, ["model.vision_tower.*"])
    assert {n.split(".")[1] for n, p in model.named_parameters() if not p.requires_grad} == {"vision_tower"}
    with pytest.raises(ConfigError, match=r"^model.freeze: llmtrain does not know the parts of paligemma models"):
        adapters._freeze(model, ["vision"])
    p = make_cfg(["model=tiny_llava", "+peft=lora", "peft.target_modules=[q_proj]"]).peft
    assert adapters.lora_config(p, model).target_modules == {"q_proj"}
    p = make_cfg(["model=tiny_llava", "+peft=lora"]).peft
    with pytest.raises(ConfigError, match=r"^peft.parts: llmtrain does not know the parts of paligemma models"):
        adapters.lora_config(p, model)


def test_lora_on_a_vision_part_of_a_text_model_is_refused_and_its_language_part_is_all_linear():
    """``+peft=lora peft.parts=[vision]`` on tiny_llama once trained adapters on the whole language
    model, without a word: the text model has no vision part, so the run is refused."""
    from llmtrain.common.errors import ConfigError
    from llmtrain.models import adapters

    _, model = built("tiny_llama")
    for named in (["vision"], ["language", "projector"]):
        p = make_cfg(["+peft=lora", f"peft.parts=[{','.join(named)}]"]).peft
        with pytest.raises(ConfigError, match=r"^peft.parts: '(vision|projector)' is not a part of a llama model; its "
                                              r"parts are language, lm_head$"):
            adapters.lora_config(p, model)
    assert adapters.lora_config(make_cfg(["+peft=lora"]).peft, model).target_modules == "all-linear"
