"""Collective bytes per step of a bf16 FSDP2 run, with FSDP2's MixedPrecisionPolicy (bf16
all-gathers, fp32 reduce-scatter: what llmtrain runs) against autocast over fp32 parameters (the
previous scheme: fp32 all-gathers). Counts the bytes handed to all-gather and reduce-scatter on
rank 0 over the training steps (not the evaluation).

    torchrun --standalone --nproc_per_node 2 scripts/bench/fsdp_bf16_traffic.py
"""

from __future__ import annotations

import collections
import functools
import sys
import tempfile

import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import benchlib  # noqa: F401  (the checkout's llmtrain first on the path)
import llmtrain.parallel.parallelize as parallelize
from llmtrain import trainer
from llmtrain.config.compose import register_configs
from llmtrain.parallel.distributed import shutdown
from llmtrain.common.paths import CONF_DIR

STEPS = 3
counted: collections.Counter = collections.Counter()
counting = {"on": False}


def counting_collective(name, fn):
    @functools.wraps(fn)
    def wrapper(output, input, *args, **kwargs):
        if counting["on"]:
            counted[f"{name} {input.dtype}"] += input.numel() * input.element_size()
        return fn(output, input, *args, **kwargs)
    return wrapper


dist.all_gather_single = counting_collective("all_gather", dist.all_gather_single)
dist.reduce_scatter_single = counting_collective("reduce_scatter", dist.reduce_scatter_single)

# Count only inside the optimizer steps' forward/backward.
real_forward_backward = trainer.forward_backward


def counted_forward_backward(engine, batches, *args):
    counting["on"] = True
    try:
        return real_forward_backward(engine, batches, *args)
    finally:
        counting["on"] = False


trainer.forward_backward = counted_forward_backward
real_apply_fsdp = parallelize.apply_fsdp


def run(scheme: str, root: str) -> dict[str, int]:
    counted.clear()
    parallelize.apply_fsdp = (real_apply_fsdp if scheme == "mixed-precision policy" else
                              lambda *args, param_dtype=None, **kwargs: real_apply_fsdp(*args, **kwargs))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[
            "+recipe=fsdp", "trainer.precision=bf16", f"trainer.max_steps={STEPS}", "tracker=none",
            "trainer.progress_bar=false", "data.max_bytes=300000", "trainer.eval_every=0", "trainer.eval_samples=8",
            "trainer.export_hf=false", f"run_dir={root}/{scheme.replace(' ', '_')}"])
    trainer.train(cfg)
    return {k: v // STEPS for k, v in counted.items()}


def main() -> int:
    import os

    register_configs()
    root = f"{tempfile.gettempdir()}/llmtrain-bench-fsdp-bf16-{os.environ.get('TORCHELASTIC_RUN_ID', os.getppid())}"
    results = {scheme: run(scheme, root) for scheme in ("autocast over fp32", "mixed-precision policy")}
    if dist.get_rank() == 0:
        for scheme, bytes_by_op in results.items():
            total = sum(bytes_by_op.values())
            print(f"{scheme:24s}: {total / 2**20:7.2f} MiB per step on rank 0  "
                  + ", ".join(f"{k}: {v / 2**20:.2f} MiB" for k, v in sorted(bytes_by_op.items())))
        before, after = (sum(r.values()) for r in results.values())
        print(f"ratio policy / autocast: {after / before:.3f}")
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
