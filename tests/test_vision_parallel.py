"""Image-text SFT on several processes: every data-parallel recipe equals one process, also when a
rank's micro-batch holds no image or fewer images than another's; a SIGKILLed 2-rank run reruns
exactly, and its checkpoint resumes exactly on one process. tp/pp/cp are refused by name.

The data (written here): 6 steps of 4 samples, read in file order (``data.shuffle=false``) in
micro-batches of 1 (a checkpoint resumes with its micro-batch size): accumulation 4 on one
process, 2 on each of two. A step's
samples ``[4s, 4s + 4)`` split as rank 0 ``4s, 4s + 1`` and rank 1 ``4s + 2, 4s + 3``, so the records
are laid out for rank 1 to see no image in a whole step, a rank with 2 images beside one with 1,
and a step without any image (:func:`test_the_data_gives_ranks_without_images`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAST, assert_ok, make_cfg, read_metrics, run_cli, run_scenarios
from test_vision import QUESTION, record, write_dataset

STEPS = 6
# Per step, the image count of each sample in order (rank 0's two, then rank 1's two).
LAYOUT = [[1, 1, 0, 0], [2, 0, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0], [1, 0, 0, 2], [1, 1, 1, 1]]
COMMON = [o for o in FAST if not o.startswith("data.max_bytes")] + [
    "model=tiny_idefics3", "data=vlm_chat", "data.shuffle=false", "data.val_fraction=0.01",
    f"trainer.max_steps={STEPS}", "trainer.save_every=4", "trainer.global_batch_size=4", "trainer.warmup_steps=2",
    "trainer.lr=3e-3"]
ONE = TWO = ["trainer.micro_batch_size=1"]
RECIPES = ["ddp", "zero2", "zero3", "fsdp"]


def text_record(i: int) -> dict:
    """A record without images (same layout, empty ``images``)."""
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": f"{QUESTION} (no picture {i})"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "none"}]}], "images": []}


def mixed_records() -> list[dict]:
    """:data:`LAYOUT`'s records, and one more where the validation sample is drawn
    (``llmtrain.data._split``: one index of the 25, from the seed)."""
    import numpy as np

    colours = ["red", "green", "blue", "white"]
    rows = []
    for i, count in enumerate(n for step in LAYOUT for n in step):
        names = [f"images/{colours[(i + k) % 4]}.png" for k in range(count)]
        rows.append(record(names, colours[i % 4], parts=count) if count else text_record(i))
    val = int(np.random.default_rng(make_cfg(COMMON).trainer.seed).choice(len(rows) + 1, size=1)[0])
    return rows[:val] + [text_record(99)] + rows[val:]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("mixed"), mixed_records())


@pytest.fixture(scope="module")
def runs(data_file, tmp_path_factory):
    """name -> run_dir: the recipes on 2 processes (one launch), then on 1 process (one launch)
    the plain reference and the step-4 checkpoints of zero3 and fsdp resumed there."""
    base = COMMON + [f"data.path={data_file}"]
    two = run_scenarios({r: base + TWO + [f"+recipe={r}"] for r in RECIPES}, 2, tmp_path_factory.mktemp("two"))
    one = run_scenarios({"plain": base + ONE + ["+recipe=ddp"],
                         "zero3_2_to_1": base + ONE + ["+recipe=zero3", f"trainer.resume={two['zero3']}/checkpoints/step_4"],
                         "fsdp_2_to_1": base + ONE + ["+recipe=ddp", "engine=torch",
                                                      f"trainer.resume={two['fsdp']}/checkpoints/step_4"]},
                        1, tmp_path_factory.mktemp("one"))
    return {**two, **one}


def steps(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "train/loss" in r}


def test_the_data_gives_ranks_without_images(data_file):
    """The training order the runs read (file order less the validation sample) is LAYOUT's:
    rank 1 holds no image in step 1, rank 0 two images beside rank 1's one in step 2, no rank an
    image in step 3."""
    from llmtrain import data
    from llmtrain.models.build import build_tokenizer

    cfg = make_cfg(COMMON + [f"data.path={data_file}"])
    splits = data.load_splits(cfg.data, build_tokenizer(cfg.model), seed=cfg.trainer.seed)
    counts = [len(splits.train[g]["images"]) for g in range(4 * STEPS)]
    assert [counts[4 * s:4 * s + 4] for s in range(STEPS)] == LAYOUT


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_two_processes_equal_one_with_ranks_without_images(recipe, runs):
    """Losses per step within 1e-5 and the exported weights within 1e-5 of one process; the
    vision tower trained (its weights moved from their initial values)."""
    plain, ours = runs["plain"], runs[recipe]
    want, got = steps(plain), steps(ours)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert abs(got[step]["train/loss"] - want[step]["train/loss"]) < 1e-5, (step, got[step], want[step])
        assert got[step]["data/sample_digest"] == want[step]["data/sample_digest"]
    exported, base = load_file(str(ours / "hf" / "model.safetensors")), load_file(str(plain / "hf" / "model.safetensors"))
    assert exported.keys() == base.keys()
    for name in base:
        torch.testing.assert_close(exported[name], base[name], rtol=0, atol=1e-5, msg=name)
    from llmtrain.models.build import build_model

    cfg = make_cfg(COMMON)
    initial = build_model(cfg.model, seed=cfg.trainer.seed).state_dict()
    tower = [k for k in base if "vision_model.encoder" in k and k.endswith("weight")]
    assert tower and all(not torch.equal(base[k], initial[k]) for k in tower)


@pytest.mark.slow
@pytest.mark.parametrize("name, saved", [("zero3_2_to_1", "zero3"), ("fsdp_2_to_1", "fsdp")])
def test_a_two_rank_checkpoint_resumes_on_one_process(name, saved, runs):
    """Steps 5 and 6 on one process from the 2-rank step-4 checkpoint: the same samples and the
    2-rank run's losses within 1e-5."""
    want, got = steps(runs[saved]), steps(runs[name])
    assert sorted(got) == [5, 6]
    for step in (5, 6):
        assert got[step]["data/sample_digest"] == want[step]["data/sample_digest"]
        assert abs(got[step]["train/loss"] - want[step]["train/loss"]) < 1e-5, (step, got[step], want[step])


