"""Mixture-of-experts benchmarks, each side by side against its baseline in alternating rounds,
with wall-clock and CPU-time (``time.process_time`` / child rusage) ratios:

    python scripts/bench/moe.py experts [--rounds 3]     # grouped_mm / batched_mm vs the eager loop
    python scripts/bench/moe.py ep [--rounds 3]          # fsdp x ep=2 vs fsdp, 2 processes, same work
    python scripts/bench/moe.py volume                   # all-to-all bytes per step vs N k H theory

``experts``: one forward + backward of a tiny Qwen3-MoE decoder (hidden 256, 4 layers, top-2,
8 and 32 experts, 8 x 512 tokens) per implementation (``model.experts_implementation``).
``ep``: ``python -m llmtrain`` runs of tiny Qwen3-MoE (32 experts) on Tiny Shakespeare, 2
processes, tokens/s of steps after the first two from metrics.jsonl. ``volume``: 2 gloo processes,
one training forward/backward under ep=2, every dispatch and combine ``all_to_all_single``
counted (elements sent per rank, backward sends the same sizes in reverse).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from benchlib import DATA, alternating, launch

import torch


def tiny_moe_config(experts: int, implementation: str):
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3_moe", vocab_size=320, hidden_size=256, intermediate_size=512,
                                moe_intermediate_size=128, num_experts=experts, num_experts_per_tok=2,
                                norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=64, experts_implementation=implementation)


def experts_bench(rounds: int) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (8, 512))
    for experts in (8, 32):
        models = {}
        for impl in ("eager", "grouped_mm", "batched_mm"):
            torch.manual_seed(0)
            models[impl] = AutoModelForCausalLM.from_config(tiny_moe_config(experts, impl),
                                                            experts_implementation=impl)
        losses, wall, cpu = {}, {k: 0.0 for k in models}, {k: 0.0 for k in models}
        for r in range(rounds + 1):
            for impl in alternating(list(models), r):
                model = models[impl]
                model.zero_grad(set_to_none=True)
                w, c = time.perf_counter(), time.process_time()
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                if r:  # round 0 warms up
                    wall[impl] += time.perf_counter() - w
                    cpu[impl] += time.process_time() - c
                losses[impl] = float(loss.detach())
        tokens = ids.numel() * rounds
        base = tokens / wall["eager"]
        print(f"{experts} experts, top-2, {ids.numel()} tokens per forward+backward, {rounds} rounds:")
        for impl in models:
            print(f"  {impl:<11} {tokens / wall[impl]:>9,.0f} tokens/s  x{tokens / wall[impl] / base:.2f} wall  "
                  f"x{cpu['eager'] / cpu[impl]:.2f} CPU-time   loss {losses[impl]:.6f}")


def _launch(extra: list[str], run_dir: Path) -> tuple[float, float]:
    """tokens/s (steps 3..) and CPU seconds of a 2-process run."""
    overrides = ["model=tiny_qwen3_moe", "model.architecture.num_experts=32", "model.architecture.hidden_size=256",
                 "model.architecture.moe_intermediate_size=128", "model.architecture.head_dim=64",
                 "data=tinyshakespeare", f"data.path={DATA / 'tinyshakespeare.txt'}", "data.seq_len=512",
                 "trainer.max_steps=8", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
                 "trainer.eval_every=0", "trainer.save_every=0", "trainer.export_hf=false", "tracker=none",
                 "tracker.report=false", "trainer.progress_bar=false", *extra]
    done = launch(overrides, run_dir, nproc=2, env={"OMP_NUM_THREADS": "1"})
    rows = [r for r in done.records if "train/loss" in r and r["step"] > 2]
    tokens = sum(r["train/tokens_per_s"] * r["train/step_time_s"] for r in rows)
    return tokens / sum(r["train/step_time_s"] for r in rows), done.cpu_s, rows[-1]["train/loss"]


def ep_bench(rounds: int) -> None:
    layouts = {"fsdp": ["+recipe=fsdp"], "fsdp x ep=2": ["+recipe=fsdp", "recipe.ep=2"]}
    rate, cpu, loss = {k: 0.0 for k in layouts}, {k: 0.0 for k in layouts}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name in alternating(list(layouts), r):
                tps, seconds, loss[name] = _launch(layouts[name], Path(tmp) / f"{r}-{name.replace(' ', '').replace('=', '')}")
                rate[name] += tps / rounds
                cpu[name] += seconds / rounds
    print(f"tiny Qwen3-MoE (32 experts, top-2, hidden 256), 2 processes, 8 x 512 tokens a step, {rounds} rounds:")
    for name in layouts:
        print(f"  {name:<12} {rate[name]:>8,.0f} tokens/s  x{rate[name] / rate['fsdp']:.2f} wall  "
              f"x{cpu['fsdp'] / cpu[name]:.2f} CPU-time (whole launch)  final loss {loss[name]:.6f}")


def _volume_worker(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from llmtrain.config.compose import compose
    from llmtrain.engine.native import NativeEngine
    from llmtrain.parallel.distributed import DistEnv
    from llmtrain.config.layout import layout
    from llmtrain.models.build import build_model
    from llmtrain.objectives import build_objective
    from llmtrain.parallel.dims import ParallelDims

    cfg = compose(["model=tiny_qwen3_moe", "+recipe=fsdp", "recipe.ep=2", "trainer.global_batch_size=8",
                   "trainer.micro_batch_size=4", "data.seq_len=512"])
    dims = ParallelDims.from_layout(layout(cfg, 2))
    env = DistEnv(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    engine = NativeEngine(cfg, env, 1, dims, objective=build_objective(cfg.objective))
    with engine.model_init_context():
        model = build_model(cfg.model, cfg.trainer.seed)
    engine.setup(model)
    sent = []
    original = fc.all_to_all_single_autograd

    def counting(tensor, output_split_sizes, input_split_sizes, group, tag=""):
        sent.append(tensor.numel())
        return original(tensor, output_split_sizes, input_split_sizes, group, tag)

    fc.all_to_all_single_autograd = counting
    torch.manual_seed(rank)
    ids = torch.randint(0, 256, (4, 512))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    engine.accumulate_gradients([batch], float(ids.numel() * 2))
    out[rank] = sent
    dist.destroy_process_group()


def volume_bench() -> None:
    import socket

    import torch.multiprocessing as mp

    from llmtrain.config.compose import compose
    from llmtrain.models.build import model_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_volume_worker, args=(port, out), nprocs=2)
    config = model_config(compose(["model=tiny_qwen3_moe"]).model)
    tokens, k, hidden, layers = 4 * 512, config.num_experts_per_tok, config.hidden_size, config.num_hidden_layers
    theory = tokens * k * hidden
    print(f"ep=2, tiny Qwen3-MoE ({layers} MoE layers, top-{k}, hidden {hidden}), {tokens} tokens per rank:")
    for rank, sent in sorted(out.items()):
        dispatch, combine = sent[0::2], sent[1::2]
        print(f"  rank {rank}: {len(dispatch)} dispatches, {len(combine)} combines; elements sent per layer: dispatch "
              f"{sum(dispatch) / layers:,.0f}, combine {sum(combine) / layers:,.0f}; theory N k H = {theory:,} per "
              f"direction (x{sum(dispatch) / layers / theory:.3f}, x{sum(combine) / layers / theory:.3f}); "
              f"{sum(sent) * 4 / 2**20:.2f} MiB fp32 forward, the same again in backward")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["experts", "ep", "volume"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    {"experts": lambda: experts_bench(args.rounds), "ep": lambda: ep_bench(args.rounds),
     "volume": volume_bench}[args.what]()


if __name__ == "__main__":
    main()
