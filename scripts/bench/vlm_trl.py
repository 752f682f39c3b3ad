#!/usr/bin/env python
"""llmtrain against TRL's ``SFTTrainer`` on the same image-text fine-tune: the digits folder
(``scripts/make_digits.py``; ``../shared/data/digits`` or ``--data``), ``tiny_idefics3`` (or
``--model``), the same records in the same order (llmtrain's unshuffled training split, which TRL
reads sequentially), the same micro-batch, global batch and steps, AdamW at a constant learning
rate with clipping 1.0, no evaluation, logging or saving in the timed steps; fp32 and bf16 (CPU
autocast on both sides: TRL ``bf16=True``, llmtrain ``trainer.precision=bf16``).

Each side in its documented configuration for an image-text SFT:

- TRL: ``SFTTrainer`` with the model's processor, a ``datasets`` image column (decoded from the
  files as it is read, as a Hub dataset's), its ``DataCollatorForVisionLanguageModeling`` (chat
  template, image processor and tokenizer per micro-batch, in the training loop), the loss on the
  assistant turns (``assistant_only_loss=True`` with llmtrain's chat template carrying
  ``{% generation %}`` markers, the targets llmtrain trains: ``tests/test_vision_trl.py``),
  ``gradient_checkpointing=False`` (llmtrain does not checkpoint by default), AdamW fused.
- llmtrain: ``python -m llmtrain model=... data=vlm_chat`` as docs/vision.md runs it: samples
  tokenized once before step 1, images read and processed per micro-batch by its collator in the
  ``data.prefetch`` background thread.

Measured in each run (its own process) between the start of step ``--warmup`` and the start of
the last step: images/s and tokens/s (the samples' real tokens) of wall clock and per CPU-second
(``time.process_time``, every thread of the process), the time spent preparing images (llmtrain:
``image_tensors``, reading and processing; TRL: decoding the image column and the image
processor) as a share of the window's wall clock (llmtrain's runs in the ``data.prefetch`` thread,
beside the step), the share the step waited for its micro-batches (llmtrain's ``time/data_wait_s``;
TRL collates in the step), and the process's peak RSS. Sides alternate over rounds; medians are printed.

    python scripts/bench/vlm_trl.py --rounds 3
    python scripts/bench/vlm_trl.py --rounds 3 --precision bf16 --steps 30 --micro 8 --global-batch 16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchlib import DATA, REPO, alternating

SIDES = ("llmtrain", "trl")


def overrides(opts: argparse.Namespace, run_dir: str) -> list[str]:
    """llmtrain's side of the job (TRL gets the same settings from the composed config)."""
    return [f"model={opts.model}", "data=vlm_chat", f"data.path={Path(opts.data) / 'train.jsonl'}",
            "data.shuffle=false", f"trainer.max_steps={opts.steps}", f"trainer.micro_batch_size={opts.micro}",
            f"trainer.global_batch_size={opts.global_batch}", f"trainer.precision={opts.precision}",
            "trainer.lr=3e-3", "trainer.warmup_steps=0", "trainer.min_lr_ratio=1.0", "trainer.weight_decay=0.0",
            "trainer.grad_clip=1.0", "tracker=none", "trainer.progress_bar=false", "trainer.eval_every=0",
            "trainer.log_every=1000", "trainer.save_every_minutes=0", "trainer.export_hf=false",
            *opts.llmtrain, f"run_dir={run_dir}"]


