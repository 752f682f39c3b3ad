"""Every recipe, on 1 and 2 processes: equivalence to a plain single-process run, and resume on a
different number of ranks (2 -> 1, 1 -> 2).

Reference runs (cached per recipe and world size): 6 steps of global batch 16, checkpoints at
steps 4 and 6, fp32 on CPU, no dropout. One process runs micro-batch 4 x accumulation 4, two run
4 x 2 x 2 ranks, so accumulation and data parallelism are both exercised.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAST, assert_ok, read_metrics, run_cli, subprocess_env
from llmtrain.export import consolidated_state_dict

RECIPES = ["ddp", "zero1", "zero2", "zero3", "zero3_offload"]
ENGINE = {"ddp": "torch"}
COMMON = FAST + ["trainer.max_steps=6", "trainer.save_every=4", "trainer.global_batch_size=16",
                 "trainer.micro_batch_size=4", "trainer.warmup_steps=2"]


def steps(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "train/loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache: dict = {}

    def get(recipe: str, nproc: int) -> Path:
        if (recipe, nproc) not in cache:
            run_dir = tmp_path_factory.mktemp(f"{recipe}-{nproc}")
            proc = run_cli(COMMON + [f"+recipe={recipe}", f"run_dir={run_dir}"], nproc=nproc)
            assert_ok(proc)
            assert f"accumulation {4 // nproc} x dp {nproc}" in proc.stdout + proc.stderr
            cache[recipe, nproc] = run_dir
        return cache[recipe, nproc]

    return get


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


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("saved_on,resumed_on", [(2, 1), (1, 2)])
def test_resume_on_another_world_size(recipe, saved_on, resumed_on, reference, tmp_path):
    ref = reference(recipe, saved_on)
    checkpoint = ref / "checkpoints" / "step_4"
    env = subprocess_env()
    env["LLMTRAIN_DUMP_AFTER_LOAD"] = str(tmp_path / "loaded.pt")
    proc = run_cli(COMMON + [f"+recipe={recipe}", f"run_dir={tmp_path / 'run'}", f"trainer.resume={checkpoint}"],
                   nproc=resumed_on, env=env)
    assert_ok(proc)

    # (a) The model right after loading is exactly the saved one.
    saved = consolidated_state_dict(checkpoint, ENGINE.get(recipe, "deepspeed"))
    loaded = torch.load(tmp_path / "loaded.pt")
    assert saved.keys() <= loaded.keys()
    for name in saved:
        assert torch.equal(saved[name].float(), loaded[name]), name

    # (b) Training continues with the same global samples; losses agree to rounding, and step 6
    # depends on the optimizer state (Adam moments, step count) restored at step 4.
    want, got = steps(ref), steps(tmp_path / "run")
    assert sorted(got) == [5, 6]
    for step in (5, 6):
        assert got[step]["data/sample_digest"] == want[step]["data/sample_digest"]
        assert got[step]["train/samples_seen"] == want[step]["train/samples_seen"]
        assert abs(got[step]["train/loss"] - want[step]["train/loss"]) < 1e-5, (step, got[step], want[step])
        assert got[step]["train/lr"] == pytest.approx(want[step]["train/lr"], rel=1e-12)
