"""Crash-safe checkpoints and exact resume (SIGKILL, SIGTERM, damaged and interrupted saves).

Every comparison is against an uninterrupted run of the same command: per-step loss, learning
rate and the digest of the samples seen must be identical (bitwise: fp32 on CPU). Dropout is on
and gradient accumulation > 1; the data set is small enough that the runs cross epochs.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from conftest import (FAST, REPO, SHARED_DATA, assert_ok, cores_for, read_metrics, run_cli, run_scenarios, scenario_log,
                      subprocess_env)

STEPS = 8
# max_bytes=8000 gives 123 training blocks of 64 tokens: a resume at step 4 (192 samples consumed)
# lands in the middle of the second epoch, and the 8 steps (384 samples) reach into the fourth.
COMMON = [o for o in FAST if not o.startswith("data.max_bytes")] + [
    "data.max_bytes=8000", f"trainer.max_steps={STEPS}", "trainer.global_batch_size=48",
    "trainer.micro_batch_size=8", "trainer.save_every=2", "trainer.warmup_steps=3",
    "model.architecture.attention_dropout=0.1", "trainer.export_hf=false"]


def per_step(run_dir: Path) -> list[tuple]:
    rows = [r for r in read_metrics(run_dir) if "train/loss" in r]
    return [(r["step"], r["train/loss"], r["train/lr"], r["data/sample_digest"], r["train/samples_seen"]) for r in rows]


def launch(overrides: list[str], nproc: int, env: dict | None = None) -> subprocess.Popen:
    if nproc == 1:
        cmd = [sys.executable, "-m", "llmtrain"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "llmtrain"]
    return subprocess.Popen(cmd + overrides, cwd=REPO, env=env or subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def stalled_after(step: int, env: dict | None = None, rank: int = 0) -> dict:
    """``env`` (default: the tests' own) in which ``rank`` stalls on entering step ``step + 1``
    (``LLMTRAIN_FAULT``, monitoring/watchdog.py): a kill once ``step`` is logged lands before step
    ``step + 1`` trains or saves, however busy the cores are, so a kill test needs no machine to
    itself. The rerun must use an environment without it (the stall holds on every first attempt)."""
    return {**(env or subprocess_env()), "LLMTRAIN_FAULT": f"stall:{rank}:{step + 1}"}


def kill_after(overrides: list[str], run_dir: Path, step: int, nproc: int, env: dict | None = None,
               rank: int = 0, timeout: float = 300) -> None:
    """Launch ``python -m llmtrain OVERRIDES`` (under torchrun for ``nproc`` > 1) writing to
    ``run_dir``, with ``rank`` stalled on entering step ``step + 1`` (:func:`stalled_after`), and
    SIGKILL its process group once ``step`` is logged: killed after step ``step``, before step
    ``step + 1`` trains or saves. Holds the cores of an ``nproc`` launch (``conftest.cores_for``)."""
    with cores_for(nproc):
        proc = launch(overrides, nproc=nproc, env=stalled_after(step, env, rank))
        wait_for_step(proc, run_dir, step, timeout=timeout)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and any(json.loads(l).get("step", -1) >= step and "train/loss" in json.loads(l)
                                 for l in path.read_text().splitlines() if l.strip()):
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before step {step}:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


# zero1 is left out of the SIGKILL matrix: DeepSpeed saves and loads ZeRO stages 1 and 2 with
# the same code (stage_1_and_2.py), and zero2 stays in. zero3_offload too: its checkpoint is
# zero3's plus DeepSpeedCPUAdam's state, whose exact resume test_recipes.py checks across world
# sizes (saved on 2 ranks, resumed on 1, and back).
KILL_RECIPES = ["ddp", "zero2", "zero3", "fsdp", "tp", "pp"]
# LoRA runs (adapter-only checkpoints, the base rebuilt from its source on resume), with LoRA
# dropout so the resumed random streams matter too.
LORA_RUNS = {"lora_zero2": ["+recipe=zero2", "+peft=lora", "peft.dropout=0.1"],
             "lora_fsdp": ["+recipe=fsdp", "+peft=lora", "peft.dropout=0.1"],
             # QLoRA: the 4-bit base is quantized again from its source on resume, to the same codes.
             "qlora_zero3": ["+recipe=zero3", "+peft=qlora", "peft.dropout=0.1"]}


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> list[str]:
    """Overrides of a packed 0.7/0.3 mixture of instruction records and ShareGPT conversations
    (written here, so the test needs no shared data), on FSDP."""
    folder = tmp_path_factory.mktemp("mix-data")
    (folder / "alpaca.json").write_text(json.dumps(
        [{"instruction": f"Add {i} and {i % 7}.", "input": "", "output": str(i + i % 7)} for i in range(150)]))
    (folder / "sharegpt.json").write_text(json.dumps([{"conversations": [
        {"from": "human", "value": f"Who is {i}?"}, {"from": "gpt", "value": f"{i} is a number."},
        {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "Yes."}]} for i in range(60)]))
    # Background saves (DTensor shards written by DCP's thread): the SIGKILL test below resumes
    # from one, and the single-process background tests compare them with synchronous saves.
    return ["data=mix", f"data.datasets.0.path={folder / 'alpaca.json'}", f"data.datasets.1.path={folder / 'sharegpt.json'}",
            "data.template=chatml", "data.seq_len=128", "data.packing=true", "+recipe=fsdp", "trainer.async_checkpoint=true"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, mixture) -> dict:
    """Uninterrupted runs: every KILL_RECIPES run (and the mixture) on 2 processes in one launch,
    plain on 1."""
    cache: dict = {}

    def get(nproc: int, recipe: str) -> list[tuple]:
        if nproc not in cache:
            runs = {r: COMMON + [f"+recipe={r}"] for r in (KILL_RECIPES if nproc == 2 else ["ddp"])}
            if nproc == 2:
                runs["mix"] = COMMON + mixture
                runs.update({name: COMMON + overrides for name, overrides in LORA_RUNS.items()})
            dirs = run_scenarios(runs, nproc, tmp_path_factory.mktemp(f"ref-{nproc}"))
            cache[nproc] = {r: per_step(d) for r, d in dirs.items()}
            cache[nproc, "metrics"] = {r: read_metrics(d) for r, d in dirs.items()}
            cache[nproc, "dirs"] = dirs
        return cache[nproc][recipe]

    get.metrics = lambda nproc, recipe: cache[nproc, "metrics"][recipe]
    get.run_dir = lambda nproc, recipe: (get(nproc, recipe), cache[nproc, "dirs"][recipe])[1]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("recipe,equal", [("ddp", False), ("pp", False), ("tp", True)])
def test_each_data_parallel_rank_and_pipeline_stage_draws_its_own_dropout_stream(recipe, equal, reference):
    # Before: every rank seeded with trainer.seed, so both ranks saved equal states everywhere.

    step_dir = reference.run_dir(2, recipe) / "checkpoints" / f"step_{STEPS}"
    states = [torch.load(step_dir / f"rank_{r}.pt", weights_only=False)["torch"] for r in (0, 1)]
    assert torch.equal(states[0], states[1]) == equal  # TP ranks share a stream, DP ranks and stages do not


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` (SQLite store, local artifacts, a free port) for this module."""
    import socket
    import urllib.request

    root = tmp_path_factory.mktemp("mlflow")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
                               "--port", str(port), "--workers", "1", "--backend-store-uri",
                               f"sqlite:///{root / 'store.db'}", "--default-artifact-root", str(root / "artifacts")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                              # Its job runner (unused here) makes a /dev/shm folder that it never removes.
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(uri + "/health", timeout=2)
            break
        except OSError:
            assert server.poll() is None and time.time() < deadline, "mlflow server did not start"
            time.sleep(0.5)
    yield uri
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:  # its shutdown ran past 30 s at a load of 20 on 2 cores: not what is tested
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


def mlflow_history(uri: str, experiment: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key`` in the experiment's live run (a run superseded after a crash is
    FAILED and tagged; exactly one other run must remain)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    live = [r for r in runs if "llmtrain.superseded_by" not in r.data.tags]
    assert len(live) == 1 and live[0].info.status == "FINISHED", [(r.info.run_id, r.info.status) for r in runs]
    return sorted((m.step, m.value) for m in client.get_metric_history(live[0].info.run_id, key))


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard reads the run's event files (orphans purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def wandb_history(run_dir: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key`` across the run's offline wandb folders in ``wandb sync`` order."""
    from llmtrain.monitoring.tracking.wandb_backend import offline_folders, offline_history

    (run_id,) = {p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")}
    rows = []
    for folder in offline_folders(run_dir, run_id):
        history = offline_history(folder)
        rows += [(step, history[step][key]) for step in sorted(history) if key in history[step]]
    return rows


def _hh_pairs_file(folder: Path) -> Path:
    """``folder`` holding a ``hh_rlhf_harmless_test.jsonl.gz`` of 16 made-up pairs in HH-RLHF's
    layout: hh_local's file for a machine without the downloads (../shared/data)."""
    import gzip

    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(folder / "hh_rlhf_harmless_test.jsonl.gz", "wt", encoding="utf-8") as f:
        for i in range(16):
            prompt = f"\n\nHuman: What is {i} plus {i}?\n\nAssistant:"
            f.write(json.dumps({"chosen": f"{prompt} It is {2 * i}.", "rejected": f"{prompt} No idea, figure it out."}) + "\n")
    return folder


# The killed runs whose rerun shares one launch (run_scenarios): a SIGKILL ends its own launch, so
# each kill is a launch of its own, but the same commands again need not be. zero3's rerun stays a
# command of its own: its goodput and trackers count the relaunch of a process.
SHARED_RERUNS = [r for r in KILL_RECIPES + list(LORA_RUNS) if r != "zero3"] + ["mix"]


def killed_rows(run_dir: Path) -> list[dict]:
    """The train records a killed process left (a line the kill cut short is skipped)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.endswith("}") and "train/loss" in line]


class Rerun(NamedTuple):
    """One run of :func:`kill_then_rerun_together`: its folder, the train records and the files
    (paths relative to the folder) its killed process left, and what the rerun logged."""

    run_dir: Path
    killed: list[dict]
    files_after_kill: set[str]
    log: str


def kill_then_rerun_together(runs: dict[str, list[str]], root: Path, rank: int = 0) -> dict[str, Rerun]:
    """Each ``name -> overrides`` run on 2 processes in ``root/name``, ``rank`` stalled on entering
    step 6 and SIGKILLed after step 5 (:func:`kill_after`: one launch each, as a SIGKILL ends its
    launch), then all the same commands again in one launch (``run_scenarios``): start-up paid once
    for every rerun."""
    killed = {}
    for name, overrides in runs.items():
        run_dir = root / name
        kill_after(overrides + [f"run_dir={run_dir}"], run_dir, 5, nproc=2, rank=rank)
        killed[name] = (killed_rows(run_dir), {str(p.relative_to(run_dir)) for p in run_dir.rglob("*")})
    dirs = run_scenarios(runs, 2, root, logs=True)  # each rerun's run_dir is its killed run's
    return {name: Rerun(dirs[name], *killed[name], scenario_log(dirs[name])) for name in runs}


@pytest.fixture(scope="module")
def killed_and_rerun(tmp_path_factory, mixture) -> dict[str, Rerun]:
    """SHARED_RERUNS, each SIGKILLed after step 5 (a checkpoint at step 4 exists, step 5 is lost)
    and run again, the reruns in one launch."""
    runs = {name: COMMON + (mixture if name == "mix" else LORA_RUNS.get(name, [f"+recipe={name}"]))
            for name in SHARED_RERUNS}
    return kill_then_rerun_together(runs, tmp_path_factory.mktemp("killed"))


def _killed_and_rerun_alone(overrides: list[str], run_dir: Path, env: dict) -> tuple[list[dict], str]:
    """A run SIGKILLed after step 5, then the same command again: (the killed process's train
    records, the rerun's output)."""
    kill_after(overrides, run_dir, 5, nproc=2, env=env)
    before = killed_rows(run_dir)
    resumed = run_cli(overrides, nproc=2, env=env)
    assert_ok(resumed)
    return before, resumed.stdout + resumed.stderr


def assert_continued_exactly(run_dir: Path, killed: list[dict], output: str, reference_rows: list[tuple]) -> list[tuple]:
    """The rerun resumed, said what the kill cost, and logged steps 1..STEPS once each, equal to
    the uninterrupted run's; returns its per-step rows."""
    assert "resuming from" in output
    # The rerun says what the kill cost: the killed process's last logged step, the checkpoint
    # it resumes from, and the difference.
    killed_at = max(r["step"] for r in killed)
    redone = "1 step is" if killed_at == 5 else f"{killed_at - 4} steps are"
    assert (f"ended after step {killed_at} without its final save (killed or crashed) and with no checkpoint "
            f"since step 4: {redone} redone") in output, output
    got = per_step(run_dir)
    assert [row[0] for row in got] == list(range(1, STEPS + 1))  # one record per step, none twice
    assert got == reference_rows  # scoring checkpoints in other processes changes nothing of the training
    return got


@pytest.mark.slow
@pytest.mark.parametrize("recipe", KILL_RECIPES + list(LORA_RUNS))
def test_sigkill_then_same_command_continues_exactly(recipe, reference, tmp_path, request):
    if recipe != "zero3":
        run = request.getfixturevalue("killed_and_rerun")[recipe]
        assert_continued_exactly(run.run_dir, run.killed, run.log, reference(2, recipe))
        return
    # Trackers are bookkeeping: adding them to the killed run changes nothing else.
    uri = request.getfixturevalue("mlflow_server")
    overrides = COMMON + [f"+recipe={recipe}", f"run_dir={tmp_path}"] + [
        "tracker.backends=[wandb,tensorboard,mlflow]", "tracker.wandb_mode=offline",
        f"tracker.mlflow_uri={uri}", f"tracker.mlflow_experiment={tmp_path.name}",
        "trainer.peak_tflops=0.5", "tracker.report=true",  # a stated peak: MFU is logged
        # Task scores of checkpoints 4 and 8, each in a process of its own: the kill
        # after step 5 meets the evaluation of step 4 running (or just logged).
        "trainer.eval_tasks=[hh_local]", "trainer.eval_tasks_every=4", "trainer.eval_tasks_limit=8"]
    env = subprocess_env()
    if not SHARED_DATA.is_dir():  # hh_local's file, where the downloads are not here
        env["LLMTRAIN_DATA_DIR"] = str(_hh_pairs_file(tmp_path.parent / f"{tmp_path.name}-data"))
    killed, output = _killed_and_rerun_alone(overrides, tmp_path, env)
    got = assert_continued_exactly(tmp_path, killed, output, reference(2, recipe))
    _check_trackers(tmp_path, uri, got)
    _check_task_scores(tmp_path, uri)


def _check_task_scores(run_dir: Path, uri: str) -> None:
    """In-loop task scores across the SIGKILL and resume: the scores of checkpoints 4 and 8 are
    each logged once, at their own step, in metrics.jsonl, TensorBoard, MLflow and wandb (there
    with ``eval/step``, as the steps had moved on when they arrived), equal to their result files."""
    key = "eval/hh_local/acc"
    scores = {step: json.loads((run_dir / "eval" / f"step_{step}.json").read_text())["scores"][key] for step in (4, 8)}
    expected = sorted(scores.items())
    assert [(r["step"], r[key]) for r in read_metrics(run_dir) if key in r] == expected
    assert [(s, pytest.approx(v)) for s, v in tensorboard_scalars(run_dir, key)] == expected
    assert mlflow_history(uri, run_dir.name, key) == [(s, pytest.approx(v)) for s, v in expected]
    assert sorted((int(step), value) for step, value in zip(
        (v for _, v in wandb_history(run_dir, "eval/step")), (v for _, v in wandb_history(run_dir, key)))) == expected
    assert "## Task scores (lm-evaluation-harness)" in (run_dir / "report.md").read_text()


def _check_trackers(run_dir: Path, uri: str, got: list[tuple]) -> None:
    """wandb (its offline folders, in sync order), TensorBoard and MLflow hold steps 1..8 once
    each with the values metrics.jsonl holds, MFU and goodput included; the report shows the
    resume."""
    import numpy as np

    losses = [(row[0], row[1]) for row in got]
    assert [(s, np.float32(v)) for s, v in tensorboard_scalars(run_dir, "train/loss")] == \
        [(s, np.float32(v)) for s, v in losses]
    assert mlflow_history(uri, run_dir.name, "train/loss") == losses
    assert wandb_history(run_dir, "train/loss") == losses
    rows = {r["step"]: r for r in read_metrics(run_dir) if "train/loss" in r}
    for key in ("perf/mfu", "time/goodput"):
        expected = [(s, rows[s][key]) for s in sorted(rows)]
        assert wandb_history(run_dir, key) == expected, key
        assert mlflow_history(uri, run_dir.name, key) == [(s, pytest.approx(v)) for s, v in expected], key
        assert [s for s, _ in tensorboard_scalars(run_dir, key)] == sorted(rows), key
    assert rows[1]["perf/mfu"] == pytest.approx(rows[1]["perf/tflops_per_device"] / 0.5)
    # Goodput: the killed process's work after checkpoint 4 is lost time, the gap until the
    # relaunch restart time; the parts never exceed the wall time since the first start.
    assert rows[4]["time/lost_s"] == rows[4]["time/restart_s"] == 0
    assert rows[5]["time/lost_s"] > 0 and rows[5]["time/restart_s"] > 0
    for r in rows.values():
        parts = sum(r[f"time/{k}_s"] for k in ("productive", "startup", "eval", "checkpoint", "lost", "restart"))
        assert parts <= r["time/wall_s"] * 1.01 and r["time/goodput"] == pytest.approx(
            r["time/productive_s"] / r["time/wall_s"], rel=1e-3)
    # The run report, written at the end: two processes, the first killed, the second resumed at 4.
    report = (run_dir / "report.md").read_text()
    assert (run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 1 |" in report and "| 2 |" in report and "killed or crashed" in report, report
    assert f"| final train loss | {got[-1][1]:.4f} |" in report, report
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    (live,) = [r for r in client.search_runs([client.get_experiment_by_name(run_dir.name).experiment_id])
               if "llmtrain.superseded_by" not in r.data.tags]
    assert {a.path for a in client.list_artifacts(live.info.run_id)} >= {"config.yaml", "report.png", "report.md"}


def test_a_rerun_names_the_unfinished_process_and_the_steps_it_redoes(tmp_path):
    """A start without an end in timeline.jsonl is a process that did not end cleanly; its last
    logged step comes from metrics.jsonl records written after that start (a line cut short by
    the kill is skipped), and the redone steps are counted from the checkpoint resumed."""
    from llmtrain.monitoring import goodput

    (tmp_path / "timeline.jsonl").write_text(
        json.dumps({"event": "start", "time": 100.0, "step": 0, "host": "n1", "pid": 7}) + "\n"
        + json.dumps({"event": "end", "time": 200.0, "step": 3, "reason": "preempted"}) + "\n"
        + json.dumps({"event": "start", "time": 300.0, "step": 3, "host": "n2", "pid": 9}) + "\n")
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "train/loss": 1.0, "time": t}) + "\n"
                for s, t in ((1, 110.0), (2, 120.0), (3, 130.0), (4, 310.0), (5, 320.0), (6, 330.0)))
        + '{"step": 7, "train/lo')
    previous = goodput.unfinished_process(tmp_path)
    assert (previous["host"], previous["pid"], previous["step"], previous["last_step"]) == ("n2", 9, 3, 6)
    line = goodput.describe_unfinished(previous, resumed_step=4)
    assert line.startswith("the previous process (started 1970-01-01 00:05:00 UTC on n2, pid 9) ended after step 6 ")
    assert line.endswith("no checkpoint since step 4: 2 steps are redone. trainer.save_every=N or "
                         "trainer.save_every_minutes=M bounds the work a crash loses")
    assert "no checkpoint at all: 6 steps are redone" in goodput.describe_unfinished(previous, resumed_step=0)
    with open(tmp_path / "timeline.jsonl", "a") as f:
        f.write('{"event": "end", "ti')  # a kill mid-write: the next event still gets a line of its own
    goodput.timeline_event(tmp_path, "end", step=8, reason="finished")
    assert json.loads((tmp_path / "timeline.jsonl").read_text().splitlines()[-1])["step"] == 8
    assert goodput.unfinished_process(tmp_path) is None
    assert goodput.unfinished_process(tmp_path / "never-ran") is None


