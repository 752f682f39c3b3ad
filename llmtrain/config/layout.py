"""The run's layout: parallel degrees and gradient accumulation, derived once from the config.

Pure functions of the recipe, the trainer's batch sizes and the world size (no torch, no
process group, no files), so :func:`llmtrain.config.validate.validate`, the planner, the dry run and the
trainer share one derivation. :class:`llmtrain.parallel.dims.ParallelDims` builds the device
mesh from a :class:`Layout` (``ParallelDims.from_layout``). Every failure is a
:class:`~llmtrain.common.errors.ConfigError` naming the fields, their values and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmtrain.common.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """Degrees whose product is ``world_size`` (``dp_replicate`` x ``dp_shard`` x ``cp`` x ``tp`` x
    ``pp``) and ``accumulation``, the micro-batches per rank per optimizer step. ``cp`` (context
    parallel) splits each sequence over that many ranks, which see the same samples. ``ep``
    (expert parallel) is not a factor of its own: it spreads each MoE layer's experts over
    ``ep`` ranks of ``dp_shard``, which still see different samples."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    accumulation: int
    cp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks that see different samples (replicate × shard)."""
        return self.dp_replicate * self.dp_shard

    @property
    def data_replicas(self) -> int:
        """Ranks that see the same samples (one data-parallel rank's tp x pp x cp group)."""
        return self.tp * self.pp * self.cp


def resolve_degrees(dp_replicate: int, dp_shard: int, tp: int, pp: int, world_size: int) -> tuple[int, int, int, int]:
    """``(dp_replicate, dp_shard, tp, pp)`` with a ``-1`` degree (at most one: "whatever is left
    of the world size") filled in, after checking that the product equals ``world_size``.

    Raises:
        ConfigError: a degree < 1 other than -1, more than one -1, a world size not divisible
            by the fixed degrees, or a product different from the world size.
    """
    degrees = {"recipe.dp_replicate": dp_replicate, "recipe.dp_shard": dp_shard, "recipe.tp": tp, "recipe.pp": pp}
    bad = {k: v for k, v in degrees.items() if v != -1 and v < 1}
    if bad:
        raise ConfigError(f"{', '.join(f'{k}={v}' for k, v in bad.items())}: degrees must be >= 1 (or -1 = derive)")
    derived = [k for k, v in degrees.items() if v == -1]
    if len(derived) > 1:
        raise ConfigError(f"only one degree may be -1, got {', '.join(f'{k}=-1' for k in derived)}")
    fixed = 1
    for k, v in degrees.items():
        if v != -1:
            fixed *= v
    described = " x ".join(f"{k}={v}" for k, v in degrees.items())
    if derived:
        if world_size % fixed:
            raise ConfigError(f"world size {world_size} is not divisible by {described} (fixed product {fixed}); "
                              f"launch a multiple of {fixed} processes or change the degrees")
        degrees[derived[0]] = world_size // fixed
    elif fixed != world_size:
        raise ConfigError(f"{described} = {fixed} but the world size is {world_size}; the product of the "
                          "degrees must equal the number of processes (or set one degree to -1)")
    return degrees["recipe.dp_replicate"], degrees["recipe.dp_shard"], degrees["recipe.tp"], degrees["recipe.pp"]


def context_parallel_degree(recipe: Any, world_size: int) -> int:
    """``recipe.cp``: ranks each sequence is split over (never derived; 1 = off).

    Raises:
        ConfigError: cp < 1, or a world size that is not a multiple of it.
    """
    cp = int(recipe.get("cp", 1) if hasattr(recipe, "get") else getattr(recipe, "cp", 1))
    if cp < 1:
        raise ConfigError(f"recipe.cp={cp}: the context-parallel degree must be >= 1 (1 = off; it is never derived)")
    if world_size % cp:
        raise ConfigError(f"recipe.cp={cp} does not divide the world size {world_size}; launch a multiple of {cp} "
                          "processes or change recipe.cp")
    return cp


def recipe_degrees(recipe: Any, world_size: int) -> tuple[int, int, int, int]:
    """``(dp_replicate, dp_shard, tp, pp)`` of ``recipe`` on ``world_size`` ranks. Unset
    data-parallel degrees follow the ZeRO stage: stage 0 replicates, stages 1-3 shard; the
    DeepSpeed engine shards (or, at stage 0, replicates) over every rank. They fill the world
    size divided by ``recipe.cp`` (:func:`context_parallel_degree`).

    Raises:
        ConfigError: see :func:`resolve_degrees` and :func:`context_parallel_degree`.
    """
    cp = context_parallel_degree(recipe, world_size)
    if cp > 1:
        try:
            return _recipe_degrees(recipe, world_size // cp)
        except ConfigError as err:
            raise ConfigError(f"{err} (recipe.cp={cp} takes its own factor: the other degrees multiply to world size "
                              f"{world_size} / cp {cp} = {world_size // cp})") from None
    return _recipe_degrees(recipe, world_size)


def _recipe_degrees(recipe: Any, world_size: int) -> tuple[int, int, int, int]:
    replicate, shard = recipe.dp_replicate, recipe.dp_shard
    if shard is None:
        shard = -1 if recipe.zero_stage > 0 and -1 not in (replicate, recipe.tp, recipe.pp) else 1
    if replicate is None:
        replicate = -1 if -1 not in (shard, recipe.tp, recipe.pp) else 1
    return resolve_degrees(replicate, shard, recipe.tp, recipe.pp, world_size)


def gradient_accumulation_steps(trainer: Any, dp_size: int) -> int:
    """Micro-batches per rank per optimizer step: global / (micro × dp).

    Raises:
        ConfigError: the global batch is not a multiple of micro-batch × data-parallel size.
    """
    per_pass = trainer.micro_batch_size * dp_size
    if trainer.global_batch_size % per_pass:
        raise ConfigError(
            f"trainer.global_batch_size={trainer.global_batch_size} is not divisible by "
            f"trainer.micro_batch_size={trainer.micro_batch_size} x data-parallel size={dp_size} "
            f"(= {per_pass}); choose a global batch that is a multiple of {per_pass}, or change "
            f"the micro-batch size or the number of ranks.")
    return trainer.global_batch_size // per_pass


def check_microbatches(pp: int, dp: int, accumulation_steps: int, stages_per_rank: int = 1) -> None:
    """A pipeline needs at least one micro-batch per stage per step; the interleaved schedule
    runs micro-batches in rounds of ``pp``, so their number must be a multiple of
    ``accumulation_steps // pp`` (torch.distributed.pipelining's rule).

    Raises:
        ConfigError: gradient accumulation steps (micro-batches per step) < pp, or not a
            multiple of the interleaved schedule's rounds.
    """
    if pp == 1:
        return
    derived = (f"trainer.global_batch_size / (trainer.micro_batch_size x dp={dp}) = "
               f"{accumulation_steps} micro-batches per step")
    if accumulation_steps < pp:
        raise ConfigError(f"recipe.pp={pp} needs at least {pp} micro-batches per step, but "
                          f"{derived}; raise the global batch or lower the micro-batch")
    rounds = max(1, accumulation_steps // pp)
    if stages_per_rank > 1 and accumulation_steps % rounds:
        raise ConfigError(f"recipe.pp_schedule=interleaved_1f1b with recipe.pp={pp}: {derived}, which "
                          f"is not a multiple of {rounds} rounds; use a multiple of recipe.pp micro-batches")


def layout(cfg: Any, world_size: int, micro_batch_size: int | None = None) -> Layout:
    """The :class:`Layout` of ``cfg`` (its ``recipe`` and ``trainer``) on ``world_size`` ranks:
    the degrees (:func:`recipe_degrees`), the gradient accumulation steps, and the pipeline's
    micro-batches per step checked against ``recipe.pp`` and its schedule.
    ``micro_batch_size`` replaces ``trainer.micro_batch_size`` (the planner tries several).

    Raises:
        ConfigError: degrees that do not multiply to ``world_size``, a global batch that is not
            a multiple of micro-batch x data-parallel size, or too few (or unevenly many)
            micro-batches for the pipeline; the message names the fields and the fix.
    """
    r, t = cfg.recipe, cfg.trainer
    dp_replicate, dp_shard, tp, pp = recipe_degrees(r, world_size)
    if micro_batch_size is not None:
        from types import SimpleNamespace

        t = SimpleNamespace(micro_batch_size=micro_batch_size, global_batch_size=t.global_batch_size)
    ep = int(r.get("ep", 1) if hasattr(r, "get") else getattr(r, "ep", 1))
    if ep > 1 and dp_shard % ep:
        raise ConfigError(f"recipe.ep={ep} does not divide recipe.dp_shard={dp_shard} on {world_size} rank(s) (expert "
                          "parallelism spreads each layer's experts over ranks of dp_shard); use an FSDP recipe "
                          f"(zero_stage >= 1) with dp_shard a multiple of {ep}, or change recipe.ep")
    accumulation = gradient_accumulation_steps(t, dp_replicate * dp_shard)
    check_microbatches(pp, dp_replicate * dp_shard, accumulation, r.pp_stages_per_rank)
    return Layout(world_size=world_size, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp,
                  accumulation=accumulation, cp=context_parallel_degree(r, world_size), ep=ep)
