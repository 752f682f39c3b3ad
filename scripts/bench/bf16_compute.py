#!/usr/bin/env python
"""The torch engine's bf16 step on bf16 casts of its weights (``Bf16ComputeWeights``, what
``trainer.precision=bf16`` runs on one process and DDP) against the same engine under bf16
autocast over fp32 weights (what it ran before), one process, in one Python process: two engines
with the same initial weights and micro-batches, steps alternating between them, medians of wall
and CPU time per optimizer step; then the planner's activation bytes of each (saved for
backward, measured under ``FakeTensorMode``).

    python scripts/bench/bf16_compute.py                      # SmolLM2-135M's width, 8 layers, 2 x 512 tokens x 2 micro-batches
    python scripts/bench/bf16_compute.py --layers 30 --seq 1024 --rounds 4

Model: SmolLM2-135M's shape from config (hidden 576, 9 heads / 3 KV heads, MLP 1536, vocab 49152,
tied embeddings; random weights), ``--layers`` decoder layers. Ratios above 1: bf16 casts faster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import benchlib  # noqa: F401  (the checkout's llmtrain first on the path)

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what python -m llmtrain sets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()

    import torch
    from hydra import compose, initialize_config_dir
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.common.paths import CONF_DIR
    from llmtrain.config.compose import register_configs
    from llmtrain.engine.torch_engine import TorchEngine
    from llmtrain.objectives import CausalLM
    from llmtrain.parallel.distributed import DistEnv
    from llmtrain.planning.memory import measure_activations

    hf = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["trainer.precision=bf16", f"trainer.micro_batch_size={args.micro_batch}",
                                           f"trainer.global_batch_size={2 * args.micro_batch}"])
    engines = {}
    for mode in ("autocast", "bf16 casts"):
        torch.manual_seed(0)
        engine = TorchEngine(cfg, DistEnv(0, 1, 0, torch.device("cpu"), "gloo"), accumulation_steps=2,
                             objective=CausalLM())
        engine.setup(LlamaForCausalLM(hf))
        if mode == "autocast":
            engine.bf16_compute = None  # the engine's forward falls back to autocast
        engines[mode] = engine
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": (ids := torch.randint(0, hf.vocab_size, (args.micro_batch, args.seq), generator=gen)),
                "labels": ids.clone(), "attention_mask": torch.ones_like(ids)} for _ in range(2)]
    tokens = 2.0 * args.micro_batch * args.seq

    def step(engine) -> float:
        sums = engine.accumulate_gradients(batches, tokens)
        engine.step()
        return float(sums[0]) / tokens

    losses = {mode: [step(engine)] for mode, engine in engines.items()}  # warm-up
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in engines}
    for index in range(args.rounds):
        for mode in benchlib.alternating(list(engines), index):
            wall, cpu = time.perf_counter(), time.process_time()
            losses[mode].append(step(engines[mode]))
            times[mode].append((time.perf_counter() - wall, time.process_time() - cpu))
    print(f"{args.layers} layers, micro-batch {args.micro_batch} x {args.seq} tokens x 2, {args.rounds} alternating rounds")
    med = {mode: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for mode, t in times.items()}
    for mode, (wall, cpu) in med.items():
        print(f"{mode:>10}: {wall:.3f} s wall, {cpu:.3f} CPU-s per step; losses {' '.join(f'{x:.4f}' for x in losses[mode])}")
    print(f"bf16 casts / autocast speed: wall {med['autocast'][0] / med['bf16 casts'][0]:.2f}, "
          f"CPU {med['autocast'][1] / med['bf16 casts'][1]:.2f}")
    acts = {mode: measure_activations(hf, args.micro_batch, args.seq, "bf16", bf16_weights=mode != "autocast")
            for mode in engines}
    mib = {mode: (hf.num_hidden_layers * a.per_layer + a.outside) / 2**20 for mode, a in acts.items()}
    print(f"activations saved for backward per micro-batch (planner): autocast {mib['autocast']:.0f} MiB, "
          f"bf16 casts {mib['bf16 casts']:.0f} MiB ({mib['bf16 casts'] / mib['autocast']:.2f})")


if __name__ == "__main__":
    main()
