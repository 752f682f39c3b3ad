"""Whether a checkpoint can resume this config: the same run continues (only the keys in
:data:`RESUMABLE_CHANGES` may differ; the layout may change on the torch engine), on the same base
weights for a partial run (LoRA, ``model.freeze``); otherwise a
:class:`~llmtrain.common.errors.ResumeError` says what differs and how to start a new run."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from llmtrain.checkpoint.protocol import CheckpointManager
from llmtrain.checkpoint.state import TrainState
from llmtrain.common.errors import ResumeError

log = logging.getLogger("llmtrain")


# Settings a resumed run may change: cadence, bookkeeping and the length of the run. Everything
# else (model, data, recipe, optimisation, seed) defines the run being continued.
RESUMABLE_CHANGES = ("name", "run_dir", "tracker", "trainer.max_steps", "trainer.eval_every", "trainer.eval_samples",
                     "trainer.log_every", "trainer.save_every", "trainer.save_every_minutes", "trainer.keep_checkpoints",
                     "trainer.checkpoint_hash", "trainer.async_checkpoint", "trainer.resume", "trainer.preempt_signal", "trainer.export_hf", "trainer.progress_bar",
                     "trainer.peak_tflops", "trainer.hang_timeout_s", "trainer.gc_every", "trainer.malloc_mmap_threshold",
                     # How the data are read, not which: the same samples in the same order (a run
                     # that a slow store stopped is resumed with a longer timeout or more read-ahead).
                     "data.read_timeout_s", "data.prefetch",
                     # Scoring the checkpoints reads them and changes nothing of the training.
                     "trainer.eval_tasks", "trainer.eval_tasks_every", "trainer.eval_tasks_async",
                     "trainer.eval_tasks_limit", "trainer.eval_tasks_batch_size", "trainer.eval_tasks_device",
                     "trainer.eval_tasks_include", "trainer.eval_tasks_bootstrap_iters", "trainer.eval_tasks_data_dir",
                     # Memory knobs that do not change what is computed (recomputation, the loss in
                     # chunks, where each row's tokens live): what a run that ran out of memory changes.
                     "trainer.activation_checkpointing", "trainer.loss_chunk_tokens", "recipe.cp", "recipe.cp_style",
                     # The same experts' math by another kernel, and experts spread over other ranks.
                     "model.experts_implementation", "recipe.ep")


# With the torch engine on both sides, the checkpoint is a Distributed Checkpoint keyed by
# parameter name, so the parallel layout (the recipe: FSDP2 / TP / PP degrees, ZeRO stage,
# schedule) may change on resume: DCP reshards.
LAYOUT_KEYS = ("recipe", "engine")


def _saved_and_current(checkpoint_dir: Path, current: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint's resolved config and ``current``, both flattened to dotted keys."""
    import yaml

    saved = yaml.safe_load((checkpoint_dir / "config.yaml").read_text()) or {}

    def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(tree, dict):
            out: dict[str, Any] = {}
            for key, value in tree.items():
                out.update(flatten(value, f"{prefix}{key}."))
            return out
        return {prefix[:-1]: tree}

    return flatten(saved), flatten(current)


def _differences(old: dict, new: dict, keep) -> list[str]:
    from llmtrain.config.keys import added_at_default
    from llmtrain.config.schema import canonical_format

    def same(k: str) -> bool:
        if k not in old and k in new:
            return added_at_default(k, new[k])  # a field newer than the checkpoint, at its default
        return canonical(k, old.get(k)) == canonical(k, new.get(k))

    def canonical(k: str, value: Any) -> Any:
        # A format renamed since older checkpoints were written: same meaning, new spelling.
        return canonical_format(value) if k == "data.format" and isinstance(value, str) else value

    return [f"{k}: {old.get(k, '<absent>')} -> {new.get(k, '<absent>')}"
            for k in sorted(set(old) | set(new)) if keep(k) and not same(k)]


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == a or key.startswith(a + ".") for a in prefixes)


def keys_outside_schema(checkpoint_dir: Path, current: dict) -> list[str]:
    """Keys of the checkpoint's config that the schema has no field for: written by runs from
    before the schema was closed (``+trainer.max_step=10`` was stored and ignored)."""
    return _outside_schema(_saved_and_current(checkpoint_dir, current)[0])


def _outside_schema(old: dict) -> list[str]:
    from llmtrain.config.keys import is_schema_key

    return sorted(k for k in old if not is_schema_key(k))


