"""Every recipe against a plain single-process run, and resume on another number of ranks or
another parallel layout.

Reference runs (cached per recipe and world size): 6 steps of global batch 16, checkpoints at
steps 4 and 6, fp32 on CPU, no dropout. One process runs micro-batch 4 x accumulation 4, two run
4 x 2 x 2 ranks, so accumulation and data parallelism are both exercised. The torch-native
layouts (FSDP2, HSDP, TP, PP with three schedules, and their 2D/3D combinations, on 2, 4 and 8
processes) train the same run in one launch per world size (``tests/scenarios.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAST, assert_ok, read_metrics, run_scenarios, subprocess_env
from llmtrain.checkpoint.export import consolidated_state_dict

RECIPES = ["ddp", "zero1", "zero2", "zero3", "zero3_offload"]
COMMON = FAST + ["trainer.max_steps=6", "trainer.save_every=4", "trainer.global_batch_size=16",
                 "trainer.micro_batch_size=4", "trainer.warmup_steps=2"]


def steps(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "train/loss" in r}


# name -> overrides of the torch-native layouts, grouped by the number of processes.
NATIVE = {
    2: {"fsdp": ["+recipe=fsdp"], "tp": ["+recipe=tp"], "pp": ["+recipe=pp"],
        "pp_gpipe": ["+recipe=pp", "recipe.pp_schedule=gpipe"],
        "pp_interleaved": ["+recipe=pp", "recipe.pp_schedule=interleaved_1f1b", "recipe.pp_stages_per_rank=2"],
        "zero1_torch": ["+recipe=zero1", "engine=torch"], "zero2_torch": ["+recipe=zero2", "engine=torch"],
        "zero3_torch": ["+recipe=zero3", "engine=torch"],
        "zero3_offload_torch": ["+recipe=zero3_offload", "engine=torch"],
        "qwen2_tp": ["model=tiny_qwen2", "+recipe=tp"], "qwen2_pp": ["model=tiny_qwen2", "+recipe=pp"]},
    4: {"hsdp": ["+recipe=hsdp"], "fsdp_tp": ["+recipe=fsdp_tp"], "pp_fsdp": ["+recipe=pp_fsdp"],
        "qwen2_fsdp_tp": ["model=tiny_qwen2", "+recipe=fsdp_tp"]},
    8: {"3d": ["+recipe=3d"]},
}
NATIVE_CASES = [(nproc, name) for nproc, group in NATIVE.items() for name in group]

# A second objective from outside the package (tests/token_weighted.py): no engine knows it.
WEIGHTED = ["objective.target=tests.token_weighted:TokenWeighted", "objective.name=token_weighted"]
WEIGHTED_RECIPES = ["ddp", "fsdp", "zero3", "pp"]
# recipe.compile=true on the mesh engine (FSDP2) and on DeepSpeed (one process is in test_grad_accum).
COMPILED_RECIPES = ["ddp", "fsdp", "zero3"]
ALPACA_STEPS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this module that ``nproc`` processes make, trained in one launch per world
    size (start-up paid once): the five classic recipes on 1 and 2 processes, the plain Qwen2
    reference on 1, the torch-native layouts on 2, 4 and 8."""
    cache: dict = {}

    alpaca = _alpaca_file(tmp_path_factory.mktemp("alpaca") / "alpaca.json")
    # Padded instruction data (prompt masked, samples of 153-254 tokens): the pipeline pads each
    # step to its longest micro-batch rounded up to recipe.pp_pad_multiple (8 below: steps of
    # several lengths, one pipeline schedule each) and attends causally without a padding mask.
    # 4 steps, not 6: the longest rows of the module (256 and 512 tokens), and 4 steps already
    # give the pipeline several padded lengths.
    alpaca_run = [o for o in COMMON if not o.startswith(("data.seq_len", "trainer.max_steps"))] + [
        "data=alpaca", f"data.path={alpaca}", "data.seq_len=256", f"trainer.max_steps={ALPACA_STEPS}"]

    def get(nproc: int) -> dict[str, Path]:
        if nproc not in cache:
            group = {recipe: COMMON + [f"+recipe={recipe}"] for recipe in RECIPES} if nproc <= 2 else {}
            # Rows of 512 tokens hold two or three of these samples.
            packed = [o for o in alpaca_run if o != "data.seq_len=256"] + ["data.seq_len=512", "data.packing=true"]
            docmask = COMMON + ["data.document_masking=true"]
            if nproc == 1:
                group["qwen2"] = COMMON + ["model=tiny_qwen2", "+recipe=ddp"]
                group["alpaca"] = alpaca_run + ["+recipe=ddp"]
                group["alpaca_packed"] = packed + ["+recipe=ddp"]
                group["docmask"] = docmask + ["+recipe=ddp"]
                group["weighted"] = COMMON + WEIGHTED + ["+recipe=ddp"]
            if nproc == 2:
                group["alpaca_pp"] = alpaca_run + ["+recipe=pp", "recipe.pp_pad_multiple=8"]
                # Packed rows: every pipeline stage gets the per-sample positions.
                group["alpaca_packed_pp"] = packed + ["+recipe=pp"]
                group["alpaca_packed_zero3"] = packed + ["+recipe=zero3"]
                group["alpaca_packed_tp"] = packed + ["+recipe=tp"]
                group["docmask_pp"] = docmask + ["+recipe=pp", "recipe.pp_schedule=interleaved_1f1b",
                                                 "recipe.pp_stages_per_rank=2"]
                group.update({f"weighted_{recipe}": COMMON + WEIGHTED + [f"+recipe={recipe}"]
                              for recipe in WEIGHTED_RECIPES})
                group.update({f"{recipe}_compile": COMMON + [f"+recipe={recipe}", "recipe.compile=true"]
                              for recipe in COMPILED_RECIPES})
            group.update({name: COMMON + o for name, o in NATIVE.get(nproc, {}).items()})
            root = tmp_path_factory.mktemp(f"runs-{nproc}")
            group.update({name: COMMON + o for name, o in fitting_runs(nproc, root).items()})
            cache[nproc] = run_scenarios(group, nproc, root)
        return cache[nproc]

    return get


