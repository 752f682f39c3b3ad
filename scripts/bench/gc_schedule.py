#!/usr/bin/env python
"""Python's garbage collector: ``trainer.gc_every=0`` (CPython's automatic collector) against the
scheduled one (default 50), on the same job, alternating, each run a fresh process.

Each run records every collection CPython makes (``gc.callbacks``): its generation and seconds,
and whether it fell in set-up (``Trainer.__init__``), in the loop (``Trainer.train``: steps,
evaluations, saves, export) or after it (interpreter exit). Prints per arm the median over rounds
of those seconds, the number of full (generation 2) collections, the loop's wall time and the
process's CPU time. On N ranks (``--nproc``) each figure is the largest over the ranks: one
rank's pause holds the others at the next collective. Examples:

    python scripts/bench/gc_schedule.py --rounds 3                      # the default job, 200 steps
    python scripts/bench/gc_schedule.py --rounds 3 --nproc 2 +recipe=fsdp
    python scripts/bench/gc_schedule.py --rounds 2 trainer.max_steps=60 trainer.eval_every=20
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(overrides: list[str]) -> None:
    """One run of ``python -m llmtrain OVERRIDES`` with every collection recorded; prints one
    JSON line (this rank's figures) at exit."""
    import atexit
    import gc
    import runpy

    phase = {"now": "before"}
    started: dict[str, float] = {}
    seen: list[tuple[str, int, float]] = []

    def record(stage, info):
        if stage == "start":
            started["t"] = time.perf_counter()
        else:
            seen.append((phase["now"], info["generation"], time.perf_counter() - started["t"]))

    gc.callbacks.append(record)
    sys.path.insert(0, str(ROOT))
    import llmtrain.trainer as trainer_module

    init, train = trainer_module.Trainer.__init__, trainer_module.Trainer.train
    loop: dict[str, float] = {}

    def timed_init(self, cfg):
        phase["now"] = "setup"
        init(self, cfg)

    def timed_train(self):
        phase["now"], t = "loop", time.perf_counter()
        try:
            return train(self)
        finally:
            loop["s"], phase["now"] = time.perf_counter() - t, "exit"

    trainer_module.Trainer.__init__, trainer_module.Trainer.train = timed_init, timed_train

    def report():
        figures = {"loop_s": loop.get("s", 0.0), "cpu_s": time.process_time()}
        for name in ("before", "setup", "loop", "exit"):
            figures[f"{name}_gc_s"] = sum(s for p, _, s in seen if p == name)
            figures[f"{name}_full"] = sum(1 for p, g, _ in seen if p == name and g == 2)
        print("GC_FIGURES " + json.dumps(figures), flush=True)

    atexit.register(report)
    # The interpreter's last collection comes after every exit hook: the process's wall and CPU
    # time (the parent's figures) hold it, the per-phase figures do not.
    sys.argv = ["llmtrain", *overrides]
    runpy.run_module("llmtrain", run_name="__main__", alter_sys=True)


def run(arm: int, overrides: list[str], nproc: int, base: Path, index: int) -> dict[str, float]:
    run_dir = base / f"run_{index}_gc{arm}"
    args = [__file__, "--child", f"run_dir={run_dir}", "tracker=none", "trainer.progress_bar=false",
            f"trainer.gc_every={arm}", *overrides]
    command = ([sys.executable, *args] if nproc == 1 else
               [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args])
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"gc_every={arm} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    ranks = [json.loads(line.split(" ", 1)[1]) for line in (done.stdout + done.stderr).splitlines()
             if line.startswith("GC_FIGURES ")]
    figures = {k: max(r[k] for r in ranks) for k in ranks[0]}
    figures["cpu_s"] = sum(r["cpu_s"] for r in ranks)
    figures["process_wall_s"] = wall
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--every", type=int, default=50, help="the scheduled arm's trainer.gc_every")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.child:
        child(args.overrides)
        return
    arms = (0, args.every)
    results: dict[int, list[dict[str, float]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="bench-gc-") as tmp:
        for r in range(args.rounds):
            for arm in (arms if r % 2 == 0 else arms[::-1]):  # alternate which goes first
                results[arm].append(run(arm, args.overrides, args.nproc, Path(tmp), r))
                print(f"round {r + 1} gc_every={arm}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[arm][-1].items()),
                      flush=True)
    med = {arm: {k: statistics.median(row[k] for row in rows) for k in rows[0]} for arm, rows in results.items()}
    print(f"\nmedian of {args.rounds} alternating rounds, {args.nproc} process(es), overrides {args.overrides or 'none'}:")
    print(f"{'':28s}" + "".join(f"{f'gc_every={arm}':>16s}" for arm in arms))
    for key, label in (("setup_gc_s", "set-up: collections (s)"), ("setup_full", "set-up: full collections"),
                       ("loop_gc_s", "loop: collections (s)"), ("loop_full", "loop: full collections"),
                       ("loop_s", "loop: wall (s)"), ("process_wall_s", "process: wall (s)"),
                       ("cpu_s", "process: CPU (s, all ranks)")):
        print(f"{label:28s}" + "".join(f"{med[arm][key]:16.3f}" for arm in arms))
    base, ours = med[arms[0]], med[arms[1]]
    print(f"ratios gc_every=0 / gc_every={args.every}: loop wall {base['loop_s'] / ours['loop_s']:.3f}, "
          f"process wall {base['process_wall_s'] / ours['process_wall_s']:.3f}, CPU {base['cpu_s'] / ours['cpu_s']:.3f}")


if __name__ == "__main__":
    main()
