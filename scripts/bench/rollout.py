"""Rollout throughput: decode tokens/s of the ``hf`` engine's sampling loop per precision mode,
side by side, on a SmolLM2-135M-shaped Llama (config-built, random weights: every completion runs
to ``--new`` tokens, so each mode decodes the same number of tokens), one thread, rounds
alternating the order of the modes. Wall clock and CPU time (``time.process_time``) per mode.

* ``fp32``: fp32 weights, no autocast (``trainer.precision=fp32``).
* ``bf16-autocast``: fp32 weights under bf16 autocast (how bf16 runs sampled before
  :func:`llmtrain.engine.native.bf16_weights`).
* ``bf16``: bf16 weights for the duration of the sampling loop (bf16 runs now).
* ``vllm`` (with ``--vllm``): ``rollout.engine=vllm``'s engine itself (a vLLM server in its own
  environment, bf16, the same weights written by ``write_policy``), one request per completion;
  its CPU time is the server's processes' (from ``/proc``) plus this one's.

    python scripts/bench/rollout.py [--rounds 3] [--rows 8] [--prompt 64] [--new 32] [--vllm]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import benchlib  # noqa: F401  (the checkout's llmtrain first)
import torch

from llmtrain.engine.native import bf16_weights
from llmtrain.rollout.generate import Sampling, sample_group

MODES = ("fp32", "bf16-autocast", "bf16")


def smollm2_shaped() -> torch.nn.Module:
    """A Llama with SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV heads, 49152 vocab)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def session_cpu_s(leader: int) -> float:
    """CPU seconds (user + system) of the live processes in session ``leader`` (a server started
    with ``start_new_session``)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == leader:  # field 6 (session), counted after the command's ")"
                total += (int(fields[11]) + int(fields[12])) / tick
    return total


class VLLMRollout:
    """The vllm engine on ``model``'s weights (bf16), started once for every round."""

    def __init__(self, model: torch.nn.Module, args, work: Path):
        from llmtrain.checkpoint.export import write_policy
        from llmtrain.config.compose import compose
        from llmtrain.models.build import build_tokenizer
        from llmtrain.rollout import build_sampler

        c = model.config
        cfg = compose(["model=tiny_llama", "objective=grpo", "rollout.engine=vllm", "trainer.precision=bf16",
                       f"data.seq_len={args.prompt + args.new + 8}", f"rollout.max_completion_length={args.new}",
                       f"run_dir={work}"] + [f"model.architecture.{k}={getattr(c, k)}" for k in (
                           "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "num_key_value_heads")])
        tokenizer = build_tokenizer(cfg.model)
        self.engine = build_sampler(cfg, tokenizer, [])
        self.policy = SimpleNamespace(full_state_dict=lambda: model.state_dict(), frozen_in_bf16=False, env=SimpleNamespace(is_main=True),
                                      optimizer_step_count=lambda: 0)
        self.engine.publish = lambda d, part: write_policy(self.policy, cfg, tokenizer, d, part, [])
        self.engine.check()
        self.engine.sample(self.policy, [{"prompt_ids": [1, 2, 3]}], [[None]])  # start, load, warm up

    def run(self, args) -> tuple[float, float, int]:
        prompt = list(range(100, 100 + args.prompt))
        leader = self.engine.process.pid
        wall, cpu, server = time.perf_counter(), time.process_time(), session_cpu_s(leader)
        out = self.engine.sample(self.policy, [{"prompt_ids": prompt}], [list(range(args.rows))])[0]
        cpu_s = time.process_time() - cpu + session_cpu_s(leader) - server
        return time.perf_counter() - wall, cpu_s, sum(len(c.ids) for c in out)


def run(model: torch.nn.Module, mode: str, args) -> tuple[float, float, int]:
    """One sampling batch in ``mode``: (wall s, CPU s, tokens decoded)."""
    if mode == "vllm":
        return args.vllm_engine.run(args)
    sampling = Sampling(temperature=1.0, max_new=args.new)
    prompt = list(range(100, 100 + args.prompt))
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mode != "fp32" else contextlib.nullcontext
    wall, cpu = time.perf_counter(), time.process_time()
    with bf16_weights(model, mode == "bf16"):
        out = sample_group(model, prompt, list(range(args.rows)), sampling, torch.device("cpu"), autocast=autocast)
    return time.perf_counter() - wall, time.process_time() - cpu, sum(len(c.ids) for c in out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8, help="completions per prompt (G), decoded as one batch")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--new", type=int, default=32, help="tokens per completion")
    parser.add_argument("--vllm", action="store_true", help="add the vllm engine (its venv: docs/online-rl.md, vLLM)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = smollm2_shaped()
    modes = MODES + (("vllm",) if args.vllm else ())
    run(model, "bf16", args)  # warm-up: oneDNN's bf16 kernels, allocator
    with tempfile.TemporaryDirectory() as work:
        args.vllm_engine = VLLMRollout(model, args, Path(work)) if args.vllm else None
        try:
            results: dict[str, list[tuple[float, float, int]]] = {m: [] for m in modes}
            for r in range(args.rounds):
                for mode in benchlib.alternating(modes, r):
                    results[mode].append(run(model, mode, args))
        finally:
            if args.vllm_engine is not None:
                args.vllm_engine.engine.close()
    base_wall = statistics.median(w for w, _, _ in results["fp32"])
    base_cpu = statistics.median(c for _, c, _ in results["fp32"])
    print(f"{'mode':<14} {'tokens/s':>9} {'ms/step':>8} {'wall vs fp32':>13} {'cpu vs fp32':>12}")
    for mode in modes:
        wall = statistics.median(w for w, _, _ in results[mode])
        cpu = statistics.median(c for _, c, _ in results[mode])
        tokens = statistics.median(n for _, _, n in results[mode])
        print(f"{mode:<14} {tokens / wall:9.1f} {1000 * wall / args.new:8.1f} {base_wall / wall:13.2f}x "
              f"{base_cpu / cpu:11.2f}x")


if __name__ == "__main__":
    main()
