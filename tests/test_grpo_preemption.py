"""Preemption while an online RL step samples (issue 59, item 6): the sampling loop gives up at
its next decode step, the step is dropped, the state of the last finished step is saved, the
process exits 0, and the same command continues as a run never interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch


def test_the_decode_loop_stops_at_the_step_its_flag_says(tmp_path):
    """``stop_when`` is asked before each decode step: True on the third ask raises after the
    prefill and two decode forwards (3 forwards), not at the end of ``max_new`` (8 tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.rollout.generate import Sampling, SamplingInterrupted, sample_batch

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    forwards, asked = [], []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    sampling = Sampling(max_new=8)

    def stop() -> bool:
        asked.append(1)
        return len(asked) == 3

    with pytest.raises(SamplingInterrupted, match="stopped at decode step 3 of at most 8"):
        sample_batch(model, [[1, 2, 3], [4, 5]], [11, 12], sampling, torch.device("cpu"), 4, 3, stop_when=stop)
    assert len(forwards) == 3
    forwards.clear()
    out = sample_batch(model, [[1, 2, 3], [4, 5]], [11, 12], sampling, torch.device("cpu"), 4, 3,
                       stop_when=lambda: False)
    assert len(forwards) == 8 and [len(c.ids) for c in out] == [8, 8]  # no end token in a random 64-token vocabulary


def _overrides(path, run_dir, *extra: str) -> list[str]:
    return ["objective=grpo", "data=prompts", f"data.path={path}", "data.columns.prompt=question", "data.seq_len=64",
            "reward.functions=[tests.grpo_fixtures:odd_tokens]", "rollout.max_completion_length=8",
            "rollout.engine=tests.grpo_fixtures:SlowPolicySampler", "objective.num_generations=2",
            "trainer.global_batch_size=2", "trainer.micro_batch_size=1", "trainer.max_steps=3",
            "trainer.eval_every=0", "trainer.eval_samples=2", "tracker=none", "trainer.progress_bar=false",
            "trainer.export_hf=false", "trainer.precision=fp32", f"run_dir={run_dir}", *extra]


def _by_step(run_dir) -> dict[int, tuple[float, float]]:
    from conftest import read_metrics

    return {r["step"]: (r["train/loss"], r["data/sample_digest"]) for r in read_metrics(run_dir) if "train/loss" in r}


def _questions(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i}+{i}?", "answer": f"#### {2 * i}"}) + "\n"
                            for i in range(12)), encoding="utf-8")
    return path


