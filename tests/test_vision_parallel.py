"""Image-text SFT on several processes: every data-parallel recipe equals one process, also when a
rank's micro-batch holds no image or fewer images than another's; a SIGKILLed 2-rank run reruns
exactly, and its checkpoint resumes exactly on one process. tp/pp/cp are refused by name.

The data (written here): 6 steps of 4 samples, read in file order (``data.shuffle=false``) in
micro-batches of 1 (a checkpoint resumes with its micro-batch size): accumulation 4 on one
process, 2 on each of two. A step's
samples ``[4s, 4s + 4)`` split as rank 0 ``4s, 4s + 1`` and rank 1 ``4s + 2, 4s + 3``, so the records
are laid out for rank 1 to see no image in a whole step, a rank with 2 images beside one with 1,
and a step without any image (:func:`test_the_data_gives_ranks_without_images`).

The same two launches train Gemma 3 on zero3 and fsdp (and resume its checkpoints on one
process), DPO on image pairs (zero3, fsdp), GRPO on image prompts (fsdp) and Idefics3 QLoRA
(zero3), each beside its one-process reference (:func:`more_scenarios`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAST, make_cfg, read_metrics, run_scenarios, train_rows
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
    more = more_scenarios(data_file, tmp_path_factory.mktemp("objectives"))  # Gemma 3, DPO, GRPO: same launches
    two = run_scenarios({**{r: base + TWO + [f"+recipe={r}"] for r in RECIPES}, **more[2]}, 2,
                        tmp_path_factory.mktemp("two"))
    one = run_scenarios({"plain": base + ONE + ["+recipe=ddp"],
                         "zero3_2_to_1": base + ONE + ["+recipe=zero3", f"trainer.resume={two['zero3']}/checkpoints/step_4"],
                         "fsdp_2_to_1": base + ONE + ["+recipe=ddp", "engine=torch",
                                                      f"trainer.resume={two['fsdp']}/checkpoints/step_4"],
                         **more[1], **gemma3_resumed(two, data_file)},
                        1, tmp_path_factory.mktemp("one"))
    return {**two, **one}


def steps(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "train/loss" in r}


def assert_resumed(want: Path, got: Path) -> None:
    """``got`` (resumed from ``want``'s step-4 checkpoint on another world size) trained steps 5
    and 6 only, on ``want``'s samples, with its losses within 1e-5."""
    want, got = steps(want), steps(got)
    assert sorted(got) == [5, 6]
    for step in (5, 6):
        assert got[step]["data/sample_digest"] == want[step]["data/sample_digest"]
        assert abs(got[step]["train/loss"] - want[step]["train/loss"]) < 1e-5, (step, got[step], want[step])


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
    assert_same_run(plain, ours, STEPS)
    base = assert_same_weights(plain, ours)
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
    assert_resumed(runs[saved], runs[name])


@pytest.mark.slow
def test_sigkill_then_rerun_continues_exactly(runs, killed_and_rerun):
    """fsdp on 2 ranks held at step 6 (``LLMTRAIN_FAULT=stall``) after the step-4 checkpoint,
    SIGKILLed, and the same command run again: every step's loss, learning rate and samples are
    the uninterrupted run's, bit for bit."""
    assert_rerun_continued(killed_and_rerun["fsdp"], runs["fsdp"])


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


# --- Gemma 3 (fixed-size tower, pooled image tokens attending to each other both ways, tied head),
# and the DPO family and GRPO on image data: their runs join the two launches above.
# Its image is 10 tokens (``\n\n<start_of_image>``, 4 soft tokens, ``<end_of_image>\n\n``): a
# two-image sample needs more than 64.
GEMMA3 = [o.replace("model=tiny_idefics3", "model=tiny_gemma3") for o in COMMON] + ["data.seq_len=96"]
GEMMA3_RECIPES = ["zero3", "fsdp"]
# DPO pairs and GRPO prompts, 4 steps of 4 in file order (rank 0's two, then rank 1's two): 1 where
# the record holds an image. Rank 1 has none in step 1, rank 0 one beside rank 1's two in step 2,
# no rank any in step 3.
OBJECTIVE_LAYOUT = [[1, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 1]]
OBJECTIVE_STEPS = len(OBJECTIVE_LAYOUT)
PER_STEP = [f"trainer.max_steps={OBJECTIVE_STEPS}", "trainer.global_batch_size=4", "trainer.micro_batch_size=1",
            "data.shuffle=false", "data.val_fraction=0.01", "trainer.lr=3e-3", "trainer.warmup_steps=1"]
# The runs on 2 processes and their 1-process references: DPO on zero3 (its frozen reference copy
# is a second ZeRO-3 build) and fsdp, GRPO on fsdp (FSDP2 gathers in generation too).
OBJECTIVE_RUNS = {"dpo": ["zero3", "fsdp"], "grpo": ["fsdp"]}
# QLoRA on Idefics3 (4-bit language model, adapters on it and on the full-precision tower) on
# LAYOUT's data: ZeRO-3 gathers the packed codes like any frozen weight.
QLORA = ["+peft=qlora", "peft.parts=[language,vision]", "trainer.lr=1e-2"]


def with_held_out(rows: list[dict], held_out: dict) -> list[dict]:
    """``rows`` with ``held_out`` inserted where ``llmtrain.data._split`` draws the one validation
    record of ``data.val_fraction=0.01`` (from the seed), so training reads ``rows`` in order."""
    import numpy as np

    val = int(np.random.default_rng(make_cfg([]).trainer.seed).choice(len(rows) + 1, size=1)[0])
    return rows[:val] + [held_out] + rows[val:]


def image_pairs(folder: Path) -> Path:
    """DPO pairs in :data:`OBJECTIVE_LAYOUT`: an image pair (TRL's VLM layout), or the same pair
    with a text-only prompt and no images."""
    from test_vision_dpo import pair, write_pairs

    def text_pair(i: int) -> dict:
        return dict(pair(i), prompt=[{"role": "user", "content": [{"type": "text", "text": f"No picture {i}: colour?"}]}],
                    images=[])

    flat = [n for step in OBJECTIVE_LAYOUT for n in step]
    return write_pairs(folder, with_held_out([pair(i) if n else text_pair(i) for i, n in enumerate(flat)], text_pair(99)))


def image_prompts(folder: Path) -> Path:
    """GRPO prompts in :data:`OBJECTIVE_LAYOUT` (``test_vision_grpo.write_prompts``' squares, or
    the question without the picture), each with an ``answer``."""
    from test_vision_grpo import write_prompts

    path = write_prompts(folder, n=4 * OBJECTIVE_STEPS)
    rows = [json.loads(line) for line in path.read_text().splitlines()]

    def text_only(row: dict, i: int) -> dict:
        user = {"role": "user", "content": [{"type": "text", "text": f"Square {i} (no picture): which colour?"}]}
        return dict(row, messages=[user, row["messages"][1]], images=[])

    flat = [n for step in OBJECTIVE_LAYOUT for n in step]
    rows = with_held_out([row if n else text_only(row, i) for i, (row, n) in enumerate(zip(rows, flat))],
                         text_only(rows[0], 99))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def objective_overrides(name: str, path: Path) -> list[str]:
    fast = [o for o in FAST if not o.startswith(("data.max_bytes", "data.seq_len"))]
    if name == "dpo":
        return fast + ["model=tiny_idefics3", "data=preference", f"data.path={path}", "objective=dpo",
                       "data.seq_len=128", "data.max_prompt_tokens=null", *PER_STEP]
    from test_vision_grpo import overrides

    # Rewards that vary within a group (a random model never names the colour), so the
    # advantages, the loss and the gradients are not all zero.
    keep = [o for o in overrides(path, Path("unused")) if not o.startswith((
        "run_dir", "trainer.max_steps", "trainer.global_batch_size", "trainer.micro_batch_size", "data.val_fraction",
        "reward.functions", "objective.num_generations", "rollout.max_completion_length"))]
    return keep + ["reward.functions=[tests.grpo_fixtures:odd_tokens,answer]", "objective.num_generations=4",
                   "rollout.max_completion_length=6", "rollout.log_completions=16", *PER_STEP]


def more_scenarios(data_file: Path, folder: Path) -> dict[int, dict[str, list[str]]]:
    """nproc -> name -> overrides: Gemma 3 on :data:`GEMMA3_RECIPES` (2 processes) and on one
    process; DPO and GRPO (:data:`OBJECTIVE_RUNS`) and Idefics3 QLoRA (zero3) on 2 processes and
    on one."""
    paths = {"dpo": image_pairs(folder / "pairs"), "grpo": image_prompts(folder / "prompts")}
    gemma3 = GEMMA3 + [f"data.path={data_file}"]
    two = {f"gemma3_{r}": gemma3 + TWO + [f"+recipe={r}"] for r in GEMMA3_RECIPES}
    two.update({f"{n}_{r}": objective_overrides(n, paths[n]) + [f"+recipe={r}"]
                for n, recipes in OBJECTIVE_RUNS.items() for r in recipes})
    two["qlora_zero3"] = COMMON + [f"data.path={data_file}"] + TWO + QLORA + ["+recipe=zero3"]
    one = {"gemma3_plain": gemma3 + ONE + ["+recipe=ddp"],
           "qlora_one": COMMON + [f"data.path={data_file}"] + ONE + QLORA + ["+recipe=ddp"]}
    one.update({f"{n}_one": objective_overrides(n, paths[n]) + ["+recipe=ddp"] for n in OBJECTIVE_RUNS})
    return {2: two, 1: one}


def gemma3_resumed(two: dict[str, Path], data_file: Path) -> dict[str, list[str]]:
    """The 2-rank Gemma 3 step-4 checkpoints resumed on one process (as Idefics3's above)."""
    base = GEMMA3 + [f"data.path={data_file}"] + ONE
    return {"gemma3_zero3_2_to_1": base + ["+recipe=zero3", f"trainer.resume={two['gemma3_zero3']}/checkpoints/step_4"],
            "gemma3_fsdp_2_to_1": base + ["+recipe=ddp", "engine=torch",
                                          f"trainer.resume={two['gemma3_fsdp']}/checkpoints/step_4"]}


def assert_same_run(want: Path, got: Path, steps: int, keys: tuple[str, ...] = ("train/loss",)) -> None:
    """``got``'s steps 1..``steps`` read ``want``'s samples, with each of ``keys`` within 1e-5."""
    a, b = train_rows(want, steps), train_rows(got, steps)
    for x, y in zip(a, b):
        assert y["data/sample_digest"] == x["data/sample_digest"], f"step {x['step']}: other samples"
        for key in keys:
            assert abs(y[key] - x[key]) < 1e-5, (x["step"], key, y[key], x[key])


def assert_same_weights(want: Path, got: Path, atol: float = 1e-5) -> dict[str, torch.Tensor]:
    """The exports' tensors are the same names, each within ``atol``; returns ``want``'s."""
    base, exported = (load_file(str(run / "hf" / "model.safetensors")) for run in (want, got))
    assert exported.keys() == base.keys()
    for name in base:
        torch.testing.assert_close(exported[name], base[name], rtol=0, atol=atol, msg=name)
    return base


def test_gemma3_and_objective_data_give_ranks_without_images(data_file, tmp_path):
    """The training order of each added run is as laid out: Gemma 3 reads :data:`LAYOUT` (no
    sample dropped as too long with its longer image expansion), the DPO pairs and GRPO prompts
    :data:`OBJECTIVE_LAYOUT`."""
    from llmtrain import data
    from llmtrain.models.build import build_tokenizer

    def images_per_sample(overrides: list[str], prompts: bool = False) -> list[int]:
        cfg = make_cfg(overrides)
        budget = {"prompt_budget": cfg.data.seq_len - cfg.rollout.max_completion_length} if prompts else {}
        train = data.load_splits(cfg.data, build_tokenizer(cfg.model), seed=cfg.trainer.seed, **budget).train
        return [len(train[g]["images"]) for g in range(len(train))]

    counts = images_per_sample(GEMMA3 + [f"data.path={data_file}"])
    assert [counts[4 * s:4 * s + 4] for s in range(STEPS)] == LAYOUT and len(counts) == 4 * STEPS
    more = more_scenarios(data_file, tmp_path)
    for name in ("dpo", "grpo"):
        counts = images_per_sample(more[1][f"{name}_one"], prompts=name == "grpo")
        assert [counts[4 * s:4 * s + 4] for s in range(OBJECTIVE_STEPS)] == OBJECTIVE_LAYOUT, name


@pytest.mark.slow
@pytest.mark.parametrize("recipe", GEMMA3_RECIPES)
def test_gemma3_two_processes_equal_one_with_ranks_without_images(recipe, runs, tmp_path):
    """Gemma 3 as Idefics3 above: losses and exported weights within 1e-5 of one process, the
    tower trained (against the initial model saved the export's way: Gemma 3's saved names are
    not its module names)."""
    from llmtrain.models.build import build_model

    assert_same_run(runs["gemma3_plain"], runs[f"gemma3_{recipe}"], STEPS)
    base = assert_same_weights(runs["gemma3_plain"], runs[f"gemma3_{recipe}"])
    cfg = make_cfg(GEMMA3)
    build_model(cfg.model, seed=cfg.trainer.seed).save_pretrained(tmp_path)
    initial = load_file(str(tmp_path / "model.safetensors"))
    tower = [k for k in base if "vision_tower" in k and ".encoder." in k and k.endswith("weight")]
    assert tower and all(not torch.equal(base[k], initial[k]) for k in tower)


@pytest.mark.slow
@pytest.mark.parametrize("saved", GEMMA3_RECIPES)
def test_gemma3_two_rank_checkpoint_resumes_on_one_process(saved, runs):
    assert_resumed(runs[f"gemma3_{saved}"], runs[f"gemma3_{saved}_2_to_1"])


@pytest.mark.slow
def test_gemma3_sigkill_then_rerun_continues_exactly(runs, killed_and_rerun):
    """Gemma 3 on zero3 (2 ranks) SIGKILLed after step 5 (its step-4 checkpoint saved) and run
    again with the same command: every step's loss, learning rate and samples are the
    uninterrupted run's, bit for bit."""
    assert_rerun_continued(killed_and_rerun["gemma3_zero3"], runs["gemma3_zero3"])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", OBJECTIVE_RUNS["dpo"])
def test_dpo_on_image_pairs_on_two_processes_equals_one(recipe, runs):
    """DPO (frozen reference copy) on 2 processes with ranks without images: each step's loss,
    reward margin and accuracy within 1e-5 of one process, and the exported weights; the
    policy moved off the reference (the loss left log 2)."""
    import math

    keys = ("train/loss", "train/rewards/margins", "train/rewards/accuracies")
    assert_same_run(runs["dpo_one"], runs[f"dpo_{recipe}"], OBJECTIVE_STEPS, keys)
    assert_same_weights(runs["dpo_one"], runs[f"dpo_{recipe}"])
    assert abs(train_rows(runs["dpo_one"], OBJECTIVE_STEPS)[-1]["train/loss"] - math.log(2)) > 1e-3


@pytest.mark.slow
def test_grpo_on_image_prompts_on_two_processes_samples_the_completions_of_one(runs):
    """GRPO on FSDP2 x 2 with ranks without images: every step's logged completions (the whole
    global batch, gathered) are one process's, token for token, with the same rewards; losses and
    gradient norms within 1e-5."""
    one, two = runs["grpo_one"], runs["grpo_fsdp"]
    assert_same_run(one, two, OBJECTIVE_STEPS, ("train/loss", "train/grad_norm", "train/reward"))
    keys = ("record", "tokens", "rewards", "advantage")
    for step in range(1, OBJECTIVE_STEPS + 1):
        want, got = ([json.loads(line) for line in (run / "completions" / f"step_{step}.jsonl").read_text().splitlines()]
                     for run in (one, two))
        assert len(want) == 16 and [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in want], step
        assert [r["rank"] for r in got] == [0] * 8 + [1] * 8
    assert any(abs(r["train/loss"]) > 1e-3 for r in train_rows(one, OBJECTIVE_STEPS))


@pytest.mark.slow
def test_qlora_on_images_on_two_processes_equals_one(runs):
    """Idefics3 QLoRA on ZeRO-3 x 2 with ranks without images: each step's loss within 1e-5 of
    one process, and the loss fell."""
    assert_same_run(runs["qlora_one"], runs["qlora_zero3"], STEPS)
    rows = train_rows(runs["qlora_one"], STEPS)
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.1


# Qwen2-VL (tiny_qwen2vl): its images are patch rows with a grid each (image_grid_thw) and its
# positions M-RoPE's, from token types added at the forward; a rank without images runs the tower
# on the blank image as the other families do. Its own two launches: zero3 and fsdp on 2 processes,
# then one process plain and resumed from the 2-rank fsdp checkpoint; zero3's run is also the
# uninterrupted one a SIGKILLed and rerun zero3 run must equal.
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
    assert_same_run(plain, ours, STEPS)
    base = assert_same_weights(plain, ours, atol=2e-5)
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
    assert_resumed(qwen_runs["fsdp"], qwen_runs["fsdp_2_to_1"])


@pytest.mark.slow
def test_qwen2vl_sigkill_then_rerun_continues_exactly(qwen_runs, killed_and_rerun):
    """tiny_qwen2vl on zero3 (2 ranks) SIGKILLed after step 5 (its step-4 checkpoint saved) and
    run again with the same command: every step's loss, learning rate and samples are the
    uninterrupted 2-rank run's, bit for bit."""
    assert_rerun_continued(killed_and_rerun["qwen2vl_zero3"], qwen_runs["zero3"])


@pytest.fixture(scope="module")
def killed_and_rerun(data_file, tmp_path_factory):
    """Idefics3 on fsdp, Gemma 3 and Qwen2-VL on zero3 (2 ranks, rank 1 held at step 6 after the
    step-4 checkpoint), each SIGKILLed after step 5 in a launch of its own, and the same commands
    run again, in one launch (``test_resume.kill_then_rerun_together``)."""
    from test_resume import kill_then_rerun_together

    runs = {"fsdp": COMMON + [f"data.path={data_file}"] + TWO + ["+recipe=fsdp"],
            "gemma3_zero3": GEMMA3 + [f"data.path={data_file}"] + TWO + ["+recipe=zero3"],
            "qwen2vl_zero3": QWEN + [f"data.path={data_file}"] + TWO + ["+recipe=zero3"]}
    return kill_then_rerun_together(runs, tmp_path_factory.mktemp("killed"), rank=1)


def assert_rerun_continued(run, uninterrupted: Path) -> None:
    """The killed process of ``run`` (a ``test_resume.Rerun``) had saved step 4 and exported
    nothing; the rerun's every step's loss, learning rate and samples are ``uninterrupted``'s,
    bit for bit."""
    from test_resume import per_step

    assert "checkpoints/step_4" in run.files_after_kill and "hf" not in run.files_after_kill
    got = per_step(run.run_dir)
    assert [row[0] for row in got] == list(range(1, STEPS + 1))
    assert got == per_step(uninterrupted)
