#!/usr/bin/env python
"""Where llmtrain's GRPO step on the TRL job (``grpo_trl.py``'s, one process) holds its memory, by
phase: the resident set (``VmRSS``, its anonymous and file-backed parts) and glibc's live heap
(``mallinfo2``: bytes in use from the arenas plus mmapped chunks; and the arenas' free bytes) sampled every 10 ms from a
thread, each sample labelled with the phase the main thread is in: ``sampling`` (the rollout's
decoding loop), ``forward k`` / ``backward k`` (micro-batch k of the training pass), ``optimizer``
(clipping, AdamW's update, zeroing the gradients) and ``other`` (scoring, layout, logging).
Printed per step: each phase's peak of each figure and the live heap when the phase began, so a
phase's own memory is its peak less what it started with.

With ``--saved`` the training forwards also count the bytes autograd saves for backward
(``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters left out), by
micro-batch.

Run it under the allocator setting the comparison uses (the threshold is read from the
environment at start-up, so set it there):

    MALLOC_MMAP_THRESHOLD_=65536 python scripts/bench/grpo_phases.py --steps 2 --ckpt
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
import threading
import time

import benchlib  # noqa: F401  (the checkout's llmtrain first on the path)
import grpo_trl


class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = Mallinfo2


def live_heap() -> int:
    """Bytes glibc has handed out and not had back: arena chunks in use plus mmapped chunks."""
    info = LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


def status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) * 1024
    return out


class Phases:
    """The phase the main thread is in, and each (step, phase)'s peaks from the sampling thread."""

    def __init__(self):
        self.step, self.phase = 0, "start-up"
        self.peaks: dict[tuple[int, str], dict[str, int]] = {}
        self.entered: dict[tuple[int, str], int] = {}
        self.saved: dict[tuple[int, str], int] = {}
        self.done = threading.Event()

    def enter(self, phase: str) -> None:
        key = (self.step, phase)
        self.entered.setdefault(key, live_heap())
        self.phase = phase

    def sample(self) -> None:
        while not self.done.wait(0.01):
            key = (self.step, self.phase)
            now = {**status(), "live": live_heap(), "free": LIBC.mallinfo2().fordblks}
            peak = self.peaks.setdefault(key, dict.fromkeys(now, 0))
            for k, v in now.items():
                peak[k] = max(peak[k], v)

    def report(self) -> None:
        mib = 2**20
        print(f"{'step':>4s} {'phase':14s} {'live at start':>14s} {'live peak':>10s} {'its own':>8s} {'VmRSS':>8s} "
              f"{'RssAnon':>8s} {'RssFile':>8s} {'heap free':>9s} {'saved':>8s}  (MiB)")
        for key, peak in self.peaks.items():
            start = self.entered.get(key, 0)
            saved = self.saved.get(key)
            print(f"{key[0]:4d} {key[1]:14s} {start / mib:14.0f} {peak['live'] / mib:10.0f} "
                  f"{(peak['live'] - start) / mib:8.0f} {peak['VmRSS'] / mib:8.0f} {peak['RssAnon'] / mib:8.0f} "
                  f"{peak['RssFile'] / mib:8.0f} {peak['free'] / mib:9.0f} {saved / mib if saved is not None else float('nan'):8.1f}")


def instrument(phases: Phases, count_saved: bool) -> None:
    """Label the trainer's phases (patched methods; restored by the process's end)."""
    import torch

    from llmtrain.engine.torch_engine import TorchEngine
    from llmtrain.rollout.rollout import Rollout
    from llmtrain.trainer import Trainer

    def wrap(owner, name, label, after="other"):
        real = getattr(owner, name)

        def wrapper(*a, **k):
            phases.enter(label() if callable(label) else label)
            try:
                return real(*a, **k)
            finally:
                phases.enter(after)
        setattr(owner, name, wrapper)

    micro = {"k": 0}

    def forward_label():
        micro["k"] += 1
        return f"forward {micro['k']}"

    real_train_step = Trainer.train_step

    def train_step(self, step):
        phases.step, micro["k"] = step + 1, 0
        phases.enter("other")
        return real_train_step(self, step)

    Trainer.train_step = train_step
    wrap(Rollout, "_sample_step", "sampling")
    wrap(TorchEngine, "backward", lambda: f"backward {micro['k']}")
    wrap(TorchEngine, "step", "optimizer")
    real_forward = TorchEngine.forward

    def forward(self, batch):
        phases.enter(forward_label())
        if not count_saved:
            return real_forward(self, batch)
        # The parameters' storages are not the step's memory (the label head saves the output layer's weight).
        seen: set[int] = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        total = [0]

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total[0] += storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = real_forward(self, batch)
        phases.saved[(phases.step, phases.phase)] = total[0]
        return out

    TorchEngine.forward = forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--g", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--ckpt", action="store_true", help="trainer.activation_checkpointing=true")
    parser.add_argument("--saved", action="store_true", help="count autograd's saved bytes per forward")
    parser.add_argument("--llmtrain", action="append", default=[], metavar="OVERRIDE")
    opts = parser.parse_args()
    opts.nproc = 1
    if opts.ckpt:
        opts.llmtrain.append("trainer.activation_checkpointing=true")
    import torch

    from llmtrain import trainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}; overrides {opts.llmtrain}")
    phases = Phases()
    instrument(phases, opts.saved)
    sampler = threading.Thread(target=phases.sample, daemon=True)
    sampler.start()
    began = time.process_time()
    with tempfile.TemporaryDirectory() as run_dir:
        trainer.train(grpo_trl.compose(grpo_trl.llmtrain_overrides(opts, run_dir)))
    phases.done.set()
    sampler.join()
    print(f"CPU {time.process_time() - began:.1f} s")
    phases.report()


if __name__ == "__main__":
    main()
