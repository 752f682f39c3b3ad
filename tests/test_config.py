"""Every shipped config and recipe composes and validates; bad values fail naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from conftest import make_cfg
from llmtrain.config import ConfigError, validate
from llmtrain.engine.deepspeed_engine import deepspeed_config
from llmtrain.paths import CONF_DIR, RECIPES_DIR



def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


RECIPES = sorted(p.stem for p in Path(RECIPES_DIR).glob("*.yaml"))


def test_shipped_recipes_are_the_documented_set():
    assert RECIPES == ["ddp", "zero1", "zero2", "zero3", "zero3_offload"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("world_size", [1, 2])
def test_every_recipe_composes_and_validates(recipe, world_size):
    cfg = make_cfg([f"+recipe={recipe}"])
    assert cfg.recipe.name == recipe
    validate(cfg, world_size)


@pytest.mark.parametrize("group", ["model", "data", "trainer", "tracker"])
def test_every_group_option_composes_and_validates(group):
    options = group_options(group)
    assert options, f"no options in conf/{group}"
    for option in options:
        overrides = [f"{group}={option}"]
        if group == "data" and make_cfg(overrides).data.name in ("tinyshakespeare", "alpaca"):
            overrides.append("data.path=/some/file")  # these ship without a path: the user's copy
        validate(make_cfg(overrides), 1)


@pytest.mark.parametrize("option", ["tinyshakespeare", "alpaca"])
def test_data_without_a_path_asks_for_one(option):
    with pytest.raises(ConfigError, match=f"data.path must be set for data={option}"):
        validate(make_cfg([f"data={option}"]), 1)


def test_default_run_is_plain_torch_and_names_run_dir():
    cfg = make_cfg([])
    assert (cfg.recipe.engine, cfg.recipe.zero_stage) == ("torch", 0)
    assert cfg.run_dir == "runs/tiny_llama-stdlib-auto"


def test_unknown_recipe_fails_at_compose():
    with pytest.raises(Exception, match="recipe/zero9"):
        make_cfg(["+recipe=zero9"])


def test_wrong_type_fails_at_compose_naming_the_key():
    with pytest.raises(ConfigCompositionException, match=r"trainer\.max_steps=many"):
        make_cfg(["trainer.max_steps=many"])


def test_unknown_key_fails_at_compose_naming_the_key():
    with pytest.raises(ConfigCompositionException, match=r"trainer\.max_stepz"):
        make_cfg(["trainer.max_stepz=3"])


@pytest.mark.parametrize("overrides,world_size,needle", [
    (["trainer.global_batch_size=10", "trainer.micro_batch_size=4"], 1, "trainer.global_batch_size=10"),
    (["trainer.global_batch_size=16", "trainer.micro_batch_size=8"], 4, "data-parallel size=4"),
    (["trainer.precision=fp16"], 1, "trainer.precision"),
    (["+recipe=zero2", "recipe.offload_params=true"], 1, "recipe.offload_params"),
    (["+recipe=ddp", "recipe.zero_stage=2"], 1, "recipe.engine=deepspeed"),
    (["data.val_fraction=0"], 1, "data.val_fraction"),
    (["model.source=pretrained"], 1, "model.path"),
    (["tracker.wandb_mode=sometimes"], 1, "tracker.wandb_mode"),
])
def test_cross_field_errors_name_the_fields(overrides, world_size, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("=", "=")):
        validate(make_cfg(overrides), world_size)


@pytest.mark.parametrize("recipe,stage,offload", [("zero1", 1, False), ("zero2", 2, False),
                                                   ("zero3", 3, False), ("zero3_offload", 3, True)])
def test_deepspeed_config_is_generated_from_recipe_and_trainer(recipe, stage, offload):
    cfg = make_cfg([f"+recipe={recipe}", "trainer.global_batch_size=32", "trainer.micro_batch_size=4",
                    "trainer.grad_clip=0.5", "trainer.precision=bf16"])
    ds = deepspeed_config(cfg, world_size=2, accumulation_steps=4)
    assert ds["train_batch_size"] == 32
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": True}
    assert ds["zero_optimization"]["stage"] == stage
    assert ("offload_optimizer" in ds["zero_optimization"]) == offload
    assert ("offload_param" in ds["zero_optimization"]) == offload
    assert ("optimizer" in ds) == offload
    assert "auto" not in repr(ds)
