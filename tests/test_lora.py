"""LoRA (``+peft=lora``) on every data-parallel recipe: the same losses as one process, adapter-
sized checkpoints without the frozen base, PEFT and merged exports that agree, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import FAST, REPO, assert_ok, make_cfg, read_metrics, run_cli, run_scenarios, subprocess_env

# peft reads transformers' deprecated gradient-checkpointing flag when it loads an adapter.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

# Dropout 0: the equivalence below compares runs whose ranks draw different dropout streams.
LORA = FAST + ["+peft=lora", "peft.r=4", "peft.alpha=8", "trainer.max_steps=6", "trainer.save_every=4",
               "trainer.global_batch_size=16", "trainer.micro_batch_size=4", "trainer.warmup_steps=2",
               "trainer.lr=5e-3", "trainer.export_merged=true"]
RECIPES = {"ddp": ["+recipe=ddp"], "zero2": ["+recipe=zero2"], "zero3": ["+recipe=zero3"], "fsdp": ["+recipe=fsdp"]}
# QLoRA (a 4-bit NF4 base, llmtrain.models.quantize) on the same recipes.
QLORA = ["model.quantize=nf4"]
# The output head trained in full next to the adapters (untied embeddings: tiny_qwen2).
HEAD = ["model=tiny_qwen2", "peft.modules_to_save=[lm_head]"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one = run_scenarios({"single": LORA + ["+recipe=ddp"],
                         "freeze": FAST + ["trainer.max_steps=2", "model.freeze=[model.embed_tokens.*]"],
                         "head_single": LORA + HEAD + ["+recipe=ddp"],
                         "qlora_single": LORA + QLORA + ["+recipe=ddp"]},
                        1, tmp_path_factory.mktemp("lora-1"))
    # bf16 on DeepSpeed holds the frozen base in bf16 only: its exports must still be fp32-exact.
    two = run_scenarios({**{name: LORA + overrides for name, overrides in RECIPES.items()},
                         "zero2_bf16": LORA + ["+recipe=zero2", "trainer.precision=bf16"],
                         "head_zero3": LORA + HEAD + ["+recipe=zero3"],
                         **{f"qlora_{name}": LORA + QLORA + overrides for name, overrides in RECIPES.items()}}, 2,
                        tmp_path_factory.mktemp("lora-2"))
    return {**one, **two}


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES) + [f"qlora_{name}" for name in RECIPES])
def test_lora_on_two_ranks_matches_one_process(recipe, runs):
    want, got = _losses(runs["qlora_single" if recipe.startswith("qlora") else "single"]), _losses(runs[recipe])
    assert sorted(got) == list(range(1, 7))
    for step in got:
        assert abs(got[step] - want[step]) < 1e-5, (step, got[step], want[step])
    assert got[6] < got[1]


def _logits(model) -> torch.Tensor:
    ids = torch.arange(0, 120).reshape(2, 60) % 256
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["single", "zero3", "fsdp", "zero2_bf16"])
def test_adapter_and_merged_exports_load_and_agree(recipe, runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = runs[recipe]
    adapter_config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    base_dir = run_dir / "adapter" / "base"  # built from a config: the frozen base ships with the adapter
    assert adapter_config["r"] == 4 and adapter_config["base_model_name_or_path"] == str(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    from llmtrain.models.build import initial_value

    for name, tensor in base.named_parameters():  # the frozen base as built, fp32-exact (bf16 too)
        assert torch.equal(tensor, initial_value(name, tensor.shape, 1234, 0.02)), name
    untouched = _logits(base)
    adapted = PeftModel.from_pretrained(base, run_dir / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    torch.testing.assert_close(_logits(adapted), _logits(merged), rtol=0, atol=1e-4)
    assert (_logits(merged) - untouched).abs().max() > 1e-3  # the adapter changed the model


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["single", "zero2", "zero3", "fsdp", "qlora_zero3", "qlora_fsdp"])
def test_checkpoints_hold_the_adapters_and_their_optimizer_state_only(recipe, runs, tmp_path):
    engine_dir = runs[recipe] / "checkpoints" / "step_6" / "engine"
    if "zero" in recipe:
        model_file = next(engine_dir.glob("*mp_rank_00_model_states.pt"))  # ZeRO-3: zero_pp_rank_0_...
        module = torch.load(model_file, map_location="cpu", weights_only=False)["module"]
        names = set(module)
        moments = 0
        for f in engine_dir.glob("*optim_states.pt"):
            state = torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
            inner = state.get("base_optimizer_state") or state.get("optimizer_state_dict")
            moments += sum(s["exp_avg"].numel() for s in inner["state"].values())
        # ZeRO-3 keeps module tensors as empty placeholders: the partitions live in the optimizer files.
        trainable = sum(v.numel() for k, v in module.items() if ".lora_" in k) if not recipe.endswith("zero3") else None
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        out = tmp_path / "state.pt"
        dcp_to_torch_save(str(engine_dir), str(out))
        state = torch.load(out, weights_only=False)
        names = set(state["model"])
        moments = sum(v.numel() for k, v in state["optimizer"].items() if k.endswith(".exp_avg"))
        trainable = sum(v.numel() for v in state["model"].values())
    assert names and all(".lora_" in n for n in names), sorted(names)[:5]
    # 7 adapted Linears per layer (q, k, v, o, gate, up, down) x 4 layers: an A and a B each.
    assert len([n for n in names if ".lora_A." in n]) == 28 and len([n for n in names if ".lora_B." in n]) == 28
    if trainable is not None:
        assert moments == trainable  # one Adam moment per trainable element; none for the base
    state = json.loads((runs[recipe] / "checkpoints" / "step_6" / "trainer_state.json").read_text())
    assert state["base_fingerprint"].startswith("config:")


@pytest.mark.slow
def test_model_freeze_keeps_patterns_frozen_and_out_of_the_checkpoint(runs, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from safetensors.torch import load_file

    from llmtrain.models.build import initial_value

    engine_dir = runs["freeze"] / "checkpoints" / "step_2" / "engine"
    dcp_to_torch_save(str(engine_dir), str(tmp_path / "state.pt"))
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    assert "model.embed_tokens.weight" not in state["model"] and "model.norm.weight" in state["model"]
    assert not any(k.startswith("state.model.embed_tokens") for k in state["optimizer"])
    exported = load_file(str(runs["freeze"] / "hf" / "model.safetensors"))
    embed = exported["model.embed_tokens.weight"]
    assert torch.equal(embed, initial_value("model.embed_tokens.weight", embed.shape, 1234, 0.02))  # never moved


@pytest.mark.slow
def test_a_lora_checkpoint_resumes_only_with_lora_and_the_same_base(runs, tmp_path):
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(runs["single"], run_dir)
    proc = run_cli([o for o in LORA if "peft" not in o] + ["+recipe=ddp", "trainer.max_steps=8", f"run_dir={run_dir}"])
    assert proc.returncode == 2 and "peft" in proc.stderr, proc.stderr[-2000:]
    # Other base weights (a config model's base is a function of its seed): refused naming both.
    saved = json.loads((run_dir / "checkpoints" / "step_6" / "trainer_state.json").read_text())["base_fingerprint"]
    proc = run_cli(LORA + ["+recipe=ddp", "trainer.max_steps=8", "trainer.seed=99", f"run_dir={run_dir}"])
    assert proc.returncode == 2 and f"trained on base weights {saved}, but model tiny_llama" in proc.stderr, \
        proc.stderr[-2000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_4", "step_6"]  # nothing written
    # A full fine-tuning checkpoint resumed with +peft=lora (it raised a TypeError before).
    shutil.copytree(runs["freeze"], tmp_path / "full")
    proc = run_cli(FAST + ["trainer.max_steps=3", "+peft=lora", f"run_dir={tmp_path / 'full'}"])
    assert proc.returncode == 2 and "peft" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("overrides,needle", [
    (["peft.r=0"], "peft.r=0 must be > 0"),
    (["peft.alpha=-1"], "peft.alpha=-1.0 must be > 0"),
    (["peft.dropout=1.0"], "peft.dropout=1.0 must be in [0, 1)"),
    (["peft.bias=some"], "peft.bias='some' must be none, all or lora_only"),
    (["+recipe=tp"], "+peft=lora with recipe tp"),
    (["+recipe=pp"], "+peft=lora with recipe pp"),
    (["peft.use_dora=true"], "peft.use_dora=true is not supported yet"),
])
def test_bad_peft_settings_are_refused_naming_the_field(overrides, needle):
    from llmtrain.common.errors import ConfigError
    from llmtrain.config.validate import validate

    with pytest.raises(ConfigError) as err:
        validate(make_cfg(["+peft=lora"] + overrides), 2)
    assert needle in str(err.value)


@pytest.mark.parametrize("overrides,needle", [
    (["peft.target_modules=[qkv_proj]"], "peft.target_modules: 'qkv_proj' matches no Linear module of this model; "
                                         "its Linear modules end in down_proj, gate_proj, k_proj"),
    (["peft.modules_to_save=[head]"], "peft.modules_to_save: 'head' is not a module of this model; top-level "
                                      "modules are model, lm_head"),
    # tiny_llama ties lm_head to the input embedding: an adapter cannot carry one side of the pair.
    (["peft.modules_to_save=[lm_head]"], "name ['lm_head'], which share one weight with ['model.embed_tokens']"),
    (["peft.target_modules=[lm_head]"], "name ['lm_head'], which share one weight with ['model.embed_tokens']"),
])
def test_names_that_match_nothing_list_the_models_own(overrides, needle):
    # Raised while the model is built, before the run directory exists (trainer order).
    from llmtrain.models import adapters
    from llmtrain.common.errors import ConfigError
    from llmtrain.models.build import build_model

    cfg = make_cfg(["+peft=lora"] + overrides)
    with pytest.raises(ConfigError) as err:
        adapters.apply(build_model(cfg.model, 0), cfg)
    assert needle in str(err.value)


def test_freeze_patterns_must_match():
    from llmtrain.models import adapters
    from llmtrain.common.errors import ConfigError
    from llmtrain.models.build import build_model

    cfg = make_cfg(["model.freeze=[model.embedding.*]"])
    with pytest.raises(ConfigError, match="model.freeze pattern 'model.embedding.\\*' matches no parameter"):
        adapters.apply(build_model(cfg.model, 0), cfg)
    with pytest.raises(ConfigError, match="froze every parameter"):
        adapters.apply(build_model(cfg.model, 0), make_cfg(["model.freeze=[*]"]))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["qlora_single", "qlora_zero3", "qlora_fsdp"])
def test_qlora_exports_merge_into_the_dequantized_base_and_load_in_plain_transformers(recipe, runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmtrain.models.build import build_model
    from llmtrain.models.quantize import round_trip

    run_dir = runs[recipe]
    cfg = make_cfg(LORA + QLORA)
    trained_on = round_trip(build_model(cfg.model, cfg.trainer.seed), cfg).state_dict()
    initial = build_model(cfg.model, cfg.trainer.seed).state_dict()
    base = AutoModelForCausalLM.from_pretrained(run_dir / "adapter" / "base")
    for name, tensor in base.state_dict().items():  # the base the run computed with: NF4, dequantized
        assert torch.equal(tensor, trained_on[name]), name
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(trained_on[q_proj], initial[q_proj])  # quantized: not the initial weights
    assert torch.equal(trained_on["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])  # kept
    adapted = _logits(PeftModel.from_pretrained(base, run_dir / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "hf")  # plain transformers, no quantization library
    torch.testing.assert_close(_logits(merged), adapted, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_llmtrain_export_writes_the_adapter_or_the_merged_model_from_a_lora_checkpoint(runs, tmp_path):
    from safetensors.torch import load_file

    checkpoint = runs["fsdp"] / "checkpoints" / "step_6"
    for extra, out in (([], tmp_path / "adapter"), (["--merged"], tmp_path / "merged")):
        proc = subprocess.run([sys.executable, "-m", "llmtrain.export", str(checkpoint), str(out)] + extra,
                              capture_output=True, text=True, env=subprocess_env(), cwd=REPO)
        assert_ok(proc)
    exported = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    trained = load_file(str(runs["fsdp"] / "adapter" / "adapter_model.safetensors"))
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    merged, at_end = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "merged", runs["fsdp"] / "hf"))
    assert all(torch.equal(merged[k], at_end[k]) for k in at_end)


@pytest.mark.slow
def test_a_two_rank_lora_checkpoint_resumes_on_one_process(runs, tmp_path):
    # The FSDP2 adapter shards of 2 ranks (step 4), loaded by one plain process: DCP reshards by
    # name and the frozen base is rebuilt from its source.
    import shutil

    shutil.copytree(runs["fsdp"], tmp_path / "run")
    assert_ok(run_cli(LORA + ["trainer.resume=4", f"run_dir={tmp_path / 'run'}"]))
    want = _losses(runs["fsdp"])
    got = {r["step"]: r["train/loss"] for r in read_metrics(tmp_path / "run")[-2:]}
    assert sorted(got) == [5, 6]
    for step in got:
        assert abs(got[step] - want[step]) < 1e-6, (step, got[step], want[step])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["head_single", "head_zero3"])
def test_adapter_base_is_the_untrained_base_when_modules_to_save_train(recipe, runs, tmp_path):
    # peft.modules_to_save=[lm_head] trains the head in full: the adapter carries the trained head,
    # adapter/base (what base_model_name_or_path names) stays the base as built, head included.
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from llmtrain.models.build import initial_value

    run_dir = runs[recipe]
    checkpoint = run_dir / "checkpoints" / "step_6"
    proc = subprocess.run([sys.executable, "-m", "llmtrain.export", str(checkpoint), str(tmp_path / "adapter")],
                          capture_output=True, text=True, env=subprocess_env(), cwd=REPO)
    assert_ok(proc)
    for adapter_dir in (run_dir / "adapter", tmp_path / "adapter"):  # the run's export and the offline one
        base = AutoModelForCausalLM.from_pretrained(adapter_dir / "base")
        assert not base.config.tie_word_embeddings
        std = base.config.initializer_range
        for name, tensor in base.state_dict().items():  # every tensor, lm_head.weight included
            assert torch.equal(tensor, initial_value(name, tensor.shape, 1234, std)), (adapter_dir, name)
        saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
        head = [saved[k] for k in saved if "lm_head" in k]
        assert len(head) == 1 and (head[0] - base.lm_head.weight).abs().max() > 1e-3  # trained, in the adapter
        untouched = _logits(base)
        adapted = PeftModel.from_pretrained(base, adapter_dir)
        merged = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
        assert torch.equal(merged.lm_head.weight, head[0])
        torch.testing.assert_close(_logits(adapted), _logits(merged), rtol=0, atol=1e-4)
        assert (_logits(merged) - untouched).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["single", "head_single"])
def test_the_adapter_folder_loads_with_its_base_from_its_own_metadata(recipe, runs):
    # A model built from a config has no loadable base anywhere else: the run writes it to
    # adapter/base and names it (absolute) in adapter_config.json, so peft's AutoPeftModel loads
    # base + adapter from the folder alone, giving the trained (merged) model's logits.
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    adapter_dir = runs[recipe] / "adapter"
    named = json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == str((adapter_dir / "base").resolve())
    adapted = AutoPeftModelForCausalLM.from_pretrained(adapter_dir)
    merged = AutoModelForCausalLM.from_pretrained(runs[recipe] / "hf")
    torch.testing.assert_close(_logits(adapted), _logits(merged), rtol=0, atol=1e-4)
    generation = json.loads((adapter_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == json.loads((runs[recipe] / "hf" / "generation_config.json").read_text())[
        "eos_token_id"]


@pytest.mark.slow
def test_ask_answers_from_an_adapter_folder_also_after_the_run_folder_moved(runs, tmp_path):
    import shutil

    def ask(folder):
        return subprocess.run([sys.executable, str(REPO / "scripts" / "tools" / "ask.py"), str(folder), "Who are you?",
                               "--max-new-tokens", "3"], capture_output=True, text=True, env=subprocess_env(),
                              cwd=tmp_path)

    proc = ask(runs["single"] / "adapter")
    assert_ok(proc)
    assert proc.stdout.strip() and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    # Moved: the absolute base path it names is gone, adapter/base inside the folder is used.
    moved = tmp_path / "moved"
    shutil.copytree(runs["single"] / "adapter", moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone" / "base")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    proc = ask(moved)
    assert_ok(proc)
    assert proc.stdout.strip()
    shutil.rmtree(moved / "base")  # no base anywhere: one error line naming the fix, exit 2
    proc = ask(moved)
    assert proc.returncode == 2 and "ask.py: error:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = ask(tmp_path / "no-such-run" / "adapter")  # a mistyped path, not a Hub id
    assert proc.returncode == 2 and "no such folder" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_gguf_base_is_written_next_to_the_adapter_and_a_pretrained_one_named():
    # model.source=gguf: from_pretrained needs a gguf_file argument, which adapter metadata cannot
    # carry; the base is written to adapter/base like a config-built one. A pretrained folder or
    # Hub id loads as it is and stays named (no 500 MB copy).
    from pathlib import Path

    from llmtrain.checkpoint import export

    for overrides, writes in ((["model=smollm2_135m"], True), ([], True),
                              (["model.source=pretrained", "model.path=org/some-model"], False)):
        cfg = make_cfg(overrides)
        assert export.base_needs_folder(cfg.model) is writes, overrides
    gguf = make_cfg(["model=smollm2_135m"])
    assert export.base_reference(gguf, Path("run/adapter/base")) == str(Path("run/adapter/base").resolve())
    assert export.base_reference(make_cfg(["model.source=pretrained", "model.path=org/some-model"]), None) == \
        "org/some-model"


@pytest.mark.parametrize("overrides,lr", [
    (["trainer=finetune", "+peft=lora"], 2e-4),  # LoRA's rate replaces the full fine-tuning one
    (["+peft=lora", "trainer=finetune"], 2e-4),  # wherever +peft=lora is written
    (["+peft=lora"], 2e-4),
    (["trainer=finetune", "+peft=lora", "trainer.lr=1e-5"], 1e-5),  # the user's rate wins
    (["trainer.lr=1e-5", "+peft=lora"], 1e-5),
    (["trainer=finetune"], 5e-5),
])
def test_peft_lora_brings_the_lora_learning_rate_unless_one_is_given(overrides, lr):
    cfg = make_cfg(overrides)
    assert cfg.trainer.lr == pytest.approx(lr)
    if "+peft=lora" in overrides:
        assert cfg.peft.r == 8 and cfg.trainer.max_steps == (30 if "trainer=finetune" in overrides else 200)


def test_ask_says_what_it_loads_and_how_much_it_generates(tmp_path):
    # Loading and generating take minutes on a CPU for a real model: lines on stderr tell that
    # from a hang (before: nothing until the answer); stdout holds the answer alone.
    from llmtrain.models.build import build_model, build_tokenizer

    cfg = make_cfg([])
    build_model(cfg.model, seed=0).save_pretrained(tmp_path / "hf")
    build_tokenizer(cfg.model).save_pretrained(tmp_path / "hf")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "tools" / "ask.py"), str(tmp_path / "hf"), "Hi",
                           "--max-new-tokens", "2"], capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path)
    assert_ok(proc)
    said = [line for line in proc.stderr.splitlines() if line.startswith("ask.py: ")]
    assert said == [f"ask.py: loading the model in {tmp_path / 'hf'}",
                    "ask.py: generating at most 2 new tokens (greedy, on the CPU)"], proc.stderr
    assert proc.stdout.strip() and "ask.py" not in proc.stdout
