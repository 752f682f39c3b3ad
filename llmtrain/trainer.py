"""The training run: a :class:`Trainer` whose ``_setup_*`` methods each build one component, a
:meth:`Trainer.train_step` for one optimizer step, and a :meth:`Trainer.train` loop in which each
component decides its own cadence (checkpointer, evaluator, tracker).

The loss of an optimizer step is the run's objective (:mod:`llmtrain.objectives`) over the whole
global batch: each micro-batch contributes ``sum(loss) / N`` where ``N`` is the objective's
normaliser (target tokens for next-token training) of all micro-batches on all ranks, so
gradient accumulation and data parallelism give exactly the gradient of one big batch, whatever
the padding.

One step, who calls whom: ``Trainer.train_step`` → :func:`forward_backward` (one all-reduce of the
normaliser, ``Engine.accumulate_gradients`` → per micro-batch ``Engine.forward`` → ``Objective.
loss_sums`` → ``Engine.backward``, then one all-reduce of the loss sums and :class:`StepScalars`)
→ ``Engine.step`` (clip, update, schedule) → :class:`StepResult`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import socket
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import OmegaConf

from llmtrain import adapters, checkpoint, console, data, distributed, export, flops, goodput, moe, reference, task_eval
from llmtrain.config import ConfigError, validate
from llmtrain.engine import build_engine
from llmtrain.errors import TrainingStopped
from llmtrain.models import build_model, build_tokenizer, check_sequence_length, model_config
from llmtrain.objectives import Objective, build_objective
from llmtrain.objectives.causal_lm import count_target_tokens, target_tokens, token_cross_entropy_sum  # noqa: F401
from llmtrain.parallel_dims import ParallelDims
from llmtrain.preemption import Preemption
from llmtrain.preflight import preflight
from llmtrain.tracking import Tracker
from llmtrain.watchdog import Watchdog

log = logging.getLogger("llmtrain")


@dataclass
class StepScalars:
    """This rank's values of one optimizer step that ride in the step's one all-reduce after
    backward, beside the loss, so the loop reports them without collectives of its own. After
    the all-reduce (:meth:`from_values`) each field holds the sum over all ranks.

    Attributes:
        sample_digest: order-free fingerprint of the step's samples (:func:`_sample_digest`).
        preempt_requested: 1.0 where a preemption signal arrived (``Preemption.local_flags``).
        save_due: 1.0 where ``trainer.save_every_minutes`` has elapsed.
        background_written: 1.0 where this rank's background checkpoint write is done.
        memory_bytes: one slot per rank, this rank's peak memory (bytes) in its own slot: the
            sum holds every rank's figure, so the maximum and its rank cost no collective.
    """

    sample_digest: float = 0.0
    preempt_requested: float = 0.0
    save_due: float = 0.0
    background_written: float = 0.0
    memory_bytes: list[float] = field(default_factory=list)

    def values(self) -> list[float]:
        """The fields flattened in declaration order (the all-reduce's layout)."""
        return [self.sample_digest, self.preempt_requested, self.save_due, self.background_written,
                *self.memory_bytes]

    @classmethod
    def from_values(cls, values: list[float]) -> "StepScalars":
        """Inverse of :meth:`values`."""
        digest, requested, due, written, *memory = values
        return cls(digest, requested, due, written, list(memory))


@dataclass
class StepSums:
    """What :func:`forward_backward` returns: the step's global mean loss (over the objective's
    normaliser), the tokens of the global batch (prompt tokens included), the objective's metrics
    (means over the same normaliser, keyed ``NAME``) and the world sums of :class:`StepScalars`."""

    loss: float
    tokens: int
    metrics: dict[str, float]
    scalars: StepScalars
    # Mixture-of-experts models: the step's world-summed router counters, float64
    # [L (E + 3) + 1] (Engine.router_counters, already divided by the tensor-parallel degree).
    router: torch.Tensor | None = None


def forward_backward(engine, batches: list[dict[str, torch.Tensor]],
                     local_scalars: Callable[[], StepScalars] | None = None) -> StepSums:
    """Accumulate the gradient of one optimizer step over this rank's micro-batches.

    Each micro-batch's summed loss is divided by the objective's normaliser of the whole global
    batch (all micro-batches, all data-parallel ranks; one all-reduce before backward), so the
    accumulated gradient is that of the global batch's mean loss, independent of how it is split.
    Tensor/pipeline-parallel peers hold the same samples, so world sums are divided by
    ``dims.data_replicas``.

    ``local_scalars``: called after backward, this rank's :class:`StepScalars`; summed over ranks
    in the same all-reduce as the loss, so a step makes two collectives of its own whatever the
    loop reports.
    """
    objective: Objective = engine.objective
    replicas = engine.dims.data_replicas
    device = batches[0]["input_ids"].device
    # Counted on the device (no host sync per micro-batch); the one sync is the normaliser's.
    counts = torch.stack([sum(objective.normaliser(b) for b in batches).to(torch.float64),
                          sum(b["attention_mask"].sum() for b in batches).to(torch.float64)])
    normaliser, tokens = (distributed.all_reduce_sum(counts) / replicas).tolist()
    sums = engine.accumulate_gradients(batches, normaliser)
    scalars = local_scalars() if local_scalars is not None else StepScalars()
    router = engine.router_counters()
    router = router if router is not None else torch.zeros(0, dtype=torch.float64, device=device)
    reduced = distributed.all_reduce_sum(torch.cat([sums.to(torch.float64),
                                                    torch.tensor(scalars.values(), dtype=torch.float64,
                                                                 device=device), router]))
    values = reduced[:len(reduced) - len(router)].tolist()  # the step's one host sync after backward
    loss, *metric_sums = [v / replicas for v in values[:len(sums)]]
    metrics = objective.average(dict(zip(objective.metric_names, metric_sums)), normaliser)
    return StepSums(loss / normaliser, int(tokens), metrics, StepScalars.from_values(values[len(sums):]),
                    reduced[len(reduced) - len(router):].cpu() / engine.dims.tp if len(router) else None)


@dataclass
class StepResult:
    """One optimizer step as :meth:`Trainer.train_step` reports it (global values every rank
    holds). ``spike``: why the loss counts as a spike (:func:`_loss_spike`), else None."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    seconds: float
    metrics: dict[str, float]
    scalars: StepScalars
    stop: bool
    save_by_time: bool
    spike: str | None
    router: torch.Tensor | None = None  # StepSums.router

    @property
    def healthy(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm) and not self.spike


@torch.no_grad()
def evaluate(engine, batches: list[dict], device: torch.device) -> dict[str, float]:
    """Validation loss (the objective's mean over all ranks' batches; for next-token training,
    mean token CE), perplexity = exp(loss), and the objective's metrics as ``val/NAME``.

    Ranks with fewer batches run forwards on a batch without targets, so every rank makes the
    same number of forward passes (ZeRO-3 gathers parameters collectively in each one).
    """
    objective: Objective = engine.objective
    engine.train(False)
    replicas = engine.dims.data_replicas
    most = distributed.all_reduce_max(torch.tensor(len(batches), device=device))
    no_targets = {"input_ids": torch.zeros(1, 2, dtype=torch.long), "attention_mask": torch.ones(1, 2, dtype=torch.long),
                  "labels": torch.full((1, 2), data.IGNORE_INDEX, dtype=torch.long)}
    names = objective.metric_names
    totals = torch.zeros(2 + len(names), dtype=torch.float64, device=device)
    for batch in list(batches) + [objective.prepare(no_targets)] * (int(most) - len(batches)):
        batch = {k: v.to(device) for k, v in batch.items()}
        totals[:-1] += engine.eval_sums(batch)
        totals[-1] += objective.normaliser(batch).double()
    distributed.all_reduce_sum(totals)
    totals /= replicas
    engine.train(True)
    normaliser = totals[-1].clamp(min=1)
    loss = float(totals[0] / normaliser)
    perplexity = {"val/perplexity": math.exp(min(loss, 50.0))} if objective.reports_perplexity else {}
    if objective.counted_unit:
        perplexity[f"val/{objective.counted_unit}"] = int(totals[-1])
    averaged = objective.average({name: float(totals[1 + k]) for k, name in enumerate(names)}, float(normaliser))
    return {"val/loss": loss, **perplexity, **{f"val/{name}": value for name, value in averaged.items()}}


class Evaluator:
    """Held-out evaluation at ``trainer.eval_every`` steps and at the last step; its time is
    added to ``state.eval_s`` (goodput's accounting)."""

    def __init__(self, engine, val_batches: list[dict], device: torch.device, every: int, max_steps: int):
        self.engine, self.val_batches, self.device = engine, val_batches, device
        self.every, self.max_steps = every, max_steps

    def should_run(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.max_steps

    def run(self, state: checkpoint.TrainState) -> dict[str, float]:
        started = time.perf_counter()
        metrics = evaluate(self.engine, self.val_batches, self.device)
        state.eval_s += time.perf_counter() - started
        return metrics


class Checkpointer:
    """The run's checkpoint cadence and bookkeeping around :class:`checkpoint.CheckpointManager`:
    every ``trainer.save_every`` steps, when ``trainer.save_every_minutes`` is due, on
    preemption, and at the last step; background writes sealed once every rank's is done. Every
    tracker is flushed before a checkpoint counts and committed after it (steps up to a counted
    checkpoint are never logged twice across a crash)."""

    def __init__(self, manager: checkpoint.CheckpointManager, engine, tracker: Tracker, preemption: Preemption,
                 cfg: Any, config_yaml: str, world_size: int):
        self.manager, self.engine, self.tracker, self.preemption = manager, engine, tracker, preemption
        self.t, self.config_yaml, self.world_size = cfg.trainer, config_yaml, world_size
        self.latest: str | None = None  # the newest counted checkpoint
        self.stalls_s: list[list[float]] = []  # [step, seconds the loop waited for its save] per save
        self.on_counted: list[Callable[[int, Path], None]] = []  # called (step, folder) once a checkpoint counts
        self.also_due: Callable[[int], bool] = lambda step: False  # other components' checkpoint steps

    def should_save(self, step: int, result: StepResult) -> bool:
        every = self.t.save_every
        return (result.stop or result.save_by_time or bool(every and step % every == 0) or step == self.t.max_steps
                or self.also_due(step))

    def save(self, state: checkpoint.TrainState, background: bool) -> None:
        started = time.perf_counter()
        state.saved_unix = time.time()
        state.tracker_run_id, state.mlflow_run_id = self.tracker.run_id, self.tracker.mlflow_run_id
        state.world_size, state.global_batch_size = self.world_size, self.t.global_batch_size
        self.tracker.flush()  # every step up to this checkpoint is on disk before the checkpoint counts
        written = self.manager.save(self.engine, state, self.config_yaml, self.t.checkpoint_hash, background)
        if written is not None:
            self._commit(written)
        state.parent = f"step_{state.step}"  # the next checkpoint continues this one
        self.preemption.saved()
        stall = time.perf_counter() - started
        self.stalls_s.append([state.step, stall])
        state.checkpoint_s += stall

    def seal_if_written(self, scalars: StepScalars, state: checkpoint.TrainState) -> None:
        """Every rank's background write is done (the step's summed flag): make it count."""
        if scalars.background_written != self.world_size:
            return
        started = time.perf_counter()
        self._commit(self.manager.finish_background())
        sealing = time.perf_counter() - started
        self.stalls_s[-1][1] += sealing
        state.checkpoint_s += sealing

    def finish(self) -> None:
        """Seal a background write still open (defensive: the last save is synchronous)."""
        if sealed := self.manager.finish_background():
            self._commit(sealed)

    def _commit(self, sealed: Path) -> None:
        self.latest = str(sealed)
        self.tracker.commit(checkpoint.step_of(sealed))
        for counted in self.on_counted:
            counted(checkpoint.step_of(sealed), sealed)

    def stall_of_previous_step(self, step: int) -> dict[str, float]:
        """``checkpoint/stall_s`` for the record of the step after a save."""
        if self.stalls_s and self.stalls_s[-1][0] == step:
            return {"checkpoint/stall_s": self.stalls_s[-1][1]}
        return {}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_streams(seed: int, dp_rank: int, pp_rank: int, start_step: int) -> int:
    """Seed this rank's random stream (dropout) for the training loop; returns the stream seed.

    Scheme: one stream per (data-parallel rank, pipeline rank), so data-parallel ranks draw
    different masks for their different samples and each pipeline stage its own (as Megatron-LM
    and torchtitan seed pipeline stages apart; unlike their default, data-parallel ranks differ
    too, because llmtrain's initialisation never draws from this stream: parameters come from
    (seed, parameter name), see :func:`llmtrain.models.init_weights`). Tensor-parallel ranks share
    this stream, so dropout on replicated activations agrees across the TP group; inside
    attention, whose activations are sharded over it, each TP rank draws its own
    (:func:`llmtrain.parallelize.apply_tp_rng`, the role of Megatron-LM's model-parallel RNG
    tracker).
    Exact resume restores each rank's saved state instead; a resume on another world size (whose
    saved states do not map onto the new ranks) reseeds with the resumed step mixed in, so no
    rank replays the masks of step 0. Rank (0, 0) of a fresh run keeps ``seed`` itself, so a
    single process draws exactly what it always did.
    """
    if (dp_rank, pp_rank, start_step) == (0, 0, 0):
        stream = seed
    else:
        stream = distributed.derived_seed(seed, f"dp{dp_rank}", f"pp{pp_rank}", f"step{start_step}")
    seed_everything(stream)
    return stream


def _memory_bytes(device: torch.device) -> int:
    """Peak memory of this process in bytes: CUDA allocator peak, or the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _run_dir(cfg: Any) -> Path:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return Path(HydraConfig.get().runtime.output_dir)  # one folder per sweep job
    return Path(cfg.run_dir)


def _sample_digest(batches: list[dict[str, torch.Tensor]]) -> float:
    """Order-free fingerprint of the samples in ``batches``: sum of CRC32s of their real tokens."""
    return float(sum(zlib.crc32(row[mask.bool()].numpy().tobytes())
                     for b in batches for row, mask in zip(b["input_ids"], b["attention_mask"])))


class StartupPhases:
    """Start-up named as it goes: rank 0 logs each phase as it begins (``start-up: model (GGUF:
    dequantizing …) …``) and, at :meth:`done`, every phase's wall time in seconds, so minutes of
    loading, tokenizing or compiling are never silent."""

    def __init__(self, on: bool):
        self.on, self.seconds = on, {}
        self._current: str | None = None
        self._began = time.time()

    def begin(self, name: str, detail: str = "") -> None:
        self._end()
        self._current, self._began = name, time.time()
        if self.on:
            log.info("start-up: %s%s ...", name, f" ({detail})" if detail else "")

    def _end(self) -> None:
        if self._current is not None:
            self.seconds[self._current] = self.seconds.get(self._current, 0.0) + time.time() - self._began
            self._current = None

    def done(self, total_s: float) -> None:
        self._end()
        if self.on:
            log.info("start-up: ready in %.1f s (%s)", total_s,
                     ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items()))


def _model_detail(model_cfg: Any) -> str:
    """What loading ``model`` does, for its start-up line."""
    if model_cfg.source == "gguf":
        return f"model.source=gguf: reading and dequantizing {model_cfg.gguf_file or 'the GGUF file'}"
    if model_cfg.source == "pretrained":
        return f"model.source=pretrained: loading {model_cfg.path}"
    return "model.source=config: initialised from the seed"


def _engine_detail(cfg: Any) -> str:
    """What setting up the engine does, for its start-up line; for DeepSpeed, where its compiled
    ops are cached (one folder per Python/torch/DeepSpeed version, llmtrain.distributed) and
    whether this run compiles them."""
    if cfg.recipe.engine != "deepspeed":
        return f"{cfg.recipe.name} on the torch engine"
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions")).expanduser()
    built = cache.is_dir() and any(cache.glob("*/*.so"))
    return (f"DeepSpeed ZeRO-{cfg.recipe.zero_stage}; compiled ops cached in {cache}"
            + ("" if built else "; this first run with these versions compiles them (1-2 min, once)"))


class Trainer:
    """One run (or its resumption), built in a fixed order by ``_setup_*`` methods that each return
    one component: validate → process group → tokenizer and data → checkpoints (and the one to
    resume) → objective → engine with the model → train state → tracker → data loader →
    evaluator → checkpointer → hang watchdog. Nothing is written before the checks of the config,
    the data, the model source and the checkpoint have passed.

    Raises (at construction):
        ConfigError, DataError, ModelSourceError, LaunchError, ResumeError (all
            :class:`llmtrain.errors.LlmtrainError`): bad input, raised before anything is written.
    """

    def __init__(self, cfg: Any):
        self.process_started = time.time()
        # Read-only: the run uses exactly the composed config that `--cfg job --resolve` prints.
        OmegaConf.set_readonly(cfg, True)
        self.cfg, self.t = cfg, cfg.trainer
        self.phases = phases = StartupPhases(on=os.environ.get("RANK", "0") == "0")
        phases.begin("process group")
        self.env = distributed.init_distributed(need_group=cfg.recipe.engine == "deepspeed")
        self.dims, self.accumulation = self._setup_layout()
        seed_everything(self.t.seed)
        self.run_dir = _run_dir(cfg)
        phases.begin("tokenizer", f"model {cfg.model.name}")
        self.tokenizer, self.hf_config = self._setup_tokenizer()
        phases.begin("data", f"data {cfg.data.name}: reading and tokenizing{f' {cfg.data.path}' if cfg.data.path else ''}")
        self.splits = data.load_splits(cfg.data, self.tokenizer, self.t.seed, unpair=cfg.objective.name == "kto")
        self.partial = adapters.is_partial(cfg)  # LoRA or model.freeze: some parameters stay frozen
        self.fingerprint = adapters.base_fingerprint(cfg.model, self.t.seed) if self.partial else None
        phases.begin("checkpoints", f"finding and verifying the one to resume in {self.run_dir / 'checkpoints'}")
        self.checkpoints, self.resume_from = self._setup_checkpoints()
        self.objective = build_objective(cfg.get("objective"))
        self._check_data_for_objective()
        self.engine = self._setup_engine()
        phases.begin("train state")
        self.state, rng = self._setup_state()
        self.config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
        phases.begin("tracker", ", ".join(["metrics.jsonl", *(b for b in cfg.tracker.backends
                                                           if b != "wandb" or cfg.tracker.wandb_mode != "disabled")]))
        self.tracker = self._setup_tracker()
        self._log_start()
        self.reference = self._setup_reference()
        phases.begin("data loader and validation batches")
        self.sampler, self.micro_batches = self._setup_data_loader()
        self.flops_per_token, self.peak_tflops = self._setup_flops()
        self.evaluator = Evaluator(self.engine, self._setup_val_batches(), self.env.device, self.t.eval_every,
                                   self.t.max_steps)
        self.summary: dict[str, Any] = {"losses": [], "lrs": [], "run_dir": str(self.run_dir),
                                        "start_step": self.state.step}
        phases.begin("first evaluation" if self.resume_from is None else "resume")
        self._evaluate_before_training()
        # After everything that draws random numbers at start-up: the dropout streams of the loop.
        if rng is not None:
            checkpoint.restore_rng(rng)
        else:
            seed_streams(self.t.seed, self.engine.dp_rank, self.engine.pp_rank, self.state.step)
        self.preemption = Preemption(self.t.preempt_signal, self.t.save_every_minutes, distributed.scheduler_signal())
        self.checkpointer = Checkpointer(self.checkpoints, self.engine, self.tracker, self.preemption, cfg,
                                         self.config_yaml, self.env.world_size)
        self.task_evals = self._setup_task_evals()
        self.progress = console.Progress(self.t.progress_bar and self.env.is_main, self.t.max_steps, self.state.step,
                                         self.t.log_every)
        self.skipped_in_a_row = 0
        self.watchdog = self._setup_watchdog()
        phases.done(time.time() - self.process_started)

    # ---- the loop ------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Train from the current step to ``trainer.max_steps`` (or a preemption), export, close;
        returns the run's summary (per-step losses and lrs, the final validation, paths written).

        Raises:
            TrainingStopped: a non-finite or spiking step under ``trainer.nonfinite`` (nothing saved).
        """
        self.state.startup_s += time.time() - self.process_started - self._startup_eval_s
        for step in range(self.state.step, self.t.max_steps):
            result = self.train_step(step)
            self.watchdog.set("log")
            metrics = self._step_metrics(result)
            if self.evaluator.should_run(result.step):
                self.watchdog.set("eval")
                metrics.update(self._log_eval(result.step, self.evaluator.run(self.state), result.loss))
            if self.tracker.should_log(result.step) or "val/loss" in metrics or not result.healthy:
                self.tracker.log(metrics, step=result.step)
                self._write_expert_load()
            if not result.healthy:
                self._on_unhealthy(result)
            _check_optimizer_steps(self.engine, self.state)
            self.watchdog.set("checkpoint")
            self.checkpointer.seal_if_written(result.scalars, self.state)
            if self.checkpointer.should_save(result.step, result):
                # The last save and a preemption's are synchronous: the process ends after them.
                background = self.t.async_checkpoint and not result.stop and result.step < self.t.max_steps
                self.checkpointer.save(self.state, background)
            self.task_evals.poll()
            if result.stop:
                self._on_preempted(result.step)
                break
        return self.close()

    def train_step(self, step: int) -> StepResult:
        """One optimizer step (``step`` is 0-based; the result's ``step`` counts it done): the
        global batch's gradient, the update (dropped under ``trainer.nonfinite=skip`` when the
        loss or norm is not finite or spikes), and the train state advanced."""
        started = time.perf_counter()
        self.watchdog.set("data", step + 1)
        host_batches = [self.objective.prepare(next(self.micro_batches)) for _ in range(self.accumulation)]
        # Fingerprint on the host copies: on an accelerator this avoids a device-to-host sync.
        digest = _sample_digest(host_batches)
        batches = [{k: v.to(self.env.device) for k, v in b.items()} for b in host_batches]
        if self.reference is not None:
            for b in batches:
                b["ref_logps"] = self.reference(b)
        lr = self.engine.lr()
        self.watchdog.set("forward_backward")
        sums = forward_backward(self.engine, batches, lambda: self._local_scalars(digest))
        stop, save_by_time = self.preemption.decide([sums.scalars.preempt_requested, sums.scalars.save_due])
        # Loss and gradient norm are global values every rank holds: checking them needs no collective.
        spike = _loss_spike(sums.loss, self.state, self.t.spike_factor)
        keep = (lambda norm: math.isfinite(norm) and math.isfinite(sums.loss) and not spike)
        self.watchdog.set("optimizer")
        grad_norm = self.engine.step(keep_update=keep if self.t.nonfinite == "skip" else None)
        result = StepResult(step + 1, sums.loss, lr, grad_norm, sums.tokens, time.perf_counter() - started,
                            sums.metrics, sums.scalars, stop, save_by_time, spike, sums.router)
        self._advance_state(result)
        return result

    # ---- set-up: one component each ------------------------------------------------------------
    def _setup_layout(self) -> tuple[ParallelDims, int]:
        """Validate the config (pure rules, then the machine's packages, files, servers and
        evaluation tasks) and return the parallel dimensions and the gradient accumulation steps."""
        layout = validate(self.cfg, self.env.world_size)
        preflight(self.cfg)
        if self.t.eval_tasks:
            task_eval.check(self.t)
        if self.cfg.recipe.auto and self.env.world_size > 1:
            _check_same_layout(self.cfg, self.env.device)
        console.configure_library_output(self.env.is_main, console.interactive())
        return ParallelDims.from_layout(layout), layout.accumulation

    def _setup_tokenizer(self) -> tuple[Any, Any]:
        """The tokenizer and the model's ``transformers`` config, checked against each other and
        the data's sequence length before the data is tokenized."""
        tokenizer, hf_config = build_tokenizer(self.cfg.model), model_config(self.cfg.model)
        if len(tokenizer) > hf_config.vocab_size:
            raise ConfigError(f"model.architecture.vocab_size={hf_config.vocab_size} is smaller than the tokenizer's "
                              f"{len(tokenizer)} tokens; raise it to at least {len(tokenizer)}")
        too_long = check_sequence_length(hf_config, self.cfg.data.seq_len)
        if too_long and self.env.is_main:
            log.warning("%s", too_long)
        return tokenizer, hf_config

    def _setup_checkpoints(self) -> tuple[checkpoint.CheckpointManager, Path | None]:
        """The run's checkpoint manager and the checkpoint to resume (checked compatible), if any."""
        manager = checkpoint.CheckpointManager(self.run_dir, self.env, self.t.keep_checkpoints)
        resume_from = manager.resolve(self.t.resume)
        if resume_from is not None:
            checkpoint.check_resumable(resume_from, self.cfg, manager, self.env.is_main, self.fingerprint)
        if self.env.is_main and self.t.resume == "auto":  # a rerun of the same command: say what a crash cost
            previous = goodput.unfinished_process(self.run_dir)
            resumed_step = checkpoint.step_of(resume_from) if resume_from is not None else 0
            if previous is not None and previous["last_step"] > resumed_step:
                log.warning("resume=%s: %s", self.t.resume, goodput.describe_unfinished(previous, resumed_step))
        return manager, resume_from

    def _setup_engine(self):
        """The engine with the model built inside its init context (ZeRO-3 partitions as it is
        built), LoRA/frozen parameters applied, and a resume's checkpoint prepared."""
        self.dims.check_model_config(self.hf_config, self.cfg.recipe.pp_stages_per_rank)
        if self.dims.cp > 1:
            from llmtrain.context_parallel import check_model

            check_model(self.cfg.recipe.cp_style, self.dims.cp, self.dims.tp, self.hf_config)
        self.phases.begin("engine", _engine_detail(self.cfg))  # DeepSpeed imports and loads (or builds) its ops here
        engine = build_engine(self.cfg, self.env, self.accumulation, self.dims, self.objective)
        self.phases.begin("model", _model_detail(self.cfg.model))
        with engine.model_init_context():
            model = self._build_model()
            if self.partial:
                adapters.apply(model, self.cfg)  # LoRA layers in place; frozen parameters marked
                if self.objective.model_output == "scores":
                    model.score.requires_grad_(True)  # a reward model's new head trains with the adapters
        self.phases.begin("engine set-up")
        if self.resume_from is not None:
            self.checkpoints.prepare(engine, self.resume_from)
        engine.setup(model)
        engine.train(True)
        return engine

    def _check_data_for_objective(self) -> None:
        """What the objective needs of the data that only the data can tell, before anything is
        written: a margin column for ``objective.margin_column``, and a resumed run's precomputed
        reference log-probs matching the data (:func:`reference.check_stored`).

        Raises:
            DataError, ResumeError: naming the field or file and the fix.
        """
        o = self.cfg.objective
        if o.get("margin_column") and "margin" not in self.splits.train[0]:
            raise data.DataError(f"objective.margin_column=true, but data.path={self.cfg.data.path} has no margin "
                                 "column; map yours with data.columns.margin=COLUMN, or drop the setting")
        if self.objective.needs_reference and o.get("precompute_reference") and self.resume_from is not None:
            reference.check_stored(self.run_dir, self.splits, self.t.eval_samples)

    def _build_model(self):
        """The model with its initial weights (the policy, or its frozen reference copy)."""
        return build_model(self.cfg.model, self.t.seed, head=self.objective.model_output,
                           pad_token_id=data.pad_id_of(self.tokenizer))

    def _setup_reference(self):
        """The reference policy of an objective that has one: log-probs precomputed into the data
        (returns None), or a live reference called on every micro-batch. Collective call."""
        if not self.objective.needs_reference:
            return None
        if self.cfg.objective.precompute_reference:
            self.phases.begin("reference", "reading the precomputed reference log-probs" if self.resume_from is not None
                              else "precomputing the reference log-probs of every pair")
            reference.precompute(self.engine, self.splits, data.collator_for(self.cfg.data, self.tokenizer),
                                 self.t.micro_batch_size, self.env.device, self.engine.dp_rank, self.dims.dp,
                                 self.run_dir, self.resume_from is not None, self.env.is_main, self.t.eval_samples)
            return None
        self.phases.begin("reference", f"objective.reference={reference.reference_kind(self.cfg)}")
        return reference.build_reference(self.cfg, self.engine, self._build_model)

    def _setup_state(self) -> tuple[checkpoint.TrainState, dict | None]:
        """A fresh train state, or the resumed checkpoint's (and its RNG states) loaded into the
        engine; the optimizer's update count checked against it."""
        state, rng = checkpoint.TrainState(world_size=self.env.world_size, global_batch_size=self.t.global_batch_size,
                                           base_fingerprint=self.fingerprint), None
        if self.resume_from is not None:
            state, rng = self.checkpoints.load(self.engine, self.resume_from)
            state.parent = self.resume_from.name
            self.checkpoints.start_branch(self.resume_from)
            _dump_loaded_model(self.engine)
        _check_optimizer_steps(self.engine, state)
        return state, rng

    def _setup_tracker(self) -> Tracker:
        """The run directory (locked, ``config.yaml`` written by rank 0) and the tracker, with the
        goodput accounting of a restart and the timeline's start event."""
        cfg, env, state, resumed = self.cfg, self.env, self.state, self.resume_from
        if env.is_main:
            checkpoint.lock_run_dir(self.run_dir)
            (self.run_dir / "config.yaml").write_text(self.config_yaml)
        tracker = Tracker(cfg.tracker, self.run_dir, cfg.name, OmegaConf.to_container(cfg, resolve=True), env.is_main,
                          resume_step=state.step if resumed else None, run_id=state.tracker_run_id,
                          config_yaml=self.config_yaml, mlflow_run_id=state.mlflow_run_id, log_every=self.t.log_every)
        goodput.account_restart(state, tracker.redone_records, self.process_started, resumed=resumed is not None)
        if env.is_main:
            goodput.timeline_event(self.run_dir, "start", fresh=resumed is None, step=state.step,
                                   resumed_from=resumed.name if resumed else None, world_size=env.world_size,
                                   recipe=cfg.recipe.name, host=socket.gethostname(), pid=os.getpid())
        return tracker

    def _setup_task_evals(self) -> task_eval.TaskEvals:
        """The in-loop task evaluations (``trainer.eval_tasks``): started when a due checkpoint
        counts, which the checkpointer then writes at those steps."""
        device = self.t.eval_tasks_device or str(self.env.device)
        evals = task_eval.TaskEvals(self.t, self.run_dir, self.env.is_main, self.tracker, self.checkpoints,
                                    self.state.step if self.resume_from is not None else None, device)
        self.checkpointer.on_counted.append(evals.checkpoint_counted)
        self.checkpointer.also_due = evals.due
        return evals

    def _setup_data_loader(self):
        """The global sample order (``sampler``) and this rank's micro-batch iterator from the
        current step on."""
        t = self.t
        loader, sampler = data.train_loader(self.splits, self.tokenizer, self.cfg.data, t.seed, t.micro_batch_size,
                                            self.accumulation, self.engine.dp_rank, self.dims.dp,
                                            start_step=self.state.step, max_steps=t.max_steps)
        return sampler, iter(loader)

    def _setup_flops(self) -> tuple[float, float | None]:
        """Model FLOPs per token (PaLM appendix B) at ``data.seq_len``, and the device's peak
        TFLOP/s where it is known (MFU)."""
        frozen, adapter = flops.partial_training_counts(self.engine.model) if self.partial else (0, 0)
        return (flops.flops_per_token(self.hf_config, self.cfg.data.seq_len, frozen, adapter),
                flops.peak_tflops(self.env.device, self.t.precision, self.t.peak_tflops))

    def _setup_val_batches(self) -> list[dict]:
        """This rank's share of the held-out batches, with what the objective adds."""
        batches = data.val_batches(self.splits, self.tokenizer, self.t.micro_batch_size, self.t.eval_samples,
                                   self.engine.dp_rank, self.dims.dp, data.collator_for(self.cfg.data, self.tokenizer))
        batches = [self.objective.prepare(b) for b in batches]
        if self.reference is not None:  # the reference does not change: its held-out log-probs once
            reference.annotate_batches(self.reference, self.engine, batches, self.env.device)
        return batches

    def _setup_watchdog(self) -> Watchdog:
        """The hang watchdog (:mod:`llmtrain.watchdog`), started: this rank's step and phase as a
        heartbeat file in ``run_dir/.watchdog``, checked against the other ranks'; off for one
        process and for ``trainer.hang_timeout_s=0``. Collective where on."""
        return Watchdog.start(self.run_dir, self.env.rank, self.env.world_size, self.t.hang_timeout_s,
                              self.state.step, (self.t.preempt_signal, distributed.scheduler_signal()))

    def _evaluate_before_training(self) -> None:
        """A fresh run's step-0 evaluation (its time is evaluation, not start-up)."""
        eval_s = self.state.eval_s
        if self.resume_from is None:
            self.summary["initial_val"] = self._log_eval(0, self.evaluator.run(self.state))
            self.tracker.log(self.summary["initial_val"], step=0)
        self._startup_eval_s = self.state.eval_s - eval_s

    def _log_start(self) -> None:
        cfg, t, dims, env = self.cfg, self.t, self.dims, self.env
        num_parameters = self.engine.num_parameters()  # collective on some engines
        if env.is_main:
            log.info("model %s: %.2f M parameters; data %s: %d train / %d val samples; objective %s; recipe %s "
                     "(engine %s, ZeRO %d) on %d rank(s) = dp %d (replicate %d x shard %d) x tp %d x pp %d%s%s; "
                     "global batch %d = micro %d x accumulation %d x dp %d",
                     cfg.model.name, num_parameters / 1e6, cfg.data.name, len(self.splits.train),
                     len(self.splits.val), self.objective.name, cfg.recipe.name, cfg.recipe.engine,
                     cfg.recipe.zero_stage, env.world_size, dims.dp, dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp,
                     f" ({cfg.recipe.pp_schedule}, {cfg.recipe.pp_stages_per_rank} stage(s) per rank)" if dims.pp > 1
                     else "", _long_context_detail(cfg, dims), t.global_batch_size, t.micro_batch_size, self.accumulation, dims.dp)
            log.info("%s", data.describe(self.splits))
        if self.partial:
            _log_trainable(self.engine, cfg, dims, env.is_main)

    # ---- per step ------------------------------------------------------------------------------
    def _local_scalars(self, digest: float) -> StepScalars:
        """This rank's :class:`StepScalars`, read after backward (so the step's own peak memory is in it)."""
        memory = [0.0] * self.env.world_size
        memory[self.env.rank] = float(_memory_bytes(self.env.device))
        requested, due = self.preemption.local_flags()
        return StepScalars(digest, requested, due, self.checkpoints.background_written(), memory)

    def _advance_state(self, result: StepResult) -> None:
        state, t = self.state, self.t
        if result.healthy:
            state.loss_ema = result.loss if not state.loss_ema_steps else 0.9 * state.loss_ema + 0.1 * result.loss
            state.loss_ema_steps += 1
        self.skipped_in_a_row = 0 if result.healthy else self.skipped_in_a_row + 1
        state.step, state.consumed_samples = result.step, result.step * t.global_batch_size
        state.skipped_updates += int(not result.healthy and t.nonfinite == "skip")
        state.tokens_seen += result.tokens
        state.productive_s += result.seconds
        self.summary["losses"].append(result.loss)
        self.summary["lrs"].append(result.lr)
        if result.router is not None:
            shape, layers = self.engine.moe_shape, self.engine.hf_layers
            counts = result.router[:layers * shape.num_experts].view(layers, shape.num_experts)
            saved = torch.tensor(state.expert_load, dtype=torch.float64) if state.expert_load else torch.zeros_like(counts)
            state.expert_load = (saved + counts).tolist()

    def _step_metrics(self, result: StepResult) -> dict[str, float]:
        """The step's record for the trackers (and the progress bar's line)."""
        state, memory = self.state, result.scalars.memory_bytes
        tokens_per_s = result.tokens / result.seconds
        metrics = {"train/loss": result.loss, "train/lr": result.lr, "train/grad_norm": result.grad_norm,
                   "train/tokens_per_s": tokens_per_s, "train/step_time_s": result.seconds,
                   "train/tokens_seen": state.tokens_seen, "train/samples_seen": state.consumed_samples,
                   "data/sample_digest": result.scalars.sample_digest / self.dims.data_replicas,
                   "memory/peak_bytes": max(memory), "memory/peak_rank": memory.index(max(memory)),
                   **{f"train/{name}": value for name, value in result.metrics.items()},
                   **flops.achieved(tokens_per_s, self.flops_per_token, self.env.world_size, self.peak_tflops)}
        metrics.update(self.checkpointer.stall_of_previous_step(result.step - 1))
        if len(self.splits.names) > 1:  # a mixture: every rank knows the global order, no collective needed
            counts = self.sampler.source_counts(result.step - 1, len(self.splits.names))
            metrics.update({f"data/source/{name}_samples": n for name, n in zip(self.splits.names, counts)})
        self.progress.update(result.step, result.loss, result.lr, result.grad_norm, tokens_per_s)
        metrics.update(goodput.time_metrics(state))
        if not result.healthy:
            metrics["train/skipped_update"] = int(self.t.nonfinite == "skip")
        if result.router is not None:
            shape = self.engine.moe_shape
            aux = float(result.router[-1]) / (self.accumulation * self.dims.dp) if self.engine.router_coef else None
            metrics.update(moe.step_metrics(result.router[:-1], self.engine.hf_layers, shape.num_experts,
                                            shape.moe_layers, aux)[0])
        return metrics

    def _write_expert_load(self) -> None:
        """``run_dir/expert_load.json`` (rank 0): tokens per expert per layer summed over every
        step so far (the checkpointed count, so a resumed run continues it exactly), for the
        report's heatmap."""
        if not self.env.is_main or not self.state.expert_load:
            return
        shape = self.engine.moe_shape
        path = self.run_dir / "expert_load.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"step": self.state.step, "num_experts": shape.num_experts, "top_k": shape.top_k,
                                   "moe_layers": list(shape.moe_layers), "tokens_per_expert": self.state.expert_load}))
        os.replace(tmp, path)

    def _log_eval(self, step: int, metrics: dict[str, float], train_loss: float | None = None) -> dict[str, float]:
        if self.env.is_main:
            if "val/perplexity" in metrics:
                detail = f"ppl {metrics['val/perplexity']:.2f}"
            elif "val/rewards/accuracies" in metrics:
                detail = (f"preference accuracy {metrics['val/rewards/accuracies']:.3f}, margin "
                          f"{metrics['val/rewards/margins']:.4f}")
            else:
                detail = ", ".join(f"{k[4:]} {v:.4f}" for k, v in metrics.items() if k.startswith("val/rewards/"))
            log.info("eval at step %d: val loss %.4f (%s)%s", step, metrics["val/loss"], detail,
                     f", train loss {train_loss:.4f}" if train_loss is not None else "")
        if step == self.t.max_steps and step > 0:
            self.summary["final_val"] = {k: v for k, v in metrics.items() if k in ("val/loss", "val/perplexity")
                                         or k.startswith("val/rewards/")}
        return metrics

    def _on_unhealthy(self, result: StepResult) -> None:
        last_healthy = self.checkpointer.latest or (str(self.resume_from) if self.resume_from else None)
        _on_nonfinite(self.t, result.step, result.loss, result.grad_norm, result.spike, self.skipped_in_a_row,
                      last_healthy, lambda: self._close_outputs(complete=False))

    def _on_preempted(self, step: int) -> None:
        self.summary["preempted_at"] = step  # close() says so, last

    # ---- the end -------------------------------------------------------------------------------
    def _close_outputs(self, complete: bool) -> None:
        """Stop what writes outside the loop: background checkpoint, progress bar, signal
        handlers, and (for a run that stops itself) the tracker."""
        self.checkpointer.finish()
        self.progress.close()
        self.preemption.restore()
        if not complete:
            self.task_evals.finish(preempted=True)
            self.tracker.finish(complete=False)

    def close(self) -> dict[str, Any]:
        """Export (unless preempted), write the run report, and tear down in dependency order: the
        tracker (rank 0's files and threads), the engine's threads and buffers, and then (by the
        caller, after every rank is here) the process group. Returns the summary."""
        summary = self.summary
        closing: list[str] = []  # llmtrain's last lines, printed once the trackers have finished
        self.watchdog.stop()  # the loop is over: export and teardown are not watched
        self._close_outputs(complete=True)
        self.task_evals.finish(preempted="preempted_at" in summary)  # their scores are in the report and trackers
        summary["checkpoint_stalls_s"] = self.checkpointer.stalls_s
        if self.checkpointer.latest:
            summary["checkpoint"] = self.checkpointer.latest
        if self.t.export_hf and "preempted_at" not in summary:
            written = export.export_hf(self.engine, self.cfg, self.tokenizer, self.run_dir,
                                       data.end_token_ids(self.cfg.data, self.tokenizer))
            summary.update(written)
            if written:
                closing.append("exported: " + "; ".join(f"{path} ({kind})" for kind, path in written.items()))
        if self.env.is_main:
            goodput.timeline_event(self.run_dir, "end", step=self.state.step,
                                   reason="preempted" if "preempted_at" in summary else "finished")
            self._write_expert_load()
            if self.cfg.tracker.report and (png := _write_report(self.run_dir)):
                summary["report"] = png
                closing.append(f"run report: {png} and {Path(png).with_suffix('.md')}")
                self.tracker.log_files([self.run_dir / "report.png", self.run_dir / "report.md"])  # MLflow, wandb
        self.tracker.finish()
        for line in closing:
            log.info("%s", line)
        if self.env.is_main and "preempted_at" in summary:
            log.warning("preempted (%s): saved step %d; %s", self.preemption.requested or "signal on another rank",
                        summary["preempted_at"], "submitit requeues the job, which continues from it"
                        if distributed.scheduler_signal() else "rerun the same command to continue")
        self.engine.close()
        distributed.barrier()
        return summary


