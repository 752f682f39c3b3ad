"""Check the memory planner (llmtrain.plan) against what each rank really holds.

    python scripts/tools/validate_plan.py [recipe[@override...] ...] [-- extra overrides]

A recipe may carry its own overrides after ``@`` (``fsdp@recipe.cp=2``,
``tp@recipe.tp_sequence_parallel=true``), so layouts of one recipe are measured side by side.

For each recipe (default: ddp zero1 zero2 zero3 zero3_offload fsdp tp pp) it trains 2 ranks
for 2 steps of a small Llama and measures, on every rank, during step 2:

- model-state bytes: every tensor storage alive right after the optimizer step (parameters,
  optimizer state, DeepSpeed's master copy, gradient storage an engine keeps, pipeline
  buffers), found through the garbage collector (and each tensor's ``.grad``), minus the
  storages alive before the model was built (the data);
- activation bytes: the peak of bytes saved for backward and not yet freed (saved_tensors_hooks
  on the real run: its real layout, micro-batches in flight, tensor-parallel shapes).

It prints those next to the planner's figures for the same overrides at world size 2 (its
bytes held between steps, device plus host, and its activation estimate) and their ratios. The
planner's bounds: model states within 10%, activations within 30%.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout, first on the path
sys.path.insert(0, str(REPO))
RECIPES = ["ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp", "tp", "pp"]
# A model with enough bytes that buffers of a few KiB do not decide the ratios; a micro-batch
# big enough that activations are megabytes.
OVERRIDES = ["tracker=none", "tracker.report=false", "trainer.progress_bar=false", "data.max_bytes=200000",
             "data.seq_len=128", "trainer.eval_every=0", "trainer.eval_samples=8", "trainer.max_steps=2",
             "trainer.save_every=0", "trainer.export_hf=false", "trainer.global_batch_size=16",
             "trainer.micro_batch_size=4", "model.architecture.hidden_size=256",
             "model.architecture.intermediate_size=688", "model.architecture.num_hidden_layers=4",
             "model.architecture.num_attention_heads=4", "model.architecture.num_key_value_heads=2",
             "trainer.precision=fp32",  # the figures in docs/planning.md and BENCHMARKS.md were measured in fp32
             # The census walks gc.get_objects(), which leaves out frozen objects: the scheduled
             # collector freezes the model at the loop's start (trainer.gc_every).
             "trainer.gc_every=0"]


def _storages() -> dict[int, int]:
    """data_ptr -> bytes of every live tensor storage (DTensor wrappers skipped: their local
    tensors are found themselves)."""
    import torch

    gc.collect()
    found: dict[int, int] = {}

    def add(tensor) -> None:
        tensor = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard
        try:
            if tensor.is_meta:
                return
            storage = tensor.untyped_storage()
        except Exception:  # noqa: BLE001  (tensor subclasses without storage)
            return
        if storage.data_ptr():
            found[storage.data_ptr()] = max(found.get(storage.data_ptr(), 0), storage.nbytes())

    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            add(obj)
            # A gradient DDP's reducer wrote has no Python object until it is read: read it.
            if obj.requires_grad and obj.grad is not None:
                add(obj.grad)
    return found


class SavedBytes:
    """Live bytes saved for backward (unique storages, parameters excluded) and their peak."""

    def __init__(self, params: list):
        self.params = params  # weights saved for backward (or views of them) are not activations
        self.live: dict[int, list] = {}  # data_ptr -> [bytes, references]
        self.current = self.peak = 0

    def pack(self, tensor):
        local = getattr(tensor, "_local_tensor", tensor)
        try:
            ptr, nbytes = local.untyped_storage().data_ptr(), local.untyped_storage().nbytes()
        except Exception:  # noqa: BLE001
            return tensor
        # Read now: ZeRO-3 and FSDP gather parameters into new storages around each use.
        if ptr in {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in self.params}:
            return tensor
        entry = self.live.setdefault(ptr, [nbytes, 0])
        if entry[1] == 0:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        return _Held(tensor, ptr, self)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]


class _Held:
    __slots__ = ("tensor", "ptr", "owner")

    def __init__(self, tensor, ptr, owner):
        self.tensor, self.ptr, self.owner = tensor, ptr, owner

    def __del__(self):
        self.owner.release(self.ptr)


def recipe_overrides(spec: str) -> list[str]:
    """``NAME@override@...`` -> ``["+recipe=NAME", override, ...]``."""
    name, *extra = spec.split("@")
    return [f"+recipe={name}", *extra]


def worker(out_prefix: str, recipes: list[str], overrides: list[str]) -> None:
    """Runs inside each rank: train every recipe in turn (one process group, as
    tests/scenarios.py does) with the trainer's hooks patched; write this rank's figures."""
    import torch

    import llmtrain.trainer as trainer
    from llmtrain.parallel.distributed import shutdown
    from llmtrain.config.compose import compose

    run: dict = {}  # the current recipe's figures (bytes), baseline storages and step count

    build_engine = trainer.build_engine

    def build_engine_after_census(*args, **kwargs):
        run["baseline"] = _storages()  # data tensors and any earlier run's leftovers: not this model's
        engine = build_engine(*args, **kwargs)
        step = engine.step

        def step_then_census(*step_args, **step_kwargs):
            norm = step(*step_args, **step_kwargs)
            if run["step"] == 2:  # after the optimizer step: what the rank holds between steps
                run["figures"]["resident_bytes"] = sum(b for p, b in _storages().items() if p not in run["baseline"])
                if torch.cuda.is_available():  # the allocator's own peak over step 2
                    run["figures"]["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
            return norm

        engine.step = step_then_census
        return engine

    forward_backward = trainer.forward_backward

    def forward_backward_tracked(*args, **kwargs):
        run["step"] += 1
        if run["step"] != 2:
            return forward_backward(*args, **kwargs)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        saved = SavedBytes([o for o in gc.get_objects() if isinstance(o, torch.nn.Parameter)])
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            result = forward_backward(*args, **kwargs)
        run["figures"]["activation_peak_bytes"] = saved.peak
        return result

    trainer.build_engine = build_engine_after_census
    trainer.forward_backward = forward_backward_tracked
    rank = int(os.environ.get("RANK", "0"))
    for recipe in recipes:
        run.update(figures={}, step=0)
        trainer.train(compose(overrides + recipe_overrides(recipe) + [f"run_dir={out_prefix}-run-{recipes.index(recipe)}"]))
        Path(f"{out_prefix}.{recipe}.{rank}").write_text(json.dumps(run["figures"]))
        gc.collect()
    shutdown()


def measure(recipes: list[str], overrides: list[str], scratch: Path) -> dict[str, list[dict]]:
    """Per recipe, each rank's figures from one 2-rank launch that trains them all."""
    out = scratch / "figures"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), WANDB_SILENT="true")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "--worker",
           str(out), ",".join(recipes), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"training failed\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return {recipe: [json.loads(Path(f"{out}.{recipe}.{rank}").read_text()) for rank in (0, 1)] for recipe in recipes}