def fitting_runs(nproc: int, root: Path) -> dict[str, list[str]]:
    """trainer.optimizer=muon / adafactor / adamw_8bit and recipe.fp8 (emulated): the plain run on 1
    process; on 2, the layouts each supports, and resumes of their step-4 checkpoints in the same
    launch (Muon's FSDP2 shards resumed on DDP: its momentum buffers resharded by DCP)."""
    fp8 = ["trainer.precision=bf16", "recipe.fp8=true", "recipe.fp8_emulate=true"]
    if nproc == 1:
        runs = {f"{name}_1": ["+recipe=ddp", f"trainer.optimizer={name}"] for name in ("muon", "adafactor", "adamw_8bit")}
        return {**runs, "bf16_1": ["+recipe=ddp", "trainer.precision=bf16"], "fp8_1": ["+recipe=ddp"] + fp8}
    if nproc != 2:
        return {}
    runs = {f"muon_{recipe}": [f"+recipe={recipe}", "trainer.optimizer=muon"] for recipe in ("ddp", "fsdp", "tp")}
    runs["adafactor_ddp"] = ["+recipe=ddp", "trainer.optimizer=adafactor"]
    runs["adafactor_pp"] = ["+recipe=pp", "trainer.optimizer=adafactor"]
    runs["adamw_8bit_ddp"] = ["+recipe=ddp", "trainer.optimizer=adamw_8bit"]
    runs["adamw_8bit_fsdp"] = ["+recipe=fsdp", "trainer.optimizer=adamw_8bit"]
    runs["fp8_fsdp"] = ["+recipe=fsdp"] + fp8
    runs["fp8_ddp"] = ["+recipe=ddp"] + fp8
    runs["adamw_8bit_fsdp_resumed"] = runs["adamw_8bit_fsdp"] + [
        f"trainer.resume={root / 'adamw_8bit_fsdp' / 'checkpoints' / 'step_4'}"]
    runs["muon_fsdp_resumed_ddp"] = runs["muon_ddp"] + [f"trainer.resume={root / 'muon_fsdp' / 'checkpoints' / 'step_4'}"]
    runs["adafactor_ddp_resumed"] = runs["adafactor_ddp"] + [
        f"trainer.resume={root / 'adafactor_ddp' / 'checkpoints' / 'step_4'}"]
    return runs


