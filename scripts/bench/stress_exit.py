"""Launch short 2-rank DeepSpeed runs repeatedly and count exit statuses: a finished run must
exit 0 every time (issue 10, kind 8: a rank once aborted at interpreter exit about 1 in 20).

    python scripts/bench/stress_exit.py [LAUNCHES] [--recipes zero1,zero2,zero3]
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("launches", type=int, nargs="?", default=20)
    parser.add_argument("--recipes", default="zero1,zero2,zero3")
    args = parser.parse_args()
    recipes = args.recipes.split(",")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_SILENT="true")
    statuses: collections.Counter = collections.Counter()
    with tempfile.TemporaryDirectory() as root:
        for i in range(args.launches):
            recipe = recipes[i % len(recipes)]
            started = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "llmtrain",
                 f"+recipe={recipe}", "tracker=none", "trainer.progress_bar=false", "data.max_bytes=300000",
                 "data.seq_len=64", "trainer.eval_every=0", "trainer.eval_samples=8", "trainer.max_steps=1",
                 f"run_dir={root}/{i}"], capture_output=True, text=True, env=env)
            statuses[proc.returncode] += 1
            tail = "" if proc.returncode == 0 else " | " + proc.stderr.strip().splitlines()[-1][:200]
            print(f"launch {i + 1}/{args.launches} {recipe}: exit {proc.returncode} "
                  f"({time.perf_counter() - started:.1f} s){tail}", flush=True)
    print("exit statuses:", dict(statuses))
    return 0 if set(statuses) == {0} else 1


if __name__ == "__main__":
    sys.exit(main())