def config_differences(checkpoint_dir: Path, current: dict) -> list[str]:
    """``key: saved -> current`` for every setting that differs from the checkpoint's resolved
    config, except :data:`RESUMABLE_CHANGES` (and :data:`LAYOUT_KEYS` when both the checkpoint
    and the current run use the torch engine) and :func:`keys_outside_schema`, which no run
    ever read."""
    old, new = _saved_and_current(checkpoint_dir, current)
    free = RESUMABLE_CHANGES + tuple(_outside_schema(old))
    if old.get("recipe.engine") == new.get("recipe.engine") == "torch":
        free = free + LAYOUT_KEYS
    return _differences(old, new, lambda key: not _under(key, free))


def layout_changes(checkpoint_dir: Path, current: dict) -> list[str]:
    """``key: saved -> current`` for the parallel-layout settings (:data:`LAYOUT_KEYS`) that differ."""
    old, new = _saved_and_current(checkpoint_dir, current)
    return _differences(old, new, lambda key: _under(key, LAYOUT_KEYS))


def check_base(checkpoint_dir: Path, saved: TrainState, model_cfg: Any, fingerprint: str | None,
               remedy: str = "resume with the base it was trained on, or start a new run_dir") -> None:
    """Refuse a partial checkpoint (LoRA, ``model.freeze``) whose trainable parameters were
    trained on other base weights than the model's source has now (``fingerprint``,
    :func:`llmtrain.models.adapters.base_fingerprint`); no check when either fingerprint is unknown.

    Raises:
        ResumeError: naming both fingerprints, the model and ``remedy``.
    """
    if saved.base_fingerprint and fingerprint and saved.base_fingerprint != fingerprint:
        raise ResumeError(
            f"checkpoint {checkpoint_dir} holds adapters/trainable parameters trained on base weights "
            f"{saved.base_fingerprint}, but model {model_cfg.get('name')} (source {model_cfg.get('source')}, path "
            f"{model_cfg.get('path')}) has weights {fingerprint}: {remedy}")


def check_resumable(resume_from: Path, cfg: Any, checkpoints: CheckpointManager, is_main: bool,
                    fingerprint: str | None = None) -> None:
    """Resuming continues the *same* run: refuse a checkpoint whose model, data, recipe or
    optimisation settings differ from the current config (naming each difference), or whose
    trainable parameters (LoRA, ``model.freeze``) were trained on other base weights
    (:func:`check_base`). A torch-engine run may change its parallel layout; that is said in the
    log (rank 0, ``is_main``).

    Raises:
        ResumeError: naming what differs and how to continue or start anew.
    """
    from omegaconf import OmegaConf

    saved = checkpoints.read_state(resume_from)
    check_base(resume_from, saved, cfg.model, fingerprint)
    if saved.global_batch_size != cfg.trainer.global_batch_size:
        raise ResumeError(
            f"checkpoint {resume_from} was trained with trainer.global_batch_size={saved.global_batch_size}; "
            f"resume it with the same value (got {cfg.trainer.global_batch_size}) so steps and samples line up")
    current = OmegaConf.to_container(cfg, resolve=True)
    differences = config_differences(resume_from, current)
    if differences:
        raise ResumeError(
            f"checkpoint {resume_from} belongs to a run with other settings ({'; '.join(differences)}). "
            "To continue it, use its settings; to start a new run, set a new run_dir (or name)")
    if not is_main:
        return
    ignored = keys_outside_schema(resume_from, current)
    if ignored:
        log.warning("checkpoint %s stores settings that are not config fields and were never used (%s); "
                    "ignoring them", resume_from, ", ".join(ignored))
    layout = layout_changes(resume_from, current)
    if layout:
        log.warning("resuming %s with another parallel layout (%s): %s", resume_from, "; ".join(layout),
                    "the Distributed Checkpoint is resharded" if cfg.recipe.engine == "torch" else
                    "each row's tokens are split anew; the ZeRO partitions follow the world size")
    if saved.step >= cfg.trainer.max_steps:
        log.warning("%s", past_max_steps(resume_from, saved.step, cfg))


def past_max_steps(resume_from: Path, step: int, cfg: Any) -> str:
    """What a run resumed from a checkpoint at ``step`` >= ``trainer.max_steps`` does: it trains
    nothing and exports that checkpoint's weights (``trainer.export_hf``) or nothing, and how to
    train more or start over."""
    max_steps = cfg.trainer.max_steps
    where = (f"is past trainer.max_steps ({step} > {max_steps})" if step > max_steps
             else f"is at trainer.max_steps={max_steps}: the run is finished")
    does = (f"exporting step {step}'s weights" if cfg.trainer.export_hf
            else "exporting nothing (trainer.export_hf=false)")
    return (f"checkpoint {resume_from} (step {step}) {where}; nothing to train, {does}. To train more, raise "
            f"trainer.max_steps above {step}; to start over, give a new name= (or run_dir=)")
