#!/usr/bin/env python
"""The first benchmark to run on a GPU machine: one line per configuration with tokens/s per GPU,
MFU, peak memory against the memory planner's estimate, and the steps measured, within 8 minutes
on one H200. No network: models are built from config with random weights (``model.source=config``)
and read the Python standard library's source files (``data=stdlib``).

    bash scripts/bench/gpu.sh                     # 1 GPU, the whole table (--budget-s 450: under 8 min)
    bash scripts/bench/gpu.sh --nproc 8           # 8 GPUs of one node (torchrun): ring/Ulysses cp run too
    bash scripts/bench/gpu.sh --dry-run           # the same code path on CPU, tiny shapes
    python scripts/bench/gpu.py --list            # the configurations
    python scripts/bench/gpu.py --only 1b-fsdp,8b-fsdp --steps 20

Configurations: a Llama-3.2-1B shape (hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 KV
heads, vocabulary 128256, tied embeddings; 1.24 B parameters) at 4096 tokens a row, micro-batch 4,
on FSDP2 (``+recipe=fsdp``) and DeepSpeed ZeRO-3 (``+recipe=zero3``), with ``recipe.compile`` on
and off and with ``recipe.fp8=true``; a Llama-3-8B shape (hidden 4096, intermediate 14336, 32/8
heads, vocabulary 128256) at 4096 tokens, micro-batch 1, activation checkpointing, with as many
of its 32 layers (stepping down by 2) as the planner fits on both recipes within the device's
memory less ``recipe.memory_margin`` (AdamW keeps 16 bytes a parameter on FSDP2 and 18 on ZeRO-3:
all 32 layers plan at 129 and 144 GiB on one GPU, so the line says how many layers ran and why);
and the 1B shape at 32768 tokens a row (activation checkpointing, the loss 4096 tokens at a
time): one row per GPU, and with ``--nproc`` >= 2 each row split over every GPU by ring and by
Ulysses context parallelism (on 1 GPU they print why they do not run).

Every configuration runs in one worker process (under torchrun for ``--nproc`` > 1) that calls
llmtrain's own ``Trainer`` in-process one configuration after another, as ``tests/scenarios.py``
does, so start-up is paid once. The worker reports each configuration to ``OUT/progress.jsonl``;
this process prints the lines, and kills and restarts the worker (with the configurations not yet
run) when one configuration passes its timeout or the worker dies, so one hang or crash costs one
line. A configuration llmtrain refuses before start-up (FP8 without float8 matmuls: its own
checks and messages) or that needs more processes is printed as
``skipped`` with the reason; one that fails as ``error`` with its exception in one line. Nothing
is checkpointed (the benchmark drops the final save: Llama-3-8B's would be ~100 GB) or exported.

Columns: tokens/s/GPU and MFU are medians of ``train/tokens_per_s`` (over the world size) and
``perf/mfu`` from the run's ``metrics.jsonl`` over the steps after ``--warmup`` (compilation and
allocator warm-up fall in those); ``peak`` is ``memory/peak_bytes`` (CUDA's allocator peak of
the busiest rank; on CPU the process's peak RSS, which includes the interpreter and every earlier
configuration of the process: not comparable with the plan); ``plan`` is
``llmtrain.planning.memory.plan_recipe``'s per-rank total for that configuration and ``peak/plan``
their ratio; ``steps`` is measured/run; ``wall`` is the configuration's seconds including its
checks, plans and start-up. ``OUT/results.json`` has every row (and each configuration's CPU
seconds), ``OUT/worker*.log`` llmtrain's own log lines.

``--dry-run`` (alias ``--cpu-dry``) runs exactly this on CPU with tiny shapes (hidden 64, 2-4
layers, 64-token rows, 128 for the long ones, 2 steps) and gloo: the configurations the CPU cannot
run (FP8, and ``compile`` unless ``--dry-compile``) print their skip reason from the same checks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30


@dataclass(frozen=True)
class Shape:
    """A Llama architecture (``model.architecture.*`` of ``model=llama3_8b``, which it overrides)."""

    label: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool

    def overrides(self, layers: int | None = None) -> list[str]:
        a = "model.architecture."
        return ["model=llama3_8b", f"{a}hidden_size={self.hidden}", f"{a}intermediate_size={self.intermediate}",
                f"{a}num_hidden_layers={layers or self.layers}", f"{a}num_attention_heads={self.heads}",
                f"{a}num_key_value_heads={self.kv_heads}", f"{a}vocab_size={self.vocab}",
                f"{a}tie_word_embeddings={str(self.tied).lower()}"]


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the real run and the dry run, besides device and backend."""

    shapes: dict[str, Shape]
    seq: int  # tokens a row, the 1B and 8B throughput configurations
    long_seq: int  # tokens a row, the long-context configurations (32k on GPUs)
    micro: dict[str, int]  # micro-batch per shape
    loss_chunk: int  # trainer.loss_chunk_tokens of the long-context configurations
    max_bytes: int  # data.max_bytes of the stdlib corpus (epochs wrap around when it is short)
    steps: int
    warmup: int
    timeout_s: dict[str, float]  # per shape; the long-context ones use "long", the compiled ones "compile"