def train(cfg: Any) -> dict[str, Any]:
    """Run (or resume) training as configured (:class:`Trainer`); returns its summary (per-step
    losses, lrs, paths written).

    Raises:
        llmtrain.errors.LlmtrainError: bad input (config, data, model source, launch, checkpoint),
            raised before anything is written; TrainingStopped for a run that stops itself.
    """
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.watchdog.stop()  # also when the loop raises: a process that lives on is not watched


def _log_trainable(engine, cfg: Any, dims: ParallelDims, is_main: bool) -> None:
    """Start-up line of partial training: trainable parameters and their share (as peft's
    ``print_trainable_parameters`` puts it) and this rank's model-state bytes."""
    trainable, total = adapters.summary(engine.model)
    shards = dims.dp if cfg.recipe.zero_stage in (1, 2) else 1
    frozen_bytes, trainable_bytes = adapters.model_state_bytes(engine.model, shards)
    if is_main:
        log.info("trainable params: %s || all params: %s || trainable%%: %.4f; model state on rank 0: frozen "
                 "%.1f MiB (parameters only) + trainable %.2f MiB (parameters, gradients, Adam moments)",
                 f"{trainable:,}", f"{total:,}", 100 * trainable / max(1, total), frozen_bytes / 2**20,
                 trainable_bytes / 2**20)


