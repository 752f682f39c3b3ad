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
@pytest.mark.slow
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


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """3 steps of ZeRO-0, 2 and 3 on 2 processes (one launch), fp32."""
    from conftest import run_scenarios

    runs = {"zero0": ["+recipe=zero1", "recipe.zero_stage=0"], "zero2": ["+recipe=zero2"], "zero3": ["+recipe=zero3"]}
    return run_scenarios({name: FAST + ["trainer.max_steps=3"] + extra for name, extra in runs.items()}, 2,
                         tmp_path_factory.mktemp("zero"))


def _export(checkpoint, out) -> None:
    assert_ok(subprocess.run([sys.executable, "-m", "llmtrain.export", str(checkpoint), str(out)],
                             capture_output=True, text=True, env=subprocess_env(), cwd=REPO))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["zero2", "zero3"])
def test_deepspeeds_zero_to_fp32_runs_as_documented_and_reproduces_the_export(recipe, zero_runs, tmp_path):
    import json

    from safetensors.torch import load_file

    run_dir = zero_runs[recipe]
    step_dir = run_dir / "checkpoints" / "step_3"
    # DeepSpeed's tag file names the engine folder, inside the checkpoint and under its marker.
    listed = json.loads((step_dir / "COMPLETE.json").read_text())["files"]
    assert {"latest", "zero_to_fp32.py"} <= set(listed) and (step_dir / "latest").read_text() == "engine"
    # docs/checkpoints.md's command, from a fresh process: cd CHECKPOINT && python zero_to_fp32.py . OUT
    # (its --safe_serialization aborts on tied embeddings, a DeepSpeed bug: DeepSpeed PR #8376).
    out = tmp_path / "fp32"
    assert_ok(subprocess.run([sys.executable, "zero_to_fp32.py", ".", str(out)],
                             capture_output=True, text=True, env=subprocess_env(), cwd=step_dir))
    got = torch.load(out / "pytorch_model.bin", weights_only=True)
    _export(step_dir, tmp_path / "exported")
    for folder in (tmp_path / "exported", run_dir / "hf"):  # the offline export and the run's own
        want = load_file(str(folder / "model.safetensors"))
        assert set(want) <= set(got), sorted(set(want) - set(got))[:5]
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (folder.name, name, (got[name] - tensor).abs().max().item())


@pytest.mark.slow
def test_zero0_checkpoints_export_under_weights_only(zero_runs, tmp_path):
    from safetensors.torch import load_file

    step_dir = zero_runs["zero0"] / "checkpoints" / "step_3"
    assert (step_dir / "latest").read_text() == "engine"
    _export(step_dir, tmp_path / "exported")  # mp_rank_00_model_states.pt read with weights_only=True
    got, want = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "exported", zero_runs["zero0"] / "hf"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_a_crafted_deepspeed_checkpoint_is_refused_by_export_and_resume(zero_runs, tmp_path):
    import shutil

    from test_checkpoint_trust import Payload, reseal

    run_dir = tmp_path / "run"
    shutil.copytree(zero_runs["zero2"], run_dir)
    step_dir = run_dir / "checkpoints" / "step_3"
    target = step_dir / "engine" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    marker = tmp_path / "payload-ran"
    state = torch.load(target, weights_only=False)
    state["optimizer_state_dict"]["extra"] = Payload(marker)
    torch.save(state, target)
    reseal(step_dir)
    proc = subprocess.run([sys.executable, "-m", "llmtrain.export", str(step_dir), str(tmp_path / "out")],
                          capture_output=True, text=True, env=subprocess_env(), cwd=REPO)
    assert proc.returncode == 2 and f"{target} holds pickled objects" in proc.stderr, proc.stderr[-3000:]
    # On resume (2 ranks: rank 1 checks this file), before DeepSpeed's loader opens anything.
    proc = run_cli(FAST + ["trainer.max_steps=4", "+recipe=zero2", f"run_dir={run_dir}"], nproc=2)
    assert proc.returncode != 0 and f"refusing DeepSpeed checkpoint {step_dir / 'engine'}: {target}" in proc.stderr, \
        proc.stderr[-3000:]
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_crafted_rank_file_of_rank_1_stops_both_ranks_on_resume(zero_runs, tmp_path):
    import shutil

    from test_checkpoint_trust import crafted_rng_file, reseal

    run_dir = tmp_path / "run"
    shutil.copytree(zero_runs["zero2"], run_dir)
    step_dir = run_dir / "checkpoints" / "step_3"
    marker = tmp_path / "payload-ran"
    crafted_rng_file(step_dir / "rank_1.pt", marker)
    reseal(step_dir)
    proc = run_cli(FAST + ["trainer.max_steps=4", "+recipe=zero2", f"run_dir={run_dir}"], nproc=2, timeout=300)
    # Every rank raises the same error (rank 0 included): no rank is left waiting in a collective.
    assert proc.returncode != 0 and proc.stderr.count(f"refusing RNG file {step_dir / 'rank_1.pt'}") >= 2, \
        proc.stderr[-3000:]
    assert not marker.exists() and not (run_dir / "checkpoints" / "step_4").exists()


