"""`python -m llmtrain.export` turns a checkpoint of any recipe into a Hugging Face folder."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import FAST, REPO, assert_ok, run_cli, subprocess_env


def logits_of(folder) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "embeddings untied"
    ids = torch.arange(0, 200).reshape(2, 100) % 256
    with torch.no_grad():
        return model(input_ids=ids).logits


# The torch-engine path of the same code is covered by tests/test_recipes.py (resume checks).
@pytest.mark.parametrize("recipe,nproc", [("zero3", 2)])
def test_export_round_trip_keeps_ties_and_logits(recipe, nproc, tmp_path):
    run_dir = tmp_path / "run"
    # eval_samples=1 leaves rank 1 without a validation batch: evaluation must not hang under ZeRO-3.
    assert_ok(run_cli(FAST + ["trainer.max_steps=3", "trainer.eval_samples=1", f"+recipe={recipe}",
                              f"run_dir={run_dir}"], nproc=nproc))
    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-m", "llmtrain.export", str(run_dir / "checkpoints" / "step_3"), str(out)],
                          capture_output=True, text=True, env=subprocess_env(), cwd=REPO)
    assert_ok(proc)
    # run_dir/hf was gathered from the live (trained) engine; the export comes from the shards.
    torch.testing.assert_close(logits_of(out), logits_of(run_dir / "hf"), rtol=0, atol=1e-5)


def test_export_of_missing_checkpoint_fails_cleanly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "llmtrain.export", str(tmp_path / "nope"), str(tmp_path / "out")],
                          capture_output=True, text=True, env=subprocess_env(), cwd=REPO)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert not (tmp_path / "out").exists()