def _check_optimizer_steps(engine, state: checkpoint.TrainState) -> None:
    """The optimizer has applied exactly one update per trainer step (less the skipped ones):
    an extra update at set-up (DeepSpeed's bf16 ZeRO-0 wrapper once took one) would add a weight
    decay and shift Adam's bias correction unseen.

    Raises:
        RuntimeError: the counts differ (a bug in an engine, not bad input).
    """
    expected, taken = state.step - state.skipped_updates, engine.optimizer_step_count()
    if taken != expected:
        raise RuntimeError(f"the optimizer has applied {taken} updates at trainer step {state.step} "
                           f"({state.skipped_updates} skipped): expected {expected}")


SPIKE_AFTER_STEPS = 10  # healthy steps in the running mean before trainer.spike_factor applies


def _loss_spike(loss: float, state: checkpoint.TrainState, factor: float) -> str | None:
    """Why ``loss`` counts as a spike (``trainer.spike_factor`` x the running mean of healthy
    losses, once ``SPIKE_AFTER_STEPS`` fed it), else None."""
    if factor and state.loss_ema_steps >= SPIKE_AFTER_STEPS and loss > factor * state.loss_ema:
        return f"is above trainer.spike_factor={factor} x the running mean loss {state.loss_ema:.4f}"
    return None