@pytest.mark.slow
def test_sigkill_of_a_packed_mixture_continues_exactly_and_counts_sources(killed_and_rerun, reference):
    got = per_step(killed_and_rerun["mix"].run_dir)
    assert [row[0] for row in got] == list(range(1, STEPS + 1))
    assert got == reference(2, "mix")
    counts = [(r["data/source/alpaca_samples"], r["data/source/sharegpt_samples"])
              for r in reference.metrics(2, "mix") if "train/loss" in r]
    assert all(a + b == 48 for a, b in counts)  # the global batch, split between the sources
    share = sum(a for a, _ in counts) / (48 * len(counts))
    assert abs(share - 0.7) < 3 * (0.7 * 0.3 / (48 * len(counts))) ** 0.5, share  # within 3 sigma


@pytest.mark.slow
def test_kill_during_save_resumes_from_previous_checkpoint(reference, tmp_path):
    overrides = COMMON + ["+recipe=ddp", f"run_dir={tmp_path}"]
    env = subprocess_env()
    env["LLMTRAIN_FAULT"] = "save_before_marker:6"
    overrides += ["tracker.backends=[wandb]", "tracker.wandb_mode=offline"]
    crashed = run_cli(overrides, nproc=1, env=env)
    assert crashed.returncode != 0
    assert (tmp_path / "checkpoints" / ".tmp-step_6").is_dir()
    assert not (tmp_path / "checkpoints" / "step_6").exists()
    resumed = run_cli(overrides, nproc=1)
    assert_ok(resumed)
    out = resumed.stdout + resumed.stderr
    assert f"removed .tmp-step_6 in {tmp_path / 'checkpoints'}: unfinished checkpoint" in out and "step_4" in out
    assert not (tmp_path / "checkpoints" / ".tmp-step_6").exists()
    assert per_step(tmp_path) == reference(1, "ddp")
    # wandb too: the killed process never wrote steps 1-4 to its offline folder (wandb buffers);
    # the resumed one logged them from metrics.jsonl, so a sync in order uploads each step once.
    assert wandb_history(tmp_path, "train/loss") == [(row[0], row[1]) for row in per_step(tmp_path)]