@pytest.mark.slow
@pytest.mark.alone  # a 2-rank launch it kills (conftest.machine_alone)
def test_sigkill_then_rerun_continues_exactly(runs, data_file, tmp_path):
    """fsdp on 2 ranks held at step 6 (``LLMTRAIN_FAULT=stall``) after the step-4 checkpoint,
    SIGKILLed, and the same command run again: every step's loss, learning rate and samples are
    the uninterrupted run's, bit for bit."""
    from test_resume import kill_after, per_step

    overrides = COMMON + [f"data.path={data_file}"] + TWO + ["+recipe=fsdp", f"run_dir={tmp_path}"]
    kill_after(overrides, tmp_path, 5, nproc=2, rank=1)
    assert (tmp_path / "checkpoints" / "step_4").is_dir() and not (tmp_path / "hf").exists()
    assert_ok(run_cli(overrides, nproc=2))
    got = per_step(tmp_path)
    assert [row[0] for row in got] == list(range(1, STEPS + 1))
    assert got == per_step(runs["fsdp"])


@pytest.mark.parametrize("overrides, field", [(["+recipe=tp"], "recipe.tp=-1 (tensor parallel)"),
                                              (["+recipe=pp"], "recipe.pp=-1 (pipeline parallel)"),
                                              (["+recipe=fsdp", "recipe.cp=2"], "recipe.cp=2 (context parallel)")])
