#!/usr/bin/env python
"""Long-context benchmarks: context parallelism, tensor-parallel sequence parallelism, the chunked loss.

    python scripts/bench/long_context.py throughput [--rounds 3 --steps 8 --seq-len 4096]
    python scripts/bench/long_context.py chunked [--tokens 8192 --vocab 128256 --chunk 1024]
    python scripts/bench/long_context.py long [--seq-len 32768 --steps 3]
    python scripts/bench/long_context.py plan

``throughput``: 2-process runs of the tiny Llama on Tiny Shakespeare, side by side at equal
global tokens (global batch x seq_len): FSDP2 over 2 ranks (cp=1) against cp=2 Ulysses and cp=2
ring (each row split over both ranks, twice the accumulation), and tensor parallel 2 without and
with ``recipe.tp_sequence_parallel``. Per mode: tokens/s of the steps after the warmup (median of
the rounds), tokens per CPU-second of the whole launch (the children's user + system time), and
the peak RSS of rank 0 (``memory/peak_bytes``). The order flips every round so machine drift
hits every mode alike; ratios are against the first mode of each group.

``chunked``: peak bytes allocated (the torch profiler's allocation timeline) by the plain loss
(``cross_entropy`` over whole logits) and by :mod:`llmtrain.models.chunked_loss` at Llama-3's vocabulary,
forward and backward, and the largest differences of loss and gradients against float64.

``long``: one row of ``--seq-len`` tokens trained on 2 processes with cp=2 (both styles), time
per step.

``plan``: the planner's per-rank GiB for Llama-3 8B at 32k and 128k tokens on 8 and 64 ranks,
cp 1-8, FSDP2 full shard, bf16, activation checkpointing, chunked loss, one row per data-parallel
rank (no accumulation, whose unsharded gradients FSDP2 would add), as a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchlib import DATA, alternating, launch

SHAKESPEARE = DATA / "tinyshakespeare.txt"


def common(seq_len: int, steps: int, global_batch: int) -> list[str]:
    return ["tracker=none", "tracker.report=false", "trainer.progress_bar=false", "data=tinyshakespeare",
            f"data.path={SHAKESPEARE}", f"data.seq_len={seq_len}", f"data.max_bytes={max(200_000, 40 * seq_len)}",
            f"model.architecture.max_position_embeddings={seq_len}", f"trainer.max_steps={steps}",
            f"trainer.global_batch_size={global_batch}", "trainer.micro_batch_size=1", "trainer.eval_every=0",
            "trainer.eval_samples=2", "trainer.save_every=0", "trainer.save_every_minutes=0",
            "trainer.export_hf=false", "trainer.hang_timeout_s=0"]


def measure(args: list[str], run_dir: Path, warmup: int, nproc: int = 2) -> dict[str, float]:
    """One run's tokens/s (steps after ``warmup``), tokens per CPU-second, seconds a step, peak
    bytes and last loss."""
    done = launch(args, run_dir, nproc=nproc)
    steps, timed = done.steps(), done.steps(warmup)
    tokens = sum(r["train/tokens_seen"] for r in steps[-1:])
    step_s = sum(r["train/step_time_s"] for r in timed)
    per_step_tokens = tokens / len(steps)
    return {"tokens_per_s": per_step_tokens * len(timed) / step_s, "tokens_per_cpu_s": tokens / done.cpu_s,
            "step_s": step_s / len(timed), "peak_bytes": max(r["memory/peak_bytes"] for r in steps),
            "wall_s": done.wall_s, "loss": steps[-1]["train/loss"]}


def throughput(a) -> None:
    groups = {
        "context parallel": {"fsdp cp=1 (dp 2)": ["+recipe=fsdp"],
                             "fsdp cp=2 ulysses": ["+recipe=fsdp", "recipe.cp=2"],
                             "fsdp cp=2 ring": ["+recipe=fsdp", "recipe.cp=2", "recipe.cp_style=ring"]},
        "sequence parallel": {"tp 2": ["+recipe=tp"], "tp 2 + sequence parallel": ["+recipe=tp",
                                                                                   "recipe.tp_sequence_parallel=true"]},
    }
    base = common(a.seq_len, a.steps, 4) + a.overrides
    for title, modes in groups.items():
        results: dict[str, list[dict]] = {m: [] for m in modes}
        with tempfile.TemporaryDirectory() as scratch:
            for rnd in range(a.rounds):
                for k, mode in enumerate(alternating(list(modes), rnd)):
                    results[mode].append(measure(base + modes[mode], Path(scratch) / f"{rnd}-{k}", a.warmup))
        first = next(iter(modes))
        ref = {key: statistics.median(r[key] for r in results[first]) for key in results[first][0]}
        print(f"\n{title}: tiny Llama, {a.seq_len} tokens a row, global batch 4 rows, 2 processes, "
              f"median of {a.rounds} rounds")
        print(f"{'mode':<28} {'tokens/s':>10} {'ratio':>7} {'tok/CPU-s':>10} {'ratio':>7} {'peak RSS MiB':>13} "
              f"{'ratio':>7} {'last loss':>10}")
        for mode in modes:
            med = {key: statistics.median(r[key] for r in results[mode]) for key in results[mode][0]}
            print(f"{mode:<28} {med['tokens_per_s']:>10.0f} {med['tokens_per_s'] / ref['tokens_per_s']:>7.2f} "
                  f"{med['tokens_per_cpu_s']:>10.0f} {med['tokens_per_cpu_s'] / ref['tokens_per_cpu_s']:>7.2f} "
                  f"{med['peak_bytes'] / 2**20:>13.0f} {med['peak_bytes'] / ref['peak_bytes']:>7.2f} "
                  f"{med['loss']:>10.5f}")


def chunked(a) -> None:
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from llmtrain.models.chunked_loss import ChunkedLabelLogps

    torch.manual_seed(0)
    hidden = torch.randn(a.tokens, a.hidden, requires_grad=True)
    weight = (torch.randn(a.vocab, a.hidden) * 0.02).requires_grad_()
    targets = torch.randint(0, a.vocab, (a.tokens,))
    targets[::7] = -100

    def peak(fn) -> int:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        level = top = 0
        for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                                if e.name() == "[memory]"):
            level += nbytes
            top = max(top, level)
        return top

    out = {}
    for name, fn in (("plain", lambda: F.cross_entropy(hidden @ weight.t(), targets, ignore_index=-100,
                                                       reduction="sum")),
                     ("chunked", lambda: -ChunkedLabelLogps.apply(hidden, weight, None, targets, a.chunk, None, 0).sum())):
        hidden.grad = weight.grad = None
        started = time.perf_counter()
        bytes_ = peak(lambda: fn().backward())
        out[name] = {"peak": bytes_, "s": time.perf_counter() - started,
                     "grads": (hidden.grad.clone(), weight.grad.clone()), "loss": float(fn().detach())}
    # float64 reference: plain cross_entropy under autograd, summed over row blocks (the loss is a
    # sum over tokens, so blocks add up; whole float64 logits would need 8 GiB each)
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = 0.0
    for start in range(0, a.tokens, 512):
        part = F.cross_entropy(h64[start:start + 512] @ w64.t(), targets[start:start + 512], ignore_index=-100,
                               reduction="sum")
        part.backward()
        ref += float(part)
    held = hidden.numel() * 4 + weight.numel() * 4  # both end holding the two gradients
    print(f"tokens {a.tokens}, vocab {a.vocab}, hidden {a.hidden}, chunk {a.chunk} tokens; whole fp32 logits "
          f"{a.tokens * a.vocab * 4 / 2**20:.0f} MiB")
    for name, r in out.items():
        dh = float((r["grads"][0].double() - h64.grad).abs().max() / h64.grad.abs().max())
        dw = float((r["grads"][1].double() - w64.grad).abs().max() / w64.grad.abs().max())
        print(f"{name:<8} peak extra {(r['peak'] - held) / 2**20:>9.1f} MiB  forward+backward {r['s']:.1f} s (profiled)  "
              f"loss rel. err {abs(r['loss'] - ref) / ref:.1e}  grad rel. err hidden {dh:.1e} weight {dw:.1e}")
    print(f"chunked / plain peak extra bytes: {(out['chunked']['peak'] - held) / (out['plain']['peak'] - held):.3f}")


def long(a) -> None:
    base = common(a.seq_len, a.steps, 2) + ["trainer.loss_chunk_tokens=4096"] + a.overrides
    with tempfile.TemporaryDirectory() as scratch:
        for style in ("ulysses", "ring"):
            r = measure(base + ["+recipe=fsdp", "recipe.cp=2", f"recipe.cp_style={style}"], Path(scratch) / style,
                        warmup=1)
            print(f"cp=2 {style:<8} {a.seq_len} tokens a row, 2 processes: {r['step_s']:.1f} s per step "
                  f"(2 rows; after the first step), {r['tokens_per_s']:.0f} tokens/s, peak RSS rank 0 "
                  f"{r['peak_bytes'] / 2**20:.0f} MiB, last loss {r['loss']:.4f}, launch {r['wall_s']:.0f} s")


def plan(a) -> None:
    from llmtrain.config.compose import compose
    from llmtrain.planning.memory import plan_recipe

    print("Per-rank GiB planned for Llama-3 8B, +recipe=fsdp, bf16, activation checkpointing, "
          "trainer.loss_chunk_tokens=4096, one row per data-parallel rank (in brackets: activations)\n")
    print("| context | ranks | cp 1 | cp 2 | cp 4 | cp 8 |")
    print("|---|---|---|---|---|---|")
    for seq in (32768, 131072):
        for world in (8, 64):
            cells = []
            for cp in (1, 2, 4, 8):
                cfg = compose(["model=llama3_8b", "+recipe=fsdp", f"recipe.cp={cp}", f"data.seq_len={seq}",
                               "trainer.micro_batch_size=1", f"trainer.global_batch_size={world // cp}",
                               "trainer.precision=bf16", "trainer.activation_checkpointing=true",
                               "trainer.loss_chunk_tokens=4096", "tracker=none"])
                p = plan_recipe(cfg, world)
                cells.append("not valid" if p.error else
                             f"{p.total / 2**30:.1f} (act {p.activations / 2**30:.1f})")
            print(f"| {seq // 1024}k | {world} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("throughput", help="tokens/s, CPU time and peak RSS: cp=1 vs cp=2 (ulysses, ring); "
                       "tp with and without sequence parallelism (2 processes each)")
    t.add_argument("--rounds", type=int, default=3, help="rounds of every mode (order flips each round)")
    t.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    t.add_argument("--warmup", type=int, default=2, help="first steps left out of tokens/s")
    t.add_argument("--seq-len", type=int, default=4096, help="tokens per row")
    t.add_argument("overrides", nargs="*", help="extra llmtrain overrides for every run")
    c = sub.add_parser("chunked", help="peak extra bytes and errors of the chunked loss against the plain one")
    c.add_argument("--tokens", type=int, default=8192, help="tokens in the batch")
    c.add_argument("--vocab", type=int, default=128256, help="vocabulary size (Llama-3's by default)")
    c.add_argument("--hidden", type=int, default=64, help="hidden size of the output layer's input")
    c.add_argument("--chunk", type=int, default=1024, help="tokens per chunk (trainer.loss_chunk_tokens)")
    g = sub.add_parser("long", help="one long row trained on 2 processes with cp=2, time per step")
    g.add_argument("--seq-len", type=int, default=32768, help="tokens per row")
    g.add_argument("--steps", type=int, default=3, help="optimizer steps")
    g.add_argument("overrides", nargs="*", help="extra llmtrain overrides")
    sub.add_parser("plan", help="the planner's per-rank GiB for Llama-3 8B at 32k/128k, 8/64 ranks, cp 1-8")
    a = p.parse_args()
    {"throughput": throughput, "chunked": chunked, "long": long, "plan": plan}[a.command](a)


if __name__ == "__main__":
    main()