# Llama-3.2-1B (Meta, 2024): 1.24 B parameters with the tied 128256 x 2048 embedding.
# Llama-3-8B (Meta, 2024): 8.03 B parameters (conf/model/llama3_8b.yaml).
REAL = Sizes(shapes={"1b": Shape("Llama-3.2-1B shape", 2048, 8192, 16, 32, 8, 128256, True),
                     "8b": Shape("Llama-3-8B shape", 4096, 14336, 32, 32, 8, 128256, False)},
             seq=4096, long_seq=32768, micro={"1b": 4, "8b": 1}, loss_chunk=4096, max_bytes=2_000_000,
             steps=12, warmup=4, timeout_s={"1b": 90, "8b": 150, "long": 90, "compile": 150})
DRY = Sizes(shapes={"1b": Shape("tiny 1B stand-in", 64, 176, 2, 4, 2, 320, True),
                    "8b": Shape("tiny 8B stand-in", 64, 224, 4, 4, 2, 320, False)},
            seq=64, long_seq=128, micro={"1b": 2, "8b": 1}, loss_chunk=32, max_bytes=100_000,
            steps=2, warmup=1, timeout_s={"1b": 60, "8b": 60, "long": 60, "compile": 60})


@dataclass(frozen=True)
class Bench:
    """One configuration (one output line)."""

    name: str
    shape: str  # key of Sizes.shapes
    recipe: str  # recipes/NAME.yaml
    long: bool = False  # Sizes.long_seq rows instead of Sizes.seq
    compile: bool = False
    fp8: bool = False
    cp_style: str | None = None  # context parallel over every process ("ring" / "ulysses")
    checkpointing: bool = False
    # Fit the depth to the device: the most layers (stepping down by 2 from the shape's) with which
    # every recipe named here fits, so the lines of one shape compare at the same depth.
    fit_recipes: tuple[str, ...] = ()
    what: str = ""