@pytest.mark.slow
def test_async_checkpoints_on_two_ranks_seal_every_save(reference):
    reference(2, "mix")
    root = reference.run_dir(2, "mix") / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_6", "step_8"]  # keep 3; nothing unsealed
    from llmtrain.checkpoint.protocol import verify

    assert all(verify(root / name) is None for name in ("step_4", "step_6", "step_8"))
    stalls = [r["checkpoint/stall_s"] for r in reference.metrics(2, "mix") if "checkpoint/stall_s" in r]
    assert len(stalls) == 3  # the saves of steps 2, 4 and 6, reported with the step after each


@pytest.mark.slow
def test_steps_report_the_largest_rank_memory_and_model_tflops(reference):
    from omegaconf import OmegaConf

    from llmtrain.planning.flops import flops_per_token
    from llmtrain.models.build import model_config

    cfg = OmegaConf.load(reference.run_dir(2, "ddp") / "config.yaml")
    per_token = flops_per_token(model_config(cfg.model), cfg.data.seq_len)
    rows = [r for r in reference.metrics(2, "ddp") if "train/loss" in r]
    assert {r["memory/peak_rank"] for r in rows} <= {0, 1} and all(r["memory/peak_bytes"] > 2**20 for r in rows)
    # MFU on CPU too: against the peak the 2 ranks measured together by a matmul probe (or read
    # from the machine's cache), which the timeline records.
    from llmtrain.monitoring.report import read_jsonl

    (peak,) = [e for e in read_jsonl(reference.run_dir(2, "ddp") / "timeline.jsonl") if e["event"] == "peak_flops"]
    assert peak["source"] == "measured" and " thread(s) x 2 rank(s) on " in peak["detail"] and peak["tflops"] > 0
    for r in rows:  # 2 ranks: the global rate over 2 devices
        assert r["perf/tflops_per_device"] == pytest.approx(r["train/tokens_per_s"] * per_token / 2 / 1e12)
        assert r["perf/mfu"] == pytest.approx(r["perf/tflops_per_device"] / peak["tflops"])