def compare(recipes: list[str], overrides: list[str], scratch: Path) -> list[tuple]:
    """``(recipe, planned resident, measured resident, planned activations, measured
    activations, planned peak total, CUDA allocator peak or None)`` in bytes, the measured
    figures the largest over the two ranks (the CUDA peak only on a machine with GPUs)."""
    from llmtrain.config.compose import compose
    from llmtrain.planning.memory import plan_recipe

    measured = measure(recipes, overrides, scratch)
    rows = []
    for recipe in recipes:
        plan = plan_recipe(compose(overrides + recipe_overrides(recipe)), 2)
        cuda = [r["cuda_peak_bytes"] for r in measured[recipe] if "cuda_peak_bytes" in r]
        rows.append((recipe, plan.resident + plan.host, max(r["resident_bytes"] for r in measured[recipe]),
                     plan.activations, max(r["activation_peak_bytes"] for r in measured[recipe]), plan.total,
                     max(cuda) if cuda else None))
    return rows


def main() -> None:
    import tempfile

    args = sys.argv[1:]
    extra = args[args.index("--") + 1:] if "--" in args else []
    recipes = (args[:args.index("--")] if "--" in args else args) or RECIPES
    print(f"{'recipe':<14} {'model states MiB':>34}   {'activations MiB':>34}")
    print(f"{'':<14} {'planned':>10} {'measured':>10} {'ratio':>10}   {'planned':>10} {'measured':>10} {'ratio':>10}")
    worst = [0.0, 0.0]
    with tempfile.TemporaryDirectory() as scratch:
        for recipe, states_plan, states, acts_plan, acts, total, cuda in compare(recipes, OVERRIDES + extra,
                                                                                  Path(scratch)):
            ratios = (states_plan / states, acts_plan / acts)
            worst = [max(worst[0], abs(ratios[0] - 1)), max(worst[1], abs(ratios[1] - 1))]
            gpu = f"   planned peak {total / 2**20:.2f} MiB, CUDA peak {cuda / 2**20:.2f} MiB" if cuda else ""
            print(f"{recipe:<14} {states_plan / 2**20:>10.2f} {states / 2**20:>10.2f} {ratios[0]:>10.3f}   "
                  f"{acts_plan / 2**20:>10.2f} {acts / 2**20:>10.2f} {ratios[1]:>10.3f}{gpu}", flush=True)
    print(f"largest deviation: model states {worst[0]:.1%} (bound 10%), activations {worst[1]:.1%} (bound 30%)")


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3].split(","), sys.argv[4:])
    else:
        main()
