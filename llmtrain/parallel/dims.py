"""Parallel degrees and the device mesh of the torch-native engine.

One object holds the data-parallel (replicate × shard), tensor-parallel and pipeline-parallel
degrees before any model is built, in the spirit of torchtitan's ``ParallelDims``; they are
derived and checked once, by the pure :func:`llmtrain.config.layout.layout` that
:func:`llmtrain.config.validate.validate` returns (``ParallelDims.from_layout``). It adds the checks that
need the model's shape (every failure names the fields, their values and the fix) and builds the
``DeviceMesh`` (dims ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, outermost first, so
a tensor-parallel group, then a context-parallel group, is made of neighbouring ranks, i.e. one
node where possible; torchtitan's order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmtrain.common.errors import ConfigError
from llmtrain.config.layout import Layout, check_microbatches, context_parallel_degree, recipe_degrees, resolve_degrees

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees whose product is the world size. ``-1`` in at most one field means "whatever is
    left of the world size". Field names match the recipe keys they will come from."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    cp: int = 1
    ep: int = 1

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int, tp: int, pp: int, world_size: int) -> "ParallelDims":
        """Fill in a ``-1`` degree and check that the product equals ``world_size``
        (:func:`llmtrain.config.layout.resolve_degrees`).

        Raises:
            ConfigError: a degree < 1 other than -1, more than one -1, a world size not divisible
                by the fixed degrees, or a product different from the world size.
        """
        return cls(*resolve_degrees(dp_replicate, dp_shard, tp, pp, world_size), world_size)

    @classmethod
    def from_layout(cls, layout: Layout) -> "ParallelDims":
        """The degrees of a :class:`~llmtrain.config.layout.Layout` (what :func:`llmtrain.config.validate.validate`
        returns); nothing is checked again."""
        return cls(layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp, layout.world_size, layout.cp, layout.ep)

    @classmethod
    def from_recipe(cls, recipe: Any, world_size: int) -> "ParallelDims":
        """Degrees of ``recipe`` on ``world_size`` ranks (:func:`llmtrain.config.layout.recipe_degrees`):
        unset data-parallel degrees follow the ZeRO stage: stage 0 replicates, stages 1-3 shard;
        the DeepSpeed engine shards (or, at stage 0, replicates) over every rank.

        Raises:
            ConfigError: see :meth:`resolve`.
        """
        return cls(*recipe_degrees(recipe, world_size), world_size, context_parallel_degree(recipe, world_size))

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
        schedule needs a multiple of its rounds (:func:`llmtrain.config.layout.check_microbatches`).

        Raises:
            ConfigError: gradient accumulation steps (micro-batches per step) < pp, or not a
                multiple of the interleaved schedule's rounds.
        """
        check_microbatches(self.pp, self.dp, accumulation_steps, stages_per_rank)

    @property
    def data_replicas(self) -> int:
        """Ranks that see the same samples (one data-parallel rank's tp x pp x cp group)."""
        return self.tp * self.pp * self.cp

    @property
    def dp_cp(self) -> int:
        """Ranks FSDP2 shards over (data-parallel x context-parallel, as torchtitan: the cp ranks of
        a sample each hold part of its gradient, so they take part in its reduction)."""
        return self.dp * self.cp

    def build_mesh(self, device_type: str):
        """The ``DeviceMesh`` over all ranks with dims :data:`MESH_DIMS` (sizes may be 1)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                                mesh_dim_names=MESH_DIMS)
