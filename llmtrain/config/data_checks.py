"""Checks of the ``data`` node (one source or a mixture, streaming or not) that need no file
access, raising :class:`~llmtrain.common.errors.ConfigError` naming the field and the fix; part of
:func:`llmtrain.config.validate.validate`."""

from __future__ import annotations

import math
from typing import Any

from omegaconf import OmegaConf

from llmtrain.common.errors import ConfigError
from llmtrain.common.paths import DOWNLOADS_DOC, PRESET_DOWNLOADS
from llmtrain.config.schema import DATA_FORMATS, FORMAT_COLUMNS, canonical_format, mapped_columns


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


NAMED_TEMPLATES = ("chatml",)


def _validate_source(src: Any, key: str) -> None:
    """Checks of one source (``key`` = ``data`` or ``data.datasets.N``); see :func:`validate_data`."""
    example = PRESET_DOWNLOADS.get(str(src.name))
    _require(not OmegaConf.is_missing(src, "path"),
             f"{key}.path must be set for data={src.name}: add {key}.path=/path/to/your/{src.name} file or folder"
             + (f" (the examples use {example}: download it, see {DOWNLOADS_DOC})" if example else ""))
    _require(src.format in DATA_FORMATS, f"{key}.format={src.format!r} must be one of {', '.join(DATA_FORMATS)}")
    _require(src.path is not None or src.format == "text",
             f"{key}.path must name a file, folder or Hub dataset id when {key}.format={src.format} "
             "(only format=text has a built-in default)")
    _require(src.chat_layout in ("auto", "messages", "sharegpt"),
             f"{key}.chat_layout={src.chat_layout!r} must be auto, messages or sharegpt")
    kind = canonical_format(src.format)
    unknown = sorted(set(mapped_columns(src.columns)) - set(FORMAT_COLUMNS[kind]))
    _require(not unknown, f"{key}.columns: {unknown} are not fields of format {src.format}; it reads "
             f"{', '.join(FORMAT_COLUMNS[kind]) or 'no columns'} (map them as {key}.columns.FIELD=your_column)")


def validate_data(d: Any) -> None:
    """Checks of the ``data`` node (one source or a mixture) that need no file access (a Jinja
    ``data.template`` file is looked for by :func:`llmtrain.planning.preflight.preflight_data`).

    Raises:
        ConfigError: naming the field (``data.datasets.1.path``), its value and the fix.
    """
    if d.datasets:
        _require(len(d.weights) == len(d.datasets),
                 f"data.weights has {len(d.weights)} value(s) for {len(d.datasets)} data.datasets; give one weight "
                 "per dataset")
        _require(all(math.isfinite(w) and w >= 0 for w in d.weights) and sum(d.weights) > 0,
                 f"data.weights={list(d.weights)} must be finite and >= 0 with a positive sum")
        names = [src.name for src in d.datasets]
        _require(len(set(names)) == len(names), f"data.datasets names {names} must be distinct (they name the "
                 "per-source counts data/source/<name>_samples)")
        _require(OmegaConf.is_missing(d, "path") or d.path is None,
                 f"data.path={d.path} is set, but data.datasets lists a mixture ({', '.join(names)}), whose sources "
                 f"read only their own paths, so data.path would be ignored; give each source's instead "
                 f"({', '.join(f'data.datasets.{i}.path=...' for i in range(len(names)))}), or drop data.datasets "
                 "(another data= option) to train on data.path alone")
        for i, src in enumerate(d.datasets):
            _validate_source(src, f"data.datasets.{i}")
    else:
        _require(not d.weights, "data.weights is set but data.datasets is empty; list the mixture's datasets")
        _validate_source(d, "data")
    formats = {src.format for src in d.datasets} if d.datasets else {d.format}
    template = str(d.template)
    _require(template in ("auto", "chat", "alpaca") + NAMED_TEMPLATES or template.endswith((".jinja", ".j2")),
             f"data.template={template!r} must be auto, chat, alpaca, {', '.join(NAMED_TEMPLATES)} or a Jinja file "
             "(*.jinja)")
    _require(d.truncation in ("right", "drop"), f"data.truncation={d.truncation!r} must be right or drop")
    _require(not (d.packing and formats & {"text", "tokens"}),
             "data.packing=true packs variable-length samples (instruction, chat, prompt_completion); text and "
             "tokens are already cut into full blocks: use data.document_masking=true to keep attention inside "
             "each document")
    _require(not (d.document_masking and formats - {"text", "tokens"}),
             f"data.document_masking=true applies to format text/tokens (got {', '.join(sorted(formats))}); "
             "use data.packing=true for the other formats")
    _require(d.seq_len >= 2, f"data.seq_len={d.seq_len} must be at least 2")
    if d.max_prompt_tokens is not None:
        _require(formats <= {"preference", "kto"}, f"data.max_prompt_tokens={d.max_prompt_tokens} applies to "
                 f"preference data (format preference or kto), not {', '.join(sorted(formats))}; drop it")
        _require(0 < d.max_prompt_tokens < d.seq_len, f"data.max_prompt_tokens={d.max_prompt_tokens} must be > 0 and "
                 f"< data.seq_len={d.seq_len} (room for the completion); lower it or raise data.seq_len")
    _require(0.0 < d.val_fraction < 1.0, f"data.val_fraction={d.val_fraction} must be in (0, 1)")
    _require(d.num_proc >= 1, f"data.num_proc={d.num_proc} must be >= 1")
    _require(d.prefetch >= 0, f"data.prefetch={d.prefetch} must be >= 0 (0: read in the step)")
    _require(d.read_timeout_s > 0, f"data.read_timeout_s={d.read_timeout_s} must be > 0 (seconds)")
    if d.streaming:
        _validate_streaming(d, formats)


def _validate_streaming(d: Any, formats: set[str]) -> None:
    """``data.streaming=true``: the formats a stream feeds, and its own settings."""
    streamed = {canonical_format(f) for f in formats}
    _require(streamed <= {"text", "instruction", "chat", "prompt_completion"},
             f"data.streaming=true reads formats text, instruction, chat and prompt_completion (got "
             f"{', '.join(sorted(formats))}); set data.streaming=false (token folders are read block by block anyway)")
    _require(not d.packing, "data.streaming=true does not pack samples (packing needs the whole set); set "
             "data.packing=false")
    sources = list(d.datasets) or [d]
    _require(all(src.max_bytes is None for src in sources), "data.streaming=true reads records or documents, not "
             "bytes: drop data.max_bytes (data.max_records caps the records of a source)")
    _require(d.val_samples >= 1, f"data.val_samples={d.val_samples} must be >= 1 (samples held out per source)")
    _require(d.shuffle_buffer >= 1, f"data.shuffle_buffer={d.shuffle_buffer} must be >= 1")
