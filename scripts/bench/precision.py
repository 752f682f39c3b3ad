"""fp32 against bf16 mixed precision on the same job (what ``trainer.precision=auto`` chooses
between), on 1 process and on ZeRO-3 x 2: tokens/s from the per-step records (wall clock) and
tokens per CPU-second of the whole run, modes alternating within each round, and the two loss
curves side by side (same data, same initial weights) to show that bf16 converges the same.

    python scripts/bench/precision.py [--rounds 2] [--steps 40]

Model: a config-built Llama (hidden 512, 4 layers, MLP 1376), sequences of 256 tokens, global
batch 16 = micro-batch 8 x accumulation 2 (x dp), Tiny Shakespeare if present, else the stdlib text.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchlib import DATA, alternating, launch

LAYOUTS = {"1 process": (1, []), "ZeRO-3 x 2": (2, ["+recipe=zero3"])}
PRECISIONS = ("fp32", "bf16")


def overrides(steps: int) -> list[str]:
    text = DATA / "tinyshakespeare.txt"
    data = ["data=text", f"data.path={text}"] if text.is_file() else []
    return data + ["model.architecture.hidden_size=512", "model.architecture.intermediate_size=1376",
                   "model.architecture.num_hidden_layers=4", "model.architecture.num_attention_heads=8",
                   "model.architecture.num_key_value_heads=4", "data.seq_len=256", "data.max_bytes=2000000",
                   "trainer.global_batch_size=16", "trainer.micro_batch_size=8", f"trainer.max_steps={steps}",
                   "trainer.warmup_steps=5", "trainer.lr=1e-3", "trainer.eval_every=0", "trainer.save_every=0",
                   "trainer.export_hf=false", "tracker=none", "trainer.progress_bar=false", "trainer.resume=never"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="llmtrain-bench-precision-"))
    results: dict[tuple[str, str], list] = {}
    for round_index in range(args.rounds):
        for layout, (nproc, extra) in LAYOUTS.items():
            for precision in alternating(PRECISIONS, round_index):
                run = launch(overrides(args.steps) + extra + [f"trainer.precision={precision}"],
                             root / f"{layout.replace(' ', '')}-{precision}-{round_index}", nproc=nproc,
                             what=f"{layout} {precision}")
                steps = run.steps(warmup=3)
                tokens = sum(r["train/tokens_seen"] for r in run.steps()[-1:])
                results.setdefault((layout, precision), []).append(
                    (statistics.median(r["train/tokens_per_s"] for r in steps), tokens / run.cpu_s,
                     [r["train/loss"] for r in run.steps()]))
    print(f"{args.rounds} rounds, {args.steps} steps each; median over rounds")
    print(f"{'layout':<12} {'precision':<9} {'tokens/s':>9} {'tokens/CPU-s':>13} {'bf16/fp32 wall':>15} {'bf16/fp32 CPU':>14}")
    for layout in LAYOUTS:
        base = results[(layout, "fp32")]
        for precision in PRECISIONS:
            rows = results[(layout, precision)]
            wall, cpu = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
            ratio = ("", "") if precision == "fp32" else (
                f"{wall / statistics.median(r[0] for r in base):.2f}x", f"{cpu / statistics.median(r[1] for r in base):.2f}x")
            print(f"{layout:<12} {precision:<9} {wall:>9.0f} {cpu:>13.0f} {ratio[0]:>15} {ratio[1]:>14}")
    print("\nloss curves (round 0), every 5th step:")
    print(f"{'step':>5} " + " ".join(f"{layout + ' ' + p:>18}" for layout in LAYOUTS for p in PRECISIONS))
    curves = {key: rows[0][2] for key, rows in results.items()}
    for step in list(range(0, args.steps, 5)) + [args.steps - 1]:
        print(f"{step + 1:>5} " + " ".join(f"{curves[(layout, p)][step]:>18.4f}" for layout in LAYOUTS for p in PRECISIONS))
    for layout in LAYOUTS:
        gap = max(abs(a - b) for a, b in zip(curves[(layout, "fp32")], curves[(layout, "bf16")]))
        last = [sum(curves[(layout, p)][-5:]) / 5 for p in PRECISIONS]
        print(f"{layout}: largest per-step |bf16 - fp32| loss gap {gap:.4f}; mean of the last 5 steps "
              f"fp32 {last[0]:.4f}, bf16 {last[1]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