def _long_context_detail(cfg: Any, dims: ParallelDims) -> str:
    """The start-up line's context-parallel, sequence-parallel, chunked-loss and expert-parallel settings."""
    parts = []
    if dims.cp > 1:
        parts.append(f" x cp {dims.cp} ({cfg.recipe.cp_style}; FSDP2 shards over dp_shard x cp = {dims.dp_shard * dims.cp}"
                     if cfg.recipe.engine == "torch" else f" x cp {dims.cp} ({cfg.recipe.cp_style}; ZeRO over every rank")
        parts[-1] += ")"
    if cfg.recipe.get("tp_sequence_parallel"):
        parts.append(" with sequence parallelism inside tp")
    if cfg.trainer.get("loss_chunk_tokens"):
        parts.append(f"; loss in chunks of {cfg.trainer.loss_chunk_tokens} tokens")
    if dims.ep > 1:
        parts.append(f"; experts split over ep {dims.ep} ranks of dp_shard (all-to-all), each FSDP-sharded over the "
                     f"other {dims.dp_replicate * dims.dp_shard // dims.ep}")
    return "".join(parts)


def _check_same_layout(cfg: Any, device: torch.device) -> None:
    """``+recipe=auto`` decides on every rank from its own device memory: ranks whose memory
    differs could choose different layouts, which would hang the first collective.

    Raises:
        ConfigError: the ranks chose differently.
    """
    choice = f"{cfg.recipe.name}|{cfg.trainer.micro_batch_size}|{cfg.trainer.activation_checkpointing}"
    mine = torch.tensor(float(zlib.crc32(choice.encode())), dtype=torch.float64, device=device)
    if distributed.all_reduce_max(mine.clone()).item() != -distributed.all_reduce_max(-mine).item():
        raise ConfigError(f"+recipe=auto chose different layouts on different ranks (this one: {choice}): their "
                          "device memory differs; set recipe.device_memory to the smallest device's")