def _alpaca_file(path: Path) -> Path:
    import json
    import random

    rng = random.Random(0)
    records = [{"instruction": f"Count to {i}.", "input": "" if i % 3 else f"start at {i % 7}",
                "output": " ".join(str(k) for k in range(rng.randint(1, 12)))} for i in range(120)]
    path.write_text(json.dumps(records))
    return path


@pytest.fixture(scope="module")
def reference(runs):
    return lambda recipe, nproc: runs(nproc)[recipe]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3_torch", "zero3"])
def test_the_run_uses_the_recipe_the_composed_config_shows(name, runs):
    import yaml
    from omegaconf import OmegaConf

    from conftest import make_cfg

    overrides = NATIVE[2].get(name) or [f"+recipe={name}"]
    used = yaml.safe_load((runs(2)[name] / "config.yaml").read_text())
    assert used["recipe"] == OmegaConf.to_container(make_cfg(overrides).recipe, resolve=True)
    assert used["recipe"]["engine"] == ("torch" if name.endswith("torch") else "deepspeed")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_two_process_recipe_matches_plain_single_process(recipe, reference):
    plain, ours = reference("ddp", 1), reference(recipe, 2)  # one process + no recipe = plain torch
    want, got = steps(plain), steps(ours)
    assert sorted(got) == list(range(1, 7))
    for step in got:
        assert abs(got[step]["train/loss"] - want[step]["train/loss"]) < 1e-5, (step, got[step], want[step])
        assert got[step]["train/lr"] == pytest.approx(want[step]["train/lr"], rel=1e-12)
        assert got[step]["data/sample_digest"] == want[step]["data/sample_digest"]
    assert got[6]["train/loss"] < got[1]["train/loss"]
    exported, base = load_file(str(ours / "hf" / "model.safetensors")), load_file(str(plain / "hf" / "model.safetensors"))
    assert exported.keys() == base.keys()
    for name in base:
        torch.testing.assert_close(exported[name], base[name], rtol=0, atol=1e-4, msg=name)


# Every resume of a step-4 checkpoint on another world size or layout: name -> (saved run, its
# world size, engine that saved it, resumed recipe, resumed world size). The resumes of each world
# size train in one launch (the ``resumed`` fixture), after the launches that saved.
# ddp is left out: torch-engine checkpoints (DCP) across world sizes and layouts are covered by
# the layout changes (tp 2 -> one rank, pp 2 -> FSDP dp 2, pp 2 x tp 2 x dp 2 -> tp 2: DCP
# reshards). zero1 too: DeepSpeed saves, converts and loads ZeRO stages 1 and 2 with the same
# code (stage_1_and_2.py, ds_to_universal), and zero2 stays in. zero3 is resumed 2 -> 1;
# zero3_offload covers stage 3 the other way.
RESUMES = {
    "zero2_2_to_1": ("zero2", 2, "deepspeed", "zero2", 1), "zero2_1_to_2": ("zero2", 1, "deepspeed", "zero2", 2),
    "zero3_2_to_1": ("zero3", 2, "deepspeed", "zero3", 1),
    "zero3_offload_2_to_1": ("zero3_offload", 2, "deepspeed", "zero3_offload", 1),
    "zero3_offload_1_to_2": ("zero3_offload", 1, "deepspeed", "zero3_offload", 2),
    "tp_to_ddp": ("tp", 2, "torch", "ddp", 1), "pp_to_fsdp": ("pp", 2, "torch", "fsdp", 2),
    "3d_to_tp": ("3d", 8, "torch", "tp", 2),
}


