"""The hang watchdog (llmtrain.monitoring.watchdog): a rank stalled by ``LLMTRAIN_FAULT=stall:<rank>:<step>``
is named with its step and phase, every rank's stacks are dumped, the job exits non-zero within
``trainer.hang_timeout_s`` + 30 s, and ``torchrun --max-restarts 1`` resumes it from the last
checkpoint with every step logged once. The detection rule on its own, in-process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FAST, REPO, assert_ok, make_cfg, read_metrics, subprocess_env

STEPS = 6
HANG_S = 10
# A checkpoint every 2 steps: step_4 exists when rank 1 stalls at the start of step 5.
OVERRIDES = FAST + [f"trainer.max_steps={STEPS}", "trainer.save_every=2", f"trainer.hang_timeout_s={HANG_S}",
                    "trainer.export_hf=false"]
LATE = "hang: rank 1 fell behind at step 5, phase data"


def torchrun(*flags: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *flags,
            "-m", "llmtrain"]


def stalled_env() -> dict:
    env = subprocess_env()
    env["LLMTRAIN_FAULT"] = "stall:1:5"
    return env


@pytest.mark.slow
@pytest.mark.alone  # hang timeouts timing a 2-rank launch (conftest.machine_alone)
def test_a_stalled_rank_is_named_every_rank_dumps_its_stacks_and_the_job_exits(tmp_path):
    run_dir, log_file = tmp_path / "run", tmp_path / "out.log"
    with open(log_file, "w") as out:
        proc = subprocess.Popen(torchrun() + OVERRIDES + [f"run_dir={run_dir}"], stdout=out, stderr=subprocess.STDOUT,
                                env=stalled_env(), cwd=REPO, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while "stalls at step 5" not in log_file.read_text():
                assert proc.poll() is None, f"ended before the stall:\n{log_file.read_text()[-4000:]}"
                assert time.monotonic() < deadline, "step 5 not reached in 300 s"
                time.sleep(0.1)
            stalled = time.monotonic()
            proc.wait(timeout=HANG_S + 60)
            exit_s = time.monotonic() - stalled
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log_file.read_text()
    print(f"exited {exit_s:.1f} s after the stall (trainer.hang_timeout_s={HANG_S}), status {proc.returncode}")
    assert proc.returncode != 0, text[-4000:]
    assert exit_s < HANG_S + 30, text[-4000:]
    lines = [line for line in text.splitlines() if LATE in line]
    assert len(lines) == 1, text[-4000:]  # one line, from rank 0
    print(lines[0])
    assert "rank 0 at step 5, phase forward_backward" in lines[0]
    assert "exits with status 4" in text and "exitcode  : 4" in text  # torchrun's summary of the failed ranks
    (hang_dir,) = run_dir.glob("hang-*")
    assert sorted(p.name for p in hang_dir.iterdir()) == ["rank_0.txt", "rank_1.txt", "report.txt"]
    late, waiting = (hang_dir / "rank_1.txt").read_text(), (hang_dir / "rank_0.txt").read_text()
    assert late.startswith("rank 1 of 2") and "step 5, phase data" in late.splitlines()[0]
    assert "_stall_forever" in late and "train_step" in late  # the training thread, where it stalled
    assert "forward_backward" in waiting  # rank 0 waits in the step's first all-reduce
    assert LATE in (hang_dir / "report.txt").read_text()


@pytest.mark.slow
@pytest.mark.alone  # hang timeouts timing a 2-rank launch (conftest.machine_alone)
def test_torchrun_max_restarts_resumes_a_hung_job_from_its_last_checkpoint(tmp_path):
    run_dir, env = tmp_path / "run", stalled_env()
    # torchrun's agent shares its rendezvous store with the workers by default, and a restarted
    # worker can read the previous attempt's addresses from it ("Gloo connectFullMesh failed ...
    # Connection refused"; pytorch/pytorch#135712): restarts need the agent's own store off.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    proc = subprocess.run(torchrun("--max-restarts=1") + OVERRIDES + [f"run_dir={run_dir}"], capture_output=True,
                          text=True, timeout=900, env=env, cwd=REPO)
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert LATE in out and f"resuming from {run_dir / 'checkpoints' / 'step_4'}" in out
    assert len(list(run_dir.glob("hang-*"))) == 1  # the restarted job did not stall again
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics if "train/loss" in m] == list(range(1, STEPS + 1))
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # trainer.eval_every=0: no step-0 evaluation
    assert (run_dir / "checkpoints" / f"step_{STEPS}" / "COMPLETE.json").is_file()


# ---- the rule, in-process ----------------------------------------------------------------------
def _beat(dog, rank: int, step: int, phase: str, changes: int, beat: int = 1) -> None:
    record = {"rank": rank, "pid": 1000 + rank, "host": "h", "step": step, "phase": phase, "changes": changes,
              "beat": beat}
    (dog.dir / f"rank_{rank}.json").write_text(json.dumps(record))


def _reader(tmp_path: Path, world_size: int = 3):
    from llmtrain.monitoring.watchdog import Watchdog

    dog = Watchdog(tmp_path, rank=0, world_size=world_size, timeout_s=0.3, step=4)
    dog.dir.mkdir()
    dog.set("data", 5)
    dog.set("forward_backward")
    return dog


def test_the_ranks_behind_are_named_once_no_rank_has_moved_for_the_timeout(tmp_path):
    dog = _reader(tmp_path)
    _beat(dog, 1, 5, "data", 7)
    _beat(dog, 2, 5, "forward_backward", 9)
    assert dog._check() is None  # first look
    time.sleep(0.2)
    _beat(dog, 2, 5, "forward_backward", 9, beat=2)  # alive but not moving
    assert dog._check() is None
    time.sleep(0.2)
    hang = dog._check()
    assert hang is not None and hang["late"] == [1] and hang["reporter"] == 0
    assert hang["message"].startswith("hang: rank 1 fell behind at step 5, phase data (host h pid 1001)")
    assert "ranks 0, 2 at step 5, phase forward_backward" in hang["message"]
    assert json.loads((dog.dir / "HANG").read_text()) == hang
    assert Path(hang["dir"]).parent == tmp_path and Path(hang["dir"]).name.startswith("hang-")


def test_a_rank_that_moves_or_ranks_all_at_one_position_are_no_hang(tmp_path):
    dog = _reader(tmp_path, world_size=2)
    _beat(dog, 1, 4, "checkpoint", 6)
    dog._check()
    time.sleep(0.2)
    _beat(dog, 1, 5, "data", 7)  # still behind, but it moved: the clock starts again
    assert dog._check() is None
    time.sleep(0.2)
    assert dog._check() is None
    _beat(dog, 1, 5, "forward_backward", 8)
    dog._check()
    time.sleep(0.4)
    assert dog._check() is None  # both in forward_backward of step 5: a slow phase, not a straggler
    assert not (dog.dir / "HANG").exists()


def test_a_rank_still_sampling_moves_while_the_others_wait_and_is_no_hang_until_it_stops(tmp_path):
    """GRPO: a rank whose completions run longer is still in its step's sampling (phase data)
    while the other waits for it in the step's collectives; each decode step calls
    :meth:`Watchdog.moved`, so it is no hang however long it samples, and is one once it stops."""
    from llmtrain.monitoring.watchdog import Watchdog

    dog = Watchdog(tmp_path, rank=0, world_size=2, timeout_s=0.3, step=4)
    dog.dir.mkdir()
    dog.set("data", 5)  # rank 0 samples
    _beat(dog, 1, 5, "forward_backward", 9)  # rank 1 is done and waits
    dog._check()
    for _ in range(5):  # 0.5 s of decoding, past the 0.3 s timeout
        time.sleep(0.1)
        dog.moved()
        assert dog._check() is None
    time.sleep(0.4)
    hang = dog._check()
    assert hang is not None and hang["late"] == [0]


def test_one_process_or_a_zero_timeout_starts_no_watchdog(tmp_path):
    from llmtrain.monitoring.watchdog import Watchdog

    for world_size, timeout in ((1, 10), (2, 0)):
        dog = Watchdog.start(tmp_path, 0, world_size, timeout, step=0)
        dog.set("data", 1)
        dog.stop()
        assert not dog.enabled and not (tmp_path / ".watchdog").exists()


def test_hang_timeout_must_not_be_negative():
    from llmtrain.common.errors import ConfigError
    from llmtrain.config.validate import validate

    assert make_cfg([]).trainer.hang_timeout_s == 300
    with pytest.raises(ConfigError, match=r"trainer\.hang_timeout_s=-1\.0 must be >= 0"):
        validate(make_cfg(["trainer.hang_timeout_s=-1"]), 1)


def test_hang_timeout_must_be_below_the_process_group_timeout_and_may_change_on_resume():
    from llmtrain.checkpoint.resume import RESUMABLE_CHANGES
    from llmtrain.common.errors import ConfigError
    from llmtrain.config.validate import validate

    with pytest.raises(ConfigError, match=r"trainer\.hang_timeout_s=600\.0 .* below the process group's timeout of 600 s"):
        validate(make_cfg(["trainer.hang_timeout_s=600"]), 1)
    validate(make_cfg(["trainer.hang_timeout_s=599"]), 1)
    # A false alarm is mended by relaunching with a longer timeout: resume must accept that.
    assert "trainer.hang_timeout_s" in RESUMABLE_CHANGES
