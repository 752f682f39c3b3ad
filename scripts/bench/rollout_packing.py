"""Padding-free rollouts: training tokens/s of GRPO micro-batches laid out padded (one completion
per row, right-padded to the longest) and packed (``rollout.packing=true``: several sequences per
row of ``--row`` tokens, ``position_ids`` from 0 per sequence), side by side on the same
completions of mixed length. One forward + backward of the GRPO loss per micro-batch, on a
SmolLM2-135M-shaped Llama (config-built; ``--layers`` of its 30), one thread, rounds alternating
the order; tokens are the real (prompt + completion) tokens of the micro-batch, the same for both.
Wall clock and CPU time (``time.process_time``); the packed layout's loss is checked against the
padded one's first.

    python scripts/bench/rollout_packing.py [--rounds 3] [--completions 16] [--layers 8] [--precision bf16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

import benchlib  # noqa: F401  (the checkout's llmtrain first)
import torch

from llmtrain.engine.base import model_inputs
from llmtrain.objectives.grpo import GRPO
from llmtrain.rollout.generate import Completion
from llmtrain.rollout.rollout import Rollout


def model(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def batches(completions: int, row: int, seed: int = 0) -> tuple[dict, dict, int]:
    """The same ``completions`` (prompts 48-96 tokens, completions 8-256, long-tailed as sampled
    completions are) laid out padded and packed."""
    rng = random.Random(seed)
    rows = []
    for k in range(completions):
        prompt = {"prompt_ids": [rng.randrange(1, 49152) for _ in range(rng.randint(48, 96))]}
        n = min(256, int(rng.expovariate(1 / 64)) + 8)
        rows.append((prompt, Completion([rng.randrange(1, 49152) for _ in range(n)], n == 256), rng.uniform(-1, 1)))
    objective = GRPO({"loss_type": "dapo", "num_generations": 2})
    out = {}
    for packing in (False, True):
        rollout = Rollout.__new__(Rollout)
        rollout.pad_id, rollout.objective, rollout.packing = 0, objective, packing
        rollout.cfg = SimpleNamespace(data=SimpleNamespace(seq_len=row))
        out[packing] = objective.prepare(rollout._layout(rows))
    tokens = sum(len(p["prompt_ids"]) + len(c.ids) for p, c, _ in rows)
    return out[False], out[True], tokens


def step(net: torch.nn.Module, objective: GRPO, batch: dict, precision: str) -> float:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits = net(**model_inputs(batch)).logits
    loss = objective.loss_sums(logits, batch).loss / objective.normaliser(batch)
    loss.backward()
    net.zero_grad(set_to_none=True)
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--completions", type=int, default=16)
    parser.add_argument("--row", type=int, default=352, help="packed row length (data.seq_len)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    net = model(args.layers)
    objective = GRPO({"loss_type": "dapo", "num_generations": 2})
    padded, packed, tokens = batches(args.completions, args.row)
    with torch.autocast("cpu", enabled=False):
        a, b = step(net, objective, padded, "fp32"), step(net, objective, packed, "fp32")
    print(f"{args.completions} completions, {tokens} real tokens: padded {tuple(padded['input_ids'].shape)} "
          f"({padded['input_ids'].numel()} slots), packed {tuple(packed['input_ids'].shape)} "
          f"({packed['input_ids'].numel()} slots); fp32 loss padded {a:.6f} packed {b:.6f} (|diff| {abs(a - b):.1e})")
    times = {"padded": [], "packed": []}
    for r in range(args.rounds):
        order = ("padded", "packed") if r % 2 == 0 else ("packed", "padded")
        for name in order:
            batch = padded if name == "padded" else packed
            wall, cpu = time.perf_counter(), time.process_time()
            step(net, objective, batch, args.precision)
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    base_wall = statistics.median(w for w, _ in times["padded"])
    base_cpu = statistics.median(c for _, c in times["padded"])
    for name, rows in times.items():
        wall, cpu = statistics.median(w for w, _ in rows), statistics.median(c for _, c in rows)
        print(f"{name:7s} {tokens / wall:8.1f} tokens/s  {tokens / cpu:8.1f} tokens/CPU-s  "
              f"{base_wall / wall:.2f}x wall  {base_cpu / cpu:.2f}x CPU  ({args.precision}, {args.layers} layers, "
              f"median of {args.rounds})")


if __name__ == "__main__":
    main()