@pytest.fixture(scope="module")
def resumed(runs, tmp_path_factory):
    """``name -> run_dir`` of a ``RESUMES`` run, each writing the model as loaded to
    ``run_dir.with_suffix('.loaded.pt')`` (``LLMTRAIN_DUMP_AFTER_LOAD``)."""
    cache: dict = {}

    def get(name: str) -> Path:
        nproc = RESUMES[name][4]
        if nproc not in cache:
            root = tmp_path_factory.mktemp(f"resumed-{nproc}")
            group, envs = {}, {}
            for key, (saved, nsaved, _, recipe, resumed_on) in RESUMES.items():
                if resumed_on == nproc:
                    checkpoint = runs(nsaved)[saved] / "checkpoints" / "step_4"
                    group[key] = COMMON + [f"+recipe={recipe}", f"trainer.resume={checkpoint}"]
                    envs[key] = {"LLMTRAIN_DUMP_AFTER_LOAD": str(root / f"{key}.loaded.pt")}
            cache[nproc] = run_scenarios(group, nproc, root, envs=envs)
        return cache[nproc][name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, (saved, *_, recipe, _) in RESUMES.items() if saved == recipe])
def test_resume_on_another_world_size(name, runs, resumed):
    assert_resumes_exactly(name, runs, resumed)


def assert_resumes_exactly(name: str, runs, resumed) -> None:
    """``RESUMES[name]``: the model right after loading is exactly the saved one, and training
    continues as the saved run did."""
    saved_run, nsaved, saved_engine = RESUMES[name][:3]
    source, run = runs(nsaved)[saved_run], resumed(name)
    checkpoint = source / "checkpoints" / "step_4"

    # (a) The model right after loading is exactly the saved one.
    saved = consolidated_state_dict(checkpoint, saved_engine)
    loaded = torch.load(run.with_suffix(".loaded.pt"))
    assert saved.keys() <= loaded.keys()
    for key in saved:
        assert torch.equal(saved[key].float(), loaded[key]), key

    # (b) Training continues with the same global samples (the data position is kept); losses
    # agree to rounding, and step 6 depends on the optimizer state (Adam moments, step count)
    # restored at step 4.
    want, got = steps(source), steps(run)
    assert sorted(got) == [5, 6]
    for step in (5, 6):
        assert got[step]["data/sample_digest"] == want[step]["data/sample_digest"]
        assert got[step]["train/samples_seen"] == want[step]["train/samples_seen"]
        assert abs(got[step]["train/loss"] - want[step]["train/loss"]) < 1e-5, (step, got[step], want[step])


def assert_same_run(got_dir: Path, want_dir: Path, atol: float = 1e-5, n_steps: int = 6) -> None:
    want, got = steps(want_dir), steps(got_dir)
    assert sorted(got) == sorted(want) == list(range(1, n_steps + 1))
    for step in got:
        assert abs(got[step]["train/loss"] - want[step]["train/loss"]) < atol, (step, got[step], want[step])
        assert got[step]["train/lr"] == pytest.approx(want[step]["train/lr"], rel=1e-12)
        assert got[step]["data/sample_digest"] == want[step]["data/sample_digest"]
    assert got[n_steps]["train/loss"] < got[1]["train/loss"]


# (dp_replicate, dp_shard, tp, pp) each torch-native recipe file gives on its world size.
DEGREES = {"fsdp": (1, 2, 1, 1), "tp": (1, 1, 2, 1), "pp": (1, 1, 1, 2), "hsdp": (2, 2, 1, 1),
           "fsdp_tp": (1, 2, 2, 1), "pp_fsdp": (1, 2, 1, 2), "3d": (1, 2, 2, 2)}