# In the order they run: what a budget cut leaves out is at the end. The 1B lines first, so eager,
# compiled and FP8 compare at one shape.
BENCHES = [
    Bench("1b-fsdp", "1b", "fsdp", what="FSDP2, bf16, eager"),
    Bench("1b-zero3", "1b", "zero3", what="DeepSpeed ZeRO-3, bf16"),
    Bench("1b-zero3-compile", "1b", "zero3", compile=True, what="DeepSpeed ZeRO-3, bf16, torch.compile per layer"),
    Bench("1b-fsdp-compile", "1b", "fsdp", compile=True, what="FSDP2, bf16, torch.compile per layer"),
    Bench("1b-fsdp-fp8-compile", "1b", "fsdp", compile=True, fp8=True,
          what="FSDP2, float8 Linear layers (torchao, tensorwise), compiled"),
    Bench("8b-fsdp", "8b", "fsdp", checkpointing=True, fit_recipes=("fsdp", "zero3"),
          what="FSDP2, bf16, activation checkpointing, the depth the planner fits"),
    Bench("8b-zero3", "8b", "zero3", checkpointing=True, fit_recipes=("fsdp", "zero3"),
          what="ZeRO-3, bf16, activation checkpointing, the depth the planner fits"),
    Bench("1b-32k-fsdp", "1b", "fsdp", long=True, checkpointing=True,
          what="32k-token rows, one row per GPU, chunked loss"),
    Bench("1b-32k-cp-ring", "1b", "fsdp", long=True, checkpointing=True, cp_style="ring",
          what="32k-token rows split over every GPU, ring attention"),
    Bench("1b-32k-cp-ulysses", "1b", "fsdp", long=True, checkpointing=True, cp_style="ulysses",
          what="32k-token rows split over every GPU, Ulysses all-to-all"),
]


def overrides_for(bench: Bench, sizes: Sizes, nproc: int, run_dir: Path, layers: int | None = None,
                  peak_tflops: float = 0.0) -> list[str]:
    """The ``python -m llmtrain`` overrides of ``bench`` (the real and the dry run differ only in
    ``sizes``)."""
    seq = sizes.long_seq if bench.long else sizes.seq
    cp = nproc if bench.cp_style else 1
    micro = 1 if bench.long else sizes.micro[bench.shape]
    dp = nproc // cp
    out = sizes.shapes[bench.shape].overrides(layers) + [
        # val_fraction 0.2: 2 MB of 32k-token rows leave 12 held-out rows, one a rank for the evaluations the
        # trainer always runs (at step 0 and the last) on up to 8 data-parallel ranks
        f"+recipe={bench.recipe}", "data=stdlib", f"data.seq_len={seq}", f"data.max_bytes={sizes.max_bytes}",
        "data.val_fraction=0.2",
        f"model.architecture.max_position_embeddings={seq}",
        "trainer.precision=bf16", f"trainer.micro_batch_size={micro}", f"trainer.global_batch_size={micro * dp}",
        f"trainer.max_steps={sizes.steps}", "trainer.warmup_steps=1", "trainer.eval_every=0", f"trainer.eval_samples={micro * dp}",
        "trainer.save_every=0", "trainer.save_every_minutes=0", "trainer.export_hf=false", "trainer.resume=never",
        "trainer.progress_bar=false", "tracker=none", "tracker.report=false",
        f"trainer.activation_checkpointing={str(bench.checkpointing).lower()}", f"run_dir={run_dir}"]
    if bench.long:
        out.append(f"trainer.loss_chunk_tokens={sizes.loss_chunk}")
    if bench.compile:
        out.append("recipe.compile=true")
    if bench.fp8:
        out.append("recipe.fp8=true")
    if bench.cp_style:
        out += [f"recipe.cp={cp}", f"recipe.cp_style={bench.cp_style}"]
    if peak_tflops > 0:
        out.append(f"trainer.peak_tflops={peak_tflops}")
    return out


# ---- the worker: every configuration in one process (group) ----------------------------------------


def plan_bytes(overrides: list[str], world_size: int) -> int:
    """The planner's per-rank device bytes for ``overrides`` on ``world_size`` ranks.

    Raises:
        llmtrain.common.errors.ConfigError: the planner finds the layout invalid (its reason).
    """
    from llmtrain.common.errors import ConfigError
    from llmtrain.config.compose import compose
    from llmtrain.planning.memory import plan_recipe

    plan = plan_recipe(compose(overrides), world_size)
    if plan.error:
        raise ConfigError(f"the planner: {plan.error}")
    return plan.total


