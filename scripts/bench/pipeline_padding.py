"""Pipeline parallel on variable-length data: steps padded to the step's longest micro-batch
(rounded up to ``recipe.pp_pad_multiple``, 64 by default: what llmtrain runs) against every step padded to
``data.seq_len`` (the previous scheme), in tokens/s of real (unpadded) tokens.

Trains ``+recipe=pp`` on alpaca instruction records (the shared data set, or ``--data`` FILE),
alternating the two schemes over rounds in one process group, and prints the median tokens/s
of each with wall-clock and CPU-time ratios.

    torchrun --standalone --nproc_per_node 2 scripts/bench/pipeline_padding.py
    torchrun --standalone --nproc_per_node 2 scripts/bench/pipeline_padding.py --rounds 4 --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchlib import DATA

import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from llmtrain import trainer
from llmtrain.common.paths import CONF_DIR
from llmtrain.config.compose import register_configs
from llmtrain.parallel.distributed import shutdown

SHARED = DATA / "alpaca_5000.json"


def run(scheme: str, data: str, steps: int, root: str, round_index: int, seq_len: int) -> tuple[float, float]:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[
            "+recipe=pp", "data=alpaca", f"data.path={data}", f"data.seq_len={seq_len}", f"trainer.max_steps={steps}",
            "trainer.global_batch_size=16", "trainer.micro_batch_size=4", "tracker=none", "trainer.progress_bar=false",
            "trainer.eval_every=0", "trainer.eval_samples=4", "trainer.export_hf=false",
            # The previous scheme: every step padded to data.seq_len.
            f"recipe.pp_pad_multiple={64 if scheme == 'step length' else seq_len}",
            f"run_dir={root}/{scheme.replace(' ', '_')}-{round_index}"])
    cpu = time.process_time()
    summary = trainer.train(cfg)
    cpu = time.process_time() - cpu
    if dist.get_rank() != 0:  # metrics.jsonl is rank 0's
        return 0.0, 0.0
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/loss" in r and r["step"] > 2]  # steps 1-2 build the schedules
    tokens = sum(r["train/tokens_per_s"] * r["train/step_time_s"] for r in rows)
    wall = sum(r["train/step_time_s"] for r in rows)
    return tokens / wall, tokens / cpu  # CPU time of the whole run (set-up included), rank 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(SHARED))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=1024,
                        help="data.seq_len (byte tokens: alpaca records are ~150-1000 long)")
    args = parser.parse_args()
    register_configs()
    root = f"{tempfile.gettempdir()}/llmtrain-bench-pp-pad-{os.environ.get('TORCHELASTIC_RUN_ID', os.getppid())}"
    results: dict[str, list[tuple[float, float]]] = {"seq_len": [], "step length": []}
    for r in range(args.rounds):
        for scheme in (("seq_len", "step length") if r % 2 == 0 else ("step length", "seq_len")):
            results[scheme].append(run(scheme, args.data, args.steps, root, r, args.seq_len))
    if dist.get_rank() == 0:
        med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in results.items()}
        for scheme, (wall, cpu) in med.items():
            print(f"padded to {scheme:11s}: {wall:8.0f} real tokens/s (wall), {cpu:8.0f} per CPU-second")
        print(f"ratio step length / seq_len: wall {med['step length'][0] / med['seq_len'][0]:.2f}, "
              f"CPU time {med['step length'][1] / med['seq_len'][1]:.2f}")
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
