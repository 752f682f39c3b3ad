#!/usr/bin/env python
"""Measured pipeline bubble (idle fraction) against theory for GPipe, 1F1B and interleaved 1F1B.

Runs llmtrain's own pipeline code (:func:`llmtrain.parallel.pipeline.split_stages` and
:func:`llmtrain.parallel.pipeline.build_schedule`, wrapped in ``torch.distributed.pipelining.PipelineStage``
exactly as ``llmtrain/engine/native.py`` does) on ``p = 2`` pipeline ranks (gloo, CPU) for
``m`` = 2, 4, 8 micro-batches and prints, per schedule and ``m``, the measured idle fraction next
to the theoretical bubble.

Theory (forward + backward of one micro-batch on one stage takes the same time on every stage;
communication is free):

* GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline
  Parallelism") and 1F1B / PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient
  Pipeline-Parallel DNN Training"): each rank computes for ``m (t_f + t_b)`` out of a step of
  ``(m + p - 1)(t_f + t_b)``, so the bubble is ``(p - 1) / (m + p - 1)``. 1F1B reorders the work
  to bound live activations; it does not shrink the bubble.
* Interleaved 1F1B (Narayanan et al., SC'21, "Efficient Large-Scale Language Model Training on
  GPU Clusters Using Megatron-LM", section 2.2): with ``v`` model chunks (stages) per rank the
  pipeline fill/drain shrinks to ``(p - 1)/v`` micro-batch times, so the bubble is
  ``(p - 1) / (v m + p - 1)``.

Measurement, per rank and per timed step (after ``--warmup`` untimed steps, ranks synchronised by
``dist.barrier`` before each step):

* step time = wall time of ``schedule.step(...)`` on the slowest rank, i.e. until the pipeline
  has flushed. A rank's ``step`` can return before that (the last stage finishes before the first
  stage's final backward); in training it would then wait for the other ranks at the optimizer
  step (gradient-norm all-reduce), so that wait is idle time too, as in the theory;
* busy time = wall time inside stage compute: ``PipelineStage.forward_one_chunk``,
  ``backward_one_chunk`` and ``backward_weight_one_chunk`` (wrapped on the instances; the
  schedules wait for p2p receives *before* calling them, so they hold compute only) plus the
  loss function (run by the schedule between a last-stage forward and its backward);
* idle fraction of a rank = 1 - busy / step time.

The benchmark assumes it has the machine to itself. The "other CPU" column is the CPU time
(in cores, averaged over the configuration's run) that processes other than the two ranks used,
from ``/proc/stat`` minus the ranks' own CPU time; well above 0 means the numbers of that row are
disturbed (rerun on a quiet machine).

The table reports, per configuration, the median over timed steps of each rank's idle fraction,
averaged over the ranks, and the median step time. Every rank runs with one
intra-op thread so the two ranks do not compete for the cores.

    timeout 600 torchrun --standalone --nproc_per_node 2 scripts/bench/pipeline_bubble.py
    timeout 600 python scripts/bench/pipeline_bubble.py   # re-launches itself via torchrun
    python scripts/bench/pipeline_bubble.py --microbatches 4 8 16 --seq-len 256 --steps 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import benchlib  # noqa: F401,E402  (the checkout's llmtrain first on the path)

from llmtrain.objectives.causal_lm import token_cross_entropy_sum  # noqa: E402
from llmtrain.parallel.pipeline import build_schedule, split_stages  # noqa: E402

PP = 2  # pipeline ranks (one process each)
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))  # (name, stages per rank)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8], help="values of m")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=688)
    p.add_argument("--layers", type=int, default=8, help="decoder layers (split over p*v stages)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=320)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration")
    p.add_argument("--steps", type=int, default=7, help="timed steps per configuration")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                                   intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
                                   num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                   max_position_embeddings=max(args.seq_len, 128), tie_word_embeddings=False)
    torch.manual_seed(args.seed)  # same weights on every rank (not needed for timing, but tidy)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def machine_cpu_seconds() -> float:
    """CPU time used by all processes of the machine so far (Linux ``/proc/stat``), NaN elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class BusyTimer:
    """Accumulates wall time spent inside the wrapped callables."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - start
        return timed

    def instrument(self, stage) -> None:
        """Time this PipelineStage's compute entry points (instance attributes shadow the methods)."""
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, self.wrap(getattr(stage, name)))


