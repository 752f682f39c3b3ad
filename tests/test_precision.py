"""bf16 on every engine: fp32 master weights that start at the initial weights, one optimizer
update per trainer step (the trainer checks the count after set-up and after every step), and
exports written from the fp32 master weights, at the end of the run and by ``llmtrain.export``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAST, REPO, assert_ok, run_scenarios, subprocess_env
from llmtrain.models import initial_value

BF16 = FAST + ["trainer.precision=bf16", "trainer.save_every=0"]
# lr=1e-30 makes the update vanish below fp32 resolution: the export after one step is the
# master copy as set-up left it.
UNMOVED = BF16 + ["trainer.max_steps=1", "trainer.lr=1e-30"]
RUNS = {
    "zero0": BF16 + ["+recipe=zero1", "recipe.zero_stage=0", "trainer.max_steps=3"],
    "zero1": UNMOVED + ["+recipe=zero1"], "zero2": UNMOVED + ["+recipe=zero2"], "zero3": UNMOVED + ["+recipe=zero3"],
    "fsdp": UNMOVED + ["+recipe=fsdp"], "ddp": UNMOVED + ["+recipe=ddp"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_scenarios(RUNS, 2, tmp_path_factory.mktemp("bf16"))


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "fsdp", "ddp"])
def test_bf16_master_weights_start_at_the_initial_weights_and_are_exported(name, runs):
    # DeepSpeed casts the model to bf16 and copies its master weights from the rounded values;
    # the engine puts the true initial weights there, and exports the master, not the bf16 copy.
    exported = load_file(str(runs[name] / "hf" / "model.safetensors"))
    for key, value in exported.items():
        assert value.dtype == torch.float32
        want = initial_value(key, value.shape, 1234, 0.02)  # trainer.seed, initializer_range
        assert torch.equal(value, want), (key, (value - want).abs().max())


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
    from llmtrain.checkpoint import TrainState
    from llmtrain.trainer import _check_optimizer_steps

    class Counting:
        def __init__(self, taken):
            self.taken = taken

        def optimizer_step_count(self):
            return self.taken

    _check_optimizer_steps(Counting(3), TrainState(step=4, skipped_updates=1))
    with pytest.raises(RuntimeError, match="applied 4 updates at trainer step 3"):
        _check_optimizer_steps(Counting(4), TrainState(step=3))
