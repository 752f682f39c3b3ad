#!/usr/bin/env python
"""llmtrain against Hugging Face Trainer: the same model, data, global batch, optimizer and
schedule, in three modes (1 process, DDP x 2, ZeRO-3 x 2), alternating order over rounds.

Both sides train the tiny Llama widened to Ψ ≈ 3 M parameters on the same packed token blocks
(llmtrain's data pipeline, ``data=stdlib``), global batch 16 of 128 tokens, AdamW (β = 0.9/0.95,
weight decay 0.1, clipping 1.0), linear warmup then cosine decay to 0.1 × lr, fp32, no
evaluation, logging or saving inside the timed steps. HF Trainer gets llmtrain's generated
DeepSpeed JSON for ZeRO-3 (``llmtrain.engine.deepspeed_engine.deepspeed_config``), so both run
the identical DeepSpeed configuration.

Measured on rank 0 between the start of step ``--warmup`` and the start of the last step: wall
tokens/s, and tokens per CPU-second (``time.process_time`` of rank 0; the figure to trust on a
shared machine). Each (framework, mode, round) is its own launch; the order of the two
frameworks flips every round.

    python scripts/bench/peers.py --rounds 3
    python scripts/bench/peers.py --modes single --rounds 5 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib import REPO
SEQ_LEN, GLOBAL_BATCH = 128, 16
OVERRIDES = ["model.architecture.hidden_size=256", "model.architecture.intermediate_size=688", "tracker=none",
             "trainer.progress_bar=false", "trainer.eval_every=0", "trainer.eval_samples=4", "trainer.export_hf=false",
             "data.max_bytes=600000", f"data.seq_len={SEQ_LEN}", f"trainer.global_batch_size={GLOBAL_BATCH}",
             "trainer.micro_batch_size=8", "trainer.precision=fp32"]  # HF Trainer's side runs fp32 too
MODES = {"single": (1, []), "ddp": (2, ["+recipe=ddp"]), "zero3": (2, ["+recipe=zero3"])}


def compose_cfg(mode: str, steps: int, run_dir: str):
    from hydra import compose, initialize_config_dir

    from llmtrain.config.compose import register_configs
    from llmtrain.common.paths import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=OVERRIDES + MODES[mode][1] + [f"trainer.max_steps={steps}",
                                                                         f"run_dir={run_dir}"])


def tokens_per_s(starts: list[tuple[float, float]], warmup: int) -> tuple[float, float]:
    """(wall tokens/s, tokens per CPU-second) from the (wall, cpu) times at each step's start."""
    (w0, c0), (w1, c1) = starts[warmup], starts[-1]
    tokens = (len(starts) - 1 - warmup) * GLOBAL_BATCH * SEQ_LEN
    return tokens / (w1 - w0), tokens / (c1 - c0)


def train_with_step_clock(cfg) -> tuple[dict, list[tuple[float, float]]]:
    """``llmtrain.trainer.train(cfg)``, recording (wall, CPU) time at the start of every step:
    (the run's summary, the clock readings). Also used by ``bench_overhead.py``."""
    from llmtrain import trainer

    starts: list[tuple[float, float]] = []
    real = trainer.forward_backward

    def timed(engine, batches, *args):
        starts.append((time.perf_counter(), time.process_time()))
        return real(engine, batches, *args)

    trainer.forward_backward = timed
    try:
        return trainer.train(cfg), starts
    finally:
        trainer.forward_backward = real


def run_llmtrain(mode: str, steps: int, warmup: int, run_dir: str) -> tuple[float, float]:
    import llmtrain.parallel.distributed  # noqa: F401  (DS_ACCELERATOR before deepspeed)

    _, starts = train_with_step_clock(compose_cfg(mode, steps, run_dir))
    return tokens_per_s(starts, warmup)


