"""In-loop task evaluation (``trainer.eval_tasks``): what it costs training, side by side in
alternating rounds, with wall-clock and CPU-time ratios:

    python scripts/bench/eval.py [--rounds 2] [--steps 40] [--every 10] [--limit 100] [--nproc 1]

Three runs of the same command per round: ``off`` (no task evaluation), ``async`` (each due
checkpoint scored on ``hh_local`` in a process of its own while training goes on, the default)
and ``sync`` (``trainer.eval_tasks_async=false``: training waits for each). Reported per mode:
training tokens/s (the mean of ``train/tokens_per_s`` over the steps after the first two, from
metrics.jsonl: the speed of the steps themselves), the run's wall time from launch to exit (which
includes waiting for the last evaluation), and the CPU seconds of the run and every process it
started (child rusage), each as a ratio to ``off``. On a machine whose cores training already
fills, an evaluation process competes with training for them: ``async`` then shows up in tokens/s;
with a device of its own (``trainer.eval_tasks_device``) or spare cores it does not.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchlib import DATA, alternating, launch


def run(mode: str, args: argparse.Namespace, root: Path) -> dict[str, float]:
    run_dir = root / f"{mode}-{time.time_ns()}"
    overrides = ["data=tinyshakespeare", f"data.path={DATA / 'tinyshakespeare.txt'}",
                 "data.seq_len=256", f"trainer.max_steps={args.steps}", "trainer.global_batch_size=16",
                 "trainer.micro_batch_size=8", "trainer.eval_every=0", "tracker=none", "tracker.report=false",
                 "trainer.progress_bar=false", "trainer.export_hf=false"]
    if mode != "off":
        overrides += ["trainer.eval_tasks=[hh_local]", f"trainer.eval_tasks_every={args.every}",
                      f"trainer.eval_tasks_data_dir={DATA}",
                      f"trainer.eval_tasks_limit={args.limit}", f"trainer.eval_tasks_async={mode == 'async'}"]
    done = launch(overrides, run_dir, nproc=args.nproc, env={"OMP_NUM_THREADS": "1"}, what=mode)
    speeds = [r["train/tokens_per_s"] for r in done.records if "train/tokens_per_s" in r and r["step"] > 2]
    scores = [r["step"] for r in done.records if "eval/hh_local/acc" in r]
    return {"tokens_per_s": sum(speeds) / len(speeds), "wall_s": done.wall_s, "cpu_s": done.cpu_s,
            "scored": len(scores)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--nproc", type=int, default=1)
    args = parser.parse_args()
    modes = ["off", "async", "sync"]
    totals = {m: {"tokens_per_s": 0.0, "wall_s": 0.0, "cpu_s": 0.0} for m in modes}
    with tempfile.TemporaryDirectory(prefix="bench_eval-") as tmp:
        for r in range(args.rounds):
            for mode in alternating(modes, r):
                got = run(mode, args, Path(tmp))
                print(f"round {r + 1} {mode:>5}: {got['tokens_per_s']:,.0f} tokens/s, wall {got['wall_s']:.1f} s, "
                      f"cpu {got['cpu_s']:.1f} s, {got['scored']} scores logged", flush=True)
                for key in totals[mode]:
                    totals[mode][key] += got[key]
    print(f"\n{args.steps} steps, hh_local ({args.limit} documents) every {args.every} steps, {args.nproc} process(es), "
          f"{args.rounds} rounds")
    print("mode   tokens/s (x off)   wall s (x off)   cpu s (x off)")
    for mode in modes:
        t = {k: v / args.rounds for k, v in totals[mode].items()}
        base = {k: v / args.rounds for k, v in totals["off"].items()}
        print(f"{mode:<6} {t['tokens_per_s']:>9,.0f} ({t['tokens_per_s'] / base['tokens_per_s']:.2f})"
              f"   {t['wall_s']:>7.1f} ({t['wall_s'] / base['wall_s']:.2f})"
              f"   {t['cpu_s']:>7.1f} ({t['cpu_s'] / base['cpu_s']:.2f})")


if __name__ == "__main__":
    main()
