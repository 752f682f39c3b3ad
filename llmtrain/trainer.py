"""The training run: a :class:`Trainer` whose ``_setup_*`` methods each build one component, a
:meth:`Trainer.train_step` for one optimizer step, and a :meth:`Trainer.train` loop in which each
component decides its own cadence (the checkpointer, :mod:`llmtrain.checkpoint.checkpointer`; the
evaluator, :mod:`llmtrain.evaluation.validation`; the tracker, :mod:`llmtrain.monitoring.tracking`).

The loss of an optimizer step is the run's objective (:mod:`llmtrain.objectives`) over the whole
global batch: each micro-batch contributes ``sum(loss) / N`` where ``N`` is the objective's
normaliser (target tokens for next-token training) of all micro-batches on all ranks, so
gradient accumulation and data parallelism give exactly the gradient of one big batch, whatever
the padding.

One step, who calls whom: ``Trainer.train_step`` → :func:`~llmtrain.engine.step.forward_backward`
(one all-reduce of the normaliser, ``Engine.accumulate_gradients`` → per micro-batch ``Engine.forward`` → ``Objective.
loss_sums`` → ``Engine.backward``, then one all-reduce of the loss sums and :class:`StepScalars`)
→ ``Engine.step`` (clip, update, schedule) → :class:`StepResult`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from llmtrain import data
from llmtrain.checkpoint.checkpointer import (Checkpointer, checkpoint_bytes, open_checkpoints, resume_state,
                                              warn_if_disk_is_short)
from llmtrain.checkpoint.export import export_hf, write_policy
from llmtrain.checkpoint.protocol import lock_run_dir
from llmtrain.checkpoint.state import restore_rng
from llmtrain.common import allocator, collection, hardware
from llmtrain.common.errors import ConfigError, DataError
from llmtrain.config.compose import run_dir_of
from llmtrain.config.validate import validate
from llmtrain.data.order import sample_digest
from llmtrain.engine import build_engine
from llmtrain.engine.base import check_optimizer_steps
# The step's types and its global-batch loss; imported from here by tests and benchmarks too.
from llmtrain.engine.step import StepResult, StepScalars, forward_backward  # noqa: F401
from llmtrain.evaluation import in_loop
from llmtrain.evaluation.validation import Evaluator, evaluate, log_eval
from llmtrain.models import adapters, moe, quantize
from llmtrain.models.blank_image import keep_tower_in_every_forward
from llmtrain.models.build import build_model, build_tokenizer, check_sequence_length, language_config, model_config
from llmtrain.models.vision import is_image_text
from llmtrain.monitoring import console, goodput
from llmtrain.monitoring.ending import log_preempted, write_report_at_end
from llmtrain.monitoring.health import FlatRewards, loss_spike, on_nonfinite, peak_memory_bytes
from llmtrain.monitoring.preemption import Preemption
from llmtrain.monitoring.startup import (StartupInterrupted, StartupPhases, engine_detail, interrupted_line, log_run,
                                         log_trainable, model_detail)
from llmtrain.monitoring.tracking import Tracker
from llmtrain.monitoring.watchdog import Watchdog
from llmtrain.objectives import build_objective, reference
from llmtrain.parallel import distributed
from llmtrain.parallel.dims import ParallelDims
from llmtrain.parallel.parallelize import compiled_graphs
from llmtrain.parallel.seeding import seed_everything, seed_streams
from llmtrain.planning import flops
from llmtrain.planning.auto import check_same_layout
from llmtrain.planning.preflight import preflight
from llmtrain.rollout import SamplingInterrupted
from llmtrain.rollout.online import held_out_detail, setup_online

log = logging.getLogger("llmtrain")


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
            self.stop_children()  # a server the first evaluation started, evaluations a resume restarted
            raise

    def _interrupted(self) -> str:
        """Close what start-up had opened when SIGINT stopped it (the tracker, with the timeline's
        end event, so a rerun does not report a crash; a rollout server) and say where it stopped."""
        def close() -> str:
            tracker, left = getattr(self, "tracker", None), ""
            if tracker is not None:
                tracker.finish(complete=False)
                if self.env.is_main:
                    goodput.timeline_event(self.run_dir, "end", step=self.state.step, reason="interrupted")
                left = (f"; {self.run_dir} keeps its checkpoints" if self.resume_from is not None else
                        f"; {self.run_dir} holds config.yaml and logs, no checkpoint")
            self.close_sampler()
            return left

        return interrupted_line(getattr(self, "phases", None), close)

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
        allocator.set_mmap_threshold(self.t.malloc_mmap_threshold)  # validated; before the model and data
        self.trim = allocator.trimmer(self.t.malloc_mmap_threshold)
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
        self.checkpoints, self.resume_from, self.rollout_state = open_checkpoints(self.run_dir, cfg, self.env,
                                                                                  self.fingerprint)
        self.objective = build_objective(cfg.get("objective"))
        self.objective.setup(cfg)
        # What the objective needs that only the data can tell (a margin column, a resumed run's
        # precomputed reference log-probs matching it), before anything is written: DataError, ResumeError.
        reference.check_data(self.cfg, self.objective, self.splits, self.run_dir, self.resume_from is not None)
        self.online = setup_online(cfg, self.objective, self.tokenizer, self.splits, self.env, self.dims, phases,
                                   lambda m: model_config(m).vocab_size, self.hf_config.vocab_size,
                                   lambda *where: write_policy(self.engine, cfg, self.tokenizer, *where))  # vLLM's weights
        # Dynamo's count is per process: another run earlier in it (a sweep, a test) is not ours.
        self.graphs_before = compiled_graphs()
        self.engine = self._setup_engine()
        phases.begin("train state")
        self.state, rng = resume_state(self.checkpoints, self.resume_from, self.engine, self.env.world_size,
                                       self.t.global_batch_size, self.fingerprint)
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
        self.summary: dict[str, Any] = {"losses": [], "lrs": [], "run_dir": str(self.run_dir), "start_step": self.state.step}
        if self.resume_from is not None:
            phases.begin("resume")
        elif self.t.eval_every:  # trainer.eval_every=0: no evaluation before the last step, step 0's included
            phases.begin("first evaluation", held_out_detail(cfg, self.objective.online))
        self._evaluate_before_training()
        # After everything that draws random numbers at start-up: the dropout streams of the loop.
        if rng is not None:
            restore_rng(rng)
        else:
            seed_streams(self.t.seed, self.engine.dp_rank, self.engine.pp_rank, self.state.step)
        self.preemption = Preemption(self.t.preempt_signal, self.t.save_every_minutes, distributed.scheduler_signal())
        self.micro_batches.stop_when = lambda: self.preemption.requested  # a step waiting on a hung store stops
        if self.objective.online:  # so does a step's sampling (llmtrain.rollout.rollout: the step is dropped)
            self.batches.stop_when = self._sampling_tick
        self.checkpointer = Checkpointer(self.checkpoints, self.engine, self.tracker, self.preemption, cfg,
                                         self.config_yaml, self.env.world_size, self.resume_from)
        self.task_evals = self._setup_task_evals()
        self.progress = console.Progress(self.t.progress_bar and self.env.is_main, self.t.max_steps, self.state.step,
                                         self.t.log_every)
        if self.objective.online and self.progress.on_bar:  # a slow step's sampling shows in the bar, not as lines
            self.batches.show = self.progress.note
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
            try:
                result = self.train_step(step)
            except DataError as err:  # mid-run: the data could not be read (a store that stays down)
                raise self.checkpointer.stopped_by_data(err, step + 1) from err
            except SamplingInterrupted:  # preempted while the step sampled: dropped, the last step's end saved
                self.checkpointer.save_between_steps(self.state)
                self.summary["preempted_at"] = self.state.step  # close() says so, last
                break
            self.watchdog.set("log")
            metrics = self._step_metrics(result)
            evaluated = self.evaluator.should_run(result.step)
            if evaluated:
                self.watchdog.set("eval")
                metrics.update(self._log_eval(result.step, self.evaluator.run(self.state), result.loss))
            if self.tracker.should_log(result.step) or evaluated or not result.healthy:
                self.tracker.log(metrics, step=result.step)
                self.unlogged_gc_s = 0.0
                if self.env.is_main:  # tokens per expert per layer so far (the checkpointed count), for the report
                    moe.write_expert_load(self.run_dir, self.state.step, self.engine.moe_shape, self.state.expert_load)
            if not result.healthy:  # trainer.nonfinite: skip, stop after the last healthy checkpoint, or raise
                on_nonfinite(self.t, result.step, result.loss, result.grad_norm, result.spike, self.skipped_in_a_row,
                             self.checkpointer.last_counted,
                             lambda: self._close_outputs(complete=False))
            check_optimizer_steps(self.engine, self.state)
            self.watchdog.set("checkpoint")
            self.checkpointer.seal_if_written(result.scalars, self.state)
            if self.checkpointer.should_save(result.step, result):
                # The last save and a preemption's are synchronous: the process ends after them.
                background = self.t.async_checkpoint and not result.stop and result.step < self.t.max_steps
                self.checkpointer.save(self.state, background)
            self.task_evals.poll()
            if result.stop:
                self.summary["preempted_at"] = result.step  # close() says so, last
                break

    def train_step(self, step: int) -> StepResult:
        """One optimizer step (``step`` is 0-based; the result's ``step`` counts it done): the
        global batch's gradient, the update (dropped under ``trainer.nonfinite=skip`` when the
        loss or norm is not finite or spikes), and the train state advanced."""
        started = time.perf_counter()
        self.watchdog.set("data", step + 1)
        self.trim()  # the last step's freed pages back before sampling and before the training pass
        host_batches, source_metrics = self.batches.for_step(step)
        self.trim()
        data_wait_s, source_metrics = self.micro_batches.take_wait(), {**source_metrics, **self.micro_batches.take_work()}
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
                            sums.metrics, sums.scalars, stop, save_by_time, spike, sums.router, source_metrics, gc_s,
                            data_wait_s)
        self._advance_state(result)
        return result

    # ---- set-up: one component each ------------------------------------------------------------
    def _setup_layout(self) -> tuple[ParallelDims, int]:
        """Validate the config (pure rules, then the machine's packages, files, servers and
        evaluation tasks) and return the parallel dimensions and the gradient accumulation steps."""
        layout = validate(self.cfg, self.env.world_size)
        preflight(self.cfg)
        if self.t.eval_tasks:
            in_loop.check(self.t, image_text=is_image_text(model_config(self.cfg.model)))
        if self.cfg.recipe.auto and self.env.world_size > 1:
            check_same_layout(self.cfg, self.env.device)
        console.configure_library_output(self.env.is_main, console.interactive())
        return ParallelDims.from_layout(layout), layout.accumulation

    def _setup_tokenizer(self) -> tuple[Any, Any]:
        """The tokenizer and the model's ``transformers`` config (a vision-language model's
        language part: layers, heads and vocabulary), checked against each other and the data's
        sequence length before the data is tokenized."""
        tokenizer, hf_config = build_tokenizer(self.cfg.model), language_config(self.cfg.model)
        if len(tokenizer) > hf_config.vocab_size:
            raise ConfigError(f"model.architecture.vocab_size={hf_config.vocab_size} is smaller than the tokenizer's "
                              f"{len(tokenizer)} tokens; raise it to at least {len(tokenizer)}")
        too_long = check_sequence_length(hf_config, self.cfg.data.seq_len)
        if too_long and self.env.is_main:
            log.warning("%s", too_long)
        return tokenizer, hf_config

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

    def _build_model(self):
        """The model with its initial weights (the policy, or its frozen reference copy); an
        image-text model runs its vision tower in every forward (llmtrain.models.blank_image)."""
        model = build_model(self.cfg.model, self.t.seed, head=self.objective.model_output,
                            pad_token_id=data.pad_id_of(self.tokenizer))
        return keep_tower_in_every_forward(model, self.tokenizer)

    def _setup_reference(self):
        """The reference policy of an objective that has one: log-probs precomputed into the data
        (returns None), or a live reference called on every micro-batch. Collective call."""
        return reference.setup_reference(self.cfg, self.objective, self.engine, self.splits,
                                         lambda: data.collator_for(self.cfg.data, self.tokenizer), self.env,
                                         self.dims.dp, self.run_dir, self.resume_from is not None, self.phases,
                                         self._build_model,
                                         lambda: self.online.setup_teacher(self.engine,
                                                                           lambda m: build_model(m, self.t.seed)))

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
        goodput.start_run(self.run_dir, state, tracker.redone_records, self.process_started, resumed, env.is_main,
                          env.world_size, cfg.recipe.name)
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
        current step on, read ``data.prefetch`` micro-batches ahead (:class:`~llmtrain.data.prefetch.Feed`)."""
        t, per = self.t, self.objective.steps_per_batch  # GRPO's μ steps train on one batch of prompts
        loader, sampler = data.train_loader(self.splits, self.tokenizer, self.cfg.data, t.seed, t.micro_batch_size,
                                            self.accumulation, self.engine.dp_rank, self.dims.dp,
                                            start_step=-(-self.state.step // per), max_steps=-(-t.max_steps // per))
        return sampler, data.Feed(iter(loader), self.cfg.data.prefetch, work=getattr(loader.collate_fn, "take_metrics", None))

    def _setup_batches(self, val_batches: list[dict]) -> tuple[Any, Evaluator]:
        """The step's batch source and the held-out evaluator: the data loader's micro-batches and
        the held-out loss, or an online objective's rollout (:mod:`llmtrain.rollout`: sampled,
        scored completions; held-out greedy rewards)."""
        t = self.t
        if not self.objective.online:
            source = data.StepBatches(self.micro_batches, self.accumulation, self.objective.prepare)
            return source, Evaluator(lambda: evaluate(self.engine, val_batches, self.env.device), t.eval_every,
                                     t.max_steps)
        rollout = self.online.setup_rollout(self.engine, self.micro_batches, self.run_dir,
                                            lambda rows, step: self.tracker.log_table("completions", rows, step),
                                            lambda batches: evaluate(self.engine, batches, self.env.device),
                                            self.rollout_state, self.checkpoints.rank_state)
        return rollout, Evaluator(lambda: self.online.held_out_rewards(rollout, val_batches, t.progress_bar),
                                  t.eval_every, t.max_steps)

    def _setup_flops(self) -> tuple[float, flops.Peak | None]:
        """Model FLOPs per token (PaLM appendix B) at ``data.seq_len``, and the peak TFLOP/s per
        device MFU is measured against (:func:`llmtrain.planning.flops.peak_tflops`: configured,
        data sheet, or a matmul probe of this machine; collective on a CPU), said at start-up and
        recorded in the timeline for the run report."""
        return flops.for_run(self.engine.model, self.hf_config, self.cfg, self.env, self.partial, self.run_dir,
                             lambda detail: self.phases.begin("peak flops probe", detail))

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

    def _sampling_tick(self) -> str | None:
        """Asked at each decode step of a step's sampling: whether a preemption asks it to stop;
        and the step moves on for the hang watchdog (a rank with longer completions is not hung)."""
        self.watchdog.moved()
        return self.preemption.requested

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
            log_run(cfg, dims, env.world_size, num_parameters, self.splits, self.objective.name, self.accumulation,
                    self.precision_reason)
            log.info("%s", data.describe(self.splits, cfg.data))
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
            state.expert_load = moe.add_expert_load(state.expert_load, result.router, self.engine.hf_layers,
                                                    self.engine.moe_shape.num_experts)

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
        if data.remote.retries():  # object-storage reads retried after a transient fault (this process)
            metrics["data/retries"] = data.remote.retries()
        if self.cfg.recipe.compile:
            metrics["perf/compiled_graphs"] = compiled_graphs() - self.graphs_before
        if len(self.splits.names) > 1:  # a mixture
            metrics.update(self.sampler.source_metrics((result.step - 1) // self.objective.steps_per_batch,
                                                       self.splits.names))
        self.progress.update(result.step, result.loss, result.lr, result.grad_norm, tokens_per_s,
                             console.reward_detail(result.source_metrics))
        if self.env.is_main:
            self.flat_rewards.observe(result.step, result.source_metrics)
        metrics.update(goodput.time_metrics(state))
        metrics["time/data_wait_s"] = result.data_wait_s
        if not result.healthy:
            metrics["train/skipped_update"] = int(self.t.nonfinite == "skip")
        if result.router is not None:
            metrics.update(moe.step_record(result.router, self.engine.hf_layers, self.engine.moe_shape,
                                           self.engine.router_coef, self.accumulation * self.dims.dp))
        return metrics

    def _log_eval(self, step: int, metrics: dict[str, float], train_loss: float | None = None) -> dict[str, float]:
        if self.env.is_main:
            log_eval(step, metrics, train_loss)
        if step == self.t.max_steps and step > 0:
            self.summary["final_val"] = {k: v for k, v in metrics.items() if k in ("val/loss", "val/perplexity",
                                         "val/reward", "val/reward_stderr") or k.startswith("val/rewards/")}
        return metrics

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
            moe.write_expert_load(self.run_dir, self.state.step, self.engine.moe_shape, self.state.expert_load)
            png = write_report_at_end(self.run_dir) if self.cfg.tracker.report else None
            if png:
                summary["report"] = png
                closing.append(f"run report: {png} and {Path(png).with_suffix('.md')}")
                self.tracker.log_files([self.run_dir / "report.png", self.run_dir / "report.md"])  # MLflow, wandb
        self.tracker.finish()
        for line in closing:
            log.info("%s", line)
        if self.env.is_main and "preempted_at" in summary:
            log_preempted(self.preemption.requested, summary["preempted_at"], bool(distributed.scheduler_signal()))
        self.close_sampler()
        self.engine.close()
        distributed.barrier()
        return summary

    def stop_children(self) -> None:
        """Stop each process group this run started (a vLLM server, task evaluations) and give the
        signals their handlers back (a process that lives on, a test's, stops on Ctrl-C again): an error's ending."""
        self.close_sampler()
        if getattr(self, "preemption", None) is not None:
            self.preemption.restore()
        if getattr(self, "task_evals", None) is not None and self.env.is_main:
            self.task_evals.stop()  # a resume evaluates their checkpoints again

    def close_sampler(self) -> None:
        """Stop the data's read-ahead thread and what an online objective's rollout engine started
        (a vLLM server); idempotent. Every ending of a run comes here."""
        if getattr(self, "micro_batches", None) is not None:
            self.micro_batches.close()
        if getattr(self, "online", None):
            self.online.close()


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
        trainer.stop_children()  # a server started for the run stops with it, on errors too