def _interrupted(command: list[str], overrides: list[str], env: dict, marker, signalled_rank: int,
                 call: str = "2") -> str:
    """Run ``command`` slow from the engine's call ``call`` (step 2's sampling), SIGTERM the
    process of rank ``signalled_rank`` once it decodes, and return the run's output (checked:
    exit status 0)."""
    slow = {**env, "LLMTRAIN_TEST_SLOW_FROM": call, "LLMTRAIN_TEST_SAMPLING_MARKER": str(marker),
            "LLMTRAIN_TEST_MARKER_RANK": str(signalled_rank)}
    proc = subprocess.Popen(command + overrides, env=slow, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1)  # (the line written whole)
        slowed, pid = marker.read_text().split()[1::2]
        assert slowed == call  # step 2's sampling (step 1 sampled at full speed)
        sent = time.monotonic()
        os.kill(int(pid), signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
        print(f"exit {time.monotonic() - sent:.1f} s after SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
    log = out + err
    assert proc.returncode == 0, log[-4000:]
    return log


@pytest.mark.parametrize("extra,call", [([], "2"), (["rollout.async_generation=true", "rollout.max_staleness=1"], "3")],
                         ids=["sync", "async"])
def test_sigterm_while_a_step_samples_saves_the_last_step_and_the_rerun_continues_exactly(tmp_path, extra, call):
    """SIGTERM once step 2 decodes (each forward 1 s from the engine's call that samples in step
    2: step 2's 8 forwards would take 8 s): exit 0 from the decode step after it, step_1 saved
    (the default ``trainer.save_every`` would not have) and intact, no step_2; the same command
    then trains steps 2 and 3 with the losses and sample digests of an uninterrupted run. Async
    generation (step 1 samples generations 1 and 2, step 2 samples 3): the checkpoint keeps the
    batch step 1 sampled ahead, not the dropped one."""
    from conftest import subprocess_env
    from llmtrain.checkpoint.protocol import verify

    path, env = _questions(tmp_path), subprocess_env()
    command = [sys.executable, "-m", "llmtrain"]
    reference = subprocess.run(command + _overrides(path, tmp_path / "reference", *extra), env=env,
                               capture_output=True, text=True, timeout=600)
    assert reference.returncode == 0, reference.stderr[-4000:]
    run = tmp_path / "run"
    log = _interrupted(command, _overrides(path, run, *extra), env, tmp_path / "sampling", 0, call)
    assert "SIGTERM while step 2 sampled (stopped at decode step " in log, log[-4000:]
    assert "preempted (SIGTERM): saved step 1" in log
    assert verify(run / "checkpoints" / "step_1") is None
    assert not (run / "checkpoints" / "step_2").exists()
    assert sorted(_by_step(run)) == [1]
    rerun = subprocess.run(command + _overrides(path, run, *extra), env=env, capture_output=True, text=True,
                           timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    expected = _by_step(tmp_path / "reference")
    assert sorted(expected) == [1, 2, 3]
    assert _by_step(run) == expected


def test_sigterm_in_the_first_steps_sampling_saves_nothing_and_says_so(tmp_path, monkeypatch, caplog):
    """In-process, SIGTERM (from a thread, once step 1 decodes) to this process: train() returns
    preempted at step 0, no checkpoint written, and the last line says nothing was saved."""
    import logging
    import threading

    from conftest import make_cfg
    from llmtrain.trainer import train

    marker, run = tmp_path / "sampling", tmp_path / "run"
    monkeypatch.setenv("LLMTRAIN_TEST_SLOW_FROM", "1")
    monkeypatch.setenv("LLMTRAIN_TEST_SAMPLING_MARKER", str(marker))

    def signal_once_sampling() -> None:
        while not marker.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_once_sampling, daemon=True).start()
    with caplog.at_level(logging.INFO, logger="llmtrain"):
        summary = train(make_cfg(_overrides(_questions(tmp_path), run)))
    assert summary["preempted_at"] == 0 and summary["losses"] == []
    assert not list((run / "checkpoints").glob("step_*"))
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("SIGTERM while step 1 sampled (stopped at decode step ") for line in lines), lines
    assert lines[-1] == "preempted (SIGTERM) in the first step, before it trained: nothing saved; rerun the same " \
                        "command to start", lines


@pytest.mark.slow
def test_a_sigterm_on_one_rank_while_it_samples_stops_both_at_the_same_step(tmp_path):
    """2 ranks (torchrun, gloo): SIGTERM to rank 1 alone while its step 2 decodes. Rank 1 stops
    at its next decode step; rank 0, never signalled, samples to the end, and the all-reduce after
    sampling drops the step on both: step_1 saved, exit 0, and the rerun equals an uninterrupted
    2-rank run."""
    from conftest import cores_for, subprocess_env
    from llmtrain.checkpoint.protocol import verify

    path, env = _questions(tmp_path), subprocess_env()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "llmtrain"]
    run = tmp_path / "run"
    with cores_for(2):
        reference = subprocess.run(command + _overrides(path, tmp_path / "reference"), env=env, capture_output=True,
                                   text=True, timeout=600)
        assert reference.returncode == 0, reference.stderr[-4000:]
        log = _interrupted(command, _overrides(path, run), env, tmp_path / "sampling", 1)
        rerun = subprocess.run(command + _overrides(path, run), env=env, capture_output=True, text=True, timeout=600)
    assert "a stop signal on another rank while step 2 sampled (another rank stopped)" in log, log[-4000:]
    assert "preempted (signal on another rank): saved step 1" in log
    assert verify(run / "checkpoints" / "step_1", 0, 2) is None and not (run / "checkpoints" / "step_2").exists()
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    expected = _by_step(tmp_path / "reference")
    assert sorted(expected) == [1, 2, 3]
    assert _by_step(run) == expected