@pytest.mark.parametrize("nproc,name", [(n, name) for n, name in NATIVE_CASES if name in DEGREES])
def test_native_recipes_compose_to_their_degrees_and_accumulation(nproc, name):
    """In-process, for the fast tier: the layouts the launches below train, composed and validated
    for their world size; 16 samples a step of micro-batches of 4 over the data-parallel ranks."""
    from conftest import make_cfg
    from llmtrain.config.validate import validate

    shape = validate(make_cfg(COMMON + NATIVE[nproc][name]), nproc)
    assert (shape.dp_replicate, shape.dp_shard, shape.tp, shape.pp) == DEGREES[name]
    assert shape.accumulation == 16 // (4 * shape.dp)


@pytest.mark.slow
@pytest.mark.parametrize("nproc,name", NATIVE_CASES, ids=[name for _, name in NATIVE_CASES])
def test_torch_native_layout_matches_plain_single_process(nproc, name, runs):
    ours = runs(nproc)[name]
    plain = runs(1)["qwen2" if name.startswith("qwen2") else "ddp"]
    assert_same_run(ours, plain)
    # The parameters gathered from every layout (the exported safetensors) equal the plain run's.
    exported, base = load_file(str(ours / "hf" / "model.safetensors")), load_file(str(plain / "hf" / "model.safetensors"))
    assert exported.keys() == base.keys()
    for key in base:
        torch.testing.assert_close(exported[key], base[key], rtol=0, atol=1e-5, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", COMPILED_RECIPES)
def test_compiled_layers_match_plain_single_process(recipe, runs):
    compiled, eager = runs(2)[f"{recipe}_compile"], runs(2)[recipe]
    assert_same_run(compiled, runs(1)["ddp"])
    exported, base = load_file(str(compiled / "hf" / "model.safetensors")), load_file(str(eager / "hf" / "model.safetensors"))
    for key in base:
        torch.testing.assert_close(exported[key], base[key], rtol=0, atol=1e-5, msg=key)
    # Dynamo's own count of captured graphs: the knob compiled something (it once compiled nothing
    # on one process), and on fixed-length rows it stops recompiling after the first step.
    graphs = [r["perf/compiled_graphs"] for r in steps(compiled).values()]
    assert graphs[0] > 0 and len(set(graphs)) == 1, graphs
    assert "perf/compiled_graphs" not in steps(eager)[1]


@pytest.mark.slow
def test_pipeline_on_padded_instruction_data_matches_plain_single_process(runs):
    assert_same_run(runs(2)["alpaca_pp"], runs(1)["alpaca"], n_steps=ALPACA_STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("name,plain", [("alpaca_packed_pp", "alpaca_packed"), ("alpaca_packed_zero3", "alpaca_packed"),
                                        ("alpaca_packed_tp", "alpaca_packed"), ("docmask_pp", "docmask")])
def test_packed_rows_on_two_ranks_match_plain_single_process(name, plain, runs):
    assert_same_run(runs(2)[name], runs(1)[plain], n_steps=ALPACA_STEPS if plain == "alpaca_packed" else 6)
    # Packing changes the rows (several samples each), not what a sample contributes.
    if plain == "alpaca_packed":
        assert steps(runs(1)["alpaca_packed"])[1]["train/tokens_seen"] > 2 * steps(runs(1)["alpaca"])[1]["train/tokens_seen"]


@pytest.mark.slow
def test_export_cli_consolidates_a_3d_checkpoint(runs, tmp_path):
    """pp 2 x tp 2 x FSDP 2 shards (tied embedding on both end stages) -> one HF folder."""
    import subprocess
    import sys

    from conftest import REPO

    run = runs(8)["3d"]
    proc = subprocess.run([sys.executable, "-m", "llmtrain.export", str(run / "checkpoints" / "step_6"),
                           str(tmp_path / "out")], capture_output=True, text=True, env=subprocess_env(), cwd=REPO)
    assert_ok(proc)
    exported, live = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(str(run / "hf" / "model.safetensors"))
    assert exported.keys() == live.keys()
    for key in live:
        assert torch.equal(exported[key], live[key]), key


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["zero1", "zero2", "zero3", "zero3_offload"])
def test_zero_recipe_on_the_torch_engine_matches_deepspeed(recipe, runs):
    assert_same_run(runs(2)[f"{recipe}_torch"], runs(2)[recipe])


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, (saved, *_, recipe, _) in RESUMES.items() if saved != recipe])
def test_resume_across_a_layout_change(name, runs, resumed):
    """tp 2 -> one rank, pp 2 -> FSDP dp 2, pp 2 x tp 2 x dp 2 -> tp 2: DCP reshards."""
    assert_resumes_exactly(name, runs, resumed)


