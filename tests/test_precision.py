"""bf16 on every engine: fp32 master weights that start at the initial weights, one optimizer
update per trainer step (the trainer checks the count after set-up and after every step), and
exports written from the fp32 master weights, at the end of the run and by ``llmtrain.export``."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAST, REPO, assert_ok, run_scenarios, subprocess_env, train_rows
from llmtrain.models.build import initial_value

BF16 = FAST + ["trainer.precision=bf16", "trainer.save_every=0"]
# lr=1e-30 makes the update vanish below fp32 resolution: the export after one step is the
# master copy as set-up left it.
UNMOVED = BF16 + ["trainer.max_steps=1", "trainer.lr=1e-30"]
RUNS = {
    "zero0": BF16 + ["+recipe=zero1", "recipe.zero_stage=0", "trainer.max_steps=3"],
    "zero1": UNMOVED + ["+recipe=zero1"], "zero2": UNMOVED + ["+recipe=zero2"], "zero3": UNMOVED + ["+recipe=zero3"],
    "fsdp": UNMOVED + ["+recipe=fsdp"], "ddp": UNMOVED + ["+recipe=ddp"],
    # Loss curves: DDP computing on bf16 casts of its weights (with activation checkpointing,
    # which recomputes on the same casts) against DeepSpeed's bf16 ZeRO-1 as the reference.
    "ddp_curve": BF16 + ["+recipe=ddp", "trainer.max_steps=6", "trainer.activation_checkpointing=true"],
    "zero1_curve": BF16 + ["+recipe=zero1", "trainer.max_steps=6"],
}


# DPO's first step in bf16: the frozen reference computes on the same bf16 weights as the policy
# on every layout, so every implicit reward is 0 and the loss is ln 2 to the last bit of fp32.
DPO = [o for o in BF16 if not o.startswith(("data.max_bytes", "data.seq_len"))] + [
    "objective=dpo", "data=preference", "data.path=PAIRS", "data.seq_len=64", "data.max_prompt_tokens=32",
    "trainer.max_steps=1", "trainer.global_batch_size=4", "trainer.micro_batch_size=1"]
DPO_RECIPES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import json

    root = tmp_path_factory.mktemp("bf16")
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Question {i}: what is {i} + {i}?", "chosen": f" It is {2 * i}.",
                                         "rejected": f" Maybe {i * 7 % 13}."}) + "\n" for i in range(40)))
    dpo = {f"dpo_{recipe}": [o.replace("PAIRS", str(pairs)) for o in DPO] + [f"+recipe={recipe}"]
           for recipe in DPO_RECIPES}
    return run_scenarios({**RUNS, **dpo}, 2, root)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "fsdp", "ddp"])
def test_bf16_master_weights_start_at_the_initial_weights_and_are_exported(name, runs):
    # DeepSpeed casts the model to bf16 and copies its master weights from the rounded values;
    # the engine puts the true initial weights there, and exports the master, not the bf16 copy.
    exported = load_file(str(runs[name] / "hf" / "model.safetensors"))
    for key, value in exported.items():
        assert value.dtype == torch.float32
        want = initial_value(key, value.shape, 1234, 0.02)  # trainer.seed, initializer_range
        assert torch.equal(value, want), (key, (value - want).abs().max())


@pytest.mark.slow
def test_deepspeed_zero0_bf16_takes_one_update_per_step_and_exports_its_fp32_weights(runs, tmp_path):
    checkpoint = runs["zero0"] / "checkpoints" / "step_3"
    states = torch.load(checkpoint / "engine" / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    # DeepSpeed's bf16 wrapper took a zero-gradient step at set-up (step 4 here); autocast does not.
    steps = {int(s["step"]) for s in states["optimizer"]["state"].values()}
    assert steps == {3}
    module = states["module"]
    assert {v.dtype for v in module.values()} == {torch.float32}  # fp32 parameters, bf16 matmuls
    exported = load_file(str(runs["zero0"] / "hf" / "model.safetensors"))
    assert all(torch.equal(exported[k], module[k]) for k in exported)
    out = tmp_path / "exported"  # raised a TypeError inside DeepSpeed's zero_to_fp32 before
    assert_ok(subprocess.run([sys.executable, "-m", "llmtrain.export", str(checkpoint), str(out)],
                             capture_output=True, text=True, env=subprocess_env(), cwd=REPO))
    again = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(again[k], exported[k]) for k in exported)


def test_the_trainer_refuses_an_optimizer_that_updated_more_often_than_it_stepped():
    from llmtrain.checkpoint.state import TrainState
    from llmtrain.engine.base import check_optimizer_steps

    class Counting:
        def __init__(self, taken):
            self.taken = taken

        def optimizer_step_count(self):
            return self.taken

    check_optimizer_steps(Counting(3), TrainState(step=4, skipped_updates=1))
    with pytest.raises(RuntimeError, match="applied 4 updates at trainer step 3"):
        check_optimizer_steps(Counting(4), TrainState(step=3))


def _floating_dtypes(node) -> set:
    if isinstance(node, torch.Tensor):
        return {node.dtype} if node.is_floating_point() else set()
    if isinstance(node, dict):
        return set().union(*map(_floating_dtypes, node.values())) if node else set()
    if isinstance(node, (list, tuple)):
        return set().union(*map(_floating_dtypes, node)) if node else set()
    return set()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "fsdp", "ddp"])
def test_bf16_master_weights_and_optimizer_state_are_fp32(name, runs, tmp_path):
    engine_dir = runs[name] / "checkpoints" / "step_1" / "engine"
    if name.startswith("zero"):
        # DeepSpeed: the optimizer files hold the fp32 master partitions and Adam's moments.
        files = sorted(engine_dir.glob("*optim_states.pt"))
        assert len(files) == 2
        for f in files:
            state = torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
            assert _floating_dtypes(state) == {torch.float32}, f
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(str(engine_dir), str(tmp_path / "state.pt"))
        state = torch.load(tmp_path / "state.pt", weights_only=False)
        assert _floating_dtypes(state["model"]) == {torch.float32}
        assert _floating_dtypes(state["optim"] if "optim" in state else state["optimizer"]) == {torch.float32}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_bf16_accumulates_gradients_in_fp32_at_every_stage(stage):
    from conftest import make_cfg
    from llmtrain.engine.deepspeed_engine import deepspeed_config

    cfg = make_cfg(["+recipe=zero1", f"recipe.zero_stage={stage}", "trainer.precision=bf16"])
    ds = deepspeed_config(cfg, world_size=2, accumulation_steps=8)
    if stage == 0:  # fp32 parameters and gradients, bf16 matmuls
        assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"} and not ds["bf16"]["enabled"]
    else:  # bf16 working weights, fp32 gradient accumulation and reduction, fp32 master
        assert ds["data_types"] == {"grad_accum_dtype": "fp32"} and ds["bf16"]["enabled"]


def test_torch_engine_accumulates_bf16_micro_batch_gradients_in_fp32():
    # Eight micro-batches under bf16 autocast: the accumulated gradient equals the fp64 sum of
    # the eight micro-batch gradients far inside one bf16 rounding of it (bf16 accumulation
    # would be off by about two roundings: 3.4e-3 vs 1.7e-3 relative, issue 10).
    from conftest import make_cfg
    from llmtrain.parallel.distributed import DistEnv
    from llmtrain.engine.torch_engine import TorchEngine
    from llmtrain.objectives import CausalLM
    from llmtrain.objectives.causal_lm import count_target_tokens
    from llmtrain.models.build import build_model

    cfg = make_cfg(["trainer.precision=bf16", "trainer.global_batch_size=16", "trainer.micro_batch_size=2"])
    engine = TorchEngine(cfg, DistEnv(0, 1, 0, torch.device("cpu"), "gloo"), accumulation_steps=8, objective=CausalLM())
    engine.setup(build_model(cfg.model, 0))
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": (ids := torch.randint(0, 256, (2, 32), generator=gen)), "labels": ids.clone(),
                "attention_mask": torch.ones_like(ids)} for _ in range(8)]
    targets = float(sum(count_target_tokens(b["labels"]) for b in batches))
    params = [p for p in engine.model.parameters()]

    reference = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for batch in batches:
        engine.accumulate_gradients([batch], targets)
        for total, p in zip(reference, params):
            total += p.grad.double()
            assert p.grad.dtype == torch.float32
        engine.optimizer.zero_grad(set_to_none=True)
    engine.accumulate_gradients(batches, targets)
    accumulated = torch.cat([p.grad.double().flatten() for p in params])
    want = torch.cat([r.flatten() for r in reference])
    error = float((accumulated - want).norm() / want.norm())
    one_rounding = float((want.to(torch.bfloat16).double() - want).norm() / want.norm())
    assert error < one_rounding / 100, (error, one_rounding)


@pytest.mark.slow
def test_ddp_bf16_trains_deepspeed_bf16_zero1s_loss_curve(runs):
    # Both compute forward and backward on bf16 weights cast from fp32 masters and accumulate
    # gradients in fp32 (DeepSpeed's bf16 optimizer, grad_accum_dtype fp32). Step 1 checks the
    # forward numerics: under autocast (fp32 residual stream) it differed by 7e-5 on this run;
    # later steps differ in the optimizers' last bits (DeepSpeed's own gradient flattening and
    # clipping), measured 1.1e-4 at most over 8 steps.
    ours = [r["train/loss"] for r in train_rows(runs["ddp_curve"], 6)]
    reference = [r["train/loss"] for r in train_rows(runs["zero1_curve"], 6)]
    assert abs(ours[0] - reference[0]) < 2e-6, (ours, reference)
    assert max(abs(a - b) for a, b in zip(ours, reference)) < 5e-4, (ours, reference)
    assert reference[-1] < reference[0] - 0.3  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("recipe", DPO_RECIPES)
def test_bf16_dpo_starts_at_ln2_on_every_layout(recipe, runs):
    # The reference runs on the weights the policy computes on: the torch engine's bf16 casts,
    # DeepSpeed's bf16 working copy (ZeRO-1/2 replicate it, ZeRO-3 partitions it), FSDP2's
    # param_dtype. A reference on fp32 weights under autocast missed ln 2 by about 1e-4.
    first = train_rows(runs[f"dpo_{recipe}"], 1)[0]
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert first["train/rewards/chosen"] == first["train/rewards/rejected"] == 0


@pytest.mark.parametrize("model", [
    [],
    # LoRA on a MoE layer's expert tensors: peft registers and removes a parametrization on the
    # cast in every forward (it left the cast behind as a buffer, and the next forward failed).
    ["model=tiny_qwen3_moe", "+peft=lora", "peft.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
     "+model.router_aux_loss_coef=0"],  # the reference below has no load-balancing term
], ids=["llama", "moe-expert-lora"])
def test_torch_engine_bf16_gradients_are_a_bf16_models_summed_in_fp32(model):
    # Reference: the same model with its parameters cast to bf16 (no llmtrain code in its forward
    # or backward), each micro-batch's gradient upcast and summed in fp32. The engine's gradients
    # must be those exactly, on its own fp32 Parameters (same objects before and after).
    import copy

    from conftest import make_cfg
    from llmtrain.engine.torch_engine import TorchEngine
    from llmtrain.models import adapters
    from llmtrain.models.build import build_model
    from llmtrain.objectives import CausalLM
    from llmtrain.parallel.distributed import DistEnv

    cfg = make_cfg(model + ["trainer.precision=bf16", "trainer.global_batch_size=8", "trainer.micro_batch_size=2"])
    model = build_model(cfg.model, 0)
    if cfg.get("peft") is not None:
        model = adapters.apply(model, cfg)
    low = copy.deepcopy(model)
    for p in low.parameters():  # buffers (RoPE's inverse frequencies) stay fp32, as in the engine
        p.data = p.data.to(torch.bfloat16)
    engine = TorchEngine(cfg, DistEnv(0, 1, 0, torch.device("cpu"), "gloo"), accumulation_steps=4, objective=CausalLM())
    engine.setup(model)
    before = {name: p for name, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": (ids := torch.randint(0, 256, (2, 32), generator=gen)), "labels": ids.clone(),
                "attention_mask": torch.ones_like(ids)} for _ in range(4)]
    for _ in range(2):  # twice: the second step starts from what the first left behind
        engine.accumulate_gradients(batches, 100.0)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained

    want = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in low.named_parameters()}
    for batch in batches + batches:
        logits = low(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        (CausalLM().loss_sums(logits, batch).loss / 100.0).backward()
        for name in trained:
            want[name] += dict(low.named_parameters())[name].grad.float()
        low.zero_grad(set_to_none=True)
    for name, p in model.named_parameters():
        assert p is before[name] and type(p) is torch.nn.Parameter, name
        if name in trained:
            assert p.dtype == torch.float32 and torch.equal(p.grad, want[name]), (name, (p.grad - want[name]).abs().max())
    assert not any(name in module._buffers for module in model.modules() for name in module._parameters)
    with torch.no_grad():  # an evaluation forward computes on the same casts, and leaves fp32 behind
        assert engine.forward(batches[0]).dtype == torch.bfloat16
    assert all(p is before[name] for name, p in model.named_parameters())


def test_torch_engine_bf16_lora_stores_its_frozen_base_in_bf16_with_the_same_losses(monkeypatch):
    # A LoRA base is frozen: the torch engine stores it as the bf16 cast it computes on. Against
    # the same run with the base kept in fp32 and cast every micro-batch (the engine before), three
    # optimizer steps give the same losses and adapters to the last bit, and the base's resident
    # bytes halve (the adapters stay fp32 masters).
    from conftest import make_cfg
    from llmtrain.engine import torch_engine
    from llmtrain.engine.torch_engine import TorchEngine
    from llmtrain.models import adapters
    from llmtrain.models.build import build_model
    from llmtrain.objectives import CausalLM
    from llmtrain.parallel.distributed import DistEnv

    cfg = make_cfg(["+peft=lora", "trainer.precision=bf16", "trainer.global_batch_size=8", "trainer.micro_batch_size=2"])
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": (ids := torch.randint(0, 256, (2, 32), generator=gen)), "labels": ids.clone(),
                "attention_mask": torch.ones_like(ids)} for _ in range(4)]

    def run(keep_fp32_base: bool):
        with monkeypatch.context() as patch:
            if keep_fp32_base:
                patch.setattr(torch_engine, "store_frozen_in_bf16", lambda model: 0)
            engine = TorchEngine(cfg, DistEnv(0, 1, 0, torch.device("cpu"), "gloo"), accumulation_steps=4,
                                 objective=CausalLM())
            engine.setup(adapters.apply(build_model(cfg.model, cfg.trainer.seed), cfg))
        losses = []
        for _ in range(3):
            losses.append(float(engine.accumulate_gradients(batches, 100.0)))
            engine.step()
        frozen = {id(p): p for p in engine.model.parameters() if not p.requires_grad}.values()
        trained = {n: p.detach().clone() for n, p in engine.model.named_parameters() if p.requires_grad}
        assert trained and all(p.dtype == torch.float32 for p in trained.values())
        return (losses, trained, sum(p.numel() * p.element_size() for p in frozen), {p.dtype for p in frozen},
                engine)

    before, after = run(keep_fp32_base=True), run(keep_fp32_base=False)
    assert before[3] == {torch.float32} and after[3] == {torch.bfloat16}
    assert after[2] * 2 == before[2] > 0
    assert after[0] == before[0] and len(set(before[0])) == 3, (before[0], after[0])
    assert all(torch.equal(after[1][n], p) for n, p in before[1].items())
    # Exports see the fp32 base as built (rebuilt from its source), with the trained adapters.
    from llmtrain.checkpoint.export import trained_state

    exported, built = trained_state(after[4], cfg), adapters.apply(build_model(cfg.model, cfg.trainer.seed), cfg).state_dict()
    assert exported.keys() == built.keys() and all(v.dtype == torch.float32 for v in exported.values())
    for name, value in exported.items():
        assert torch.equal(value, after[1][name] if name in after[1] else built[name]), name


def test_bf16_casts_give_every_parameter_back_when_a_cast_or_the_body_fails():
    from llmtrain.engine.mixed_precision import Bf16ComputeWeights
    from llmtrain.models.build import build_model
    from conftest import make_cfg

    model = build_model(make_cfg([]).model, 0)
    before = dict(model.named_parameters())
    casts = Bf16ComputeWeights(model)

    class FailingCast:  # a cast that runs out of memory part-way through the slots
        def to(self, dtype):
            raise RuntimeError("out of memory")

    casts._slots.insert(3, (torch.nn.Module(), "w", FailingCast()))
    with pytest.raises(RuntimeError, match="out of memory"):
        with casts.computing():
            pass
    del casts._slots[3]
    with pytest.raises(ValueError, match="in the forward"):
        with casts.computing():
            assert model.model.embed_tokens.weight.dtype == torch.bfloat16
            raise ValueError("in the forward")
    assert casts._depth == 0
    assert all(p is before[name] and p.dtype == torch.float32 for name, p in model.named_parameters())
    assert {v.dtype for v in model.state_dict().values() if v.is_floating_point()} == {torch.float32}


@pytest.mark.parametrize("flags,native", [({"fpu", "avx512f", "amx_bf16", "amx_tile"}, True), ({"avx512_bf16"}, True),
                                          ({"avx2", "avx512f", "fma"}, False), (set(), False)])
def test_auto_precision_reads_bf16_matmul_units_from_the_cpu_flags(flags, native):
    from llmtrain.common.hardware import bf16_native

    got, evidence = bf16_native(torch.device("cpu"), frozenset(flags))
    assert got is native
    assert ("amx_bf16" in evidence or "avx512_bf16" in evidence)


def test_the_default_job_picks_what_the_machine_runs_natively_and_says_why(tmp_path):
    # No trainer.precision override: the default (auto). This machine's own flags decide, read
    # here independently of llmtrain.
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    found = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    overrides = [o for o in FAST if not o.startswith("trainer.precision")] + ["trainer.max_steps=2", f"run_dir={tmp_path}"]
    proc = subprocess.run([sys.executable, "-m", "llmtrain", *overrides], capture_output=True, text=True,
                          env=subprocess_env(), cwd=REPO, timeout=300)
    assert_ok(proc)
    chosen = "bf16" if found else "fp32"
    assert "precision: " + chosen in (tmp_path / "config.yaml").read_text()  # the run records what it used
    why = f"the CPU has {' and '.join(found)}" if found else "the CPU has neither amx_bf16 nor avx512_bf16"
    assert f"precision {chosen} (trainer.precision=auto: {why})" in proc.stderr + proc.stdout
    # An explicit choice wins, and is named as such.
    from llmtrain.common.hardware import resolve_precision

    assert resolve_precision("fp32", torch.device("cpu")) == ("fp32", "trainer.precision=fp32")
    assert resolve_precision("bf16", torch.device("cpu")) == ("bf16", "trainer.precision=bf16")
