"""The Trainer's small parts on their own: the step's named scalars survive their all-reduce
layout, and each component's cadence is the documented one."""

from __future__ import annotations

import torch

from llmtrain.checkpoint.checkpointer import Checkpointer
from llmtrain.evaluation.validation import Evaluator
from llmtrain.trainer import StepResult, StepScalars


def test_step_scalars_round_trip_by_name():
    scalars = StepScalars(sample_digest=123456789.0, preempt_requested=1.0, save_due=0.0, background_written=2.0,
                          memory_bytes=[10.0, 0.0, 30.0])
    values = scalars.values()
    assert values == [123456789.0, 1.0, 0.0, 2.0, 10.0, 0.0, 30.0]
    assert StepScalars.from_values(values) == scalars
    # Two ranks' vectors summed, as the all-reduce sums them: each field is the world sum.
    other = StepScalars(1.0, 0.0, 1.0, 1.0, [0.0, 5.0, 0.0])
    summed = (torch.tensor(values, dtype=torch.float64) + torch.tensor(other.values(), dtype=torch.float64)).tolist()
    assert StepScalars.from_values(summed) == StepScalars(123456790.0, 1.0, 1.0, 3.0, [10.0, 5.0, 30.0])


def _result(step: int, stop: bool = False, save_by_time: bool = False) -> StepResult:
    return StepResult(step, 1.0, 1e-3, 1.0, 64, 0.1, {}, StepScalars(), stop, save_by_time, None)


def test_evaluator_runs_every_n_steps_and_at_the_end():
    evaluator = Evaluator(dict, every=4, max_steps=10)
    assert [s for s in range(1, 11) if evaluator.should_run(s)] == [4, 8, 10]
    never = Evaluator(dict, every=0, max_steps=10)
    assert [s for s in range(1, 11) if never.should_run(s)] == [10]


def test_checkpointer_saves_on_cadence_preemption_time_and_the_last_step():
    from conftest import make_cfg

    cfg = make_cfg(["trainer.save_every=3", "trainer.max_steps=8"])
    saver = Checkpointer(None, None, None, None, cfg, "", 1)
    assert [s for s in range(1, 9) if saver.should_save(s, _result(s))] == [3, 6, 8]
    assert saver.should_save(1, _result(1, stop=True)) and saver.should_save(2, _result(2, save_by_time=True))
    assert not saver.should_save(4, _result(4))


def test_step_result_health():
    assert _result(1).healthy
    assert not StepResult(1, float("nan"), 0, 1.0, 1, 1, {}, StepScalars(), False, False, None).healthy
    assert not StepResult(1, 1.0, 0, float("inf"), 1, 1, {}, StepScalars(), False, False, None).healthy
    assert not StepResult(1, 1.0, 0, 1.0, 1, 1, {}, StepScalars(), False, False, "spike").healthy


def test_tracker_logs_on_its_cadence(tmp_path):
    from conftest import make_cfg
    from llmtrain.monitoring.tracking import Tracker

    tracker = Tracker(make_cfg(["tracker=none"]).tracker, tmp_path, "x", {}, is_main=False, log_every=3)
    assert [s for s in range(1, 10) if tracker.should_log(s)] == [3, 6, 9]
    quiet = Tracker(make_cfg(["tracker=none"]).tracker, tmp_path, "x", {}, is_main=False, log_every=0)
    assert not any(quiet.should_log(s) for s in range(1, 10))


def test_a_run_folder_short_of_disk_for_its_checkpoints_is_warned_about(tmp_path, monkeypatch, caplog):
    """keep_checkpoints + 1 checkpoints must fit (a new one is written before the oldest goes):
    SmolLM2-135M fully fine-tuned is about 1.6 GB a checkpoint (12 bytes per parameter)."""
    import logging
    import shutil
    from collections import namedtuple

    from llmtrain.checkpoint.checkpointer import checkpoint_bytes, warn_if_disk_is_short

    per_checkpoint = checkpoint_bytes(134_515_008, "torch", 3)
    assert per_checkpoint == 134_515_008 * 12 == checkpoint_bytes(134_515_008, "deepspeed", 3)
    assert checkpoint_bytes(10, "deepspeed", 2) == 160
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, 4 * per_checkpoint - 1))
    with caplog.at_level(logging.WARNING, logger="llmtrain"):
        assert warn_if_disk_is_short(tmp_path / "run", 3, per_checkpoint)  # the folder need not exist yet
    assert "trainer.keep_checkpoints=3 needs about 6.0 GiB (4 checkpoints of 1.50 GiB" in caplog.text
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, 4 * per_checkpoint))
    assert not warn_if_disk_is_short(tmp_path, 3, per_checkpoint)


def test_the_gap_before_continuing_a_finished_run_is_idle_not_restart_time(tmp_path):
    """Goodput: a run that finished and is continued later with a higher trainer.max_steps was idle
    in between (a 1.1 % goodput once came from booking that gap as restart time); the gap after a
    crash is restart time, as before."""
    import pytest

    from llmtrain.checkpoint.state import TrainState
    from llmtrain.monitoring import goodput

    goodput.timeline_event(tmp_path, "start", fresh=True, step=0)
    goodput.timeline_event(tmp_path, "end", step=10, reason="finished")
    finished = goodput.finished_at(tmp_path)
    assert finished is not None
    state = TrainState(step=10, run_started_unix=finished - 50, saved_unix=finished - 1, productive_s=40)
    goodput.account_restart(state, [], finished + 600, resumed=True, finished=finished)
    assert state.idle_s == pytest.approx(600) and state.restart_s == state.lost_s == 0
    crashed = TrainState(step=10, run_started_unix=finished - 50, saved_unix=finished - 1, productive_s=40)
    goodput.account_restart(crashed, [{"step": 11, "time": finished + 5}], finished + 600, resumed=True)
    assert crashed.idle_s == 0 and crashed.lost_s == pytest.approx(6) and crashed.restart_s == pytest.approx(595)
    goodput.timeline_event(tmp_path, "start", step=10)  # the continuation, running (or killed)
    assert goodput.finished_at(tmp_path) is None
    goodput.timeline_event(tmp_path, "end", step=12, reason="preempted")
    assert goodput.finished_at(tmp_path) is None  # a preemption's gap is a real loss
