#!/usr/bin/env python
"""DPO's reference policy three ways, side by side: a frozen full copy, the LoRA base with the
adapters disabled, and log-probs precomputed before step 1.

For each mode: the planner's per-rank bytes (``python -m llmtrain.plan``'s figure for this
config) and the measured peak RSS of the run (``memory/peak_bytes``, one process on CPU), and
steps/s and steps per CPU-second (the child's user + system time) of the steps after
``--warmup``. Runs alternate over rounds (the order flips every round) so machine drift hits all
modes alike; medians over rounds are printed with ratios against the live frozen copy. The LoRA
mode trains adapters, so its step time is not comparable with the two full fine-tuning modes;
it is printed for its memory.

    python scripts/bench/preference.py PAIRS.jsonl --rounds 3 --steps 12
    python scripts/bench/preference.py ../shared/data/hh_rlhf_harmless_test.jsonl.gz model.architecture.num_hidden_layers=8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from benchlib import alternating, launch

# A model large enough that a second copy shows in the process's memory (~26 M parameters).
MODEL = ["model.architecture.hidden_size=512", "model.architecture.intermediate_size=1408",
         "model.architecture.num_hidden_layers=8", "model.architecture.num_attention_heads=8",
         "model.architecture.num_key_value_heads=4"]
MODES = {"copy": ["objective.reference=copy"],
         "precompute": ["objective.precompute_reference=true"],
         "lora_disabled": ["+peft=lora"]}


def overrides(pairs: str, steps: int, extra: list[str]) -> list[str]:
    return ["data=preference", f"data.path={pairs}", "data.seq_len=256", "data.max_prompt_tokens=192",
            "objective=dpo", f"trainer.max_steps={steps}", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
            "trainer.eval_every=0", "trainer.eval_samples=8", "trainer.save_every_minutes=0", "trainer.export_hf=false",
            "tracker=none", "tracker.report=false", "trainer.progress_bar=false", "trainer.log_every=1",
            "data.val_fraction=0.05", *MODEL, *extra]


def planned_bytes(args: list[str]) -> int:
    from llmtrain.config.compose import compose
    from llmtrain.planning.memory import plan_recipe

    return plan_recipe(compose(args), 1).total


def run(args: list[str], run_dir: Path, warmup: int) -> dict[str, float]:
    done = launch(args, run_dir)
    steps = done.steps(warmup)
    step_s = sum(r["train/step_time_s"] for r in steps)
    return {"steps_per_s": len(steps) / step_s, "peak_bytes": max(r["memory/peak_bytes"] for r in steps),
            "cpu_s": done.cpu_s, "wall_s": done.wall_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pairs", help="a preference file (e.g. ../shared/data/hh_rlhf_harmless_test.jsonl.gz)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    a, extra = p.parse_known_args(argv)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    names = list(MODES)
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(a.rounds):
            for mode in alternating(names, k):
                results[mode].append(run(overrides(a.pairs, a.steps, extra + MODES[mode]), Path(tmp) / f"{mode}-{k}",
                                         a.warmup))
    base = {key: statistics.median(r[key] for r in results["copy"]) for key in ("steps_per_s", "peak_bytes", "cpu_s")}
    print(f"{'reference':<14} {'planned/rank':>13} {'measured RSS':>13} {'RSS vs copy':>12} {'steps/s':>8} "
          f"{'vs copy':>8} {'CPU s':>7} {'CPU vs copy':>12}")
    for mode in names:
        med = {key: statistics.median(r[key] for r in results[mode]) for key in ("steps_per_s", "peak_bytes", "cpu_s")}
        planned = planned_bytes(overrides(a.pairs, a.steps, extra + MODES[mode]))
        print(f"{mode:<14} {planned / 2**20:>10.1f} MiB {med['peak_bytes'] / 2**20:>9.1f} MiB "
              f"{med['peak_bytes'] / base['peak_bytes']:>12.3f} {med['steps_per_s']:>8.3f} "
              f"{med['steps_per_s'] / base['steps_per_s']:>8.3f} {med['cpu_s']:>7.1f} {med['cpu_s'] / base['cpu_s']:>12.3f}")
    print(f"medians over {a.rounds} rounds of {a.steps} steps ({a.warmup} warm-up steps left out of steps/s); CPU s is "
          "the whole process (start-up and the precompute pass included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
