"""Padding fraction and real tokens/s with and without ``data.packing``, side by side.

    OMP_NUM_THREADS=1 python scripts/bench/packing.py --alpaca ../shared/data/alpaca_5000.json \
        --sharegpt ../shared/data/sharegpt_dummy_500.json

For each dataset: llmtrain's own splits (byte tokenizer with the ChatML template, ``seq_len``
512), micro-batches of 8 rows in the training order, forward + backward of the tiny Llama. Padding
fraction = 1 - real tokens / (rows x padded length). Real tokens/s counts non-padding tokens.
Rounds alternate packed and unpacked; medians of wall clock and CPU time (``time.process_time``)
are printed with their ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import benchlib  # noqa: F401,E402  (the checkout's llmtrain first on the path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alpaca", required=True)
    parser.add_argument("--sharegpt", required=True)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from llmtrain import data
    from llmtrain.config.schema import DataConfig
    from llmtrain.engine import model_inputs
    from llmtrain.objectives.causal_lm import token_cross_entropy_sum
    from llmtrain.models.build import byte_tokenizer, model_config
    from tests.conftest import make_cfg

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(make_cfg([]).model))
    print("| data | packing | padding fraction | real tokens/s (wall) | real tokens per CPU-s | samples per row |")
    print("|---|---|---|---|---|---|")
    for name, path, fmt in (("alpaca_5000", args.alpaca, "instruction"), ("sharegpt_dummy_500", args.sharegpt, "chat")):
        results = {}
        batches = {}
        for packing in (False, True):
            cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), dict(
                name=name, format=fmt, path=path, seq_len=args.seq_len, template="chatml", packing=packing))
            splits = data.load_splits(cfg, byte_tokenizer(), seed=0)
            order = splits.order(0, True)
            rows = [splits.train[order[g]] for g in range(8 * args.batches)]
            batches[packing] = [data.Collator(257)(rows[i:i + 8]) for i in range(0, len(rows), 8)]
            stats = splits.stats[name]
            results[packing] = {"wall": [], "cpu": [], "per_row": stats.get("packed_samples", 1) / stats.get(
                "packed_rows", 1)}
        for _ in range(args.rounds):
            for packing in ((False, True) if _ % 2 == 0 else (True, False)):
                wall, cpu = time.perf_counter(), time.process_time()
                for b in batches[packing]:
                    loss = token_cross_entropy_sum(model(**model_inputs(b)).logits, b["labels"])
                    loss.backward()
                results[packing]["wall"].append(time.perf_counter() - wall)
                results[packing]["cpu"].append(time.process_time() - cpu)
        real = {p: sum(int(b["attention_mask"].sum()) for b in batches[p]) for p in (False, True)}
        for packing in (False, True):
            cells = sum(b["input_ids"].numel() for b in batches[packing])
            r = results[packing]
            print(f"| {name} | {packing} | {1 - real[packing] / cells:.3f} | "
                  f"{real[packing] / statistics.median(r['wall']):,.0f} | "
                  f"{real[packing] / statistics.median(r['cpu']):,.0f} | {r['per_row']:.2f} |")
        # Real tokens per second, packed over unpacked, for wall clock and CPU time.
        ratio = {clock: (real[True] / statistics.median(results[True][clock]))
                 / (real[False] / statistics.median(results[False][clock])) for clock in ("wall", "cpu")}
        print(f"|   {name}: packed / unpacked real tokens/s | | | {ratio['wall']:.2f}x | {ratio['cpu']:.2f}x | |")


if __name__ == "__main__":
    main()
