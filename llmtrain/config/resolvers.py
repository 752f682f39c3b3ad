"""The interpolation resolvers of the config schema (:mod:`llmtrain.config.schema` registers them
when it is imported): ``recipe_engine``, ``recipe_name``, ``sweep_subdir`` and ``held_out_samples``."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf


def _recipe_engine(own: str, _root_: Any) -> str:
    """``recipe.engine``: the top-level ``engine=`` when given (one ZeRO recipe, either engine),
    else the recipe file's own."""
    top = _root_.get("engine") if "recipe" in _root_ else None  # alone, _root_ is the recipe itself
    return top or own


def _recipe_name(name: str, own_engine: str, _parent_: Any) -> str:
    """``recipe.name``: the file's name, with the engine appended when the recipe runs on another
    engine than its own (``zero3-torch``), so that run's default run_dir is not the other's."""
    engine = _parent_.engine
    return name if engine == own_engine else f"{name}-{engine}"


SWEEP_SUBDIR_MAX = 200  # bytes of a sweep job's folder name; file systems allow 255


def sweep_subdir(job_num: Any, overrides: str) -> str:
    """A sweep job's folder name: ``<job number>_<its overrides>`` (``3_trainer.lr=0.001``), with
    ``/`` made ``_`` (a value with a slash would nest folders) and a name longer than
    :data:`SWEEP_SUBDIR_MAX` bytes (UTF-8) cut, ending in a hash of the whole name so that it
    stays unique."""
    import hashlib

    name = f"{job_num}_{overrides}".rstrip("_").replace("/", "_")
    if len(name.encode()) > SWEEP_SUBDIR_MAX:
        digest = hashlib.sha1(name.encode()).hexdigest()[:8]
        kept = name.encode()[:SWEEP_SUBDIR_MAX - 10].decode(errors="ignore")
        name = f"{kept}..{digest}"
    return name


ONLINE_OBJECTIVES = ("grpo", "distill")  # their held-out evaluation generates (llmtrain.rollout)


def held_out_samples(objective: str, global_batch_size: Any) -> int:
    """``trainer.eval_samples``' default: 64, or for an online objective (its held-out prompts
    each get a greedy completion, decoded one prompt at a time) ``2 x trainer.global_batch_size``
    prompts, at most 64: about two training steps' sampling (a step samples its prompts' groups
    one prompt at a time too)."""
    return min(64, 2 * int(global_batch_size)) if objective in ONLINE_OBJECTIVES else 64


def register_resolvers() -> None:
    """Register the config's interpolation resolvers with OmegaConf (once per process)."""
    for name, resolver in (("recipe_engine", _recipe_engine), ("recipe_name", _recipe_name),
                           ("sweep_subdir", sweep_subdir), ("held_out_samples", held_out_samples)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)