@pytest.mark.slow
def test_kill_during_a_background_write_resumes_from_the_previous_checkpoint(reference, tmp_path):
    overrides = COMMON + ["+recipe=ddp", f"run_dir={tmp_path}", "trainer.async_checkpoint=true"]
    env = subprocess_env()
    env["LLMTRAIN_FAULT"] = "background_write:6"  # SIGKILL from the writer thread, mid-checkpoint
    crashed = run_cli(overrides, nproc=1, env=env)
    assert crashed.returncode == -signal.SIGKILL
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step_6", "step_2", "step_4"]
    assert not (root / ".tmp-step_6" / "COMPLETE.json").exists()
    resumed = run_cli(overrides, nproc=1)
    assert_ok(resumed)
    assert f"resuming from {root / 'step_4'}" in resumed.stdout + resumed.stderr
    assert per_step(tmp_path) == reference(1, "ddp")  # the same run as the synchronous one


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("damage,problem", [
    (lambda d: (d / "COMPLETE.json").unlink(), "no completion marker"),
    (lambda d: _truncate(d / "engine" / "__0_0.distcp"), "truncated file engine/__0_0.distcp"),
    (lambda d: _flip_byte(d / "engine" / ".metadata"), "checksum mismatch in engine/.metadata"),
])
def test_damaged_newest_checkpoint_is_skipped_loudly(damage, problem, reference, tmp_path):
    run_dir = _copy_of_finished_run(reference, tmp_path / "run")
    damage(run_dir / "checkpoints" / "step_8")
    # Same command again: the finished run's newest checkpoint is bad, so steps 7-8 are redone.
    resumed = run_cli(COMMON + ["+recipe=ddp", f"run_dir={run_dir}"], nproc=1)
    assert_ok(resumed)
    out = resumed.stdout + resumed.stderr
    assert "SKIPPING checkpoint" in out and problem in out and "resuming from" in out and "step_6" in out
    assert per_step(run_dir) == reference(1, "ddp")


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_continues_exactly(reference, tmp_path):
    overrides = COMMON + ["+recipe=ddp", f"run_dir={tmp_path}", "trainer.save_every=0"]
    proc = launch(overrides, nproc=1)
    wait_for_step(proc, tmp_path, 3)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    saved = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert len(saved) == 1 and saved[0].startswith("step_") and "preempted" in out
    assert_ok(run_cli(overrides, nproc=1))
    assert per_step(tmp_path) == reference(1, "ddp")


