"""When a run saves: the trainer's checkpoint cadence (steps, minutes, preemption, the last step,
the steps in-loop evaluations need) around :class:`~llmtrain.checkpoint.protocol.CheckpointManager`,
background writes sealed once every rank's is done, trackers flushed before a checkpoint counts.
Also the run's checkpoints opened at start-up (:func:`open_checkpoints`: the one to resume, checked)
and its train state loaded (:func:`resume_state`), and the debugging dump of a model as loaded on
resume (``LLMTRAIN_DUMP_AFTER_LOAD``)."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

from llmtrain.checkpoint.protocol import CheckpointManager, step_of
from llmtrain.checkpoint.resume import check_resumable
from llmtrain.checkpoint.state import TrainState
from llmtrain.common.errors import DataError
from llmtrain.engine.base import check_optimizer_steps
from llmtrain.monitoring import goodput
from llmtrain.monitoring.preemption import Preemption
from llmtrain.monitoring.tracking import Tracker

log = logging.getLogger("llmtrain")


class Checkpointer:
    """The run's checkpoint cadence and bookkeeping around :class:`CheckpointManager`:
    every ``trainer.save_every`` steps, when ``trainer.save_every_minutes`` is due, on
    preemption, and at the last step; background writes sealed once every rank's is done. Every
    tracker is flushed before a checkpoint counts and committed after it (steps up to a counted
    checkpoint are never logged twice across a crash)."""

    def __init__(self, manager: CheckpointManager, engine, tracker: Tracker, preemption: Preemption,
                 cfg: Any, config_yaml: str, world_size: int, resumed_from: str | Path | None = None):
        self.manager, self.engine, self.tracker, self.preemption = manager, engine, tracker, preemption
        self.t, self.config_yaml, self.world_size = cfg.trainer, config_yaml, world_size
        self.latest: str | None = None  # the newest counted checkpoint this process saved
        self.resumed_from = str(resumed_from) if resumed_from is not None else None
        self.stalls_s: list[list[float]] = []  # [step, seconds the loop waited for its save] per save
        self.on_counted: list[Callable[[int, Path], None]] = []  # called (step, folder) once a checkpoint counts
        self.also_due: Callable[[int], bool] = lambda step: False  # other components' checkpoint steps

    def should_save(self, step: int, result: Any) -> bool:
        """Whether step ``step`` saves; ``result``: its :class:`llmtrain.trainer.StepResult` (``stop``:
        preempted, ``save_by_time``: ``trainer.save_every_minutes`` is due)."""
        every = self.t.save_every
        return (result.stop or result.save_by_time or bool(every and step % every == 0) or step == self.t.max_steps
                or self.also_due(step))

    def save(self, state: TrainState, background: bool) -> None:
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

    @property
    def last_counted(self) -> str | None:
        """The checkpoint the same command continues from now: the newest this process saved,
        else the one it resumed from (None: neither)."""
        return self.latest or self.resumed_from

    def save_between_steps(self, state: TrainState) -> None:
        """A preemption that dropped a step before it trained (its sampling stopped: ``state`` is
        that of the end of the last finished step): the background write in flight sealed, then
        ``state`` saved as a preemption at that step's end saves it, unless a checkpoint of it
        already counts (that step saved, or it is the one the run resumed from) or no step
        trained. Collective call."""
        if sealed := self.manager.finish_background():
            self._commit(sealed)
        counted = self.last_counted
        if state.step == 0 or (counted is not None and step_of(Path(counted)) == state.step):
            return
        self.save(state, background=False)

    def seal_if_written(self, scalars: Any, state: TrainState) -> None:
        """Every rank's background write is done (``scalars.background_written``, the step's flag summed
        over ranks, :class:`llmtrain.trainer.StepScalars`): make it count."""
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
        self.manager.finish_pruning()  # checkpoints pruned in the background are gone on return

    def _commit(self, sealed: Path) -> None:
        self.latest = str(sealed)
        self.tracker.commit(step_of(sealed))
        for counted in self.on_counted:
            counted(step_of(sealed), sealed)

    def stopped_by_data(self, err: Exception, step: int) -> DataError:
        """The error that ends a run whose data could not be read in ``step`` (1-based; a store
        that stays down): ``err`` and the checkpoint the same command continues from."""
        latest = self.last_counted
        return DataError(f"{err}; stopped in step {step}, " + (
            f"the last checkpoint {latest} stands: the same command continues from it once the data can be read"
            if latest else "before any checkpoint: the same command starts again"))

    def stall_of_previous_step(self, step: int) -> dict[str, float]:
        """``checkpoint/stall_s`` for the record of the step after a save."""
        if self.stalls_s and self.stalls_s[-1][0] == step:
            return {"checkpoint/stall_s": self.stalls_s[-1][1]}
        return {}


def dump_loaded_model(engine) -> None:
    """Debugging aid: LLMTRAIN_DUMP_AFTER_LOAD=FILE writes the just-loaded model's consolidated
    state dict (``torch.save``), to compare a resume against its checkpoint. Collective call."""
    path = os.environ.get("LLMTRAIN_DUMP_AFTER_LOAD")
    if path:
        state = engine.full_state_dict()
        if state is not None:
            torch.save(state, path)


def checkpoint_bytes(trained_parameters: int, engine: str, zero_stage: int) -> int:
    """About how many bytes one checkpoint takes: each trained parameter's fp32 value and its two
    AdamW moments (12 bytes; measured 12.0-12.9 with DCP's metadata, and under ZeRO-3), 16 under
    DeepSpeed ZeRO-1/2, whose checkpoints hold the weights once more (measured 16.0; docs/checkpoints.md,
    Disk use). Frozen parameters (LoRA's base, ``model.freeze``) are not in a checkpoint; RNG and small
    files are left out."""
    return trained_parameters * (16 if engine == "deepspeed" and zero_stage in (1, 2) else 12)


def warn_if_disk_is_short(run_dir: Path, keep: int, per_checkpoint: int) -> bool:
    """Warn (and return True) when the file system of ``run_dir`` has less free space than
    ``keep + 1`` checkpoints of ``per_checkpoint`` bytes need (a new one is written before the
    oldest kept one is deleted), naming both figures and what to change."""
    folder = next(p for p in (run_dir, *run_dir.absolute().parents) if p.exists())
    free, need = shutil.disk_usage(folder).free, (keep + 1) * per_checkpoint
    if free >= need:
        return False
    log.warning("%s has %.1f GiB free, but trainer.keep_checkpoints=%d needs about %.1f GiB (%d checkpoints of %.2f "
                "GiB while the newest is written): free space, lower trainer.keep_checkpoints, or set run_dir on "
                "another disk", folder, free / 2**30, keep, need / 2**30, keep + 1, per_checkpoint / 2**30)
    return True


def open_checkpoints(run_dir: Path, cfg: Any, env: Any,
                     fingerprint: str | None) -> tuple[CheckpointManager, Path | None, dict[str, torch.Tensor]]:
    """A run's checkpoint manager, the checkpoint to resume (``trainer.resume``; checked
    compatible with ``cfg``) if any, and its rollout state (an online objective's pending
    generation batch; empty when fresh). A rerun of the same command (``resume=auto``) says what
    a crash cost.

    Raises:
        ResumeError: a checkpoint that cannot resume this config.
    """
    t = cfg.trainer
    manager = CheckpointManager(run_dir, env, t.keep_checkpoints)
    resume_from = manager.resolve(t.resume)
    rollout_state: dict[str, torch.Tensor] = {}
    if resume_from is not None:
        check_resumable(resume_from, cfg, manager, env.is_main, fingerprint)
        rollout_state = manager.read_rank_state(resume_from, "rollout")
    if env.is_main and t.resume == "auto":
        previous = goodput.unfinished_process(run_dir)
        resumed_step = step_of(resume_from) if resume_from is not None else 0
        if previous is not None and previous["last_step"] > resumed_step:
            # Said by announce(), once start-up checks pass: a config error would follow it otherwise.
            manager.notes.append((logging.WARNING,
                                  f"resume={t.resume}: {goodput.describe_unfinished(previous, resumed_step)}"))
    return manager, resume_from, rollout_state


def resume_state(manager: CheckpointManager, resume_from: Path | None, engine: Any, world_size: int,
                 global_batch_size: int, fingerprint: str | None) -> tuple[TrainState, dict | None]:
    """A fresh train state, or the resumed checkpoint's (and its RNG states) loaded into
    ``engine``; the optimizer's update count checked against it. Collective call."""
    state, rng = TrainState(world_size=world_size, global_batch_size=global_batch_size,
                            base_fingerprint=fingerprint), None
    if resume_from is not None:
        state, rng = manager.load(engine, resume_from)
        state.parent = resume_from.name
        manager.start_branch(resume_from)
        dump_loaded_model(engine)
    check_optimizer_steps(engine, state)
    return state, rng
