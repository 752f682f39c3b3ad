"""Clusters through Hydra's submitit launcher: the SLURM preset's sbatch script, a launch whose
layout cannot run refused before anything is submitted or written, and a 2-task job of
submitit's local executor (``hydra/launcher=slurm_local``): its ranks from submitit's job
environment, a preemption signal (USR2, what submitit forwards) saved through llmtrain's
preemption path, the job requeued by submitit and resumed, with every step logged once and
per-step losses equal to the same run under torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FAST, REPO, assert_ok, read_metrics, run_cli, subprocess_env

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

STEPS = 8
COMMON = FAST + [f"trainer.max_steps={STEPS}", "trainer.global_batch_size=16", "trainer.micro_batch_size=4",
                 "trainer.warmup_steps=2", "trainer.export_hf=false", "+recipe=zero2"]


def _llmtrain(args: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmtrain", *args], capture_output=True, text=True, cwd=cwd,
                          env=subprocess_env(), timeout=600, **kwargs)


def test_slurm_preset_renders_the_sbatch_script_submitit_would_submit(tmp_path):
    """Nodes, tasks per node and GPUs from the preset (tasks follow gpus_per_node), the USR2
    warning submitit asks for before the time limit, and srun starting one task per rank."""
    proc = _llmtrain(["-m", "hydra/launcher=slurm", "hydra.launcher.render_only=true", "hydra.launcher.nodes=4",
                      "hydra.launcher.partition=gpu", "name=big", "+recipe=fsdp", "trainer.global_batch_size=32",
                      "trainer.micro_batch_size=1"], cwd=tmp_path)
    assert_ok(proc)
    script = proc.stdout
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --signal=USR2@120", "#SBATCH --time=240",
                 "#SBATCH --partition=gpu", "#SBATCH --job-name=llmtrain-big", "export SUBMITIT_EXECUTOR=slurm"):
        assert line + "\n" in script, (line, script)
    assert f"-u -m submitit.core._submit {tmp_path}/multirun/big/.submitit/%j" in script, script
    assert not (tmp_path / "multirun").exists()  # rendering submits and writes nothing


def test_a_layout_the_job_cannot_run_is_refused_before_anything_is_submitted(tmp_path):
    proc = _llmtrain(["-m", "hydra/launcher=slurm_local", "hydra.launcher.tasks_per_node=3", "name=bad",
                      "+recipe=tp"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("llmtrain: error: sweep job 0 (name=bad +recipe=tp) on hydra.launcher.nodes x "
                                   "tasks_per_node = 3 ranks: recipe.tp=3 must divide the model's attention heads (4) "
                                   "and KV heads (2)"), proc.stderr
    assert not any(tmp_path.iterdir())
    proc = _llmtrain(["-m", "hydra/launcher=slurm", "hydra.launcher.render_only=true", "hydra.launcher.nodes=0"],
                     cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == ("llmtrain: error: hydra.launcher.nodes=0 must be a whole "
                                                            "number >= 1"), proc.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.alone
def test_submitit_job_preempted_requeued_and_resumed_equals_torchrun(tmp_path):
    """Acceptance 3: 2 tasks of submitit's local executor train the zero2 run; USR2 after step 4
    (as submitit forwards SLURM's warning) saves through llmtrain's preemption path, submitit
    requeues the job, and the requeued tasks resume from that save. Steps 1..8 are logged once
    each, with the losses, learning rates and sample digests of the same run under torchrun."""
    reference = tmp_path / "torchrun"
    assert_ok(run_cli(COMMON + [f"run_dir={reference}"], nproc=2))
    sweep = tmp_path / "sweep"
    job = subprocess.Popen([sys.executable, "-m", "llmtrain", "-m", "hydra/launcher=slurm_local",
                            "hydra.launcher.tasks_per_node=2", f"hydra.sweep.dir={sweep}", *COMMON],
                           cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        tasks = _wait_for_step(job, sweep, 4)
        for pid in tasks:
            os.kill(pid, signal.SIGUSR2)
        output, _ = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, output
    (run_dir,) = [p for p in sweep.iterdir() if p.name.startswith("0_")]
    logs = "".join(p.read_text() for p in (sweep / ".submitit").rglob("*_0_log.*"))
    assert "preempted (SIGUSR2): saved step" in logs and "submitit requeues the job" in logs, logs[-4000:]
    assert "Requeued job" in logs and "resume=auto: resuming from" in logs, logs[-4000:]
    assert "2 rank(s)" in logs
    rows = [r for r in read_metrics(run_dir) if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once across the requeue
    keys = ("step", "train/loss", "train/lr", "data/sample_digest")
    expected = [tuple(r[k] for k in keys) for r in read_metrics(reference) if "train/loss" in r]
    assert [tuple(r[k] for k in keys) for r in rows] == expected
    events = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["event"] in ("start", "end")] == ["start", "end", "start", "end"]
    assert [e.get("reason") for e in events if e["event"] == "end"] == ["preempted", "finished"]


def _wait_for_step(job: subprocess.Popen, sweep: Path, step: int, timeout: float = 300) -> list[int]:
    """The job's task processes once its run has logged ``step``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for path in sweep.glob("0_*/metrics.jsonl"):
            if any(json.loads(line).get("step", -1) >= step and "train/loss" in line
                   for line in path.read_text().splitlines() if line.endswith("}")):
                listing = subprocess.run(["pgrep", "-f", f"submitit.core._submit {sweep}"], capture_output=True,
                                         text=True).stdout.split()
                return [int(pid) for pid in listing]
        if job.poll() is not None:
            raise AssertionError(f"the job ended before step {step}:\n{job.stdout.read()[-4000:]}")
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached in {timeout} s")