@pytest.mark.slow
def test_preempt_signal_on_one_rank_stops_all_ranks_at_the_same_step(tmp_path):
    import psutil

    # 200 steps: the run is still going when the signal arrives, however busy the cores are.
    overrides = COMMON + ["+recipe=ddp", f"run_dir={tmp_path}", "trainer.save_every=0", "trainer.max_steps=200"]
    with cores_for(2):
        proc = launch(overrides, nproc=2)
        wait_for_step(proc, tmp_path, 2)
        workers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                   if "torch.distributed.run" not in c.cmdline()]
        assert len(workers) == 2
        workers[-1].send_signal(signal.SIGUSR1)   # SLURM's warning signal, to one rank only
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert len(list((tmp_path / "checkpoints").glob("step_*"))) == 1


@pytest.mark.parametrize("resume,needle", [("7", "step 7 does not exist"), ("/nonexistent/ckpt", "path /nonexistent/ckpt does not exist")])
def test_explicit_missing_checkpoint_fails_and_writes_nothing(resume, needle, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(COMMON + [f"run_dir={run_dir}", f"trainer.resume={resume}"])
    assert proc.returncode != 0
    assert needle in proc.stdout + proc.stderr
    assert not run_dir.exists()


def _copy_of_finished_run(reference, tmp_path) -> Path:
    """A finished single-process run (the reference's, copied): checkpoints of steps 4, 6, 8."""
    shutil.copytree(reference.run_dir(1, "ddp"), tmp_path, dirs_exist_ok=True)
    return tmp_path


@pytest.mark.slow
def test_resume_never_refuses_to_clobber_checkpoints(reference, tmp_path):
    _copy_of_finished_run(reference, tmp_path)
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    proc = run_cli(COMMON + [f"run_dir={tmp_path}", "trainer.resume=never"])
    assert proc.returncode != 0 and "trainer.resume=never" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def test_keep_k_newest_complete_checkpoints(tmp_path):
    assert_ok(run_cli(COMMON + [f"run_dir={tmp_path}", "trainer.save_every=1", "trainer.keep_checkpoints=2"]))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_7", "step_8"]


@pytest.mark.slow
def test_resume_with_another_global_batch_is_refused_before_writing(reference, tmp_path):
    _copy_of_finished_run(reference, tmp_path)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    proc = run_cli(COMMON + [f"run_dir={tmp_path}", "trainer.global_batch_size=24"])
    assert proc.returncode != 0
    assert "trainer.global_batch_size=48" in proc.stderr and "got 24" in proc.stderr
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_resume_with_other_settings_is_refused_naming_them(tmp_path):
    assert_ok(run_cli(COMMON + [f"run_dir={tmp_path}", "trainer.max_steps=4"]))
    proc = run_cli(COMMON + [f"run_dir={tmp_path}", "trainer.lr=3e-4", "data.seq_len=32"])
    assert proc.returncode != 0
    assert "trainer.lr: 0.001 -> 0.0003" in proc.stderr and "data.seq_len: 64 -> 32" in proc.stderr
    # A longer run and other cadences are fine: that is how a run is extended; the first resumed
    # step already follows the new schedule (warmup 3, cosine to step 6), not the old one's end.
    longer = run_cli(COMMON + [f"run_dir={tmp_path}", "trainer.max_steps=6", "trainer.save_every=1"])
    assert_ok(longer)
    metrics = read_metrics(tmp_path)
    assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5, 6]  # trainer.eval_every=0: no step-0 evaluation
    expected = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (4 - 3) / (6 - 3))))
    assert metrics[4]["train/lr"] == pytest.approx(expected, rel=1e-12)  # step 5