def _write_report(run_dir: Path) -> str | None:
    """``report.png`` / ``report.md`` (llmtrain.report) of the run so far; a failure to plot is a
    warning, never a failed run."""
    from llmtrain import report

    try:
        png, _ = report.write_report(run_dir)
    except Exception as err:  # noqa: BLE001  (matplotlib missing or a plotting error)
        log.warning("could not write the run report (%s); `python -m llmtrain.report %s` retries", err, run_dir)
        return None
    return str(png)


def _on_nonfinite(t: Any, step: int, loss: float, grad_norm: float, spike: str | None, skipped_in_a_row: int,
                  last_healthy: str | None, close: Any) -> None:
    """Apply ``trainer.nonfinite`` to a step whose loss or gradient norm is not finite, or whose
    loss is a spike (``spike``: why, see :func:`_loss_spike`): with
    ``skip`` (the update was already dropped) log it until ``max_skipped_steps`` in a row;
    otherwise close the run's outputs and raise before anything is saved or exported.

    Raises:
        TrainingStopped: naming the step, the values and the last healthy checkpoint.
    """
    values = (f"loss spike: train loss {loss} {spike}, grad norm {grad_norm}" if spike else
              f"non-finite train loss {loss}, grad norm {grad_norm}")
    if t.nonfinite == "skip" and skipped_in_a_row < t.max_skipped_steps:
        log.warning("step %d: %s: update skipped (%d in a row; trainer.max_skipped_steps=%d)",
                    step, values, skipped_in_a_row, t.max_skipped_steps)
        return
    close()
    why = (f"{skipped_in_a_row} updates in a row were skipped (trainer.max_skipped_steps={t.max_skipped_steps})"
           if t.nonfinite == "skip" else "trainer.nonfinite=stop")
    restart = (f"the last healthy checkpoint is {last_healthy}: resume from it (trainer.resume=auto) to retry with "
               "the same settings (resume refuses a changed trainer.lr or grad_clip: those make a new run, with its "
               "own run_dir)" if last_healthy else
               "no checkpoint was written before it: lower trainer.lr or raise trainer.warmup_steps")
    raise TrainingStopped(f"step {step}: {values} ({why}); nothing was saved or exported from this state; "
                          f"{restart}")


def _dump_loaded_model(engine) -> None:
    """Debugging aid: LLMTRAIN_DUMP_AFTER_LOAD=FILE writes the just-loaded model's consolidated
    state dict (``torch.save``), to compare a resume against its checkpoint. Collective call."""
    path = os.environ.get("LLMTRAIN_DUMP_AFTER_LOAD")
    if path:
        state = engine.full_state_dict()
        if state is not None:
            torch.save(state, path)
