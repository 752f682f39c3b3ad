"""What this machine's matmul units run natively, for ``trainer.precision=auto``.

bf16 mixed precision is the default wherever bf16 matmuls are native: NVIDIA GPUs of compute
capability 8.0 or later (Ampere's bf16 tensor cores; A100, H100, H200, L40S, RTX 30/40), and CPUs
with AMX (``amx_bf16``, Intel Sapphire Rapids and later) or AVX512-BF16 (``avx512_bf16``: Cooper
Lake, Zen 4), read from the kernel's CPU flags (``/proc/cpuinfo``). Elsewhere bf16 would be
emulated, slower than fp32, and the run stays in fp32.

For MFU where no data sheet names the device (CPUs, unknown GPUs): :func:`probe_matmul_flops`
measures the dense matmul rate this process reaches at a precision, kept per machine in
``LLMTRAIN_CACHE/peak_flops.json`` (default ``~/.cache/llmtrain``; :func:`read_cached_peak`,
:func:`write_cached_peak`), so only the first run on a machine pays the probe's second or two
(:func:`llmtrain.planning.flops.peak_tflops` decides when to measure).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import platform
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from llmtrain.common import paths

log = logging.getLogger("llmtrain")

PRECISIONS = ("auto", "fp32", "bf16")
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.lru_cache(maxsize=None)
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags as the kernel lists them (empty where there is no
    ``/proc/cpuinfo``, e.g. macOS)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def bf16_native(device: torch.device, flags: frozenset[str] | None = None) -> tuple[bool, str]:
    """Whether ``device`` runs bf16 matmuls natively, and the evidence in a few words.

    ``flags``: CPU flags to judge instead of this machine's (tests)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        return (major >= 8, f"{name}, compute capability {major}.{minor} {'>=' if major >= 8 else '<'} 8.0")
    if device.type == "cpu":
        found = [flag for flag in BF16_CPU_FLAGS if flag in (cpu_flags() if flags is None else flags)]
        if found:
            return True, f"the CPU has {' and '.join(found)}"
        return False, "the CPU has neither amx_bf16 nor avx512_bf16"
    return False, f"no bf16 rule for device type {device.type}"


def resolve_precision(requested: str, device: torch.device) -> tuple[str, str]:
    """``trainer.precision`` as the run uses it (``fp32`` or ``bf16``) and why: ``auto`` picks
    bf16 where :func:`bf16_native`, else fp32; ``fp32`` and ``bf16`` are kept as given."""
    if requested != "auto":
        return requested, f"trainer.precision={requested}"
    native, evidence = bf16_native(device)
    return ("bf16" if native else "fp32"), f"trainer.precision=auto: {evidence}"


def default_device() -> torch.device:
    """The device a rank of this machine trains on: CUDA where a GPU is visible, else the CPU
    (the rule of :mod:`llmtrain.parallel.distributed`)."""
    return torch.device("cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu")


# ---- measured peak FLOP/s (for MFU where no data sheet applies) --------------------------------
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PEAK_CACHE_NAME = "peak_flops.json"
PROBE_BUDGET_S = 2.0
# Raised whenever the probe measures differently: the cache's entries of another version are
# measured again (version 3: the fastest of four operand layouts, CPU time over the cores,
# sizes from 512 up).
PROBE_VERSION = 3


def matmul_flops(n: int) -> float:
    """FLOPs of one ``n x n`` by ``n x n`` matmul: ``2 n^3`` (a multiply-add is 2 FLOPs, the
    count torch.utils.flop_counter and PaLM's appendix B use)."""
    return 2.0 * n ** 3


@dataclass(frozen=True)
class MatmulProbe:
    """What :func:`probe_matmul_flops` measured.

    ``flops_per_s``: the best timing's rate (FLOP/s), ``matmuls`` matmuls of side ``n`` in
    ``seconds``, operands laid out as ``layout`` (:data:`LAYOUTS`); ``wall_seconds`` and
    ``cpu_seconds`` (the process's CPU time over all threads) of that timing; ``cores``: the
    cores it counted (``seconds`` is the shorter of the wall time and ``cpu_seconds / cores``,
    see :func:`probe_matmul_flops`); ``flops_done``: FLOPs of every matmul the probe ran,
    warm-ups included; ``wall_s``: the probe's own wall time."""

    flops_per_s: float
    n: int
    matmuls: int
    seconds: float
    wall_seconds: float
    cpu_seconds: float
    cores: float
    flops_done: float
    wall_s: float
    layout: str = "NN"