@pytest.mark.slow
def test_token_weighted_objective_reference_on_one_process(runs):
    """The 1-process run of the test objective (the reference of the two-process runs below)
    trained the weighted loss: on the same samples and initial weights, step 1's
    ``sum(w * CE) / sum(w)`` differs from the plain token mean, and the loss falls. The loss itself
    is checked against its equation, token by token, in tests/test_objectives.py."""
    got = steps(runs(1)["weighted"])
    plain = steps(runs(1)["ddp"])
    assert sorted(got) == list(range(1, 7))
    assert all(0.0 <= got[s]["train/accuracy"] <= 1.0 for s in got)
    # Same data, same initial weights: step 1 differs only by the weighting of the same tokens.
    assert got[1]["data/sample_digest"] == plain[1]["data/sample_digest"]
    assert abs(got[1]["train/loss"] - plain[1]["train/loss"]) > 1e-3
    assert got[6]["train/loss"] < got[1]["train/loss"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", WEIGHTED_RECIPES)
def test_token_weighted_objective_on_two_processes_matches_single_process(recipe, runs):
    """A new objective trains on DDP, FSDP2, ZeRO-3 (DeepSpeed) and the pipeline engine without
    touching them: per-step loss and its metric equal the single-process run, so each engine
    normalises by the objective's global-batch normaliser (token weights), not by tokens."""
    want, got = steps(runs(1)["weighted"]), steps(runs(2)[f"weighted_{recipe}"])
    assert sorted(got) == list(range(1, 7))
    for step in got:
        assert abs(got[step]["train/loss"] - want[step]["train/loss"]) < 1e-5, (step, got[step], want[step])
        assert abs(got[step]["train/accuracy"] - want[step]["train/accuracy"]) < 1e-6, step
        assert got[step]["data/sample_digest"] == want[step]["data/sample_digest"]


# Muon orthogonalises each update in bf16 (torch.optim.Muon's Newton-Schulz iteration): a gradient
# that differs in its last fp32 bits (another all-reduce order) can round one bf16 element of the
# update the other way, a 2^-8 relative change of that element, so layouts agree to ~1e-5 on the
# loss after 6 steps (measured: up to 4e-5) where AdamW's fp32 arithmetic agrees to ~1e-6.
MUON_ATOL = 1e-4


# (muon on zero3 with engine=torch is the fsdp layout: FSDP2 full shard.)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["muon_ddp", "muon_fsdp", "muon_tp", "adafactor_ddp",
                                  "adafactor_pp", "adamw_8bit_ddp", "adamw_8bit_fsdp"])
def test_optimizer_on_two_processes_matches_single_process(name, runs):
    optimizer = name.rsplit("_", 1)[0] if name.startswith("adamw_8bit") else name.split("_")[0]
    plain = runs(1)[f"{optimizer}_1"]
    assert_same_run(runs(2)[name], plain, atol=MUON_ATOL if optimizer == "muon" else 1e-5)
    # The optimizer is in effect: its curve is not AdamW's (8-bit AdamW's is, to its rounding).
    moved = abs(steps(plain)[6]["train/loss"] - steps(runs(1)["ddp"])[6]["train/loss"])
    assert moved > (0 if optimizer == "adamw_8bit" else 1e-3)


