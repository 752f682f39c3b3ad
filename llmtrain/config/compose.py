"""Composition: the primary config, its groups and ``recipes/`` composed by Hydra, in-process
(:func:`compose`) as on the command line, and the checks of the command line before Hydra parses
it (:func:`check_overrides`: unknown keys and options named with the closest one;
:func:`keep_typed_strings`: string fields keep what was typed).

Recipes are YAML files in the top-level ``recipes/`` folder; :func:`register_configs` stores each
one as an option of the Hydra group ``recipe``, typed by
:class:`~llmtrain.config.schema.RecipeConfig`, so ``+recipe=zero3`` works whether llmtrain runs
from a checkout or from an installed wheel."""

from __future__ import annotations

import copy
import re
import typing
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from llmtrain.config.keys import _NOT_IN_SCHEMA, _schema_hint, _unknown_key, _walk_schema
from llmtrain.config.schema import Config, RecipeConfig
from llmtrain.common.errors import ConfigError, did_you_mean
from llmtrain.common.paths import RECIPES_DIR


# The recipe files (name, mtime, size) the ConfigStore holds, or None before the first register.
_registered: Optional[tuple] = None


def register_configs() -> None:
    """Store the schema as ``base_config`` and every ``recipes/*.yaml`` as group ``recipe``.

    Raises:
        ConfigError: a recipe file has an unknown key or a value of the wrong type (the message
            names the file and the key).
    """
    global _registered
    files = sorted(Path(RECIPES_DIR).glob("*.yaml"))
    # Building the schema and 13 recipes takes 0.5 s, and a process that composes many runs (a
    # sweep's in-process jobs, the test scenarios) would pay it at each: the store is kept for as
    # long as the recipe files are those it was built from (a recipe edited, added or removed
    # since: built again).
    stamp = tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    cs = ConfigStore.instance()
    if stamp == _registered and "base_config.yaml" in cs.repo:
        return
    cs.store(name="base_config", node=Config)
    for recipe_file in files:
        cs.store(group="recipe", name=recipe_file.stem, node=load_recipe(recipe_file.stem))
    _registered = stamp