def bench_one(model, args, name: str, stages_per_rank: int, m: int, rank: int) -> tuple[list[float], list[float]]:
    """Per timed step on this rank: (busy seconds, seconds inside ``schedule.step``)."""
    from torch.distributed.pipelining import PipelineStage

    device = torch.device("cpu")
    num_stages = PP * stages_per_rank
    parts = split_stages(model, PP, rank, stages_per_rank)
    timer = BusyTimer()
    stages = []
    for s, part in parts:
        stage = PipelineStage(part, s, num_stages, device, group=dist.group.WORLD)
        timer.instrument(stage)
        stages.append(stage)
    has_first = any(s == 0 for s, _ in parts)
    has_last = any(s == num_stages - 1 for s, _ in parts)

    batch = m * args.micro_batch_size
    gen = torch.Generator().manual_seed(args.seed)
    input_ids = torch.randint(0, args.vocab_size, (batch, args.seq_len), generator=gen)
    labels = input_ids.clone()
    normaliser = float(batch * (args.seq_len - 1))  # target tokens of the whole batch (constant)
    loss_fn = timer.wrap(lambda logits, y: token_cross_entropy_sum(logits, y) / normaliser)
    schedule = build_schedule(name, stages, m, loss_fn)

    busy, step_seconds = [], []
    for step in range(args.warmup + args.steps):
        for _, part in parts:
            for prm in part.parameters():
                prm.grad = None
        kwargs = {"target": labels, "losses": []} if has_last else {}
        step_args = [input_ids] if has_first else []
        dist.barrier()
        timer.seconds = 0.0
        start = time.perf_counter()
        schedule.step(*step_args, **kwargs)
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            busy.append(timer.seconds)
            step_seconds.append(elapsed)
    dist.barrier()
    return busy, step_seconds


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != PP:
        raise SystemExit(f"run with exactly {PP} processes (torchrun --nproc_per_node {PP}), got {world}")
    for name, v in SCHEDULES:
        if args.layers < PP * v:
            raise SystemExit(f"--layers {args.layers} < {PP * v} stages needed by {name}")
    model = build_model(args)
    model.train()

    rows = []
    for name, v in SCHEDULES:
        for m in args.microbatches:
            dist.barrier()
            machine0, own0, wall0 = machine_cpu_seconds(), time.process_time(), time.perf_counter()
            busy, seconds = bench_one(model, args, name, v, m, rank)
            own = time.process_time() - own0  # this rank's CPU time, all its threads
            gathered: list = [None] * world
            dist.all_gather_object(gathered, (busy, seconds, own))
            if rank == 0:
                wall = time.perf_counter() - wall0
                other_cpu = (machine_cpu_seconds() - machine0 - sum(g[2] for g in gathered)) / wall
                gathered = [g[:2] for g in gathered]
                # Step time of step i: until the slowest rank is done (ranks start together).
                steps = [max(per_rank) for per_rank in zip(*(s for _, s in gathered))]
                per_rank_idle = [statistics.median(1.0 - b / t for b, t in zip(busy_r, steps))
                                 for busy_r, _ in gathered]
                step_time = statistics.median(steps)
                theory = (PP - 1) / (m + PP - 1)  # GPipe, 1F1B
                interleaved = (PP - 1) / (v * m + PP - 1) if v > 1 else None
                rows.append((name, PP, m, sum(per_rank_idle) / world, per_rank_idle, theory, interleaved,
                             step_time, other_cpu))
                print(f"  done {name:<16} m={m:<3} idle={rows[-1][3]:.3f} step={step_time:.3f}s "
                      f"other CPU={other_cpu:.2f}", flush=True)

    if rank == 0:
        print()
        print(f"model: llama hidden={args.hidden_size} ffn={args.intermediate_size} layers={args.layers} "
              f"vocab={args.vocab_size}; micro-batch {args.micro_batch_size}x{args.seq_len} tokens; "
              f"{args.warmup} warm-up + {args.steps} timed steps (median); interleaved: v=2 stages per rank")
        header = (f"{'schedule':<17} {'p':>2} {'m':>3} {'measured idle':>13} {'(r0 / r1)':>13} "
                  f"{'theory (p-1)/(m+p-1)':>20} {'interleaved theory':>18} {'step s':>7} {'other CPU':>9}")
        print(header)
        print("-" * len(header))
        for name, p, m, idle, per_rank, theory, inter, step_time, other_cpu in rows:
            ranks = " / ".join(f"{x:.3f}" for x in per_rank)
            inter_s = f"{inter:.3f}" if inter is not None else "-"
            print(f"{name:<17} {p:>2} {m:>3} {idle:>13.3f} {ranks:>13} {theory:>20.3f} {inter_s:>18} "
                  f"{step_time:>7.3f} {other_cpu:>9.2f}")
        print("note: idle = 1 - (time in stage forward/backward/loss) / step time. With 2 CPU cores and gloo, "
              "p2p transfers and Python/schedule overhead also count as idle (theory assumes free communication "
              "and equal stages), so measured idle sits above theory by roughly that overhead.")
        print(f"other CPU: cores used by other processes during a row's run, out of {os.cpu_count()} "
              "(well above 0 means that row was disturbed by other load)")
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:  # plain `python`: re-launch under torchrun with PP processes
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={PP}",
               os.path.abspath(__file__), *sys.argv[1:]]
        os.execv(sys.executable, cmd)
    main()