class Stopwatch:
    """Wall seconds spent inside the wrapped calls (any thread), from step ``warmup`` on."""

    def __init__(self):
        self.seconds, self.on = 0.0, False
        self.lock = threading.Lock()

    def wrap(self, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.on:
                    with self.lock:
                        self.seconds += time.perf_counter() - started
        return timed


def run_llmtrain(opts: argparse.Namespace, run_dir: str) -> dict:
    from peers import train_with_step_clock

    from llmtrain.config.compose import compose
    from llmtrain.data import prefetch, vision

    watch = Stopwatch()
    vision.image_tensors = watch.wrap(vision.image_tensors)  # what ImageCollator calls per micro-batch
    waited = [0.0]
    take_wait = prefetch.Feed.take_wait

    def summed(feed):  # each step's wait for its micro-batches (time/data_wait_s), inside the window
        seconds = take_wait(feed)
        waited[0] += seconds if watch.on else 0.0
        return seconds

    prefetch.Feed.take_wait = summed
    cfg = compose(overrides(opts, run_dir))
    _, starts = train_with_step_clock(cfg, lambda i: setattr(watch, "on", watch.on or i >= opts.warmup))
    return {"starts": starts, "image_s": watch.seconds, "data_wait_s": waited[0]}


def run_trl(opts: argparse.Namespace, run_dir: str) -> dict:
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    sys.path.insert(0, str(REPO / "tests"))
    from test_vision_trl import training_template

    from llmtrain.common.images import processor_of
    from llmtrain.config.compose import compose
    from llmtrain.data import _split
    from llmtrain.models.build import build_model, build_tokenizer

    cfg = compose(overrides(opts, run_dir))
    t = cfg.trainer
    processor = processor_of(build_tokenizer(cfg.model))
    path = Path(cfg.data.path)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    train_idx, _ = _split(len(records), cfg.data.val_fraction, t.seed)
    rows = [records[train_idx[k]] for k in range(opts.steps * opts.global_batch)]
    rows = [{"messages": r["messages"], "images": [str(path.parent / p) for p in r["images"]]} for r in rows]
    dataset = datasets.Dataset.from_list(rows).cast_column("images", datasets.Sequence(datasets.Image()))
    template = Path(run_dir) / "training.jinja"
    template.write_text(training_template(processor))

    watch = Stopwatch()
    datasets.Image.decode_example = watch.wrap(datasets.Image.decode_example)
    processor.image_processor.__class__.__call__ = watch.wrap(processor.image_processor.__class__.__call__)
    starts: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            watch.on = watch.on or len(starts) >= opts.warmup
            starts.append((time.perf_counter(), time.process_time()))

    args = SFTConfig(output_dir=run_dir, max_steps=opts.steps, per_device_train_batch_size=opts.micro,
                     gradient_accumulation_steps=opts.global_batch // opts.micro, learning_rate=t.lr,
                     lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, adam_beta1=t.beta1,
                     adam_beta2=t.beta2, adam_epsilon=t.eps, logging_strategy="no", save_strategy="no", report_to=[],
                     use_cpu=not torch.cuda.is_available(), seed=t.seed, disable_tqdm=True,
                     train_sampling_strategy="sequential", gradient_checkpointing=False, max_length=None,
                     bf16=opts.precision == "bf16", assistant_only_loss=True, chat_template_path=str(template))
    SFTTrainer(model=build_model(cfg.model, t.seed), args=args, train_dataset=dataset, processing_class=processor,
               callbacks=[Clock()]).train()
    return {"starts": starts, "image_s": watch.seconds, "data_wait_s": None}


def sample_counts(opts: argparse.Namespace) -> tuple[int, int]:
    """(images, real tokens) of the samples in the timed steps (the same records on both sides)."""
    from llmtrain import data
    from llmtrain.config.compose import compose
    from llmtrain.models.build import build_tokenizer

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = compose(overrides(opts, run_dir))
    splits = data.load_splits(cfg.data, build_tokenizer(cfg.model), cfg.trainer.seed)
    order = splits.order(cfg.trainer.seed, False)
    timed = [splits.train[order[i]] for i in range(opts.warmup * opts.global_batch, (opts.steps - 1) * opts.global_batch)]
    return sum(len(s["images"]) for s in timed), sum(len(s["input_ids"]) for s in timed)


def child(side: str, opts: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as run_dir:
        got = (run_llmtrain if side == "llmtrain" else run_trl)(opts, run_dir)
    (w0, c0), (w1, c1) = got["starts"][opts.warmup], got["starts"][-1]
    print("RESULT " + json.dumps({"wall_s": w1 - w0, "cpu_s": c1 - c0, "image_s": got["image_s"],
                                  "data_wait_s": got["data_wait_s"],
                                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)


def launch(side: str, opts: argparse.Namespace) -> dict:
    passed = ["--child", side, "--model", opts.model, "--data", str(opts.data), "--steps", str(opts.steps),
              "--warmup", str(opts.warmup), "--micro", str(opts.micro), "--global-batch", str(opts.global_batch),
              "--precision", opts.precision] + [f"--llmtrain={o}" for o in opts.llmtrain]
    env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, __file__, *passed], capture_output=True, text=True, cwd=REPO, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{side} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny_idefics3")
    parser.add_argument("--data", type=Path, default=DATA / "digits", help="a digits folder (scripts/make_digits.py)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the measurement")
    parser.add_argument("--micro", type=int, default=8, help="micro-batch (both sides)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--precision", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--llmtrain", action="append", default=[], metavar="OVERRIDE",
                        help="an extra llmtrain override (repeatable), e.g. --llmtrain=data.prefetch=0")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        opts.precision = opts.precision[0]
        return child(opts.child, opts)
    precisions = opts.precision
    opts.precision = precisions[0]
    images, tokens = sample_counts(opts)
    print(f"{opts.model} on {opts.data}: micro-batch {opts.micro}, global batch {opts.global_batch}, {opts.steps} steps "
          f"timed from step {opts.warmup} ({images} images, {tokens} tokens), {opts.rounds} alternating rounds, medians")
    print(f"{'precision':9s} {'side':8s} {'images/s':>9s} {'tokens/s':>9s} {'img/CPU-s':>9s} {'tok/CPU-s':>9s} "
          f"{'image prep':>10s} {'data wait':>9s} {'peak RSS MiB':>12s}")
    for precision in precisions:
        opts.precision = precision
        got: dict[str, list[dict]] = {side: [] for side in SIDES}
        for r in range(opts.rounds):
            for side in alternating(SIDES, r):
                got[side].append(launch(side, opts))
        med = {side: {k: statistics.median(x[k] for x in runs) for k in ("wall_s", "cpu_s", "image_s", "peak_rss_mib")}
               for side, runs in got.items()}
        for side in SIDES:
            m, waits = med[side], [x["data_wait_s"] for x in got[side] if x["data_wait_s"] is not None]
            wait = f"{statistics.median(waits) / m['wall_s']:.1%}" if waits else "-"
            print(f"{precision:9s} {side:8s} {images / m['wall_s']:9.1f} {tokens / m['wall_s']:9.0f} "
                  f"{images / m['cpu_s']:9.1f} {tokens / m['cpu_s']:9.0f} {m['image_s'] / m['wall_s']:10.1%} "
                  f"{wait:>9s} {m['peak_rss_mib']:12.0f}", flush=True)
        ours, theirs = med["llmtrain"], med["trl"]
        print(f"{precision}: llmtrain / TRL throughput, wall {theirs['wall_s'] / ours['wall_s']:.2f}, CPU "
              f"{theirs['cpu_s'] / ours['cpu_s']:.2f}; peak RSS {ours['peak_rss_mib'] / theirs['peak_rss_mib']:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
