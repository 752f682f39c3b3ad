#!/usr/bin/env python
"""Checkpoint throughput against plain ``torch.save`` / ``torch.load`` of the same tensors.

Builds the configured model on one process with the chosen recipe, takes one optimizer step (so
Adam state exists), then times, alternating, ``--rounds`` times each:

* llmtrain save: engine shards + RNG + marker (SHA-256 of every file, fsync, atomic rename);
* plain save: one ``torch.save`` of the model and optimizer state dicts, fsynced;
* llmtrain resume: verify the marker (re-hash) + engine load;
* plain load: ``torch.load`` + ``load_state_dict`` of model and optimizer.

Prints bytes/s of each and the ratios, and the time a resume adds before the first step
(verification + load). Example (≈25 M parameters):

    python scripts/bench_checkpoint.py model.architecture.hidden_size=512 model.architecture.num_hidden_layers=8
    python scripts/bench_checkpoint.py +recipe=zero2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llmtrain.distributed as distributed  # noqa: E402  (before deepspeed)

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from llmtrain import checkpoint, data  # noqa: E402
from llmtrain.config import gradient_accumulation_steps, register_configs  # noqa: E402
from llmtrain.engine import build_engine  # noqa: E402
from llmtrain.models import build_model, byte_tokenizer  # noqa: E402
from llmtrain.parallel_dims import ParallelDims  # noqa: E402
from llmtrain.paths import CONF_DIR  # noqa: E402
from llmtrain.trainer import forward_backward  # noqa: E402


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["tracker=none"] + args.overrides)
    env = distributed.init_distributed(need_group=cfg.recipe.engine == "deepspeed")
    dims = ParallelDims.from_recipe(cfg.recipe, 1)
    engine = build_engine(cfg, env, gradient_accumulation_steps(cfg.trainer, 1), dims)
    with engine.model_init_context():
        model = build_model(cfg.model, cfg.trainer.seed)
    engine.setup(model)
    tok = byte_tokenizer()
    batch = data.Collator(tok.pad_token_id)([{"input_ids": list(range(64)), "labels": list(range(64))}] * 2)
    forward_backward(engine, [batch])
    engine.step()

    times: dict[str, list[float]] = {k: [] for k in ("save", "plain_save", "resume", "plain_load")}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        manager = checkpoint.CheckpointManager(Path(tmp) / "run", env, keep=1)
        state = checkpoint.TrainState(step=1, consumed_samples=2, world_size=1, global_batch_size=2)
        plain_file = Path(tmp) / "plain.pt"
        for r in range(args.rounds):
            state.step = r + 1
            t0 = time.perf_counter()
            saved = manager.save(engine, state, "")
            times["save"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            with open(plain_file, "wb") as f:
                torch.save({"model": engine.model.state_dict(), "optimizer": engine.optimizer.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            times["plain_save"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            assert checkpoint.verify(saved) is None
            manager.load(engine, saved)
            times["resume"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            blob = torch.load(plain_file, weights_only=False)
            engine.model.load_state_dict(blob["model"])
            engine.optimizer.load_state_dict(blob["optimizer"])
            times["plain_load"].append(time.perf_counter() - t0)
        ours_bytes, plain_bytes = folder_bytes(saved), plain_file.stat().st_size

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"recipe {cfg.recipe.name}, model {sum(p.numel() for p in engine.model.parameters()) / 1e6:.1f} M parameters, "
          f"checkpoint {ours_bytes / 2**20:.1f} MiB (plain file {plain_bytes / 2**20:.1f} MiB), median of {args.rounds}")
    print(f"save   llmtrain {ours_bytes / med['save'] / 2**20:8.1f} MiB/s   plain torch.save {plain_bytes / med['plain_save'] / 2**20:8.1f} MiB/s"
          f"   ratio {(ours_bytes / med['save']) / (plain_bytes / med['plain_save']):.2f}")
    print(f"load   llmtrain {ours_bytes / med['resume'] / 2**20:8.1f} MiB/s   plain torch.load {plain_bytes / med['plain_load'] / 2**20:8.1f} MiB/s"
          f"   ratio {(ours_bytes / med['resume']) / (plain_bytes / med['plain_load']):.2f}")
    print(f"a resume adds {med['resume']:.3f} s before the first step (marker verification + load); plain load {med['plain_load']:.3f} s")


if __name__ == "__main__":
    main()