# Operand layouts (N: as stored, T: a transposed view), all of which training runs: a Linear's
# forward is x @ W.T (NT), its input gradient g @ W (NN), its weight gradient g.T @ x (TN). Their
# speeds can differ by far: bf16 emulated on Zen 3 runs TN at 43 GFLOP/s, NT at 18, NN at 2.
LAYOUTS = {"NN": lambda a, b: (a, b), "NT": lambda a, b: (a, b.t()),
           "TN": lambda a, b: (a.t(), b), "TT": lambda a, b: (a.t(), b.t())}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a SLURM allocation's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no affinity masks
        return os.cpu_count() or 1


def probe_matmul_flops(device: torch.device, precision: str, cores: float | None = None, max_n: int | None = None,
                       min_n: int = 512, budget_s: float = PROBE_BUDGET_S, repeats: int = 3,
                       target_s: float = 0.02) -> MatmulProbe:
    """The peak dense matmul rate of one process on ``device`` at ``precision`` (``bf16`` or
    ``fp32``), with the torch threads it has now (``torch.get_num_threads()``: the ones it trains
    with).

    Square matmuls of side ``min_n`` (512: smaller ones run below steady state, and a busy
    machine's wall clock may leave no time for a larger one), doubling up to ``max_n`` (default
    4096 on CPU, 8192 on a GPU, where smaller ones do not fill the device). First each operand
    layout of :data:`LAYOUTS` gets a warm-up (oneDNN's and cuBLAS's kernel selection) and one
    timing at side ``min(min_n, 256)``, and the fastest is kept for the rest; every size then
    gets a warm-up and ``repeats`` timings of enough back-to-back matmuls to last ``target_s``.
    The next size is tried only while a warm-up and one timing of it (the current matmul's time
    times the cube of the size ratio, each) fit in what is left of ``budget_s``, so a CPU that
    emulates bf16 stops at a small size instead of spending a minute. The result is the best
    timing: peak means the fastest rate seen, and larger sizes only help (steady state), noise
    only hurts.

    On a CPU a timing counts the time the threads had the cores: the shorter of its wall time and
    the process's CPU time over ``cores`` (default: its threads, at most :func:`usable_cores`).
    Other processes on the machine take cores away from the wall clock, not from CPU time, so a
    busy machine (a shared CI runner, other jobs) still measures what its cores do; several
    ranks sharing the cores pass their share as ``cores``. GPUs: wall time.

    Returns:
        :class:`MatmulProbe`; ``flops_per_s`` in FLOP/s (``2 n^3`` per matmul).

    Raises:
        ValueError: a precision other than ``bf16``/``fp32``, ``min_n`` > ``max_n``, or ``cores`` <= 0.
    """
    if precision not in DTYPES:
        raise ValueError(f"precision={precision!r}: the probe measures one of {', '.join(DTYPES)}")
    max_n = max_n or (8192 if device.type == "cuda" else 4096)
    if min_n > max_n:
        raise ValueError(f"min_n={min_n} must be <= max_n={max_n}")
    cores = cores if cores is not None else min(torch.get_num_threads(), usable_cores())
    if cores <= 0:
        raise ValueError(f"cores={cores} must be > 0")
    dtype, started = DTYPES[precision], time.perf_counter()
    deadline = started + budget_s
    best: MatmulProbe | None = None
    # The layouts are compared at a small size (256 at most), where the slowest costs little.
    done, n, layouts = 0.0, min(min_n, 256), list(LAYOUTS)

    def timed(a: torch.Tensor, b: torch.Tensor, count: int) -> tuple[float, float]:
        _sync(device)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            torch.mm(a, b)
        _sync(device)
        return time.perf_counter() - wall, time.process_time() - cpu

    while True:
        square = [torch.randn(n, n, device=device, dtype=dtype) for _ in range(2)]
        per_matmul = {}
        for layout in layouts:
            a, b = LAYOUTS[layout](*square)
            one = timed(a, b, 1)[0]  # warm-up: its time only sizes the timings
            done += matmul_flops(n)
            count = max(1, min(64, math.ceil(target_s / max(one, 1e-9))))
            per_matmul[layout] = one
            for i in range(repeats if len(layouts) == 1 else 1):
                if i and time.perf_counter() + count * per_matmul[layout] > deadline:
                    break
                wall, cpu = timed(a, b, count)
                done += count * matmul_flops(n)
                per_matmul[layout] = min(per_matmul[layout], wall / count)
                seconds = wall if device.type != "cpu" else min(wall, cpu / cores)
                rate = count * matmul_flops(n) / max(seconds, 1e-12)
                if best is None or rate > best.flops_per_s:
                    best = MatmulProbe(rate, n, count, seconds, wall, cpu, cores, 0.0, 0.0, layout)
        selecting, layouts = len(layouts) > 1, [best.layout]
        grown = max(2 * n, min_n) if selecting else 2 * n
        if grown > max_n or time.perf_counter() + 2 * (grown / n) ** 3 * per_matmul[best.layout] > deadline:
            break
        n = grown
    return dataclasses.replace(best, flops_done=done, wall_s=time.perf_counter() - started)


