"""Collective traffic and model-state memory per rank, for every recipe, against ZeRO theory.

Launch with torchrun; each recipe trains ``--steps`` optimizer steps in this process group. The
script wraps torch.distributed's collectives (the functions FSDP2, DDP's reducer aside, DeepSpeed
and llmtrain call) and counts, on rank 0, over the optimizer steps after the first (evaluation
and checkpoint saves excluded):

* calls per step, and elements per step as ring volume: an all-reduce of n elements moves 2n
  (reduce-scatter + all-gather), an all-gather or reduce-scatter of an n-element full tensor
  moves n (Rajbhandari et al., "ZeRO", SC'20, section 7: DDP and ZeRO-1/2 move 2Ψ per step,
  ZeRO-3 3Ψ). DDP's gradient all-reduce runs inside its C++ reducer, so ``ddp`` reads the bucket
  sizes from the reducer instead (DDP all-reduces every gradient element once per step);
* model-state bytes: every distinct tensor storage alive on the rank after an optimizer step
  (parameters, gradients, optimizer state, engine buffers), found through the garbage
  collector, against the ZeRO paper's fp32-AdamW figure 16Ψ (4 parameter + 4 gradient + 8 Adam
  bytes per parameter), divided by N for what the stage shards (section 5.1).

    python scripts/bench/comm.py                      # every recipe, 2 ranks, one launch each
    python scripts/bench/comm.py --nproc 4 --recipes zero3 fsdp

Each recipe runs in a launch of its own: engines leave buffers alive in the process (DeepSpeed's
globals), which would count towards the next recipe's census.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import os
import shutil
import sys
import tempfile

import benchlib  # noqa: F401  (the checkout's llmtrain first on the path)
import llmtrain.parallel.distributed  # noqa: F401  (sets DS_ACCELERATOR=cpu before deepspeed loads)

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from llmtrain import trainer
from llmtrain.checkpoint.protocol import CheckpointManager
from llmtrain.config.compose import register_configs
from llmtrain.parallel.distributed import shutdown
from llmtrain.common.paths import CONF_DIR

# Ψ ≈ 3.0 M parameters: big enough that the loop's scalars are noise next to the gradients.
MODEL = ["model.architecture.hidden_size=256", "model.architecture.intermediate_size=688",
         "model.architecture.num_hidden_layers=4"]
# Where each stage keeps a full copy (1) or a 1/N shard of parameters, gradients, Adam state.
SHARDED = {"ddp": (1, 1, 1), "zero1": (1, 1, 0), "zero2": (1, 0, 0), "zero3": (0, 0, 0), "fsdp": (0, 0, 0)}
THEORY_VOLUME = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3, "fsdp": 3}

calls: collections.Counter = collections.Counter()
elements: collections.Counter = collections.Counter()
counting = {"on": False}


def _count(name: str, numel: int, ring_factor: int) -> None:
    if counting["on"] and not counting.get("inside"):
        calls[name] += 1
        elements[name] += numel * ring_factor


def _wrap(name: str, numel_of, ring_factor: int) -> None:
    for module in (dist, c10d):
        fn = getattr(module, name, None)
        if fn is None or getattr(fn, "_counted", False):
            continue

        @functools.wraps(fn)
        def wrapper(*args, _fn=fn, **kwargs):
            _count(name, numel_of(*args, **kwargs), ring_factor)
            # Count the outermost call only (all_gather_into_tensor calls all_gather_single).
            outer, counting["inside"] = counting.get("inside"), True
            try:
                return _fn(*args, **kwargs)
            finally:
                counting["inside"] = outer

        wrapper._counted = True
        setattr(module, name, wrapper)


def _first(*args, **kwargs):
    return next(iter(list(args) + list(kwargs.values())))


def _second(*args, **kwargs):
    values = list(args) + list(kwargs.values())
    return values[1]


def install_counters() -> None:
    _wrap("all_reduce", lambda *a, **k: _first(*a, **k).numel(), 2)
    _wrap("all_reduce_coalesced", lambda *a, **k: sum(t.numel() for t in _first(*a, **k)), 2)
    _wrap("broadcast", lambda *a, **k: _first(*a, **k).numel(), 1)
    _wrap("reduce", lambda *a, **k: _first(*a, **k).numel(), 1)  # a reduce to one rank: reduce-scatter's share
    for gather in ("all_gather_into_tensor", "_all_gather_base", "all_gather_single"):
        _wrap(gather, lambda *a, **k: _first(*a, **k).numel(), 1)  # output = the full tensor
    for scatter in ("reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter_single"):
        _wrap(scatter, lambda *a, **k: _second(*a, **k).numel(), 1)  # input = the full tensor
    _wrap("all_gather", lambda *a, **k: sum(t.numel() for t in _first(*a, **k)), 1)
    _wrap("reduce_scatter", lambda *a, **k: sum(t.numel() for t in _second(*a, **k)), 1)


def live_tensor_bytes(model: torch.nn.Module, ddp) -> int:
    """Bytes of every distinct tensor storage the garbage collector can see on this rank, with
    the parameters' gradients (held by autograd, so given Python handles here) and DDP's
    reducer buckets (C++ only; read from its logging data when gradients are not views of
    them)."""
    import warnings

    warnings.filterwarnings("ignore")
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # noqa: F841  (kept alive for gc)
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        except Exception:  # DTensor wrappers, freed storages
            continue
    buckets = 0
    if ddp is not None:
        info = ddp._get_ddp_logging_data()
        if not info.get("gradient_as_bucket_view"):
            buckets = sum(int(b) for b in str(info.get("bucket_sizes", "")).split(",") if b.strip())
    return sum(seen.values()) + buckets


def run(recipe: str, steps: int, root: str, extra: list[str]) -> dict:
    calls.clear()
    elements.clear()
    census: dict[str, int] = {}
    real_fb, real_eval, real_save = trainer.forward_backward, trainer.evaluate, CheckpointManager.save
    step_no = {"n": 0}

    def counted_forward_backward(engine, batches, *args):
        step_no["n"] += 1
        counting["on"] = step_no["n"] > 1  # step 1 builds buckets and optimizer state
        result = real_fb(engine, batches, *args)
        if step_no["n"] == 2:  # gradients and optimizer state both exist here
            ddp = getattr(engine, "wrapped", None)
            ddp = ddp if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) else None
            census["bytes"] = live_tensor_bytes(engine.model, ddp)
            census["psi"] = sum(getattr(p, "ds_numel", p.numel()) for p in engine.model.parameters())
            census["ddp"] = int(ddp is not None)
        return result

    def paused(fn):
        def inner(*args, **kwargs):
            was, counting["on"] = counting["on"], False
            try:
                return fn(*args, **kwargs)
            finally:
                # After the last step's evaluation/save the run only tears down: stop counting.
                counting["on"] = was and step_no["n"] < steps
        return inner

    trainer.forward_backward = counted_forward_backward
    trainer.evaluate = paused(real_eval)
    CheckpointManager.save = paused(real_save)
    try:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose(config_name="config", overrides=[
                f"+recipe={recipe}", f"trainer.max_steps={steps}", "tracker=none", "trainer.progress_bar=false",
                "data.max_bytes=400000", "trainer.eval_every=0", "trainer.eval_samples=4", "trainer.export_hf=false",
                "trainer.global_batch_size=8", "trainer.micro_batch_size=4", f"run_dir={root}/{recipe}",
                # live_tensor_bytes walks gc.get_objects(), which leaves out frozen objects: the
                # scheduled collector freezes the model at the loop's start.
                "trainer.gc_every=0", *MODEL, *extra])
        trainer.train(cfg)
    finally:
        trainer.forward_backward, trainer.evaluate = real_fb, real_eval
        CheckpointManager.save = real_save
    counted_steps = steps - 1
    return {"calls": {k: v / counted_steps for k, v in calls.items()},
            "elements": {k: v / counted_steps for k, v in elements.items()}, **census}


def print_header(n: int, steps: int) -> None:
    print(f"world size {n}; per step on rank 0, optimizer steps 2..{steps}")
    print(f"{'recipe':8s} {'Ψ (M)':>7s} {'calls':>6s} {'elements/Ψ':>11s} {'theory':>7s} {'ratio':>6s} "
          f"{'state MiB':>10s} {'theory MiB':>10s} {'ratio':>6s}  calls x mean elements, by collective")


def print_row(recipe: str, res: dict, n: int) -> None:
    psi = res["psi"]
    volume = sum(res["elements"].values())
    if res.get("ddp"):  # the reducer all-reduces every gradient element once per step
        volume += 2 * psi
    p, g, o = SHARDED.get(recipe, (1, 1, 1))
    theory_bytes = psi * (4 * (p or 1 / n) + 4 * (g or 1 / n) + 8 * (o or 1 / n))
    theory_volume = THEORY_VOLUME.get(recipe, 2)
    by_call = ", ".join(f"{k} {v:g}x {res['elements'][k] / v / 1e3:.0f}k" for k, v in sorted(res["calls"].items()))
    print(f"{recipe:8s} {psi / 1e6:7.2f} {sum(res['calls'].values()):6.0f} {volume / psi:11.3f} "
          f"{theory_volume:7d} {volume / psi / theory_volume:6.2f} {res['bytes'] / 2**20:10.1f} "
          f"{theory_bytes / 2**20:10.1f} {res['bytes'] / theory_bytes:6.2f}  {by_call}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="*", default=["ddp", "zero1", "zero2", "zero3", "fsdp"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:  # the driver: one torchrun launch per recipe
        import subprocess

        print_header(args.nproc, args.steps)
        for recipe in args.recipes:
            out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc_per_node={args.nproc}", __file__, "--recipes", recipe,
                                  "--steps", str(args.steps), *args.overrides], capture_output=True, text=True)
            rows = [line for line in out.stdout.splitlines() if line.startswith(f"{recipe} ")]
            print(rows[0] if rows and out.returncode == 0 else f"{recipe}: failed\n{out.stderr[-3000:]}", flush=True)
        return 0
    register_configs()
    install_counters()
    root = f"{tempfile.gettempdir()}/llmtrain-bench-comm-{os.environ.get('TORCHELASTIC_RUN_ID', os.getppid())}"
    results = {r: run(r, args.steps, root, args.overrides) for r in args.recipes}
    if dist.get_rank() == 0:
        for recipe, res in results.items():
            print_row(recipe, res, dist.get_world_size())
        shutil.rmtree(root, ignore_errors=True)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
