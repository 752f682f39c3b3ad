#!/usr/bin/env python
"""Checkpoint throughput against plain ``torch.save`` / ``torch.load`` of the same tensors.

Builds the configured model on one process with the chosen recipe, takes one optimizer step (so
Adam state exists), then times, alternating, ``--rounds`` times each:

* llmtrain save: engine shards + RNG + marker (checksum of every file, fsync, atomic rename);
* plain save: one ``torch.save`` of the model and optimizer state dicts, fsynced;
* llmtrain resume: verify the marker (re-checksum) + engine load;
* plain load: ``torch.load`` + ``load_state_dict`` of model and optimizer;
* the training stall of a background save (``trainer.async_checkpoint=true``): the time until
  ``save`` returns (state copied to host memory), and the write's total time.

Prints bytes/s of each and the ratios in wall clock and CPU time, and the time a resume adds
before the first step (verification + load). Example (≈25 M parameters):

    python scripts/bench/checkpoint.py model.architecture.hidden_size=512 model.architecture.num_hidden_layers=8
    python scripts/bench/checkpoint.py +recipe=zero2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import benchlib  # noqa: F401,E402  (the checkout's llmtrain first on the path)

import llmtrain.parallel.distributed as distributed  # noqa: E402  (before deepspeed)

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from llmtrain import data  # noqa: E402
from llmtrain.checkpoint.protocol import CheckpointManager, HASHES, verify_collective
from llmtrain.checkpoint.state import TrainState
from llmtrain.config.layout import gradient_accumulation_steps  # noqa: E402
from llmtrain.config.compose import register_configs
from llmtrain.engine import build_engine  # noqa: E402
from llmtrain.models.build import build_model, byte_tokenizer  # noqa: E402
from llmtrain.objectives import build_objective  # noqa: E402
from llmtrain.parallel.dims import ParallelDims  # noqa: E402
from llmtrain.common.paths import CONF_DIR  # noqa: E402
from llmtrain.trainer import forward_backward  # noqa: E402


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--hash", choices=HASHES, default="xxh3")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["tracker=none"] + args.overrides)
    env = distributed.init_distributed(need_group=cfg.recipe.engine == "deepspeed")
    dims = ParallelDims.from_recipe(cfg.recipe, 1)
    engine = build_engine(cfg, env, gradient_accumulation_steps(cfg.trainer, 1), dims, build_objective(cfg.objective))
    with engine.model_init_context():
        model = build_model(cfg.model, cfg.trainer.seed)
    engine.setup(model)
    tok = byte_tokenizer()
    batch = data.Collator(tok.pad_token_id)([{"input_ids": list(range(64)), "labels": list(range(64))}] * 2)
    forward_backward(engine, [batch])
    engine.step()

    kinds = ("save", "plain_save", "resume", "plain_load", "async_stall", "async_total")
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}

    def timed(kind: str, fn):
        w, c = time.perf_counter(), time.process_time()
        result = fn()
        wall[kind].append(time.perf_counter() - w)
        cpu[kind].append(time.process_time() - c)
        return result

    def plain_save(path: Path) -> None:
        with open(path, "wb") as f:
            torch.save({"model": engine.model.state_dict(), "optimizer": engine.optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    def plain_load(path: Path) -> None:
        blob = torch.load(path, weights_only=False)
        engine.model.load_state_dict(blob["model"])
        engine.optimizer.load_state_dict(blob["optimizer"])

    def resume(path: Path) -> None:
        assert verify_collective(path, env) is None
        manager.load(engine, path)

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        manager = CheckpointManager(Path(tmp) / "run", env, keep=1)
        state = TrainState(step=1, consumed_samples=2, world_size=1, global_batch_size=2)
        plain_file = Path(tmp) / "plain.pt"
        step = 0
        for r in range(args.rounds):
            # Alternate which of ours / plain runs first, so drifts of the shared box cancel.
            order = ("ours", "plain") if r % 2 == 0 else ("plain", "ours")
            for who in order:
                if who == "plain":
                    timed("plain_save", lambda: plain_save(plain_file))
                    timed("plain_load", lambda: plain_load(plain_file))
                    continue
                step += 1
                state.step = step
                saved = timed("save", lambda: manager.save(engine, state, "", args.hash))
                ours_bytes = folder_bytes(saved)
                timed("resume", lambda: resume(saved))
                step += 1
                state.step = step
                w = time.perf_counter()
                timed("async_stall", lambda: manager.save(engine, state, "", args.hash, background=True))
                manager.finish_background()
                wall["async_total"].append(time.perf_counter() - w)
        plain_bytes = plain_file.stat().st_size

    med = {k: statistics.median(v) for k, v in wall.items() if v}
    cmed = {k: statistics.median(v) for k, v in cpu.items() if v}
    print(f"recipe {cfg.recipe.name}, model {sum(p.numel() for p in engine.model.parameters()) / 1e6:.1f} M parameters, "
          f"checkpoint {ours_bytes / 2**20:.1f} MiB (plain file {plain_bytes / 2**20:.1f} MiB), checksum {args.hash}, "
          f"median of {args.rounds} alternating rounds")
    for ours, plain, label in (("save", "plain_save", "save"), ("resume", "plain_load", "load")):
        print(f"{label:5s} llmtrain {ours_bytes / med[ours] / 2**20:8.1f} MiB/s   plain {plain_bytes / med[plain] / 2**20:8.1f} MiB/s"
              f"   ratio wall {(ours_bytes / med[ours]) / (plain_bytes / med[plain]):.2f}"
              f"   ratio CPU time {(ours_bytes / cmed[ours]) / (plain_bytes / cmed[plain]):.2f}")
    print(f"a resume adds {med['resume']:.3f} s before the first step (marker verification + load); plain load "
          f"{med['plain_load']:.3f} s")
    print(f"training stall per save: synchronous {med['save']:.3f} s, trainer.async_checkpoint=true "
          f"{med['async_stall']:.3f} s (the write then takes {med['async_total'] - med['async_stall']:.3f} s "
          f"in the background)")


if __name__ == "__main__":
    main()