def run_hf(mode: str, steps: int, warmup: int, run_dir: str) -> tuple[float, float]:
    import llmtrain.parallel.distributed  # noqa: F401
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from llmtrain import data
    from llmtrain.config.layout import gradient_accumulation_steps
    from llmtrain.models.build import build_model, build_tokenizer

    cfg = compose_cfg(mode, steps, run_dir)
    t = cfg.trainer
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # before TrainingArguments: its DeepSpeed config reads the world size from the group
        from llmtrain.parallel.distributed import init_distributed

        init_distributed(need_group=True)
        if mode == "zero3":  # zero.Init (the model is built partitioned) reads deepspeed.comm's world
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
    tokenizer = build_tokenizer(cfg.model)
    splits = data.load_splits(cfg.data, tokenizer, t.seed)

    class Blocks(torch.utils.data.Dataset):
        def __len__(self):
            return len(splits.train)

        def __getitem__(self, i):
            return splits.train[i]

    ds_config = None
    if mode == "zero3":
        from llmtrain.engine.deepspeed_engine import deepspeed_config

        ds_config = deepspeed_config(cfg, world, gradient_accumulation_steps(t, world))
    args = TrainingArguments(
        output_dir=run_dir, max_steps=steps, per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps(t, world), learning_rate=t.lr,
        weight_decay=t.weight_decay, adam_beta1=t.beta1, adam_beta2=t.beta2, adam_epsilon=t.eps,
        max_grad_norm=t.grad_clip, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=t.warmup_steps, logging_strategy="no", save_strategy="no", eval_strategy="no", report_to=[],
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, seed=t.seed, deepspeed=ds_config,
        disable_tqdm=True, ddp_backend="gloo" if world > 1 else None)
    starts: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            starts.append((time.perf_counter(), time.process_time()))

    model = build_model(cfg.model, t.seed)
    Trainer(model=model, args=args, train_dataset=Blocks(), data_collator=data.Collator(tokenizer.pad_token_id),
            callbacks=[Clock()]).train()
    return tokens_per_s(starts, warmup)


def child(framework: str, mode: str, steps: int, warmup: int) -> None:
    with tempfile.TemporaryDirectory() as run_dir:
        result = (run_llmtrain if framework == "llmtrain" else run_hf)(mode, steps, warmup, run_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps({"wall": result[0], "cpu": result[1]}), flush=True)
    from llmtrain.parallel.distributed import shutdown

    shutdown()


def launch(framework: str, mode: str, steps: int, warmup: int) -> dict:
    nproc = MODES[mode][0]
    cmd = ([sys.executable] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"])
    out = subprocess.run(cmd + [__file__, "--child", framework, "--modes", mode, "--steps", str(steps),
                                "--warmup", str(warmup)], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{framework} {mode} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the measurement")
    parser.add_argument("--child", choices=["llmtrain", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.modes[0], args.steps, args.warmup)
    print(f"Ψ ≈ 3.0 M, global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens, {args.steps} steps "
          f"(timed from step {args.warmup}), median of {args.rounds} alternating rounds")
    print(f"{'mode':7s} {'llmtrain tok/s':>15s} {'HF tok/s':>9s} {'ratio':>6s} {'llmtrain tok/CPU-s':>19s} "
          f"{'HF tok/CPU-s':>13s} {'ratio':>6s}")
    for mode in args.modes:
        got: dict[str, list[dict]] = {"llmtrain": [], "hf": []}
        for r in range(args.rounds):
            for framework in (("llmtrain", "hf") if r % 2 == 0 else ("hf", "llmtrain")):
                got[framework].append(launch(framework, mode, args.steps, args.warmup))
        med = {f: {k: statistics.median(x[k] for x in v) for k in ("wall", "cpu")} for f, v in got.items()}
        print(f"{mode:7s} {med['llmtrain']['wall']:15.0f} {med['hf']['wall']:9.0f} "
              f"{med['llmtrain']['wall'] / med['hf']['wall']:6.2f} {med['llmtrain']['cpu']:19.0f} "
              f"{med['hf']['cpu']:13.0f} {med['llmtrain']['cpu'] / med['hf']['cpu']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
