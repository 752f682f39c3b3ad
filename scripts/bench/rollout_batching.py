"""Batched sampling of the ``hf`` engine against one prompt's group at a time: a GRPO step's
sampling (``--prompts`` prompts x G = ``--group`` completions x ``--new`` tokens) and a held-out
evaluation (``--eval`` prompts, one greedy completion each), on a SmolLM2-135M-shaped Llama
(config-built, random weights: every completion runs to ``--new`` tokens, so both modes decode
the same tokens), fp32, one thread, rounds alternating the order of the modes. Wall clock and
CPU time (``time.process_time``) per mode, medians.

* ``before``: the engine of ``--before-rev`` (its ``llmtrain/rollout/generate.py``'s
  ``sample_group``, one call per prompt, as its ``PolicySampler`` made them).
* ``after``: this checkout's ``PolicySampler`` (``rollout.generation_batch`` = ``--rows``).

    python scripts/bench/rollout_batching.py --before-rev REV [--rounds 3] [--prompts 4] [--group 4] [--new 64]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import benchlib
import torch
from rollout import smollm2_shaped  # scripts/bench/rollout.py's model, the same job's shape

from llmtrain.rollout.engines import PolicySampler
from llmtrain.rollout.generate import Sampling

MODES = ("before", "after")


def old_generate(rev: str, work: Path):
    """``llmtrain/rollout/generate.py`` as it was at ``rev``, imported as a module of its own."""
    text = subprocess.run(["git", "show", f"{rev}:llmtrain/rollout/generate.py"], cwd=benchlib.REPO, check=True,
                          capture_output=True, text=True).stdout
    path = work / "generate_before.py"
    path.write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("generate_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class Policy:
    """What the engine reads of a training engine: the whole model, the CPU, no autocast."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.env, self.generation_autocast = model, SimpleNamespace(device=torch.device("cpu")), None

    @contextlib.contextmanager
    def generation_model(self):
        yield self.model


def run(mode: str, model, before, samples, seeds, args) -> tuple[float, float, int]:
    """One sampling call of ``samples`` (one completion per seed): (wall s, CPU s, tokens)."""
    wall, cpu = time.perf_counter(), time.process_time()
    if mode == "before":
        sampling = before.Sampling(max_new=args.new)
        groups = [before.sample_group(model, s["prompt_ids"], row, sampling, torch.device("cpu"))
                  for s, row in zip(samples, seeds)]
    else:
        cfg = SimpleNamespace(rollout=SimpleNamespace(generation_batch=args.rows))
        groups = PolicySampler(cfg, None, Sampling(max_new=args.new)).sample(Policy(model), samples, seeds)
    return time.perf_counter() - wall, time.process_time() - cpu, sum(len(c.ids) for g in groups for c in g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before-rev", required=True, help="the commit whose engine is 'before'")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (G)")
    parser.add_argument("--new", type=int, default=64, help="tokens per completion")
    parser.add_argument("--eval", type=int, default=16, help="held-out prompts (greedy, one completion each)")
    parser.add_argument("--rows", type=int, default=16, help="rollout.generation_batch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = smollm2_shaped()
    generator = torch.Generator().manual_seed(0)
    # GSM8K-like prompts of different lengths (chat-templated questions: 60-110 tokens).
    prompts = [{"prompt_ids": torch.randint(2, 49152, (int(n),), generator=generator).tolist(), "record": k}
               for k, n in enumerate(torch.randint(60, 111, (max(args.prompts, args.eval),), generator=generator))]
    jobs = {"step": (prompts[:args.prompts], [[1000 * k + i for i in range(args.group)] for k in range(args.prompts)]),
            "eval": (prompts[:args.eval], [[None] for _ in range(args.eval)])}
    with tempfile.TemporaryDirectory() as work:
        before = old_generate(args.before_rev, Path(work))
        results = {(job, m): [] for job in jobs for m in MODES}
        run("after", model, before, prompts[:1], [[0]], SimpleNamespace(new=2, rows=args.rows))  # warm-up
        for r in range(args.rounds):
            for job, (samples, seeds) in jobs.items():
                for mode in benchlib.alternating(MODES, r):
                    results[job, mode].append(run(mode, model, before, samples, seeds, args))
                    print(job, mode, r, results[job, mode][-1], flush=True)
    print(f"{'job':<5} {'mode':<7} {'tokens/s':>9} {'wall s':>8} {'CPU s':>8} {'wall vs before':>15} "
          f"{'CPU vs before':>14}")
    for job in jobs:
        base_wall = statistics.median(w for w, _, _ in results[job, "before"])
        base_cpu = statistics.median(c for _, c, _ in results[job, "before"])
        for mode in MODES:
            wall = statistics.median(w for w, _, _ in results[job, mode])
            cpu = statistics.median(c for _, c, _ in results[job, mode])
            tokens = statistics.median(n for _, _, n in results[job, mode])
            print(f"{job:<5} {mode:<7} {tokens / wall:9.1f} {wall:8.2f} {cpu:8.2f} {base_wall / wall:14.2f}x "
                  f"{base_cpu / cpu:13.2f}x")


if __name__ == "__main__":
    main()