def test_tensor_pipeline_and_context_parallel_are_refused_by_name(overrides, field, tmp_path):
    """The checks a 2-rank launch makes before it builds or writes anything (validate, then
    preflight): one ConfigError naming the recipe and the field; the same recipes pass for a
    text-only model."""
    from llmtrain.common.errors import ConfigError
    from llmtrain.planning.preflight import validate_and_preflight

    common = COMMON + TWO + [f"data.path={write_dataset(tmp_path)}", f"run_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError) as err:
        validate_and_preflight(make_cfg(common + overrides), world_size=2)
    recipe = overrides[0].split("=")[1]
    assert str(err.value).startswith(f"recipe={recipe}: {field} is not supported for the image-text model idefics3"), err
    assert "\n" not in str(err.value) and "fsdp or hsdp" in str(err.value)
    validate_and_preflight(make_cfg(common + overrides + ["model=tiny_llama"]), world_size=2)
    assert not (tmp_path / "run").exists()


# Qwen2-VL (tiny_qwen2vl): its images are patch rows with a grid each (image_grid_thw) and its
# positions M-RoPE's, from token types added at the forward; a rank without images runs the tower
# on the blank image as the other families do. Its own two launches: zero3 and fsdp on 2 processes,
# then one process plain and resumed from the 2-rank fsdp checkpoint.
QWEN = [o for o in COMMON if not o.startswith("model=")] + ["model=tiny_qwen2vl"]
QWEN_RECIPES = ["zero3", "fsdp"]


@pytest.fixture(scope="module")
def qwen_runs(data_file, tmp_path_factory):
    """name -> run_dir of tiny_qwen2vl: QWEN_RECIPES on 2 processes (one launch), then on 1
    process (one launch) the plain reference and fsdp's step-4 checkpoint resumed there."""
    base = QWEN + [f"data.path={data_file}"]
    two = run_scenarios({r: base + TWO + [f"+recipe={r}"] for r in QWEN_RECIPES}, 2, tmp_path_factory.mktemp("qwen_two"))
    one = run_scenarios({"plain": base + ONE + ["+recipe=ddp"],
                         "fsdp_2_to_1": base + ONE + ["+recipe=ddp", "engine=torch",
                                                      f"trainer.resume={two['fsdp']}/checkpoints/step_4"]},
                        1, tmp_path_factory.mktemp("qwen_one"))
    return {**two, **one}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", QWEN_RECIPES)
def test_qwen2vl_two_processes_equal_one_with_ranks_without_images(recipe, qwen_runs):
    """tiny_qwen2vl, the same records as tiny_idefics3's: losses per step within 1e-5 of one
    process (measured: at most 2.7e-7), the same samples, the exported weights within 2e-5 (AdamW
    divides by the root of its second moment, so the reduction order's rounding of a near-zero
    gradient moves its weight more: measured 1.0e-5 for zero3 on one element, 8.7e-7 for fsdp);
    the tower and its merger trained."""
    plain, ours = qwen_runs["plain"], qwen_runs[recipe]
    want, got = steps(plain), steps(ours)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert abs(got[step]["train/loss"] - want[step]["train/loss"]) < 1e-5, (step, got[step], want[step])
        assert got[step]["data/sample_digest"] == want[step]["data/sample_digest"]
    exported, base = load_file(str(ours / "hf" / "model.safetensors")), load_file(str(plain / "hf" / "model.safetensors"))
    assert exported.keys() == base.keys()
    for name in base:
        torch.testing.assert_close(exported[name], base[name], rtol=0, atol=2e-5, msg=name)
    from llmtrain.models.build import build_model

    cfg = make_cfg(QWEN)
    initial = build_model(cfg.model, seed=cfg.trainer.seed).state_dict()
    # The export keeps Qwen2-VL's checkpoint names (visual.*, model.layers.*), the model's are model.visual.*.
    tower = [k for k in base if k.startswith("visual.") and k.endswith("weight")]
    assert any(".merger." in k for k in tower) and all(not torch.equal(base[k], initial["model." + k]) for k in tower)


@pytest.mark.slow
def test_qwen2vl_two_rank_fsdp_checkpoint_resumes_on_one_process(qwen_runs):
    """Steps 5 and 6 on one process from tiny_qwen2vl's 2-rank fsdp step-4 checkpoint: the same
    samples and the 2-rank run's losses within 1e-5."""
    want, got = steps(qwen_runs["fsdp"]), steps(qwen_runs["fsdp_2_to_1"])
    assert sorted(got) == [5, 6]
    for step in (5, 6):
        assert got[step]["data/sample_digest"] == want[step]["data/sample_digest"]
        assert abs(got[step]["train/loss"] - want[step]["train/loss"]) < 1e-5, (step, got[step], want[step])
