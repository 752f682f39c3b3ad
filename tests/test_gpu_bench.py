"""scripts/bench/gpu.py: its dry run (the GPU benchmark's code path on CPU with tiny shapes) prints
one line per configuration with real figures and the reasons for what this machine cannot run,
and the 8B depth search keeps the most layers the planner fits."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts" / "bench"))

import gpu  # noqa: E402  (scripts/bench is not a package)

RAN = ["1b-fsdp", "1b-zero3", "8b-fsdp", "8b-zero3", "1b-32k-fsdp"]


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """One dry run of every configuration on 1 process: (stdout lines, results.json rows, out folder)."""
    out = tmp_path_factory.mktemp("gpu_bench")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "gpu.py"), "--dry-run", "--out", str(out),
                           "--peak-tflops", "0.001"], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads((out / "results.json").read_text())}
    return proc.stdout.splitlines(), rows, out


def _line(lines: list[str], name: str) -> str:
    found = [line for line in lines if line.split(" ", 1)[0] == name]
    assert len(found) == 1, f"{name}: {len(found)} lines in\n" + "\n".join(lines)
    return found[0]


def test_one_line_per_configuration(dry):
    lines, rows, _ = dry
    assert [b.name for b in gpu.BENCHES] == list(rows)
    for bench in gpu.BENCHES:
        _line(lines, bench.name)
    assert any(line.startswith("configuration") and "tokens/s/GPU" in line and "peak/plan" in line for line in lines)


def test_figures_of_the_configurations_that_ran(dry):
    lines, rows, out = dry
    for name in RAN:
        row, cells = rows[name], _line(lines, name).split()
        assert row["status"] == "ok", row
        tokens = float(cells[1].replace(",", ""))
        assert tokens > 0 and abs(tokens - row["tokens_per_s_gpu"]) <= 0.5
        assert cells[2].endswith("%") and float(cells[2][:-1]) > 0  # --peak-tflops 0.001: MFU against 1 GFLOP/s
        assert cells[4] in ("GiB", "MiB") and cells[6] in ("GiB", "MiB")  # peak and plan, with units
        assert row["peak_bytes"] > 0 and row["plan_bytes"] > 0
        assert float(cells[7]) == pytest.approx(row["peak_bytes"] / row["plan_bytes"], abs=0.006)
        assert cells[8] == f"{gpu.DRY.steps - gpu.DRY.warmup}/{gpu.DRY.steps}"
        # tokens/s/GPU against the batch shape the configuration asked for: global batch x row length
        # over each measured step's time, straight from the run's own metrics.jsonl
        bench = {b.name: b for b in gpu.BENCHES}[name]
        tokens_per_step = ((1 if bench.long else gpu.DRY.micro[bench.shape])
                           * (gpu.DRY.long_seq if bench.long else gpu.DRY.seq))
        steps = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in steps if "train/step_time_s" in r][gpu.DRY.warmup:]
        assert row["tokens_per_s_gpu"] == pytest.approx(
            statistics.median(tokens_per_step / r["train/step_time_s"] for r in steps), rel=1e-3)


def test_skip_reasons(dry):
    lines, rows, _ = dry
    fp8 = _line(lines, "1b-fsdp-fp8-compile")
    # llmtrain's own preflight refusal, not a reason the benchmark made up
    assert "skipped: llmtrain refuses it: recipe.fp8=true needs float8 matmuls" in fp8 and "this machine trains on cpu" in fp8
    for name in ("1b-zero3-compile", "1b-fsdp-compile"):
        assert "--dry-compile" in _line(lines, name)
    for name in ("1b-32k-cp-ring", "1b-32k-cp-ulysses"):
        assert "skipped: context parallel" in _line(lines, name) and "--nproc 2" in _line(lines, name)
    assert {n for n, r in rows.items() if r["status"] == "error"} == set()


def test_8b_depth_search_against_a_linear_planner():
    """The most layers (stepping down by 2 from 32) with which both recipes fit, and the note
    names the planner's full-depth figures; with nothing fitting, None and why."""
    per_layer = {"fsdp": 1.0e9, "zero3": 1.2e9}

    def plan(overrides, world_size):
        layers = int(next(o for o in overrides if "num_hidden_layers=" in o).split("=")[1])
        recipe = next(o for o in overrides if o.startswith("+recipe=")).split("=")[1]
        return int(per_layer[recipe] * layers)

    bench = {b.name: b for b in gpu.BENCHES}["8b-fsdp"]
    layers, note = gpu.fit_layers(bench, gpu.REAL, 1, Path("/nonexistent"), int(30e9), plan)
    assert layers == 24  # zero3: 26 x 1.2e9 = 31.2e9 > 30e9 >= 24 x 1.2e9
    assert note.startswith("24 of 32 layers") and "fsdp 29.80 GiB" in note and "zero3 35.76 GiB" in note
    assert gpu.fit_layers(bench, gpu.REAL, 1, Path("/nonexistent"), int(40e9), plan) == (32, "")
    layers, note = gpu.fit_layers(bench, gpu.REAL, 1, Path("/nonexistent"), int(1e9), plan)
    assert layers is None and "not even 2 layers" in note


def test_timeout_hint_names_a_stale_deepspeed_op_build(tmp_path):
    """A worker killed while DeepSpeed builds its ops leaves torch's extension lock behind: the
    timeout line says where; a worker killed anywhere else gets no hint."""
    building = ("2026-12-03 13:50:32,486 llmtrain start-up: engine (DeepSpeed ZeRO-3; compiled ops cached in "
                "/cache/torch_extensions/py311-x; this first run with these versions compiles them (1-2 min, once)) ...\n")
    log = tmp_path / "worker1.log"
    log.write_text("2026-12-03 13:50:28,863 llmtrain start-up: process group ...\n" + building)
    assert "delete the stale 'lock' files under /cache/torch_extensions/py311-x " in gpu._op_build_hint(log)
    log.write_text(building + "2026-12-03 13:52:00,000 llmtrain start-up: model (model.source=config) ...\n")
    assert gpu._op_build_hint(log) == ""
    assert gpu._op_build_hint(tmp_path / "missing.log") == ""
