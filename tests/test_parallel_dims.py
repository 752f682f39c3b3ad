"""ParallelDims: degree derivation and every invalid case, with the fields and values named."""

from __future__ import annotations

import pytest

from llmtrain.common.errors import ConfigError
from llmtrain.parallel.dims import ParallelDims


@pytest.mark.parametrize("degrees,world,expected", [
    ((1, -1, 1, 1), 4, (1, 4, 1, 1)),
    ((2, -1, 2, 1), 8, (2, 2, 2, 1)),
    ((1, 1, 2, -1), 4, (1, 1, 2, 2)),
    ((1, 2, 2, 2), 8, (1, 2, 2, 2)),
])
def test_derives_the_free_degree(degrees, world, expected):
    dims = ParallelDims.resolve(*degrees, world_size=world)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp) == expected
    assert dims.dp == expected[0] * expected[1]


@pytest.mark.parametrize("degrees,world,needles", [
    ((1, 1, 2, 1), 4, ["recipe.tp=2", "= 2 but the world size is 4"]),
    ((1, -1, 3, 1), 4, ["world size 4 is not divisible", "recipe.tp=3"]),
    ((-1, -1, 1, 1), 4, ["only one degree may be -1", "recipe.dp_replicate=-1", "recipe.dp_shard=-1"]),
    ((1, 0, 1, 1), 1, ["recipe.dp_shard=0", "must be >= 1"]),
])
def test_invalid_degrees_name_fields_and_values(degrees, world, needles):
    with pytest.raises(ConfigError) as err:
        ParallelDims.resolve(*degrees, world_size=world)
    for needle in needles:
        assert needle in str(err.value)


def test_model_checks_name_the_numbers():
    dims = ParallelDims.resolve(1, 1, 2, 2, world_size=4)
    dims.check_model(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)
    with pytest.raises(ConfigError, match=r"recipe.tp=2 must divide the model's attention heads \(4\) and KV heads \(1\)"):
        dims.check_model(num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=4)
    with pytest.raises(ConfigError, match="4 pipeline stages but the model has 3 decoder layers"):
        dims.check_model(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, stages_per_rank=2)


def test_pipeline_needs_a_micro_batch_per_stage():
    dims = ParallelDims.resolve(1, 1, 1, 4, world_size=4)
    dims.check_microbatches(4)
    with pytest.raises(ConfigError, match="recipe.pp=4 needs at least 4 micro-batches per step.*= 2"):
        dims.check_microbatches(2)
