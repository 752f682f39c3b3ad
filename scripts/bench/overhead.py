#!/usr/bin/env python
"""Overhead of llmtrain's loop against a plain PyTorch loop (one process, same model and data).

Both loops train the same model from the same initial weights on the same micro-batches with
AdamW, warmup + cosine schedule and clipping. Runs alternate (plain, llmtrain, plain, ...) so
machine drift hits both alike (the order flips every round); tokens/s is measured over the steps after ``--warmup`` and the
median over rounds is reported with the ratio llmtrain / plain (target >= 0.97).

    python scripts/bench/overhead.py --rounds 3 --steps 30
    python scripts/bench/overhead.py model.architecture.hidden_size=256   # extra Hydra overrides
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import benchlib  # noqa: F401,E402  (the checkout's llmtrain first on the path)

from hydra import compose, initialize_config_dir  # noqa: E402

from llmtrain import data  # noqa: E402
from llmtrain.config.layout import gradient_accumulation_steps  # noqa: E402
from llmtrain.config.compose import register_configs
from llmtrain.engine import lr_lambda, param_groups  # noqa: E402
from llmtrain.models.build import build_model, build_tokenizer  # noqa: E402
from llmtrain.common.paths import CONF_DIR  # noqa: E402
from llmtrain.parallel.seeding import seed_everything  # noqa: E402
from llmtrain.objectives.causal_lm import token_cross_entropy_sum


def plain_loop(cfg, warmup: int) -> tuple[float, float]:
    """Tokens/s and tokens per CPU-second of a hand-written loop: the baseline every trainer is
    measured against."""
    t = cfg.trainer
    seed_everything(t.seed)
    tokenizer = build_tokenizer(cfg.model)
    splits = data.load_splits(cfg.data, tokenizer, t.seed)
    model = build_model(cfg.model, t.seed)
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t))
    accumulation = gradient_accumulation_steps(t, 1)
    loader, _ = data.train_loader(splits, tokenizer, cfg.data, t.seed, t.micro_batch_size, accumulation, 0, 1, 0, t.max_steps)
    batches = iter(loader)
    tokens, seconds, cpu_seconds = 0, 0.0, 0.0
    for step in range(t.max_steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        micro = [next(batches) for _ in range(accumulation)]
        n_targets = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
        for b in micro:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            (token_cross_entropy_sum(logits, b["labels"]) / n_targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            seconds += time.perf_counter() - started
            cpu_seconds += time.process_time() - cpu_started
            tokens += sum(int(b["attention_mask"].sum()) for b in micro)
    return tokens / seconds, tokens / cpu_seconds


def llmtrain_loop(cfg, warmup: int) -> tuple[float, float]:
    """Tokens/s and tokens per CPU-second of llmtrain's loop, from each step's start to the next
    (the loop's own work between steps included)."""
    from peers import train_with_step_clock  # scripts/bench/ is on sys.path when run as a script

    summary, starts = train_with_step_clock(cfg)
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    tokens = sum(r["train/tokens_per_s"] * r["train/step_time_s"] for r in records
                 if "train/loss" in r and warmup < r["step"] < len(starts))
    (w0, c0), (w1, c1) = starts[warmup], starts[-1]
    return tokens / (w1 - w0), tokens / (c1 - c0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the measurement")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    register_configs()
    results: dict[str, list[tuple[float, float]]] = {"plain": [], "llmtrain": []}
    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        overrides = ["tracker=none", "trainer.progress_bar=false", "trainer.eval_every=0", "trainer.eval_samples=8",
                     "trainer.export_hf=false", "trainer.log_every=1", f"trainer.max_steps={args.steps}"]
        for round_index in range(args.rounds):
            pair = [("plain", plain_loop), ("llmtrain", llmtrain_loop)]
            for name, loop in (pair if round_index % 2 == 0 else pair[::-1]):  # neither always goes first
                cfg = compose(config_name="config", overrides=overrides + [f"run_dir={tmp}/{name}{round_index}"] + args.overrides)
                results[name].append(loop(cfg, args.warmup))
                wall, cpu = results[name][-1]
                print(f"round {round_index}: {name:8s} {wall:10.0f} tokens/s {cpu:10.0f} tokens/CPU-s", flush=True)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in results.items()}
    print(f"\nmedian tokens/s  plain PyTorch: {med['plain'][0]:.0f}   llmtrain: {med['llmtrain'][0]:.0f}   "
          f"ratio llmtrain/plain: {med['llmtrain'][0] / med['plain'][0]:.3f}")
    print(f"median tokens per CPU-second  plain: {med['plain'][1]:.0f}   llmtrain: {med['llmtrain'][1]:.0f}   "
          f"ratio: {med['llmtrain'][1] / med['plain'][1]:.3f}")


if __name__ == "__main__":
    main()
