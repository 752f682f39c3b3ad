"""The training run: a :class:`Trainer` whose ``_setup_*`` methods each build one component, a
:meth:`Trainer.train_step` for one optimizer step, and a :meth:`Trainer.train` loop in which each
component decides its own cadence (the checkpointer, :mod:`llmtrain.checkpoint.checkpointer`; the
evaluator, :mod:`llmtrain.evaluation.validation`; the tracker, :mod:`llmtrain.monitoring.tracking`).

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

import contextlib
import json
import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import OmegaConf

from llmtrain import data
from llmtrain.checkpoint.checkpointer import Checkpointer, checkpoint_bytes, dump_loaded_model, warn_if_disk_is_short
from llmtrain.checkpoint.export import export_hf, write_policy
from llmtrain.checkpoint.protocol import CheckpointManager, lock_run_dir, step_of
from llmtrain.checkpoint.resume import check_resumable
from llmtrain.checkpoint.state import TrainState, restore_rng
from llmtrain.common import collection, hardware
from llmtrain.common.errors import ConfigError
from llmtrain.config.compose import run_dir_of
from llmtrain.config.validate import validate
from llmtrain.data.order import sample_digest
from llmtrain.engine import build_engine
from llmtrain.engine.base import check_optimizer_steps
from llmtrain.evaluation import in_loop
from llmtrain.evaluation.validation import Evaluator, evaluate
from llmtrain.models import adapters, moe, quantize
from llmtrain.models.build import build_model, build_tokenizer, check_sequence_length, model_config
from llmtrain.monitoring import console, goodput
from llmtrain.monitoring.health import FlatRewards, loss_spike, on_nonfinite, peak_memory_bytes
from llmtrain.monitoring.preemption import Preemption
from llmtrain.monitoring.startup import (StartupInterrupted, StartupPhases, engine_detail, log_trainable,
                                         long_context_detail, model_detail)
from llmtrain.monitoring.tracking import Tracker
from llmtrain.monitoring.watchdog import Watchdog
from llmtrain.objectives import Objective, build_objective, reference
from llmtrain.parallel import distributed
from llmtrain.parallel.dims import ParallelDims
from llmtrain.parallel.parallelize import compiled_graphs
from llmtrain.parallel.seeding import seed_everything, seed_streams
from llmtrain.planning import flops
from llmtrain.planning.auto import check_same_layout
from llmtrain.planning.preflight import preflight
from llmtrain.rollout import (RewardError, Rollout, build_environment, build_rewards, build_sampler,
                              environment_reward)

log = logging.getLogger("llmtrain")


@dataclass
class StepScalars:
    """This rank's values of one optimizer step that ride in the step's one all-reduce after
    backward, beside the loss, so the loop reports them without collectives of its own. After
    the all-reduce (:meth:`from_values`) each field holds the sum over all ranks.

    Attributes:
        sample_digest: order-free fingerprint of the step's samples (:func:`sample_digest`).
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
    holds). ``spike``: why the loss counts as a spike (:func:`loss_spike`), else None."""

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
    # What the batch source reports (an online objective's rollout: rewards, lengths, times).
    source_metrics: dict[str, float] = field(default_factory=dict)
    gc_s: float = 0.0  # seconds of the scheduled garbage collection that ended the step (trainer.gc_every)

    @property
    def healthy(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm) and not self.spike


class Trainer:
    """One run (or its resumption), built in a fixed order by ``_setup_*`` methods that each return
    one component: validate → process group → tokenizer and data → checkpoints (and the one to
    resume) → objective → engine with the model → train state → tracker → data loader →
    evaluator → checkpointer → hang watchdog → the garbage collector's schedule
    (:mod:`llmtrain.common.collection`). Nothing is written before the checks of the config,
    the data, the model source and the checkpoint have passed.

    Raises (at construction):
        ConfigError, DataError, ModelSourceError, LaunchError, ResumeError (all
            :class:`llmtrain.common.errors.LlmtrainError`): bad input, raised before anything is written.
    """

    def __init__(self, cfg: Any):
        self.process_started = time.time()
        self.collection = collection.CollectionSchedule(cfg.trainer.gc_every)
        self.collection.set_up()
        self.unlogged_gc_s = 0.0  # scheduled collections' seconds since the last logged record
        try:
            self._set_up(cfg)
        except KeyboardInterrupt:
            collection.restore()
            raise StartupInterrupted(self._interrupted()) from None
        except BaseException:
            collection.restore()  # a process that lives on (a sweep, a benchmark) collects as before
            raise

    def _interrupted(self) -> str:
        """Close what start-up had opened when SIGINT stopped it (the tracker, with the timeline's
        end event, so a rerun does not report a crash; a rollout server) and say where it stopped."""
        import signal

        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut this short
        try:
            phases = getattr(self, "phases", None)
            where = f"during {phases.current}" if phases is not None and phases.current else "before the first step"
            tracker = getattr(self, "tracker", None)
            left = ""
            if tracker is not None:
                tracker.finish(complete=False)
                if self.env.is_main:
                    goodput.timeline_event(self.run_dir, "end", step=self.state.step, reason="interrupted")
                left = (f"; {self.run_dir} keeps its checkpoints" if self.resume_from is not None else
                        f"; {self.run_dir} holds config.yaml and logs, no checkpoint")
            self.close_sampler()
        finally:
            signal.signal(signal.SIGINT, previous)
        return f"SIGINT (Ctrl-C) in start-up, {where}: nothing was trained{left}"

    def _set_up(self, cfg: Any) -> None:
        # trainer.precision=auto becomes what this machine runs natively before anything reads it
        # (config.yaml records the choice; the start-up line says why).
        precision, self.precision_reason = hardware.resolve_precision(cfg.trainer.precision, hardware.default_device())
        if precision != cfg.trainer.precision:
            cfg.trainer.precision = precision
        # Read-only: the run uses exactly the composed config that `--cfg job --resolve` prints.
        OmegaConf.set_readonly(cfg, True)
        self.cfg, self.t = cfg, cfg.trainer
        self.phases = phases = StartupPhases(on=os.environ.get("RANK", "0") == "0")
        phases.begin("process group")
        self.env = distributed.init_distributed(need_group=cfg.recipe.engine == "deepspeed")
        self.dims, self.accumulation = self._setup_layout()
        seed_everything(self.t.seed)
        self.run_dir = run_dir_of(cfg)
        phases.begin("tokenizer", f"model {cfg.model.name}")
        self.tokenizer, self.hf_config = self._setup_tokenizer()
        phases.begin("data", f"data {cfg.data.name}: reading and tokenizing{f' {cfg.data.path}' if cfg.data.path else ''}")
        self.splits = data.load_splits(cfg.data, self.tokenizer, self.t.seed, unpair=cfg.objective.name == "kto",
                                       prompt_budget=cfg.data.seq_len - cfg.rollout.max_completion_length)
        self.partial = adapters.is_partial(cfg)  # LoRA or model.freeze: some parameters stay frozen
        self.fingerprint = adapters.base_fingerprint(cfg.model, self.t.seed) if self.partial else None
        phases.begin("checkpoints", f"finding and verifying the one to resume in {self.run_dir / 'checkpoints'}")
        self.checkpoints, self.resume_from = self._setup_checkpoints()
        self.objective = build_objective(cfg.get("objective"))
        self.objective.setup(cfg)
        self._check_data_for_objective()
        self.online_parts = self._setup_online()
        # Dynamo's count is per process: another run earlier in it (a sweep, a test) is not ours.
        self.graphs_before = compiled_graphs()
        self.engine = self._setup_engine()
        phases.begin("train state")
        self.state, rng = self._setup_state()
        self.config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
        self.checkpoints.announce()  # resuming or starting fresh: said once every check has passed
        phases.begin("tracker", ", ".join(["metrics.jsonl", *(b for b in cfg.tracker.backends
                                                           if b != "wandb" or cfg.tracker.wandb_mode != "disabled")]))
        self.tracker = self._setup_tracker()
        self._log_start()
        self.reference = self._setup_reference()
        self.flops_per_token, self.peak = self._setup_flops()  # a probe, when it runs, is a start-up phase of its own
        phases.begin("data loader and validation batches")
        self.sampler, self.micro_batches = self._setup_data_loader()
        self.batches, self.evaluator = self._setup_batches(self._setup_val_batches())
        self.summary: dict[str, Any] = {"losses": [], "lrs": [], "run_dir": str(self.run_dir),
                                        "start_step": self.state.step}
        if self.resume_from is not None:
            phases.begin("resume")
        elif self.t.eval_every:  # trainer.eval_every=0: no evaluation before the last step, step 0's included
            phases.begin("first evaluation", self._held_out_detail())
        self._evaluate_before_training()
        # After everything that draws random numbers at start-up: the dropout streams of the loop.
        if rng is not None:
            restore_rng(rng)
        else:
            seed_streams(self.t.seed, self.engine.dp_rank, self.engine.pp_rank, self.state.step)
        self.preemption = Preemption(self.t.preempt_signal, self.t.save_every_minutes, distributed.scheduler_signal())
        self.checkpointer = Checkpointer(self.checkpoints, self.engine, self.tracker, self.preemption, cfg,
                                         self.config_yaml, self.env.world_size)
        self.task_evals = self._setup_task_evals()
        self.progress = console.Progress(self.t.progress_bar and self.env.is_main, self.t.max_steps, self.state.step,
                                         self.t.log_every)
        self.skipped_in_a_row = 0
        self.flat_rewards = FlatRewards()
        self.watchdog = self._setup_watchdog()
        self.collection.start()
        phases.done(time.time() - self.process_started)

    # ---- the loop ------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Train from the current step to ``trainer.max_steps`` (or a preemption), export, close;
        returns the run's summary (per-step losses and lrs, the final validation, paths written).

        Raises:
            TrainingStopped: a non-finite or spiking step under ``trainer.nonfinite`` (nothing saved).
        """
        try:
            self._run_steps()
            return self.close()
        finally:
            collection.restore()  # also when the loop raises: a process that lives on collects as before

    def _run_steps(self) -> None:
        """The loop: a step, its record, evaluation, checkpoint; until max_steps or a preemption."""
        self.state.startup_s += time.time() - self.process_started - self._startup_eval_s
        for step in range(self.state.step, self.t.max_steps):
            result = self.train_step(step)
            self.watchdog.set("log")
            metrics = self._step_metrics(result)
            evaluated = self.evaluator.should_run(result.step)
            if evaluated:
                self.watchdog.set("eval")
                metrics.update(self._log_eval(result.step, self.evaluator.run(self.state), result.loss))
            if self.tracker.should_log(result.step) or evaluated or not result.healthy:
                self.tracker.log(metrics, step=result.step)
                self.unlogged_gc_s = 0.0
                self._write_expert_load()
            if not result.healthy:
                self._on_unhealthy(result)
            check_optimizer_steps(self.engine, self.state)
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

    def train_step(self, step: int) -> StepResult:
        """One optimizer step (``step`` is 0-based; the result's ``step`` counts it done): the
        global batch's gradient, the update (dropped under ``trainer.nonfinite=skip`` when the
        loss or norm is not finite or spikes), and the train state advanced."""
        started = time.perf_counter()
        self.watchdog.set("data", step + 1)
        host_batches, source_metrics = self.batches.for_step(step)
        # Fingerprint on the host copies: on an accelerator this avoids a device-to-host sync.
        digest = sample_digest(host_batches)
        batches = [{k: v.to(self.env.device) for k, v in b.items()} for b in host_batches]
        if self.reference is not None:
            for b in batches:
                b[self.objective.reference_key] = self.reference(b)
        lr = self.engine.lr()
        self.watchdog.set("forward_backward")
        sums = forward_backward(self.engine, batches, lambda: self._local_scalars(digest))
        stop, save_by_time = self.preemption.decide([sums.scalars.preempt_requested, sums.scalars.save_due])
        # Loss and gradient norm are global values every rank holds: checking them needs no collective.
        spike = loss_spike(sums.loss, self.state, self.t.spike_factor)
        keep = (lambda norm: math.isfinite(norm) and math.isfinite(sums.loss) and not spike)
        self.watchdog.set("optimizer")
        grad_norm = self.engine.step(keep_update=keep if self.t.nonfinite == "skip" else None)
        gc_s = self.collection.collect_if_due(step + 1)  # inside the step's time: the tokens/s count it
        result = StepResult(step + 1, sums.loss, lr, grad_norm, sums.tokens, time.perf_counter() - started,
                            sums.metrics, sums.scalars, stop, save_by_time, spike, sums.router, source_metrics, gc_s)
        self._advance_state(result)
        return result

    # ---- set-up: one component each ------------------------------------------------------------
    def _setup_layout(self) -> tuple[ParallelDims, int]:
        """Validate the config (pure rules, then the machine's packages, files, servers and
        evaluation tasks) and return the parallel dimensions and the gradient accumulation steps."""
        layout = validate(self.cfg, self.env.world_size)
        preflight(self.cfg)
        if self.t.eval_tasks:
            in_loop.check(self.t)
        if self.cfg.recipe.auto and self.env.world_size > 1:
            check_same_layout(self.cfg, self.env.device)
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

    def _setup_checkpoints(self) -> tuple[CheckpointManager, Path | None]:
        """The run's checkpoint manager and the checkpoint to resume (checked compatible), if any."""
        manager = CheckpointManager(self.run_dir, self.env, self.t.keep_checkpoints)
        resume_from = manager.resolve(self.t.resume)
        self.rollout_state: dict[str, torch.Tensor] = {}  # an online objective's pending generation batch
        if resume_from is not None:
            check_resumable(resume_from, self.cfg, manager, self.env.is_main, self.fingerprint)
            self.rollout_state = manager.read_rank_state(resume_from, "rollout")
        if self.env.is_main and self.t.resume == "auto":  # a rerun of the same command: say what a crash cost
            previous = goodput.unfinished_process(self.run_dir)
            resumed_step = step_of(resume_from) if resume_from is not None else 0
            if previous is not None and previous["last_step"] > resumed_step:
                log.warning("resume=%s: %s", self.t.resume, goodput.describe_unfinished(previous, resumed_step))
        return manager, resume_from

    def _setup_engine(self):
        """The engine with the model built inside its init context (ZeRO-3 partitions as it is
        built), LoRA/frozen parameters applied, and a resume's checkpoint prepared."""
        self.dims.check_model_config(self.hf_config, self.cfg.recipe.pp_stages_per_rank)
        if self.dims.cp > 1:
            from llmtrain.parallel.context_parallel import check_model

            check_model(self.cfg.recipe.cp_style, self.dims.cp, self.dims.tp, self.hf_config)
        self.phases.begin("engine", engine_detail(self.cfg))  # DeepSpeed imports and loads (or builds) its ops here
        engine = build_engine(self.cfg, self.env, self.accumulation, self.dims, self.objective)
        self.phases.begin("model", model_detail(self.cfg.model))
        # A 4-bit base is quantized from whole weights: built outside the meta-device / zero.Init
        # context, then sharded by the engine like any pretrained model.
        quantized = quantize.is_quantized(self.cfg)
        with engine.model_init_context() if not quantized else contextlib.nullcontext():
            model = self._build_model()
            quantize.quantize_base(model, self.cfg)
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

    def _setup_online(self) -> tuple[Any, list, Any] | None:
        """An online objective's sampler, reward functions (each tried on two prompts before
        anything is written: :func:`llmtrain.rollout.build_rewards`) and multi-turn environment
        (or None); None for others.

        Raises:
            ConfigError: a rollout engine, reward function or environment that cannot be built,
                or a reward function that fails the try.
        """
        if not self.objective.online:
            return None
        if self.objective.reference_model() is not None:
            self._check_teacher()
        end_ids = data.end_token_ids(self.cfg.data, self.tokenizer)
        sampler = build_sampler(self.cfg, self.tokenizer, end_ids)
        sampler.check()
        # An engine that serves the policy elsewhere (vLLM) gets its weights written by the export's code.
        sampler.publish = lambda directory, part: write_policy(self.engine, self.cfg, self.tokenizer, directory, part,
                                                               end_ids)
        probe = [self.splits.train[i] for i in range(min(2, len(self.splits.train)))]
        if getattr(self.objective, "lmbda", 1.0) < 1 and probe and "completion" not in probe[0]:
            raise ConfigError(f"objective.lmbda={self.objective.lmbda}: the batches the student does not sample are the "
                              "data's own completions, read from each record's 'completion' column, which the records "
                              f"of data.path lack (theirs: {', '.join(k for k in probe[0] if k != 'prompt_ids')}); add "
                              "it or set objective.lmbda=1")
        # gsm8k's answers are checked over more records than the probe: a few may lack a number.
        answers = [self.splits.train[i].get("answer") for i in range(min(64, len(self.splits.train)))] \
            if probe and "answer" in probe[0] else None
        try:
            functions = build_rewards(self.cfg, probe, self.env.device, answers) if self.cfg.reward.functions else []
        except RewardError as err:
            raise ConfigError(f"reward.functions: {err}") from err.__cause__
        environment = build_environment(self.cfg)
        if environment is not None and environment.gives_rewards:  # one more function: weighted, logged
            functions.append(environment_reward())
        return sampler, functions, environment

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
        if self.objective.reference_model() is not None:
            return self._setup_teacher()
        self.phases.begin("reference", f"objective.reference={reference.reference_kind(self.cfg)}")
        # GRPO's log-probs are of temperature-scaled logits; the preference objectives' are plain.
        logps = getattr(self.objective, "token_logps", reference.completion_token_logps)
        return reference.build_reference(self.cfg, self.engine, self._build_model, logps)

    def _setup_teacher(self):
        """The objective's own frozen reference model (distillation's teacher), laid out like a
        reference copy. Collective call.

        Raises:
            ConfigError: an engine that cannot lay it out.
        """
        teacher = self.objective.reference_model()
        self.phases.begin("teacher", f"objective.teacher={self.objective.teacher} (model source {teacher.source})")
        forward = self.engine.frozen_copy(lambda: build_model(teacher, self.t.seed), teacher.source == "config")
        if forward is None:
            raise ConfigError(f"objective.teacher: the {type(self.engine).__name__} engine of recipe "
                              f"{self.cfg.recipe.name} cannot lay out a frozen teacher; use a data-parallel, ZeRO or "
                              "FSDP recipe")
        return reference.LiveReference(forward, self.objective.reference_outputs)

    def _check_teacher(self) -> None:
        """A distillation teacher that exists and shares the student's vocabulary (read from the
        two model configs), before anything is written.

        Raises:
            ConfigError: naming the teacher and both vocabulary sizes.
        """
        teacher = self.objective.reference_model()
        width = model_config(teacher).vocab_size
        if width != self.hf_config.vocab_size:
            raise ConfigError(f"objective.teacher={self.objective.teacher!r} has {width} logits per token, the student "
                              f"model {self.cfg.model.name} {self.hf_config.vocab_size}: distillation compares the two "
                              "distributions token by token, so they need one tokenizer and vocabulary")

    def _setup_state(self) -> tuple[TrainState, dict | None]:
        """A fresh train state, or the resumed checkpoint's (and its RNG states) loaded into the
        engine; the optimizer's update count checked against it."""
        state, rng = TrainState(world_size=self.env.world_size, global_batch_size=self.t.global_batch_size,
                                           base_fingerprint=self.fingerprint), None
        if self.resume_from is not None:
            state, rng = self.checkpoints.load(self.engine, self.resume_from)
            state.parent = self.resume_from.name
            self.checkpoints.start_branch(self.resume_from)
            dump_loaded_model(self.engine)
        check_optimizer_steps(self.engine, state)
        return state, rng

    def _setup_tracker(self) -> Tracker:
        """The run directory (locked, ``config.yaml`` written by rank 0) and the tracker, with the
        goodput accounting of a restart and the timeline's start event."""
        cfg, env, state, resumed = self.cfg, self.env, self.state, self.resume_from
        if env.is_main:
            lock_run_dir(self.run_dir)
            (self.run_dir / "config.yaml").write_text(self.config_yaml)
        tracker = Tracker(cfg.tracker, self.run_dir, cfg.name, OmegaConf.to_container(cfg, resolve=True), env.is_main,
                          resume_step=state.step if resumed else None, run_id=state.tracker_run_id,
                          config_yaml=self.config_yaml, mlflow_run_id=state.mlflow_run_id, log_every=self.t.log_every)
        finished = goodput.finished_at(self.run_dir) if env.is_main and resumed is not None else None
        goodput.account_restart(state, tracker.redone_records, self.process_started, resumed=resumed is not None,
                                finished=finished)
        if env.is_main:
            goodput.timeline_event(self.run_dir, "start", fresh=resumed is None, step=state.step,
                                   resumed_from=resumed.name if resumed else None, world_size=env.world_size,
                                   recipe=cfg.recipe.name, host=socket.gethostname(), pid=os.getpid())
        return tracker

    def _setup_task_evals(self) -> in_loop.TaskEvals:
        """The in-loop task evaluations (``trainer.eval_tasks``): started when a due checkpoint
        counts, which the checkpointer then writes at those steps."""
        device = self.t.eval_tasks_device or str(self.env.device)
        evals = in_loop.TaskEvals(self.t, self.run_dir, self.env.is_main, self.tracker, self.checkpoints,
                                    self.state.step if self.resume_from is not None else None, device)
        self.checkpointer.on_counted.append(evals.checkpoint_counted)
        self.checkpointer.also_due = evals.due
        return evals

    def _setup_data_loader(self):
        """The global sample order (``sampler``) and this rank's micro-batch iterator from the
        current step on."""
        t, per = self.t, self.objective.steps_per_batch  # GRPO's μ steps train on one batch of prompts
        loader, sampler = data.train_loader(self.splits, self.tokenizer, self.cfg.data, t.seed, t.micro_batch_size,
                                            self.accumulation, self.engine.dp_rank, self.dims.dp,
                                            start_step=-(-self.state.step // per), max_steps=-(-t.max_steps // per))
        return sampler, iter(loader)

    def _setup_batches(self, val_batches: list[dict]) -> tuple[Any, Evaluator]:
        """The step's batch source and the held-out evaluator: the data loader's micro-batches and
        the held-out loss, or an online objective's rollout (:mod:`llmtrain.rollout`: sampled,
        scored completions; held-out greedy rewards)."""
        t = self.t
        if not self.objective.online:
            source = data.StepBatches(self.micro_batches, self.accumulation, self.objective.prepare)
            return source, Evaluator(lambda: evaluate(self.engine, val_batches, self.env.device), t.eval_every,
                                     t.max_steps)
        sampler, functions, environment = self.online_parts
        rollout = Rollout(self.cfg, self.engine, self.objective, sampler, self.micro_batches, self.tokenizer,
                          data.pad_id_of(self.tokenizer), functions, self.run_dir, self.env.is_main,
                          lambda rows, step: self.tracker.log_table("completions", rows, step), environment,
                          self._held_out_divergence if self.objective.reference_model() is not None else None)
        rollout.load_state_dict(self.rollout_state)
        self.checkpoints.rank_state["rollout"] = rollout.state_dict
        return rollout, Evaluator(lambda: self._held_out_rewards(rollout, val_batches), t.eval_every, t.max_steps)

    def _held_out_rewards(self, rollout: Rollout, val_batches: list[dict]) -> dict[str, float]:
        """An online objective's held-out evaluation (:meth:`Rollout.evaluate`) with rank 0's
        progress through its prompts (a bar on a terminal, else lines): minutes on a CPU."""
        prompts = sum(len(b["prompts"]) for b in val_batches)
        share = " (rank 0's share)" if self.dims.dp > 1 else ""
        with console.CountProgress(f"held-out evaluation{share}", prompts, "prompts", self.env.is_main,
                                   self.t.progress_bar and console.interactive()) as progress:
            sampler = self.online_parts[0]
            sampler.on_sampled = progress.advance
            try:
                return rollout.evaluate(val_batches)
            finally:
                sampler.on_sampled = None

    def _held_out_detail(self) -> str:
        """What the first evaluation does, for its start-up line."""
        if not self.objective.online:
            return f"held-out loss of up to {self.t.eval_samples} samples"
        return (f"a greedy completion of each of up to {self.t.eval_samples} held-out prompts (trainer.eval_samples), "
                f"up to {self.cfg.rollout.max_completion_length} tokens each; trainer.eval_every=0 skips it")

    def _held_out_divergence(self, batches: list[dict]) -> dict[str, float]:
        """Distillation's held-out loss: the teacher's outputs on greedy completions of the
        held-out prompts, then the objective's loss over them (``val/loss``: the per-token KL)."""
        batches = [self.objective.prepare(b) for b in batches]
        reference.annotate_batches(self.reference, self.engine, batches, self.env.device, self.objective.reference_key)
        return evaluate(self.engine, batches, self.env.device)

    def _setup_flops(self) -> tuple[float, flops.Peak | None]:
        """Model FLOPs per token (PaLM appendix B) at ``data.seq_len``, and the peak TFLOP/s per
        device MFU is measured against (:func:`llmtrain.planning.flops.peak_tflops`: configured,
        data sheet, or a matmul probe of this machine; collective on a CPU), said at start-up and
        recorded in the timeline for the run report."""
        frozen, adapter = flops.partial_training_counts(self.engine.model) if self.partial else (0, 0)
        peak = flops.peak_tflops(self.env.device, self.t.precision, self.t.peak_tflops,
                                 announce=lambda detail: self.phases.begin("peak flops probe", detail))
        if self.env.is_main and peak is not None:
            log.info("MFU against %s", peak.describe())
            goodput.timeline_event(self.run_dir, "peak_flops", tflops=peak.tflops, precision=peak.precision,
                                   source=peak.source, detail=peak.detail)
        return flops.flops_per_token(self.hf_config, self.cfg.data.seq_len, frozen, adapter), peak

    def _setup_val_batches(self) -> list[dict]:
        """This rank's share of the held-out batches, with what the objective adds (an online
        objective's: prompts, which its rollout completes)."""
        batches = data.val_batches(self.splits, self.tokenizer, self.t.micro_batch_size, self.t.eval_samples,
                                   self.engine.dp_rank, self.dims.dp, data.collator_for(self.cfg.data, self.tokenizer))
        if self.objective.online:
            return batches
        batches = [self.objective.prepare(b) for b in batches]
        if self.reference is not None:  # the reference does not change: its held-out log-probs once
            self.phases.begin("reference log-probs", f"the reference policy over {len(batches)} held-out micro-batches"
                              " on this rank: as long as one evaluation")
            reference.annotate_batches(self.reference, self.engine, batches, self.env.device)
        return batches

    def _setup_watchdog(self) -> Watchdog:
        """The hang watchdog (:mod:`llmtrain.monitoring.watchdog`), started: this rank's step and phase as a
        heartbeat file in ``run_dir/.watchdog``, checked against the other ranks'; off for one
        process and for ``trainer.hang_timeout_s=0``. Collective where on."""
        return Watchdog.start(self.run_dir, self.env.rank, self.env.world_size, self.t.hang_timeout_s,
                              self.state.step, (self.t.preempt_signal, distributed.scheduler_signal()))

    def _evaluate_before_training(self) -> None:
        """A fresh run's step-0 evaluation (its time is evaluation, not start-up); none under
        ``trainer.eval_every=0``."""
        eval_s = self.state.eval_s
        if self.resume_from is None and self.t.eval_every:
            self.summary["initial_val"] = self._log_eval(0, self.evaluator.run(self.state))
            self.tracker.log(self.summary["initial_val"], step=0)
        self._startup_eval_s = self.state.eval_s - eval_s

    def _log_start(self) -> None:
        cfg, t, dims, env = self.cfg, self.t, self.dims, self.env
        num_parameters = self.engine.num_parameters()  # collective on some engines
        if env.is_main:
            log.info("model %s: %.2f M parameters; data %s: %d train / %d val samples; objective %s; recipe %s "
                     "(engine %s, ZeRO %d) on %d rank(s) = dp %d (replicate %d x shard %d) x tp %d x pp %d%s%s; "
                     "global batch %d = micro %d x accumulation %d x dp %d; precision %s (%s)",
                     cfg.model.name, num_parameters / 1e6, cfg.data.name, len(self.splits.train),
                     len(self.splits.val), self.objective.name, cfg.recipe.name, cfg.recipe.engine,
                     cfg.recipe.zero_stage, env.world_size, dims.dp, dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp,
                     f" ({cfg.recipe.pp_schedule}, {cfg.recipe.pp_stages_per_rank} stage(s) per rank)" if dims.pp > 1
                     else "", long_context_detail(cfg, dims), t.global_batch_size, t.micro_batch_size, self.accumulation, dims.dp,
                     t.precision, self.precision_reason)
            log.info("%s", data.describe(self.splits))
        if self.partial:
            log_trainable(self.engine, cfg, dims, env.is_main)
        if env.is_main:
            trained = adapters.summary(self.engine.model)[0] if self.partial else num_parameters
            warn_if_disk_is_short(self.run_dir, t.keep_checkpoints, checkpoint_bytes(trained, cfg.recipe.engine, cfg.recipe.zero_stage))

    # ---- per step ------------------------------------------------------------------------------
    def _local_scalars(self, digest: float) -> StepScalars:
        """This rank's :class:`StepScalars`, read after backward (so the step's own peak memory is in it)."""
        memory = [0.0] * self.env.world_size
        memory[self.env.rank] = float(peak_memory_bytes(self.env.device))
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
        state.generation_s += result.source_metrics.get("rollout/generation_s", 0.0)
        state.reward_s += result.source_metrics.get("rollout/reward_s", 0.0)
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
                   **{f"train/{name}": value for name, value in result.metrics.items() if not name.startswith("_")},
                   **result.source_metrics,
                   **flops.achieved(tokens_per_s, self.flops_per_token, self.env.world_size,
                                     self.peak.tflops if self.peak else None)}
        metrics.update(self.checkpointer.stall_of_previous_step(result.step - 1))
        self.unlogged_gc_s += result.gc_s
        if self.unlogged_gc_s:  # carried to the next logged record: log_every need not divide gc_every
            metrics["perf/gc_s"] = self.unlogged_gc_s
        if self.cfg.recipe.compile:
            metrics["perf/compiled_graphs"] = compiled_graphs() - self.graphs_before
        if len(self.splits.names) > 1:  # a mixture: every rank knows the global order, no collective needed
            counts = self.sampler.source_counts((result.step - 1) // self.objective.steps_per_batch,
                                                len(self.splits.names))
            metrics.update({f"data/source/{name}_samples": n for name, n in zip(self.splits.names, counts)})
        self.progress.update(result.step, result.loss, result.lr, result.grad_norm, tokens_per_s,
                             console.reward_detail(result.source_metrics))
        if self.env.is_main:
            self.flat_rewards.observe(result.step, result.source_metrics)
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
            elif "val/teacher_kl" in metrics:
                detail = (f"per-token reverse KL to the teacher on greedy completions of {metrics['val/prompts']} "
                          f"held-out prompts, mean {metrics['val/completions/mean_length']:.1f} tokens")
            elif "val/rewards/accuracies" in metrics:
                # Accuracy counts pairs whose chosen reward is strictly higher; with the policy still
                # the reference every reward is 0: a tie, not a wrong answer.
                ties = metrics["val/rewards/accuracies"] == 0 and metrics["val/rewards/margins"] == 0
                detail = (f"preference accuracy {metrics['val/rewards/accuracies']:.3f}"
                          f"{' (every pair a tie: the policy is still the reference)' if ties else ''}, margin "
                          f"{metrics['val/rewards/margins']:.4f}")
            else:
                detail = ", ".join(f"{k[4:]} {v:.4f}" for k, v in metrics.items() if k.startswith("val/rewards/"))
            if "val/loss" in metrics:
                log.info("eval at step %d: val loss %.4f (%s)%s", step, metrics["val/loss"], detail,
                         f", train loss {train_loss:.4f}" if train_loss is not None else "")
            else:  # an online objective: the mean reward of greedy completions of held-out prompts
                log.info("eval at step %d: val reward %.4f ± %.4f (standard error) over %d prompts (%s), mean "
                         "completion %.1f tokens", step, metrics["val/reward"], metrics["val/reward_stderr"],
                         metrics["val/prompts"], detail, metrics["val/completions/mean_length"])
        if step == self.t.max_steps and step > 0:
            self.summary["final_val"] = {k: v for k, v in metrics.items() if k in ("val/loss", "val/perplexity",
                                         "val/reward", "val/reward_stderr") or k.startswith("val/rewards/")}
        return metrics

    def _on_unhealthy(self, result: StepResult) -> None:
        last_healthy = self.checkpointer.latest or (str(self.resume_from) if self.resume_from else None)
        on_nonfinite(self.t, result.step, result.loss, result.grad_norm, result.spike, self.skipped_in_a_row,
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
            written = export_hf(self.engine, self.cfg, self.tokenizer, self.run_dir,
                                       data.end_token_ids(self.cfg.data, self.tokenizer))
            summary.update(written)
            if written:
                closing.append("exported: " + "; ".join(f"{path} ({kind})" for kind, path in written.items()))
        if self.env.is_main:
            goodput.timeline_event(self.run_dir, "end", step=self.state.step,
                                   reason="preempted" if "preempted_at" in summary else "finished")
            self._write_expert_load()
            if self.cfg.tracker.report and (png := _write_report_or_warn(self.run_dir)):
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
        self.close_sampler()
        self.engine.close()
        distributed.barrier()
        return summary

    def close_sampler(self) -> None:
        """Stop what an online objective's rollout engine started (a vLLM server); idempotent."""
        if getattr(self, "online_parts", None):
            self.online_parts[0].close()


def _write_report_or_warn(run_dir: Path) -> str | None:
    # matplotlib (about 0.5 s) is imported only by runs that write a report, and only when they end.
    from llmtrain.monitoring.report import write_report_or_warn

    return write_report_or_warn(run_dir)


def train(cfg: Any) -> dict[str, Any]:
    """Run (or resume) training as configured (:class:`Trainer`); returns its summary (per-step
    losses, lrs, paths written).

    Raises:
        llmtrain.common.errors.LlmtrainError: bad input (config, data, model source, launch, checkpoint),
            raised before anything is written; TrainingStopped for a run that stops itself.
    """
    trainer = Trainer(cfg)  # on failure it gives the garbage collector back itself, as its train() does
    try:
        return trainer.train()
    finally:
        trainer.watchdog.stop()  # also when the loop raises: a process that lives on is not watched
        trainer.close_sampler()  # a server started for the run stops with it, on errors too