# adamw_8bit on fsdp equals one process because every shard of the tiny model holds >= 4096
# elements in whole 256-element blocks (torchao quantizes per rank's shard: smaller shards would
# keep fp32 moments where one process keeps 8-bit ones).
@pytest.mark.slow
@pytest.mark.parametrize("name,source", [("muon_fsdp_resumed_ddp", "muon_fsdp"), ("adafactor_ddp_resumed", "adafactor_ddp"),
                                         ("adamw_8bit_fsdp_resumed", "adamw_8bit_fsdp")])
def test_optimizer_state_resumes_exactly(name, source, runs):
    """Steps 5 and 6 after resuming step 4's checkpoint equal the uninterrupted run: step 5's
    update needed the restored state (Muon's momentum, Adafactor's factored moments)."""
    want, got = steps(runs(2)[source]), steps(runs(2)[name])
    assert sorted(got) == [5, 6]
    assert abs(got[5]["train/loss"] - want[5]["train/loss"]) < 1e-6  # the parameters after step 4, loaded
    atol = MUON_ATOL if name.startswith("muon") else 1e-6  # muon: resumed on another layout (ddp)
    assert abs(got[6]["train/loss"] - want[6]["train/loss"]) < atol
    assert got[6]["data/sample_digest"] == want[6]["data/sample_digest"]


@pytest.mark.slow
def test_resuming_with_another_optimizer_is_refused_by_name(runs):
    from omegaconf import OmegaConf

    from conftest import make_cfg
    from llmtrain.checkpoint.resume import config_differences

    checkpoint = runs(1)["muon_1"] / "checkpoints" / "step_4"
    current = OmegaConf.to_container(make_cfg(COMMON + ["+recipe=ddp", "trainer.optimizer=adafactor"]), resolve=True)
    assert any(d.startswith("trainer.optimizer") for d in config_differences(checkpoint, current))


# Emulated float8 (torchao: every matmul operand rounded to e4m3, output gradients to e5m2, then
# multiplied in higher precision): 3 mantissa bits are a relative rounding of up to 2^-4 per
# operand, averaging out over each dot product; on the tiny model the loss moves ~1e-3 relative
# to bf16 (measured up to 5.5e-3 absolute at loss ~5 over 6 steps). 2e-2 bounds that 4x over.
FP8_VS_BF16_ATOL = 2e-2


@pytest.mark.slow
def test_fp8_trains_within_float8_rounding_of_bf16_and_fsdp_matches_one_process(runs):
    bf16, fp8 = steps(runs(1)["bf16_1"]), steps(runs(1)["fp8_1"])
    for step in range(1, 7):
        assert abs(fp8[step]["train/loss"] - bf16[step]["train/loss"]) < FP8_VS_BF16_ATOL, step
    assert abs(fp8[1]["train/loss"] - bf16[1]["train/loss"]) > 1e-5  # the layers did run in float8
    assert fp8[6]["train/loss"] < fp8[1]["train/loss"] - 0.5
    # Tensorwise scales are the whole tensor's absolute maximum on every layout (FSDP2 all-reduces
    # it across shards and all-gathers the weights in float8). DDP rounds as one process does:
    # its first three steps equal one process's to 1e-6. A gradient one fp32 ulp apart (seen on an
    # AVX-512 CPU at step 3's backward, not on an AVX2 one) can then round a weight to the other
    # neighbouring float8 value, so the later steps get FSDP2's bound (measured 3e-4 at step 5).
    # FSDP2 also computes the ops outside the float8 matmuls (norms, attention, embedding) on its
    # bf16 param_dtype copy where one process keeps fp32 weights under autocast (measured 9e-4).
    assert_same_run(runs(2)["fp8_ddp"], runs(1)["fp8_1"], atol=5e-3)
    ddp, one = steps(runs(2)["fp8_ddp"]), steps(runs(1)["fp8_1"])
    for step in (1, 2, 3):
        assert abs(ddp[step]["train/loss"] - one[step]["train/loss"]) < 1e-6, step
    assert_same_run(runs(2)["fp8_fsdp"], runs(1)["fp8_1"], atol=5e-3)