def fit_layers(bench: Bench, sizes: Sizes, nproc: int, run_dir: Path, budget: int,
               plan=plan_bytes) -> tuple[int | None, str]:
    """The most layers of ``bench``'s shape, from the shape's own down in steps of 2, with which
    every recipe of ``bench.fit_recipes`` plans within ``budget`` bytes a rank; (None, why) when
    not even 2 layers fit. ``plan``: ``(overrides, world_size) -> bytes`` (the planner).

    Returns:
        (layers, a note naming the planner's figures at the full depth when layers were dropped).
    """
    full = sizes.shapes[bench.shape].layers
    first_need = None
    for layers in range(full, 1, -2):
        needs = {recipe: plan(overrides_for(Bench(bench.name, bench.shape, recipe, bench.long, bench.compile,
                                                  bench.fp8, bench.cp_style, bench.checkpointing),
                                            sizes, nproc, run_dir, layers), nproc)
                 for recipe in bench.fit_recipes}
        first_need = first_need or needs
        if max(needs.values()) <= budget:
            if layers == full:
                return layers, ""
            return layers, (f"{layers} of {full} layers: the planner puts all {full} at "
                            + ", ".join(f"{r} {_fmt_bytes(n)}" for r, n in first_need.items())
                            + f" > {_fmt_bytes(budget)} a rank")
    return None, (f"not even 2 layers fit {_fmt_bytes(budget)} a rank (the planner, {full} layers: "
                  + ", ".join(f"{r} {_fmt_bytes(n)}" for r, n in (first_need or {}).items()) + ")")