def cpu_model_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first CPU's ``model name`` from ``/proc/cpuinfo`` (``platform.processor()`` elsewhere)."""
    try:
        for line in Path(cpuinfo).read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_label(device: torch.device) -> str:
    """The device's model in words: the CPU's model name, or the GPU's name."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model_name()


def peak_cache_key(device: torch.device, precision: str, local_ranks: int = 1) -> str:
    """The cache entry a measurement belongs to: the device model, torch's version, the threads
    of one process and how many ranks of this machine probed together (they share the cores: two
    ranks on one CPU each get about half of it), and the precision."""
    threads = f" | {torch.get_num_threads()} threads x {local_ranks} rank(s)" if device.type == "cpu" else ""
    return f"{device_label(device)} | torch {torch.__version__}{threads} | {precision}"


def peak_cache_path() -> Path:
    """``LLMTRAIN_CACHE/peak_flops.json`` (read at call time, so a test can point it elsewhere)."""
    return paths.CACHE_DIR / PEAK_CACHE_NAME


def _read_entries(path: Path) -> dict:
    """The cache's entries; {} for a missing file, and (with a warning) for one that does not
    read or parse as an object of entries: it is measured again and rewritten."""
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("peak FLOP/s cache %s is unreadable (%s); measuring again", path, err)
        return {}
    if not isinstance(entries, dict):
        log.warning("peak FLOP/s cache %s holds no object of entries; measuring again", path)
        return {}
    return entries


def read_cached_peak(key: str, path: Path | None = None) -> dict | None:
    """The cache entry ``key`` (``tflops``, ``n``, ``measured_at`` ...) when it holds a usable
    figure (a positive finite ``tflops``) of this :data:`PROBE_VERSION`, else None."""
    entry = _read_entries(path or peak_cache_path()).get(key)
    if not isinstance(entry, dict) or entry.get("probe") != PROBE_VERSION:
        return None
    tflops = entry.get("tflops")
    if isinstance(tflops, (int, float)) and not isinstance(tflops, bool) and math.isfinite(tflops) and tflops > 0:
        return entry
    log.warning("peak FLOP/s cache entry %r has no usable tflops (%r); measuring again", key, tflops)
    return None


def write_cached_peak(key: str, entry: dict, path: Path | None = None) -> bool:
    """Add ``entry`` under ``key`` (other entries kept) by an atomic rename, so a reader never
    sees half a file. A cache that cannot be written (read-only home) costs a warning and a
    probe next time, never the run. Returns whether it was written."""
    path = path or peak_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _read_entries(path)
        entries[key] = entry
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
        return True
    except OSError as err:
        log.warning("could not write the peak FLOP/s cache %s (%s); the next run measures again", path, err)
        return False


def peak_entry(tflops: float, n: int, layout: str, probe_s: float) -> dict:
    """The cache entry of a measurement made now: ``tflops`` (TFLOP/s per device), the probe's
    matrix side ``n`` and operand ``layout``, the :data:`PROBE_VERSION`, ``measured_at`` (UTC,
    ISO 8601) and the probe's wall seconds."""
    return {"tflops": tflops, "n": n, "layout": layout, "probe": PROBE_VERSION, "probe_s": round(probe_s, 3),
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
