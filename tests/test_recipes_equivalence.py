"""Each recipe on 2 processes reproduces a single-process run with the same global batch.

Global batch 16 = micro-batch 4 x accumulation 4 on one process and 4 x 2 x 2 ranks on two, so
gradient accumulation and data parallelism are both exercised. fp32 on CPU; losses per step
must agree within 1e-5 and the exported (ZeRO-3: consolidated) weights must match.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAST, assert_ok, read_metrics, run_cli

STEPS = 5
COMMON = FAST + [f"trainer.max_steps={STEPS}", "trainer.global_batch_size=16", "trainer.micro_batch_size=4",
                 "trainer.warmup_steps=2"]


def train_losses(run_dir: Path) -> tuple[list[float], list[float]]:
    records = [r for r in read_metrics(run_dir) if "train/loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["train/loss"] for r in records], [r["train/lr"] for r in records]


def exported_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "hf" / "model.safetensors"))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("baseline")
    assert_ok(run_cli(COMMON + [f"run_dir={run_dir}"]))
    return run_dir


@pytest.mark.parametrize("recipe", ["ddp", "zero1", "zero2", "zero3", "zero3_offload"])
def test_two_process_recipe_matches_single_process(recipe, baseline, tmp_path):
    proc = run_cli(COMMON + [f"+recipe={recipe}", f"run_dir={tmp_path}"], nproc=2)
    assert_ok(proc)
    assert "accumulation 2 x dp 2" in proc.stdout + proc.stderr
    losses, lrs = train_losses(tmp_path)
    base_losses, base_lrs = train_losses(baseline)
    assert max(abs(a - b) for a, b in zip(losses, base_losses)) < 1e-5, (losses, base_losses)
    assert lrs == pytest.approx(base_lrs, rel=1e-12)
    assert losses[-1] < losses[0]
    got, want = exported_weights(tmp_path), exported_weights(baseline)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-4, msg=name)
