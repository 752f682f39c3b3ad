#!/usr/bin/env python
"""The learning result of docs/vision.md, end to end: ``tiny_idefics3`` on the digits folder,
scored by ``digits_local`` (greedy exact match on the 300 test images) at step 0, after a long
supervised run, after a short one, and after GRPO with the ``answer`` reward from the short one.

Each stage is one ``python -m llmtrain`` run (the commands of docs/vision.md) and one
``python -m llmtrain.evaluate RUN/hf tasks=[digits_local]``; printed per stage: the test images
answered right of 300, the exact match and its standard error sqrt(p (1 - p) / n) (the binomial
proportion's), and the stage's wall time. Step 0 is a one-step run at ``trainer.lr=1e-12``
(``trainer.lr`` must be > 0): AdamW moves each weight by at most ~1e-12, so it scores the
initialisation. On 2 shared CPU cores the four stages take about 20 minutes.

    python scripts/make_digits.py --out digits
    python scripts/bench/digits_vlm.py --data digits --out runs
    python scripts/bench/digits_vlm.py --data ../shared/data/digits --only grpo   # reuses digits-start in runs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from benchlib import REPO, launch

MODEL = ["model=tiny_idefics3"]
ANSWER_TOKENS = ["rollout.max_completion_length=2"]  # a digit and <|im_end|>, which ends the completion
# Each stage's run directory under --out: docs/vision.md's names.
RUNS = {"step0": "digits-step0", "sft": "digits-vlm", "start": "digits-start", "grpo": "digits-rl"}
STAGES = tuple(RUNS)


def stage_overrides(stage: str, train: Path, out: Path, args: argparse.Namespace) -> list[str]:
    """The llmtrain overrides of ``stage`` (docs/vision.md's commands, with absolute paths)."""
    sft = [*MODEL, "data=vlm_chat", f"data.path={train}"]
    if stage == "step0":
        return [*sft, "trainer.max_steps=1", "trainer.lr=1e-12"]
    if stage == "sft":
        return [*sft, f"trainer.max_steps={args.sft_steps}", "trainer.lr=3e-3", "trainer.eval_every=250"]
    if stage == "start":
        return [*sft, f"trainer.max_steps={args.start_steps}", "trainer.lr=3e-3"]
    return [*MODEL, "model.source=pretrained", f"model.path={out / 'digits-start' / 'hf'}", "model.tokenizer=model",
            "objective=grpo", "data=prompts", f"data.path={train}", "data.columns.prompt=messages",
            "reward.functions=[answer]", *ANSWER_TOKENS, f"rollout.temperature={args.temperature}",
            "objective.num_generations=8", "trainer.global_batch_size=16", "trainer.micro_batch_size=16",
            f"trainer.max_steps={args.grpo_steps}", "trainer.lr=3e-3", "trainer.eval_every=25"]


def score(run_dir: Path, test: Path) -> tuple[int, int]:
    """(right answers, test images) of ``digits_local`` on ``run_dir``'s export."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "llmtrain.evaluate", str(run_dir / "hf"), "tasks=[digits_local]",
                           f"data_file={test}"], capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"digits_local on {run_dir} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    newest = max((run_dir / "eval").glob("step_*.json"), key=lambda p: p.stat().st_mtime)
    scores = json.loads(newest.read_text())["scores"]
    n = int(scores["eval/digits_local/documents"])
    return round(scores["eval/digits_local/exact_match"] * n), n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=Path("digits"), help="the digits folder (scripts/make_digits.py)")
    p.add_argument("--out", type=Path, default=Path("runs"), help="where the four run directories go")
    p.add_argument("--only", choices=STAGES, action="append", help="run only these stages (repeatable)")
    p.add_argument("--sft-steps", type=int, default=1000, help="steps of the long supervised run")
    p.add_argument("--start-steps", type=int, default=100, help="steps of the supervised run GRPO starts from")
    p.add_argument("--grpo-steps", type=int, default=150)
    p.add_argument("--temperature", type=float, default=1.0, help="GRPO's sampling temperature")
    args = p.parse_args(argv)
    data, out = args.data.resolve(), args.out.resolve()
    if not (data / "train.jsonl").is_file() or not (data / "test.jsonl").is_file():
        p.error(f"--data {args.data}: no train.jsonl and test.jsonl there; write them with "
                "python scripts/make_digits.py --out DIR")
    print(f"{'stage':<6} {'right':>9} {'exact match':>17} {'wall s':>7}")
    for stage in args.only or STAGES:
        run_dir = out / RUNS[stage]
        started = time.perf_counter()
        launch(stage_overrides(stage, data / "train.jsonl", out, args), run_dir, what=stage)
        right, n = score(run_dir, data / "test.jsonl")
        acc = right / n
        print(f"{stage:<6} {right:>5}/{n:<3} {acc:>9.3f} ± {math.sqrt(acc * (1 - acc) / n):.3f} "
              f"{time.perf_counter() - started:>7.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