def test_a_max_steps_below_the_checkpoint_says_what_it_exports_and_how_to_go_on(tmp_path):
    """trainer.max_steps lowered below the checkpoint's step: the warning says the checkpoint is
    past it, what is exported (that step's weights, or nothing with export_hf=false) and how to
    train more or start over (before: "step 4 >= trainer.max_steps=2 ...; exporting only", also
    with export_hf=false)."""
    assert_ok(run_cli(COMMON + [f"run_dir={tmp_path}", "trainer.max_steps=4"]))  # checkpoints of steps 2 and 4
    checkpoint = tmp_path / "checkpoints" / "step_4"
    go_on = "To train more, raise trainer.max_steps above 4; to start over, give a new name= (or run_dir=)"
    proc = run_cli(COMMON + [f"run_dir={tmp_path}", "trainer.max_steps=2"])
    assert_ok(proc)
    assert (f"checkpoint {checkpoint} (step 4) is past trainer.max_steps (4 > 2); nothing to train, exporting "
            f"nothing (trainer.export_hf=false). {go_on}") in proc.stdout, proc.stdout[-3000:]
    assert not (tmp_path / "hf").exists()
    proc = run_cli(COMMON + [f"run_dir={tmp_path}", "trainer.max_steps=4", "trainer.export_hf=true"])
    assert_ok(proc)
    assert (f"checkpoint {checkpoint} (step 4) is at trainer.max_steps=4: the run is finished; nothing to train, "
            f"exporting step 4's weights. {go_on}") in proc.stdout, proc.stdout[-3000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert [r["step"] for r in read_metrics(tmp_path) if "train/loss" in r] == [1, 2, 3, 4]


@pytest.mark.slow
def test_orphaned_workers_die_with_their_launcher(tmp_path):
    import psutil

    with cores_for(2):
        proc = launch(COMMON + ["+recipe=ddp", f"run_dir={tmp_path}", "trainer.max_steps=200"], nproc=2)
        wait_for_step(proc, tmp_path, 1)
        workers = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only: workers live in their own sessions
        proc.wait()
        gone, alive = psutil.wait_procs(workers, timeout=20)
    assert not alive, [p.cmdline() for p in alive]


def test_second_live_run_in_the_same_run_dir_is_refused(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from llmtrain.checkpoint.protocol import lock_run_dir; lock_run_dir(Path(sys.argv[1])); "
                               "print('locked', flush=True); time.sleep(60)", str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = run_cli(COMMON + [f"run_dir={tmp_path}"])
        assert proc.returncode != 0 and "in use by another llmtrain process" in proc.stderr
        assert not (tmp_path / "checkpoints").exists()
    finally:
        holder.kill()


def test_a_branch_from_an_older_step_is_continued_and_the_abandoned_future_kept(tmp_path):
    # Before: with keep_checkpoints=1 the branch's steps 5 and 6 were pruned as soon as written
    # (the old step 8 ranked higher), and resume=auto after a crash went back to the old step 8.
    base = [o for o in COMMON if not o.startswith(("trainer.save_every", "model.architecture"))] + ["+recipe=ddp",
                                                                                                  f"run_dir={tmp_path}"]
    assert_ok(run_cli(base + ["trainer.save_every=2", "trainer.keep_checkpoints=4"]))
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4", "step_6", "step_8"]
    env = subprocess_env()
    env["LLMTRAIN_FAULT"] = "save_before_marker:7"
    crashed = run_cli(base + ["trainer.resume=4", "trainer.save_every=1", "trainer.keep_checkpoints=1"], env=env)
    assert crashed.returncode != 0
    abandoned = [p for p in root.iterdir() if p.name.startswith("abandoned-")]
    assert len(abandoned) == 1 and sorted(p.name for p in abandoned[0].iterdir()) == ["step_6", "step_8"]
    assert "starts a new branch" in crashed.stdout + crashed.stderr
    # keep 1 on this branch: step_6 is the newest written (step_4, step_5 pruned), the crash left step 7 unsealed.
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith("abandoned-")) == [".tmp-step_7", "step_6"]
    assert json.loads((root / "step_6" / "trainer_state.json").read_text())["parent"] == "step_5"
    resumed = run_cli(base + ["trainer.save_every=1", "trainer.keep_checkpoints=1"])
    assert_ok(resumed)
    assert f"resuming from {root / 'step_6'}" in resumed.stdout + resumed.stderr
    assert sorted(p.name for p in abandoned[0].iterdir()) == ["step_6", "step_8"]  # never deleted