def _emit(progress: Path, record: dict) -> None:
    with open(progress, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def measure(run_dir: Path, warmup: int, world_size: int) -> dict:
    """tokens/s/GPU, MFU (None without a known peak), peak bytes and steps from ``run_dir``'s
    ``metrics.jsonl``: medians over the steps after ``warmup`` (all steps when there are no more)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "train/step_time_s" in r]
    if not steps:
        raise RuntimeError(f"no training steps in {run_dir / 'metrics.jsonl'}")
    timed = steps[warmup:] or steps
    mfu = [r["perf/mfu"] for r in timed if "perf/mfu" in r]
    return {"tokens_per_s_gpu": statistics.median(r["train/tokens_per_s"] for r in timed) / world_size,
            "mfu": statistics.median(mfu) if mfu else None,
            "peak_bytes": max(r["memory/peak_bytes"] for r in steps),
            "steps_measured": len(timed), "steps_run": len(steps)}


CP_ON_ONE = ("context parallel splits each row over the processes: 1 process has nothing to split (run with "
             "--nproc 2 or more); 1b-32k-fsdp is the single-device 32k run")
COMPILE_ON_CPU = ("recipe.compile on CPU builds C++ kernels with inductor (tens of seconds on 2 cores until its "
                  "cache is warm): the dry run skips it unless --dry-compile")


_FITTED: dict[tuple[str, ...], tuple[int | None, str]] = {}


def run_bench(bench: Bench, sizes: Sizes, spec: dict, device_budget: int) -> dict:
    """Run ``bench`` in this process (every rank) and return its row (rank 0's is the one written)."""
    import torch

    from llmtrain.common.errors import LlmtrainError
    from llmtrain.config.compose import compose
    from llmtrain.planning.preflight import validate_and_preflight

    nproc, out = spec["nproc"], Path(spec["out"])
    run_dir = out / bench.name
    row: dict = {"name": bench.name, "status": "ok", "note": ""}
    started, cpu = time.perf_counter(), time.process_time()
    if bench.cp_style and nproc < 2:  # before llmtrain's checks, which would only say the degrees do not divide
        return {**row, "status": "skipped", "note": CP_ON_ONE}
    layers = None
    if bench.fit_recipes:
        if bench.fit_recipes not in _FITTED:  # the lines of one group plan once (~3 s a plan at 8B)
            _FITTED[bench.fit_recipes] = fit_layers(bench, sizes, nproc, run_dir, device_budget)
        layers, note = _FITTED[bench.fit_recipes]
        if layers is None:
            return {**row, "status": "skipped", "note": note}
        row["note"] = note
        row["layers"] = layers
    overrides = overrides_for(bench, sizes, nproc, run_dir, layers, spec["peak_tflops"])
    try:
        validate_and_preflight(compose(overrides), nproc)
    except LlmtrainError as err:  # refused before start-up: the same check and message a run gives
        return {**row, "status": "skipped", "note": f"llmtrain refuses it: {_one_line(err).split(': ', 1)[1]}"}
    if bench.compile and spec["device"] == "cpu" and not spec["dry_compile"]:
        return {**row, "status": "skipped", "note": COMPILE_ON_CPU}
    try:
        row["plan_bytes"] = plan_bytes(overrides, nproc)
        if row["plan_bytes"] > device_budget and not bench.checkpointing:  # e.g. the 1B lines on an 80 GB GPU
            without = row["plan_bytes"]
            overrides = [o.replace("activation_checkpointing=false", "activation_checkpointing=true") for o in overrides]
            row["plan_bytes"] = plan_bytes(overrides, nproc)
            row["note"] = (row["note"] + "; " if row["note"] else "") + (
                f"activation checkpointing: the planner puts it at {_fmt_bytes(without)} without, over "
                f"{_fmt_bytes(device_budget)}" + ("" if row["plan_bytes"] <= device_budget
                                                  else f", and {_fmt_bytes(row['plan_bytes'])} with it"))
    except Exception as err:  # noqa: BLE001  (a configuration the planner cannot model still trains)
        row["note"] = (row["note"] + "; " if row["note"] else "") + f"no plan: {_one_line(err)}"
    row["before_train_s"] = time.perf_counter() - started  # checks and plans (diagnostics in results.json)
    try:
        _train(compose(overrides))
        row.update(measure(run_dir, sizes.warmup, nproc))
    except Exception as err:  # noqa: BLE001  (one failing configuration is one line; the rest go on)
        row.update(status="error", note=_one_line(err))
    finally:
        import gc

        if bench.compile:
            torch._dynamo.reset()
        _release_deepspeed_globals()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()  # the trainer reads the allocator's peak: per configuration
            row["left_allocated_bytes"] = torch.cuda.memory_allocated()
            if row["left_allocated_bytes"] > device_budget // 100:  # the next configurations would plan wrong
                row["note"] = (row["note"] + "; " if row["note"] else "") + (
                    f"{_fmt_bytes(row['left_allocated_bytes'])} still allocated after it (later lines have less memory)")
    row["wall_s"], row["cpu_s"] = time.perf_counter() - started, time.process_time() - cpu
    return row


def _release_deepspeed_globals() -> None:
    """Drop what DeepSpeed (0.19) keeps of a finished ZeRO-3 model after ``engine.destroy()``: the
    root module stays on ``parameter_offload.FWD_MODULE_STACK`` and, with every submodule, in the
    class-level ``lru_cache`` of ``PartitionedParameterCoordinator.__params_to_release``, which
    would hold its parameters and optimizer state (22 GB for the 1B shape) on the GPU through
    every later configuration of this process."""
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None:
        offload.FWD_MODULE_STACK.clear()
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    if coordinator is not None:
        method = getattr(coordinator.PartitionedParameterCoordinator,
                         "_PartitionedParameterCoordinator__params_to_release", None)
        # instrument_w_nvtx wraps the lru_cache without functools.wraps: it is in the closure
        for cell in getattr(method, "__closure__", None) or ():
            if hasattr(cell.cell_contents, "cache_clear"):
                cell.cell_contents.cache_clear()


def _train(cfg) -> None:
    """``llmtrain.trainer.train(cfg)`` without the final checkpoint: the trainer always saves at
    ``trainer.max_steps``, which for the 8B shape is ~100 GB of disk and minutes of the budget, and
    a benchmark has nothing to resume."""
    from llmtrain.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.checkpointer.should_save = lambda step, result: False
    try:
        trainer.train()
    finally:
        trainer.watchdog.stop()
        trainer.close_sampler()


def worker(spec_file: str) -> int:
    """Run the configurations of ``spec_file`` (see :func:`main`) in order, rank 0 appending a
    ``start`` record and then the row of each to the spec's ``progress.jsonl``."""
    spec = json.loads(Path(spec_file).read_text())
    import logging

    import torch

    from llmtrain.parallel.distributed import shutdown

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rank = int(os.environ.get("RANK", "0"))
    progress = Path(spec["out"]) / "progress.jsonl"
    sizes = replace(DRY if spec["dry"] else REAL, steps=spec["steps"], warmup=spec["warmup"])
    if not spec["dry"] and not torch.cuda.is_available():
        if rank == 0:
            _emit(progress, {"fatal": "no CUDA device here: run the dry mode (--dry-run) on CPU"})
        return 2
    if spec["device_memory"]:
        total = spec["device_memory"]
    elif torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // spec["nproc"]
    from llmtrain.config.schema import RecipeConfig

    budget = int(total * (1 - RecipeConfig.memory_margin))  # +recipe=auto's rule
    if rank == 0:
        _emit(progress, {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                         "device_bytes": total, "budget_bytes": budget})
    by_name = {b.name: b for b in BENCHES}
    for name in spec["todo"]:
        if rank == 0:
            _emit(progress, {"start": name, "t": time.time()})
        row = run_bench(by_name[name], sizes, spec, budget)
        if rank == 0:
            _emit(progress, row)
    shutdown()
    return 0


# ---- the parent: launch, watch, print -------------------------------------------------------------


@dataclass
class Watch:
    """What the parent has read of ``progress.jsonl`` so far."""

    offset: int = 0
    rows: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    current: str | None = None
    current_since: float = 0.0


def _read_progress(path: Path, watch: Watch) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, encoding="utf-8") as f:
        f.seek(watch.offset)
        chunk = f.read()
    complete = chunk[:chunk.rfind("\n") + 1]
    watch.offset += len(complete.encode())
    new = []
    for line in complete.splitlines():
        record = json.loads(line)
        if "start" in record:
            watch.current, watch.current_since = record["start"], time.monotonic()
        elif "name" in record:
            watch.rows[record["name"]] = record
            watch.current = None
            new.append(record)
        else:
            watch.info.update(record)
    return new


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


HEADER = (f"{'configuration':<20} {'tokens/s/GPU':>12} {'MFU':>6} {'peak':>11} {'plan':>11} {'peak/plan':>9} "
          f"{'steps':>6} {'wall':>5}  note")


def format_row(row: dict) -> str:
    """One output line: the numbers of a configuration that ran, else ``skipped: why`` / ``error: what``."""
    name = row["name"]
    if row["status"] != "ok":
        return f"{name:<20} {row['status']}: {row['note']}"
    plan, peak = row.get("plan_bytes"), row.get("peak_bytes")
    ratio = f"{peak / plan:.2f}" if plan and peak else "-"
    mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "n/a"
    return (f"{name:<20} {row['tokens_per_s_gpu']:>12,.0f} {mfu:>6} {_fmt_bytes(peak):>11} {_fmt_bytes(plan):>11} "
            f"{ratio:>9} {row['steps_measured']:>2}/{row['steps_run']:<3} {row['wall_s']:>4.0f}s  {row['note']}".rstrip())


def _launch(spec_file: Path, nproc: int, dry: bool, log) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if dry:  # the same code on CPU even on a GPU machine
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    me = [str(Path(__file__).resolve()), "--worker", str(spec_file)]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *me]
           if nproc > 1 else [sys.executable, *me])
    # A session of its own: a timeout ends the worker and every process it started, nothing else.
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def _op_build_hint(log_path: Path) -> str:
    """What to do when the killed worker was building DeepSpeed's ops: torch's extension builder
    leaves its ``lock`` file behind, and every later run waits on it for ever."""
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    phases = [line for line in text.splitlines() if "llmtrain start-up:" in line]  # the last is where it stopped
    found = re.search(r"compiled ops cached in (\S+?);.*compiles them", phases[-1]) if phases else None
    return (f"; it was building DeepSpeed's ops: delete the stale 'lock' files under {found.group(1)} before the "
            "next run" if found else "")


