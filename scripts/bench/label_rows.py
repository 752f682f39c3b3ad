#!/usr/bin/env python
"""The label head (``trainer.logits_at_labels_only``) against Hugging Face's own loss, in one
process, side by side: a model of SmolLM2-135M's shape (hidden 576, 30 layers, vocabulary 49,152,
tied head; random init) built from its config, forward and backward on ``--rows`` x ``--seq``
tokens whose first ``--masked`` fraction of each row carries no label (a prompt), under bf16
autocast where the CPU runs bf16 natively.

- ``hf``: ``model(input_ids, labels=labels).loss`` (whole logits, their fp32 copy and
  ``cross_entropy`` at every position: Hugging Face's ``ForCausalLMLoss``);
- ``label head``: :func:`llmtrain.models.chunked_loss.install` (chunk 0) and llmtrain's
  ``token_cross_entropy_sum`` over the returned label log-probs, divided by the same count.

Rounds alternate the order; prints wall and CPU seconds per step (medians) and their ratios, and
the largest difference of the two losses.

    python scripts/bench/label_rows.py                 # half of each row masked
    python scripts/bench/label_rows.py --masked 0      # pre-training: every position labelled
"""

from __future__ import annotations

import argparse
import statistics
import time

import benchlib  # noqa: F401  (the checkout's llmtrain first on the path)
import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--masked", type=float, default=0.5, help="fraction of each row without labels")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per side and round")
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.common.hardware import resolve_precision
    from llmtrain.models.chunked_loss import install
    from llmtrain.objectives.causal_lm import count_target_tokens, token_cross_entropy_sum

    precision, why = resolve_precision("auto", torch.device("cpu"))
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)
    models = {"hf": LlamaForCausalLM(config)}
    models["label head"] = LlamaForCausalLM(config)
    models["label head"].load_state_dict(models["hf"].state_dict())
    head = install(models["label head"], 0)
    ids = torch.randint(0, config.vocab_size, (args.rows, args.seq))
    labels = ids.clone()
    labels[:, :int(args.seq * args.masked)] = -100
    count = count_target_tokens(labels)
    losses: dict[str, float] = {}

    def step(name: str) -> None:
        model = models[name]
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            if name == "hf":
                loss = model(input_ids=ids, labels=labels).loss
            else:
                head.targets = F.pad(labels[:, 1:], (0, 1), value=-100)
                loss = token_cross_entropy_sum(model(input_ids=ids).logits, labels) / count
                head.targets = None
        loss.backward()
        losses[name] = float(loss)

    times: dict[str, list[tuple[float, float]]] = {"hf": [], "label head": []}
    for name in times:
        step(name)  # warm-up
    for r in range(args.rounds):
        for name in benchlib.alternating(list(times), r):
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.repeats):
                step(name)
            times[name].append(((time.perf_counter() - wall) / args.repeats, (time.process_time() - cpu) / args.repeats))
    med = {name: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)) for name, v in times.items()}
    print(f"{precision} ({why}); {args.layers} layers, {args.rows} x {args.seq} tokens, {args.masked:.0%} of each row "
          f"masked; medians of {args.rounds} alternating rounds of {args.repeats} steps")
    for name, (wall, cpu) in med.items():
        print(f"{name:11s} {wall:7.3f} s wall {cpu:7.3f} CPU-s a step")
    print(f"hf ÷ label head: wall {med['hf'][0] / med['label head'][0]:.2f}, CPU {med['hf'][1] / med['label head'][1]:.2f}; "
          f"loss difference {abs(losses['hf'] - losses['label head']):.2g}")


if __name__ == "__main__":
    main()
