"""glibc's heap: large frees go back to the system at once (``trainer.malloc_mmap_threshold``).

glibc serves an allocation above its mmap threshold with an ``mmap`` of its own and unmaps it
when freed; below it, from the heap, which keeps what is freed for later allocations (returned
to the system only from the top of the heap, past ``M_TRIM_THRESHOLD``). The threshold starts
at 128 KiB and is *dynamic*: every free of an mmapped chunk raises it to that chunk's size, up
to 32 MiB (``DEFAULT_MMAP_THRESHOLD_MAX``; mallopt(3)). After the first forward has freed a few
activations the threshold sits at megabytes, and a training step's activations, logits and
gradients (tensors of 0.1-30 MiB on a CPU) come from the heap, which then holds their high-water
mark, fragmented, for the rest of the run: the resident set follows the largest step so far plus
whatever the sampling loop's KV cache left in between, not the live tensors. A fixed threshold
(setting it turns the dynamic adjustment off) keeps tensors above it out of the heap.

Measured on GRPO's SmolLM2-135M LoRA job (BENCHMARKS.md "GRPO against TRL's GRPOTrainer"): one
process's peak RSS 3.46 -> 2.15 GiB at 64 KiB, with 1.30 GiB of live allocations at the peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("llmtrain")

M_MMAP_THRESHOLD = -3  # <malloc.h>
# glibc refuses a larger threshold (HEAP_MAX_SIZE / 2 on 64-bit): mallopt(3).
MAX_THRESHOLD = 32 * 2**20


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (bytes, 1 .. 32 MiB) for this process, turning
    its dynamic adjustment off (see the module); 0 leaves glibc's default. Returns whether it was
    set: False (and nothing changed) on a C library without glibc's ``mallopt``, e.g. macOS's."""
    if not nbytes:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("trainer.malloc_mmap_threshold: no mallopt in this C library; left as it is")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, int(nbytes)))


def trimmer(nbytes: int):
    """What the trainer calls between a step's phases (before its sampling, before its training
    pass): with ``trainer.malloc_mmap_threshold`` set (``nbytes`` > 0), glibc's ``malloc_trim(0)``,
    which hands back every whole free page in the heap's arenas (``madvise``), not only those at
    the top: the small tensors and Python buffers (below the threshold) that the last phase freed
    leave their pages resident otherwise, under the next phase's peak. Values are untouched (free
    memory only). 0, or a C library without ``malloc_trim``: a no-op."""
    if not nbytes:
        return lambda: None
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)