def test_export_names_a_bad_out_dir_and_keeps_log_files_quiet(tmp_path):
    """OUT_DIR a file, or below one: a one-line error naming it, exit 2. Into a pipe: only the
    result line; no progress bars, no DeepSpeed prints (a one-process ZeRO-3 checkpoint)."""
    run_dir = tmp_path / "run"
    assert_ok(run_cli(FAST + ["trainer.max_steps=2", "trainer.export_hf=false", "+recipe=zero3", f"run_dir={run_dir}"]))
    step = run_dir / "checkpoints" / "step_2"
    (tmp_path / "a_file").write_text("mine")

    def export(out):
        return subprocess.run([sys.executable, "-m", "llmtrain.export", str(step), str(out)], capture_output=True,
                              text=True, env=subprocess_env(), cwd=REPO)

    for out, needle in ((tmp_path / "a_file", "is a file"), (tmp_path / "a_file" / "sub", "cannot be created")):
        proc = export(out)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert proc.stderr.startswith(f"llmtrain.export: error: OUT_DIR {out} {needle}") and proc.stderr.count("\n") == 1
    assert (tmp_path / "a_file").read_text() == "mine"
    proc = export(tmp_path / "out")
    assert_ok(proc)
    assert proc.stdout == f"exported {step} -> {tmp_path / 'out'}\n", proc.stdout
    assert "\r" not in proc.stderr and "it/s" not in proc.stderr and "zero checkpoint" not in proc.stderr, proc.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_an_export_imports_neither_deepspeed_nor_a_report_library(tmp_path):
    """A torch-engine run's export goes through transformers' save_pretrained, which imported
    DeepSpeed (and mlflow through DeepSpeed's autotuner) at every run's end only to test for a
    DeepSpeedEngine, 2-3 s of CPU time; the folder it writes is the same, and loads. The
    DeepSpeed engine imports deepspeed without mlflow (1.4 s of CPU time a rank), which stays
    importable for the tracker."""
    script = (
        "import sys, torch\n"
        "from conftest import make_cfg\n"
        "from llmtrain.checkpoint.export import save_hf_folder\n"
        "from llmtrain.models.build import build_model, build_tokenizer\n"
        "cfg = make_cfg([])\n"
        "model = build_model(cfg.model, 0)\n"
        f"save_hf_folder({{k: v.detach() for k, v in model.state_dict().items()}}, cfg.model, build_tokenizer(cfg.model), "
        f"__import__('pathlib').Path({str(tmp_path / 'hf')!r}))\n"
        "print(sorted(m for m in ('deepspeed', 'mlflow', 'matplotlib') if m in sys.modules))\n"
        # The DeepSpeed engine's import of deepspeed leaves mlflow out, and mlflow importable.
        "from llmtrain.engine.deepspeed_imports import _without_mlflow\n"
        "with _without_mlflow():\n"
        "    import deepspeed\n"
        "print('mlflow' in sys.modules)\n"
        "import mlflow\n"
        "print(mlflow.__name__)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(),
                          cwd=REPO / "tests", timeout=300)
    assert_ok(proc)
    assert proc.stdout.strip().splitlines()[-3:] == ["[]", "False", "mlflow"], proc.stdout
    from transformers import AutoModelForCausalLM

    from llmtrain.models.build import build_model
    from conftest import make_cfg

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    built = build_model(make_cfg([]).model, 0)
    for name, tensor in built.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
