"""The matmul probe behind CPU MFU (llmtrain.common.hardware.probe_matmul_flops), fp32 against
bf16 on this machine: each round probes both (the order alternating over rounds) and prints the
figure the trainer would cache (CPU time over the cores) next to the wall-clock rate of the same
timing, then the medians and the bf16/fp32 ratio. ``--layouts`` also times each operand layout
alone at one size (emulated bf16 differs by an order of magnitude between them).

    python scripts/bench/peak_probe.py --rounds 3
    OMP_NUM_THREADS=1 python scripts/bench/peak_probe.py --rounds 2 --layouts 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as python -m llmtrain runs (llmtrain/__main__.py)

import torch  # noqa: E402

from llmtrain.common import hardware  # noqa: E402


def layout_rates(precision: str, n: int) -> dict[str, float]:
    """GFLOP/s of each operand layout at side ``n``: the best of 3 timings, CPU time over the threads."""
    dtype, threads, out = hardware.DTYPES[precision], torch.get_num_threads(), {}
    x, y = (torch.randn(n, n, dtype=dtype) for _ in range(2))
    for name, arrange in hardware.LAYOUTS.items():
        a, b = arrange(x, y)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(3):
            began = time.process_time()
            torch.mm(a, b)
            best = min(best, (time.process_time() - began) / threads)
        out[name] = hardware.matmul_flops(n) / best / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layouts", type=int, default=0, metavar="N", help="also time each layout at side N")
    args = parser.parse_args()
    cpu = torch.device("cpu")
    print(f"{hardware.cpu_model_name()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"bf16 native: {hardware.bf16_native(cpu)[1]}")
    figures: dict[str, list[tuple[float, float]]] = {"fp32": [], "bf16": []}
    for r in range(args.rounds):
        for precision in ("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32"):
            p = hardware.probe_matmul_flops(cpu, precision)
            wall = p.matmuls * hardware.matmul_flops(p.n) / p.wall_seconds
            figures[precision].append((p.flops_per_s, wall))
            print(f"round {r} {precision}: {p.flops_per_s / 1e9:7.2f} GFLOP/s cached figure, {wall / 1e9:7.2f} wall "
                  f"(n={p.n}, {p.layout}, probe {p.wall_s:.2f} s)", flush=True)
    med = {k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for k, v in figures.items()}
    print(f"median: fp32 {med['fp32'][0] / 1e9:.2f} GFLOP/s, bf16 {med['bf16'][0] / 1e9:.2f} GFLOP/s, "
          f"bf16/fp32 {med['bf16'][0] / med['fp32'][0]:.2f}x (wall {med['bf16'][1] / med['fp32'][1]:.2f}x)")
    if args.layouts:
        for precision in ("fp32", "bf16"):
            rates = layout_rates(precision, args.layouts)
            print(f"{precision} at n={args.layouts}: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()) + " GFLOP/s")


if __name__ == "__main__":
    main()
