"""Parallel degrees and the device mesh of the torch-native engine.

One object derives and validates the data-parallel (replicate × shard), tensor-parallel and
pipeline-parallel degrees before any model is built, in the spirit of torchtitan's
``ParallelDims``: every failure names the fields, their values and the fix. It also builds the
``DeviceMesh`` (dims ``pp``, ``dp_replicate``, ``dp_shard``, ``tp``, outermost first, so a
tensor-parallel group is made of neighbouring ranks, i.e. one node where possible).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmtrain.config import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees whose product is the world size. ``-1`` in at most one field means "whatever is
    left of the world size". Field names match the recipe keys they will come from."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int, tp: int, pp: int, world_size: int) -> "ParallelDims":
        """Fill in a ``-1`` degree and check that the product equals ``world_size``.

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
        return cls(degrees["recipe.dp_replicate"], degrees["recipe.dp_shard"], degrees["recipe.tp"],
                   degrees["recipe.pp"], world_size)

    @classmethod
    def from_recipe(cls, recipe: Any, world_size: int) -> "ParallelDims":
        """Degrees of ``recipe`` on ``world_size`` ranks. Unset data-parallel degrees follow the
        ZeRO stage: stage 0 replicates, stages 1-3 shard; the DeepSpeed engine shards (or, at
        stage 0, replicates) over every rank.

        Raises:
            ConfigError: see :meth:`resolve`.
        """
        replicate, shard = recipe.dp_replicate, recipe.dp_shard
        if shard is None:
            shard = -1 if recipe.zero_stage > 0 and -1 not in (replicate, recipe.tp, recipe.pp) else 1
        if replicate is None:
            replicate = -1 if -1 not in (shard, recipe.tp, recipe.pp) else 1
        return cls.resolve(replicate, shard, recipe.tp, recipe.pp, world_size)

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks that see different samples (replicate × shard)."""
        return self.dp_replicate * self.dp_shard

    def check_model(self, num_attention_heads: int, num_key_value_heads: int, num_hidden_layers: int,
                    stages_per_rank: int = 1) -> None:
        """Tensor parallel splits heads; pipeline parallel needs a decoder layer per stage.

        Raises:
            ConfigError: heads or KV heads not divisible by tp; fewer layers than pp stages.
        """
        if num_attention_heads % self.tp or num_key_value_heads % self.tp:
            raise ConfigError(f"recipe.tp={self.tp} must divide the model's attention heads ({num_attention_heads}) "
                              f"and KV heads ({num_key_value_heads})")
        stages = self.pp * stages_per_rank
        if num_hidden_layers < stages:
            raise ConfigError(f"recipe.pp={self.pp} x stages per rank {stages_per_rank} = {stages} pipeline stages "
                              f"but the model has {num_hidden_layers} decoder layers; lower recipe.pp")

    def check_model_config(self, hf_config: Any, stages_per_rank: int = 1) -> None:
        """:meth:`check_model` for a ``transformers`` config (no KV-head count: one per head).

        Raises:
            ConfigError: see :meth:`check_model`.
        """
        heads = hf_config.num_attention_heads
        self.check_model(heads, getattr(hf_config, "num_key_value_heads", None) or heads,
                         hf_config.num_hidden_layers, stages_per_rank)

    def check_microbatches(self, accumulation_steps: int, stages_per_rank: int = 1) -> None:
        """A pipeline needs at least one micro-batch per stage per step; the interleaved
        schedule runs micro-batches in rounds of ``pp``, so their number must be a multiple of
        ``accumulation_steps // pp`` (torch.distributed.pipelining's rule).

        Raises:
            ConfigError: gradient accumulation steps (micro-batches per step) < pp, or not a
                multiple of the interleaved schedule's rounds.
        """
        if self.pp == 1:
            return
        derived = (f"trainer.global_batch_size / (trainer.micro_batch_size x dp={self.dp}) = "
                   f"{accumulation_steps} micro-batches per step")
        if accumulation_steps < self.pp:
            raise ConfigError(f"recipe.pp={self.pp} needs at least {self.pp} micro-batches per step, but "
                              f"{derived}; raise the global batch or lower the micro-batch")
        rounds = max(1, accumulation_steps // self.pp)
        if stages_per_rank > 1 and accumulation_steps % rounds:
            raise ConfigError(f"recipe.pp_schedule=interleaved_1f1b with recipe.pp={self.pp}: {derived}, which "
                              f"is not a multiple of {rounds} rounds; use a multiple of recipe.pp micro-batches")

    @property
    def data_replicas(self) -> int:
        """Ranks that see the same samples (one data-parallel rank's tp x pp group)."""
        return self.tp * self.pp

    def build_mesh(self, device_type: str):
        """The ``DeviceMesh`` over all ranks with dims :data:`MESH_DIMS` (sizes may be 1)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp),
                                mesh_dim_names=MESH_DIMS)
