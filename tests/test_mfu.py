"""MFU everywhere: the peak a run's MFU is measured against (trainer.peak_tflops, a data sheet, or
a matmul probe of this machine, cached per machine), and the tiny default job reporting it."""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import FAST, make_cfg, read_metrics
from llmtrain.common import hardware
from llmtrain.planning import flops

# The machine to itself under xdist (conftest.machine_alone): measures the machine's peak FLOP/s.
pytestmark = pytest.mark.alone

CPU = torch.device("cpu")
# Small sizes and budgets: the real probe, in well under a second per call.
SMALL = functools.partial(hardware.probe_matmul_flops, min_n=64, max_n=256, budget_s=0.5)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty ``LLMTRAIN_CACHE`` of the test's own; returns the peak cache file's path."""
    monkeypatch.setattr(hardware.paths, "CACHE_DIR", tmp_path / "cache")
    return tmp_path / "cache" / hardware.PEAK_CACHE_NAME


class Counting:
    """A probe that counts its calls and otherwise runs ``inner``."""

    def __init__(self, inner=SMALL):
        self.inner, self.calls = inner, []

    def __call__(self, device, precision, cores=None):
        self.calls.append((device.type, precision, cores))
        return self.inner(device, precision, cores)


def test_the_probe_counts_2n3_flops_per_matmul_as_torchs_flop_counter_does():
    with FlopCounterMode(display=False) as counter:
        found = SMALL(CPU, "fp32", cores=1.5)
    assert found.flops_done == counter.get_total_flops() > 0  # every matmul the probe ran, 2 n^3 each
    assert found.n in (64, 128, 256) and found.cores == 1.5 and found.layout in hardware.LAYOUTS
    # The rate is the best timing's FLOPs over its seconds: the wall time, or the CPU time over
    # the cores counted when that is shorter (other processes held the cores meanwhile).
    assert found.seconds == min(found.wall_seconds, found.cpu_seconds / 1.5)
    assert found.flops_per_s == pytest.approx(found.matmuls * 2 * found.n ** 3 / found.seconds)


def test_bad_probe_arguments_name_the_argument():
    with pytest.raises(ValueError, match="precision='fp16'"):
        SMALL(CPU, "fp16")
    with pytest.raises(ValueError, match="min_n=512 must be <= max_n=256"):
        SMALL(CPU, "fp32", min_n=512)
    with pytest.raises(ValueError, match="cores=0"):
        SMALL(CPU, "fp32", cores=0)


def test_bf16_is_measured_faster_than_fp32_exactly_where_it_is_native():
    # hardware.bf16_native reads the CPU flags (AMX / AVX512-BF16); the probe times the matmuls.
    # Native bf16 runs faster than fp32: AMX about 9x; AVX512-BF16 without AMX about 2x (its dot
    # product does two bf16 multiply-adds per fp32 lane; 2.3-3.3x measured here, 1.93x in one CI
    # run with the machine to itself, as this module has it), so the bound is 1.3x. Emulated bf16
    # runs below fp32 even in its fastest layout (Zen 3: 38 against 137 GFLOP/s), which is why
    # trainer.precision=auto keeps such CPUs in fp32. Each precision is probed twice, alternating,
    # and its best kept, so a burst of other load hits both sides.
    probe = functools.partial(hardware.probe_matmul_flops, max_n=1024, budget_s=1.0)
    rounds = [(probe(CPU, "fp32").flops_per_s, probe(CPU, "bf16").flops_per_s) for _ in range(2)]
    fp32, bf16 = max(r[0] for r in rounds), max(r[1] for r in rounds)
    native, evidence = hardware.bf16_native(CPU)
    if native:
        assert bf16 > 1.3 * fp32, (evidence, bf16, fp32)
    else:
        assert bf16 < fp32, (evidence, bf16, fp32)


def test_the_measured_peak_is_cached_per_machine_and_a_bad_cache_is_measured_again(cache):
    probe = Counting()
    first = flops.peak_tflops(CPU, "fp32", probe=probe)
    assert len(probe.calls) == 1 and probe.calls[0][2] == min(torch.get_num_threads(), hardware.usable_cores())
    assert first.source == "measured" and first.precision == "fp32" and first.tflops > 0
    assert re.fullmatch(rf"measured by a (64|128|256)x\1 matmul probe \((NN|NT|TN|TT) layout\) on this CPU "
                        rf"\({re.escape(hardware.cpu_model_name())}"
                        rf", fp32, {torch.get_num_threads()} thread\(s\) x 1 rank\(s\) on \d+ core\(s\)\), cached in "
                        rf"{re.escape(str(cache))}", first.detail), first.detail
    key = hardware.peak_cache_key(CPU, "fp32")
    assert hardware.cpu_model_name() in key and torch.__version__ in key and key.endswith("| fp32")
    entry = json.loads(cache.read_text())[key]
    assert entry["tflops"] == first.tflops and f"{entry['n']}x{entry['n']} matmul probe ({entry['layout']} layout)" \
        in first.detail

    again = flops.peak_tflops(CPU, "fp32", probe=probe)  # read back: no second probe
    assert len(probe.calls) == 1 and again.tflops == first.tflops
    assert f"read from {cache}; delete the file to measure again" in again.detail
    assert entry["measured_at"] in again.detail

    flops.peak_tflops(CPU, "bf16", probe=probe)  # another precision: an entry of its own
    assert len(probe.calls) == 2 and set(json.loads(cache.read_text())) == {key, hardware.peak_cache_key(CPU, "bf16")}

    version = hardware.PROBE_VERSION
    for broken in ("{not json", "[1, 2]", json.dumps({key: {"tflops": -1.0, "probe": version}}),
                   json.dumps({key: {"tflops": "fast", "probe": version}}),
                   json.dumps({key: {**entry, "probe": version - 1}})):  # an older probe's figure
        cache.write_text(broken)
        calls = len(probe.calls)
        peak = flops.peak_tflops(CPU, "fp32", probe=probe)
        assert len(probe.calls) == calls + 1 and peak.tflops > 0, broken
        assert json.loads(cache.read_text())[key]["tflops"] == peak.tflops  # rewritten, usable again


def test_an_unwritable_cache_costs_a_warning_not_the_run(tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(hardware.paths, "CACHE_DIR", tmp_path / "file" / "cache")  # a folder under a file
    peak = flops.peak_tflops(CPU, "fp32", probe=SMALL)
    assert peak.tflops > 0 and "could not write the peak FLOP/s cache" in caplog.text


def test_the_configured_peak_wins_then_the_data_sheet_then_the_probe(cache, monkeypatch):
    probe = Counting()
    configured = flops.peak_tflops(CPU, "bf16", configured=3.5, probe=probe)
    assert configured == flops.Peak(3.5, "bf16", "trainer.peak_tflops", "trainer.peak_tflops=3.5")
    assert configured.describe() == "3.5 TFLOP/s bf16 per device (trainer.peak_tflops=3.5)"

    name = ["NVIDIA H100 80GB HBM3"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name[0])
    gpu = torch.device("cuda", 0)
    assert flops.peak_tflops(gpu, "bf16", configured=100.0, probe=probe).tflops == 100.0
    sheet = flops.peak_tflops(gpu, "bf16", probe=probe)
    assert (sheet.tflops, sheet.source, sheet.detail) == (989.4, "data sheet", "the H100 80GB HBM3 data sheet, dense")
    assert probe.calls == []
    # An accelerator the table lacks is measured (here by a stand-in: there is no GPU to time).
    name[0] = "Some Future GPU"
    stand_in = hardware.MatmulProbe(5e14, 8192, 1, 0.0022, 0.0022, 0.0, 1, 0.0, 0.1)
    unknown = flops.peak_tflops(gpu, "bf16", probe=Counting(lambda *args: stand_in))
    assert unknown.tflops == 500.0 and "8192x8192 matmul probe (NN layout) on this GPU (Some Future GPU, bf16)" \
        in unknown.detail


def _rank(rank: int, world: int, rendezvous: str, cache_dir: str, out: str) -> None:
    import os

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # as torchrun sets it for several ranks
    torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    hardware.paths.CACHE_DIR = __import__("pathlib").Path(cache_dir)
    cores = []

    def probe(device, precision, share):  # rank r measures r + 1 TFLOP/s
        cores.append(share)
        return hardware.MatmulProbe((rank + 1) * 1e12, 256, 1, 1.0, 1.0, 1.0, share, 0.0, 0.0)

    first = flops.peak_tflops(CPU, "fp32", probe=probe)
    second = flops.peak_tflops(CPU, "fp32", probe=probe)  # every rank finds the cache: no probe
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"first": first.tflops, "second": second.tflops, "cores": cores, "detail": first.detail}, f)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ranks_sharing_a_cpu_probe_together_and_agree_on_the_mean(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "out")
    mp.spawn(_rank, args=(2, str(tmp_path / "rendezvous"), str(tmp_path / "cache"), out), nprocs=2, join=True)
    got = [json.loads(open(f"{out}.{r}").read()) for r in range(2)]
    share = min(1, hardware.usable_cores() / 2)
    for r in got:
        assert r["first"] == r["second"] == 1.5  # the mean of 1 and 2 TFLOP/s, then read back
        assert r["cores"] == [share]  # each probed once, with its share of the cores
        assert "1 thread(s) x 2 rank(s)" in r["detail"]
    entries = json.loads((tmp_path / "cache" / hardware.PEAK_CACHE_NAME).read_text())
    assert [e["tflops"] for e in entries.values()] == [1.5] and "1 threads x 2 rank(s)" in next(iter(entries))


def test_the_tiny_default_job_reports_mfu_against_the_probe(cache, tmp_path, caplog):
    from llmtrain.monitoring.report import read_jsonl
    from llmtrain.trainer import train

    run_dir = tmp_path / "run"
    with caplog.at_level("INFO", logger="llmtrain"):
        train(make_cfg(FAST + ["trainer.max_steps=2", "trainer.log_every=1", "tracker.report=true",
                               f"run_dir={run_dir}"]))
    (peak,) = [e for e in read_jsonl(run_dir / "timeline.jsonl") if e["event"] == "peak_flops"]
    assert peak["source"] == "measured" and peak["precision"] == "fp32"
    assert json.loads(cache.read_text())[hardware.peak_cache_key(CPU, "fp32")]["tflops"] == peak["tflops"]
    line = f"MFU against {peak['tflops']:.3g} TFLOP/s fp32 per device ({peak['detail']})"
    assert line in caplog.text and " layout) on this CPU (" in line
    rows = [r for r in read_metrics(run_dir) if "train/loss" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["perf/mfu"] == pytest.approx(r["perf/tflops_per_device"] / peak["tflops"])
    report = (run_dir / "report.md").read_text()
    assert f"| MFU peak | {peak['tflops']:.3g} TFLOP/s fp32 per device ({peak['detail']}) |" in report
