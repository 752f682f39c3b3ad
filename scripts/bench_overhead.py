#!/usr/bin/env python
"""Overhead of llmtrain's loop against a plain PyTorch loop (one process, same model and data).

Both loops train the same model from the same initial weights on the same micro-batches with
AdamW, warmup + cosine schedule and clipping. Runs alternate (plain, llmtrain, plain, ...) so
machine drift hits both alike (the order flips every round); tokens/s is measured over the steps after ``--warmup`` and the
median over rounds is reported with the ratio llmtrain / plain (target >= 0.97).

    python scripts/bench_overhead.py --rounds 3 --steps 30
    python scripts/bench_overhead.py model.architecture.hidden_size=256   # extra Hydra overrides
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra import compose, initialize_config_dir  # noqa: E402

from llmtrain import data  # noqa: E402
from llmtrain.config import gradient_accumulation_steps, register_configs  # noqa: E402
from llmtrain.engine import lr_lambda, param_groups  # noqa: E402
from llmtrain.models import build_model, build_tokenizer  # noqa: E402
from llmtrain.paths import CONF_DIR  # noqa: E402
from llmtrain.trainer import seed_everything, token_cross_entropy_sum, train  # noqa: E402


def plain_loop(cfg, warmup: int) -> float:
    """Tokens/s of a hand-written loop: the baseline every trainer is measured against."""
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
    tokens, seconds = 0, 0.0
    for step in range(t.max_steps):
        started = time.perf_counter()
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
            tokens += sum(int(b["attention_mask"].sum()) for b in micro)
    return tokens / seconds


def llmtrain_loop(cfg, warmup: int) -> float:
    summary = train(cfg)
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r and r["step"] > warmup]
    tokens = sum(r["train/tokens_per_s"] * r["train/step_time_s"] for r in steps)
    return tokens / sum(r["train/step_time_s"] for r in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the measurement")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    register_configs()
    results: dict[str, list[float]] = {"plain": [], "llmtrain": []}
    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        overrides = ["tracker=none", "trainer.progress_bar=false", "trainer.eval_every=0", "trainer.eval_samples=8",
                     "trainer.export_hf=false", "trainer.log_every=1", f"trainer.max_steps={args.steps}"]
        for round_index in range(args.rounds):
            pair = [("plain", plain_loop), ("llmtrain", llmtrain_loop)]
            for name, loop in (pair if round_index % 2 == 0 else pair[::-1]):  # neither always goes first
                cfg = compose(config_name="config", overrides=overrides + [f"run_dir={tmp}/{name}{round_index}"] + args.overrides)
                results[name].append(loop(cfg, args.warmup))
                print(f"round {round_index}: {name:8s} {results[name][-1]:10.0f} tokens/s", flush=True)
    plain, ours = statistics.median(results["plain"]), statistics.median(results["llmtrain"])
    print(f"\nmedian tokens/s  plain PyTorch: {plain:.0f}   llmtrain: {ours:.0f}   ratio llmtrain/plain: {ours / plain:.3f}")


if __name__ == "__main__":
    main()
