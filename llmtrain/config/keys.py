"""Which dotted keys the schema has: whether a key is in it, its default, where a key is free-form
(``model.architecture``, ``data.columns``), and the closest key for a typo, so an unknown key is
a one-line error naming it (:class:`~llmtrain.common.errors.ConfigError`)."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from omegaconf import OmegaConf

from llmtrain.config.schema import Config
from llmtrain.common.errors import ConfigError


def is_schema_key(dotted_key: str) -> bool:
    """Whether ``dotted_key`` (``trainer.lr``) names a field of :class:`Config`, or lies inside a
    field that is not a dataclass (``model.architecture.rope_theta``: free-form mappings take any
    key). The same notion of the schema as :func:`check_known_keys`, for plain dicts."""
    return _schema_hint(dotted_key, through_containers=False) is not _NOT_IN_SCHEMA


_NOT_IN_SCHEMA = object()
_FREE_FORM = object()


def _schema_hint(dotted_key: str, through_containers: bool) -> Any:
    """The type hint of the :class:`Config` field ``dotted_key`` names; :data:`_FREE_FORM` when
    the key lies inside a field that is not a dataclass, :data:`_NOT_IN_SCHEMA` when a part is
    no field. ``through_containers``: also step through ``Optional[X]`` and list indexes
    (``data.datasets.0.name``) and return the bare hint; otherwise such a field counts as
    free-form (as :func:`check_known_keys` sees plain dicts)."""
    return _walk_schema(dotted_key, through_containers)[0]


def _walk_schema(dotted_key: str, through_containers: bool) -> tuple[Any, int, list[str]]:
    """:func:`_schema_hint`'s walk: ``(hint, depth, fields)``, where for :data:`_NOT_IN_SCHEMA`
    ``depth`` is the index of the first part that is no field and ``fields`` are the fields of
    the node that lacks it (for the error naming the closest); otherwise ``(hint, -1, [])``."""
    def bare(hint: Any) -> Any:  # Optional[X] -> X
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint

    schema: Any = Config
    for depth, part in enumerate(dotted_key.split(".")):
        if through_containers:
            schema = bare(schema)
            if typing.get_origin(schema) is list and part.isdigit():
                schema = typing.get_args(schema)[0]
                continue
        if not dataclasses.is_dataclass(schema):
            return _FREE_FORM, -1, []
        hints = typing.get_type_hints(schema)
        if part not in hints:
            return _NOT_IN_SCHEMA, depth, list(hints)
        schema = hints[part]
    return (bare(schema) if through_containers else schema), -1, []


_NO_DEFAULT = object()


def schema_default(dotted_key: str) -> Any:
    """The schema's default of ``dotted_key`` (``data.packing`` -> False), as plain data; a
    sentinel when the key has no default of its own (inside a free-form mapping or a list)."""
    node: Any = OmegaConf.structured(Config)
    for part in dotted_key.split("."):
        if not OmegaConf.is_dict(node) or node._is_none() or part not in node or OmegaConf.get_type(node) is dict:
            return _NO_DEFAULT  # free-form, or an optional group left out (peft: None)
        node = node._get_node(part)
        if OmegaConf.is_config(node):
            continue
        if node._is_missing():
            return _NO_DEFAULT
        node = node._value()
    return OmegaConf.to_container(node) if OmegaConf.is_config(node) else node


def added_at_default(dotted_key: str, value: Any) -> bool:
    """Whether ``dotted_key`` = ``value`` is a field at its schema default (used when a checkpoint
    predates the field: the default reproduces what that run did)."""
    default = schema_default(dotted_key)
    return default is not _NO_DEFAULT and default == value


def check_known_keys(node: Any, prefix: str = "") -> None:
    """Refuse keys that are not fields of the typed schema, however they were added.

    Hydra's struct mode already rejects ``trainer.max_step=10``, but ``+key=value``, ``++key=value``
    and a config file merged with ``+`` open the node and add the key, which would then be
    stored in ``config.yaml`` and silently ignored. Free-form mappings (``model.architecture``,
    ``model.tp_plan``) are not checked: they are passed on to ``transformers``.

    Raises:
        ConfigError: naming the unknown key and the closest field.
    """
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    fields = [f.name for f in dataclasses.fields(schema)]
    for key in node.keys():
        path = f"{prefix}{key}"
        if key not in fields:
            raise _unknown_key(path, prefix, fields)
        if OmegaConf.is_config(node._get_node(key)):
            check_known_keys(node[key], f"{path}.")


def _unknown_key(path: str, prefix: str, fields: list[str]) -> ConfigError:
    """The error for ``path``, not a field of the schema node at ``prefix`` (``trainer.``), with
    the closest of ``fields``."""
    key = path[len(prefix):]
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.5)
    owner = f"a field of {prefix.rstrip('.')}" if prefix else "a top-level field"
    hint = f"did you mean {prefix}{close[0]}?" if close else f"the fields are {', '.join(fields)}."
    return ConfigError(f"{path} is not {owner}: {hint} Fix or remove it "
                       "(`python -m llmtrain --help` lists the groups and fields)")
