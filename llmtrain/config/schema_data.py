"""The data group of the run's config schema (``data.*``: sources, formats, columns, mixtures,
streaming): dataclasses registered through :mod:`llmtrain.config.schema`, which re-exports them,
and the names a data field may take. Imports nothing of llmtrain."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING


DATA_FORMATS = ("text", "instruction", "alpaca", "chat", "prompt_completion", "tokens", "preference", "kto", "prompts")
# Older spellings of a format: same records, same samples.
FORMAT_ALIASES = {"alpaca": "instruction"}


def canonical_format(fmt: str) -> str:
    """``data.format`` with aliases resolved (``alpaca`` -> ``instruction``)."""
    return FORMAT_ALIASES.get(fmt, fmt)
# Record fields each format reads; data.columns maps them to a file's own column names.
FORMAT_COLUMNS = {
    "text": ("text",),
    "instruction": ("instruction", "input", "output"),
    "chat": ("messages", "conversations", "images"),  # images: paths of TRL's vision layout
    "prompt_completion": ("prompt", "completion"),
    "tokens": (),
    "preference": ("prompt", "chosen", "rejected", "margin", "images"),  # images: TRL's VLM DPO layout
    "kto": ("prompt", "completion", "label"),
    "prompts": ("prompt", "answer"),  # answer: the reference the gsm8k reward reads (optional)
}


@dataclass
class ColumnsConfig:
    """The file's column for each field a format reads (null: the field's own name), e.g.
    ``data.columns.text=content`` or ``data.columns.messages=dialog``."""

    text: Optional[str] = None
    instruction: Optional[str] = None
    input: Optional[str] = None
    output: Optional[str] = None
    messages: Optional[str] = None
    conversations: Optional[str] = None
    prompt: Optional[str] = None
    completion: Optional[str] = None
    chosen: Optional[str] = None
    rejected: Optional[str] = None
    margin: Optional[str] = None
    label: Optional[str] = None
    answer: Optional[str] = None  # format prompts: the reference answers (reward gsm8k)
    images: Optional[str] = None  # format chat: each record's images (paths, bytes, ...: llmtrain.data.image_refs)


def mapped_columns(columns: Any) -> dict[str, str]:
    """``{field: column}`` for the fields a source maps (``columns`` as config node or dict)."""
    items = columns.items() if hasattr(columns, "items") else vars(columns).items()
    return {k: v for k, v in items if v is not None}


@dataclass
class DataSourceConfig:
    """One dataset: where its records come from and how to read them (see :class:`DataConfig`)."""

    name: str = MISSING
    format: str = "text"
    path: Optional[str] = MISSING
    glob: str = "**/*.py"
    subset: Optional[str] = None
    split: str = "train"
    revision: Optional[str] = None
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    chat_layout: str = "auto"
    max_bytes: Optional[int] = None
    max_records: Optional[int] = None


@dataclass
class DataConfig(DataSourceConfig):
    """Training data, read through ``datasets``.

    Sources (``path``): a local file or folder of ``.json``/``.jsonl``/``.parquet``/``.csv``/
    ``.txt``/``.arrow`` files (``glob`` picks files in a folder), a folder written by
    ``Dataset.save_to_disk``, or a Hugging Face Hub dataset id with ``subset``, ``split`` and
    ``revision`` (needs network, or the dataset in the ``datasets`` cache), or any of these but a
    Hub id as an ``s3://BUCKET/KEY`` URL (``llmtrain[s3]``, docs/object-storage.md). ``columns`` maps the
    fields a format reads to the file's names (``columns: {text: content}``). ``text`` with
    ``path: null`` reads the Python standard library's own source files (on every machine).

    ``format``:
      * ``text``: documents tokenized, joined with EOS and cut into blocks of ``seq_len`` tokens
        (``document_masking``: attention and positions restart at each document).
      * ``instruction`` (alias ``alpaca``): {instruction, input, output} records; the response
        and its end token are trained, the prompt is not. ``template``: ``chat``/``auto`` (the
        tokenizer's chat template when it has one), ``alpaca`` (the Stanford Alpaca prompt), or
        a named template / Jinja file as for ``chat``.
      * ``chat``: one conversation per record, OpenAI ``messages`` (role/content) or ShareGPT
        ``conversations`` (from/value), told apart by ``chat_layout`` (``auto``, ``messages``,
        ``sharegpt``). Rendered with the chat template; every assistant turn and its end-of-turn
        token are trained. ``template``: ``auto`` (the tokenizer's), ``chatml`` (a built-in
        template) or a path to a Jinja file.
      * ``prompt_completion``: {prompt, completion}; the completion and EOS are trained.
      * ``preference``: preference pairs for ``objective=dpo|simpo|orpo|reward``, TRL's layouts:
        {prompt, chosen, rejected} as strings or message lists (rendered with the chat
        template), or implicit prompts ({chosen, rejected} only; the prompt is their shared
        prefix, as in Anthropic HH-RLHF); optional ``margin`` (reward models). Each sequence
        (prompt + completion + EOS) is at most ``seq_len`` tokens: a prompt over
        ``max_prompt_tokens`` keeps its last tokens, then completions are cut from the right;
        pairs left without a completion token are dropped and counted. Loss on completions only.
      * ``kto``: unpaired examples for ``objective=kto``: {prompt, completion, label} (strings or
        message lists; ``label`` a boolean: desirable or not), TRL's unpaired layout, truncated
        as pairs are. ``objective=kto`` also reads ``preference`` pairs, each as a desirable
        (chosen) and an undesirable (rejected) example.
      * ``tokens``: a folder written by ``python -m llmtrain.prepare`` (read by block from disk).
    ``truncation``: a sample longer than ``seq_len`` is cut (``right``) or dropped (``drop``); a
    sample left without target tokens is dropped either way. ``packing``: several samples share
    one row of ``seq_len`` tokens, with positions restarting and attention kept inside each.
    Mixtures: ``datasets`` (a list of sources) with ``weights``; each global sample index draws
    its source from the weights and ``trainer.seed``.
    ``max_bytes`` caps the raw text read from plain-text files at that many bytes in all (null:
    all; the file the cap falls in is cut at a character boundary; record files are read whole
    until their sizes reach it); ``max_records`` caps records per source. A mixture's sources read
    only their own ``data.datasets.N.path`` (a top-level ``data.path`` is refused).
    ``val_fraction`` of the samples (at least one) is held out for validation, chosen by the seed.
    ``num_proc``: processes for tokenization (``datasets.map``).
    ``prefetch``: micro-batches read ahead of the step by a background thread (0: read in the
    step); the samples and their order do not depend on it.
    ``streaming``: read the sources as streams (``datasets`` streaming; formats text, instruction,
    chat, prompt_completion) instead of whole (:mod:`llmtrain.data.streaming`, docs/object-storage.md):
    the first ``val_samples`` samples of each source are held out for validation (``val_fraction``
    is not read), the rest are shuffled by a seeded buffer of ``shuffle_buffer`` samples
    (``shuffle=false``: file order); a resume continues at the next sample on any number of ranks.
    ``read_timeout_s``: how long a request to object storage waits for an answer before it counts
    as a fault (retried with backoff, ``data/retries``; a store that stays down ends the run in one
    error naming the last checkpoint).
    ``max_pixels``/``min_pixels``: the pixel budget of each image for a model with dynamic
    resolution (Qwen2-VL: an image keeps its aspect ratio and is resized to at most ``max_pixels``
    and at least ``min_pixels`` pixels, in multiples of its patch and merge size; more pixels, more
    image tokens); null: the processor's own. Refused for an image processor of fixed size.
    """

    name: str = MISSING
    seq_len: int = 256
    val_fraction: float = 0.05
    template: str = "auto"
    truncation: str = "right"
    packing: bool = False
    document_masking: bool = False
    shuffle: bool = True
    num_proc: int = 1
    prefetch: int = 4
    streaming: bool = False
    shuffle_buffer: int = 1000
    val_samples: int = 16
    read_timeout_s: float = 30.0
    max_prompt_tokens: Optional[int] = None
    max_pixels: Optional[int] = None
    min_pixels: Optional[int] = None
    datasets: List[DataSourceConfig] = field(default_factory=list)
    weights: List[float] = field(default_factory=list)
