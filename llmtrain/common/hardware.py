"""What this machine's matmul units run natively, for ``trainer.precision=auto``.

bf16 mixed precision is the default wherever bf16 matmuls are native: NVIDIA GPUs of compute
capability 8.0 or later (Ampere's bf16 tensor cores; A100, H100, H200, L40S, RTX 30/40), and CPUs
with AMX (``amx_bf16``, Intel Sapphire Rapids and later) or AVX512-BF16 (``avx512_bf16``: Cooper
Lake, Zen 4), read from the kernel's CPU flags (``/proc/cpuinfo``). Elsewhere bf16 would be
emulated, slower than fp32, and the run stays in fp32.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

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