def _tail(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.is_file() else []
    return " ".join(lines[-1].split())[:200] if lines else "(no output)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", "--cpu-dry", dest="dry", action="store_true",
                        help="the same code path on CPU with tiny shapes and gloo (well under a minute)")
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) on this node; >1 runs under torchrun")
    parser.add_argument("--only", default="", help="comma-separated configuration names (default: all; --list)")
    parser.add_argument("--list", action="store_true", help="print the configurations and exit")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per configuration (12; dry 3)")
    parser.add_argument("--warmup", type=int, default=None, help="first steps left out of the medians (4; dry 1)")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="seconds for the whole table; configurations not started by then are listed as not run")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="seconds per configuration, start-up included (default: 90 for 1B and 32k, 150 for 8B and "
                             "the compiled ones; dry 60)")
    parser.add_argument("--device-memory", default=None,
                        help="bytes per device to plan the 8B depth against (e.g. 80GiB; default: the GPU's, "
                             "on CPU the host's over --nproc)")
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="trainer.peak_tflops for MFU (0: llmtrain's table by GPU name; CPUs have no entry)")
    parser.add_argument("--dry-compile", action="store_true", help="dry run: run the compile configurations too")
    parser.add_argument("--out", default=None, help="folder of the run directories (default runs/gpu_bench/<time>)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    base = DRY if args.dry else REAL
    sizes = replace(base, steps=args.steps or base.steps, warmup=base.warmup if args.warmup is None else args.warmup)
    if args.list:
        for b in BENCHES:
            print(f"{b.name:<20} {sizes.shapes[b.shape].label}, {b.what}")
        return 0
    names = [b.name for b in BENCHES]
    todo = [n for n in args.only.split(",") if n] if args.only else names
    unknown = [n for n in todo if n not in names]
    if unknown:
        print(f"gpu.py: error: --only {','.join(unknown)}: not a configuration (--list: {', '.join(names)})",
              file=sys.stderr)
        return 2
    if args.nproc < 1 or sizes.steps <= sizes.warmup:
        print("gpu.py: error: --nproc must be >= 1 and --steps larger than --warmup", file=sys.stderr)
        return 2
    device_memory = None
    if args.device_memory:
        sys.path.insert(0, str(REPO))
        from llmtrain.config.validate import parse_bytes

        device_memory = parse_bytes(args.device_memory, "--device-memory")
    out = Path(args.out or REPO / "runs" / "gpu_bench" / time.strftime("%Y%m%d-%H%M%S")).absolute()
    out.mkdir(parents=True, exist_ok=True)
    by_name = {b.name: b for b in BENCHES}
    timeout = {n: args.timeout_s or sizes.timeout_s["compile" if by_name[n].compile else "long" if by_name[n].long
                                                     else by_name[n].shape] for n in todo}

    started = time.monotonic()
    print(f"GPU benchmark{' (dry run: CPU, tiny shapes, gloo)' if args.dry else ''}: {args.nproc} process(es), "
          f"{sizes.steps} steps a configuration, medians over the steps after {sizes.warmup}; runs in {out}")
    for key, shape in sizes.shapes.items():
        print(f"  {key}: {shape.label}: hidden {shape.hidden}, intermediate {shape.intermediate}, {shape.layers} layers, "
              f"{shape.heads}/{shape.kv_heads} heads, vocabulary {shape.vocab}, micro-batch {sizes.micro[key]} x "
              f"{sizes.seq} tokens; long-context rows {sizes.long_seq} tokens")
    watch, attempt, header = Watch(), 0, [HEADER]
    if args.dry:
        header.append("(CPU: peak is the process's peak RSS, interpreter and earlier configurations included; "
                      "peak/plan means something on GPUs only)")
    remaining = list(todo)

    def show(row: dict) -> None:
        """Print ``row`` (the table's header first) and count its configuration done."""
        if row["name"] not in remaining:  # its row came in after the configuration was killed as timed out
            return
        while header:
            print(header.pop(0), flush=True)
        print(format_row(row), flush=True)
        watch.rows[row["name"]] = row
        remaining.remove(row["name"])

    while remaining and time.monotonic() - started < args.budget_s:
        attempt += 1
        spec_file = out / f"spec{attempt}.json"
        spec_file.write_text(json.dumps({"todo": remaining, "nproc": args.nproc, "out": str(out), "dry": args.dry,
                                         "device": "cpu" if args.dry else "cuda", "dry_compile": args.dry_compile,
                                         "device_memory": device_memory, "peak_tflops": args.peak_tflops,
                                         "steps": sizes.steps, "warmup": sizes.warmup}))
        log_path = out / f"worker{attempt}.log"
        with open(log_path, "w") as log:
            proc, before = _launch(spec_file, args.nproc, args.dry, log), len(remaining)
            while True:
                for row in _read_progress(out / "progress.jsonl", watch):
                    show(row)
                if "fatal" in watch.info:
                    _stop(proc)
                    print(f"gpu.py: error: {watch.info['fatal']}", file=sys.stderr)
                    return 2
                if "device" in watch.info and "printed_device" not in watch.info:
                    watch.info["printed_device"] = True
                    print(f"device: {watch.info['device']}, {_fmt_bytes(watch.info['device_bytes'])}; plans must fit "
                          f"{_fmt_bytes(watch.info['budget_bytes'])} a rank (less recipe.memory_margin 0.1)", flush=True)
                now = time.monotonic()
                over_budget = now - started > args.budget_s
                current = watch.current
                if current and (now - watch.current_since > timeout[current] or over_budget):
                    _stop(proc)
                    why = (f"timeout: passed {timeout[current]:.0f} s" if not over_budget
                           else f"timeout: the {args.budget_s:.0f} s budget ran out")
                    watch.current = None
                    show({"name": current, "status": "error", "note": f"{why} (log: {log_path}){_op_build_hint(log_path)}"})
                    break
                if proc.poll() is not None:
                    for row in _read_progress(out / "progress.jsonl", watch):  # written just before the exit
                        show(row)
                    if watch.current:
                        current, watch.current = watch.current, None
                        show({"name": current, "status": "error",
                              "note": f"the worker exited with status {proc.returncode}: {_tail(log_path)}"})
                    elif len(remaining) == before:  # it ended without starting one: a relaunch would too
                        print(f"gpu.py: error: the worker exited with status {proc.returncode} before starting "
                              f"a configuration: {_tail(log_path)}", file=sys.stderr)
                        return 1
                    break
                if over_budget and not current:  # between configurations when the budget ran out
                    _stop(proc)
                    break
                time.sleep(0.2)
    for name in list(remaining):
        show({"name": name, "status": "skipped",
              "note": CP_ON_ONE if by_name[name].cp_style and args.nproc < 2
              else f"not run: the {args.budget_s:.0f} s budget was spent (--only {name} runs it)"})
    results = [watch.rows[n] for n in todo if n in watch.rows]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"total {time.monotonic() - started:.0f} s; rows in {out / 'results.json'}, logs in {out}/worker*.log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
