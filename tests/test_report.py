"""``python -m llmtrain.report``: the report of a synthetic run directory (no training)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from matplotlib.image import imread

from conftest import subprocess_env
from llmtrain.monitoring.report import build_figure, proportional_scale, write_report
from llmtrain.report import main

T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC
CONFIG = """\
name: tiny-run
model: {name: sshleifer/tiny-gpt2}
data: {name: tinyshakespeare, seq_len: 64}
recipe: {name: zero3, engine: deepspeed, zero_stage: 3}
trainer: {max_steps: 12, global_batch_size: 8, micro_batch_size: 2, precision: bf16, lr: 0.0003}
"""


def train_loss(step: int) -> float:
    return 4.0 - 0.1234 * step


def write_run(run_dir, steps=12, config=True, timeline=True):
    """A run resumed at step 4 after a crash: train records 1..steps, val at 0, 6, 12, the goodput
    numbers on the last record (wall 200 s: 150 productive, 40 itemised, 10 other)."""
    records = [{"step": 0, "time": T0, "val/loss": 4.1, "val/perplexity": 60.34}]
    for s in range(1, steps + 1):
        r = {"step": s, "time": T0 + 10 * s, "train/loss": train_loss(s), "train/lr": 3e-4 * min(1, s / 3),
             "train/grad_norm": 1.0 / s, "train/tokens_per_s": 1000.0 + s, "train/tokens_seen": 512 * s,
             "perf/mfu": 0.25, "memory/peak_bytes": (2 + (s == 7)) * 2**30, "memory/peak_rank": 1,
             "time/goodput": 0.75 * s / steps, "time/wall_s": 200.0 * s / steps, "train/step_time_s": 0.5,
             "time/data_wait_s": 0.01 * (s % 2)}
        if s in (6, 12):
            r.update({"val/loss": 3.5 if s == 6 else 3.6, "val/perplexity": 33.12 if s == 6 else 36.6})
        records.append(r)
    records[-1].update({"time/goodput": 0.75, "time/wall_s": 200.0, "time/productive_s": 150.0,
                        "time/startup_s": 10.0, "time/eval_s": 5.0, "time/checkpoint_s": 5.0,
                        "time/lost_s": 8.0, "time/restart_s": 12.0})
    lines = [json.dumps(r) for r in records]
    lines.insert(3, '{"step": 3, "train/lo')  # a line cut short by the crash
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if config:
        (run_dir / "config.yaml").write_text(CONFIG)
    if timeline:
        events = [{"event": "start", "time": T0, "step": 0, "resumed_from": None, "world_size": 2, "recipe": "zero3"},
                  {"event": "start", "time": T0 + 100, "step": 4, "resumed_from": "step_4", "world_size": 2,
                   "recipe": "zero3"},
                  {"event": "end", "time": T0 + 300, "step": 12, "reason": "finished"}]
        (run_dir / "timeline.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def assert_png(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(path).shape[:2] == (1000, 1200)  # figsize (12, 10) at 100 dpi


def test_full_report(tmp_path):
    write_run(tmp_path)
    png, md = write_report(tmp_path)
    assert (png, md) == (tmp_path / "report.png", tmp_path / "report.md")
    assert not list(tmp_path.glob("*.tmp"))
    assert_png(png)
    text = md.read_text()
    assert text.startswith("# Training report: tiny-run (zero3)\n")
    assert "| `trainer.max_steps` | 12 |" in text and "| `trainer.lr` | 0.0003 |" in text
    assert f"| final train loss | {train_loss(12):.4f} |" in text and "2.5192" in text
    assert "| last val loss | 3.6000 (step 12) |" in text and "| last val perplexity | 36.600 |" in text
    assert "| best val loss | 3.5000 (step 6) |" in text and "| best val perplexity | 33.120 |" in text
    assert "| total steps | 12 |" in text and "| tokens seen | 6,144 |" in text
    assert "| tokens/s (mean of last 10 logged steps) | 1,008 |" in text  # mean of 1003..1012 = 1007.5
    assert "| MFU (mean) | 25.0 % |" in text
    assert "| max peak memory | 3.00 GiB (rank 1) |" in text
    assert "| goodput | 75.0 % |" in text
    assert "| data wait (mean of logged steps) | 5.0 ms per step (1.0 % of step time) |" in text
    # Goodput breakdown: other = 200 - (150 + 10 + 5 + 5 + 8 + 12) = 10 s.
    for row in ["| productive | 150.0 | 75.0 % |", "| startup | 10.0 | 5.0 % |", "| eval | 5.0 | 2.5 % |",
                "| checkpoint | 5.0 | 2.5 % |", "| lost (redone after crash) | 8.0 | 4.0 % |",
                "| restart | 12.0 | 6.0 % |", "| other | 10.0 | 5.0 % |", "| **wall** | 200.0 | 100.0 % |"]:
        assert row in text, row
    # Three events, two processes: the first crashed (a start follows it), the second resumed at 4.
    timeline = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert timeline == [
        "| 1 | 2023-11-14 22:13:20Z | 0 | 4 | 2 | zero3 | killed or crashed (no end record); the next start "
        "resumed from step 4 |",
        "| 2 | 2023-11-14 22:15:00Z | 4 | 12 | 2 | zero3 | finished |"]
    assert not [line for line in text.splitlines() if line.startswith("| 3 |")]
    assert "![report](report.png)" in text


def test_only_step_zero(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "time": T0, "val/loss": 4.1,
                                                        "val/perplexity": 60.34}) + "\n")
    png, md = write_report(tmp_path)
    assert_png(png)
    text = md.read_text()
    assert "| final train loss | n/a |" in text and "| last val loss | 4.1000 (step 0) |" in text
    assert "| total steps | 0 |" in text and "_No `time/wall_s` in metrics.jsonl._" in text


def test_without_timeline_and_config(tmp_path):
    write_run(tmp_path, config=False, timeline=False)
    png, md = write_report(tmp_path)
    assert_png(png)
    text = md.read_text()
    assert text.startswith(f"# Training report: {tmp_path.name}\n")
    assert "_No readable `config.yaml` in the run directory._" in text
    assert "_No `timeline.jsonl` (a run from before timelines were recorded)._" in text
    assert f"| final train loss | {train_loss(12):.4f} |" in text and "| goodput | 75.0 % |" in text


def test_last_process_without_end_runs_to_last_logged_step(tmp_path):
    write_run(tmp_path, steps=9)
    with open(tmp_path / "timeline.jsonl") as f:
        events = [json.loads(line) for line in f][:2]
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    text = write_report(tmp_path)[1].read_text()
    assert "| 2 | 2023-11-14 22:15:00Z | 4 | 9 | 2 | zero3 | no end record (still running, or killed) |" in text


def test_cli_missing_dir_exits_2_and_writes_nothing(tmp_path):
    missing = tmp_path / "nope"
    proc = subprocess.run([sys.executable, "-m", "llmtrain.report", str(missing)], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert str(missing) in proc.stderr and "metrics.jsonl" in proc.stderr
    assert not missing.exists() and list(tmp_path.iterdir()) == []


def test_cli_dir_without_metrics(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "metrics.jsonl") in err and "expected" in err
    assert list(tmp_path.iterdir()) == []


def test_cli_prints_paths(tmp_path, capsys):
    write_run(tmp_path)
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "report.png"), str(tmp_path / "report.md")]


def _short_run(steps=3, peak=100.0):
    """``steps`` records of a run whose MFU is tokens/s x 6e6 FLOPs/token / peak TFLOP/s."""
    return [{"step": s, "train/loss": 4.0 - s / 10, "train/lr": 1e-3, "train/grad_norm": 1.0, "train/tokens_seen": 64 * s,
             "train/tokens_per_s": 500.0 + 40 * s, "perf/tflops_per_device": (500.0 + 40 * s) * 6e6 / 1e12,
             "perf/mfu": (500.0 + 40 * s) * 6e6 / 1e12 / peak, "memory/peak_bytes": 2**30} for s in range(1, steps + 1)]


def _panel(fig, title):
    return next(ax for ax in fig.axes if ax.get_title() == title)


def test_a_short_run_has_integer_step_ticks():
    fig = build_figure(_short_run(), [], "short")
    fig.canvas.draw()
    step_axes = [ax for ax in fig.axes if ax.get_xlabel() == "step"]
    assert len(step_axes) == 5  # loss, lr, grad norm, throughput, memory
    for ax in step_axes:
        labels = [t.get_text().replace("\u2212", "-") for t in ax.get_xticklabels() if t.get_text()]
        assert labels and all(lab.lstrip("-").isdigit() for lab in labels), (ax.get_title(), labels)


def test_throughput_is_one_curve_with_mfu_as_a_second_scale():
    fig = build_figure(_short_run(), [], "short")
    fig.canvas.draw()
    ax = _panel(fig, "throughput")
    assert [line.get_label() for line in ax.get_lines()] == ["tokens/s"]
    # No twin axes drawing a second, overlapping curve; MFU is a scale on the same curve.
    assert not [other for other in fig.axes if other is not ax and other.bbox.bounds == ax.bbox.bounds]
    (mfu_axis,) = ax.child_axes
    assert mfu_axis.get_ylabel() == "MFU (%)"
    scale = 100 * 6e6 / 1e12 / 100.0  # MFU % per token/s
    assert np.allclose(mfu_axis.get_ylim(), np.array(ax.get_ylim()) * scale)
    # Not proportional (a resume on another world size changes the ratio): its own dashed curve.
    records = _short_run()
    records[-1]["perf/mfu"] *= 2
    fig = build_figure(records, [], "resized")
    twins = [other for other in fig.axes if other.get_ylabel() == "MFU (%)"]
    assert len(twins) == 1 and twins[0].get_lines()[0].get_linestyle() == "--"


def test_proportional_scale():
    assert proportional_scale(([1, 2], [10.0, 20.0]), ([1, 2], [1.0, 2.0])) == 0.1
    assert proportional_scale(([1, 2], [10.0, 20.0]), ([1, 2], [1.0, 3.0])) is None
    assert proportional_scale(([1], [0.0]), ([1], [1.0])) is None


def test_an_online_rl_run_plots_reward_and_completion_length(tmp_path):
    """objective=grpo logs rewards, not a per-token likelihood: the second panel plots the sampled
    completions' mean reward (train), the greedy held-out reward (val points) and, on a second
    scale, the mean completion length; report.md gives the last rewards."""
    records = [{"step": 0, "val/reward": 0.25, "val/prompts": 4}]
    for s in range(1, 7):
        records.append({"step": s, "train/loss": 0.01 * s, "train/lr": 1e-3, "train/grad_norm": 0.5,
                        "train/kl": 0.001 * s, "train/reward": 0.1 * s, "train/completions/mean_length": 20.0 + s})
    records[-1].update({"val/reward": 0.75, "time/wall_s": 100.0, "time/productive_s": 80.0,
                        "time/generation_s": 50.0, "time/reward_s": 5.0})
    fig = build_figure(records, [], "grpo")
    ax = _panel(fig, "reward and completion length")
    assert [line.get_label() for line in ax.get_lines()] == ["train reward", "val reward (greedy)"]
    assert list(ax.get_lines()[0].get_ydata()) == [0.1 * s for s in range(1, 7)]
    assert list(ax.get_lines()[1].get_xdata()) == [0, 6]
    assert _panel(fig, "loss vs step").get_ylabel() == "loss (clipped surrogate)"
    (twin,) = [other for other in fig.axes if other.get_ylabel() == "completion length (tokens)"]
    assert list(twin.get_lines()[0].get_ydata()) == [20.0 + s for s in range(1, 7)]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_report(run)
    text = (run / "report.md").read_text()
    assert "| last train reward (sampled) | 0.6000 |" in text and "| last val reward (greedy) | 0.7500 |" in text
    # Generation and scoring are parts of the productive time, not added to it.
    assert "| productive | 80.0 | 80.0 % |\n| productive: generation | 50.0 | 50.0 % |\n" \
           "| productive: reward functions | 5.0 | 5.0 % |" in text
    assert "| other | 20.0 | 20.0 % |" in text


def test_a_preference_run_plots_accuracy_and_the_held_out_margin():
    """DPO-like records: preference accuracy (train line, val points) where other runs plot loss
    against tokens, and the held-out reward margin on a second scale."""
    records = [{"step": 0, "val/loss": 0.69, "val/rewards/accuracies": 0.0, "val/rewards/margins": 0.0}]
    for s in range(1, 5):
        records.append({"step": s, "train/loss": 0.7 - 0.01 * s, "train/lr": 1e-3, "train/grad_norm": 1.0,
                        "train/rewards/accuracies": 0.5 + 0.1 * s, "train/rewards/chosen": 0.1 * s,
                        "train/rewards/rejected": -0.1 * s})
    records[-1].update({"val/loss": 0.6, "val/rewards/accuracies": 0.75, "val/rewards/margins": 0.2})
    fig = build_figure(records, [2], "dpo")
    ax = _panel(fig, "preference accuracy and margin")
    assert [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")] == [
        "train accuracy", "val accuracy", "resume"]  # the dashed line at the resume step
    assert ax.get_ylabel() == "preference accuracy" and ax.get_xlabel() == "step"
    (twin,) = [other for other in fig.axes if other.get_ylabel() == "reward margin (chosen - rejected)"]
    assert list(twin.get_lines()[0].get_ydata()) == [0.0, 0.2]
    assert _panel(fig, "loss vs step").get_ylabel() == "loss (per pair)"