def compose(overrides: list[str]) -> Any:
    """The run config of ``python -m llmtrain OVERRIDES``, composed in-process with Hydra's
    compose API (the same primary config, groups and recipes as the command line)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from llmtrain.common.paths import CONF_DIR

    register_configs()
    check_overrides(list(overrides))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return hydra_compose(config_name="config", overrides=keep_typed_strings(list(overrides)))


def _string_field(dotted_key: str) -> Optional[str]:
    """``"str"`` when ``dotted_key`` names a string field of :class:`Config` (``name``,
    ``data.path``, ``data.datasets.0.name``, ``tracker.run_name``), ``"list"`` for a list of
    strings (``tracker.tags``), else None."""
    hint = _schema_hint(dotted_key, through_containers=True)
    if hint is str:
        return "str"
    return "list" if typing.get_origin(hint) is list and typing.get_args(hint) == (str,) else None


def keep_typed_strings(overrides: list[str]) -> list[str]:
    """Overrides of string fields quoted where Hydra would read the value as something else, so
    the field keeps the characters typed.

    Hydra's override grammar reads an unquoted ``1_1_1`` as the integer 111, ``1e3`` as the float
    1000.0 and ``true`` as a boolean before OmegaConf turns them into the strings ``'111'``,
    ``'1000.0'``, ``'True'`` (Hydra issue #999): ``name=1_1_1`` would train in ``runs/111``. Such a
    value of a string field (or an element of a list of strings, or of a ``a,b`` sweep) is
    quoted as typed: ``name=1_1_1`` becomes ``name='1_1_1'``. Every other override is unchanged.

    Raises:
        ConfigError: a value of a string field that Hydra reads as a number, inside a form this
            cannot split safely (``choice(...)``, quotes or brackets inside a list); the message
            asks for quotes.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, ValueType

    def retyped(value: Any) -> bool:
        return isinstance(value, (bool, int, float))

    def refuse(arg: str, key: str, values: list) -> None:
        example = next(str(v) for v in values if retyped(v))
        raise ConfigError(f"{arg}: {key} takes strings, but Hydra reads unquoted values such as 1_1 or 1e3 as numbers "
                          f"(here one becomes {example}); quote each string value, e.g. {key}='1_1' (in a shell, "
                          f"wrap the whole override in double quotes: \"{key}='1_1'\")")

    def quoted_pieces(arg: str, key: str, text: str, values: list) -> str:
        pieces = [p.strip() for p in text.split(",")]
        if len(pieces) != len(values) or any(c in text for c in "'\"[]{}()$\\"):
            refuse(arg, key, values)
        return ",".join(f"'{p}'" if retyped(v) else p for p, v in zip(pieces, values))

    parser = OverridesParser.create()
    kept = []
    for arg in overrides:
        match = re.fullmatch(r"(\+{0,2})([A-Za-z_][\w.-]*)=(.*)", arg, re.S)
        kind = _string_field(match.group(2)) if match else None
        if kind is None:
            kept.append(arg)
            continue
        prefix, key, text = match.group(1), match.group(2), match.group(3).strip()
        try:
            override = parser.parse_override(arg)
        except Exception:  # noqa: BLE001  (malformed: Hydra reports it while composing)
            kept.append(arg)
            continue
        value = override.value()
        if override.value_type == ValueType.ELEMENT and retyped(value):
            arg = f"{prefix}{key}='{text}'"
        elif kind == "list" and override.value_type == ValueType.ELEMENT and isinstance(value, list) \
                and any(map(retyped, value)):
            if not (text.startswith("[") and text.endswith("]")):
                refuse(arg, key, value)
            arg = f"{prefix}{key}=[{quoted_pieces(arg, key, text[1:-1], value)}]"
        elif isinstance(value, ChoiceSweep) and any(map(retyped, value.list)):
            if override.value_type != ValueType.SIMPLE_CHOICE_SWEEP:  # choice(...): refused, not parsed here
                refuse(arg, key, value.list)
            arg = f"{prefix}{key}={quoted_pieces(arg, key, text, value.list)}"
        kept.append(arg)
    return kept


def load_recipe(name: str) -> Any:
    """The ``recipe`` node of ``recipes/<name>.yaml`` over the :class:`RecipeConfig` schema, as
    ``+recipe=<name>`` composes it: its engine and name are interpolations that honour a
    top-level ``engine=``.

    Raises:
        ConfigError: no such recipe, or the file has an unknown key or a value of the wrong type
            (the message names the file and the key).
    """
    recipe_file = Path(RECIPES_DIR) / f"{name}.yaml"
    if not recipe_file.is_file():
        known = ", ".join(sorted(p.stem for p in Path(RECIPES_DIR).glob("*.yaml")))
        raise ConfigError(f"no recipe {name!r} in {RECIPES_DIR}; the recipes are {known}")
    # The planner reads each recipe hundreds of times (+recipe=auto tries every layout): the
    # schema merge is kept per file version, and each caller gets its own copy to change.
    stat = recipe_file.stat()
    key = (name, stat.st_mtime_ns, stat.st_size)
    if key not in _recipe_nodes:
        _recipe_nodes[key] = _read_recipe(recipe_file)
    return copy.deepcopy(_recipe_nodes[key])


# Recipe nodes read (name, mtime, size) -> node; load_recipe hands out copies.
_recipe_nodes: dict[tuple, Any] = {}


def _read_recipe(recipe_file: Path) -> Any:
    """:func:`load_recipe`'s node, read from ``recipe_file``."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        node = OmegaConf.merge(OmegaConf.structured(RecipeConfig), OmegaConf.load(recipe_file))
    except OmegaConfBaseException as err:
        raise ConfigError(f"recipe file {recipe_file}: {err}".replace("\n", " ")) from err
    engine = OmegaConf.to_container(node, resolve=True)["engine"]
    node.engine = f"${{recipe_engine:{engine}}}"
    node.name = f"${{recipe_name:{node._get_node('name')._value()},{engine}}}"
    return node


def config_groups() -> dict[str, list[str]]:
    """Every config group and its options: the folders of ``conf/`` and ``recipe`` (the files of
    ``recipes/``), e.g. ``{"data": ["alpaca", "chat", ...], "recipe": ["3d", "auto", ...]}``."""
    from llmtrain.common.paths import CONF_DIR

    groups = {d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in Path(CONF_DIR).iterdir() if d.is_dir()}
    groups["recipe"] = sorted(f.stem for f in Path(RECIPES_DIR).glob("*.yaml"))
    return groups


def check_overrides(args: list[str]) -> None:
    """Check command-line overrides against the schema and the config groups before Hydra
    composes, so that a misspelt field (``trainer.max_step=10``, ``data.colums.text=content``)
    or option (``data=alpacca``, ``+recipe=zero4``) gets one line naming the closest one, as
    :func:`check_known_keys` gives for ``+key=value``, instead of Hydra's composition error and
    its advice to append with ``+``. Hydra's own flags (``--cfg job``), ``hydra.*`` and
    ``hydra/...`` overrides, deletions (``~key``) and keys inside free-form mappings
    (``model.architecture.*``) pass through; malformed overrides are left to Hydra's parser.

    Raises:
        ConfigError: naming the override and the closest field or option.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    parser = OverridesParser.create()
    overrides = []
    for arg in args:
        if arg.startswith("-") or "=" not in arg or arg.startswith("~"):
            continue
        try:
            overrides.append((arg, parser.parse_override(arg)))
        except Exception:  # noqa: BLE001  (malformed: Hydra's parser reports it, with its grammar)
            _check_one_override_each(arg)
            continue
    groups = config_groups()
    if any(a in ("--config-dir", "-cd") or a.startswith("--config-dir=") for a in args):
        groups = {}  # options from a folder of the user's: Hydra names what it cannot find
    for _, override in overrides:  # hydra.searchpath=[file://DIR]: DIR's groups add options
        if override.key_or_group != "hydra.searchpath":
            continue
        entries = override.value() or []
        for entry in entries if isinstance(entries, list) else [entries]:
            if not str(entry).startswith("file://"):
                groups = {}  # pkg:// and the like: not read here
                break
            for folder in Path(str(entry)[len("file://"):]).glob("*/"):
                groups[folder.name] = sorted(set(groups.get(folder.name, [])) | {f.stem for f in folder.glob("*.yaml")})
    selected: dict[str, list[tuple[str, Any]]] = {}
    for arg, override in overrides:
        key = override.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")) or override.package is not None:
            continue
        if key in groups:
            selected.setdefault(key, []).append((arg, override))
            value = override.value()
            if not isinstance(value, (str, ChoiceSweep)) or (isinstance(value, ChoiceSweep) and
                                                            not all(isinstance(v, str) for v in value.list)):
                continue  # glob(...), range(...), null: Hydra expands or refuses them
            chosen = value.list if isinstance(value, ChoiceSweep) else [value]
            for option in chosen:
                if option is not None and str(option) not in groups[key]:
                    raise ConfigError(f"{arg}: {option!r} is not an option of group {key}: "
                                      f"{did_you_mean(str(option), groups[key])}the options are "
                                      f"{', '.join(groups[key])} (`python -m llmtrain --help` lists every group)")
            continue
        # Through Optional and list elements (data.datasets.0.path); keys inside a free-form
        # mapping (model.architecture.*) are the user's.
        for dotted in [*_dict_keys(key, override.value()), key]:  # the key last: its hint is checked below
            hint, depth, fields = _walk_schema(dotted, through_containers=True)
            if hint is _NOT_IN_SCHEMA:
                parts = dotted.split(".")
                prefix = ".".join(parts[:depth])
                raise _unknown_key(".".join(parts[:depth + 1]), f"{prefix}." if prefix else "", fields)
        _check_scalar_type(arg, key, hint, override)
        _check_list_type(arg, key, hint, override)
    if groups and not any(a in ("--config-name", "-cn") or a.startswith("--config-name=") for a in args):
        # (another primary config has other defaults)
        _check_group_selections(selected, deleted={a[1:].split("=")[0] for a in args if a.startswith("~")})
    for arg, override in overrides:
        if override.key_or_group.startswith("peft.") and "peft" not in selected:
            raise ConfigError(f"{arg}: no peft method is selected; add +peft=lora (the fields are those of "
                              "conf/peft/lora.yaml)")


def _default_options() -> dict[str, str]:
    """The groups the primary config (``conf/config.yaml``) selects by default and their options
    (``{"model": "tiny_llama", "data": "stdlib", ...}``); peft and recipe have none."""
    from llmtrain.common.paths import CONF_DIR

    entries = OmegaConf.load(Path(CONF_DIR) / "config.yaml").get("defaults", [])
    return {k: str(v) for e in entries if OmegaConf.is_dict(e) for k, v in e.items() if "/" not in k
            and not k.startswith("override")}


def _check_group_selections(selected: dict[str, list[tuple[str, Any]]], deleted: set[str]) -> None:
    """How each group of ``conf/`` is selected, where Hydra would stop with its own multi-line
    error (exit status 1): a group given twice with ``+`` in either ("Multiple values for peft"),
    ``+GROUP=X`` for a group the primary config already selects, ``GROUP=X`` for one it does not
    ("Could not override"). A group given twice without ``+`` is Hydra's override of an
    override (the last wins) and stays allowed; ``deleted``: groups removed with ``~GROUP``, which
    ``+GROUP=X`` may then add again.

    Raises:
        ConfigError: naming the overrides as typed and the one to give.
    """
    from hydra.core.override_parser.types import OverrideType

    defaults = _default_options()
    for key, chosen in selected.items():
        if key == "recipe":  # selected with +recipe=NAME, checked by __main__.check_recipe_selection
            continue
        typed = [arg for arg, _ in chosen]
        values = {str(o.value()) for _, o in chosen}
        added = [arg for arg, o in chosen if o.type == OverrideType.ADD]
        if len(chosen) > 1 and added:
            qlora = " (+peft=qlora is +peft=lora with model.quantize=nf4)" if {"lora", "qlora"} <= values else ""
            raise ConfigError(f"the {key} group is given {len(chosen)} times ({', '.join(typed)}); give one of them"
                              f"{qlora}")
        arg, override = chosen[0]
        if override.type == OverrideType.ADD and key in defaults and key not in deleted:
            raise ConfigError(f"{arg}: the {key} group already has an option ({key}={defaults[key]}, the default); "
                              f"choose another without '+': {arg[1:]}")
        if override.type == OverrideType.CHANGE and key not in defaults:
            raise ConfigError(f"{arg}: the {key} group has no default to override; select it with +{arg}")


def _dict_keys(key: str, value: Any) -> list[str]:
    """The dotted keys a mapping value sets under ``key`` (``model.lr_multipliers={tower:2}``:
    ``model.lr_multipliers.tower``), nested mappings included, so a typo inside one is named as a
    typo of a field is (Hydra's own error for it is multi-line, exit status 1)."""
    if not isinstance(value, dict):
        return []
    out = []
    for name, inner in value.items():
        out += [f"{key}.{name}", *_dict_keys(f"{key}.{name}", inner)]
    return out


_SCALAR_KINDS = {int: "a whole number", float: "a number", bool: "true or false"}


def _check_scalar_type(arg: str, key: str, hint: Any, override: Any) -> None:
    """A value of an int, float or bool field that OmegaConf would refuse while Hydra composes
    (``trainer.max_steps=ten``: Hydra's multi-line error, exit status 1), as one line. Sweeps
    check each value; interpolations and other sweeps (range, glob) are left to Hydra.

    Raises:
        ConfigError: naming the override, the field's type and the value.
    """
    from hydra.core.override_parser.types import ChoiceSweep, Sweep
    from omegaconf import ValidationError
    from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode

    node = {int: IntegerNode, float: FloatNode, bool: BooleanNode}.get(hint)
    if node is None:
        return
    value = override.value()
    if isinstance(value, Sweep) and not isinstance(value, ChoiceSweep):
        return
    for one in value.list if isinstance(value, ChoiceSweep) else [value]:
        if one is None or (isinstance(one, str) and "${" in one):
            continue  # null where the field allows it, or an interpolation: Hydra resolves them
        try:
            node(value=one)
        except ValidationError:
            raise ConfigError(f"{arg}: {key} takes {_SCALAR_KINDS[hint]}, not {one!r}") from None


def _check_one_override_each(arg: str) -> None:
    """An argument Hydra cannot parse that holds several overrides (a whole command quoted as
    one: ``"trainer.lr=1e-3 trainer.max_steps=5"``), which Hydra's parser would answer with its
    grammar error ("mismatched input '='", exit status 1), as one line asking to split it.

    Raises:
        ConfigError: the argument has a space followed by ``key=``.
    """
    if re.search(r"\s(\+{0,2}|~)[A-Za-z_][\w.@/-]*=", arg):
        parts = " ".join(arg.split())
        raise ConfigError(f"{arg!r} is one argument holding several overrides; give each as its own argument "
                          f"(no quotes around the whole): python -m llmtrain {parts}")


def _check_list_type(arg: str, key: str, hint: Any, override: Any) -> None:
    """A single value given to a list field (``reward.functions=gsm8k``, brackets forgotten), which
    OmegaConf would refuse while Hydra composes ("str is not a ListConfig", exit status 1), as
    one line showing the list form; elements of a list of numbers are checked as numbers. Sweeps
    check each value; null, interpolations and other sweeps are left to Hydra.

    Raises:
        ConfigError: naming the override, the field and the value as a list.
    """
    from hydra.core.override_parser.types import ChoiceSweep, Sweep
    from omegaconf import ValidationError
    from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode

    if typing.get_origin(hint) is not list:
        return
    value = override.value()
    if isinstance(value, Sweep) and not isinstance(value, ChoiceSweep):
        return
    element = typing.get_args(hint)[0]
    node = {int: IntegerNode, float: FloatNode, bool: BooleanNode}.get(element)
    for one in value.list if isinstance(value, ChoiceSweep) else [value]:
        if one is None or (isinstance(one, str) and "${" in one):
            continue  # null where the field allows it, or an interpolation: Hydra resolves them
        if not isinstance(one, list):
            typed = arg.split("=", 1)[1]
            sweep = (f" (a sweep over lists, with -m: {key}={','.join(f'[{v}]' for v in value.list)})"
                     if isinstance(value, ChoiceSweep) else "")
            raise ConfigError(f"{key} takes a list: {key}=[{typed}]{sweep}")
        for item in one if node is not None else []:
            if isinstance(item, str) and "${" in item:
                continue
            try:
                node(value=item)
            except ValidationError:
                raise ConfigError(f"{arg}: {key} takes a list of {_LIST_KINDS[element]}, not {item!r}") from None


_LIST_KINDS = {int: "whole numbers", float: "numbers", bool: "true or false values"}


def run_dir_of(cfg: Any) -> Path:
    """The folder a run writes to: ``cfg.run_dir``, or under ``-m`` the sweep job's own folder
    (``hydra.sweep.dir/hydra.sweep.subdir``, which Hydra resolves per job)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return Path(HydraConfig.get().runtime.output_dir)  # one folder per sweep job
    return Path(cfg.run_dir)
